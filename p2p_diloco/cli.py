"""``p2p-diloco``: the one command, with subcommands ``bootstrap``, ``peer``, ``status``, ``dashboard``,
``fetch-assets`` and those the lab registers (``chaos``, :func:`lab_commands`).

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
from p2p_diloco.flags import add_config_arguments, build_config

EPILOG = """examples:
  p2p-diloco bootstrap --host-maddrs /ip4/0.0.0.0/tcp/31337 --identity-path bootstrap.key
  p2p-diloco peer --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW... --run-id demo --island island-0
  p2p-diloco status --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW... --run-id demo --watch
  p2p-diloco dashboard --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW... --run-id demo --port 8080
  p2p-diloco prepare-data --data corpus.jsonl --out corpus.tokens
"""

# name -> (help, description) of the product's subcommands; each takes its configuration's fields as flags
COMMANDS = {
    "bootstrap": ("run a long-lived DHT peer that islands join through",
                  "Run a DHT-only bootstrap peer. Its first stdout line is INITIAL_PEERS=<maddr>...; the identity "
                  "key is created on first run and reused, so the peer id survives restarts."),
    "peer": ("join a run as an island (one model replica) and train",
             "Join a run as an island: train a model replica on this island's data shard and exchange outer "
             "updates with the swarm, one fragment at a time. Every config field is a flag; a TOML file "
             "(--config) sets them too, flags win."),
    "status": ("show a run's live islands and swarm totals",
               "Show a run's live islands (from their signed DHT records) and swarm totals."),
    "dashboard": ("serve a live web page, /api/status and /metrics of a run",
                  "Serve a run's live dashboard (islands, swarm totals, loss and tokens/s charts), its JSON "
                  "(/api/status) and Prometheus metrics (/metrics), from the islands' signed DHT records only. "
                  "Its first stdout line is DASHBOARD=<url>. Needs no GPU and holds no model."),
    "identity": ("create (or show) a peer's identity key and write its public key",
                 "Create the libp2p identity key at PATH on first use (mode 0600) and write PATH.pub, the public "
                 "key a private run's operator certifies (`p2p-diloco authority admit PATH.pub ...`)."),
    "authority": ("a private run's authority: init, admit, revoke",
                  "Run a private run's authority (docs/DEPLOY.md): `init` writes the key pair, `admit` signs a "
                  "peer's certificate, `revoke` adds certificates to the signed revocation list that the run's "
                  "peers publish (effective within one record TTL). Keep authority.key off the swarm's machines."),
    "prepare-data": ("tokenize a corpus once into memory-mapped token files",
                     "Tokenize a corpus (text, jsonl, parquet, arrow or a saved datasets folder), streaming it, into "
                     "a token folder (train.bin, eval.bin, tokenizer.json, meta.json) that islands train on with "
                     "--data OUT without holding the corpus in memory."),
    "fetch-assets": ("download the dashboard's charting library (uPlot) once",
                     "Download the pinned uPlot release from the npm registry (or read it from --from FILE.tgz on "
                     "a machine without internet), check its SHA-512 and install its files as package data."),
}


def build_parser(peer_config: type = config_lib.PeerConfig) -> argparse.ArgumentParser:
    """The ``p2p-diloco`` argument parser: one subcommand per role, one flag per config field
    (``peer_config``: the island's configuration class; the lab passes one with its fault flags)."""
    parser = argparse.ArgumentParser(prog="p2p-diloco", description="Peer-to-peer Decoupled DiLoCo on hivemind.",
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    lab = lab_commands()
    commands = parser.add_subparsers(dest="command", metavar="{" + ",".join([*COMMANDS, *lab]) + "}", required=True)
    configs = {"peer": peer_config, **ROLE_CONFIGS}
    for name, (help_line, description) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_line, description=description)
        if name == "peer":
            sub.add_argument("--config", default="", metavar="FILE.toml", help="TOML file with config fields")
        if name in configs:
            add_config_arguments(sub, configs[name])
        if name == "identity":
            sub.add_argument("path", metavar="PATH", help="the identity key file (created if missing)")
        if name == "authority":
            _authority_arguments(sub)
        if name == "fetch-assets":
            sub.add_argument("--from", dest="source", default=None, metavar="FILE.tgz",
                             help="a local copy of the uplot tarball instead of the registry")
        sub.add_argument("-v", "--verbose", action="store_true", help="debug logs, including hivemind's")
    for name, command in lab.items():  # the lab's, e.g. chaos (without importing the lab)
        sub = commands.add_parser(name, help=command.help, description=command.description)
        command.add_arguments(sub)
        sub.set_defaults(lab_command=command)
        sub.add_argument("-v", "--verbose", action="store_true", help="debug logs, including hivemind's")
    return parser


def _authority_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="{init,admit,revoke}", required=True)
    init = actions.add_parser("init", help="write authority.key (mode 0600) and authority.pub")
    init.add_argument("--dir", default=".", help="folder for the key pair (default: here)")
    admit = actions.add_parser("admit", help="sign a certificate for a peer's public key")
    admit.add_argument("public_key", metavar="PEER.pub", help="the peer's public key (from `p2p-diloco identity`)")
    admit.add_argument("--island", required=True, help="the name the peer is admitted under")
    admit.add_argument("--role", default="island", choices=["island", "observer", "bootstrap"],
                       help="island: trains and averages; observer: reads the records; bootstrap: serves the DHT")
    admit.add_argument("--run-id", default="*", help="the run it admits to (default *: every run of this authority)")
    admit.add_argument("--days", type=float, default=30.0, help="validity in days (default 30)")
    admit.add_argument("--out", required=True, metavar="FILE", help="where to write the certificate")
    revoke = actions.add_parser("revoke", help="add certificates to the signed revocation list")
    revoke.add_argument("certificates", nargs="+", metavar="CERT", help="certificate files or serials to revoke")
    revoke.add_argument("--revocations", default="revocations.json", metavar="FILE",
                        help="the revocation list to update (created if missing; default revocations.json)")
    for sub in (admit, revoke):
        sub.add_argument("--authority-key", default="authority.key", metavar="FILE",
                         help="the authority's private key (default authority.key)")


