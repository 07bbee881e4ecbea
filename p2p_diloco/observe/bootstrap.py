"""The bootstrap node: a long-lived DHT peer with a persistent identity that islands join through.

It holds no model; with ``--dashboard-port`` it also serves the run's dashboard (its second stdout
line is then ``DASHBOARD=<url>``). Its first line on stdout is ``INITIAL_PEERS=<maddr>[ <maddr>...]`` so scripts can
read its addresses without parsing logs (hivemind's ``run_dht`` works the same way).
"""

from __future__ import annotations

import logging
import sys
import time

from p2p_diloco.net.dht import check_listen_ports, count_connected_peers, ensure_identity, parse_maddrs, start_dht, visible_maddrs
from p2p_diloco.config import BootstrapConfig
from p2p_diloco.procs import StopSignal
from p2p_diloco.net.gate import dht_refusals, load_admission
from p2p_diloco.net.records import ProgressBoard, make_validators
from p2p_diloco.net.reachability import serve_dial_back

logger = logging.getLogger(__name__)
ADMISSION_PERIOD = 2.0  # seconds between a private run's chores (revocation list, certificate)


def swarm_summary(dht, board: ProgressBoard | None, run_id: str, private: bool = False) -> str:
    """One line: connected peers (and refused ones, in a private run), and the run's live islands
    when a run id is known."""
    line = f"swarm: {count_connected_peers(dht)} peers connected"
    if private:
        line += f", {len(dht_refusals(dht))} refused"
    if board is not None:
        records = [r for r in board.read() if r.state != "stopping"]
        tokens = sum(r.tokens for r in records)
        speed = sum(r.tokens_per_second for r in records)
        line += f"; run {run_id}: {len(records)} islands, {tokens / 1e6:.2f}M tokens, {speed:,.0f} tok/s"
    return line


def run_bootstrap(config: BootstrapConfig, stop: StopSignal) -> None:
    """Serve the DHT until SIGINT/SIGTERM.

    :raises UserError: malformed multiaddrs, a port in use, an unreadable identity, dead initial peers,
        missing dashboard files
    """
    peers = parse_maddrs(config.initial_peers, what="--initial-peers", need_peer_id=True)
    parse_maddrs(config.host_maddrs, what="--host-maddrs", need_peer_id=False)
    parse_maddrs(config.announce_maddrs, what="--announce-maddrs", need_peer_id=False)
    check_listen_ports(config.host_maddrs)
    identity = ensure_identity(config.identity_path)
    admission = load_admission(config.admission, identity_path=identity, run_id=config.run_id, role="bootstrap",
                               where="bootstrap")
    dashboard = None
    if config.dashboard_port is not None:  # its port is taken before anything starts
        from p2p_diloco.observe.dashboard import Dashboard

        dashboard = Dashboard(config.run_id, host=config.dashboard_host, port=config.dashboard_port,
                              flag="--dashboard-port")
    validators, public_key = make_validators(config.run_id) if config.run_id else ([], b"")
    dht = None
    try:
        dht = start_dht(
            initial_peers=peers, host_maddrs=config.host_maddrs, announce_maddrs=config.announce_maddrs,
            identity_path=identity, record_validators=validators, stop_event=stop.event,
            authorizer=admission.authorizer() if admission else None,
        )
        serve_dial_back(dht)  # joining islands ask whether they can be dialled (p2p_diloco.net.reachability)
        print("INITIAL_PEERS=" + " ".join(visible_maddrs(dht)), flush=True)
        logger.info("bootstrap peer %s is up (identity %s)", dht.peer_id, identity)
        board = ProgressBoard(dht, config.run_id, public_key) if config.run_id else None
        if dashboard is not None:
            dashboard.start(board)
            print(f"DASHBOARD={dashboard.url}", flush=True)
            logger.info("dashboard of run %s at %s", config.run_id, dashboard.url)
        last_summary = time.monotonic()
        period = min(ADMISSION_PERIOD, config.summary_period) if admission is not None else config.summary_period
        while not stop.event.wait(period):
            if admission is not None:
                admission.tick(dht, ttl=3 * ADMISSION_PERIOD)
            if time.monotonic() - last_summary >= config.summary_period:
                last_summary = time.monotonic()
                logger.info(swarm_summary(dht, board, config.run_id, private=admission is not None))
    finally:
        if dashboard is not None:
            dashboard.close()  # before the DHT: its poller reads through it
        if dht is not None:
            logger.info("shutting down")
            dht.shutdown()
        sys.stdout.flush()
