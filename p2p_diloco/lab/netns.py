"""Emulated links between islands on one machine: Linux network namespaces joined by veth pairs.

Each island of a chaos run gets its own network namespace with one interface, ``eth0``, whose peer
end sits on a bridge in the launching namespace; the bootstrap node listens on the bridge's address.
All addresses are private (10.77.x.0/24), on this machine only, and no namespace has a route off it,
so nothing can leave the host. A link can be cut (its bridge end set down) and throttled with
``tc tbf`` on both ends (netem is not needed).

An island may sit behind its own NAT router (``nat=``), as a volunteer at home does: the router is a
namespace on the bridge (it holds the island's public address) that masquerades the island's private
LAN (192.168.1.0/24, the same behind every router, as home routers have it) with ``iptables`` and drops
every connection that starts outside. The island can dial out; nobody can dial it, not even an island
behind another router. The island's default route leads to its router, whose only routes are its two
links: a packet for any other address is dropped there.

Needs root (or CAP_NET_ADMIN) and the ``ip`` and ``tc`` tools (and ``iptables`` for NAT);
:func:`check_available` says why not.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from typing import Optional, Sequence

from p2p_diloco.errors import UserError

logger = logging.getLogger(__name__)


class NetnsUnavailable(UserError):
    """Network namespaces cannot be used here (not root, or ``ip``/``tc`` missing)."""

    exit_code = 2


def check_available(nat: bool = False) -> Optional[str]:
    """None if namespaces, veth pairs and tc (and with ``nat``, iptables) can be used here, else the
    reason (one line)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root or use network = \"loopback\""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} tool is missing (Debian: apt install iproute2)"
    if nat and shutil.which("iptables") is None:
        return "the 'iptables' tool is missing (Debian: apt install iptables)"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=20)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {result.stderr.strip()}")
    return result


def _free_subnet() -> str:
    """A 10.77.x /24 that no interface of this namespace uses yet.

    :raises RuntimeError: when all are taken
    """
    shown = _run("ip", "-4", "-o", "addr", "show").stdout
    for x in range(20, 250):
        if f" 10.77.{x}." not in shown:
            return f"10.77.{x}"
    raise RuntimeError("no free 10.77.x.0/24 subnet: remove stale labs (ip link show | grep pd)")


class Lab:
    """A bridge plus one namespace per island (and one router namespace per island behind NAT);
    :meth:`close` removes everything it created.

    :param islands: how many namespaces (island i's public address is ``10.77.<net>.<10+i>``: its own,
        or its router's when it is behind NAT)
    :param tag: short unique suffix for interface names (default: this process's PID)
    :param nat: the islands that sit behind a NAT router of their own (address ``192.168.1.10``)
    :raises NetnsUnavailable: when :func:`check_available` fails or the setup is refused
    """

    LAN = "192.168.1"  # every router's private LAN: the router is .1, its island .10

    def __init__(self, islands: int, tag: Optional[str] = None, nat: Sequence[int] = ()):
        reason = check_available(nat=bool(nat))
        if reason:
            raise NetnsUnavailable(reason)
        self.tag = tag or str(os.getpid() % 100000)
        self.bridge = f"pd{self.tag}br"
        self.namespaces: list[str] = []
        self.routers: list[str] = []
        self.nat = set(nat)
        self.veths: list[str] = []
        self._bridge_created = False
        try:
            self.subnet = _free_subnet()
            self.host = f"{self.subnet}.1"  # the bridge's address: the bootstrap node listens here
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            self._bridge_created = True
            # where br_netfilter is loaded (Docker hosts), bridged frames would cross iptables FORWARD
            _run("ip", "link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0", check=False)
            _run("ip", "addr", "add", f"{self.host}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for i in range(islands):
                self._add_island(i)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            self.close()
            raise NetnsUnavailable(f"could not set up network namespaces: {e}") from None

    def _add_island(self, i: int) -> None:
        ns, veth = f"p2pd-{self.tag}-{i}", f"pd{self.tag}v{i}"
        public = self._on_bridge(i)
        _run("ip", "netns", "add", public)
        (self.routers if i in self.nat else self.namespaces).append(public)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", public)
        self.veths.append(veth)
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        self._up(public, "eth0", f"{self.public_address(i)}/24")
        if i in self.nat:
            self._add_nat(public, ns)

    def _add_nat(self, router: str, ns: str) -> None:
        """Island namespace ``ns`` on a LAN behind ``router``, which masquerades it and refuses what
        starts outside."""
        _run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _run("ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._up(router, "lan0", f"{self.LAN}.1/24")
        self._up(ns, "eth0", f"{self.LAN}.10/24")
        _run("ip", "-n", ns, "route", "add", "default", "via", f"{self.LAN}.1")
        inside = ["ip", "netns", "exec", router]
        _run(*inside, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        _run(*inside, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE")
        _run(*inside, "iptables", "-A", "FORWARD", "-i", "eth0", "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _run(*inside, "iptables", "-A", "FORWARD", "-i", "eth0", "-j", "DROP")

    def _on_bridge(self, i: int) -> str:
        """The namespace at island i's end of the bridge: the island itself, or its NAT router."""
        return f"p2pd-{self.tag}-r{i}" if i in self.nat else f"p2pd-{self.tag}-{i}"

    @staticmethod
    def _up(ns: str, dev: str, cidr: str) -> None:
        _run("ip", "-n", ns, "addr", "add", cidr, "dev", dev)
        _run("ip", "-n", ns, "link", "set", dev, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def address(self, i: int) -> str:
        """The IPv4 address island i listens on (behind NAT: its private one)."""
        return f"{self.LAN}.10" if i in self.nat else self.public_address(i)

    def public_address(self, i: int) -> str:
        """Island i's address on the bridge (behind NAT: its router's)."""
        return f"{self.subnet}.{10 + i}"

    def prefix(self, i: int) -> list[str]:
        """Command prefix that runs a program inside island i's namespace (same PID: ip execs it)."""
        return ["ip", "netns", "exec", self.namespaces[i]]

    def _ends(self, i: int) -> list[tuple[list[str], str]]:
        """Island i's link to the bridge as (command prefix, device) for its bridge end and its other
        end (the island's namespace, or its router's)."""
        return [([], self.veths[i]), (["ip", "netns", "exec", self._on_bridge(i)], "eth0")]

    def cut(self, i: int) -> None:
        """Disconnect island i (its bridge end goes down; packets are dropped both ways)."""
        _run("ip", "link", "set", self.veths[i], "down")

    def restore(self, i: int) -> None:
        """Reconnect island i after :meth:`cut`."""
        _run("ip", "link", "set", self.veths[i], "up")

    def throttle(self, i: int, rate: str, burst: str = "64kb", latency: str = "100ms") -> None:
        """Limit island i's link to ``rate`` (tc syntax, e.g. "20mbit") in both directions with tc tbf."""
        for prefix, dev in self._ends(i):
            _run(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                 "latency", latency)

    def unthrottle(self, i: int) -> None:
        """Remove island i's rate limit."""
        for prefix, dev in self._ends(i):
            _run(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    def close(self) -> None:
        """Delete the namespaces (their veth pairs go with them) and the bridge; safe to call twice.
        Call after every process inside the namespaces has ended."""
        for ns in self.namespaces + self.routers:
            _run("ip", "netns", "del", ns, check=False)
        for veth in self.veths:
            _run("ip", "link", "del", veth, check=False)
        if self._bridge_created:
            _run("ip", "link", "del", self.bridge, check=False)
        self.namespaces, self.routers, self.veths, self._bridge_created = [], [], [], False
