"""The observer: a table (or JSON) of a run's live islands, from their signed DHT records only."""

from __future__ import annotations

import json
import time

from p2p_diloco.net.dht import ensure_identity, parse_maddrs, start_dht
from p2p_diloco.net.gate import load_admission
from p2p_diloco.config import StatusConfig
from p2p_diloco.errors import ConfigError
from p2p_diloco.procs import StopSignal
from p2p_diloco.net.records import IslandProgress, ProgressBoard, finite_or_none, make_validators


# the "network" column: how the island takes part in rounds (docs/DESIGN.md, "Islands behind NAT")
NETWORK = {"public": "public", "nat": "NAT (client)", "client": "client", "unknown": "?"}


def island_row(record: IslandProgress, now: float) -> dict:
    """One island of ``status --json``: its record (non-finite numbers as null), ``last_seen_s`` and
    ``bytes_per_token`` (bytes sent / tokens trained)."""
    return ({k: finite_or_none(v) for k, v in record.dict().items()}
            | {"last_seen_s": round(max(0.0, now - record.time), 2),
               "bytes_per_token": round(record.bytes_sent / record.tokens, 3) if record.tokens else None})


def swarm_snapshot(records: list[IslandProgress], run_id: str, now: float | None = None) -> dict:
    """The JSON view of ``status --json``: every live island's record plus swarm totals (non-finite
    numbers become null)."""
    now = time.time() if now is None else now
    islands = [island_row(r, now) for r in records]
    tokens = sum(r.tokens for r in records)
    training = [r for r in records if r.state == "training"]
    totals = {
        "islands": len(records),
        "training": len(training),
        "tokens": tokens,
        "tokens_per_second": round(sum(finite_or_none(r.tokens_per_second) or 0.0 for r in training), 2),
        "rounds_ok": sum(r.rounds_ok for r in records),
        "rounds_failed": sum(r.rounds_failed for r in records),
        "mean_utilization": round(sum(r.utilization for r in training) / len(training), 4) if training else None,
        "bytes_sent": sum(r.bytes_sent for r in records),
        "bytes_per_token": round(sum(r.bytes_sent for r in records) / tokens, 3) if tokens else None,
        "peak_bytes_per_step": max((r.peak_bytes_per_step for r in records), default=0),
        "flagged": sorted({name for r in records for name in r.flagged}),
        "flag_reasons": flag_reasons(records),  # flagged island -> why (what its flaggers caught)
        "refused": len({peer for r in records for peer in r.refused}),  # peers refused admission
        "max_clock_offset": round(max((abs(r.clock_offset) for r in records), default=0.0), 3),  # seconds
        "behind_nat": sum(r.reachability == "nat" for r in records),  # client-mode members nobody can dial
    }
    return {"run_id": run_id, "time": now, "islands": islands, "totals": totals}


def flag_reasons(records: list[IslandProgress]) -> dict[str, str]:
    """Each flagged island -> why, as the islands that caught it say (``garbage``, ``outlier``; several
    joined by '/'); ``adopted`` only when every island that flagged it took the others' word."""
    reasons: dict[str, set] = {}
    for record in records:
        for name in record.flagged:
            reasons.setdefault(name, set()).add(record.flag_reasons.get(name, "garbage"))
    return {name: "/".join(sorted(found - {"adopted"}) or ["adopted"]) for name, found in sorted(reasons.items())}


def _with_reason(name: str, reasons: dict) -> str:
    return f"{name} ({reasons[name]})" if name in reasons else name


