"""``p2p-diloco``: the one command, with subcommands ``bootstrap``, ``peer``, ``status``, ``dashboard``,
``fetch-assets`` and ``chaos``.

User mistakes print ``error: <what and how to fix>`` on stderr and exit non-zero, without a traceback.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from typing import Optional, Sequence

from p2p_diloco import config as config_lib
from p2p_diloco.errors import UserError

EPILOG = """examples:
  p2p-diloco bootstrap --host-maddrs /ip4/0.0.0.0/tcp/31337 --identity-path bootstrap.key
  p2p-diloco peer --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW... --run-id demo --island island-0
  p2p-diloco status --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW... --run-id demo --watch
  p2p-diloco dashboard --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW... --run-id demo --port 8080
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``p2p-diloco`` argument parser: one subcommand per role, one flag per config field."""
    parser = argparse.ArgumentParser(
        prog="p2p-diloco",
        description="Peer-to-peer Decoupled DiLoCo on hivemind.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="{bootstrap,peer,status,dashboard,fetch-assets,chaos}", required=True)

    bootstrap = commands.add_parser(
        "bootstrap", help="run a long-lived DHT peer that islands join through",
        description="Run a DHT-only bootstrap peer. Its first stdout line is INITIAL_PEERS=<maddr>...; "
        "the identity key is created on first run and reused, so the peer id survives restarts.",
    )
    config_lib.add_config_arguments(bootstrap, config_lib.BootstrapConfig)

    peer = commands.add_parser(
        "peer", help="join a run as an island (one model replica) and train",
        description="Join a run as an island: train a model replica on this island's data shard and "
        "exchange outer updates with the swarm, one fragment at a time. Every config field is a flag; "
        "a TOML file (--config) sets them too, flags win.",
    )
    peer.add_argument("--config", default="", metavar="FILE.toml", help="TOML file with config fields")
    config_lib.add_config_arguments(peer, config_lib.PeerConfig)

    status = commands.add_parser(
        "status", help="show a run's live islands and swarm totals",
        description="Show a run's live islands (from their signed DHT records) and swarm totals.",
    )
    config_lib.add_config_arguments(status, config_lib.StatusConfig)

    dashboard = commands.add_parser(
        "dashboard", help="serve a live web page, /api/status and /metrics of a run",
        description="Serve a run's live dashboard (islands, swarm totals, loss and tokens/s charts), its JSON "
        "(/api/status) and Prometheus metrics (/metrics), from the islands' signed DHT records only. Its first "
        "stdout line is DASHBOARD=<url>. Needs no GPU and holds no model.",
    )
    config_lib.add_config_arguments(dashboard, config_lib.DashboardConfig)

    fetch = commands.add_parser(
        "fetch-assets", help="download the dashboard's charting library (uPlot) once",
        description="Download the pinned uPlot release from the npm registry (or read it from --from FILE.tgz on "
        "a machine without internet), check its SHA-512 and install its files as package data.",
    )
    fetch.add_argument("--from", dest="source", default=None, metavar="FILE.tgz",
                       help="a local copy of the uplot tarball instead of the registry")

    chaos = commands.add_parser(
        "chaos", help="run a local swarm with scheduled faults and report what they cost",
        description="Start a bootstrap node and islands on 127.0.0.1 (or in network namespaces), inject "
        "the schedule's faults (kill and restart, freeze, bootstrap death, a donor killed mid-download, a "
        "faulty island, cut or throttled links) and write report.json (goodput, utilization, global "
        "downtime, stall per failure, time to rejoin) and timeline.png to the output folder.",
    )
    chaos.add_argument("--schedule", default="", metavar="FILE", help="a TOML or YAML schedule (see docs/CHAOS.md)")
    chaos.add_argument("--out", default="", metavar="DIR", help="output folder (default: runs/chaos-<timestamp>)")
    chaos.add_argument("--islands", type=int, metavar="N", help="override the schedule's number of islands")
    chaos.add_argument("--minutes", type=float, metavar="X", help="override the schedule's measured minutes")
    chaos.add_argument("--reanalyze", default="", metavar="DIR",
                       help="recompute report.json and timeline.png of a finished run folder, then exit")

    for sub in (bootstrap, peer, status, dashboard, fetch, chaos):
        sub.add_argument("-v", "--verbose", action="store_true", help="debug logs, including hivemind's")
    return parser


def setup_logging(verbose: bool) -> None:
    """Logs go to stderr (stdout stays machine-readable); hivemind's own chatter only with -v."""
    from p2p_diloco.transport import quiet_hivemind

    quiet_hivemind(verbose)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("p2p_diloco").setLevel(logging.DEBUG if verbose else logging.INFO)


