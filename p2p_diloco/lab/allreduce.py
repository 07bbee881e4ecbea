"""How long one averaging round takes: this project's hivemind averager against gloo and a memory copy.

For every tensor size and number of peers, on 127.0.0.1 loopback, it times:

- **ours**: a real averaging round of :func:`p2p_diloco.net.averager.make_fragment_averager` (the
  hivemind ``DecentralizedAverager`` subclass islands use) with the ``none`` codec: each peer writes
  the exact-average fp32 encoding of :func:`p2p_diloco.algo.wire.encode_for_wire` into its buffer, as
  the syncer does. Each peer is its own process with its own hivemind DHT (127.0.0.1, port 0); the
  first peer's visible multiaddrs are the others' initial peers, and every peer keeps one averager
  per size (group-key prefixes differ), all of them started before the first round, as an island
  keeps one per fragment. The group needs every peer (``quorum`` = number of peers).

  Each peer times its own round with ``time.perf_counter``, starting right after a
  ``multiprocessing.Barrier`` that all peers pass together:

  - *round*: from the call of ``averager.step(wait=False)`` to its result. This includes
    matchmaking, i.e. hivemind's ``min_matchmaking_time`` (``--matchmaking-time``, 1 s by default),
    which a leader waits for before it starts the all-reduce: it is a fixed cost of every round, not
    a measure of speed.
  - *all-reduce*: from the moment the averager process marks the step as running its all-reduce
    (``StepControl.began_allreduce``, the group is formed; polled every millisecond, so up to about
    1 ms late) to the result. This is the part comparable with gloo; it also includes hivemind's load
    balancing of the parts and the wait for groupmates whose all-reduce starts a little later.

  The round time of a repeat is the largest over the peers (the round is over when every peer has
  its result). After every round each peer checks that it received the exact average (peer r sends
  ``r + (i mod 8) / 8`` at element i, so all must get ``(n - 1) / 2 + (i mod 8) / 8``) and that the
  group had every peer; the benchmark fails (exit code 1) otherwise.
- **gloo**: ``torch.distributed.all_reduce`` (sum) with the gloo backend among as many processes,
  on the same sizes and repeats, after one warm-up call; each timed call follows
  ``torch.distributed.barrier()``. The round time is again the largest over the ranks, and the result
  is checked. The rendezvous is a TCPStore that rank 0 opens on 127.0.0.1 port 0 (what
  ``init_method="tcp://127.0.0.1:PORT"`` opens, without picking a free port by binding and releasing
  one, which is racy); ``GLOO_SOCKET_IFNAME=lo`` keeps gloo's own connections on loopback.
- **copy**: ``dst.copy_(src)`` of the same number of bytes in this (the parent) process, after one
  warm-up copy and after every child ended; median (min) of ``max(--repeats, 10)`` copies (a single
  copy of 1 MB takes microseconds: mostly noise). It is a floor, not a target: no all-reduce can be
  faster than touching each byte of the tensor once. A ring all-reduce sends and receives
  2 (n - 1) / n of the tensor per peer over the network (reduce-scatter, then all-gather) and adds up
  n - 1 partial sums; on one machine the kernel also copies every byte through loopback, so even a
  perfect implementation takes several times this floor. ``ours/copy`` says how far a round is from it.

Both "ours" and gloo do one untimed warm-up round per size (checked like the others). Every child
process, and the copy, runs torch with one thread (the machine may have fewer cores than peers, and
a parallel copy on a busy machine mostly measures the wait for a second core). Sizes are in MB of
fp32, 1 MB = 2**20 bytes (JSON: ``bytes``, ``elements``); every time is in seconds; the table shows
the median over ``--repeats`` rounds, with the minimum in parentheses, and ratios of medians.

Run from the repository root (about 2-4 minutes on 2 cores)::

    .venv/bin/python scripts/bench/allreduce.py --sizes-mb 1 16 64 --peers 2 4 --repeats 5

It prints the Markdown table and writes ``table.md`` and ``results.json`` (every figure, per peer)
under ``--out`` (default ``runs/bench/allreduce-<YYYYmmdd-HHMMSS>/``). Exit codes: 0; 1 when a
round failed or gave a wrong result (one ``error:`` line); 2 for bad flags; 130 on Ctrl+C or SIGTERM.
Stopping aborts the peers' barrier, so each shuts its DHT and averagers down and exits; a child still
alive 10 s later gets SIGTERM, then SIGKILL, by PID (its DHT, p2pd and averagers die with it: see
p2p_diloco/procs.py). A second Ctrl+C exits at once, and the children die with this process.

Note: hivemind streams a round in parts of 512 KiB (``DEFAULT_PART_SIZE_BYTES``), below p2pd's 4 MiB
message limit, so 64 MB rounds need no special settings.
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import sys
import time
from datetime import datetime, timedelta
from multiprocessing.connection import wait as wait_for_ready
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from p2p_diloco.procs import StopSignal, install_child_hooks
from p2p_diloco import files

logger = logging.getLogger(__name__)

MB = 2**20  # bytes
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
POLL_S = 0.001  # how often a peer looks whether its averager began the all-reduce
COPY_REPEATS = 10  # at least this many copies per size: one copy of 1 MB takes microseconds, noise dominates


class BenchError(Exception):
    """The benchmark cannot go on: a child failed, a result was wrong, a child went silent."""


# ------------------------------------------------------------------------------------------------
# flags


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the flags; a bad value exits with code 2 and one ``error:`` line (argparse)."""
    parser = argparse.ArgumentParser(prog="scripts/bench/allreduce.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 16.0, 64.0],
                        help="tensor sizes, MB of fp32 (1 MB = 2**20 bytes)")
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4], help="numbers of peers (each at least 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per (size, peers) cell")
    parser.add_argument("--matchmaking-time", type=float, default=1.0,
                        help="hivemind's min_matchmaking_time, seconds (part of every round of ours)")
    parser.add_argument("--allreduce-timeout", type=float, default=120.0,
                        help="seconds one all-reduce may take once its group formed (ours and gloo)")
    parser.add_argument("--out", default="", help="output folder (default runs/bench/allreduce-<time>/)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show hivemind's log")
    args = parser.parse_args(argv)
    for size in args.sizes_mb:
        if not (math.isfinite(size) and size > 0):
            parser.error(f"--sizes-mb: every size must be a positive number of MB, got {size:g}")
        if _elements(size) < 1:
            parser.error(f"--sizes-mb: {size:g} MB is less than one fp32 value")
    for peers in args.peers:
        if peers < 2:
            parser.error(f"--peers: an all-reduce needs at least 2 peers, got {peers}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if not (math.isfinite(args.matchmaking_time) and args.matchmaking_time > 0):
        parser.error(f"--matchmaking-time must be positive seconds, got {args.matchmaking_time:g}")
    if not (math.isfinite(args.allreduce_timeout) and args.allreduce_timeout > 0):
        parser.error(f"--allreduce-timeout must be positive seconds, got {args.allreduce_timeout:g}")
    args.sizes_mb = list(dict.fromkeys(args.sizes_mb))  # repeated values once, in the order given
    args.peers = list(dict.fromkeys(args.peers))
    return args


def _elements(size_mb: float) -> int:
    return int(round(size_mb * MB / 4))  # fp32


def _settings(args: argparse.Namespace) -> dict:
    """What the children need (plain values: they are forked, but keep it small and explicit)."""
    return dict(sizes=[_elements(s) for s in args.sizes_mb], repeats=args.repeats,
                matchmaking_time=args.matchmaking_time, allreduce_timeout=args.allreduce_timeout,
                verbose=args.verbose)


def _wait_timeout(settings: dict) -> float:
    """Seconds a child waits at a barrier or for a round's result before giving up."""
    return 60.0 + 2.0 * settings["allreduce_timeout"]


# ------------------------------------------------------------------------------------------------
# children: one process per peer (ours) or rank (gloo); each reports on its own pipe


def _child(body: Callable[..., None], rank: int, conn, *args) -> None:
    """Run ``body`` in a child and report its end ("done", or "error" with the reason) to the parent.

    SIGTERM kills a child at once (procs.py's fork hook restores the default action); the processes
    it started (DHT, p2pd, averagers) die with it. To end peers gracefully, the parent aborts their
    barrier first: they then leave through their ``finally``, which shuts their DHT and averagers down.
    """
    torch.set_num_threads(1)
    try:
        body(rank, conn, *args)
        code, report = 0, ("done", rank, None)
    except BaseException as e:  # report it to the parent, which stops the others
        code, report = 1, ("error", rank, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    try:
        conn.send(report)
    except Exception as e:  # the parent is gone or stopped listening
        logger.debug("cannot report to the parent: %r", e)
    os._exit(code)  # skip atexit hooks inherited from the parent (its multiprocessing state)


def _wire_values(rank: int, numel: int) -> torch.Tensor:
    """What peer ``rank`` averages: ``rank + (i mod 8) / 8`` at element i (exact in fp32)."""
    return torch.arange(numel, dtype=torch.float32).remainder_(8).mul_(0.125).add_(rank)  # (numel,)


def _ours_peer(rank: int, conn, n: int, settings: dict, initial_peers: list[str], barrier) -> None:
    """One peer of "ours": a DHT, one averager per size, timed and checked rounds."""
    from p2p_diloco.algo import wire
    from p2p_diloco.net.dht import quiet_hivemind, start_dht, visible_maddrs
    from p2p_diloco.net import averager as fragment_averager, codec as wire_codec

    quiet_hivemind(settings["verbose"])
    wait_s = _wait_timeout(settings)
    mm = settings["matchmaking_time"]
    offset = wire.wire_offset(float(n))  # C: every value sent lies in [C, C + n), within C/4 of C
    dht, averagers = None, []
    try:
        dht = start_dht(initial_peers=initial_peers, host_maddrs=[LOOPBACK], join_timeout=60.0)
        for index, numel in enumerate(settings["sizes"]):
            codec = wire_codec.make_codec("none")
            wire_codec.install(codec)  # in the averager forked next, as the syncer does
            averagers.append(fragment_averager.make_fragment_averager(
                [torch.zeros(numel)], dht, prefix=f"bench_allreduce_{n}p_s{index}", quorum=n,
                matchmaking_time=mm, request_timeout=min(0.5, mm / 2),
                allreduce_timeout=settings["allreduce_timeout"], state_provider=lambda: ({}, []), codec=codec))
        conn.send(("ready", rank, visible_maddrs(dht)))
        for index, (numel, averager) in enumerate(zip(settings["sizes"], averagers)):
            values = _wire_values(rank, numel)
            expected = _wire_values(0, numel).add_((n - 1) / 2)  # the mean over ranks 0..n-1
            for repeat in range(-1, settings["repeats"]):  # -1: the warm-up round
                with averager.get_tensors() as buffers:
                    wire.encode_for_wire([values], buffers, offset)
                barrier.wait(wait_s)
                total, allreduce, gathered = _timed_step(averager, settings)
                if gathered is None or len(gathered) != n:
                    raise BenchError(f"size {index}, round {repeat}: the group had "
                                     f"{0 if gathered is None else len(gathered)} members, not {n}")
                with averager.get_tensors() as buffers:
                    received = wire.decode_from_wire(buffers, offset)[0]
                if not torch.equal(received, expected):
                    wrong = int((received != expected).sum())
                    error = float((received - expected).abs().max())
                    raise BenchError(f"size {index}, round {repeat}: wrong average on {wrong} of {numel} "
                                     f"elements (largest error {error:g})")
                if repeat >= 0:
                    conn.send(("round", rank, dict(size=index, repeat=repeat, total_s=total, allreduce_s=allreduce)))
        barrier.wait(wait_s)  # nobody leaves while a groupmate may still be receiving from it
    finally:
        # the island's order (Island.close, then Syncer.close): the DHT first, then the averagers
        if dht is not None:
            try:
                dht.shutdown()
            except Exception as e:
                logger.debug("DHT shutdown: %r", e)
        for averager in averagers:
            if averager.is_alive():
                averager.terminate()
        for averager in averagers:
            averager.join(5.0)
            if averager.is_alive():
                averager.kill()
                averager.join(5.0)


def _timed_step(averager, settings: dict) -> tuple[float, Optional[float], Optional[dict]]:
    """One round: (seconds from step() to result, seconds from the all-reduce's start to result
    or None if it was not seen, the gathered metadata)."""
    from concurrent.futures import TimeoutError as FutureTimeout

    step_timeout = 30.0 + 5.0 * settings["matchmaking_time"]  # to find the group (with retries)
    start = time.perf_counter()
    control = averager.step(timeout=step_timeout, allow_retries=True, wait=False)
    began = None
    while not control.done():
        if control.began_allreduce:
            began = time.perf_counter()
            break
        time.sleep(POLL_S)
    try:
        gathered = control.result(timeout=step_timeout + settings["allreduce_timeout"] + 10.0)
    except FutureTimeout:
        control.cancel()
        raise BenchError("no result within the round's timeouts") from None
    end = time.perf_counter()
    return end - start, (end - began if began is not None else None), gathered


def _gloo_rank(rank: int, conn, n: int, settings: dict, port: int) -> None:
    """One rank of gloo: timed and checked ``all_reduce`` calls on the same sizes."""
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own connections: loopback only
    wait_s = _wait_timeout(settings)
    store = dist.TCPStore("127.0.0.1", port if rank else 0, n, is_master=rank == 0, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    if rank == 0:
        conn.send(("ready", rank, store.port))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timedelta(seconds=wait_s))
    try:
        for index, numel in enumerate(settings["sizes"]):
            tensor = torch.empty(numel)
            expected = float(n * (n - 1) // 2)  # the sum of the ranks
            for repeat in range(-1, settings["repeats"]):  # -1: the warm-up call
                tensor.fill_(rank)
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                seconds = time.perf_counter() - start
                if not bool((tensor == expected).all()):
                    raise BenchError(f"size {index}, call {repeat}: wrong sum (expected {expected:g})")
                if repeat >= 0:
                    conn.send(("round", rank, dict(size=index, repeat=repeat, total_s=seconds)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# parent: start a group of children, collect their reports, stop them whatever happens


class Group:
    """The n processes of one (kind, peers) run, started by fork from the main thread (hivemind's
    DHT and averagers are forked processes too; see p2p_diloco/procs.py)."""

    def __init__(self, kind: str, n: int, stop: StopSignal, silence_s: float):
        self.kind, self.n, self.stop, self.silence_s = kind, n, stop, silence_s
        self.ctx = mp.get_context("fork")
        self.barrier = None  # the children's barrier, if they use one: aborted to end them gracefully
        self.procs: list[mp.Process] = []
        self.conns: list[Any] = []  # by rank
        self._open: list[Any] = []  # those that may still carry messages
        self.done: set[int] = set()
        self.rounds: list[tuple[int, dict]] = []
        self._heard = time.monotonic()

    def start(self, rank: int, body: Callable[..., None], *args) -> None:
        """Fork one child running ``body(rank, conn, *args)``."""
        reader, writer = self.ctx.Pipe(duplex=False)
        # not a daemon: multiprocessing forbids daemons to start processes (hivemind's DHT, averagers)
        proc = self.ctx.Process(target=_child, args=(body, rank, writer, *args), name=f"{self.kind}-{rank}")
        proc.start()
        writer.close()  # the child holds it; later children must not inherit it
        self.procs.append(proc)
        self.conns.append(reader)
        self._open.append(reader)

    def _drain(self, conn) -> list[tuple[str, int, Any]]:
        messages = []
        try:
            while conn.poll():
                messages.append(conn.recv())
        except (EOFError, OSError):  # the child and every process holding its pipe are gone
            if conn in self._open:
                self._open.remove(conn)
        return messages

    def poll(self, timeout: float = 0.5) -> list[tuple[str, int, Any]]:
        """Messages from the children within ``timeout``; raises BenchError if one failed or all went
        silent for too long, and :class:`Interrupted` once a stop was asked for."""
        from p2p_diloco.errors import Interrupted

        if self.stop.event.is_set():
            raise Interrupted(f"{self.stop.received or 'stop'} received")
        messages = []
        if self._open:
            ready = wait_for_ready(self._open, timeout)
        else:
            time.sleep(timeout)
            ready = []
        for conn in ready:
            messages += self._handle(self._drain(conn))
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is not None and rank not in self.done:
                messages += self._handle(self._drain(self.conns[rank]))  # it may have said "done" just before
                if rank not in self.done:
                    raise BenchError(f"{self.kind}, {self.n} peers, rank {rank}: exited with code {proc.exitcode}")
        if time.monotonic() - self._heard > self.silence_s:
            raise BenchError(f"{self.kind}, {self.n} peers: no progress in {self.silence_s:.0f} s")
        return messages

    def _handle(self, messages: list[tuple[str, int, Any]]) -> list[tuple[str, int, Any]]:
        for kind, rank, payload in messages:
            self._heard = time.monotonic()
            if kind == "error":
                raise BenchError(f"{self.kind}, {self.n} peers, rank {rank}: {payload}")
            if kind == "done":
                self.done.add(rank)
            if kind == "round":
                self.rounds.append((rank, payload))
        return messages

    def wait_ready(self, rank: int) -> Any:
        """The payload of ``rank``'s "ready" message (multiaddrs, or a port)."""
        while True:
            for kind, sender, payload in self.poll():
                if kind == "ready" and sender == rank:
                    return payload

    def wait_done(self) -> None:
        """Until every child reported its end; then join them."""
        while len(self.done) < len(self.procs):
            self.poll()
        for proc in self.procs:
            proc.join(30.0)

    def close(self, grace_s: float = 10.0) -> None:
        """End every child still alive: abort their barrier (peers then shut their DHT and averagers
        down and exit) and wait up to ``grace_s``; then SIGTERM, then SIGKILL, by PID. Their own
        children die with them (parent-death signal, procs.py)."""
        if self.barrier is not None and any(proc.is_alive() for proc in self.procs):
            self.barrier.abort()
            deadline = time.monotonic() + grace_s
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self.conns:
            conn.close()


def run_ours(n: int, settings: dict, stop: StopSignal) -> list[tuple[int, dict]]:
    """Run "ours" among ``n`` peers; returns every (rank, round report)."""
    group = Group("ours", n, stop, silence_s=_wait_timeout(settings) + 60.0)
    barrier = group.barrier = group.ctx.Barrier(n)
    try:
        group.start(0, _ours_peer, n, settings, [], barrier)
        maddrs = group.wait_ready(0)
        for rank in range(1, n):
            group.start(rank, _ours_peer, n, settings, list(maddrs), barrier)
        group.wait_done()
        return group.rounds
    finally:
        group.close()


def run_gloo(n: int, settings: dict, stop: StopSignal) -> list[tuple[int, dict]]:
    """Run gloo among ``n`` ranks; returns every (rank, round report)."""
    group = Group("gloo", n, stop, silence_s=_wait_timeout(settings) + 60.0)
    try:
        group.start(0, _gloo_rank, n, settings, 0)
        port = group.wait_ready(0)
        for rank in range(1, n):
            group.start(rank, _gloo_rank, n, settings, port)
        group.wait_done()
        return group.rounds
    finally:
        group.close()


def copy_seconds(numel: int, repeats: int) -> list[float]:
    """Seconds of ``dst.copy_(src)`` for ``numel`` fp32 values with one torch thread (as each peer
    has), ``repeats`` times after a warm-up copy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.rand(numel)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up: page faults
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return times
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------
# figures and output


def _summary(values: Sequence[Optional[float]]) -> dict:
    known = [v for v in values if v is not None]
    if not known or len(known) < len(values):
        return {"median": None, "min": None}
    return {"median": statistics.median(known), "min": min(known)}


def _rounds(reports: list[tuple[int, dict]], size: int, repeats: int, n: int, fields: Sequence[str]) -> list[dict]:
    """Per repeat: the largest value over the ranks of each field, and every rank's values."""
    rounds = []
    for repeat in range(repeats):
        per_rank = sorted(((rank, r) for rank, r in reports if r["size"] == size and r["repeat"] == repeat),
                          key=lambda item: item[0])
        if len(per_rank) != n:
            raise BenchError(f"size {size}, round {repeat}: {len(per_rank)} of {n} ranks reported")
        entry: dict[str, Any] = {}
        for field in fields:
            values = [r.get(field) for _rank, r in per_rank]
            entry[field] = None if any(v is None for v in values) else max(values)
        entry["per_rank"] = [{"rank": rank, **{f: r.get(f) for f in fields}} for rank, r in per_rank]
        rounds.append(entry)
    return rounds


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def build_cells(args: argparse.Namespace, ours: dict, gloo: dict, copies: dict) -> list[dict]:
    """One JSON cell per (size, peers): ours, gloo, copy, ratios of medians."""
    cells = []
    for index, size_mb in enumerate(args.sizes_mb):
        numel = _elements(size_mb)
        for n in args.peers:
            ours_rounds = _rounds(ours[n], index, args.repeats, n, ("total_s", "allreduce_s"))
            gloo_rounds = _rounds(gloo[n], index, args.repeats, n, ("total_s",))
            cell = {
                "size_mb": size_mb, "bytes": numel * 4, "elements": numel, "peers": n,
                "ours": {"round_s": _summary([r["total_s"] for r in ours_rounds]),
                         "allreduce_s": _summary([r["allreduce_s"] for r in ours_rounds]),
                         "rounds": ours_rounds},
                "gloo": {"round_s": _summary([r["total_s"] for r in gloo_rounds]), "rounds": gloo_rounds},
                "copy": {"round_s": _summary(copies[index]), "rounds": copies[index]},
            }
            ours_s, ours_ar = cell["ours"]["round_s"]["median"], cell["ours"]["allreduce_s"]["median"]
            gloo_s, copy_s = cell["gloo"]["round_s"]["median"], cell["copy"]["round_s"]["median"]
            cell["ratios"] = {"ours_over_gloo": _ratio(ours_s, gloo_s),
                              "ours_allreduce_over_gloo": _ratio(ours_ar, gloo_s),
                              "ours_over_copy": _ratio(ours_s, copy_s),
                              "ours_allreduce_over_copy": _ratio(ours_ar, copy_s)}
            cells.append(cell)
    return cells


def _fmt(summary: dict) -> str:
    if summary["median"] is None:
        return "n/a"
    return f"{summary['median']:.4g} ({summary['min']:.4g})"


def _fmt_ratio(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def markdown_table(cells: Sequence[dict]) -> str:
    """The Markdown table: seconds per round, median (min), and ratios of medians."""
    lines = [
        "| size MB | peers | ours s | ours all-reduce s | gloo s | copy s | ours/gloo | ours all-reduce/gloo "
        "| ours/copy | ours all-reduce/copy |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        r = c["ratios"]
        lines.append(
            f"| {c['size_mb']:g} | {c['peers']} | {_fmt(c['ours']['round_s'])} | {_fmt(c['ours']['allreduce_s'])} "
            f"| {_fmt(c['gloo']['round_s'])} | {_fmt(c['copy']['round_s'])} | {_fmt_ratio(r['ours_over_gloo'])} "
            f"| {_fmt_ratio(r['ours_allreduce_over_gloo'])} | {_fmt_ratio(r['ours_over_copy'])} "
            f"| {_fmt_ratio(r['ours_allreduce_over_copy'])} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; returns the exit code (0, 1 on a failed run, 130 when interrupted)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import hivemind  # imported once here, before forking the children

    from p2p_diloco.errors import Interrupted
    from p2p_diloco.net.dht import quiet_hivemind

    install_child_hooks()  # children die with us, and Ctrl+C reaches only this process
    stop = StopSignal().install()
    quiet_hivemind(args.verbose)
    settings = _settings(args)
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    started = datetime.now()
    out = Path(args.out or f"runs/bench/allreduce-{started:%Y%m%d-%H%M%S}")
    ours: dict[int, list] = {}
    gloo: dict[int, list] = {}
    try:
        for n in args.peers:
            t0 = time.monotonic()
            ours[n] = run_ours(n, settings, stop)
            print(f"ours, {n} peers: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            gloo[n] = run_gloo(n, settings, stop)
            print(f"gloo, {n} peers: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        copies = {index: copy_seconds(numel, max(args.repeats, COPY_REPEATS))
                  for index, numel in enumerate(settings["sizes"])}
        cells = build_cells(args, ours, gloo, copies)
    except Interrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
        return 130
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    table = markdown_table(cells)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    files.write_text(out / "table.md", f"Command: `{command}`\n\n{table}\n\nSeconds per round: median (min) over "
                                  f"{args.repeats} rounds; ratios of medians.\n")
    results = {
        "command": command, "started": started.isoformat(timespec="seconds"),
        "finished": datetime.now().isoformat(timespec="seconds"),
        "units": {"time": "seconds", "size": "bytes (size_mb: 2**20 bytes)"},
        "settings": {"sizes_mb": args.sizes_mb, "peers": args.peers, "repeats": args.repeats,
                     "matchmaking_time_s": args.matchmaking_time, "allreduce_timeout_s": args.allreduce_timeout,
                     "codec": "none", "warmup_rounds": 1, "torch_threads": 1,
                     "copy_repeats": max(args.repeats, COPY_REPEATS)},
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                 "torch": torch.__version__, "hivemind": hivemind.__version__},
        "cells": cells,
    }
    files.write_json(out / "results.json", results)
    print(f"wrote {out / 'table.md'} and {out / 'results.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
