"""Everything that touches hivemind's networking: multiaddrs, the DHT, identities, averagers.

The rest of the package sees small functions and one class, :class:`FragmentAverager`; the inner loop
never calls into this module.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from p2p_diloco.errors import ConfigError, Interrupted, NetworkError

logger = logging.getLogger(__name__)

# A fixed listen port must fail loudly when taken: without this, libp2p's SO_REUSEPORT lets a second
# process bind the same port and the kernel splits connections between the two.
os.environ.setdefault("LIBP2P_TCP_REUSEPORT", "false")


def quiet_hivemind(verbose: bool) -> None:
    """hivemind logs expected events (a lone island finding no group) as errors; keep them for -v."""
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("in_root_logger")
    level = logging.INFO if verbose else logging.WARNING
    logging.getLogger("hivemind").setLevel(level)
    # "asyncio" only carries hivemind's internal task errors here (e.g. a round result arriving after we
    # gave up on it); the island reports round outcomes itself
    for noisy in ("hivemind.averaging", "hivemind.p2p", "hivemind.dht", "hivemind.utils", "asyncio"):
        logging.getLogger(noisy).setLevel(level if verbose else logging.CRITICAL)


def parse_maddrs(values: Sequence[str], *, what: str, need_peer_id: bool) -> list[str]:
    """Check that every value is a multiaddr (``/ip4/1.2.3.4/tcp/31337[/p2p/PEER_ID]``).

    :param what: the flag being checked, named in errors
    :param need_peer_id: initial peers must end with ``/p2p/<peer id>``
    :raises ConfigError: naming the first malformed value
    """
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    checked = []
    for value in values:
        try:
            maddr = Multiaddr(value)
            protocols = [proto.name for proto in maddr.protocols()]
        except Exception as e:
            raise ConfigError(
                f"{what}: {value!r} is not a multiaddr ({e}); expected e.g. /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW..."
            ) from None
        if need_peer_id:
            if "p2p" not in protocols:
                raise ConfigError(f"{what}: {value!r} lacks the peer id; expected .../p2p/12D3KooW... (copy INITIAL_PEERS)")
            try:
                PeerID.from_base58(maddr.value_for_protocol("p2p"))
            except Exception:
                raise ConfigError(f"{what}: {value!r} has a malformed peer id after /p2p/") from None
        checked.append(value)
    return checked


def check_listen_ports(host_maddrs: Sequence[str]) -> None:
    """Fail fast, naming the port, when a fixed TCP listen port is already taken.

    :raises NetworkError: if binding one of the ``/tcp/PORT`` addresses fails
    """
    from hivemind.utils.multiaddr import Multiaddr

    for value in host_maddrs:
        maddr = Multiaddr(value)
        protocols = [proto.name for proto in maddr.protocols()]
        if "tcp" not in protocols or int(maddr.value_for_protocol("tcp")) == 0:
            continue
        port = int(maddr.value_for_protocol("tcp"))
        family, host = (socket.AF_INET6, maddr.value_for_protocol("ip6")) if "ip6" in protocols else (
            socket.AF_INET, maddr.value_for_protocol("ip4") if "ip4" in protocols else "0.0.0.0")
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise NetworkError(
                        f"port {port} is already in use ({value}): stop the other process or pick another port"
                    ) from None
                raise NetworkError(f"cannot listen on {value}: {e.strerror}") from None


def ensure_identity(path: str) -> str:
    """Create a libp2p private key at ``path`` on first use (mode 0600); reuse it afterwards.

    :returns: the absolute path
    :raises ConfigError: if the file exists but is unreadable or not a key
    """
    from hivemind.p2p import P2P, PeerID

    file = Path(path).expanduser().absolute()
    if file.exists():
        try:
            PeerID.from_identity(file.read_bytes())
        except PermissionError:
            raise ConfigError(f"identity file {file} is not readable (permission denied)") from None
        except Exception:
            raise ConfigError(f"identity file {file} is not a libp2p private key: move it away to create a new one") from None
    else:
        file.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(file))
        os.chmod(file, 0o600)
        logger.info("created identity key %s", file)
    return str(file)


def start_dht(
    *,
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str] = (),
    identity_path: str = "",
    client_mode: bool = False,
    record_validators: Sequence[Any] = (),
    join_timeout: float = 60.0,
    stop_event: Optional[threading.Event] = None,
    wait_timeout: float = 3.0,
):
    """Start a hivemind DHT, retrying with exponential backoff while the initial peers are unreachable.

    :param join_timeout: seconds to keep retrying before giving up
    :param wait_timeout: seconds a DHT request waits for a reply (hivemind's default: 3)
    :returns: a running ``hivemind.DHT``
    :raises NetworkError: with one line naming the peers, once the retries are spent or stop_event is set
    """
    import hivemind

    kwargs: dict[str, Any] = dict(
        host_maddrs=list(host_maddrs),
        client_mode=client_mode,
        record_validators=list(record_validators),
        nat_port_map=False,  # no UPnP multicast on the local network
        use_relay=False,
        use_auto_relay=False,
        startup_timeout=30,
        wait_timeout=wait_timeout,
    )
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    if identity_path:
        kwargs["identity_path"] = identity_path
    deadline = time.monotonic() + join_timeout
    delay, attempt = 1.0, 0
    while True:
        attempt += 1
        try:
            return hivemind.DHT(initial_peers=list(initial_peers) or None, start=True, **kwargs)
        except Exception as e:
            reason = str(e).splitlines()[-1] if str(e) else type(e).__name__
            if "address already in use" in reason:
                raise NetworkError(f"cannot listen on {' '.join(host_maddrs)}: address already in use") from None
            if "already taken by another peer" in reason:
                raise NetworkError(f"identity {identity_path} is already used by a live peer: is this island running twice?") from None
            if not initial_peers:
                raise NetworkError(f"could not start the DHT: {reason}") from None
            remaining = deadline - time.monotonic()
            if stop_event is not None and stop_event.is_set():
                raise Interrupted("interrupted while connecting to the initial peers") from None
            if remaining <= 0:
                raise NetworkError(
                    f"could not reach any initial peer ({' '.join(initial_peers)}) after {attempt} attempts "
                    f"in {join_timeout:.0f} s: check the address and that the bootstrap node is running"
                ) from None
            wait = min(delay, remaining)
            logger.warning("initial peers unreachable (%s); retrying in %.0f s", reason, wait)
            if stop_event is not None and stop_event.wait(wait):
                raise Interrupted("interrupted while connecting to the initial peers") from None
            if stop_event is None:
                time.sleep(wait)
            delay = min(delay * 2, 16.0)


def peers_by_id(maddrs: Sequence[str]) -> dict[str, list[str]]:
    """Group multiaddrs that end in ``/p2p/<peer id>`` by peer id (others are skipped)."""
    peers: dict[str, list[str]] = {}
    for maddr in maddrs:
        head, sep, peer = str(maddr).rpartition("/p2p/")
        if sep and peer:
            peers.setdefault(peer, []).append(str(maddr))
    return peers


def visible_maddrs(dht) -> list[str]:
    """The multiaddrs (with /p2p/ peer id) that other peers can use to join through this one."""
    return [str(maddr) for maddr in dht.get_visible_maddrs(latest=True)]


async def _count_peers(_dht, node) -> int:  # module level: run_coroutine pickles it to the DHT process
    return len(await node.p2p.list_peers())


async def _reconnect(_dht, node, peers: dict, timeout: float) -> int:
    """In the DHT process: dial each peer at its last known addresses and ping it, which puts it back
    in this node's routing table and this node back in its (the ping asks it to add us)."""
    import asyncio

    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    async def one(peer_id: str, maddrs: list) -> bool:
        peer = PeerID.from_base58(peer_id)
        try:  # the daemon may have forgotten the addresses of a peer it lost; tell it again
            addrs = [Multiaddr(m.rpartition("/p2p/")[0] or m) for m in maddrs]  # transport part only
            await asyncio.wait_for(node.p2p._client.connect(peer, addrs), timeout)
        except Exception:
            pass  # the ping below still tries the addresses the daemon remembers
        return await asyncio.wait_for(node.protocol.call_ping(peer), timeout) is not None

    results = await asyncio.gather(*(one(p, m) for p, m in peers.items()), return_exceptions=True)
    return sum(result is True for result in results)


def reconnect_peers(dht, peers: dict[str, list[str]], timeout: float = 3.0):
    """Ask the DHT to reconnect to ``peers`` (peer id -> multiaddrs), without waiting.

    hivemind's DHT drops peers that stop answering (a cut link, a frozen process) and does not look
    for them again; once the bootstrap node is gone, an island whose routing table emptied would stay
    alone forever. Islands call this for peers they knew but no longer see, which heals the partition.

    :returns: a future with the number of peers that answered (or None if the call could not be made)
    """
    try:
        return dht.run_coroutine(partial(_reconnect, peers=dict(peers), timeout=timeout), return_future=True)
    except Exception as e:
        logger.debug("could not ask the DHT to reconnect: %r", e)
        return None


def count_connected_peers(dht) -> int:
    """Number of libp2p peers this DHT's daemon is connected to (for log lines); -1 if unknown."""
    try:
        return int(dht.run_coroutine(_count_peers))
    except Exception as e:
        logger.debug("could not count peers: %r", e)
        return -1


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
              from the exponents every member gathered (:func:`p2p_diloco.wire.put_on_grid_`), and
              tell the island which grid was used (``shared["grid"]``);
            - record exactly which elements kept this member's own values because their reducer
              failed (``shared["failed_mask"]``, ``shared["failed"]``: their number, -1 if unknown).
            """
            import asyncio

            from hivemind.utils.asyncio import enter_asynchronously

            if self._levels:
                from p2p_diloco import wire

                reports = []
                for raw in group_info.gathered:
                    try:
                        user = self.serializer.loads(self.serializer.loads(raw)[2])
                        reports.append(user.get("exponents") if isinstance(user, dict) else None)
                    except Exception:
                        reports.append(None)
                async with enter_asynchronously(self.get_tensors()) as tensors:
                    grid = await asyncio.get_event_loop().run_in_executor(
                        None, wire.put_on_grid_, tensors, reports, self._levels, self._ceilings)
                self._shared["grid"].copy_(grid)
            recorder = _FailureRecorder(self._shared.get("failed_mask"))
            future = self._running_groups.get(group_info.group_id)
            if future is not None:
                future.add_done_callback(recorder.attach)  # runs before any reducer can have failed
            gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
            if "failed" in self._shared:
                self._shared["failed"].fill_(recorder.count())
            return gathered

    return FragmentAverager


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
):
    """Start one fragment's averager process (hivemind ``DecentralizedAverager``).

    Rounds send what ``codec`` encodes (a :mod:`p2p_diloco.wire` codec, installed with
    ``wire.install`` right before this call). With ``levels == 0`` the island writes the
    exact-average encoding of :func:`p2p_diloco.outer.encode_for_wire` (plain fp32 on the wire);
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
    :returns: the started averager; end it with ``terminate()`` after the DHT is shut down
    """
    FragmentAverager = _fragment_averager_class()
    chunk_timeout = next_chunk_timeout(allreduce_timeout)
    return FragmentAverager(
        averaged_tensors=list(tensors),
        dht=dht,
        start=True,
        prefix=prefix,
        min_group_size=max(2, quorum),
        min_matchmaking_time=matchmaking_time,
        request_timeout=request_timeout,
        allreduce_timeout=allreduce_timeout,
        # a member that stops answering is dropped from the round well before the round's own
        # timeout, so the others finish without it (outer.find_unaveraged handles its part)
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
