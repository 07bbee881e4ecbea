"""The dial-back check's pure parts (docs/DESIGN.md, "Islands behind NAT"): the verdict from the
helpers' answers, the ports a requester may ask for, and the address a helper dials."""

from p2p_diloco.net import reachability
from p2p_diloco.net.reachability import MAX_PORTS, Reachability, ports_of, verdict_of


def test_public_only_when_most_helpers_that_answered_reached_us():
    assert verdict_of({}) == "unknown"
    assert verdict_of({"a": True}) == "public"
    assert verdict_of({"a": False}) == "nat"
    assert verdict_of({"a": True, "b": False}) == "nat"  # a tie: one lying helper cannot make us a reducer
    assert verdict_of({"a": True, "b": True, "c": False}) == "public"
    assert verdict_of({"a": True, "b": False, "c": False}) == "nat"


def test_ports_are_bounded_deduplicated_and_valid():
    maddrs = [f"/ip4/1.2.3.4/tcp/{p}/p2p/Qm" for p in (31337, 31337, 0, 70000, 1, 2, 3, 4, 5)]
    assert ports_of(maddrs) == [31337, 1, 2, 3][:MAX_PORTS]
    assert ports_of(["/ip4/1.2.3.4/udp/5/quic", "/ip4/1.2.3.4/tcp/x"]) == []


def test_a_helper_dials_only_a_direct_address():
    assert reachability._host_of("/ip4/10.0.0.7/tcp/4001") == "10.0.0.7"
    assert reachability._host_of("/ip6/::1/tcp/4001") == "::1"
    assert reachability._host_of("/ip4/1.2.3.4/tcp/1/p2p/QmRelay/p2p-circuit") is None
    assert reachability._host_of("/dns4/example.org/tcp/1") is None


def test_the_verdict_explains_itself():
    found = Reachability("nat", {"a": False, "b": False}, ["10.77.20.11", "10.77.20.11"])
    assert found.describe() == "0 of 2 peer(s) could dial this machine back (seen as 10.77.20.11)"


def test_client_mode_on_and_off_skip_the_check(monkeypatch):
    monkeypatch.setattr(reachability, "check_reachability", lambda *a: (_ for _ in ()).throw(AssertionError))
    assert reachability.decide_client_mode("on", ["/ip4/1.2.3.4/tcp/1/p2p/Qm"], []) == "client"
    assert reachability.decide_client_mode("off", ["/ip4/1.2.3.4/tcp/1/p2p/Qm"], []) == "public"
    # peers on this machine can always dial it
    assert reachability.decide_client_mode("auto", ["/ip4/127.0.0.1/tcp/1/p2p/Qm"], []) == "public"
    assert reachability.decide_client_mode("auto", [], []) == "public"  # the first island: others join through it


def test_no_initial_peer_means_nobody_to_ask():
    assert reachability.check_reachability([], ["/ip4/127.0.0.1/tcp/0"]).verdict == "unknown"


def test_helpers_on_this_machine_are_not_asked_when_others_can_be():
    local, remote = "/ip4/127.0.0.1/tcp/1/p2p/QmLocal", "/ip4/1.2.3.4/tcp/1/p2p/QmRemote"
    assert reachability.helpers_of([local, remote]) == ["QmRemote"]  # the local one always reaches us
    assert reachability.helpers_of([local]) == ["QmLocal"]
    many = [f"/ip4/1.2.3.{i}/tcp/1/p2p/Qm{i}" for i in range(6)]
    assert reachability.helpers_of(many) == ["Qm0", "Qm1", "Qm2"]
