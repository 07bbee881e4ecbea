"""The live dashboard: a web page, ``/api/status`` (JSON) and ``/metrics`` (Prometheus) of one run.

Like ``p2p-diloco status`` it reads only the islands' signed DHT records (DESIGN.md, Observer); it
needs no GPU and holds no model. A poller thread reads the records every ``interval`` seconds into a
bounded in-memory :class:`SwarmHistory`; a threaded HTTP server (the standard library's) serves it:

- ``/``: the page (``static/dashboard.html``), which polls ``/api/status`` and draws its charts with
  uPlot, served from ``/static/vendor/`` (see :mod:`p2p_diloco.assets`; no CDN);
- ``/api/status``: :meth:`SwarmHistory.snapshot` as JSON;
- ``/metrics``: the same figures in Prometheus' text format, written by ``prometheus-client``.

An island whose record disappears (it expired: killed, frozen or cut off; or it was withdrawn: a
clean stop) stays on the page as *departed* for ``departed_keep`` seconds, then is dropped.
"""

from __future__ import annotations

import json
import logging
import mimetypes
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from prometheus_client.core import CollectorRegistry, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from p2p_diloco import assets
from p2p_diloco.config import DashboardConfig
from p2p_diloco.errors import NetworkError
from p2p_diloco.procs import StopSignal
from p2p_diloco.records import IslandProgress, ProgressBoard, island_metrics
from p2p_diloco.status import check_initial_peers, join_as_observer, swarm_snapshot

logger = logging.getLogger(__name__)


@dataclass
class _Island:
    record: IslandProgress
    departed: Optional[float] = None  # wall-clock time its record disappeared
    points: deque = field(default_factory=deque)  # (tokens, loss, eval_loss, time)


class SwarmHistory:
    """What the dashboard knows about a run: each island's latest record, a bounded history of its
    (tokens, loss, eval loss) and of the swarm's tokens/s, and which islands departed.

    :param points: at most this many points per island and for the swarm series (oldest dropped)
    :param departed_keep: seconds a departed island stays listed before it is dropped
    Thread-safe: the poller calls :meth:`update`, HTTP handlers call :meth:`snapshot`.
    """

    def __init__(self, run_id: str, *, points: int = 1000, departed_keep: float = 60.0):
        self.run_id, self.points, self.departed_keep = run_id, points, departed_keep
        self.islands: dict[str, _Island] = {}
        self.swarm: deque = deque(maxlen=points)  # (time, tokens/s, tokens so far, islands alive)
        self.dropped_tokens = 0  # tokens of islands already dropped from the page
        self.updated: Optional[float] = None
        self._lock = threading.Lock()

    def update(self, records: list[IslandProgress], now: Optional[float] = None) -> None:
        """Take one read of the run's records (every live island's latest one) at wall time ``now``."""
        now = time.time() if now is None else now
        with self._lock:
            live = {r.island: r for r in records}
            for name, record in live.items():
                entry = self.islands.get(name)
                if entry is None:
                    entry = self.islands[name] = _Island(record, points=deque(maxlen=self.points))
                if record.tokens < entry.record.tokens:  # restarted from scratch under the same name
                    entry.points.clear()
                entry.record, entry.departed = record, None
                point = (record.tokens, record.loss, record.eval_loss, round(record.time, 3))
                if entry.points and entry.points[-1][0] == record.tokens:
                    entry.points[-1] = point  # one point per token count (the charts' x must increase)
                else:
                    entry.points.append(point)
            for name, entry in list(self.islands.items()):
                if name in live:
                    continue
                if entry.departed is None:
                    entry.departed = now
                    logger.info("island %s departed (its record is gone)", name)
                elif now - entry.departed > self.departed_keep:
                    self.dropped_tokens += entry.record.tokens
                    del self.islands[name]
            training = [r for r in live.values() if r.state == "training"]
            self.swarm.append((round(now, 3), round(sum(r.tokens_per_second for r in training), 2),
                               self._tokens_so_far(), len(live)))
            self.updated = now

    def _tokens_so_far(self) -> int:
        return self.dropped_tokens + sum(entry.record.tokens for entry in self.islands.values())

    def snapshot(self, now: Optional[float] = None, history: bool = True) -> dict:
        """The JSON of ``/api/status``: ``islands`` (live ones as in ``status --json``, then departed
        ones with ``departed: true`` and ``departed_s``), ``totals`` (those of ``status --json`` plus
        ``islands_alive``, ``tokens_so_far`` and ``goodput``, the mean of the live islands' goodput),
        and, with ``history``, the chart data: per island ``tokens``, ``loss``, ``eval_loss``, and the
        swarm's ``time`` (unix seconds) and ``tokens_per_second``."""
        now = time.time() if now is None else now
        with self._lock:
            live = [e.record for e in self.islands.values() if e.departed is None]
            out = swarm_snapshot(live, self.run_id, now)
            for island in out["islands"]:
                island["departed"] = False
            for name, entry in sorted(self.islands.items()):
                if entry.departed is not None:
                    departed = swarm_snapshot([entry.record], self.run_id, now)["islands"][0]
                    out["islands"].append(departed | {"departed": True, "departed_s": round(now - entry.departed, 1)})
            out["totals"] |= {
                "islands_alive": len(live),
                "tokens_so_far": self._tokens_so_far(),
                "goodput": round(statistics.fmean(r.goodput for r in live), 4) if live else None,
            }
            out["updated"] = self.updated
            if history:
                out["history"] = {
                    "islands": {name: {"tokens": [p[0] for p in e.points], "loss": [p[1] for p in e.points],
                                       "eval_loss": [p[2] for p in e.points]}
                                for name, e in sorted(self.islands.items())},
                    "swarm": {"time": [s[0] for s in self.swarm], "tokens_per_second": [s[1] for s in self.swarm]},
                }
            return out


