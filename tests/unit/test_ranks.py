"""Islands of several ranks (docs/DESIGN.md, "Islands of many ranks"): the launch command, the
launcher's checks, a follower's data position, the launcher's stop, and the ranks' agreement check over a real gloo
group of two processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from p2p_diloco.errors import ConfigError
from p2p_diloco.island import data, ranks


def test_torchrun_argv_runs_this_module_with_the_same_flags():
    argv = ranks.torchrun_argv(3, ["peer", "--island", "a", "--nproc-per-node", "3"], max_restarts=2)
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    module = argv.index("-m", 1 + argv.index("torch.distributed.run"))
    launcher, rest = argv[3:module], argv[module:]
    assert launcher[launcher.index("--nproc-per-node") + 1] == "3"
    assert launcher[launcher.index("--max-restarts") + 1] == "2" and "--standalone" in launcher
    assert rest == ["-m", "p2p_diloco", "peer", "--island", "a", "--nproc-per-node", "3"]
    assert ranks.torchrun_argv(2, ["peer"], module="p2p_diloco.lab.faults")[-3:] == ["-m", "p2p_diloco.lab.faults", "peer"]


def test_nproc_per_node_must_match_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="--nproc-per-node 4 but torchrun started 2 ranks"):
        ranks.start_ranks("ddp", torch.device("cpu"), expected=4)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert ranks.start_ranks("ddp", torch.device("cpu"), expected=4) is None  # not under torchrun


def test_skip_reaches_the_position_of_drawing():
    tokens = np.arange(5000) % 97
    drawn = data.BatchSampler(tokens, 4, 16, seed=3, island="a#rank1")
    for _ in range(5):
        drawn.next_batch()
    skipped = data.BatchSampler(tokens, 4, 16, seed=3, island="a#rank1")
    skipped.skip(5)
    assert skipped.batches_drawn == 5
    assert torch.equal(skipped.next_batch(), drawn.next_batch())


def _agree_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    group = ranks.IslandRanks("ddp", torch.device("cpu"), timeout=60)
    try:
        params = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)]
        # the leader's update reaches the follower, which starts with other values
        update = [p + 1 for p in params] if rank == 0 else None
        received = group.broadcast(update, [p.shape for p in params])
        result = {"delivered": all(torch.equal(a, b.float() + 1) for a, b in zip(received, params)),
                  "checksum": group.agree(params)}
        if rank == 1:
            params[0][1, 2] = torch.nextafter(params[0][1, 2], torch.tensor(100.0))  # one ulp off
        try:
            group.agree(params)
        except ranks.RankLost as e:
            result["diverged"] = str(e)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
    finally:
        group.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_agree_on_equal_parameters_and_catch_one_ulp(tmp_path):
    out, port = str(tmp_path / "result"), _free_port()
    root = Path(__file__).resolve().parents[2]
    workers = [subprocess.Popen([sys.executable, "-c", "import sys; from tests.unit.test_ranks import _agree_worker; "
                                 "_agree_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])", str(rank),
                                 str(port), out], cwd=root) for rank in (0, 1)]
    assert [worker.wait(120) for worker in workers] == [0, 0]
    results = [json.loads(open(f"{out}.{rank}").read()) for rank in (0, 1)]
    assert all(r["delivered"] for r in results)  # the broadcast gave every rank rank 0's tensors
    assert results[0]["checksum"] == results[1]["checksum"]  # equal parameters agree
    for r in results:  # and one ulp on one rank is caught, on every rank
        assert "ranks [1] of this island hold other parameters than rank 0" in r["diverged"]


# a stand-in for torchrun: starts a worker, restarts it (up to RESTARTS times) when it ends with an
# error, exits 1 when signalled itself (as torchrun does)
LAUNCHER = """
import signal, subprocess, sys
folder, code, restarts = sys.argv[1], sys.argv[2], int(sys.argv[3])
workers = []

def shutdown(*_):
    for worker in workers:
        worker.kill()
    sys.exit(1)

signal.signal(signal.SIGTERM, shutdown)
for attempt in range(restarts + 1):
    workers.append(subprocess.Popen([sys.executable, "-c", WORKER, folder, str(attempt), code]))
    if workers[-1].wait() == 0:
        sys.exit(0)
sys.exit(1)
"""
WORKER = """
import os, signal, sys, time
folder, attempt, code = sys.argv[1], sys.argv[2], int(sys.argv[3])
signal.signal(signal.SIGTERM, lambda *_: sys.exit(code))
open(os.path.join(folder, "started-" + attempt), "w").close()
time.sleep(60)
"""


@pytest.mark.parametrize("worker_code,expected", [(0, 0), (130, 130)])
def test_a_stop_reaches_the_workers_and_no_restart_follows_it(tmp_path, worker_code, expected):
    import signal
    import time

    script = "WORKER = " + repr(WORKER) + "\n" + LAUNCHER
    runner = subprocess.Popen([sys.executable, "-c", "import sys; from p2p_diloco.procs import run_launcher; "
                               "sys.exit(run_launcher(sys.argv[1:], settle=1.0))", sys.executable, "-c", script,
                               str(tmp_path), str(worker_code), "5"], cwd=Path(__file__).resolve().parents[2])
    deadline = time.monotonic() + 30
    while not (tmp_path / "started-0").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(30) == expected
    # a worker that stopped cleanly ends the launcher with 0; one that ended with an error was
    # restarted once at most before the launcher itself was ended (not 5 times)
    started = len(list(tmp_path.glob("started-*")))
    assert started == 1 if worker_code == 0 else 1 <= started <= 2
