"""Chaos runs: a local swarm with scheduled faults, and the figures of what they cost.

``p2p-diloco chaos --schedule FILE`` starts a bootstrap node and N islands on 127.0.0.1, injects
the schedule's faults at their times (seconds after every island trains), stops the swarm at the
end and writes, under the output folder, ``report.json`` (goodput, global downtime, stall per
failure, time to rejoin, rounds, eval losses) and ``timeline.png``, next to every island's logs.

Faults: ``kill`` (SIGKILL an island; ``restart_after`` seconds later it restarts with the same
identity), ``freeze`` (SIGSTOP the island's whole process tree for ``duration`` seconds, then
SIGCONT: a straggler), ``kill_bootstrap`` (the islands keep training and a restarted island joins
through a live island's address), ``kill_donor`` (the island restarts, and whichever island serves
its state download is SIGKILLed mid-download: the joiner fails over to another donor), ``corrupt``
(the running island starts sending NaN, Inf or 1e30 pseudo-gradients, or attacks within the bounds
as ``--debug-attack`` does (``value = "flip+inflate"``, docs/SECURITY.md), on SIGUSR2; for ``duration``
seconds when given, else until the end, restarts included), and, with ``network = "netns"``
(each island in its own network namespace, see :mod:`p2p_diloco.lab.netns`), ``cut`` (the island's link
goes down for ``duration`` seconds) and ``throttle`` (its link is limited to ``rate`` with tc tbf).
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from p2p_diloco.flags import format_validation_error, load_toml
from p2p_diloco.errors import ConfigError
from p2p_diloco.island.events import read_events
from p2p_diloco.lab.faults import ATTACKS, GARBAGE
from p2p_diloco.lab.figures import CHECKPOINT_OUTCOMES, checkpoint_resumes, run_figures
from p2p_diloco.lab.localswarm import LocalSwarm
from p2p_diloco.procs import descendants
from p2p_diloco import files

logger = logging.getLogger(__name__)


class Fault(BaseModel):
    """One scheduled fault."""

    model_config = ConfigDict(extra="forbid")

    at: float = Field(ge=0.0, description="seconds after every island trains")
    kind: Literal["kill", "freeze", "kill_bootstrap", "kill_donor", "corrupt", "cut", "throttle"]
    island: str = Field("", description="the island (every kind but kill_bootstrap; kill_donor: the joiner)")
    restart_after: Optional[float] = Field(
        None, gt=0.0, description="kill: restart the island this many seconds later; kill_donor: the donor"
    )
    duration: Optional[float] = Field(
        None, gt=0.0, description="freeze, cut, throttle (default 10): seconds until it ends; corrupt: seconds "
        "the island stays faulty (default: for good)",
    )
    value: str = Field("nan", description="corrupt: what the faulty island sends: nan, inf or huge (out of "
                       "bounds), or attacks within the bounds (" + ", ".join(a for a in ATTACKS if a != "lying_reducer")
                       + ", joined by '+')")
    rate: str = Field("20mbit", pattern=r"^[0-9.]+[kmg]?bit$", description="throttle: tc rate, e.g. 20mbit")

    @model_validator(mode="after")
    def _default_duration(self) -> "Fault":
        if self.duration is None and self.kind in ("freeze", "cut", "throttle"):
            self.duration = 10.0
        attacks = self.value.split("+")
        if self.value not in GARBAGE and not all(a in ATTACKS and a != "lying_reducer" for a in attacks):
            raise ValueError(f"value {self.value!r}: use nan, inf, huge, or attacks among "
                             f"{', '.join(a for a in ATTACKS if a != 'lying_reducer')} joined by '+'")
        return self


class ChaosConfig(BaseModel):
    """A chaos run: the swarm, its length and its faults (TOML or YAML)."""

    model_config = ConfigDict(extra="forbid")

    islands: int = Field(4, ge=1, le=16)
    minutes: float = Field(3.0, gt=0.0, description="measured minutes, after every island trains")
    run_id: str = "chaos"
    preset: Literal["tiny", "small", "base"] = "tiny"
    period: float = Field(20.0, gt=0.0, description="outer period T_outer, seconds")
    fragments: int = Field(2, ge=1)
    threads: int = Field(1, ge=0)
    island_args: list[str] = Field(default_factory=list, description="extra flags for every island")
    checkpoint_every: Optional[float] = Field(
        None, gt=0.0, description="give each island its own checkpoint folder, saved this often (seconds); a "
        "killed island resumes from its newest checkpoint, a kill_donor joiner starts on an empty folder"
    )
    network: Literal["loopback", "netns"] = Field(
        "loopback", description="netns: each island in its own network namespace (root; needed by cut/throttle)"
    )
    donate_delay: float = Field(
        0.6, ge=0.0, le=5.0,
        description="with kill_donor faults: seconds every donor waits before serving a download, so the "
        "runner can kill it mid-download",
    )
    faults: list[Fault] = Field(default_factory=list)


def load_schedule(path: str) -> ChaosConfig:
    """Read a schedule from TOML (``.toml``) or YAML (``.yaml``/``.yml``).

    :raises ConfigError: unreadable file or invalid content (the message names the field)
    """
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"schedule {path} does not exist") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"schedule {path} is not valid YAML: {e}") from None
    else:
        data = load_toml(path)
    try:
        config = ChaosConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"schedule {path}: {format_validation_error(e)}") from None
    names = {f"island-{i}" for i in range(config.islands)}
    for fault in config.faults:
        if fault.kind != "kill_bootstrap" and fault.island not in names:
            raise ConfigError(f"schedule {path}: fault at {fault.at} s names island {fault.island!r}, "
                              f"expected one of {', '.join(sorted(names))}")
        if fault.kind == "corrupt" and any(f.kind == "corrupt" and f.island == fault.island and f.value != fault.value
                                           for f in config.faults):
            raise ConfigError(f"schedule {path}: island {fault.island} has corrupt faults with different values; "
                              "an island sends one kind of garbage")
        if fault.kind in ("cut", "throttle") and config.network != "netns":
            raise ConfigError(f"schedule {path}: the {fault.kind} fault at {fault.at} s needs network = \"netns\"")
    return config


class ChaosRun:
    """Runs one schedule; every process it starts is ended by :meth:`close` (also on Ctrl+C)."""

    def __init__(self, config: ChaosConfig, out: str | Path, stop):
        self.config, self.out, self.stop = config, Path(out), stop
        self.swarm = LocalSwarm(self.out, run_id=config.run_id)
        self.names = [f"island-{i}" for i in range(config.islands)]
        self.faults: list[dict] = []  # what was done, when
        self.alive: dict[str, list[list[float]]] = {name: [] for name in self.names}  # [start, end]
        self.frozen: dict[str, list[list[float]]] = {name: [] for name in self.names}
        self.cut: dict[str, list[list[float]]] = {name: [] for name in self.names}
        self.throttled: dict[str, list[list[float]]] = {name: [] for name in self.names}
        self.lab = None  # p2p_diloco.lab.netns.Lab with network = "netns"
        self.tails = {name: EventTail(self.swarm.events_path(name)) for name in self.names}
        self.donor_watch: list[dict] = []  # kill_donor faults waiting for a donation to the joiner
        self.faulty: dict[str, str] = {}  # island -> what it sends while faulty (kept across restarts)
        # island -> its checkpoint folder (its disk): a kill_donor joiner is a new machine, with a new one
        self.disks: dict[str, Path] = {name: self.out / "checkpoints" / name for name in self.names}
        self._closed = False
        self.t0 = 0.0

    def island_args(self, index: int) -> list[str]:
        config, budget = self.config, self.config.period / self.config.fragments
        matchmaking = min(2.0, 0.35 * budget)
        return [
            "--preset", config.preset, "--device", "cpu", "--threads", str(config.threads),
            "--data-num-shards", str(max(8, config.islands)), "--data-shard-index", str(index),
            "--outer-fragments", str(config.fragments), "--outer-period", str(config.period),
            "--outer-matchmaking-time", f"{matchmaking:.3f}", "--outer-grace-window", f"{min(1.0, 0.15 * budget):.3f}",
            "--outer-allreduce-timeout", f"{min(3.0, 0.35 * budget):.3f}",
            "--outer-request-timeout", f"{min(0.5, matchmaking / 2 - 0.05):.3f}",
            "--identity-path", str(self.out / "keys" / f"island-{index}.key"),
            "--progress-period", "2", "--progress-ttl", "10",
            *(["--checkpoint-dir", str(self.checkpoint_dir(index)), "--checkpoint-every", str(config.checkpoint_every)]
              if config.checkpoint_every else []),
            *(["--debug-donate-delay", str(config.donate_delay)]
              if any(f.kind == "kill_donor" for f in config.faults) else []),
            *config.island_args,
            *self._corrupt_args(f"island-{index}"),
        ]

    def _corrupt_args(self, name: str) -> list[str]:
        """An island with a corrupt fault in the schedule turns faulty, and healthy again, on SIGUSR2
        (no restart, so no start-up cost); one that restarts while faulty gets SIGUSR2 again once it
        started (the "refault" follow-up of its restart)."""
        values = [f.value for f in self.config.faults if f.kind == "corrupt" and f.island == name]
        if not values:
            return []
        return ["--debug-corrupt-outer" if values[0] in GARBAGE else "--debug-attack", values[0],
                "--debug-corrupt-on-signal"]

    def checkpoint_dir(self, index: int) -> Path:
        """Island ``index``'s own checkpoint folder now (used when the schedule sets checkpoint_every):
        ``checkpoints/island-<index>``, or ``checkpoints/island-<index>.<n>`` after its n-th life came
        back as a kill_donor joiner, which starts on an empty disk and so downloads the state."""
        return self.disks[self.names[index]]

    def _new_disk(self, name: str) -> dict:
        """Give a kill_donor joiner an empty checkpoint folder; returns what its restart record says."""
        if not self.config.checkpoint_every:
            return {}
        self.disks[name] = self.out / "checkpoints" / f"{name}.{len(self.alive[name])}"
        return self._disk(name)

    def _disk(self, name: str) -> dict:
        return {"checkpoint_dir": str(self.disks[name])} if self.config.checkpoint_every else {}

    def _start(self, name: str, initial_peers: Optional[list[str]] = None) -> None:
        index = self.names.index(name)
        where = dict(host=self.lab.address(index), prefix=self.lab.prefix(index)) if self.lab else {}
        self.swarm.start_island(name, *self.island_args(index),
                                initial_peers=initial_peers, **where)
        self.alive[name].append([time.time(), float("inf")])

    def _live_peers(self) -> list[str]:
        """Addresses to join through: the bootstrap node's while it lives, plus those of every island
        whose current life has started listening (a joiner needs only one of them to answer)."""
        peers = list(self.swarm.initial_peers) if self.swarm.bootstrap is not None and self.swarm.bootstrap.alive() else []
        for name, island in self.swarm.islands.items():
            if not island.alive() or not self.alive[name]:
                continue
            self.tails[name].read()
            starts = [e for e in self.tails[name].marks["start"] if e["t"] >= self.alive[name][-1][0]]
            if starts:
                host = self.lab.address(self.names.index(name)) if self.lab else "127.0.0.1"
                maddrs = starts[-1]["maddrs"]
                peers += [m for m in maddrs if f"/{host}/" in m] or maddrs
        return peers or list(self.swarm.initial_peers)

    def _toggle(self, name: str) -> bool:
        """SIGUSR2 to a running island (faulty <-> honest), once its current life has started: before,
        its handler is not installed and the signal would kill it. False: not started yet, retry."""
        if not self._started(name):
            return False
        _signal(self.swarm.islands[name].pid, signal.SIGUSR2)
        return True

    def _refault(self, name: str) -> Optional[tuple[float, str, dict]]:
        """The follow-up that makes a faulty island faulty again after its restart."""
        return (1.0, "refault", {"island": name}) if name in self.faulty else None

    def _started(self, name: str) -> bool:
        """The island's current life has logged its start (signal handlers are installed by then)."""
        self.tails[name].read()
        return any(e["t"] >= self.alive[name][-1][0] for e in self.tails[name].marks["start"])

    def _record(self, kind: str, island: str = "", **extra) -> None:
        fault = {"t": time.time(), "kind": kind, "island": island, **extra}
        self.faults.append(fault)
        logger.info("%s %s", kind, island)

    def _tree(self, name: str) -> list[int]:
        pid = self.swarm.islands[name].pid
        return [pid, *descendants(pid)]

    def run(self) -> dict:
        """Start, inject, stop, report. Returns the report (also written to report.json).

        :raises RuntimeError: if the islands do not start training
        :raises p2p_diloco.lab.netns.NetnsUnavailable: network = "netns" where namespaces cannot be made
        """
        self.out.mkdir(parents=True, exist_ok=True)
        if self.config.network == "netns":
            from p2p_diloco.lab.netns import Lab

            self.lab = Lab(self.config.islands)
            self.swarm.host = self.lab.host
        self.swarm.start_bootstrap()
        for name in self.names:
            self._start(name)
        self._wait_all_training()
        self.t0 = time.time()
        end = self.t0 + self.config.minutes * 60
        agenda: list[tuple[float, int, str, dict]] = []
        for index, fault in enumerate(self.config.faults):
            heapq.heappush(agenda, (self.t0 + fault.at, index, fault.kind, fault.model_dump()))
        counter, last_census = len(agenda), 0.0
        while not self.stop.is_set():
            now = time.time()
            if agenda and agenda[0][0] <= now:
                _, _, kind, fault = heapq.heappop(agenda)
                follow_up = self._apply(kind, fault)
                if follow_up is not None:
                    counter += 1
                    heapq.heappush(agenda, (now + follow_up[0], counter, follow_up[1], follow_up[2]))
                continue
            if now >= end:
                break
            for follow_up in self._watch_donors():
                counter += 1
                heapq.heappush(agenda, (now + follow_up[0], counter, follow_up[1], follow_up[2]))
            if now - last_census >= 0.5:  # a /proc scan per process: not at the donor watch's pace
                self.swarm.remember_trees()
                last_census = now
            tick = 0.05 if self.donor_watch else 0.5
            self.stop.wait(min(tick, max(0.0, min([end] + [a[0] for a in agenda[:1]]) - now)))
        measured_end = time.time()
        self.close()
        return self.report(measured_end)

    def _apply(self, kind: str, fault: dict) -> Optional[tuple[float, str, dict]]:
        """Inject one fault (or end one); returns a follow-up (delay, kind, fault) or None. A fault that
        does not apply at that moment (killing a dead island, freezing a frozen one, cutting a cut
        link: the donor of kill_donor is chosen at run time, so schedules can collide) is skipped and
        recorded as such."""
        name = fault.get("island", "")
        island = self.swarm.islands.get(name)
        alive = island is not None and island.alive()
        if kind == "kill":
            if not alive:
                return self._skip(kind, name, "not running")
            self._kill(name)
            self._record("kill", name)
            return (fault["restart_after"], "restart", fault) if fault.get("restart_after") else None
        if kind == "restart":
            if alive:
                return self._skip(kind, name, "already running")
            self._start(name, initial_peers=self._live_peers())
            self._record("restart", name, **self._disk(name), **({"faulty": True} if name in self.faulty else {}))
            return self._refault(name)
        if kind == "freeze":
            if not alive or _open(self.frozen[name]):
                return self._skip(kind, name, "frozen already" if alive else "not running")
            for pid in self._tree(name):
                _signal(pid, signal.SIGSTOP)
            span = [time.time(), float("inf")]
            self.frozen[name].append(span)
            self._record("freeze", name, duration=fault["duration"])
            return fault["duration"], "thaw", dict(fault, span=span)
        if kind == "thaw":
            span = fault["span"]
            if span[1] != float("inf"):
                return None  # killed while frozen: nothing left to thaw
            for pid in self._tree(name):
                _signal(pid, signal.SIGCONT)
            span[1] = time.time()
            self._record("thaw", name)
            return None
        if kind in ("corrupt", "heal"):  # SIGUSR2 toggles the island between faulty and honest
            if (kind == "corrupt") == (name in self.faulty):
                return self._skip(kind, name, "faulty already" if kind == "corrupt" else "not faulty")
            # a dead island restarts honest, and gets SIGUSR2 again if it is to be faulty (_refault); one
            # that has not started yet is honest too, so healing it is bookkeeping (waiting for its start
            # kept it counted faulty while the next island turned: two faulty at once)
            if alive and self._started(name):
                self._toggle(name)
            elif alive and kind == "corrupt":
                return 1.0, kind, fault  # its signal handler is not installed yet: again in a second
            if kind == "corrupt":
                self.faulty[name] = fault["value"]
            else:
                del self.faulty[name]
            self._record(kind, name, **({"value": fault["value"]} if kind == "corrupt" else {}))
            return (fault["duration"], "heal", fault) if kind == "corrupt" and fault.get("duration") else None
        if kind == "refault":  # a faulty island restarted honest: make it faulty again once it started
            if name in self.faulty and alive and not self._toggle(name):
                return 1.0, kind, fault
            return None
        if kind == "kill_bootstrap":
            if self.swarm.bootstrap is None or not self.swarm.bootstrap.alive():
                return self._skip(kind, "", "not running")
            self.swarm.bootstrap.signal(signal.SIGKILL)
            self._record("kill_bootstrap")
            return None
        if kind == "kill_donor":  # restart the joiner; _watch_donors kills whoever serves its download
            if alive:
                self._kill(name)
            disk = self._new_disk(name)
            self._start(name, initial_peers=self._live_peers())
            self._record("restart", name, why="kill_donor", **disk, **({"faulty": True} if name in self.faulty else {}))
            self.donor_watch.append({"joiner": name, "since": time.time(), "joining": False,
                                     "restart_after": fault.get("restart_after")})
            return self._refault(name)
        if kind in ("cut", "throttle"):
            spans = (self.cut if kind == "cut" else self.throttled)[name]
            if _open(spans):
                return self._skip(kind, name, "already " + ("cut" if kind == "cut" else "throttled"))
            index = self.names.index(name)
            if kind == "cut":
                self.lab.cut(index)
            else:
                self.lab.throttle(index, fault["rate"])
            span = [time.time(), float("inf")]
            spans.append(span)
            self._record(kind, name, duration=fault["duration"], **({"rate": fault["rate"]} if kind == "throttle" else {}))
            return fault["duration"], "restore" if kind == "cut" else "unthrottle", dict(fault, span=span)
        if kind in ("restore", "unthrottle"):
            index = self.names.index(name)
            if kind == "restore":
                self.lab.restore(index)
            else:
                self.lab.unthrottle(index)
            fault["span"][1] = time.time()
            self._record(kind, name)
            return None
        raise ValueError(kind)

    def _kill(self, name: str) -> None:
        """SIGKILL an island's whole process tree (a stopped helper could not notice its parent died)
        and close its life's span (and a freeze in progress)."""
        for pid in self._tree(name):
            _signal(pid, signal.SIGKILL)
        try:
            self.swarm.islands[name].popen.wait(10)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not die within 10 s of SIGKILL", name)
        now = time.time()
        self.alive[name][-1][1] = now
        if _open(self.frozen[name]):
            self.frozen[name][-1][1] = now

    def _skip(self, kind: str, name: str, why: str) -> None:
        logger.warning("skipped %s %s: %s", kind, name, why)
        self._record("skipped", name, fault=kind, why=why)
        return None

    def _watch_donors(self) -> list[tuple[float, str, dict]]:
        """For each pending kill_donor fault: once the joiner starts downloading state, SIGKILL the
        first island that logs a donation. Returns follow-ups (delay, "restart", fault) for donors."""
        follow_ups = []
        for tail in self.tails.values():
            tail.read()
        for watch in list(self.donor_watch):
            joiner, since = watch["joiner"], watch["since"]
            if not watch["joining"]:
                watch["joining"] = any(e["t"] >= since for e in self.tails[joiner].marks["join_start"])
            donors = [n for n in self.names if n != joiner and self.swarm.islands[n].alive()
                      and any(e["t"] >= since for e in self.tails[n].marks["donate"])] if watch["joining"] else []
            if donors:
                donor = donors[0]
                self._kill(donor)
                self._record("kill_donor", donor, joiner=joiner)
                self.donor_watch.remove(watch)
                if watch["restart_after"]:
                    follow_ups.append((watch["restart_after"], "restart", {"island": donor}))
            elif time.time() - since > 120 or not self.swarm.islands[joiner].alive():
                logger.warning("kill_donor: %s never downloaded state; no donor was killed", joiner)
                self._record("kill_donor_missed", joiner)
                self.donor_watch.remove(watch)
        return follow_ups

    def _wait_all_training(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.stop.is_set():
            for tail in self.tails.values():
                tail.read()
            ready = [n for n in self.names if self.tails[n].marks["step"]]
            if len(ready) == len(self.names):
                return
            dead = [n for n, island in self.swarm.islands.items() if not island.alive()]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"islands did not start training: {dead or 'timeout'}; see {self.out}")
            self.stop.wait(1.0)

    def close(self) -> None:
        """Thaw frozen islands, then stop every process; then remove the network namespaces.
        Safe to call twice (the second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_swarm()
        finally:
            if self.lab is not None:
                self.lab.close()

    def _stop_swarm(self) -> None:
        now = time.time()
        for name, spans in self.frozen.items():
            if spans and spans[-1][1] == float("inf") and self.swarm.islands[name].alive():
                for pid in self._tree(name):
                    _signal(pid, signal.SIGCONT)
                spans[-1][1] = now
        leftovers = self.swarm.close()
        for table in (self.alive, self.cut, self.throttled):
            for name, spans in table.items():
                for span in spans:
                    if span[1] == float("inf"):
                        span[1] = time.time()
        if leftovers:
            logger.warning("force-killed leftover processes: %s", leftovers)

    def report(self, end: float) -> dict:
        """Figures of the run from the islands' own event logs; writes report.json and timeline.png."""
        return write_report(self.out, self.config, start=self.t0, end=end, faults=self.faults,
                            alive=_spans(self.alive), frozen=_spans(self.frozen), cut=_spans(self.cut),
                            throttled=_spans(self.throttled))