class SwarmCollector:
    """A ``prometheus-client`` collector of a :class:`SwarmHistory`: per island (labels ``run_id``,
    ``island``, ``device``) ``p2p_diloco_island_<metric>`` for every name of
    :data:`records.METRICS`, ``p2p_diloco_island_up`` (0 once departed) and
    ``p2p_diloco_island_last_seen_seconds``; for the swarm ``p2p_diloco_swarm_islands_alive``,
    ``_tokens_per_second``, ``_tokens`` (so far), ``_goodput``, ``_rounds_ok``, ``_rounds_failed``."""

    def __init__(self, history: SwarmHistory):
        self.history = history

    def collect(self):
        snapshot = self.history.snapshot(history=False)
        labels = ["run_id", "island", "device"]
        families: dict[str, GaugeMetricFamily] = {}

        def gauge(name: str, doc: str, label_names=labels) -> GaugeMetricFamily:
            if name not in families:
                families[name] = GaugeMetricFamily(f"p2p_diloco_{name}", doc, labels=label_names)
            return families[name]

        with self.history._lock:
            entries = {name: (e.record, e.departed) for name, e in self.history.islands.items()}
        for name, (record, departed) in sorted(entries.items()):
            values = [self.history.run_id, name, record.device]
            gauge("island_up", "1 while the island's record is live, 0 once it departed").add_metric(
                values, 0.0 if departed else 1.0)
            gauge("island_last_seen_seconds", "seconds since the island's latest record").add_metric(
                values, max(0.0, snapshot["time"] - record.time))
            for metric, value in island_metrics(record).items():
                gauge(f"island_{metric}", f"the island's {metric} (see DESIGN.md, DHT records)").add_metric(
                    values, value)
        totals = snapshot["totals"]
        for metric, key, doc in (
            ("swarm_islands_alive", "islands_alive", "islands with a live record"),
            ("swarm_tokens_per_second", "tokens_per_second", "tokens/s of the training islands"),
            ("swarm_tokens", "tokens_so_far", "tokens trained by every island seen"),
            ("swarm_goodput", "goodput", "mean goodput of the live islands"),
            ("swarm_rounds_ok", "rounds_ok", "outer rounds completed (live islands)"),
            ("swarm_rounds_failed", "rounds_failed", "outer rounds failed (live islands)"),
        ):
            if totals.get(key) is not None:
                gauge(metric, doc, ["run_id"]).add_metric([self.history.run_id], float(totals[key]))
        yield from families.values()


