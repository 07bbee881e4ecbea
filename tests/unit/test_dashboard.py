"""The dashboard's pure logic (history, departed islands, Prometheus output, HTTP routes on a real
socket but without a swarm), the experiment log when off, and the pinned asset download."""

from __future__ import annotations

import io
import json
import tarfile
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer
from threading import Thread

import pytest
from prometheus_client.core import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from p2p_diloco import assets
from p2p_diloco.dashboard import SwarmCollector, SwarmHistory, _handler
from p2p_diloco.errors import ConfigError
from p2p_diloco.explog import ExperimentLog
from p2p_diloco.records import METRICS, IslandProgress, island_metrics


def record(island: str, tokens: int, t: float, *, loss=5.0, eval_loss=None, state="training", goodput=0.9):
    return IslandProgress(
        island=island, peer_id="Qm" + island, fingerprint="f", device="cpu", state=state, maddrs=[],
        inner_step=tokens // 2048, tokens=tokens, tokens_per_second=1000.0, loss=loss, eval_loss=eval_loss,
        fragment_versions=[1, 2], fragment_hashes=["a", "b"], rounds_ok=3, rounds_failed=1, rounds_rejected=0,
        flagged=[], bytes_sent=tokens * 10, bytes_received=tokens * 10, utilization=0.99, goodput=goodput,
        started=t - 10, time=t,
    )


def test_island_metrics_share_one_set_of_names():
    metrics = island_metrics(record("a", 4096, 100.0))
    assert set(metrics) == set(METRICS) - {"eval_loss"}  # no eval yet: left out, not logged as 0
    assert metrics["bytes_per_token"] == 10.0 and metrics["inner_step"] == 2.0
    assert island_metrics(record("a", 4096, 100.0, eval_loss=4.5))["eval_loss"] == 4.5


def test_history_follows_islands_coming_departing_and_dropped():
    history = SwarmHistory("run", points=3, departed_keep=10.0)
    history.update([record("a", 2048, 100.0), record("b", 4096, 100.0)], now=100.0)
    history.update([record("a", 4096, 101.0), record("b", 4096, 101.0, loss=4.0)], now=101.0)
    snap = history.snapshot(now=101.0)
    assert [i["island"] for i in snap["islands"]] == ["a", "b"] and not any(i["departed"] for i in snap["islands"])
    assert snap["totals"]["islands_alive"] == 2 and snap["totals"]["tokens_so_far"] == 8192
    assert snap["history"]["islands"]["a"]["tokens"] == [2048, 4096]
    assert snap["history"]["islands"]["b"] == {"tokens": [4096], "loss": [4.0], "eval_loss": [None]}  # same x: replaced
    # b's record is gone: departed, greyed, still counted in tokens so far
    history.update([record("a", 6144, 105.0)], now=105.0)
    snap = history.snapshot(now=107.0)
    b = snap["islands"][-1]
    assert b["island"] == "b" and b["departed"] and b["departed_s"] == 2.0
    assert snap["totals"]["islands_alive"] == 1 and snap["totals"]["tokens_so_far"] == 6144 + 4096
    # after departed_keep it is dropped; its tokens stay in the swarm's total
    history.update([record("a", 8192, 116.0)], now=116.0)
    snap = history.snapshot(now=116.0)
    assert [i["island"] for i in snap["islands"]] == ["a"] and "b" not in snap["history"]["islands"]
    assert snap["totals"]["tokens_so_far"] == 8192 + 4096
    assert snap["history"]["islands"]["a"]["tokens"] == [4096, 6144, 8192]  # bounded: the oldest point dropped
    assert len(snap["history"]["swarm"]["time"]) == 3


def test_history_a_returning_island_is_live_again_and_a_fresh_restart_starts_its_curve_over():
    history = SwarmHistory("run", departed_keep=60.0)
    history.update([record("a", 8192, 100.0)], now=100.0)
    history.update([], now=101.0)
    assert history.snapshot(now=101.0)["islands"][0]["departed"]
    history.update([record("a", 2048, 130.0)], now=130.0)  # restarted without a checkpoint
    snap = history.snapshot(now=130.0)
    assert not snap["islands"][0]["departed"] and snap["history"]["islands"]["a"]["tokens"] == [2048]