def render_table(snapshot: dict):
    """A rich Table of a :func:`swarm_snapshot`."""
    from rich.table import Table

    def fmt(value, pattern="{:.3f}"):
        return "-" if value is None else pattern.format(value)

    totals = snapshot["totals"]
    reasons = totals.get("flag_reasons", {})
    flagged = (f"; flagged as faulty: {', '.join(_with_reason(name, reasons) for name in totals['flagged'])}"
               if totals["flagged"] else "")
    flagged += f"; {totals['refused']} peers refused admission" if totals.get("refused") else ""
    table = Table(
        title=f"run {snapshot['run_id']}: {totals['islands']} islands, {totals['tokens'] / 1e6:.2f}M tokens, "
        f"{totals['tokens_per_second']:,.0f} tok/s, rounds {totals['rounds_ok']} ok/{totals['rounds_failed']} failed, "
        f"{fmt(totals['bytes_per_token'], '{:,.1f}')} bytes/token sent{flagged}",
        title_justify="left",
    )
    for column in ("island", "peer id", "device", "state", "step", "tokens", "tok/s", "loss", "eval",
                   "versions", "rounds ok/failed", "util", "bytes/tok", "peak B/step", "clock", "network", "last seen",
                   "flagged"):
        table.add_column(column, justify="left" if column in ("island", "peer id", "device", "state", "flagged")
                         else "right")
    for r in snapshot["islands"]:
        table.add_row(
            r["island"], "…" + r["peer_id"][-8:], r["device"], r["state"], str(r["inner_step"]),
            f"{r['tokens'] / 1e6:.2f}M", f"{r['tokens_per_second']:,.0f}", fmt(r["loss"]), fmt(r["eval_loss"]),
            ",".join(map(str, r["fragment_versions"])), f"{r['rounds_ok']}/{r['rounds_failed']}",
            f"{r['utilization']:.3f}", fmt(r["bytes_per_token"], "{:,.1f}"), f"{r['peak_bytes_per_step']:,}",
            f"{r.get('clock_offset') or 0.0:+.2f}s", NETWORK.get(r.get("reachability"), "?"), f"{r['last_seen_s']:.0f}s",
            ", ".join(_with_reason(name, {name: r.get("flag_reasons", {}).get(name, "garbage")}) for name in r["flagged"])
            or "-",
        )
    return table


def check_initial_peers(config) -> list:
    """The observer's parsed ``--initial-peers``.

    :raises ConfigError: none given, or a malformed multiaddr"""
    if not config.initial_peers:
        raise ConfigError("--initial-peers is required: the address of any live peer (e.g. the bootstrap node)")
    return parse_maddrs(config.initial_peers, what="--initial-peers", need_peer_id=True)


def join_as_observer(config, peers: list, stop: StopSignal) -> tuple:
    """Start a client-mode DHT (it stores nothing, serves nothing) that validates the run's records;
    returns (dht, the run's :class:`ProgressBoard`). ``config``: a Status or Dashboard config;
    ``peers``: :func:`check_initial_peers`'s.

    :raises UserError: unreachable peers, an interruption while joining, a private run's bad credentials
    """
    identity = ensure_identity(config.identity_path) if config.identity_path else ""
    admission = load_admission(config.admission, identity_path=identity, run_id=config.run_id, role=None, where="")
    validators, public_key = make_validators(config.run_id)
    dht = start_dht(
        initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True, identity_path=identity,
        record_validators=validators, join_timeout=config.join_timeout, stop_event=stop.event,
        authorizer=admission.authorizer() if admission else None,
    )
    return dht, ProgressBoard(dht, config.run_id, public_key)


def run_status(config: StatusConfig, stop: StopSignal) -> None:
    """Print the run's status once, or refresh it every ``interval`` seconds with ``--watch``."""
    dht, board = join_as_observer(config, check_initial_peers(config), stop)
    try:
        if config.watch and not config.json_output:
            from rich.live import Live

            with Live(render_table(swarm_snapshot(board.read(), config.run_id)), refresh_per_second=1) as live:
                while not stop.event.wait(config.interval):
                    live.update(render_table(swarm_snapshot(board.read(), config.run_id)))
            return
        while True:
            snapshot = swarm_snapshot(board.read(), config.run_id)
            if config.json_output:
                print(json.dumps(snapshot), flush=True)
            else:
                from rich.console import Console

                console = Console()
                if not console.is_terminal:
                    console.width = max(console.width, 160)
                console.print(render_table(snapshot))
            if not config.watch or stop.event.wait(config.interval):
                break
    finally:
        dht.shutdown()
