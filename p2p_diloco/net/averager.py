"""One fragment's hivemind averager process (docs/DESIGN.md, "One round"): hivemind's
``DecentralizedAverager`` subclassed where hivemind is designed for it (``get_current_state`` and
``_aggregate_with_group``; a private run's gate on its RPCs), the timeouts our rounds use, and the
shared memory through which the averager process tells the island the grid it used, which parts no
reducer averaged and the bytes it moved. :class:`p2p_diloco.net.channel.HivemindChannel` drives it.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from p2p_diloco.algo import grid
from p2p_diloco.net.reducer import MergeRule, OutlierBook, capped_weights, install_runner

logger = logging.getLogger(__name__)


def _fragment_averager_class():
    from hivemind.averaging import DecentralizedAverager

    from p2p_diloco.net.gate import GatedAveragerMixin

    class FragmentAverager(GatedAveragerMixin, DecentralizedAverager):
        """hivemind's DecentralizedAverager for one fragment; it serves the fragment's state
        (Theta_p, outer momentum m_p, version) to joining or lagging islands through
        ``get_current_state``, hivemind's documented extension point; in a private run its RPCs and
        groups go through a gate (:class:`p2p_diloco.net.gate.GatedAveragerMixin`)."""

        def __init__(self, *args, state_provider: Callable[[], tuple[dict, list[torch.Tensor]]], levels: int = 0,
                     shared: Optional[dict] = None, ceilings: Optional[Sequence[int]] = None, gate=None,
                     clock_offset: Optional[torch.Tensor] = None, merge_rule: Optional[MergeRule] = None, **kwargs):
            self._state_provider, self._gate, self._clock_offset = state_provider, gate, clock_offset
            self._levels, self._ceilings, self._merge_rule = levels, ceilings, merge_rule
            self._shared = shared or {}
            super().__init__(*args, **kwargs)

        def run(self):  # the averager process's entry point (hivemind's mp.Process.run)
            if self._clock_offset is not None:
                run_on_swarm_time(self._clock_offset)
            if self._merge_rule is not None:
                install_runner()
            super().run()

        def get_current_state(self):
            metadata, tensors = self._state_provider()
            return metadata, tensors, None

        def load_state_from(self, peers: Sequence[str], *, timeout: float, max_bytes: int,
                            max_tensors: int) -> Optional[tuple[dict, list[torch.Tensor]]]:
            """(metadata, tensors) of the first of ``peers`` (peer ids, in the order given) that serves
            its state. hivemind's ``load_state_from_peers`` asks the donor of the highest declared
            priority first and takes whatever it serves; this asks exactly the donors whose records
            show the state we want (docs/SECURITY.md, "The donor hivemind picks").

            :param timeout: seconds for all of them together (one deadline for both processes)
            :param max_bytes: wire bytes beyond which a donor is dropped (see :func:`download_state`)
            :param max_tensors: tensors beyond which a donor is dropped
            :returns: None when none of them served a state within ``timeout``
            """
            import concurrent.futures
            import time

            from hivemind.utils.mpfuture import MPFuture

            future = MPFuture()
            deadline = time.monotonic() + timeout  # (CLOCK_MONOTONIC: the same clock in the averager process)
            self._outer_pipe.send(("_load_state_from", [list(peers)], dict(
                deadline=deadline, max_bytes=max_bytes, max_tensors=max_tensors, future=future)))
            try:
                return future.result(timeout=timeout + 1.0)
            except concurrent.futures.TimeoutError:
                future.cancel()  # the averager process stops at its next donor
                return None

        async def _load_state_from(self, peers: list, *, deadline: float, max_bytes: int, max_tensors: int,
                                   future) -> None:
            """In the averager process: :meth:`load_state_from`'s downloads, one donor after another
            until one serves a state, ``deadline`` (time.monotonic() seconds) passes or the caller
            cancels ``future``."""
            import asyncio
            import contextlib
            import time
            from concurrent.futures import InvalidStateError

            from hivemind.p2p import PeerID

            result = None
            for peer in peers:
                remaining = deadline - time.monotonic()
                if future.done() or remaining <= 0 or peer == self.peer_id.to_base58():
                    if future.done() or remaining <= 0:
                        break
                    continue  # (a record naming us: nothing to ask)
                try:
                    result = await asyncio.wait_for(
                        download_state(self, PeerID.from_base58(peer), max_bytes=max_bytes, max_tensors=max_tensors,
                                       chunk_timeout=self.next_chunk_timeout or self.request_timeout),
                        timeout=remaining)
                except Exception as e:  # gone, refused, too slow, too much, malformed: the next one
                    logger.debug("state download from %s failed: %r", peer, e)
                    continue
                if result is not None:
                    break
            with contextlib.suppress(InvalidStateError):  # the caller gave up meanwhile
                future.set_result(result)

        async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
            """In the averager process, once the group is known and around its all-reduce (hivemind's
            own PowerSGD averager extends this method the same way):

            - with a low-bit codec, put the raw values the island wrote on the round's shared grid,
              from the exponents every member gathered (:func:`p2p_diloco.algo.grid.put_on_grid_`), and
              tell the island which grid was used (``shared["grid"]``);
            - record exactly which elements kept this member's own values because their reducer
              failed (``shared["failed_mask"]``, ``shared["failed"]``: their number, -1 if unknown);
            - say when the group formed (``shared["formed_at"]``, float64 [1]: the averager's time,
              swarm time once :func:`run_on_swarm_time` ran).
            """
            if "formed_at" in self._shared:
                from hivemind.averaging import averager as hivemind_averager

                self._shared["formed_at"].fill_(hivemind_averager.get_dht_time())
            claims = _gathered_claims(self, group_info)
            if self._levels:
                self._shared["grid"].copy_(await _put_on_shared_grid(self, [c.get("exponents") for c in claims]))
            if self._merge_rule is not None:  # capped weights and a robust merge (p2p_diloco.net.reducer)
                book = OutlierBook(self._shared["outliers"]) if "outliers" in self._shared else None
                if book is not None:
                    book.reset()
                weights = capped_weights([c.get("weight") for c in claims], self._merge_rule)
                kwargs["merge"] = {"rule": self._merge_rule, "weights": weights, "book": book}
            recorder = _FailureRecorder(self._shared.get("failed_mask"), self._shared.get("reducers"))
            future = self._running_groups.get(group_info.group_id)
            if future is not None:
                future.add_done_callback(recorder.attach)  # runs before any reducer can have failed
            gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
            if "failed" in self._shared:
                self._shared["failed"].fill_(recorder.count())
            return gathered

    return FragmentAverager


def _gathered_claims(averager, group_info) -> list[dict]:
    """Each member's gathered metadata in the group's order (``{}`` where it cannot be read)."""
    claims = []
    for raw in group_info.gathered:
        try:
            user = averager.serializer.loads(averager.serializer.loads(raw)[2])
            claims.append(user if isinstance(user, dict) else {})
        except Exception:
            claims.append({})
    return claims


async def _put_on_shared_grid(averager, reports: list) -> torch.Tensor:
    """In the averager process: the round's shared grid from the exponents every member gathered
    (``reports``, in the group's order), and the raw values in the averaged tensors put on it
    (:func:`p2p_diloco.algo.grid.put_on_grid_`, run off the event loop). Returns the grid used (int16,
    every tensor's chunk exponents in sequence)."""
    import asyncio

    from hivemind.utils.asyncio import enter_asynchronously

    async with enter_asynchronously(averager.get_tensors()) as tensors:
        return await asyncio.get_event_loop().run_in_executor(
            None, grid.put_on_grid_, tensors, reports, averager._levels, averager._ceilings)


def run_on_swarm_time(offset: torch.Tensor) -> None:
    """In an averager process only: hivemind's clock there (``get_dht_time``, this machine's wall
    clock) becomes swarm time, this machine's wall clock minus ``offset[0]`` (float64 [1], shared
    with the island, which keeps it current). Every expiration the averager declares, compares
    and waits for is then on one clock across the swarm, so islands whose clocks disagree rank the
    same leader and accept each other's join requests (docs/DESIGN.md, "Clocks").

    hivemind takes the time in these modules through their own binding of ``get_dht_time``; its
    DHT, in another process, keeps this machine's wall clock.
    """
    import importlib
    import time

    def swarm_time() -> float:
        return time.time() - float(offset[0])

    for name in ("averaging.averager", "averaging.control", "averaging.matchmaking", "utils.timed_storage"):
        importlib.import_module(f"hivemind.{name}").get_dht_time = swarm_time


async def download_state(averager, peer, *, max_bytes: int, max_tensors: int, chunk_timeout: float):
    """In an averager process: (metadata, tensors) that ``peer``'s averager of the same prefix serves
    through hivemind's ``rpc_download_state`` (its first message carries the metadata), or None when it
    serves nothing (no state to share, or a private run's gate refused us). The stream is untrusted
    input: it is bounded in bytes and tensors, and its metadata must come once, first.

    :param max_bytes: wire bytes (whole messages) beyond which the donor is dropped; an honest one
        sends a fragment's Theta and momentum in fp32
    :param max_tensors: tensors beyond which the donor is dropped
    :param chunk_timeout: seconds to wait for each message
    :raises ValueError: the donor streamed too much, or metadata other than once, first
    :raises asyncio.TimeoutError: a message took longer than ``chunk_timeout``
    :raises Exception: whatever hivemind's P2P, msgpack or tensor deserialization raise for a donor
        that is gone or sends garbage
    """
    from hivemind.compression import deserialize_tensor_stream
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import aiter_with_timeout

    stub = averager.get_stub(averager._p2p, peer, namespace=averager.prefix)
    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
    metadata, received, tensors, first = None, 0, 0, True

    async def parts():
        nonlocal metadata, received, tensors, first
        async for message in aiter_with_timeout(stream, timeout=chunk_timeout):
            if message.metadata:
                if not first:
                    raise ValueError("the donor sent metadata other than in its first message")
                metadata = averager.serializer.loads(message.metadata)
            first = False
            received += message.ByteSize() + 64  # (+64: empty messages count too)
            tensors += bool(message.tensor_part.dtype)  # (a part that names its dtype starts a tensor)
            if received > max_bytes or tensors > max_tensors:
                raise ValueError(f"the donor streamed more than {max_bytes} bytes or {max_tensors} tensors")
            yield [message.tensor_part]

    downloaded = await deserialize_tensor_stream(parts())
    return None if metadata is None else (metadata, downloaded)


def averager_stub(p2p, peer, prefix: str):
    """A client of the RPCs (``rpc_join_group``, ``rpc_aggregate_part``, ``rpc_download_state``) of
    peer ``peer``'s averager of ``prefix`` over a ``hivemind.P2P`` (hivemind names the handlers after
    the averager's class)."""
    return _fragment_averager_class().get_stub(p2p, peer, namespace=prefix)


class _FailureRecorder:
    """Wraps one all-reduce's ``register_failed_reducer`` (hivemind keeps the member's own values for
    the parts of a reducer that failed) to mark those elements, in the flattened order of the
    averaged tensors, in ``mask`` (uint8, shared with the island); and writes which member of the
    group reduces each element into ``reducers`` (int16, the member's index in the group's order, -1
    where unknown), so that the island can tell each reducer's results apart (docs/SECURITY.md)."""

    def __init__(self, mask: Optional[torch.Tensor], reducers: Optional[torch.Tensor] = None):
        self.mask, self.reducers, self.container = mask, reducers, None
        if mask is not None:
            mask.zero_()
        if reducers is not None:
            reducers.fill_(-1)

    def attach(self, future) -> None:
        try:
            container = future.result().tensor_part_container
            original = container.register_failed_reducer
        except Exception as e:
            logger.debug("cannot watch for failed reducers: %r", e)
            return
        if self.reducers is not None:
            try:
                for peer_index in range(container.group_size):
                    for index, numel in _spans(container, peer_index, 0):
                        self.reducers[index:index + numel] = peer_index
            except Exception as e:  # never let bookkeeping break the all-reduce
                logger.debug("cannot map the reducers' parts: %r", e)
                self.reducers.fill_(-1)

        def record(peer_index: int) -> None:
            try:
                for index, numel in _spans(container, peer_index, container._outputs_registered_by_peer[peer_index]):
                    self.mask[index:index + numel] = 1
            except Exception as e:  # never let bookkeeping break the all-reduce
                logger.debug("cannot record failed reducer parts: %r", e)
                self.container = None
            original(peer_index)

        container.register_failed_reducer = record
        self.container = container

    def count(self) -> int:
        """Elements whose reducer failed, or -1 when they could not be recorded exactly."""
        if self.container is None or self.mask is None:
            return -1
        return int(self.container.failed_size)


def _spans(container, peer_index: int, first: int):
    """(first element, count) in the flattened averaged tensors of each part that member
    ``peer_index`` reduces, from its ``first`` part on (hivemind's parts are views of the tensors)."""
    starts, position = [], 0
    for tensor in container.local_tensors:
        starts.append((tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size(), position,
                       tensor.element_size()))
        position += tensor.numel()
    for part, _info in list(container._input_parts_by_peer[peer_index])[first:]:
        pointer = part.data_ptr()
        begin, _end, offset, size = next(entry for entry in starts if entry[0] <= pointer < entry[1])
        yield offset + (pointer - begin) // size, part.numel()


def next_chunk_timeout(allreduce_timeout: float) -> float:
    """Seconds a receiver waits for the next chunk of an all-reduce or a state download (hivemind's
    ``next_chunk_timeout``); a donor must start streaming well within it."""
    return max(1.0, allreduce_timeout / 2)


def sender_timeout(allreduce_timeout: float) -> float:
    """Seconds a reducer waits for a member's data before leaving that member out of the average:
    a third of the round's timeout, but up to 1 s (at most 0.45 of it) for short rounds on a busy
    machine, where a healthy member's averager may start a few hundred milliseconds late."""
    return max(allreduce_timeout / 3, min(1.0, 0.45 * allreduce_timeout))


def reducer_timeout(allreduce_timeout: float) -> float:
    """Seconds a member waits for the next averaged chunk from a reducer before keeping its own
    values for that reducer's part: above :func:`sender_timeout` (hivemind requires it, and a
    reducer first waits for late senders) and at most 0.675 of the round's timeout, so that a
    member that stalls early in the round is dropped before the round itself times out."""
    return max(0.6 * allreduce_timeout, 1.5 * sender_timeout(allreduce_timeout))


def make_fragment_averager(
    tensors: Sequence[torch.Tensor],
    dht,
    *,
    prefix: str,
    quorum: int,
    matchmaking_time: float,
    request_timeout: float,
    allreduce_timeout: float,
    state_provider: Callable[[], tuple[dict, list[torch.Tensor]]],
    codec=None,
    levels: int = 0,
    shared: Optional[dict] = None,
    ceilings: Optional[Sequence[int]] = None,
    gate=None,
    clock_offset: Optional[torch.Tensor] = None,
    merge_rule: Optional[MergeRule] = None,
    start_timeout: float = 60.0,
):
    """Start one fragment's averager process (hivemind ``DecentralizedAverager``).

    Rounds send what ``codec`` encodes (a :mod:`p2p_diloco.net.codec` codec, installed with
    :func:`p2p_diloco.net.codec.install` right before this call). With ``levels == 0`` the island writes the
    exact-average encoding of :func:`p2p_diloco.algo.wire.encode_for_wire` (plain fp32 on the wire);
    otherwise raw values, which the averager puts on the round's shared grid.

    :param tensors: fp32 CPU buffers, one per parameter of the fragment; rounds average them in place
    :param prefix: group-key prefix, unique per (run, fingerprint, fragment); no dots
    :param quorum: K, hivemind's ``min_group_size`` (at least 2: a lone island falls back without
        hivemind); a round waits for this many members until its deadline
    :param matchmaking_time: hivemind's ``min_matchmaking_time``, seconds
    :param request_timeout: seconds to wait for a matchmaking answer
    :param allreduce_timeout: seconds an all-reduce may take once the group formed
    :param state_provider: returns (metadata, tensors) served to peers that download the fragment
    :param codec: hivemind ``CompressionBase`` for the round's messages (None: hivemind's plain fp32)
    :param levels: L of the low-bit codec (0: none)
    :param shared: shared-memory tensors the averager process writes for the island after each
        all-reduce: ``grid`` (int16, the chunk exponents used, with a low-bit codec), ``failed_mask``
        (uint8 per element: 1 where the reducer failed) and ``failed`` (int64, one element: how many
        failed, -1 if unknown), ``reducers`` (int16 per element: the index in the group of the member
        that reduced it, -1 if unknown) and ``outliers`` (:class:`p2p_diloco.net.reducer.OutlierBook`'s table)
    :param ceilings: per tensor, the largest grid exponent an honest member needs
    :param gate: a private run's :class:`p2p_diloco.net.gate.AveragerGate` (None: an open run)
    :param clock_offset: float64 [1], shared: seconds this machine's clock is ahead of the swarm's; the
        averager process then runs on swarm time (:func:`run_on_swarm_time`; None: the wall clock)
    :param merge_rule: capped weights and a robust merge of the parts this member reduces
        (:mod:`p2p_diloco.net.reducer`; None: hivemind's weighted mean of the senders' own weights)
    :param start_timeout: seconds the averager process may take to be ready
    :returns: the started averager; end it with ``terminate()`` after the DHT is shut down
    :raises RuntimeError: if it is not ready within ``start_timeout``
    """
    FragmentAverager = _fragment_averager_class()
    chunk_timeout = next_chunk_timeout(allreduce_timeout)
    averager = FragmentAverager(
        averaged_tensors=list(tensors),
        dht=dht,
        start=False,
        prefix=prefix,
        min_group_size=max(2, quorum),
        min_matchmaking_time=matchmaking_time,
        request_timeout=request_timeout,
        allreduce_timeout=allreduce_timeout,
        # a member that stops answering is dropped from the round well before the round's own
        # timeout, so the others finish without it (the island zeroes its part: RoundFormat.unaveraged)
        sender_timeout=sender_timeout(allreduce_timeout),
        reducer_timeout=reducer_timeout(allreduce_timeout),
        next_chunk_timeout=chunk_timeout,
        allow_state_sharing=False,
        # (hivemind's default) each declaration is a DHT store, and stores are what loads the DHT of a
        # large swarm (docs/SCALE.md); a new state declares at once anyway (the donor priority changes),
        # and our downloads ask the donors the records show by peer id first
        declare_state_period=30.0,
        levels=levels,
        shared=shared,
        ceilings=ceilings,
        gate=gate,
        clock_offset=clock_offset,
        merge_rule=merge_rule,
        **({"compression": codec} if codec is not None else {}),
        shutdown_timeout=3.0,
        state_provider=state_provider,
    )
    try:
        averager.run_in_background(await_ready=True, timeout=start_timeout)
    except TimeoutError:
        averager.terminate()
        raise RuntimeError(f"the averager of {prefix} did not start within {start_timeout:.0f} s") from None
    return averager