_ISLAND_RAN = False  # set once an island ran in this process (see run())


def run(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point: :func:`main`, then exit. After an island, the process ends with
    ``os._exit`` once logs are flushed: everything it started is already shut down explicitly, and
    the interpreter's own teardown can abort in C++ destructors (torch's thread pools) while a
    daemon thread still holds them ("terminate called without an active exception", exit 134)."""
    code = main(argv)
    if _ISLAND_RAN:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``p2p-diloco``; returns the exit code (0 ok, 1 helper died, 2 config/data,
    3 network, 4 fingerprint, 130 interrupted)."""
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    from p2p_diloco.procs import StopSignal, exit_with_parent, install_child_hooks

    install_child_hooks()
    stop = StopSignal().install()
    if os.environ.get("P2P_DILOCO_EXIT_WITH_PARENT"):
        exit_with_parent(stop)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` prints every thread's stack (debugging a hang)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        if args.command == "bootstrap":
            from p2p_diloco.bootstrap import run_bootstrap

            run_bootstrap(config_lib.build_config(config_lib.BootstrapConfig, args), stop)
        elif args.command == "status":
            from p2p_diloco.status import run_status

            run_status(config_lib.build_config(config_lib.StatusConfig, args), stop)
        elif args.command == "dashboard":
            from p2p_diloco.dashboard import run_dashboard

            run_dashboard(config_lib.build_config(config_lib.DashboardConfig, args), stop)
        elif args.command == "fetch-assets":
            from p2p_diloco import assets

            written = assets.fetch(args.source)
            print(f"{len(written)} files written to {assets.VENDOR}" if written else f"already in {assets.VENDOR}")
        elif args.command == "chaos":
            return run_chaos(args, stop)
        else:
            from p2p_diloco.island import run_peer

            global _ISLAND_RAN
            _ISLAND_RAN = True
            summary = run_peer(config_lib.build_config(config_lib.PeerConfig, args, args.config), stop)
            if summary and summary["stop_reason"] == "helper_died":
                return 1
            if summary:
                logging.getLogger("p2p_diloco").info(
                    "summary: %d steps, %.2fM tokens, eval loss %s -> %s, rounds %d ok / %d failed, utilization %.3f",
                    summary["inner_steps"], summary["tokens"] / 1e6, _fmt(summary["eval_loss_first"]),
                    _fmt(summary["eval_loss_last"]), summary["outer_rounds_ok"], summary["outer_rounds_failed"],
                    summary["compute_utilization"],
                )
                logging.getLogger("p2p_diloco").info(
                    "bandwidth: %s bytes/token sent (data-parallel: %s, %sx fewer), peak %s bytes per inner step",
                    _fmt(summary["bytes_per_token"]), _fmt(summary["dp_bytes_per_token"]),
                    _fmt(summary["reduction_vs_dp"]), f"{summary['peak_bytes_per_inner_step']:,}",
                )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


def run_chaos(args: argparse.Namespace, stop) -> int:
    """``p2p-diloco chaos``: run a schedule and print its headline figures."""
    import time

    from p2p_diloco.chaos import ChaosConfig, ChaosRun, load_schedule, reanalyze

    if args.reanalyze:
        _print_chaos_figures(reanalyze(args.reanalyze)["figures"], args.reanalyze)
        return 0
    config = load_schedule(args.schedule) if args.schedule else ChaosConfig()
    overrides = {key: value for key, value in (("islands", args.islands), ("minutes", args.minutes)) if value}
    if overrides:
        config = ChaosConfig.model_validate(config.model_dump() | overrides)
    out = args.out or f"runs/chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    run = ChaosRun(config, out, stop.event)
    try:
        report = run.run()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        run.close()
    _print_chaos_figures(report["figures"], out)
    return 130 if stop.event.is_set() else 0


def _print_chaos_figures(figures: dict, out: str) -> None:
    rejoins = [r["seconds"] for r in figures["rejoin"]]
    print(f"goodput {figures['goodput']:.3f}, alive utilization {figures['alive_utilization']:.3f} "
          f"(ready {figures['ready_utilization']:.3f}), global downtime {figures['global_downtime_seconds']:.1f} s, "
          f"stall per failure median {figures['stall_seconds_median']} s / max {figures['stall_seconds_max']} s, "
          f"rejoin {rejoins} s; report in {out}/report.json")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
