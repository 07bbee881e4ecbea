"""The live dashboard: a web page, ``/api/status`` (JSON) and ``/metrics`` (Prometheus) of one run.

Like ``p2p-diloco status`` it reads only the islands' signed DHT records (docs/DESIGN.md, "Roles"); it
needs no GPU and holds no model. A poller thread reads the records every ``interval`` seconds into a
bounded in-memory :class:`SwarmHistory`; a threaded HTTP server (the standard library's) serves it:

- ``/``: the page (``static/dashboard.html``), which polls ``/api/status`` and draws its charts with
  uPlot, served from ``/static/vendor/`` (see :mod:`p2p_diloco.observe.assets`; no CDN);
- ``/api/status``: :meth:`SwarmHistory.snapshot` as JSON (``?history=0``: without the charts' data);
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
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from prometheus_client.core import CollectorRegistry, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from p2p_diloco.observe import assets
from p2p_diloco.config import DashboardConfig
from p2p_diloco.errors import NetworkError
from p2p_diloco.procs import StopSignal
from p2p_diloco.net.records import IslandProgress, finite_or_none, island_metrics
from p2p_diloco.observe.status import check_initial_peers, island_row, join_as_observer, swarm_snapshot

logger = logging.getLogger(__name__)


@dataclass
class _Island:
    record: IslandProgress
    departed: Optional[float] = None  # wall-clock time the dashboard found its record gone
    missed: int = 0  # reads in a row without its record
    points: list = field(default_factory=list)  # (tokens, loss, eval_loss), tokens increasing


def _history_row(key: str, island: _Island, now: float) -> dict:
    """One row of ``/api/status``: the island's ``status --json`` row, its ``key`` and ``departed``,
    and once departed, ``departed_s`` (seconds since)."""
    row = island_row(island.record, now) | {"key": key, "departed": island.departed is not None}
    if island.departed is not None:
        row["departed_s"] = round(now - island.departed, 1)
    return row


def _thin(series: list, limit: int) -> None:
    """Keep ``series`` within ``limit`` items by dropping every other one of its older half: the whole
    run stays visible, at a coarser resolution the longer it runs."""
    if len(series) > limit:
        half = len(series) // 2
        series[:half] = series[:half:2]


class SwarmHistory:
    """What the dashboard knows about a run: each island's latest record, a bounded history of its
    (tokens, loss, eval loss) and of the swarm's tokens/s, and which islands departed.

    Islands are keyed by name (a restarted island continues its row and curve); two live peers that
    claim one name get a row each, ``name@<peer id tail>``.

    :param points: at most this many points per island and in the swarm series; older points are
        thinned, not dropped, so a chart always spans the whole run
    :param departed_keep: seconds a departed island stays listed before it is dropped
    :param misses: reads in a row without an island's record before it counts as departed (one read
        can miss a record that is alive)
    Thread-safe: the poller calls :meth:`update`, HTTP handlers call :meth:`snapshot`.
    """

    def __init__(self, run_id: str, *, points: int = 1000, departed_keep: float = 60.0, misses: int = 2):
        self.run_id, self.points, self.departed_keep, self.misses = run_id, points, departed_keep, misses
        self.islands: dict[str, _Island] = {}
        self.swarm: list = []  # (time, swarm tokens/s)
        self.tokens: dict[str, list[int]] = {}  # key -> [tokens of its earlier lives, of its current one]
        self.updated: Optional[float] = None
        self._lock = threading.Lock()

    def update(self, records: list[IslandProgress], now: Optional[float] = None) -> None:
        """Take one successful read of the run's records (every live island's latest one) at wall
        time ``now`` (a failed read must not be passed: it would look like every island left)."""
        now = time.time() if now is None else now
        names = Counter(r.island for r in records)
        live = {(r.island if names[r.island] == 1 else f"{r.island}@{r.peer_id[-6:]}"): r for r in records}
        with self._lock:
            for key, record in live.items():
                entry = self.islands.setdefault(key, _Island(record))
                counted = self.tokens.setdefault(key, [0, 0])
                if record.tokens < counted[1]:  # a new life: restarted from scratch or an older checkpoint
                    counted[0] += counted[1]
                counted[1] = record.tokens
                while entry.points and entry.points[-1][0] >= record.tokens:
                    entry.points.pop()  # one point per token count, increasing (the charts' x)
                entry.points.append((record.tokens, finite_or_none(record.loss), finite_or_none(record.eval_loss)))
                _thin(entry.points, self.points)
                entry.record, entry.departed, entry.missed = record, None, 0
            for key, entry in list(self.islands.items()):
                if key in live:
                    continue
                entry.missed += 1
                if entry.departed is None and entry.missed >= self.misses:
                    entry.departed = now
                    logger.info("island %s departed (its record is gone)", key)
                elif entry.departed is not None and now - entry.departed > self.departed_keep:
                    del self.islands[key]
            training = [r for r in live.values() if r.state == "training"]
            speed = sum(finite_or_none(r.tokens_per_second) or 0.0 for r in training)
            self.swarm.append((round(now, 3), round(speed, 2)))
            _thin(self.swarm, self.points)
            self.updated = now

    def snapshot(self, now: Optional[float] = None, history: bool = True) -> dict:
        """The JSON of ``/api/status``: ``islands`` (as in ``status --json``, sorted, each with its
        row ``key``, ``departed`` and, once departed, ``departed_s``), ``totals`` (those of ``status
        --json`` for the live islands plus ``islands_alive``, ``tokens_so_far`` (every island seen,
        earlier lives included) and ``goodput`` (mean over live islands)), ``updated`` (time of the
        latest read) and, with ``history``, the charts' data: per island ``tokens``, ``loss``,
        ``eval_loss``, and the swarm's ``time`` (unix seconds) and ``tokens_per_second``. Non-finite
        numbers are null."""
        now = time.time() if now is None else now
        with self._lock:
            entries = sorted(self.islands.items())
            live = [e.record for _, e in entries if e.departed is None]
            out = swarm_snapshot(live, self.run_id, now)  # its totals; rows for live and departed below
            out["islands"] = [_history_row(key, entry, now) for key, entry in entries]
            goodput = [g for g in (finite_or_none(r.goodput) for r in live) if g is not None]
            out["totals"] |= {
                "islands_alive": len(live),
                "tokens_so_far": sum(base + current for base, current in self.tokens.values()),
                "goodput": round(statistics.fmean(goodput), 4) if goodput else None,
            }
            out["updated"] = self.updated
            if history:
                out["history"] = {
                    "islands": {key: {"tokens": [p[0] for p in e.points], "loss": [p[1] for p in e.points],
                                      "eval_loss": [p[2] for p in e.points]} for key, e in entries},
                    "swarm": {"time": [p[0] for p in self.swarm], "tokens_per_second": [p[1] for p in self.swarm]},
                }
            return out


class SwarmCollector:
    """A ``prometheus-client`` collector of a :class:`SwarmHistory`: per island (labels ``run_id``,
    ``island`` (its row key), ``device``) ``p2p_diloco_island_<metric>`` for every name of
    :data:`records.METRICS`, ``p2p_diloco_island_up`` (0 once departed) and
    ``p2p_diloco_island_last_seen_seconds``; for the swarm ``p2p_diloco_swarm_islands_alive``,
    ``_tokens_per_second``, ``_tokens`` (so far), ``_goodput``, ``_rounds_ok``, ``_rounds_failed``,
    ``_peers_refused`` and ``_island_flagged`` (1 per flagged island, labels ``island`` and ``reason``).
    All are gauges: an island's counts restart with it."""

    def __init__(self, history: SwarmHistory):
        self.history = history

    def collect(self):
        snapshot = self.history.snapshot(history=False)  # one consistent view
        run_id, families = self.history.run_id, {}

        def gauge(name: str, doc: str, labels=("run_id", "island", "device")) -> GaugeMetricFamily:
            if name not in families:
                families[name] = GaugeMetricFamily(f"p2p_diloco_{name}", doc, labels=list(labels))
            return families[name]

        for island in snapshot["islands"]:
            labels = [run_id, island["key"], island["device"]]
            gauge("island_up", "1 while the island's record is live, 0 once it departed").add_metric(
                labels, 0.0 if island["departed"] else 1.0)
            gauge("island_last_seen_seconds", "seconds since the island's latest record").add_metric(
                labels, island["last_seen_s"])
            for metric, value in island_metrics(island).items():
                gauge(f"island_{metric}", f"the island's {metric}, from its signed progress record").add_metric(
                    labels, value)
        totals = snapshot["totals"]
        for metric, key, doc in (
            ("swarm_islands_alive", "islands_alive", "islands with a live record"),
            ("swarm_tokens_per_second", "tokens_per_second", "tokens/s of the training islands"),
            ("swarm_tokens", "tokens_so_far", "tokens trained by every island seen"),
            ("swarm_goodput", "goodput", "mean goodput of the live islands"),
            ("swarm_rounds_ok", "rounds_ok", "outer rounds completed (live islands)"),
            ("swarm_rounds_failed", "rounds_failed", "outer rounds failed (live islands)"),
            ("swarm_peers_refused", "refused", "peers the live islands refused admission (a private run)"),
        ):
            if totals.get(key) is not None:
                gauge(metric, doc, ["run_id"]).add_metric([run_id], float(totals[key]))
        flagged = gauge("swarm_island_flagged", "1 for each island the live islands flagged, with why (docs/SECURITY.md)",
                        ["run_id", "island", "reason"])
        for name, reason in totals.get("flag_reasons", {}).items():
            flagged.add_metric([run_id, name, reason], 1.0)
        yield from families.values()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a client that went away: not worth a traceback
        logger.debug("request from %s failed", client_address, exc_info=True)


