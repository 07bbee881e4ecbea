"""The reporter's partition healing: which peers it dials again, and when (pure logic, no DHT)."""

from __future__ import annotations

import time

from p2p_diloco.island.reporter import Reporter


class Done:
    def done(self):
        return True


def record(island: str, peer: str, reachability: str = "public"):
    class R:  # the fields _heal reads
        pass

    r = R()
    r.island, r.peer_id, r.maddrs = island, peer, [f"/ip4/127.0.0.1/tcp/1/p2p/{peer}"]
    r.reachability = reachability
    return r


def reporter(calls, initial=None):
    return Reporter(board=None, build_record=None, period=1.0, ttl=5.0, fingerprint="f", island="me", show=None,
                    health=None, on_failure=None, reconnect=lambda peers: calls.append(peers) or Done(),
                    initial=initial or {}, heal_every=0.0)


def test_islands_that_vanished_are_dialled_again_and_the_initial_peers_when_alone():
    calls = []
    rep = reporter(calls, initial={"Boot": ["/ip4/127.0.0.1/tcp/9/p2p/Boot"]})
    rep.others = [record("a", "A"), record("b", "B"), record("home", "H", "nat")]
    rep._heal()
    assert list(calls[-1]) == ["Boot"]  # everybody visible: only the periodic ping of the initial peers
    rep._heal()
    assert len(calls) == 1  # not again before initial_every
    rep.others = [record("a", "A")]
    rep._heal()
    assert list(calls[-1]) == ["B"]  # b's record expired: dial it again (nobody can dial H, behind NAT)
    rep.others = []
    rep._heal()
    assert set(calls[-1]) == {"A", "B", "Boot"}  # alone: the initial peers too


def test_healing_waits_for_the_previous_attempt_and_forgets_old_peers():
    calls = []
    rep = reporter(calls)

    class Pending:
        def done(self):
            return False

    rep.reconnect = lambda peers: calls.append(peers) or Pending()
    rep.others = [record("a", "A")]
    rep._heal()
    rep.others = []
    rep._heal()
    rep._heal()
    assert len(calls) == 1  # the first attempt is still dialling
    rep._healing = Done()
    rep.known["A"] = (rep.known["A"][0], time.time() - 10 * rep.forget_after)
    rep._heal()
    assert len(calls) == 1  # A was last seen too long ago: not dialled forever


def test_the_initial_peers_are_dialled_now_and_then_so_a_restarted_bootstrap_finds_the_swarm():
    calls = []
    rep = reporter(calls, initial={"Boot": ["/ip4/127.0.0.1/tcp/9/p2p/Boot"]})
    rep.others = [record("a", "A")]
    rep._heal()
    assert list(calls[-1]) == ["Boot"]
    rep._last_initial -= rep.initial_every  # initial_every seconds later
    rep._heal()
    assert len(calls) == 2 and list(calls[-1]) == ["Boot"]


def test_a_nudge_publishes_and_reads_while_a_refresh_only_reads():
    """A DHT store costs far more than a read: an island waiting for the others' records reads them
    again soon without storing its own record each time; after its state changed it stores it."""

    class Board:
        timeout = 1.0

        def __init__(self):
            self.log = []

        def publish(self, record, ttl):
            self.log.append("publish")

        def read(self):
            self.log.append("read")
            return []

    board = Board()
    rep = Reporter(board=board, build_record=lambda state: state, period=30.0, ttl=60.0, fingerprint="f",
                   island="me", show=lambda others, tick: None, health=lambda: None, on_failure=lambda: None)
    rep.start()
    try:
        deadline = time.monotonic() + 5
        while board.log != ["publish", "read"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert board.log == ["publish", "read"]  # the first, periodic report
        rep.refresh()
        while len(board.log) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert board.log[2:] == ["read"]  # read again, nothing stored
        rep.nudge()
        while len(board.log) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert board.log[3:] == ["publish", "read"]
    finally:
        rep.stop()
