"""One fragment's rounds and state downloads behind a small interface, :class:`FragmentChannel`
(docs/DESIGN.md, "One round"). :class:`HivemindChannel` implements it with hivemind's
``DecentralizedAverager`` (subclassed where hivemind is designed for it: ``get_current_state`` and
``_aggregate_with_group``), the timeouts our rounds use, and shared memory through which the averager
process tells the island the grid it used, which parts no reducer averaged and the bytes it moved.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional, Protocol, Sequence

import torch

from p2p_diloco.algo import grid

logger = logging.getLogger(__name__)


def _fragment_averager_class():
    from hivemind.averaging import DecentralizedAverager

    class FragmentAverager(DecentralizedAverager):
        """hivemind's DecentralizedAverager for one fragment; it serves the fragment's state
        (Theta_p, outer momentum m_p, version) to joining or lagging islands through
        ``get_current_state``, hivemind's documented extension point."""

        def __init__(self, *args, state_provider: Callable[[], tuple[dict, list[torch.Tensor]]], levels: int = 0,
                     shared: Optional[dict] = None, ceilings: Optional[Sequence[int]] = None, **kwargs):
            self._state_provider = state_provider
            self._levels, self._ceilings = levels, ceilings
            self._shared = shared or {}
            super().__init__(*args, **kwargs)

        def get_current_state(self):
            metadata, tensors = self._state_provider()
            return metadata, tensors, None

        async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
            """In the averager process, once the group is known and around its all-reduce (hivemind's
            own PowerSGD averager extends this method the same way):

            - with a low-bit codec, put the raw values the island wrote on the round's shared grid,
              from the exponents every member gathered (:func:`p2p_diloco.algo.grid.put_on_grid_`), and
              tell the island which grid was used (``shared["grid"]``);
            - record exactly which elements kept this member's own values because their reducer
              failed (``shared["failed_mask"]``, ``shared["failed"]``: their number, -1 if unknown).
            """
            if self._levels:
                self._shared["grid"].copy_(await _put_on_shared_grid(self, group_info))
            recorder = _FailureRecorder(self._shared.get("failed_mask"))
            future = self._running_groups.get(group_info.group_id)
            if future is not None:
                future.add_done_callback(recorder.attach)  # runs before any reducer can have failed
            gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
            if "failed" in self._shared:
                self._shared["failed"].fill_(recorder.count())
            return gathered

    return FragmentAverager


async def _put_on_shared_grid(averager, group_info) -> torch.Tensor:
    """In the averager process: the round's shared grid from the exponents every member gathered, and
    the raw values in the averaged tensors put on it (:func:`p2p_diloco.algo.grid.put_on_grid_`, run
    off the event loop). Returns the grid used (int16, every tensor's chunk exponents in sequence)."""
    import asyncio

    from hivemind.utils.asyncio import enter_asynchronously

    reports = []
    for raw in group_info.gathered:
        try:
            user = averager.serializer.loads(averager.serializer.loads(raw)[2])
            reports.append(user.get("exponents") if isinstance(user, dict) else None)
        except Exception:
            reports.append(None)
    async with enter_asynchronously(averager.get_tensors()) as tensors:
        return await asyncio.get_event_loop().run_in_executor(
            None, grid.put_on_grid_, tensors, reports, averager._levels, averager._ceilings)


class _FailureRecorder:
    """Wraps one all-reduce's ``register_failed_reducer`` (hivemind keeps the member's own values for
    the parts of a reducer that failed) to mark those elements, in the flattened order of the
    averaged tensors, in ``mask`` (uint8, shared with the island)."""

    def __init__(self, mask: Optional[torch.Tensor]):
        self.mask, self.container = mask, None
        if mask is not None:
            mask.zero_()

    def attach(self, future) -> None:
        try:
            container = future.result().tensor_part_container
            original = container.register_failed_reducer
        except Exception as e:
            logger.debug("cannot watch for failed reducers: %r", e)
            return

        def record(peer_index: int) -> None:
            try:
                self._mark(container, peer_index)
            except Exception as e:  # never let bookkeeping break the all-reduce
                logger.debug("cannot record failed reducer parts: %r", e)
                self.container = None
            original(peer_index)

        container.register_failed_reducer = record
        self.container = container

    def _mark(self, container, peer_index: int) -> None:
        starts, position = [], 0
        for tensor in container.local_tensors:
            starts.append((tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size(), position,
                           tensor.element_size()))
            position += tensor.numel()
        first = container._outputs_registered_by_peer[peer_index]
        for part, _info in list(container._input_parts_by_peer[peer_index])[first:]:
            pointer = part.data_ptr()
            begin, _end, offset, size = next(entry for entry in starts if entry[0] <= pointer < entry[1])
            index = offset + (pointer - begin) // size
            self.mask[index:index + part.numel()] = 1

    def count(self) -> int:
        """Elements whose reducer failed, or -1 when they could not be recorded exactly."""
        if self.container is None or self.mask is None:
            return -1
        return int(self.container.failed_size)


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
        failed, -1 if unknown)
    :param ceilings: per tensor, the largest grid exponent an honest member needs
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
        declare_state_period=10.0,
        levels=levels,
        shared=shared,
        ceilings=ceilings,
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