def _handler(history: SwarmHistory, registry: CollectorRegistry, poll_seconds: float) -> type:
    """The request handler class serving ``history`` (see the module docstring)."""

    class Handler(BaseHTTPRequestHandler):
        server_version = "p2p-diloco-dashboard"
        timeout = 30  # seconds an idle connection may hold its thread

        def do_GET(self, head: bool = False):  # noqa: N802 (the standard library's name)
            path, _, query = self.path.partition("?")
            if path in ("/", "/index.html"):
                self._file(assets.STATIC / "dashboard.html", head)
            elif path.startswith("/static/"):
                self._file(assets.STATIC / path[len("/static/"):], head)
            elif path == "/api/status":
                body = history.snapshot(history="history=0" not in query.split("&")) | {"poll_seconds": poll_seconds}
                self._send(200, json.dumps(body, allow_nan=False).encode(), "application/json", head)
            elif path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST, head)
            else:
                self._send(404, b"not found\n", "text/plain", head)

        def do_HEAD(self):  # noqa: N802
            self.do_GET(head=True)

        def _file(self, target, head: bool) -> None:
            try:
                target = target.resolve()
                found = assets.STATIC.resolve() in target.parents and target.is_file()
            except (OSError, ValueError):  # a NUL byte, a name too long
                found = False
            if not found:  # nothing outside static/ is served
                self._send(404, b"not found\n", "text/plain", head)
                return
            kind = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
            self._send(200, target.read_bytes(), kind + ("; charset=utf-8" if kind.startswith("text/") else ""), head)

        def _send(self, code: int, body: bytes, kind: str, head: bool = False) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def log_message(self, format, *args):  # noqa: A002 (the standard library's signature)
            logger.debug("%s %s", self.address_string(), format % args)

    return Handler


