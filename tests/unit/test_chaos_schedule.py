"""Chaos schedules: validation, and the incremental event-log reader the runner polls."""

from __future__ import annotations

import json

import pytest

from p2p_diloco.lab.chaos import EventTail, load_schedule
from p2p_diloco.errors import ConfigError


def write(tmp_path, text: str, name: str = "s.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_schedule_reads_every_fault_kind(tmp_path):
    config = load_schedule(write(tmp_path, """
islands = 3
network = "netns"
[[faults]]
at = 5
kind = "kill_donor"
island = "island-1"
restart_after = 10
[[faults]]
at = 9
kind = "throttle"
island = "island-2"
rate = "5mbit"
duration = 4
[[faults]]
at = 12
kind = "cut"
island = "island-0"
"""))
    assert [f.kind for f in config.faults] == ["kill_donor", "throttle", "cut"]
    assert config.faults[1].rate == "5mbit" and config.faults[2].duration == 10.0


def test_schedule_yaml(tmp_path):
    config = load_schedule(write(tmp_path, "islands: 2\nfaults:\n  - {at: 3, kind: freeze, island: island-1}\n",
                                 "s.yaml"))
    assert config.islands == 2 and config.faults[0].kind == "freeze"


@pytest.mark.parametrize("text, words", [
    ('islands = 2\n[[faults]]\nat = 1\nkind = "kill"\nisland = "island-7"\n', "island-7"),
    ('[[faults]]\nat = 1\nkind = "cut"\nisland = "island-0"\n', "netns"),
    ('network = "netns"\n[[faults]]\nat = 1\nkind = "throttle"\nisland = "island-0"\nrate = "fast"\n', "rate"),
    ('[[faults]]\nat = -1\nkind = "freeze"\nisland = "island-0"\n', "at"),
    ('[[faults]]\nat = 1\nkind = "explode"\nisland = "island-0"\n', "kind"),
    ('islands = 3\ncolour = "red"\n', "colour"),
])
def test_bad_schedules_name_the_problem(tmp_path, text, words):
    with pytest.raises(ConfigError, match=words):
        load_schedule(write(tmp_path, text))


def test_missing_schedule(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_schedule(str(tmp_path / "nope.yaml"))


def test_event_tail_reads_increments_and_waits_for_torn_lines(tmp_path):
    path = tmp_path / "a.events.jsonl"
    tail = EventTail(path)
    assert tail.read() == []  # no file yet
    with open(path, "w") as f:
        f.write(json.dumps({"event": "step", "t": 1.0}) + "\n" + '{"event": "do')
    assert [e["event"] for e in tail.read()] == ["step"]
    with open(path, "a") as f:
        f.write('nate", "t": 2.0}\n')
        f.write(json.dumps({"event": "round", "t": 3.0}) + "\n")
    assert [e["event"] for e in tail.read()] == ["donate", "round"]
    assert tail.read() == []
    assert [e["t"] for e in tail.seen] == [1.0, 2.0, 3.0]


def test_reanalyze_recomputes_a_run_folder(tmp_path):
    from p2p_diloco.lab.chaos import ChaosConfig, reanalyze

    steps = [{"event": "step", "t": t + 0.5, "dt": 0.5, "island": "island-0"} for t in range(0, 100)]
    (tmp_path / "island-0.events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in steps))
    old = {"schedule": ChaosConfig(islands=1).model_dump(), "start": 0.0, "end": 100.0, "faults": [],
           "alive": {"island-0": [[0.0, 100.0]]}, "frozen": {"island-0": [[40.0, 50.0]]}}
    (tmp_path / "report.json").write_text(json.dumps(old))
    report = reanalyze(tmp_path)
    assert report["figures"]["useful_seconds"] == pytest.approx(45.0)  # steps inside the freeze do not count
    assert report["figures"]["alive_utilization"] == pytest.approx(0.5)
    assert json.loads((tmp_path / "report.json").read_text())["figures"] == report["figures"]
    assert (tmp_path / "timeline.png").exists()
    with pytest.raises(ConfigError, match="report"):
        reanalyze(tmp_path / "nowhere")


def test_faults_that_do_not_apply_are_skipped_and_spans_stay_consistent(tmp_path):
    # stand-in islands are `sleep` processes this test owns: freeze and kill are real signals
    import subprocess
    import threading
    import time

    from p2p_diloco.lab.chaos import ChaosConfig, ChaosRun
    from p2p_diloco.lab.localswarm import Managed

    run = ChaosRun(ChaosConfig(islands=2), tmp_path, threading.Event())

    def start(name, initial_peers=None):
        run.swarm.islands[name] = Managed(name, subprocess.Popen(["sleep", "60"]), tmp_path / f"{name}.log")
        run.alive[name].append([time.time(), float("inf")])

    run._start = start
    for name in run.names:
        start(name)
    try:
        thaw = run._apply("freeze", {"island": "island-0", "duration": 5})
        assert thaw[1] == "thaw"
        assert run._apply("freeze", {"island": "island-0", "duration": 5}) is None  # frozen already
        assert run._apply("kill", {"island": "island-0", "restart_after": None}) is None
        assert not run.swarm.islands["island-0"].alive()
        assert run.frozen["island-0"][-1][1] < float("inf")  # the freeze ended with the island
        assert run._apply(*thaw[1:]) is None  # nothing left to thaw
        assert run._apply("kill", {"island": "island-0"}) is None  # dead already
        assert run._apply("restart", {"island": "island-1"}) is None  # running already
        assert [f["kind"] for f in run.faults] == ["freeze", "skipped", "kill", "skipped", "skipped"]
        assert len(run.alive["island-1"]) == 1 and run.alive["island-0"][0][1] < float("inf")
    finally:
        for island in run.swarm.islands.values():
            island.popen.kill()
            island.popen.wait(5)


def test_a_kill_donor_joiner_starts_on_an_empty_checkpoint_folder_and_restarts_keep_theirs(tmp_path):
    import subprocess
    import threading
    import time

    from p2p_diloco.lab.chaos import ChaosConfig, ChaosRun
    from p2p_diloco.lab.localswarm import Managed

    run = ChaosRun(ChaosConfig(islands=2, checkpoint_every=60), tmp_path, threading.Event())
    folders = []

    def start(name, initial_peers=None):
        folders.append(run.island_args(run.names.index(name))[run.island_args(0).index("--checkpoint-dir") + 1])
        run.swarm.islands[name] = Managed(name, subprocess.Popen(["sleep", "60"]), tmp_path / f"{name}.log")
        run.alive[name].append([time.time(), float("inf")])

    run._start, run._live_peers = start, lambda: []
    try:
        start("island-0")
        run._apply("kill", {"island": "island-0"})
        run._apply("restart", {"island": "island-0"})  # the same disk: it resumes from its checkpoint
        run._apply("kill_donor", {"island": "island-0"})  # a new machine: an empty folder, so it downloads
        run._apply("kill", {"island": "island-0"})
        run._apply("restart", {"island": "island-0"})  # and keeps that folder from then on
        disk, fresh = str(tmp_path / "checkpoints" / "island-0"), str(tmp_path / "checkpoints" / "island-0.2")
        assert folders == [disk, disk, fresh, fresh]
        assert [f.get("checkpoint_dir") for f in run.faults if f["kind"] == "restart"] == [disk, fresh, fresh]
    finally:
        for island in run.swarm.islands.values():
            island.popen.kill()
            island.popen.wait(5)


STAND_IN = """
import json, signal, sys, time
def note(*_):
    with open(sys.argv[2], "a") as f:
        f.write("usr2\\n")
signal.signal(signal.SIGUSR2, note)
time.sleep(0.3)  # still starting: the runner must not signal yet
with open(sys.argv[1], "a") as f:  # like an island: handlers installed, then the start event
    f.write(json.dumps({"t": time.time(), "event": "start", "maddrs": []}) + "\\n")
time.sleep(60)
"""


def test_corrupt_toggles_a_running_island_by_signal_once_it_started(tmp_path):
    # the stand-in island is a Python process this test owns that records each SIGUSR2 it gets
    import subprocess
    import sys
    import threading
    import time

    from p2p_diloco.lab.chaos import ChaosConfig, ChaosRun, Fault
    from p2p_diloco.lab.localswarm import Managed

    fault = Fault(at=5, kind="corrupt", island="island-1", value="inf", duration=30)
    run = ChaosRun(ChaosConfig(islands=2, faults=[fault]), tmp_path, threading.Event())
    assert run._corrupt_args("island-1") == ["--debug-corrupt-outer", "inf", "--debug-corrupt-on-signal"]
    assert run._corrupt_args("island-0") == []
    signals = tmp_path / "signals.txt"
    events = run.swarm.events_path("island-1")
    events.parent.mkdir(parents=True, exist_ok=True)
    popen = subprocess.Popen([sys.executable, "-c", STAND_IN, str(events), str(signals)])
    run.swarm.islands["island-1"] = Managed("island-1", popen, tmp_path / "island-1.log")
    run.alive["island-1"].append([time.time(), float("inf")])
    try:
        retry = run._apply("corrupt", fault.model_dump())  # not started yet: no signal (it would kill it)
        assert retry[:2] == (1.0, "corrupt") and not run.faults and not run.faulty
        deadline = time.monotonic() + 30
        while not run._started("island-1") and time.monotonic() < deadline:
            time.sleep(0.05)
        def received(count):  # signals sent in quick succession would merge: wait for each one
            deadline = time.monotonic() + 10
            while (not signals.exists() or len(signals.read_text().split()) < count) and time.monotonic() < deadline:
                time.sleep(0.05)

        heal = run._apply("corrupt", fault.model_dump())
        assert heal[0] == 30 and heal[1] == "heal" and run.faults[-1]["kind"] == "corrupt"
        received(1)
        assert run._refault("island-1")[1] == "refault"  # were it to restart, it would be made faulty again
        assert run._apply("refault", {"island": "island-1"}) is None  # (what that follow-up does: SIGUSR2)
        received(2)
        assert run._apply("corrupt", fault.model_dump()) is None and run.faults[-1]["why"] == "faulty already"
        assert run._apply(*heal[1:]) is None and run.faults[-1]["kind"] == "heal" and not run.faulty
        assert run._refault("island-1") is None and run._apply("refault", {"island": "island-1"}) is None
        received(3)
        assert signals.read_text().split() == ["usr2"] * 3 and popen.poll() is None
    finally:
        popen.kill()
        popen.wait(5)


def test_healing_an_island_that_has_not_started_yet_is_bookkeeping(tmp_path):
    """A faulty island that was killed restarts honest: a heal due before its new life has started
    takes effect at once (no signal, which would kill it; no retry, which kept it counted faulty)."""
    import subprocess
    import threading
    import time

    from p2p_diloco.lab.chaos import ChaosConfig, ChaosRun, Fault
    from p2p_diloco.lab.localswarm import Managed

    fault = Fault(at=5, kind="corrupt", island="island-1", value="inf", duration=30)
    run = ChaosRun(ChaosConfig(islands=2, faults=[fault]), tmp_path, threading.Event())
    popen = subprocess.Popen(["sleep", "30"])  # SIGUSR2 would end it
    run.swarm.islands["island-1"] = Managed("island-1", popen, tmp_path / "island-1.log")
    run.alive["island-1"].append([time.time(), float("inf")])
    run.faulty["island-1"] = "inf"
    try:
        assert run._apply("heal", fault.model_dump()) is None
        assert run.faults[-1]["kind"] == "heal" and not run.faulty
        assert run._apply("refault", {"island": "island-1"}) is None  # its pending follow-up does nothing
        time.sleep(0.2)
        assert popen.poll() is None
    finally:
        popen.kill()
        popen.wait(5)


def test_faulty_spans_run_from_corrupt_to_heal_or_the_end():
    from p2p_diloco.lab.chaos import faulty_spans

    faults = [{"t": 10.0, "kind": "corrupt", "island": "island-1"}, {"t": 12.0, "kind": "freeze", "island": "island-1"},
              {"t": 40.0, "kind": "heal", "island": "island-1"}, {"t": 50.0, "kind": "corrupt", "island": "island-1"},
              {"t": 30.0, "kind": "corrupt", "island": "island-2"}, {"t": 35.0, "kind": "heal", "island": "island-0"}]
    assert faulty_spans(faults, end=100.0) == {"island-1": [(10.0, 40.0), (50.0, 100.0)], "island-2": [(30.0, 100.0)]}


def test_a_faulty_island_may_attack_within_the_bounds(tmp_path):
    text = 'islands = 3\n[[faults]]\nat = 5\nkind = "corrupt"\nisland = "island-1"\nvalue = "{}"\nduration = 30\n'
    assert load_schedule(write(tmp_path, text.format("flip+inflate"))).faults[0].value == "flip+inflate"
    for bad in ("lying_reducer", "flip+explode", ""):  # (a lying reducer cannot be switched on and off)
        with pytest.raises(ConfigError, match="value"):
            load_schedule(write(tmp_path, text.format(bad)))


def test_the_hundred_fault_schedule_keeps_its_rules():
    """docs/chaos/hundred.toml (scripts/make_chaos_schedule.py): 100 faults of every kind in 30 minutes,
    at most 1 island faulty and 2 down at once, the last 2 minutes quiet."""
    from tests.conftest import ROOT

    config = load_schedule(str(ROOT / "docs" / "chaos" / "hundred.toml"))
    faults = config.faults
    assert len(faults) == 100 and config.minutes == 30 and max(f.at for f in faults) <= 30 * 60 - 120
    assert {f.kind for f in faults} == {"kill", "freeze", "kill_bootstrap", "kill_donor", "corrupt", "cut", "throttle"}
    values = {f.value for f in faults if f.kind == "corrupt"}
    assert "nan" in values and {"flip+inflate", "noise", "bias", "replay"} <= values
    faulty = sorted((f.at, f.at + f.duration) for f in faults if f.kind == "corrupt")
    assert all(end <= start for (_, end), (start, _) in zip(faulty, faulty[1:]))  # one faulty island at a time
    down = [(f.at, f.at + (f.duration if f.kind == "freeze" else f.restart_after + 45.0)) for f in faults
            if f.kind in ("kill", "freeze")]
    assert all(sum(s <= t < e for s, e in down) <= 2 for t, _ in down)
    assert load_schedule(str(ROOT / "docs" / "chaos" / "hundred_baseline.toml")).faults == []