@dataclass
class RoundReport:
    """What the averager process said about a channel's last all-reduce.

    :param grid: int16 chunk exponents of the shared grid it used (every tensor's in sequence), or
        None for plain fp32 rounds
    :param failed: elements whose reducer failed (they kept this member's own values); -1 when they
        could not be recorded exactly
    :param failed_mask: uint8 per element (fragment order), 1 where the reducer failed (valid when
        ``failed > 0``)
    """

    grid: Optional[torch.Tensor]
    failed: int
    failed_mask: torch.Tensor


class FragmentChannel(Protocol):
    """One fragment's averaging rounds and state transfers, as the island's rounds use them. A real
    averager (:class:`HivemindChannel`) and a test double implement the same methods."""

    def tensors(self) -> ContextManager[list[torch.Tensor]]:
        """The buffers a round averages in place (fp32, the fragment's shapes), locked while held."""

    def all_reduce(self, *, gather: dict, weight: float, scheduled_time: float, deadline: float,
                   stop) -> Optional[dict]:
        """One round: meet the members that show up at ``scheduled_time`` (wall clock), looking for a
        quorum until ``deadline``, and average the buffers with them (weight > 0). Returns
        {peer: gathered metadata} of the group, or None if the round failed or ``stop`` was set."""

    def report(self) -> RoundReport:
        """The grid and failed parts of the last :meth:`all_reduce`."""

    def traffic(self) -> tuple[int, int]:
        """Bytes of round messages sent and received so far."""

    def set_group_bits(self, bits: str) -> None:
        """Meet only members whose group key carries these bits ("" for the default key)."""

    def set_donor_priority(self, priority: float) -> None:
        """Donors of higher priority are asked first by downloaders."""

    def share_state(self) -> None:
        """Start serving the fragment's state to downloaders."""

    def load_state(self, timeout: float) -> Optional[tuple[dict, list[torch.Tensor]]]:
        """(metadata, tensors) downloaded from the best donor, or None (nobody, a timeout)."""

    def is_alive(self) -> bool:
        """False once the channel's helper process died."""

    def close(self, timeout: float = 5.0) -> None:
        """End the channel (after the DHT is shut down)."""


