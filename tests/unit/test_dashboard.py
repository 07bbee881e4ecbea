"""The dashboard's pure logic (history, departed islands, Prometheus output, HTTP routes on a real
socket but without a swarm), the experiment log when off, and the pinned asset download."""

from __future__ import annotations

import io
import json
import tarfile
import time
import urllib.error
import urllib.request
from threading import Thread

import pytest
from prometheus_client.core import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from p2p_diloco.observe import assets
from p2p_diloco.observe.dashboard import Dashboard, SwarmCollector, SwarmHistory, make_server
from p2p_diloco.errors import ConfigError, NetworkError
from p2p_diloco.island.explog import ExperimentLog
from p2p_diloco.net.records import METRICS, IslandProgress, island_metrics


def record(island: str, tokens: int, t: float, *, loss=5.0, eval_loss=None, state="training", goodput=0.9):
    return IslandProgress(
        island=island, peer_id="Qm" + island, fingerprint="f", device="cpu", state=state, maddrs=[],
        inner_step=tokens // 2048, tokens=tokens, tokens_per_second=1000.0, loss=loss, eval_loss=eval_loss,
        fragment_versions=[1, 2], fragment_hashes=["a", "b"], rounds_ok=3, rounds_failed=1, rounds_rejected=0,
        flagged=[], bytes_sent=tokens * 10, bytes_received=tokens * 10, utilization=0.99, goodput=goodput,
        started=t - 10, time=t,
    )


def test_island_metrics_share_one_set_of_names():
    metrics = island_metrics(record("a", 4096, 100.0).dict())
    assert set(metrics) == set(METRICS) - {"eval_loss", "mfu"}  # no eval yet, no GPU: left out, not logged as 0
    assert metrics["bytes_per_token"] == 10.0 and metrics["inner_step"] == 2.0
    assert island_metrics(record("a", 4096, 100.0, eval_loss=4.5).dict())["eval_loss"] == 4.5
    assert island_metrics(record("a", 4096, 100.0).dict() | {"mfu": 0.41})["mfu"] == 0.41  # a GPU's
    assert "loss" not in island_metrics(record("a", 4096, 100.0, loss=float("nan")).dict())


def test_history_follows_islands_coming_departing_and_dropped():
    history = SwarmHistory("run", points=4, departed_keep=10.0)
    history.update([record("b", 4096, 100.0), record("a", 2048, 100.0)], now=100.0)
    history.update([record("a", 4096, 101.0), record("b", 4096, 101.0, loss=4.0)], now=101.0)
    snap = history.snapshot(now=101.0)
    assert [i["key"] for i in snap["islands"]] == ["a", "b"] and not any(i["departed"] for i in snap["islands"])
    assert snap["totals"]["islands_alive"] == 2 and snap["totals"]["tokens_so_far"] == 8192
    assert snap["history"]["islands"]["a"]["tokens"] == [2048, 4096]
    assert snap["history"]["islands"]["b"] == {"tokens": [4096], "loss": [4.0], "eval_loss": [None]}  # same x: replaced
    # one read without b's record is not enough (a read can miss a live record); two are
    history.update([record("a", 6144, 104.0)], now=104.0)
    assert not history.snapshot(now=104.0)["islands"][1]["departed"]
    history.update([record("a", 8192, 105.0)], now=105.0)
    snap = history.snapshot(now=107.0)
    b = snap["islands"][-1]
    assert b["key"] == "b" and b["departed"] and b["departed_s"] == 2.0
    assert snap["totals"]["islands_alive"] == 1 and snap["totals"]["tokens_so_far"] == 8192 + 4096
    # after departed_keep it is dropped; its tokens stay in the swarm's total
    history.update([record("a", 10240, 116.0)], now=116.0)
    snap = history.snapshot(now=116.0)
    assert [i["key"] for i in snap["islands"]] == ["a"] and "b" not in snap["history"]["islands"]
    assert snap["totals"]["tokens_so_far"] == 10240 + 4096
    # bounded: when full, the older half is thinned, so the curve still starts at the run's start
    assert snap["history"]["islands"]["a"]["tokens"] == [2048, 6144, 8192, 10240]
    assert len(snap["history"]["swarm"]["time"]) <= 4 and snap["history"]["swarm"]["time"][0] == 100.0
    # b comes back, resumed from a checkpoint: its tokens are not counted twice
    history.update([record("a", 10240, 117.0), record("b", 6144, 117.0)], now=117.0)
    assert history.snapshot(now=117.0)["totals"]["tokens_so_far"] == 10240 + 6144


