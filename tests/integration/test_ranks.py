"""Islands of several ranks (docs/DESIGN.md, "Islands of many ranks"): one of 2 DDP ranks, one of 2
FSDP ranks (gloo, on the CPU) and a one-process island share rounds; a SIGKILLed rank ends its island
with a non-zero exit while the other two train on."""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from p2p_diloco.lab.localswarm import LocalSwarm
from p2p_diloco.procs import pid_alive
from tests.integration.helpers import FAST, events_of, wait_for

pytestmark = pytest.mark.integration

# one fragment, a round every 4 s
ROUNDS = ["--outer-fragments", "1", "--outer-period", "4"]


def _rank_pid(island_pid: int, rank: int) -> int:
    """The PID of the worker that the island's torchrun started as ``rank``."""
    root = psutil.Process(island_pid)
    launcher = next(p for p in [root, *root.children(recursive=True)] if "torch.distributed.run" in p.cmdline())
    for child in launcher.children():
        if child.environ().get("RANK") == str(rank):
            return child.pid
    raise AssertionError(f"no rank {rank} under torchrun {launcher.pid}")


def _ok_rounds(swarm: LocalSwarm, name: str, after: float = 0.0) -> list[dict]:
    return [e for e in events_of(swarm.events_path(name), "round") if e["outcome"] == "ok" and e["t_start"] > after]


def test_islands_of_ddp_and_fsdp_ranks_share_rounds_and_a_killed_rank_ends_only_its_island(tmp_path):
    swarm = LocalSwarm(tmp_path, run_id="ranks")
    try:
        swarm.start_bootstrap()
        ddp = swarm.start_island("ddp", *FAST, *ROUNDS, "--nproc-per-node", "2", "--max-restarts", "1",
                                 "--data-shard-index", "0")
        swarm.start_island("fsdp", *FAST, *ROUNDS, "--nproc-per-node", "2", "--island-parallel", "fsdp",
                                  "--data-shard-index", "1")
        swarm.start_island("solo", *FAST, *ROUNDS, "--data-shard-index", "2")
        # rounds of all three, each applied on every rank of an island with the ranks agreeing
        wait_for(lambda: any(len(e["members"]) == 3 for e in _ok_rounds(swarm, "ddp"))
                 and len(events_of(swarm.events_path("ddp"), "ranks_agree")) >= 2, timeout=180,
                 message="a 3-member round applied on both of ddp's ranks")
        # a dead rank: torchrun restarts the island, which downloads the swarm's state and rejoins
        killed_at = time.time()
        psutil.Process(_rank_pid(ddp.pid, 1)).send_signal(signal.SIGKILL)
        wait_for(lambda: _ok_rounds(swarm, "ddp", after=killed_at) and events_of(swarm.events_path("ddp"), "join"),
                 timeout=150, message="the restarted ddp island in a round")
        # a second dead rank, past torchrun's restarts: the island ends, as a failure, leaving nothing
        swarm.remember_trees()
        tree = list(ddp.tree)
        killed_at = time.time()
        psutil.Process(_rank_pid(ddp.pid, 1)).send_signal(signal.SIGKILL)
        ddp.popen.wait(90)
        assert ddp.popen.returncode != 0
        wait_for(lambda: not any(pid_alive(pid) for pid in tree), timeout=30, message="ddp's processes ended")
        # the others keep training and meeting
        wait_for(lambda: _ok_rounds(swarm, "fsdp", after=killed_at + 4) and _ok_rounds(swarm, "solo", after=killed_at + 4),
                 timeout=120, message="rounds after the kill")
        # SIGTERM, as a terminal's Ctrl+C: a clean stop of every rank, exit 0, nothing left
        swarm.remember_trees()
        others = [swarm.islands[name] for name in ("fsdp", "solo")]
        for island in others:
            island.popen.send_signal(signal.SIGTERM)
        assert [island.popen.wait(60) for island in others] == [0, 0]
        wait_for(lambda: not any(pid_alive(pid) for island in others for pid in island.tree), timeout=15,
                 message="fsdp's and solo's processes ended")
    finally:
        assert not swarm.close(), "processes had to be force-killed"
    log = (tmp_path / "ddp.log").read_text()
    assert "error: rank 0 of this island lost its group" in log and "[rank0]: Traceback" not in log
    assert "SignalException" not in (tmp_path / "fsdp.log").read_text()  # torchrun was not signalled
    solo, fsdp = swarm.summary("solo"), swarm.summary("fsdp")
    assert fsdp["ranks"] == 2 and solo["ranks"] == 1
    # an island's tokens count each rank once: 2 ranks x the one-process island's tokens per step
    assert fsdp["tokens"] == 2 * fsdp["inner_steps"] * solo["tokens"] // solo["inner_steps"]
    assert fsdp["eval_loss_last"] < fsdp["eval_loss_first"]
    for name in ("ddp", "fsdp"):
        agreed = events_of(swarm.events_path(name), "ranks_agree")
        boundary = events_of(swarm.events_path(name), "step")[-2]["t"]  # a step boundary came after it
        applied = [e for e in events_of(swarm.events_path(name), "round")
                   if e["outcome"] in ("ok", "fallback") and e["t"] < boundary]
        # every round landed before the last steps was landed on both ranks, which then held the same
        # parameters
        assert len(agreed) >= len(applied) >= 2 and all(e["ranks"] == 2 for e in agreed)
    assert any(len(e["members"]) == 3 for e in _ok_rounds(swarm, "fsdp"))