def make_server(history: SwarmHistory, host: str = "127.0.0.1", port: int = 0,
                poll_seconds: float = 1.0) -> ThreadingHTTPServer:
    """A bound (not yet serving) HTTP server of ``history``: the page, ``/api/status`` and ``/metrics``.

    :raises OSError: the address cannot be bound
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(history))
    return _Server((host, port), _handler(history, registry, poll_seconds))


class Dashboard:
    """A run's dashboard: binds its HTTP server at once (so a taken port is reported before anything
    else starts), then serves the records of a :class:`records.ProgressBoard` given to :meth:`start`.

    :param host: address to listen on (``0.0.0.0`` for every interface)
    :param port: TCP port; 0 picks a free one (see :attr:`url`)
    :param interval: seconds between two reads of the records
    :param flag: the command-line flag that set ``port`` (named in the error)
    :raises NetworkError: the port is taken or the address cannot be bound
    :raises ConfigError: uPlot's files are missing (run ``p2p-diloco fetch-assets``)
    """

    def __init__(self, run_id: str, *, host: str = "127.0.0.1", port: int = 8080, interval: float = 1.0,
                 points: int = 1000, departed_keep: float = 60.0, flag: str = "--port"):
        assets.require()
        self.history = SwarmHistory(run_id, points=points, departed_keep=departed_keep)
        self.interval = interval
        try:
            self.server = make_server(self.history, host, port, interval)
        except OSError as e:
            raise NetworkError(f"the dashboard cannot listen on {host}:{port} ({e.strerror or e}); "
                               f"pick another {flag} (0 takes a free one) or check the address") from None
        self.board = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}/"

    def start(self, board) -> "Dashboard":
        """Serve ``board``'s records (anything with ``try_read() -> list | None`` and ``timeout``)."""
        self.board = board
        self._threads = [threading.Thread(target=self.server.serve_forever, name="dashboard-http", daemon=True),
                         threading.Thread(target=self._poll, name="dashboard-poll", daemon=True)]
        for thread in self._threads:
            thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                records = self.board.try_read()
                if records is not None:  # no answer is not "every island left"
                    self.history.update(records)
            except Exception as e:  # a bad record must not stop the page
                logger.warning("reading the records failed: %r", e)
            self._stop.wait(self.interval)

    def close(self) -> None:
        """Stop serving and polling (in-flight requests finish on their daemon threads). Safe to call
        before :meth:`start` and more than once."""
        self._stop.set()
        if self._threads:
            self.server.shutdown()
        self.server.server_close()
        for thread in self._threads:
            thread.join(timeout=getattr(self.board, "timeout", 10.0) + self.interval)
        self._threads = []


def run_dashboard(config: DashboardConfig, stop: StopSignal) -> None:
    """``p2p-diloco dashboard``: bind the port, join the swarm as a client, serve until SIGINT/SIGTERM.
    Its first stdout line is ``DASHBOARD=<url>``.

    :raises UserError: no or bad --initial-peers, missing chart files, the port is taken, unreachable peers
    """
    peers = check_initial_peers(config)
    dashboard = Dashboard(config.run_id, host=config.host, port=config.port, interval=config.interval,
                          points=config.history, departed_keep=config.departed_keep)
    dht = None
    try:
        dht, board = join_as_observer(config, peers, stop)
        dashboard.start(board)
        print(f"DASHBOARD={dashboard.url}", flush=True)
        logger.info("dashboard of run %s at %s (metrics at %smetrics)", config.run_id, dashboard.url, dashboard.url)
        stop.event.wait()
    finally:
        dashboard.close()  # before the DHT: its poller reads through it
        if dht is not None:
            dht.shutdown()