def write_report(out: str | Path, config: ChaosConfig, *, start: float, end: float, faults: list[dict],
                 alive: dict, frozen: dict, cut: dict, throttled: dict) -> dict:
    """Compute a run's figures from the islands' event logs in ``out`` and write ``report.json`` and
    ``timeline.png`` there. Times are wall-clock seconds; ``alive``/``frozen``/``cut``/``throttled``
    map each island to its [start, end] intervals."""
    out = Path(out)
    names = [f"island-{i}" for i in range(config.islands)]
    events = {name: _tail_events(out / f"{name}.events.jsonl") for name in names}
    figures = run_figures(events, start=start, end=end, alive=alive, frozen=frozen, faults=faults)
    rounds = {name: _count_outcomes(evs) for name, evs in events.items()}
    # islands each island flagged, caught in its own rounds or adopted from the others' records
    flagged = {name: sorted({e["culprit"] for e in evs if e.get("event") == "flag"}) for name, evs in events.items()}
    evals = {name: [e["eval_loss"] for e in evs if e.get("event") == "eval"] for name, evs in events.items()}
    donor_kills = []
    for fault in faults:
        if fault["kind"] == "kill_donor":
            joins = [e for e in events[fault["joiner"]] if e.get("event") == "join" and e["t"] > fault["t"]]
            done = len(joins) >= config.fragments
            joined_at = max(e["t"] for e in joins[:config.fragments]) if done else end
            # who served the joiner after the kill: the download failed over to them
            others = sorted(n for n, evs in events.items() if n not in (fault["island"], fault["joiner"]) and any(
                e.get("event") == "donate" and fault["t"] <= e["t"] <= joined_at for e in evs))
            donor_kills.append({"donor": fault["island"], "joiner": fault["joiner"], "t": fault["t"],
                                "joiner_joined": done, "failover_donors": others,
                                "join_seconds": round(joined_at - fault["t"], 3) if done else None})
    faulty = faulty_spans(faults, end)
    report = {
        "schedule": config.model_dump(),
        "start": start, "end": end,
        "faults": faults,
        "alive": alive, "frozen": frozen,  # island -> [start, end] of each life / each freeze
        "figures": figures.as_dict(),
        "rounds": rounds,
        "flagged": flagged,
        "faulty": faulty,  # island -> [start, end] of each stretch it sent garbage
        "donor_kills": donor_kills,
        "network": {"cut": {n: s for n, s in cut.items() if s}, "throttled": {n: s for n, s in throttled.items() if s}},
        "eval_loss": {name: {"first": v[0] if v else None, "last": v[-1] if v else None} for name, v in evals.items()},
    }
    if config.checkpoint_every:
        report["checkpoints"] = checkpoint_report(out / "checkpoints", events, faults)
    files.write_json(out / "report.json", report)
    from p2p_diloco.lab.plots import plot_timeline

    plot_timeline(events, alive=alive, frozen=frozen, faults=faults, start=start, end=end,
                  out_path=out / "timeline.png", cut=cut, throttled=throttled, faulty=faulty)
    return report