def lab_commands() -> dict:
    """The subcommands the lab registers as entry points of the group ``p2p_diloco.commands`` (name ->
    an object with ``help``, ``description``, ``add_arguments(parser)`` and ``run(args, stop) -> exit
    code``): the CLI runs them without importing the lab. Empty where the package is not installed."""
    from importlib.metadata import entry_points

    return {ep.name: ep.load() for ep in sorted(entry_points(group="p2p_diloco.commands"), key=lambda ep: ep.name)}


def setup_logging(verbose: bool) -> None:
    """Logs go to stderr (stdout stays machine-readable); hivemind's own chatter only with -v."""
    from p2p_diloco.net.dht import quiet_hivemind

    quiet_hivemind(verbose)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    rank = f"[rank {os.environ['RANK']}] " if "LOCAL_RANK" in os.environ and "RANK" in os.environ else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s {rank}%(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("p2p_diloco").setLevel(logging.DEBUG if verbose else logging.INFO)


# the roles besides ``peer`` (main's ``peer_config``) whose flags make a pydantic configuration
ROLE_CONFIGS = {"bootstrap": config_lib.BootstrapConfig, "status": config_lib.StatusConfig,
                "dashboard": config_lib.DashboardConfig, "prepare-data": config_lib.PrepareDataConfig}

_ISLAND_RAN = False  # set once an island ran in this process (see run())


def run(argv: Optional[Sequence[str]] = None, **island: object) -> None:
    """Console entry point: :func:`main`, then exit. After an island, the process ends with
    ``os._exit`` once logs are flushed: everything it started is already shut down explicitly, and
    the interpreter's own teardown can abort in C++ destructors (torch's thread pools) while a
    daemon thread still holds them ("terminate called without an active exception", exit 134)."""
    code = main(argv, **island)
    if _ISLAND_RAN:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: Optional[Sequence[str]] = None, *, peer_config: type = config_lib.PeerConfig,
         builder: Optional[type] = None, entry: str = "p2p_diloco") -> int:
    """Entry point of ``p2p-diloco``; returns the exit code (0 ok, 1 helper died, 2 config/data,
    3 network, 4 fingerprint, 130 interrupted).

    :param peer_config: the configuration class of ``peer`` (a subclass of PeerConfig)
    :param builder: the island's :class:`~p2p_diloco.island.builder.IslandBuilder` class (default: the
        product's; the lab passes one that injects faults)
    :param entry: the module torchrun runs each rank of ``peer --nproc-per-node N`` with (``python -m``)
    """
    args = build_parser(peer_config).parse_args(argv)
    role_config = None
    if getattr(args, "lab_command", None) is None:
        try:  # before hivemind and torch load (seconds): a bad flag or config file shows at once
            if args.command == "peer":
                role_config = build_config(peer_config, args, args.config)
            elif args.command in ROLE_CONFIGS:
                role_config = build_config(ROLE_CONFIGS[args.command], args)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code
        if args.command == "peer" and role_config.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
            # one island of N ranks: torchrun starts them, each with these flags, and our signals go
            # to them (docs/DESIGN.md, "Islands of many ranks")
            from p2p_diloco.island.ranks import torchrun_argv
            from p2p_diloco.procs import run_launcher

            return run_launcher(torchrun_argv(role_config.nproc_per_node,
                                              list(argv) if argv is not None else sys.argv[1:],
                                              role_config.max_restarts, module=entry))
    setup_logging(args.verbose)
    from p2p_diloco.procs import StopSignal, exit_with_parent, install_child_hooks

    install_child_hooks()
    stop = StopSignal().install()
    if os.environ.get("P2P_DILOCO_EXIT_WITH_PARENT"):
        exit_with_parent(stop)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` prints every thread's stack (debugging a hang)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        if getattr(args, "lab_command", None) is not None:
            return args.lab_command.run(args, stop)
        if args.command == "peer":
            return run_island(role_config, stop, builder)
        run_role(args, stop, role_config)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


def run_role(args: argparse.Namespace, stop, config=None) -> None:
    """``bootstrap``, ``status``, ``dashboard`` (``config``: its validated configuration, of the class
    :data:`ROLE_CONFIGS` names), or ``identity``, ``authority``, ``fetch-assets`` (no ``config``).

    :raises UserError: bad flags, unreachable peers, a taken port
    """
    if args.command == "bootstrap":
        from p2p_diloco.observe.bootstrap import run_bootstrap

        run_bootstrap(config, stop)
    elif args.command == "status":
        from p2p_diloco.observe.status import run_status

        run_status(config, stop)
    elif args.command == "dashboard":
        from p2p_diloco.observe.dashboard import run_dashboard

        run_dashboard(config, stop)
    elif args.command == "prepare-data":
        prepare_data(config)
    elif args.command in ("identity", "authority"):
        from p2p_diloco import admin

        admin.run(args)
    elif args.command == "fetch-assets":
        from p2p_diloco.observe import assets

        written = assets.fetch(args.source)
        print(f"{len(written)} files written to {assets.VENDOR}" if written else f"already in {assets.VENDOR}")


def prepare_data(config: config_lib.PrepareDataConfig) -> None:
    """``prepare-data``: :func:`~p2p_diloco.island.data.prepare_corpus` with a progress bar (on stderr)
    over the corpus's characters; prints the folder's counts.

    :raises UserError: bad input, an existing or unwritable ``--out``
    """
    import time
    from pathlib import Path

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from p2p_diloco.island import data as data_lib

    source = Path(config.data).expanduser()
    total = None
    if config.data and source.is_file():
        total = source.stat().st_size
    elif config.data and source.is_dir():
        total = sum(f.stat().st_size for f in source.rglob("*") if f.suffix in data_lib.TEXT_SUFFIXES and f.is_file())
    started = time.time()
    with Progress(TextColumn("tokenizing"), BarColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                  transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task("tokenize", total=total or None)
        meta = data_lib.prepare_corpus(config.data, config.out, tokenizer_path=config.tokenizer, model_dir=config.model,
                                       vocab_size=config.vocab_size, eval_fraction=config.eval_fraction,
                                       progress=lambda chars: bar.advance(task, chars))
    print(f"wrote {config.out}: {meta['train_tokens']:,} training and {meta['eval_tokens']:,} held-out tokens "
          f"({meta['dtype']}) of {meta['num_docs']:,} documents in {time.time() - started:.1f} s; "
          f"train with --data {config.out}")


def run_island(config: config_lib.PeerConfig, stop, builder: Optional[type] = None) -> int:
    """``peer``: one island until a limit or a signal; logs its summary's headline. Returns the exit
    code (1 when a helper process died).

    :raises UserError: bad input, unreachable peers, a refused fingerprint, an early interruption
    """
    from p2p_diloco.island.builder import run_peer

    global _ISLAND_RAN
    _ISLAND_RAN = True
    summary = run_peer(config, stop, builder)
    if not summary:
        return 0
    log = logging.getLogger("p2p_diloco")
    log.info("summary: %d steps, %.2fM tokens, eval loss %s -> %s, rounds %d ok / %d failed, utilization %.3f",
             summary["inner_steps"], summary["tokens"] / 1e6, _fmt(summary["eval_loss_first"]),
             _fmt(summary["eval_loss_last"]), summary["outer_rounds_ok"], summary["outer_rounds_failed"],
             summary["compute_utilization"])
    log.info("bandwidth: %s bytes/token sent (data-parallel: %s, %sx fewer), peak %s bytes per inner step",
             _fmt(summary["bytes_per_token"]), _fmt(summary["dp_bytes_per_token"]), _fmt(summary["reduction_vs_dp"]),
             f"{summary['peak_bytes_per_inner_step']:,}")
    return 1 if summary["stop_reason"] == "helper_died" else 0


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