class HivemindChannel:
    """A :class:`FragmentChannel` over one hivemind averager process (forked by the constructor:
    create it from the main thread, see :mod:`p2p_diloco.procs`).

    :param dht: a running ``hivemind.DHT``
    :param shapes: the fragment's parameter shapes
    :param codec: the run's ``outer.codec`` (``none``, ``fp16``, ..., ``int2``)
    :param ceilings: per tensor, the largest grid exponent an honest member needs (low-bit codecs)
    :param state_provider: returns (metadata, tensors) served to peers that download the fragment
    :param allreduce_timeout: seconds an all-reduce may take once the group formed
    :param kwargs: ``prefix``, ``quorum``, ``matchmaking_time``, ``request_timeout`` of
        :func:`make_fragment_averager`
    """

    def __init__(self, dht, *, shapes: Sequence[torch.Size], codec: str, ceilings: Sequence[int],
                 state_provider: Callable[[], tuple[dict, list[torch.Tensor]]], allreduce_timeout: float, **kwargs):
        from p2p_diloco.net import codec as codecs

        self.allreduce_timeout = allreduce_timeout
        self.levels = grid.levels_of(codec)
        numel = sum(int(torch.Size(shape).numel()) for shape in shapes)
        # bytes sent, bytes received (counted by the codec), elements whose reducer failed (-1: unknown)
        self._traffic = torch.zeros(3, dtype=torch.int64).share_memory_()
        self._shared = {"grid": torch.zeros(grid.num_chunks(shapes), dtype=torch.int16).share_memory_(),
                        "failed_mask": torch.zeros(numel, dtype=torch.uint8).share_memory_(),
                        "failed": self._traffic[2:]}
        wire_codec = codecs.make_codec(codec, self._traffic[:2])
        codecs.install(wire_codec)  # in the averager forked next: decodes and encodes the round's messages
        self.averager = make_fragment_averager(
            [torch.zeros(shape) for shape in shapes], dht, codec=wire_codec, levels=self.levels,
            shared=self._shared, ceilings=ceilings, state_provider=state_provider,
            allreduce_timeout=allreduce_timeout, **kwargs)

    def tensors(self) -> ContextManager[list[torch.Tensor]]:
        return self.averager.get_tensors()

    def all_reduce(self, *, gather: dict, weight: float, scheduled_time: float, deadline: float,
                   stop) -> Optional[dict]:
        """See :class:`FragmentChannel`. A slot is one-shot (no retries: a retry would average buffers
        that the failed attempt already changed)."""
        self._traffic[2] = -1  # unknown until the averager tells
        self._shared["grid"].fill_(grid.TOP_EXPONENT)  # (a grid that carries nothing, until it tells)
        if not self.averager.is_alive():  # step() would wait forever for a dead process
            return None
        control = None
        try:
            control = self.averager.step(gather=gather, weight=weight, scheduled_time=scheduled_time,
                                         timeout=max(0.5, deadline - time.time()), allow_retries=False, wait=False)
            # hivemind bounds the all-reduce by allreduce_timeout once the group formed; on a loaded
            # machine its event loop may report late, so allow as much again before giving up
            budget = deadline - time.time() + 2.0 * self.allreduce_timeout + 1.0
            while budget > 0 and not stop.is_set():
                try:
                    return control.result(timeout=min(0.5, budget))
                except FutureTimeout:
                    budget -= 0.5
            control.cancel()
            return None
        except Exception as e:  # no group, a peer vanished mid-round, a timeout
            logger.debug("round failed: %r", e)
            if control is not None and not control.done():
                control.cancel()
            # the future keeps the exception, whose traceback holds this frame and its callers' (the
            # snapshot, the pseudo-gradient): a reference cycle that only a full GC would free, so
            # the island's memory grew by a fragment or two per failed round (scripts/bench_rss.py)
            e.__traceback__ = None
            return None
        finally:
            control = None

    def report(self) -> RoundReport:
        return RoundReport(self._shared["grid"].clone() if self.levels else None, int(self._traffic[2]),
                           self._shared["failed_mask"])

    def traffic(self) -> tuple[int, int]:
        sent, received = self._traffic[:2].tolist()
        return int(sent), int(received)

    def set_group_bits(self, bits: str) -> None:
        try:
            self.averager.set_group_bits(bits)
        except Exception as e:
            logger.debug("could not set group bits: %r", e)

    def set_donor_priority(self, priority: float) -> None:
        try:
            self.averager.state_sharing_priority = priority
        except Exception as e:
            logger.debug("could not update donor priority: %r", e)

    def share_state(self) -> None:
        self.averager.allow_state_sharing = True

    def load_state(self, timeout: float) -> Optional[tuple[dict, list[torch.Tensor]]]:
        try:
            return self.averager.load_state_from_peers(wait=True, timeout=timeout)
        except Exception as e:
            logger.debug("state download failed: %r", e)
            return None

    def is_alive(self) -> bool:
        return self.averager.is_alive()

    @property
    def exitcode(self) -> Optional[int]:
        """The averager process's exit code (None while it runs)."""
        return self.averager.exitcode

    def close(self, timeout: float = 5.0) -> None:
        """End the averager process; call after the DHT (and with it p2pd) is shut down.

        Order matters: an averager that exits while one of its DHT requests is still queued crashes
        hivemind's DHT process (the request's reply pipe can no longer be fetched from the dead
        sender), so the DHT goes first. With p2pd gone, an averager's graceful shutdown (which
        unregisters its handlers from p2pd) can only fail, so the averager gets SIGTERM: rounds have
        stopped and it holds no state of its own. For the same reason there is no
        ``allow_state_sharing = False`` here: donor entries simply expire.
        """
        if self.averager.is_alive():
            self.averager.terminate()
        self.averager.join(timeout)
        if self.averager.is_alive():
            self.averager.kill()
            self.averager.join(timeout)
