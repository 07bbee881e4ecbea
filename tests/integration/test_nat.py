"""Islands behind NAT (docs/DESIGN.md, "Islands behind NAT"): a small internet in network namespaces.
A bridge stands for the public internet, with the bootstrap node (in this namespace) and one public
island; two islands sit behind NAT routers of their own (iptables MASQUERADE, same private LAN), so
each can dial out and nobody can dial it, not even the other. Both find out that they cannot be
dialled, take part in rounds as client-mode members, share the public island's rounds and end them
with its Theta, and status says they are behind NAT; once the public island has left, their rounds
fall back as a lone island's do."""

from __future__ import annotations

import pytest

from p2p_diloco.lab import netns
from tests.integration.helpers import FAST, events_of, rounds_by_slot, status_json, wait_for

pytestmark = pytest.mark.integration
RUN = "nat"
# FAST, with a grace window of 1 s (FAST's 0.5 s is tight for clients on a loaded 2-core machine: a
# client waits for its leader's start no longer than the product's default of 1.5 s would let it), and
# 2 s of matchmaking and a 2.5 s all-reduce timeout: with FAST's 1.5 s for both, a client just after
# its join missed 2 of 8 rounds in one CI run (one left out of the group, one whose result it did not
# receive in time), below the 80%
TIMING = [*FAST, "--outer-period", "12", "--outer-grace-window", "1.0", "--outer-matchmaking-time", "2",
          "--outer-allreduce-timeout", "2.5"]
REASON = netns.check_available(nat=True)


@pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")
def test_islands_behind_two_nat_routers_share_the_public_islands_rounds(tmp_path):
    from p2p_diloco.lab.localswarm import LocalSwarm

    try:
        lab = netns.Lab(3, nat=(1, 2))
    except netns.NetnsUnavailable as e:  # root without CAP_SYS_ADMIN (a container, say)
        pytest.skip(str(e))
    names = ["public", "home-1", "home-2"]
    swarm = LocalSwarm(tmp_path / "swarm", run_id=RUN, host=lab.host)
    paths = {name: swarm.events_path(name) for name in names}

    def shared_ok_rounds():
        rounds = [e for e in events_of(paths["public"], "round") if e["outcome"] == "ok"]
        first = next((i for i, e in enumerate(rounds) if len(e["members"]) == 3), len(rounds))
        return len(rounds) - first

    try:
        swarm.start_bootstrap()
        # the clients join a training swarm: they download its state from the public island
        swarm.start_island("public", *TIMING, "--max-steps", "1000", host=lab.address(0), prefix=lab.prefix(0))
        wait_for(lambda: events_of(paths["public"], "step"), 90, message="the public island's first step")
        for i, name in enumerate(names[1:], start=1):  # (steps are a bound: the test stops them after rounds)
            swarm.start_island(name, *TIMING, "--max-steps", "1000", host=lab.address(i), prefix=lab.prefix(i))
        wait_for(lambda: shared_ok_rounds() >= 2, 120, message="rounds of all three islands")
        islands = {r["island"]: r for r in status_json(swarm.initial_peers, RUN)["islands"]}
        assert set(islands) == set(names)
        assert [islands[n]["reachability"] for n in names] == ["public", "nat", "nat"]
        # bounded in rounds: the public island leaves after 10, the clients after two rounds alone (10,
        # not 8: the 80% below then allows 2 missed rounds, and 2 of 8 failed it in one CI run, a client
        # left out of one group on a loaded machine)
        wait_for(lambda: shared_ok_rounds() >= 10, 150, message="10 ok rounds of the public island")
        assert swarm.islands["public"].stop() == 0
        public_left = events_of(paths["public"], "stop")[0]["t"]
        wait_for(lambda: all(len([e for e in events_of(paths[name], "round") if e["t_start"] > public_left + 1.0]) >= 2
                             for name in names[1:]), 60, message="two rounds of each client alone")
        assert swarm.stop_islands(names[1:]) == [0, 0]
    finally:
        swarm.close()
        lab.close()

    # state downloads work from the public donor (the clients, which nobody can dial, serve none)
    for name in names[1:]:
        assert events_of(paths[name], "join_start")[0]["donors"] == ["public"]
        assert len(events_of(paths[name], "join")) == 2, name  # both fragments downloaded
        assert not events_of(paths[name], "donate"), name
    assert len(events_of(paths["public"], "donate")) >= 4
    # without a public member nobody can reduce: rounds fall back as a lone island's do, training goes on
    for name in names[1:]:
        alone = [e for e in events_of(paths[name], "round") if e["t_start"] > public_left + 1.0]
        assert any(e["outcome"] == "fallback" for e in alone), (name, alone)
        assert all(e["outcome"] != "ok" for e in alone), (name, alone)

    table = rounds_by_slot(paths)
    in_order = sorted(table, key=lambda key: (key[1], key[0]))  # (fragment, slot) keys, in time order
    first = next(key for key in in_order if len(table[key].get("public", {}).get("members", [])) == 3)
    ok = {name: [key for key in in_order[in_order.index(first):] if table[key].get(name, {}).get("outcome") == "ok"]
          for name in names}
    # a NAT'd island's ok rounds over the public island's, in the slots it took part in: a round it
    # skipped because its own learner was late with the snapshot (no_snapshot: a busy CPU) is no
    # network's doing, and it must have taken part in most slots
    took_part = {name: [key for key in ok["public"] if table[key].get(name, {}).get("outcome") != "no_snapshot"]
                 for name in names[1:]}
    together = {name: len(set(took_part[name]) & set(ok[name])) for name in names[1:]}
    print(f"ok rounds from the first of all three: public {len(ok['public'])}; shared by {together} of the "
          f"{ {name: len(slots) for name, slots in took_part.items()} } each took part in")
    assert len(ok["public"]) >= 10
    for name in names[1:]:
        assert len(took_part[name]) >= 0.7 * len(ok["public"]), (name, took_part, ok["public"])
        assert together[name] >= 0.8 * len(took_part[name]), (name, together, took_part)
    # islands that start a round from the same Theta and complete it end with the same Theta (hashes
    # of the bytes). A member on a fork (its first rounds fell back alone) or one dropped mid-round
    # (hivemind's sender timeout) reloads the canonical Theta after it
    same_base = [slot for slot in ok["public"]
                 if len({table[slot][name].get("base_hash") for name in names if name in table[slot]}) == 1]
    assert len(same_base) >= 0.5 * len(ok["public"])
    for slot in same_base:
        # (a member whose parts partly did not arrive in time keeps its own values there, says so in
        # `unaveraged` and reloads the canonical Theta after the round: only whole averages must agree)
        completed = {name: event["new_hash"] for name, event in table[slot].items()
                     if event["outcome"] == "ok" and not event.get("unaveraged")}
        assert len(set(completed.values())) <= 1, (slot, completed)
        partial = [name for name, event in table[slot].items() if event["outcome"] == "ok" and event.get("unaveraged")]
        later = [key for key in in_order[in_order.index(slot) + 1:] if key[0] == slot[0]]
        for name in partial:  # ... and starts its next round of the fragment from the whole average
            following = next((table[key][name] for key in later if name in table[key]), None)
            assert following is None or not completed or following["base_hash"] in completed.values(), (
                slot, name, following)
