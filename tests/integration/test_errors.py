"""Bad input gets one clear line, a non-zero exit code and no traceback, and touches nothing."""

from __future__ import annotations

import time

import pytest

from p2p_diloco.lab.localswarm import LocalSwarm
from tests.integration.helpers import assert_clean_error, cli

pytestmark = pytest.mark.integration
DEAD_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJaBkyHXEd1hiTKLR5bXgoHHmQYq1DD2vRU2d9UmijSan"


def test_malformed_multiaddr():
    done = cli("peer", "--run-id", "r", "--island", "i", "--initial-peers", "garbage")
    assert_clean_error(done, 2, "is not a multiaddr")
    done = cli("peer", "--run-id", "r", "--island", "i", "--initial-peers", "/ip4/127.0.0.1/tcp/1234")
    assert_clean_error(done, 2, "lacks the peer id")


def test_invalid_config_value_names_the_field():
    done = cli("peer", "--run-id", "r", "--island", "i", "--inner-lr", "-1")
    assert_clean_error(done, 2, "inner.lr (--inner-lr)")
    done = cli("peer", "--island", "i")
    assert_clean_error(done, 2, "run_id (--run-id): is required")


def test_unreadable_data_path(tmp_path):
    done = cli("peer", "--run-id", "r", "--island", "i", "--data", str(tmp_path / "missing.txt"))
    assert_clean_error(done, 2, "no such file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    done = cli("peer", "--run-id", "r", "--island", "i", "--data", str(bad))
    assert_clean_error(done, 2, "not valid JSON")


def test_dead_initial_peers_give_a_clear_error_after_bounded_retries():
    started = time.monotonic()
    done = cli("peer", "--run-id", "r", "--island", "i", "--preset", "tiny", "--host-maddrs",
               "/ip4/127.0.0.1/tcp/0", "--initial-peers", DEAD_PEER, "--join-timeout", "4")
    assert_clean_error(done, 3, "could not reach any initial peer")
    assert "retrying" in done.stderr and time.monotonic() - started < 90
    done = cli("status", "--run-id", "r", "--initial-peers", DEAD_PEER, "--join-timeout", "2")
    assert_clean_error(done, 3, "could not reach any initial peer")


def test_second_bootstrap_on_a_port_in_use(tmp_path):
    swarm = LocalSwarm(tmp_path, run_id="ports")
    try:
        peers = swarm.start_bootstrap()
        port = peers[0].split("/tcp/")[1].split("/")[0]
        done = cli("bootstrap", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--identity-path",
                   str(tmp_path / "second.key"))
        assert_clean_error(done, 3, f"port {port} is already in use")
        assert swarm.bootstrap.alive()
    finally:
        swarm.close()
