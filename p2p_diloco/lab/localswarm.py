"""Start and stop a swarm of real processes on this machine: a bootstrap node and islands on
127.0.0.1 (or in network namespaces, see :mod:`p2p_diloco.lab.netns`). Used by the demo, the tests,
chaos runs, experiments and benchmarks; every process it starts is tracked by PID and ended by
:meth:`LocalSwarm.close`.

Every island's flags are parsed into a validated :class:`~p2p_diloco.lab.faults.LabPeerConfig` here,
in the launcher (a typo or a renamed flag fails at once, not in a child's log), and the child gets
``config.to_flags()``: ``p2p-diloco peer`` itself, or the lab's faulty island when a ``[debug]``
fault is asked for."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from p2p_diloco.flags import parse_flags
from p2p_diloco.lab.faults import LabPeerConfig
from p2p_diloco.procs import descendants, pid_alive

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def listen_maddr(host: str) -> str:
    """The multiaddr to listen on at ``host`` (an IPv4 address) with a free port."""
    return f"/ip4/{host}/tcp/0"


@dataclass
class Managed:
    """One started process: its role, name, Popen handle and log file."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    tree: list[int] = field(default_factory=list)  # last known descendants, for cleanup

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def remember_tree(self) -> None:
        if self.alive():
            self.tree = sorted(set(self.tree) | set(descendants(self.pid)))

    def signal(self, signum: int) -> None:
        if self.alive():
            os.kill(self.pid, signum)

    def stop(self, timeout: float = 20.0, *, signal_first: bool = True) -> Optional[int]:
        """SIGTERM (unless already sent), wait up to ``timeout`` s, then SIGKILL the process and
        anything it left behind."""
        self.remember_tree()
        if self.alive():
            if signal_first:
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self.reap_leftovers()
        return self.popen.returncode

    def reap_leftovers(self, grace: float = 5.0) -> list[int]:
        """SIGKILL descendants that outlived the process (there should be none); returns their PIDs."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(pid_alive(pid) for pid in self.tree):
            time.sleep(0.1)
        leftovers = [pid for pid in self.tree if pid_alive(pid)]
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return leftovers


class LocalSwarm:
    """A bootstrap node and islands on 127.0.0.1, each a ``python -m p2p_diloco`` process.

    :param workdir: logs, keys, summaries and event logs go here
    :param run_id: the run the islands join
    :param env: extra environment variables for every process
    :param host: the bootstrap node's IPv4 address (and the islands' unless given per island)
    """

    def __init__(self, workdir: str | Path, run_id: str = "local", env: Optional[dict] = None,
                 host: str = "127.0.0.1"):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.run_id, self.host = run_id, host
        # children end themselves if this launcher dies without stopping them (procs.exit_with_parent)
        self.env = os.environ.copy() | {"PYTHONUNBUFFERED": "1", "P2P_DILOCO_EXIT_WITH_PARENT": "1"} | (env or {})
        self.bootstrap: Optional[Managed] = None
        self.initial_peers: list[str] = []
        self.dashboard_url = ""
        self.dashboard: Optional[Managed] = None
        self.islands: dict[str, Managed] = {}
        self.others: dict[str, Managed] = {}  # the lab's own processes (e.g. rogue peers)

    def _spawn(self, name: str, args: Sequence[str], *, stdout=None, prefix: Sequence[str] = (),
               module: str = "p2p_diloco") -> Managed:
        """Start ``python -m module args`` (after ``prefix``), logging to ``<name>.log`` (appended)."""
        log_path = self.workdir / f"{name}.log"
        log = open(log_path, "ab")
        popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", module, *args], stdout=stdout or log, stderr=log, env=self.env,
            start_new_session=True,  # a Ctrl+C in the terminal reaches the launcher only; it stops us in order
        )
        log.close()
        return Managed(name, popen, log_path)

    def start_bootstrap(self, *extra: str, timeout: float = 60.0) -> list[str]:
        """Start the bootstrap node and return its INITIAL_PEERS (read from its first stdout line); with
        ``--dashboard-port`` in ``extra``, its dashboard's URL is then :attr:`dashboard_url`.

        :raises RuntimeError: if it exits or prints nothing within ``timeout`` seconds
        """
        self.bootstrap = self._spawn(
            "bootstrap",
            ["bootstrap", "--host-maddrs", listen_maddr(self.host), "--identity-path", str(self.workdir / "bootstrap.key"),
             "--run-id", self.run_id, *extra],
            stdout=subprocess.PIPE,
        )
        self.initial_peers = read_value(self.bootstrap, "INITIAL_PEERS", timeout).split()
        if "--dashboard-port" in extra:  # its second line
            self.dashboard_url = read_value(self.bootstrap, "DASHBOARD", timeout)
        return self.initial_peers

    def start_dashboard(self, *extra: str, timeout: float = 60.0) -> str:
        """Start ``p2p-diloco dashboard`` on 127.0.0.1 (a free port unless ``extra`` names one) for the
        swarm's run and return its URL (read from its first stdout line).

        :raises RuntimeError: if it exits or prints nothing within ``timeout`` seconds
        """
        self.dashboard = self._spawn(
            "dashboard", ["dashboard", "--initial-peers", *self.initial_peers, "--run-id", self.run_id,
                          "--port", "0", *extra], stdout=subprocess.PIPE,
        )
        return read_value(self.dashboard, "DASHBOARD", timeout)

    def start_island(self, name: str, *extra: str, initial_peers: Optional[Sequence[str]] = None,
                     host: Optional[str] = None, prefix: Sequence[str] = ()) -> Managed:
        """Start an island that writes ``<name>.summary.json`` and ``<name>.events.jsonl`` in workdir.

        :param extra: the island's flags (those of ``p2p-diloco peer``, and the lab's ``--debug-*`` /
            ``--slowdown`` faults)
        :param host: the island's IPv4 address (default: the swarm's)
        :param prefix: command prefix, e.g. ``ip netns exec NS`` (it must exec, keeping the PID)
        :raises p2p_diloco.errors.ConfigError: an unknown flag or an invalid value, before anything starts
        """
        config = self.island_config(name, *extra, initial_peers=initial_peers, host=host)
        module = "p2p_diloco.lab.faults" if config.debug.any else "p2p_diloco"
        island = self._spawn(name, ["peer", *config.to_flags()], prefix=prefix, module=module)
        self.islands[name] = island
        return island

    def start_process(self, name: str, module: str, *args: str) -> Managed:
        """Start ``python -m module args`` (a lab process, e.g. :mod:`p2p_diloco.lab.rogues`), stopped
        first by :meth:`close`; it logs to ``<name>.log``."""
        self.others[name] = self._spawn(name, args, module=module)
        return self.others[name]

    def island_config(self, name: str, *extra: str, initial_peers: Optional[Sequence[str]] = None,
                      host: Optional[str] = None) -> LabPeerConfig:
        """The validated configuration :meth:`start_island` starts ``name`` with."""
        peers = list(self.initial_peers if initial_peers is None else initial_peers)
        return parse_flags(LabPeerConfig, [
            "--run-id", self.run_id, "--island", name, "--host-maddrs", listen_maddr(host or self.host),
            "--summary-json", str(self.summary_path(name)), "--log-jsonl", str(self.events_path(name)),
            *(["--initial-peers", *peers] if peers else []), *extra])

    def summary_path(self, name: str) -> Path:
        return self.workdir / f"{name}.summary.json"

    def events_path(self, name: str) -> Path:
        return self.workdir / f"{name}.events.jsonl"

    def summary(self, name: str) -> Optional[dict]:
        path = self.summary_path(name)
        return json.loads(path.read_text()) if path.exists() else None

    def remember_trees(self) -> None:
        """Record every process's descendants (call while they run) so close() can verify cleanup."""
        for managed in self.all():
            managed.remember_tree()

    def all(self) -> list[Managed]:
        return [*self.others.values(), *self.islands.values(), *(m for m in (self.dashboard, self.bootstrap) if m is not None)]

    def wait_islands(self, timeout: float) -> dict[str, Optional[int]]:
        """Wait for every island to exit on its own; returns exit codes (None: still running)."""
        deadline = time.monotonic() + timeout
        for island in self.islands.values():
            try:
                island.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {name: island.popen.poll() for name, island in self.islands.items()}

    def stop_islands(self, names, timeout: float = 20.0) -> list[Optional[int]]:
        """SIGTERM the islands ``names`` together, then wait for each; returns their exit codes."""
        for name in names:
            self.islands[name].remember_tree()
            if self.islands[name].alive():
                self.islands[name].popen.send_signal(signal.SIGTERM)
        return [self.islands[name].stop(timeout, signal_first=False) for name in names]

    def close(self, timeout: float = 20.0) -> list[int]:
        """Stop every island, then the dashboard and the bootstrap node; returns PIDs that had to be
        force-killed."""
        self.remember_trees()
        leftovers = []
        for managed in self.others.values():
            managed.stop(timeout)
            leftovers += managed.reap_leftovers()
        for island in self.islands.values():
            if island.alive():
                island.popen.send_signal(signal.SIGTERM)
        for island in self.islands.values():
            island.stop(timeout, signal_first=False)
            leftovers += island.reap_leftovers()
        for managed in (self.dashboard, self.bootstrap):
            if managed is not None:
                managed.stop(timeout)
                leftovers += managed.reap_leftovers()
        return leftovers


def read_value(managed: Managed, name: str, timeout: float) -> str:
    """The value of the next stdout line of ``managed``, which must be ``NAME=value``.

    :raises RuntimeError: another line, or none within ``timeout`` seconds (the process died)
    """
    line = read_line(managed.popen, timeout)
    if not line.startswith(name + "="):
        raise RuntimeError(f"{managed.name} did not start (expected {name}=..., got {line!r}); see {managed.log_path}")
    return line.split("=", 1)[1]


def read_line(popen: subprocess.Popen, timeout: float) -> str:
    """The next stdout line of ``popen`` (text), or "" on timeout or exit."""
    deadline = time.monotonic() + timeout
    buffer = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([popen.stdout], [], [], 0.2)
        if ready:
            chunk = os.read(popen.stdout.fileno(), 1)
            if not chunk:
                break
            buffer += chunk
            if chunk == b"\n":
                break
        elif popen.poll() is not None:
            break
    return buffer.decode(errors="replace").strip()
