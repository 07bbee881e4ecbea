"""The live dashboard against a real swarm on 127.0.0.1: a bootstrap node serving it
(``--dashboard-port 0``), a standalone ``p2p-diloco dashboard``, and two islands. JSON fields,
Prometheus parsing, a headless Chromium page; then two islands of the departure test's own: one
SIGKILLed (departed, then dropped) and one stopped cleanly (withdrawn) that logged to W&B (offline)
and TensorBoard.

The tests share one swarm (module fixture) and run in any order: its two islands stay up.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import time
import urllib.request
from pathlib import Path
from threading import Thread

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import browser
from p2p_diloco.observe.dashboard import SwarmHistory, make_server
from p2p_diloco.lab.localswarm import LocalSwarm
from p2p_diloco.net.records import METRICS
from tests.conftest import ROOT
from tests.integration.helpers import FAST, cli, wait_for
from tests.unit.test_dashboard import record

CPU_METRICS = set(METRICS) - {"mfu"}  # model FLOPs utilization: only on a GPU of known peak

pytestmark = pytest.mark.integration
ISLANDS = ["island-0", "island-1"]
ARTIFACTS = Path(os.environ.get("P2P_DILOCO_ARTIFACTS", ROOT / "runs" / "test-artifacts"))


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("dashboard")
    swarm = LocalSwarm(workdir, run_id="dash", env={"WANDB_DIR": str(workdir), "WANDB_SILENT": "true"})
    try:
        swarm.start_bootstrap("--dashboard-port", "0")
        for index, name in enumerate(ISLANDS):
            # evals every 5 steps and a flag at the first outlier round: the attacker test waits less
            swarm.start_island(name, *FAST, "--data-shard-index", str(index), "--eval-every", "5",
                               "--outer-outlier-rounds", "1")
        swarm.standalone_url = swarm.start_dashboard("--departed-keep", "4", "--interval", "0.5")
    except BaseException:
        swarm.close()
        raise
    yield swarm
    assert not swarm.close(), "processes had to be force-killed"


def _json(url: str) -> dict:
    with urllib.request.urlopen(url + "api/status", timeout=10) as response:
        return json.loads(response.read())


def _metrics(url: str) -> dict:
    with urllib.request.urlopen(url + "metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=")
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def _training(url: str, names=ISLANDS) -> dict | None:
    status = _json(url)
    islands = {i["island"]: i for i in status["islands"] if i["state"] == "training" and i["inner_step"] > 0}
    return status if set(names) <= set(islands) else None


def test_api_status_shows_every_live_island_with_its_fields(swarm):
    status = wait_for(lambda: _training(swarm.dashboard_url), timeout=120, message="2 training islands")
    for island in status["islands"]:
        for key in ("island", "device", "state", "inner_step", "tokens", "tokens_per_second", "loss", "eval_loss",
                    "fragment_versions", "rounds_ok", "rounds_failed", "utilization", "bytes_per_token",
                    "last_seen_s"):
            assert key in island, key
        assert island["departed"] is False and island["device"] == "cpu" and island["tokens"] > 0
    totals = status["totals"]
    assert totals["islands_alive"] >= 2 and totals["tokens_so_far"] >= sum(i["tokens"] for i in status["islands"])
    assert totals["tokens_per_second"] > 0 and 0 < totals["goodput"] <= 1
    history = status["history"]
    assert set(ISLANDS) <= set(history["islands"])
    for series in history["islands"].values():
        assert len(series["tokens"]) == len(series["loss"]) == len(series["eval_loss"]) >= 1
        assert series["tokens"] == sorted(set(series["tokens"]))  # the charts' x increases
    assert len(history["swarm"]["time"]) == len(history["swarm"]["tokens_per_second"]) >= 1
    # the standalone dashboard reads the same records
    assert wait_for(lambda: _training(swarm.standalone_url), timeout=60, message="the standalone dashboard")


def test_metrics_parse_with_prometheus_clients_parser(swarm):
    status = _json(swarm.dashboard_url)  # first: an eval loss, once there, stays
    families = _metrics(swarm.dashboard_url)
    up = {s.labels["island"]: s.value for s in families["p2p_diloco_island_up"].samples}
    assert all(up[name] == 1.0 for name in ISLANDS)
    for name in CPU_METRICS:
        if name != "eval_loss" or all(i["eval_loss"] is not None for i in status["islands"]):
            assert set(ISLANDS) <= {s.labels["island"] for s in families[f"p2p_diloco_island_{name}"].samples}, name
    assert families["p2p_diloco_swarm_islands_alive"].samples[0].value == sum(up.values()) >= 2
    assert families["p2p_diloco_swarm_tokens"].samples[0].value > 0
    assert families["p2p_diloco_swarm_tokens_per_second"].samples[0].labels == {"run_id": "dash"}


def test_a_taken_port_is_a_clear_error(swarm):
    port = swarm.standalone_url.rsplit(":", 1)[1].strip("/")
    done = cli("dashboard", "--initial-peers", *swarm.initial_peers, "--run-id", "dash", "--port", port, timeout=60)
    assert done.returncode == 3 and f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_page_renders_every_island_and_both_charts_and_updates_live(swarm):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with browser.chromium() as page:
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(swarm.dashboard_url)
        page.wait_for_function("window.dashboard && window.dashboard.updates >= 2", timeout=30_000)
        rows = dict(map(tuple, browser.rows(page)))
        assert all(rows.get(name) == "" for name in ISLANDS)
        colors = [browser.island_color(page, name) for name in ISLANDS]
        assert len(set(colors)) == len(ISLANDS)
        for name, color in zip(ISLANDS, colors):  # each island's loss curve is drawn in its colour
            assert browser.color_pixels(page, "loss", color) > 50, name
        assert browser.color_pixels(page, "speed", browser.SPEED_COLOR) > 50
        assert int(page.text_content("#t-islands")) >= 2
        started = time.monotonic()
        browser.wait_for_new_steps(page)  # a live update: new inner steps without a reload
        seconds = time.monotonic() - started
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        print(f"the page showed new inner steps {seconds:.1f} s later; screenshot in {ARTIFACTS}/dashboard.png")
        assert not errors, errors


def test_page_draws_sparse_and_faulty_records_without_errors():
    """No swarm: one island with a single point and no eval, one whose record carries a NaN loss (a
    faulty peer), one departed; the swarm series has one point. The page must draw all of it."""
    history = SwarmHistory("edge", misses=1)
    now = time.time()
    history.update([record("gone", 4096, now - 2)], now=now - 2)
    history.update([record("solo", 2048, now), record("faulty", 4096, now, loss=float("nan"))], now=now)
    server = make_server(history)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        with browser.chromium() as page:
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
            page.wait_for_function("window.dashboard && window.dashboard.updates >= 2", timeout=30_000)
            assert not errors and page.evaluate("window.dashboard.error") is None, errors
            assert browser.rows(page) == [["faulty", ""], ["gone", "departed"], ["solo", ""]]
            # a single point is drawn as a dot in the island's colour
            assert browser.color_pixels(page, "loss", browser.island_color(page, "solo")) > 5
            assert browser.color_pixels(page, "speed", browser.SPEED_COLOR) > 5
    finally:
        server.shutdown()
        server.server_close()


def _wandb_history(folder: Path) -> list[dict]:
    """The history rows of an offline W&B run file (``run-*.wandb``: LevelDB-style log records of 32 KiB
    blocks, each holding a ``wandb_internal_pb2.Record``)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, chunks, rows = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        chunks += data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def _events(swarm, name: str) -> list[dict]:
    path = swarm.events_path(name)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _island(url: str, name: str) -> dict | None:
    return next((i for i in _json(url)["islands"] if i["island"] == name), None)


