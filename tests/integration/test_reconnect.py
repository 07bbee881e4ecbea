"""Healing a DHT partition: a node dials a peer it lost and both routing tables get it back.

Two real hivemind DHT nodes on 127.0.0.1: B joins through A, then A's routing-table entry for B is
dropped (as hivemind does for a peer that stops answering); reconnect_peers from B puts it back.
"""

from __future__ import annotations

import pytest

from p2p_diloco.net.dht import peers_by_id, reconnect_peers, start_dht, visible_maddrs

pytestmark = pytest.mark.integration


async def _forget(_dht, node, peer_id: str) -> bool:
    from hivemind.p2p import PeerID

    peer = PeerID.from_base58(peer_id)
    node_id = node.protocol.routing_table.get(peer_id=peer)
    if node_id is not None:
        del node.protocol.routing_table[node_id]
    return node.protocol.routing_table.get(peer_id=peer) is None


async def _knows(_dht, node, peer_id: str) -> bool:
    from hivemind.p2p import PeerID

    return node.protocol.routing_table.get(peer_id=PeerID.from_base58(peer_id)) is not None


def test_reconnect_peers_restores_both_routing_tables():
    from functools import partial

    a = start_dht(initial_peers=[], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    b = start_dht(initial_peers=visible_maddrs(a), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        a_id, b_id = str(a.peer_id), str(b.peer_id)
        assert a.run_coroutine(partial(_knows, peer_id=b_id))
        assert a.run_coroutine(partial(_forget, peer_id=b_id)) and b.run_coroutine(partial(_forget, peer_id=a_id))
        assert not a.run_coroutine(partial(_knows, peer_id=b_id))
        answered = reconnect_peers(b, peers_by_id(visible_maddrs(a))).result(timeout=30)
        assert answered == 1
        assert b.run_coroutine(partial(_knows, peer_id=a_id))  # B has A again
        assert a.run_coroutine(partial(_knows, peer_id=b_id))  # and the ping made A add B back
    finally:
        b.shutdown()
        a.shutdown()