def test_prometheus_output_parses_with_prometheus_clients_own_parser():
    history = SwarmHistory("run")
    history.update([record("a", 4096, 100.0, eval_loss=4.5), record("b", 2048, 100.0)], now=100.0)
    history.update([record("a", 6144, 101.0, eval_loss=4.5)], now=101.0)  # b departed
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(history))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    up = {s.labels["island"]: s.value for s in families["p2p_diloco_island_up"].samples}
    assert up == {"a": 1.0, "b": 0.0}
    tokens = {s.labels["island"]: s.value for s in families["p2p_diloco_island_tokens"].samples}
    assert tokens == {"a": 6144.0, "b": 2048.0}
    assert [s.value for s in families["p2p_diloco_island_eval_loss"].samples] == [4.5]  # b has none
    assert families["p2p_diloco_swarm_islands_alive"].samples[0].value == 1.0
    assert families["p2p_diloco_swarm_tokens"].samples[0].value == 8192.0
    for name in METRICS:
        assert f"p2p_diloco_island_{name}" in families


@pytest.fixture
def server():
    history = SwarmHistory("run")
    history.update([record("a", 4096, 100.0)], now=100.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(history))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(history, registry, poll_seconds=1.0))
    Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def test_http_routes(server):
    code, kind, body = _get(server + "/api/status")
    assert code == 200 and kind == "application/json"
    status = json.loads(body)
    assert status["poll_seconds"] == 1.0 and status["islands"][0]["island"] == "a"
    code, kind, body = _get(server + "/metrics")
    assert code == 200 and kind.startswith("text/plain") and b"p2p_diloco_island_tokens" in body
    code, kind, body = _get(server + "/")
    assert code == 200 and kind.startswith("text/html") and b"/static/vendor/uPlot.iife.min.js" in body
    assert _get(server + "/static/dashboard.js")[0] == 200
    assert _get(server + "/static/../dashboard.py")[0] == 404  # nothing outside static/
    assert _get(server + "/static/%2e%2e/dashboard.py")[0] == 404
    assert _get(server + "/nope")[0] == 404


def test_experiment_log_off_does_nothing():
    log = ExperimentLog(run_id="run", island="a", config={})
    assert not log.enabled
    log.log(record("a", 2048, 1.0))
    log.close()


def test_tensorboard_dir_that_cannot_be_written_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="--tensorboard-dir"):
        ExperimentLog(run_id="run", island="a", config={}, tensorboard_dir=str(blocker))


def _tarball(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_fetch_checks_the_pinned_integrity(tmp_path, monkeypatch):
    data = _tarball({"package/dist/x.js": b"x()", "package/LICENSE": b"MIT"})
    source = tmp_path / "x.tgz"
    source.write_bytes(data)
    good = assets.NpmAsset("x", "1.0.0", assets._integrity(data), {"package/dist/x.js": "x.js"})
    monkeypatch.setattr(assets, "ASSETS", (good,))
    vendor = tmp_path / "vendor"
    assert assets.missing(vendor) == ["x.js"]
    with pytest.raises(ConfigError, match="missing"):
        assets.require(vendor)
    assert assets.fetch(str(source), vendor) == [vendor / "x.js"]
    assert (vendor / "x.js").read_bytes() == b"x()" and assets.missing(vendor) == []
    assert assets.fetch(None, vendor) == []  # present: no download
    bad = assets.NpmAsset("x", "1.0.0", "sha512-AAAA", {"package/dist/x.js": "x.js"})
    monkeypatch.setattr(assets, "ASSETS", (bad,))
    with pytest.raises(ConfigError, match="SHA-512 differs"):
        assets.fetch(str(source), tmp_path / "other")
    assert not (tmp_path / "other" / "x.js").exists()
    with pytest.raises(ConfigError, match="cannot read"):
        assets.fetch(str(tmp_path / "absent.tgz"), vendor)


def test_wandb_online_without_an_api_key_is_a_config_error_that_names_offline_mode(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    with pytest.raises(ConfigError, match="--wandb-mode offline"):
        ExperimentLog(run_id="run", island="a", config={}, wandb_project="p", wandb_mode="online")
