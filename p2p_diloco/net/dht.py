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
from typing import Any, Optional, Sequence

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
    authorizer=None,
):
    """Start a hivemind DHT, retrying with exponential backoff while the initial peers are unreachable.

    :param client_mode: store and serve nothing (observers; islands behind NAT): nobody dials it
    :param join_timeout: seconds to keep retrying before giving up
    :param wait_timeout: seconds a DHT request waits for a reply (hivemind's default: 3)
    :param authorizer: a private run's :class:`p2p_diloco.net.gate.RunAuthorizer` (None: open)
    :returns: a running ``hivemind.DHT``
    :raises NetworkError: with one line naming the peers, once the retries are spent or stop_event is set
    """
    import hivemind

    kwargs: dict[str, Any] = dict(
        host_maddrs=list(host_maddrs),
        client_mode=client_mode,
        record_validators=list(record_validators),
        nat_port_map=False,  # no UPnP multicast on the local network
        # no libp2p circuit relays: an island behind NAT takes part as a client, which only dials out
        # (docs/DESIGN.md, "Islands behind NAT" says why, and why our lab cannot exercise them)
        use_relay=False,
        use_auto_relay=False,
        startup_timeout=30,
        wait_timeout=wait_timeout,
        # a clock more than 3 s off joins with a warning instead of failing as "unreachable": the island
        # then measures its offset and says so (p2p_diloco.net.clock; docs/DESIGN.md, "Clocks")
        strict=False,
    )
    if authorizer is not None:
        kwargs["authorizer"] = authorizer
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    if identity_path:
        kwargs["identity_path"] = identity_path
    deadline = time.monotonic() + join_timeout
    delay, attempt = 1.0, 0
    stop_event = stop_event or threading.Event()
    while True:
        attempt += 1
        try:
            return hivemind.DHT(initial_peers=list(initial_peers) or None, start=True, **kwargs)
        except Exception as e:
            reason = str(e).splitlines()[-1] if str(e) else type(e).__name__
            _raise_if_final(reason, host_maddrs, identity_path, initial_peers)
            remaining = deadline - time.monotonic()
            if stop_event.is_set():
                raise Interrupted("interrupted while connecting to the initial peers") from None
            if remaining <= 0:
                raise NetworkError(
                    f"could not reach any initial peer ({' '.join(initial_peers)}) after {attempt} attempts "
                    f"in {join_timeout:.0f} s: check the address and that the bootstrap node is running"
                    + ("; in a private run, also that they admit this peer's certificate (their logs say why "
                       "they refused it)" if authorizer is not None else
                       " (a private run answers only peers started with --certificate)")
                ) from None
            wait = min(delay, remaining)
            logger.warning("initial peers unreachable (%s); retrying in %.0f s", reason, wait)
            if stop_event.wait(wait):
                raise Interrupted("interrupted while connecting to the initial peers") from None
            delay = min(delay * 2, 16.0)


def _raise_if_final(reason: str, host_maddrs: Sequence[str], identity_path: str, initial_peers: Sequence[str]) -> None:
    """A DHT start failure that retrying cannot fix: a taken address or identity, or nobody to join."""
    if "address already in use" in reason:
        raise NetworkError(f"cannot listen on {' '.join(host_maddrs)}: address already in use") from None
    if "already taken by another peer" in reason:
        raise NetworkError(f"identity {identity_path} is already used by a live peer: is this island running twice?") from None
    if not initial_peers:
        raise NetworkError(f"could not start the DHT: {reason}") from None


def peers_by_id(maddrs: Sequence[str]) -> dict[str, list[str]]:
    """Group multiaddrs that end in ``/p2p/<peer id>`` by peer id (others are skipped)."""
    peers: dict[str, list[str]] = {}
    for maddr in maddrs:
        head, sep, peer = str(maddr).rpartition("/p2p/")
        if sep and peer:
            peers.setdefault(peer, []).append(str(maddr))
    return peers


def visible_maddrs(dht) -> list[str]:
    """The multiaddrs (with /p2p/ peer id) that other peers can use to join through this one: those
    p2pd reported when the DHT started (asking it again, ``latest=True``, now and then never answers,
    and hivemind's call has no timeout)."""
    return [str(maddr) for maddr in dht.get_visible_maddrs(latest=False)]


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