def _handler(history: SwarmHistory, registry: CollectorRegistry, poll_seconds: float) -> type:
    """The request handler class serving ``history`` (see the module docstring)."""

    class Handler(BaseHTTPRequestHandler):
        server_version = "p2p-diloco-dashboard"

        def do_GET(self):  # noqa: N802 (the standard library's name)
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._file(assets.STATIC / "dashboard.html")
            elif path.startswith("/static/"):
                target = (assets.STATIC / path[len("/static/"):]).resolve()
                if assets.STATIC.resolve() not in target.parents:
                    self._send(404, b"not found\n", "text/plain")
                else:
                    self._file(target)
            elif path == "/api/status":
                body = history.snapshot() | {"poll_seconds": poll_seconds}
                self._send(200, json.dumps(body).encode(), "application/json")
            elif path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            else:
                self._send(404, b"not found\n", "text/plain")

        def _file(self, target) -> None:
            if not target.is_file():
                self._send(404, b"not found\n", "text/plain")
                return
            kind = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
            self._send(200, target.read_bytes(), kind + ("; charset=utf-8" if kind.startswith("text/") else ""))

        def _send(self, code: int, body: bytes, kind: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # noqa: A002 (the standard library's signature)
            logger.debug("%s %s", self.address_string(), format % args)

    return Handler


class Dashboard:
    """Serve a run's dashboard from an already running DHT (the observer's, the bootstrap node's or
    the demo's), created with :func:`records.make_validators`'s validators.

    :param host: address to listen on (``0.0.0.0`` for every interface)
    :param port: TCP port; 0 picks a free one (see :attr:`url`)
    :param interval: seconds between two reads of the records
    :raises NetworkError: the port is taken or the address cannot be bound
    :raises ConfigError: uPlot's files are missing (run ``p2p-diloco fetch-assets``)
    """

    def __init__(self, dht, run_id: str, public_key: bytes, *, host: str = "127.0.0.1", port: int = 8080,
                 interval: float = 1.0, points: int = 1000, departed_keep: float = 60.0):
        assets.require()
        self.board = ProgressBoard(dht, run_id, public_key)
        self.history = SwarmHistory(run_id, points=points, departed_keep=departed_keep)
        self.interval = interval
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SwarmCollector(self.history))
        try:
            self.server = ThreadingHTTPServer((host, port), _handler(self.history, self.registry, interval))
        except OSError as e:
            raise NetworkError(f"the dashboard cannot listen on {host}:{port} ({e.strerror or e}); "
                               "pick another --port (0 takes a free one)") from None
        self.server.daemon_threads = True
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self.server.serve_forever, name="dashboard-http", daemon=True),
                         threading.Thread(target=self._poll, name="dashboard-poll", daemon=True)]

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}/"

    def start(self) -> "Dashboard":
        """Start the poller and the HTTP server threads."""
        for thread in self._threads:
            thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.history.update(self.board.read())
            except Exception as e:  # a bad record or a DHT hiccup must not stop the page
                logger.warning("reading the records failed: %r", e)
            self._stop.wait(self.interval)

    def close(self) -> None:
        """Stop serving and polling (in-flight requests finish on their daemon threads)."""
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        for thread in self._threads:
            thread.join(timeout=self.board.timeout + self.interval)


def run_dashboard(config: DashboardConfig, stop: StopSignal) -> None:
    """``p2p-diloco dashboard``: join the swarm as a client, serve until SIGINT/SIGTERM. Its first
    stdout line is ``DASHBOARD=<url>``.

    :raises UserError: no or bad --initial-peers, unreachable peers, the port is taken
    """
    check_initial_peers(config)
    assets.require()  # before joining the swarm: say both at once
    dht, public_key = join_as_observer(config, stop)
    try:
        dashboard = Dashboard(dht, config.run_id, public_key, host=config.host, port=config.port,
                              interval=config.interval, points=config.history, departed_keep=config.departed_keep)
        dashboard.start()
        try:
            print(f"DASHBOARD={dashboard.url}", flush=True)
            logger.info("dashboard of run %s at %s (metrics at %smetrics)", config.run_id, dashboard.url, dashboard.url)
            stop.event.wait()
        finally:
            dashboard.close()
    finally:
        dht.shutdown()
