"""Emulated links: network namespaces joined by veth pairs on a bridge; a cut drops traffic, tc tbf
throttles it, and closing removes everything. Needs root (CAP_NET_ADMIN) and iproute2."""

from __future__ import annotations

import select
import subprocess
import sys

import pytest

from p2p_diloco.lab import netns

pytestmark = pytest.mark.integration

REASON = netns.check_available()

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5555)); s.listen(8); print("ready", flush=True)
while True:
    c, _ = s.accept(); c.sendall(c.recv(16)); c.close()
"""
CLIENT = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], 5555), timeout=1.5); c.sendall(b"ping"); print(c.recv(16).decode())
except OSError as e:
    print("unreachable", e)
"""


def _run_in(lab, index, code, *args, timeout=10):
    return subprocess.run([*lab.prefix(index), sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout).stdout.strip()


@pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")
def test_lab_links_can_be_cut_throttled_and_removed():
    try:
        lab = netns.Lab(2)
    except netns.NetnsUnavailable as e:  # root without CAP_SYS_ADMIN (a container, say)
        pytest.skip(str(e))
    server = None
    try:
        server = subprocess.Popen([*lab.prefix(0), sys.executable, "-c", SERVER, lab.address(0)],
                                  stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([server.stdout], [], [], 20)
        assert ready and server.stdout.readline().strip() == "ready"
        assert _run_in(lab, 1, CLIENT, lab.address(0)) == "ping"  # island 1 reaches island 0 over the bridge
        lab.cut(0)
        assert _run_in(lab, 1, CLIENT, lab.address(0)).startswith("unreachable")
        lab.restore(0)
        assert _run_in(lab, 1, CLIENT, lab.address(0)) == "ping"
        lab.throttle(1, "5mbit")
        shown = subprocess.run([*lab.prefix(1), "tc", "qdisc", "show", "dev", "eth0"], capture_output=True,
                               text=True).stdout
        assert "tbf" in shown and "5Mbit" in shown
        assert _run_in(lab, 1, CLIENT, lab.address(0)) == "ping"
        lab.unthrottle(1)
        assert "tbf" not in subprocess.run([*lab.prefix(1), "tc", "qdisc", "show", "dev", "eth0"],
                                           capture_output=True, text=True).stdout
    finally:
        if server is not None:
            server.kill()
            server.wait(5)
        lab.close()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"p2pd-{lab.tag}-" not in names
    assert subprocess.run(["ip", "link", "show", lab.bridge], capture_output=True).returncode != 0


@pytest.mark.skipif(netns.check_available(nat=True) is not None, reason="namespaces or iptables unavailable")
def test_an_island_behind_nat_dials_out_and_nobody_dials_it():
    try:
        lab = netns.Lab(3, nat=(1, 2))
    except netns.NetnsUnavailable as e:
        pytest.skip(str(e))
    servers = []
    try:
        for i in range(3):
            server = subprocess.Popen([*lab.prefix(i), sys.executable, "-c", SERVER, lab.address(i)],
                                      stdout=subprocess.PIPE, text=True)
            servers.append(server)
            ready, _, _ = select.select([server.stdout], [], [], 20)
            assert ready and server.stdout.readline().strip() == "ready"
        assert lab.address(1) == lab.address(2) == "192.168.1.10"  # one private LAN behind every router
        assert _run_in(lab, 1, CLIENT, lab.address(0)) == "ping"  # out through the router
        assert _run_in(lab, 0, CLIENT, lab.address(1)).startswith("unreachable")  # no route to a private LAN
        assert _run_in(lab, 0, CLIENT, lab.public_address(1)).startswith("unreachable")  # the router forwards nothing
        assert _run_in(lab, 2, CLIENT, lab.public_address(1)).startswith("unreachable")  # nor for the other NAT'd
    finally:
        for server in servers:
            server.kill()
            server.wait(5)
        lab.close()
    assert f"p2pd-{lab.tag}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
