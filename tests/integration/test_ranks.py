"""Islands of several ranks (docs/DESIGN.md, "Islands of many ranks"): one of 2 DDP ranks, one of 2
FSDP ranks (gloo, on the CPU) and a one-process island share rounds; a SIGKILLed rank ends its island
with a non-zero exit while the other two train on; torchrun's restart brings the island back from its
checkpoint."""

from __future__ import annotations

import collections
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
                                 "--checkpoint-dir", str(tmp_path / "ddp-checkpoints"), "--checkpoint-every", "3",
                                 "--data-shard-index", "0")
        fsdp = swarm.start_island("fsdp", *FAST, *ROUNDS, "--nproc-per-node", "2", "--island-parallel", "fsdp",
                                  "--data-shard-index", "1")
        solo = swarm.start_island("solo", *FAST, *ROUNDS, "--data-shard-index", "2")
        # rounds of all three, each applied on every rank of an island with the ranks agreeing
        wait_for(lambda: any(len(e["members"]) == 3 for e in _ok_rounds(swarm, "ddp"))
                 and len(events_of(swarm.events_path("ddp"), "ranks_agree")) >= 2
                 and len(_ok_rounds(swarm, "fsdp")) >= 2 and events_of(swarm.events_path("ddp"), "checkpoint"),
                 timeout=180, message="a 3-member round landed on both of ddp's ranks, fsdp's rounds, ddp's checkpoint")
        # a dead rank in each: fsdp ends, as a failure, leaving nothing; torchrun restarts ddp, whose
        # rank 0 loads the checkpoint and hands it to rank 1, and both ranks land the next round alike
        swarm.remember_trees()
        tree = list(fsdp.tree)
        killed_at = time.time()
        for island in (fsdp, ddp):
            psutil.Process(_rank_pid(island.pid, 1)).send_signal(signal.SIGKILL)
        fsdp.popen.wait(90)
        assert fsdp.popen.returncode != 0
        wait_for(lambda: not any(pid_alive(pid) for pid in tree), timeout=30, message="fsdp's processes ended")

        def restored_and_agreed():
            resumed = [e for e in events_of(swarm.events_path("ddp"), "resume") if e["t"] > killed_at]
            return resumed and [e for e in events_of(swarm.events_path("ddp"), "ranks_agree") if e["t"] > resumed[0]["t"]]

        wait_for(lambda: restored_and_agreed() and _ok_rounds(swarm, "solo", after=killed_at + 4), timeout=150,
                 message="the restarted ddp island's ranks landing a round, and solo's rounds after the kill")
        # SIGTERM, as a terminal's Ctrl+C: a clean stop of every rank, exit 0, nothing left
        swarm.remember_trees()
        for island in (ddp, solo):
            island.popen.send_signal(signal.SIGTERM)
        assert [island.popen.wait(60) for island in (ddp, solo)] == [0, 0]
        wait_for(lambda: not any(pid_alive(pid) for island in (ddp, solo) for pid in island.tree), timeout=15,
                 message="ddp's and solo's processes ended")
    finally:
        assert not swarm.close(), "processes had to be force-killed"
    log = (tmp_path / "fsdp.log").read_text()
    assert "error: rank 0 of this island lost its group" in log and "[rank0]: Traceback" not in log
    assert "SignalException" not in (tmp_path / "ddp.log").read_text()  # torchrun itself was not signalled
    ddp_summary, solo_summary = swarm.summary("ddp"), swarm.summary("solo")
    assert ddp_summary["ranks"] == 2 and solo_summary["ranks"] == 1 and ddp_summary["resumed_from"]
    # an island's tokens count each rank once: 2 ranks x the one-process island's tokens per step
    assert ddp_summary["tokens"] == 2 * ddp_summary["inner_steps"] * solo_summary["tokens"] // solo_summary["inner_steps"]
    assert ddp_summary["eval_loss_last"] < ddp_summary["eval_loss_first"]
    resumed = events_of(swarm.events_path("ddp"), "resume")[0]["t"]
    for after, until in ((0.0, killed_at), (resumed, float("inf"))):  # each life of ddp (rank 1 alive)
        agreed = [e for e in events_of(swarm.events_path("ddp"), "ranks_agree") if after < e["t"] < until]
        assert agreed and all(e["ranks"] == 2 for e in agreed), agreed
        # every round was landed on both ranks, which then held the same parameters, bit for bit; but
        # a life's last round, whose result may come after its last inner step (or the kill)
        landed = {(e["fragment"], e["version"]) for e in agreed}
        newest = {p: max(v for q, v in landed if q == p) for p, _ in landed}
        rounds = [e for e in events_of(swarm.events_path("ddp"), "round")
                  if e["outcome"] in ("ok", "fallback") and after < e["t"] < until]
        missed = [e for e in rounds if e["new_version"] <= newest.get(e["fragment"], -1)
                  and (e["fragment"], e["new_version"]) not in landed]
        last = collections.Counter(e["fragment"] for e in rounds if e["new_version"] > newest.get(e["fragment"], -1))
        assert not missed and max(last.values(), default=0) <= 1, (missed, last, sorted(landed))
    # FSDP's ranks hold disjoint shards (nothing to compare): they landed the rounds that 3 islands shared
    assert any(len(e["members"]) == 3 for e in _ok_rounds(swarm, "fsdp"))
    assert not events_of(swarm.events_path("fsdp"), "ranks_agree")