def checkpoint_report(folder: Path, events: dict[str, list[dict]], faults: list[dict]) -> dict:
    """Whether a run with checkpoints lost any: every restart's resume
    (:func:`p2p_diloco.lab.figures.checkpoint_resumes`) and every checkpoint file left in ``folder``
    read back and verified (:func:`p2p_diloco.island.checkpoint.load_checkpoint`)."""
    from p2p_diloco.island.checkpoint import CheckpointError, list_checkpoints, load_checkpoint

    restarts = checkpoint_resumes(events, faults)
    files, unreadable = 0, []
    for disk in sorted(folder.iterdir()) if folder.is_dir() else []:
        for path in list_checkpoints(disk):
            files += 1
            try:
                load_checkpoint(path)
            except CheckpointError as e:
                unreadable.append(str(e))
    saved = sum(1 for evs in events.values() for e in evs if e.get("event") == "checkpoint")
    outcomes = [r["outcome"] for r in restarts]
    return {"saved": saved, "files": files, "unreadable": unreadable, "restarts": restarts,
            **{outcome: outcomes.count(outcome) for outcome in CHECKPOINT_OUTCOMES}}


def faulty_spans(faults: list[dict], end: float) -> dict[str, list[tuple[float, float]]]:
    """island -> [(start, end)] of the stretches it sent garbage, from the ``corrupt`` and ``heal``
    records (wall-clock seconds; a stretch with no heal runs to ``end``)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    since: dict[str, float] = {}
    for fault in sorted(faults, key=lambda f: f["t"]):
        if fault["kind"] == "corrupt":
            since.setdefault(fault["island"], fault["t"])
        elif fault["kind"] == "heal" and fault["island"] in since:
            spans.setdefault(fault["island"], []).append((since.pop(fault["island"]), fault["t"]))
    for island, t in since.items():
        spans.setdefault(island, []).append((t, end))
    return spans


def reanalyze(out: str | Path) -> dict:
    """Recompute ``report.json`` and ``timeline.png`` of a finished run folder (after a change to the
    figures' definitions, say) from its event logs and the spans the old report recorded.

    :raises ConfigError: when ``out`` holds no readable report.json
    """
    path = Path(out) / "report.json"
    try:
        old = json.loads(path.read_text())
        config = ChaosConfig.model_validate(old["schedule"])
        network = old.get("network", {})
        return write_report(out, config, start=old["start"], end=old["end"], faults=old["faults"],
                            alive=_spans(old.get("alive", {})), frozen=_spans(old.get("frozen", {})),
                            cut=_spans(network.get("cut", {})), throttled=_spans(network.get("throttled", {})))
    except (OSError, ValueError, KeyError, ValidationError) as e:
        raise ConfigError(f"{path}: not a chaos report that can be recomputed ({e})") from None


def _spans(table: dict) -> dict[str, list[tuple[float, float]]]:
    """island -> its [start, end] intervals as tuples (what the figures take)."""
    return {name: [tuple(span) for span in spans] for name, spans in table.items()}


def _open(spans: list) -> bool:
    """True if the last interval has not ended."""
    return bool(spans) and spans[-1][1] == float("inf")


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


class EventTail:
    """Reads an island's JSONL event log incrementally (all of its lives); ``seen`` keeps everything,
    ``marks`` the ``start``, ``join_start`` and ``donate`` events (what the runner polls for) and the
    first ``step``."""

    def __init__(self, path: Path):
        self.path, self.offset, self.seen = path, 0, []
        self.marks: dict[str, list[dict]] = {"start": [], "join_start": [], "donate": [], "step": []}
        self._partial = ""

    def read(self) -> list[dict]:
        """Events appended since the last call (a torn last line waits for its end)."""
        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        new = []
        for line in lines:
            try:
                new.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        self.seen += new
        for event in new:
            kind = event.get("event")
            if kind in self.marks and not (kind == "step" and self.marks["step"]):  # one step is enough
                self.marks[kind].append(event)
        return new


def _tail_events(path: Path) -> list[dict]:
    return read_events(str(path)) if path.exists() else []


def _count_outcomes(events: list[dict]) -> dict:
    counts: dict[str, int] = {}
    for event in events:
        if event.get("event") == "round":
            counts[event["outcome"]] = counts.get(event["outcome"], 0) + 1
    return counts
