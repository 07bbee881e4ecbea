"""Can other peers dial this machine? A dial-back check at start (docs/DESIGN.md, "Islands behind NAT").

An island behind NAT (a home router, a cloud instance without a public address) can dial out but
nobody can dial it. As a full member of a round it would be the reducer of a part that the others
cannot send to, and its group would fail; so it takes part as a hivemind *client-mode* member: it
sends its parts to the reducers and receives the averages, and reduces and serves nothing.

Whether a machine can be dialled is decided before its DHT starts, as libp2p's AutoNAT does: a
short-lived libp2p host listening where the island will listen asks up to three initial peers to
open a plain TCP connection back to the address they see the request come from, at the island's
listening port(s). The DHT then starts as a client (it stores and serves nothing, so nobody keeps an
address that cannot be dialled in a routing table) or as a full node. p2pd runs AutoNAT itself but
does not report its verdict through its control API, and AutoNAT ignores private addresses (a LAN, a
datacenter network, our namespace lab), hence this check.

A helper dials only the address the request came from, at most :data:`MAX_PORTS` ports, a few checks
at a time: it cannot be used to make the swarm connect anywhere else. A helper's answer is not
trusted alone: the island is public only if most of the helpers that answered reached it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

from p2p_diloco.net.dht import peers_by_id

logger = logging.getLogger(__name__)

HANDLER = "p2p_diloco.DialBack"
MAX_PORTS = 4  # ports a requester may ask one helper to try
MAX_REQUEST_BYTES = 256
HELPERS = 3  # initial peers asked
DIAL_TIMEOUT = 3.0  # seconds a helper waits for a TCP connection back (a firewall that drops is silent)

MAX_WAITING = 16  # requests a helper holds at once (beyond: refused at once, the requester asks others)

_checks: Optional[asyncio.Semaphore] = None  # in the helper's DHT process: checks running at once
_waiting = 0  # in the helper's DHT process: requests being answered or queued


@dataclass
class Reachability:
    """The verdict of :func:`check_reachability`.

    :param verdict: ``public`` (most helpers that answered reached this machine), ``nat`` (they did
        not), ``unknown`` (no helper answered)
    :param answers: each answering helper's peer id and whether it reached this machine
    :param observed: the addresses the helpers saw the requests come from (a NAT router's, behind NAT)
    """

    verdict: str
    answers: dict[str, bool] = field(default_factory=dict)
    observed: list[str] = field(default_factory=list)

    def describe(self) -> str:
        reached = sum(self.answers.values())
        seen = f" (seen as {', '.join(sorted(set(self.observed)))})" if self.observed else ""
        return f"{reached} of {len(self.answers)} peer(s) could dial this machine back{seen}"


def verdict_of(answers: dict[str, bool]) -> str:
    """``public`` if more than half of the answers reached us, ``nat`` if fewer, ``unknown`` if none
    (a tie counts as ``nat``: a client-mode member costs the swarm one reducer, a member nobody can
    reach costs it whole rounds)."""
    if not answers:
        return "unknown"
    return "public" if 2 * sum(answers.values()) > len(answers) else "nat"


def _protocols(maddr) -> dict[str, str]:
    """{protocol name: value} of a multiaddr's transport part, before ``/p2p/<peer id>`` (hivemind's
    parser; empty if malformed)."""
    from hivemind.utils.multiaddr import Multiaddr

    try:
        parsed = Multiaddr(str(maddr).partition("/p2p/")[0])
        return {proto.name: parsed.value_for_protocol(proto.code) for proto in parsed.protocols()}
    except Exception:
        return {}


def _host_of(maddr) -> Optional[str]:
    """The IPv4/IPv6 address of a direct multiaddr (None for a relayed or a DNS one)."""
    if "/p2p-circuit" in str(maddr):
        return None
    protocols = _protocols(maddr)
    return protocols.get("ip4") or protocols.get("ip6")


def _is_loopback(host: Optional[str]) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _valid_ports(values) -> list[int]:
    """Distinct TCP ports in 1..65535 among ``values``, at most :data:`MAX_PORTS`."""
    ports: list[int] = []
    for value in values:
        if isinstance(value, (int, str)) and str(value).isdigit() and 0 < int(value) < 65536 and int(value) not in ports:
            ports.append(int(value))
    return ports[:MAX_PORTS]


def ports_of(maddrs: Sequence) -> list[int]:
    """The TCP ports in ``maddrs`` (at most :data:`MAX_PORTS`, no duplicates, no zeros)."""
    return _valid_ports(_protocols(maddr).get("tcp") for maddr in maddrs)


async def _answer(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """In a helper's DHT process: dial the requester back at the address its stream came from.
    Bounded: at most :data:`MAX_WAITING` requests held, 4 checks at a time, each waiting at most
    :data:`DIAL_TIMEOUT` for a free slot; a busy helper does not answer (the requester counts no vote),
    and one with nothing to dial answers ``reached: null``."""
    global _checks, _waiting
    _checks = _checks or asyncio.Semaphore(4)
    _waiting += 1
    try:
        if _waiting > MAX_WAITING:
            return
        host = _host_of(stream_info.addr)
        request = json.loads(await asyncio.wait_for(reader.read(MAX_REQUEST_BYTES), DIAL_TIMEOUT) or b"{}")
        ports = _valid_ports(request.get("ports", [])[:MAX_PORTS])
        reached = None  # no direct address or no port to dial: no verdict
        if host is not None and ports:
            await asyncio.wait_for(_checks.acquire(), DIAL_TIMEOUT)
            try:
                reached = False
                for port in ports:
                    try:
                        _, dialled = await asyncio.wait_for(asyncio.open_connection(host, port), DIAL_TIMEOUT)
                        dialled.close()
                        reached = True
                        break
                    except (OSError, asyncio.TimeoutError):
                        continue
            finally:
                _checks.release()
        reply = {"reached": reached, "observed": host or ""}
        writer.write(json.dumps(reply).encode())
        await writer.drain()
    except Exception as e:  # a malformed or vanished request, or a busy helper: nothing to answer
        logger.debug("dial-back request failed: %r", e)
    finally:
        _waiting -= 1
        writer.close()


async def _serve(_dht, node) -> None:  # module level: run_coroutine pickles it to the DHT process
    await node.p2p.add_binary_stream_handler(HANDLER, _answer)


def serve_dial_back(dht) -> None:
    """Answer other peers' dial-back checks from this DHT's process (the bootstrap node and public
    islands do; a client-mode DHT could not be reached to be asked)."""
    try:
        dht.run_coroutine(_serve)
    except Exception as e:
        logger.warning("cannot answer reachability checks: %r", e)


async def _ask(p2p, peer_id, ports: list[int], timeout: float) -> Optional[tuple[bool, str]]:
    try:
        _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer_id, HANDLER), timeout)
    except Exception as e:
        logger.debug("peer %s could not be asked for a dial-back: %r", peer_id, e)
        return None
    try:
        writer.write(json.dumps({"ports": ports}).encode())
        await writer.drain()
        reply = json.loads(await asyncio.wait_for(reader.read(MAX_REQUEST_BYTES), timeout + DIAL_TIMEOUT * MAX_PORTS))
        if isinstance(reply.get("reached"), bool):
            return reply["reached"], str(reply.get("observed", ""))[:64]
    except Exception as e:
        logger.debug("no dial-back answer from %s: %r", peer_id, e)
    finally:
        writer.close()
    return None


def helpers_of(initial_peers: Sequence[str]) -> list[str]:
    """The peer ids of up to :data:`HELPERS` initial peers to ask. Peers on this machine's loopback
    are left out when there are others: they always reach us, whatever the rest of the world can."""
    by_id = peers_by_id(initial_peers)
    remote = [peer for peer, maddrs in by_id.items() if not all(_is_loopback(_host_of(m)) for m in maddrs)]
    return (remote or list(by_id))[:HELPERS]


async def _check(initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str],
                 timeout: float) -> Reachability:
    from hivemind.p2p import P2P, PeerID

    p2p = await P2P.create(initial_peers=list(initial_peers), host_maddrs=list(host_maddrs),
                           announce_maddrs=list(announce_maddrs) or None, use_relay=False, auto_nat=False,
                           nat_port_map=False, startup_timeout=timeout)
    try:
        ports = ports_of(await p2p.get_visible_maddrs())
        if not ports:  # nothing a helper could dial (no TCP address): no verdict
            return Reachability("unknown")
        helpers = [PeerID.from_base58(peer) for peer in helpers_of(initial_peers)]
        replies = await asyncio.gather(*(_ask(p2p, peer, ports, timeout) for peer in helpers))
    finally:
        await p2p.shutdown()
    answers = {str(peer): reply[0] for peer, reply in zip(helpers, replies) if reply is not None}
    observed = [reply[1] for reply in replies if reply is not None and reply[1]]
    return Reachability(verdict_of(answers), answers, observed)


def check_reachability(initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str] = (),
                       timeout: float = 10.0) -> Reachability:
    """Ask up to :data:`HELPERS` initial peers whether they can dial this machine at the ports it
    listens on (``host_maddrs``: where the DHT will listen; port 0 checks a fresh port) or announces
    (``announce_maddrs``: a port forwarded to it).

    Takes about a second (a p2pd start); at most about ``2 * timeout + 22`` seconds (the p2pd start,
    opening the streams, the helpers' dial-backs) when helpers are slow or silent. Never raises: a
    failure to ask anyone is the verdict ``unknown``.
    """
    if not initial_peers:
        return Reachability("unknown")
    try:
        return asyncio.run(_check(initial_peers, host_maddrs, announce_maddrs, timeout))
    except Exception as e:
        logger.debug("reachability check failed: %r", e)
        return Reachability("unknown")


def decide_client_mode(setting: str, initial_peers: Sequence[str], host_maddrs: Sequence[str],
                       announce_maddrs: Sequence[str] = ()) -> str:
    """This island's reachability from ``--client-mode`` (``auto``, ``on``, ``off``), logged once.

    :returns: ``client`` (on), ``public`` (off, dialled back, no initial peers (the swarm's first
        island), or all initial peers on this machine's loopback), ``nat`` (nobody could dial it back: a client-mode member) or ``unknown``
        (nobody answered: a full member, as before)
    """
    if setting == "on":
        logger.info("client mode (--client-mode on): this island sends its parts and reduces nothing")
        return "client"
    if setting == "off":
        return "public"
    if not initial_peers or all(_is_loopback(_host_of(peer)) for peer in initial_peers):
        return "public"  # the swarm's first island (others join through it), or peers on this machine
    found = check_reachability(initial_peers, host_maddrs, announce_maddrs)
    if found.verdict == "nat":
        logger.warning(
            "this machine cannot be dialled (%s): it joins rounds as a client (it sends its parts and "
            "receives the averages; it reduces nothing and serves no state downloads). To be a full member, "
            "forward a fixed port to it (--host-maddrs /ip4/0.0.0.0/tcp/PORT) and announce the public "
            "address (--announce-maddrs), or set --client-mode off if you know it can be dialled",
            found.describe())
    elif found.verdict == "unknown":
        logger.warning("no initial peer answered the reachability check (unreachable so far, or of an older "
                       "version); this island joins as a full member: set --client-mode on if it is behind NAT")
    else:
        logger.info("reachability: %s", found.describe())
    return found.verdict