def test_history_restarts_and_two_peers_claiming_one_name():
    history = SwarmHistory("run", departed_keep=60.0)
    history.update([record("a", 8192, 100.0)], now=100.0)
    history.update([record("a", 2048, 130.0)], now=130.0)  # restarted from scratch: a new life
    snap = history.snapshot(now=130.0)
    assert snap["history"]["islands"]["a"]["tokens"] == [2048] and snap["totals"]["tokens_so_far"] == 8192 + 2048
    history.update([record("a", 4096, 131.0)], now=131.0)
    twin = record("a", 1024, 131.0).copy(update={"peer_id": "QmOther"})
    history.update([record("a", 6144, 132.0), twin], now=132.0)
    keys = [i["key"] for i in history.snapshot(now=132.0)["islands"]]
    assert "a@mOther" in keys and "a@Qma" in keys  # one row each, not one row flipping between them


def test_non_finite_numbers_become_null_in_the_json():
    history = SwarmHistory("run")
    history.update([record("a", 4096, 100.0, loss=float("nan"), eval_loss=float("inf"))], now=100.0)
    text = json.dumps(history.snapshot(now=100.0), allow_nan=False)  # raises on NaN
    island = json.loads(text)["islands"][0]
    assert island["loss"] is None and island["eval_loss"] is None


def test_prometheus_output_parses_with_prometheus_clients_own_parser():
    history = SwarmHistory("run", misses=1)
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
    for name in set(METRICS) - {"mfu"}:  # (no island here has a GPU: a family without samples is left out)
        assert f"p2p_diloco_island_{name}" in families


@pytest.fixture
def server():
    history = SwarmHistory("run")
    history.update([record("a", 4096, 100.0)], now=100.0)
    httpd = make_server(history)
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
    assert status["poll_seconds"] == 1.0 and status["islands"][0]["island"] == "a" and "history" in status
    assert "history" not in json.loads(_get(server + "/api/status?history=0")[2])
    code, kind, body = _get(server + "/metrics")
    assert code == 200 and kind.startswith("text/plain") and b"p2p_diloco_island_tokens" in body
    code, kind, body = _get(server + "/")
    assert code == 200 and kind.startswith("text/html") and b"/static/vendor/uPlot.iife.min.js" in body
    assert _get(server + "/static/dashboard.js")[0] == 200
    assert _get(server + "/static/../dashboard.py")[0] == 404  # nothing outside static/
    assert _get(server + "/static/%2e%2e/dashboard.py")[0] == 404
    assert _get(server + "/nope")[0] == 404
    assert _get(server + "/static/a%00b")[0] == 404
    head = urllib.request.Request(server + "/api/status", method="HEAD")
    with urllib.request.urlopen(head, timeout=10) as response:
        assert response.status == 200 and response.read() == b""


class FakeBoard:
    """A board whose reads fail (None) until told otherwise."""

    timeout = 1.0

    def __init__(self):
        self.records, self.reads = None, 0

    def try_read(self):
        self.reads += 1
        return self.records


def test_dashboard_lifecycle_and_failed_reads():
    dashboard = Dashboard("run", port=0, interval=0.05)
    dashboard.close()  # before start: returns at once
    dashboard.close()
    board = FakeBoard()
    dashboard = Dashboard("run", port=0, interval=0.05).start(board)
    try:
        dashboard.history.update([record("a", 4096, time.time())])
        wait = time.monotonic() + 10
        while board.reads < 10 and time.monotonic() < wait:
            time.sleep(0.05)
        assert board.reads >= 10  # ten failed reads: nobody departs on "no answer"
        assert not dashboard.history.snapshot()["islands"][0]["departed"]
        board.records = []  # an answer: nobody is there any more
        wait = time.monotonic() + 10
        while not dashboard.history.snapshot()["islands"][0]["departed"] and time.monotonic() < wait:
            time.sleep(0.05)
        assert dashboard.history.snapshot()["islands"][0]["departed"]
        status, _, _ = _get(dashboard.url + "api/status")
        assert status == 200
    finally:
        dashboard.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(dashboard.url + "api/status", timeout=2)


def test_a_taken_port_is_a_network_error_naming_the_flag():
    first = Dashboard("run", port=0)
    try:
        port = first.server.server_address[1]
        with pytest.raises(NetworkError, match=f"127.0.0.1:{port}.*--dashboard-port"):
            Dashboard("run", port=port, flag="--dashboard-port")
    finally:
        first.close()


def test_experiment_log_off_does_nothing():
    log = ExperimentLog(run_id="run", island="a", config={})
    assert not log.enabled
    log.log(record("a", 2048, 1.0))
    log.close()


def test_tensorboard_dir_that_cannot_be_written_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="--tensorboard-dir .* cannot write"):
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