def _evals(swarm, name: str) -> list[dict]:
    return [e for e in _events(swarm, name) if e.get("event") == "eval"]


def test_an_attacker_is_flagged_and_shown_then_killed_departs_and_a_stopped_island_withdraws_leaving_its_logs(swarm):
    """"victim" sends its updates reversed at the bound and claims a million times its weight (every
    value within the protocol's bounds: docs/SECURITY.md). The honest islands' eval loss still falls,
    they flag it as an outlier, and the dashboard shows why. Then it is SIGKILLed (departed, then
    dropped) while "quitter" is stopped cleanly (withdrawn) after logging to W&B and TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logging = ["--wandb-project", "itest", "--wandb-mode", "offline", "--tensorboard-dir", str(swarm.workdir / "tb")]
    # the honest islands' eval loss before it came
    before = wait_for(lambda: all(_evals(swarm, n) for n in ISLANDS) and {n: _evals(swarm, n)[-1] for n in ISLANDS},
                      timeout=120, message="the honest islands' evals")
    swarm.start_island("victim", *FAST, "--data-shard-index", "2", "--debug-attack", "flip+inflate")
    swarm.start_island("quitter", *FAST, "--data-shard-index", "3", *logging)
    wait_for(lambda: _training(swarm.dashboard_url, ["victim", "quitter"]), timeout=120, message="both training")
    reasons = wait_for(lambda: (r := _json(swarm.dashboard_url)["totals"]["flag_reasons"]).get("victim") and r,
                       timeout=90, message="the attacker flagged")
    assert reasons == {"victim": "outlier"}, reasons
    flags = [e for name in ISLANDS for e in _events(swarm, name) if e.get("event") == "flag"]
    assert {(e["culprit"], e["reason"]) for e in flags} <= {("victim", "outlier"), ("victim", "adopted")}, flags
    flagged = {s.labels["island"]: s.labels["reason"] for s in
               _metrics(swarm.dashboard_url)["p2p_diloco_swarm_island_flagged"].samples}
    assert flagged == {"victim": "outlier"}
    with browser.chromium() as page:
        page.goto(swarm.dashboard_url)
        page.wait_for_function("window.dashboard && window.dashboard.updates >= 1", timeout=30_000)
        assert page.text_content("#t-flagged") == "victim (outlier)"
    # its rounds with the honest islands were ok (every value passed the checks; where it was one of only
    # 2 contributors, the result was cut short, and an honest member whose update it reversed did not
    # apply it: docs/SECURITY.md, "Updates against our own"); their eval loss is below its level before the
    # attacker within 6 evals (30 inner steps) of the flag. (3 evals were too few in one CI run: island-0,
    # hit by a pair round with the attacker, was at 6.01 against 5.99 before it, and island-1 at 5.65)
    flagged_at = max(e["t"] for e in flags)
    window = 6

    def evals_after(n):
        return [e for e in _evals(swarm, n) if e["t"] > flagged_at][:window]

    after = wait_for(lambda: all(len(evals_after(n)) == window or any(e["eval_loss"] < before[n]["eval_loss"]
                                                                 for e in evals_after(n)) for n in ISLANDS)
                     and {n: min(evals_after(n), key=lambda e: e["eval_loss"]) for n in ISLANDS},
                     timeout=150, message="evals after the flag")
    attacked = [e for name in ISLANDS for e in _events(swarm, name)
                if e.get("event") == "round" and "victim" in e.get("members", [])]
    assert attacked and all(e["outcome"] == "ok" or e["outcome"] == "rejected" and e.get("vetoed")
                            for e in attacked), attacked
    print("eval loss before the attacker, after it was flagged:",
          {n: (before[n]["eval_loss"], after[n]["eval_loss"]) for n in ISLANDS}, f"{len(attacked)} rounds with it",
          f"({sum(bool(e.get('halvings')) for e in attacked)} of them cut short, "
          f"{sum(bool(e.get('vetoed')) for e in attacked)} not applied)")
    assert all(after[n]["eval_loss"] < before[n]["eval_loss"] for n in ISLANDS)
    swarm.islands["victim"].signal(signal.SIGKILL)
    killed = time.monotonic()
    quitter = swarm.islands["quitter"]
    os.killpg(quitter.pid, signal.SIGINT)  # what Ctrl+C in its terminal sends
    assert quitter.popen.wait(60) == 0
    # withdrawn at exit: the dashboard saw it go while its last record was younger than the TTL (6 s)
    gone = wait_for(lambda: (_island(swarm.dashboard_url, "quitter") or {}).get("departed") and
                    _island(swarm.dashboard_url, "quitter"), timeout=30, interval=0.5, message="quitter departed")
    assert gone["last_seen_s"] - gone["departed_s"] < 6, gone
    # a killed island's record expires: greyed out as departed, then dropped
    wait_for(lambda: (_island(swarm.dashboard_url, "victim") or {}).get("departed"), timeout=30,
             message="victim departed")
    print(f"victim shown as departed {time.monotonic() - killed:.1f} s after SIGKILL (record TTL 6 s)")
    up = {s.labels["island"]: s.value for s in _metrics(swarm.dashboard_url)["p2p_diloco_island_up"].samples}
    assert up == {"island-0": 1.0, "island-1": 1.0, "victim": 0.0, "quitter": 0.0}
    assert _json(swarm.dashboard_url)["totals"]["islands_alive"] == 2
    with browser.chromium() as page:
        page.goto(swarm.dashboard_url)
        page.wait_for_function("window.dashboard && window.dashboard.updates >= 1", timeout=30_000)
        assert sorted(browser.rows(page)) == [["island-0", ""], ["island-1", ""], ["quitter", "departed"],
                                              ["victim", "departed"]]
        page.screenshot(path=str(ARTIFACTS / "dashboard_departed.png"), full_page=True)
    # the standalone dashboard keeps departed islands 4 s, then drops them
    wait_for(lambda: sorted(i["island"] for i in _json(swarm.standalone_url)["islands"]) == ISLANDS, timeout=40,
             message="the departed islands dropped from the standalone dashboard")
    # it joined a training swarm: its state came from peers; a stop is no failed round
    summary = swarm.summary("quitter")
    assert summary["stop_reason"] == "signal" and summary["state_downloads"] >= 2
    rounds = [e for e in _events(swarm, "quitter") if e.get("event") == "round"]
    assert summary["outer_rounds_failed"] == sum(e["outcome"] == "fallback" for e in rounds)
    # what it logged: the dashboard's metric names, its last values those of its summary
    rows = _wandb_history(swarm.workdir)
    logged = {key for row in rows for key in row if not key.startswith("_")}
    assert logged == CPU_METRICS  # the dashboard's names, eval loss included
    assert rows[-1]["tokens"] == summary["tokens"] and rows[-1]["inner_step"] == summary["inner_steps"]
    assert [row["_step"] for row in rows] == sorted(row["_step"] for row in rows)
    events = EventAccumulator(str(swarm.workdir / "tb" / "dash" / "quitter"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == CPU_METRICS
    assert events.Scalars("tokens")[-1].value == summary["tokens"]
