"""A real swarm with the options the papers compare switched on: RDA merges, int4 outer gradients on
the wire, one fragment (plain DiLoCo) and plain averaging (FedAvg). Three islands on 127.0.0.1."""

from __future__ import annotations

import pytest

from p2p_diloco.lab.localswarm import LocalSwarm
from tests.integration.helpers import FAST, events_of, rounds_by_slot

pytestmark = pytest.mark.integration
ISLANDS = ["opt-0", "opt-1", "opt-2"]
OPTIONS = ["--outer-merge", "rda", "--outer-codec", "int4", "--outer-fragments", "1",
           "--outer-lr", "1.0", "--outer-momentum", "0", "--max-minutes", "1.0"]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    swarm = LocalSwarm(tmp_path_factory.mktemp("options"), run_id="options")
    swarm.start_bootstrap()
    for index, name in enumerate(ISLANDS):
        swarm.start_island(name, *FAST, "--data-shard-index", str(index), *OPTIONS)
    codes = swarm.wait_islands(240)
    assert not swarm.close(), "processes had to be force-killed"
    assert codes == {name: 0 for name in ISLANDS}
    return swarm


def test_members_of_shared_rda_int4_rounds_hold_identical_theta(swarm):
    shared = {key: {name: e for name, e in by_island.items() if e["outcome"] == "ok" and e.get("canonical")}
              for key, by_island in rounds_by_slot({n: swarm.events_path(n) for n in ISLANDS}).items()}
    shared = {key: members for key, members in shared.items() if len(members) >= 2}
    clean = [key for key, members in shared.items() if all(e["unaveraged"] == 0 for e in members.values())]
    assert len(clean) >= 3, shared
    for key, members in shared.items():
        # members that started from the same Theta and saw the same failed reducers (none, mostly) end
        # identical; a member that alone missed a reducer's answer forks, and reloads at the next round
        # (a known limit, docs/CHAOS.md), which the swarm's later rounds show
        by_failure: dict = {}
        for e in members.values():
            by_failure.setdefault(e["unaveraged"], []).append(e)
        for same in by_failure.values():
            assert len({e["new_hash"] for e in same}) == 1, (key, members)
            assert len({e["new_version"] for e in same}) == 1


def test_int4_rounds_move_over_five_times_fewer_bytes_than_fp32_would(swarm):
    for name in ISLANDS:
        summary = swarm.summary(name)
        parameters = summary["parameters"]  # one fragment: the whole model in every round
        rounds = [e for e in events_of(swarm.events_path(name), "round") if e["outcome"] == "ok"]
        assert rounds
        for e in rounds:
            n = e["group_size"]
            fp32 = 2 * parameters * 4 * (n - 1) / n  # butterfly all-reduce: parts out, averages back
            # 4 bits out, 5 to 7 back (docs/RESULTS.md measures the ratio per token: E5)
            assert 0 < e["bytes_sent"] <= fp32 / 5, (e, fp32)
            assert 0 < e["bytes_received"] <= fp32 / 5, (e, fp32)


def test_the_summary_trains_and_reports_bytes_per_token_against_data_parallel(swarm):
    for name in ISLANDS:
        summary = swarm.summary(name)
        assert summary["eval_loss_last"] < summary["eval_loss_first"] - 1.0
        # (a short run: the state downloads at start weigh as much as the rounds; docs/RESULTS.md has long runs)
        assert summary["bytes_per_token"] > 0 and summary["reduction_vs_dp"] > 1
        assert summary["reduction_vs_dp"] == pytest.approx(summary["dp_bytes_per_token"] / summary["bytes_per_token"],
                                                           rel=0.01)
        log = (swarm.workdir / f"{name}.log").read_text()
        assert "bandwidth:" in log and "fewer" in log
        assert "terminate called" not in log  # the island's process ended cleanly (cli.run)
