"""Bad input gets one clear line, a non-zero exit code and no traceback, and touches nothing."""

from __future__ import annotations

import time

import pytest

from p2p_diloco.lab.localswarm import LocalSwarm
from tests.integration.helpers import FAST, cli, events_of, status_json, wait_for

pytestmark = pytest.mark.integration
DEAD_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJaBkyHXEd1hiTKLR5bXgoHHmQYq1DD2vRU2d9UmijSan"


def _assert_clean_error(done, code: int, needle: str):
    assert done.returncode == code, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], done.stderr[-2000:]


def test_malformed_multiaddr():
    done = cli("peer", "--run-id", "r", "--island", "i", "--initial-peers", "garbage")
    _assert_clean_error(done, 2, "is not a multiaddr")
    done = cli("peer", "--run-id", "r", "--island", "i", "--initial-peers", "/ip4/127.0.0.1/tcp/1234")
    _assert_clean_error(done, 2, "lacks the peer id")


def test_invalid_config_value_names_the_field():
    done = cli("peer", "--run-id", "r", "--island", "i", "--inner-lr", "-1")
    _assert_clean_error(done, 2, "inner.lr (--inner-lr)")
    done = cli("peer", "--island", "i")
    _assert_clean_error(done, 2, "run_id (--run-id): is required")


def test_unreadable_data_path(tmp_path):
    done = cli("peer", "--run-id", "r", "--island", "i", "--data", str(tmp_path / "missing.txt"))
    _assert_clean_error(done, 2, "no such file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    done = cli("peer", "--run-id", "r", "--island", "i", "--data", str(bad))
    _assert_clean_error(done, 2, "not valid JSON")


def test_dead_initial_peers_give_a_clear_error_after_bounded_retries():
    started = time.monotonic()
    done = cli("peer", "--run-id", "r", "--island", "i", "--preset", "tiny", "--host-maddrs",
               "/ip4/127.0.0.1/tcp/0", "--initial-peers", DEAD_PEER, "--join-timeout", "4")
    _assert_clean_error(done, 3, "could not reach any initial peer")
    assert "retrying" in done.stderr and time.monotonic() - started < 90
    done = cli("status", "--run-id", "r", "--initial-peers", DEAD_PEER, "--join-timeout", "2")
    _assert_clean_error(done, 3, "could not reach any initial peer")


def test_second_bootstrap_on_a_port_in_use(tmp_path):
    swarm = LocalSwarm(tmp_path, run_id="ports")
    try:
        peers = swarm.start_bootstrap()
        port = peers[0].split("/tcp/")[1].split("/")[0]
        done = cli("bootstrap", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--identity-path",
                   str(tmp_path / "second.key"))
        _assert_clean_error(done, 3, f"port {port} is already in use")
        assert swarm.bootstrap.alive()
    finally:
        swarm.close()


def test_mismatched_fingerprint_is_refused_and_touches_nothing(tmp_path):
    swarm = LocalSwarm(tmp_path, run_id="fp")
    try:
        peers = swarm.start_bootstrap()
        swarm.start_island("good", *FAST)
        wait_for(lambda: events_of(swarm.events_path("good"), "round"), timeout=120, message="the island's rounds")
        done = cli("peer", "--run-id", "fp", "--island", "other", *FAST, "--model-num-layers", "2",
                   "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--initial-peers", *peers,
                   "--log-jsonl", str(tmp_path / "other.events.jsonl"))
        _assert_clean_error(done, 4, "fingerprint")
        islands = status_json(peers, "fp")["islands"]
        assert [i["island"] for i in islands] == ["good"]
        assert swarm.islands["good"].alive()
        assert all("other" not in e.get("members", []) for e in events_of(swarm.events_path("good"), "round"))
    finally:
        swarm.close()
