"""Rogue peers of a private run (lab only; nothing outside the lab imports this): peers without a
valid certificate that try, again and again, every door the gates of docs/DESIGN.md ("Admission")
close: joining the run's DHT, and calling an island's averagers directly, past the DHT (joining its
group, sending it a part, downloading its state), as a peer that knows the island's address, its peer
id and the run's averager names would (a revoked former member does).

One process plays every kind of rogue (:data:`KINDS`), each with its own libp2p identity, in turn, so
that the rogues cost the machine one process::

    python -m p2p_diloco.lab.rogues --dir ROGUES --initial-peers MADDR... --target PREFIX=MADDR... \
        --attacks 20 --out report.json

``report.json`` counts, per kind and door, the attempts refused and the breaches (an attempt the
swarm did not refuse); a breach is a bug in the gates. :func:`make_rogues` writes the identities
and certificates from the run's authority key (the lab stands in for what a rogue would have).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from p2p_diloco.net import admission as adm
from p2p_diloco.net.gate import CERTIFICATE_FIELD, RunAuthorizer

logger = logging.getLogger(__name__)

# no certificate, a forged one, an expired one, another peer's and a revoked one (the issue's five)
KINDS = ("none", "forged", "expired", "stolen", "revoked")
DOORS = ("dht", "join", "part", "download")


class RogueAuthorizer(RunAuthorizer):
    """A rogue's DHT authorizer: it sends whatever certificate it has (hivemind's own check of the
    local token would stop an honest peer with a bad certificate from sending anything)."""

    def is_token_valid(self, access_token) -> bool:
        if access_token.username == self.certificate.to_bytes().decode():
            return True
        return super().is_token_valid(access_token)


@dataclass(frozen=True)
class Rogue:
    """One rogue: its kind, its own libp2p identity and the certificate it presents (None: none)."""

    kind: str
    identity_path: str
    certificate: Optional[adm.Certificate]

    def authorizer(self, verifier: adm.Verifier) -> Optional[RogueAuthorizer]:
        return None if self.certificate is None else RogueAuthorizer(self.certificate, self.identity_path, verifier)


def make_rogues(authority_key: str, folder: str | Path, run_id: str, victim: adm.Certificate) -> tuple[list[Rogue], str]:
    """Write one identity (and certificate) per kind under ``folder``.

    :param authority_key: the run's authority private key (the lab forges what rogues would hold)
    :param victim: an admitted island's certificate, which the "stolen" rogue presents as its own
    :returns: the rogues, and the serial of the "revoked" rogue's certificate, which the caller must
        put in the run's revocation list
    """
    from p2p_diloco.net.dht import ensure_identity

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = adm.load_authority_private(authority_key)
    rogues = []
    serial = ""
    for kind in KINDS:
        identity = ensure_identity(str(folder / f"rogue-{kind}.key"))
        public = adm.identity_public_key(identity)
        cert: Optional[adm.Certificate] = None
        if kind == "forged":  # a genuine certificate whose island name was changed: the signature fails
            cert = replace(adm.issue_certificate(key, public, island=f"rogue-{kind}", role="island", run_id=run_id),
                           island=victim.island)
        elif kind == "expired":
            cert = adm.issue_certificate(key, public, island=f"rogue-{kind}", role="island", run_id=run_id,
                                         now=time.time() - 3 * 86400, days=1)
        elif kind == "stolen":
            cert = victim
        elif kind == "revoked":
            cert = adm.issue_certificate(key, public, island=f"rogue-{kind}", role="island", run_id=run_id)
            serial = cert.serial
        rogues.append(Rogue(kind, identity, cert))
    return rogues, serial


def parse_targets(specs: Sequence[str]) -> dict[str, list[str]]:
    """``PREFIX=MADDR`` pairs (an averager's name and the island's multiaddr with /p2p/) -> {maddr: [prefix]}."""
    targets: dict[str, list[str]] = {}
    for spec in specs:
        prefix, sep, maddr = spec.partition("=")
        if not sep or "/p2p/" not in maddr:
            raise ValueError(f"--target {spec!r}: expected PREFIX=/ip4/.../p2p/PEER")
        targets.setdefault(maddr, []).append(prefix)
    return targets


class Attack:
    """The attempts of every rogue against one swarm, counted in :attr:`outcomes`
    ((kind, door, "refused" | "breach" | "error") -> count)."""

    def __init__(self, rogues: Sequence[Rogue], verifier: adm.Verifier, initial_peers: Sequence[str],
                 targets: dict[str, list[str]]):
        self.rogues, self.verifier, self.initial_peers, self.targets = list(rogues), verifier, list(initial_peers), targets
        self.outcomes: Counter = Counter()
        self.errors: list[str] = []

    def _count(self, rogue: Rogue, door: str, outcome: str, detail: str = "") -> None:
        self.outcomes[(rogue.kind, door, outcome)] += 1
        if outcome != "refused":
            self.errors.append(f"{rogue.kind} {door} {outcome}: {detail}"[:300])
            logger.warning("%s rogue, %s: %s %s", rogue.kind, door, outcome, detail)

    def try_dht(self, rogue: Rogue) -> None:
        """Join the run's DHT through its initial peers: refused unless the gates are broken."""
        from p2p_diloco.errors import NetworkError
        from p2p_diloco.net.dht import start_dht

        try:
            dht = start_dht(initial_peers=self.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], join_timeout=0.5,
                            wait_timeout=1.0, identity_path=rogue.identity_path,
                            authorizer=rogue.authorizer(self.verifier))
        except NetworkError as e:
            self._count(rogue, "dht", "refused" if "could not reach any initial peer" in str(e) else "error", str(e))
            return
        dht.shutdown()
        self._count(rogue, "dht", "breach", "joined the DHT")

    async def try_averagers(self, rogue: Rogue) -> None:
        """Call every target's averagers directly: join its group, send it a part, download its state."""
        from hivemind.p2p import P2P, PeerID
        from hivemind.proto import averaging_pb2
        from hivemind.utils import MSGPackSerializer as serializer

        from p2p_diloco.net.averager import averager_stub

        user = {"island": rogue.certificate.island if rogue.certificate else f"rogue-{rogue.kind}"}
        if rogue.certificate is not None:
            user[CERTIFICATE_FIELD] = rogue.certificate.to_bytes()
        gather = serializer.dumps([1.0, 0, serializer.dumps(user)])

        async def one_part():
            yield averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"rogue", weight=1.0)

        try:
            p2p = await P2P.create(initial_peers=list(self.targets), identity_path=rogue.identity_path,
                                   host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        except Exception as e:
            self._count(rogue, "join", "error", f"no connection to the targets: {e!r}")
            return
        try:
            for maddr, prefixes in self.targets.items():
                peer = PeerID.from_base58(maddr.rpartition("/p2p/")[2])
                for prefix in prefixes:
                    stub = averager_stub(p2p, peer, prefix)
                    await self._door(rogue, "join", self._join(stub, gather, averaging_pb2))
                    await self._door(rogue, "part", self._part(stub, one_part(), averaging_pb2))
                    await self._door(rogue, "download", self._download(stub, averaging_pb2))
        finally:
            await p2p.shutdown()

    async def _door(self, rogue: Rogue, door: str, attempt) -> None:
        try:
            refused, detail = await asyncio.wait_for(attempt, timeout=10)
        except (StopAsyncIteration, BrokenPipeError, ConnectionResetError) as e:  # closed on us: refused too
            refused, detail = True, f"closed without an answer ({type(e).__name__})"
        except Exception as e:  # not an answer either way (the target unreachable, a timeout): recorded
            self._count(rogue, door, "error", repr(e))
            return
        self._count(rogue, door, "refused" if refused else "breach", detail)

    @staticmethod
    async def _join(stub, gather: bytes, pb) -> tuple[bool, str]:
        stream = await stub.rpc_join_group(pb.JoinRequest(schema_hash=b"rogue", expiration=time.time() + 5,
                                                          gather=gather, group_key="rogue"))
        first = await stream.__anext__()
        return first.code == pb.PROTOCOL_VIOLATION, f"join answered {pb.MessageCode.Name(first.code)}"

    @staticmethod
    async def _part(stub, parts, pb) -> tuple[bool, str]:
        stream = await stub.rpc_aggregate_part(parts)
        first = await stream.__anext__()
        return first.code == pb.PROTOCOL_VIOLATION, f"part answered {pb.MessageCode.Name(first.code)}"

    @staticmethod
    async def _download(stub, pb) -> tuple[bool, str]:
        messages = [m async for m in await stub.rpc_download_state(pb.DownloadRequest())]
        return not messages, f"download gave {len(messages)} message(s)"

    def run(self, attacks: int, pause: float, stop: threading.Event) -> None:
        """``attacks`` times (or until ``stop``): every rogue at every door, then ``pause`` seconds."""
        for _ in range(attacks):
            # one rogue at a time: each starts a DHT process and a libp2p daemon, and rogues that start
            # together load this machine's CPU in bursts (the islands' rounds on it paid for that: 0.70
            # of their ok rounds against 0.95-0.97 one at a time, at the same rate of attempts)
            for rogue in self.rogues:
                if stop.is_set():
                    return
                self.try_dht(rogue)
                if self.targets and not stop.is_set():
                    asyncio.run(self.try_averagers(rogue))
            if stop.wait(pause):
                return

    def report(self) -> dict:
        """{"attempts", "refused", "breaches", "errors", "by_kind": {kind: {door: {outcome: n}}}}"""
        by_kind: dict = {}
        for (kind, door, outcome), n in sorted(self.outcomes.items()):
            by_kind.setdefault(kind, {}).setdefault(door, {})[outcome] = n
        total = sum(self.outcomes.values())
        counts = Counter()
        for (_, _, outcome), n in self.outcomes.items():
            counts[outcome] += n
        return {"attempts": total, "refused": counts["refused"], "breaches": counts["breach"],
                "errors": self.errors[:20], "by_kind": by_kind}


class PrivateRun:
    """A private run's paperwork for a local swarm: an authority (``folder/authority``), a revocation
    list file the bootstrap node reads (``--revocations``) and each peer's identity and certificate.

    :param folder: where keys, certificates and the list are written
    """

    def __init__(self, folder: str | Path, run_id: str):
        self.folder, self.run_id = Path(folder), run_id
        private, self.public_path = adm.init_authority(str(self.folder / "authority"))
        self.key_path = str(private)
        self.key = adm.load_authority_private(self.key_path)
        self.revocations_path = self.folder / "revocations.json"
        self._write_revocations(adm.revoke(self.key, None, []))

    def _write_revocations(self, revocations: adm.Revocations) -> None:
        from p2p_diloco import files

        files.write_bytes(self.revocations_path, revocations.to_bytes())

    def identity(self, name: str) -> str:
        from p2p_diloco.net.dht import ensure_identity

        return ensure_identity(str(self.folder / f"{name}.key"))

    def certificate_path(self, name: str) -> Path:
        return self.folder / f"{name}.cert"

    def flags(self, name: str, role: str = "island") -> list[str]:
        """``--identity-path``, ``--authority-public-key`` and ``--certificate`` for peer ``name``
        (its certificate is issued on first use)."""
        from p2p_diloco import files

        cert = self.certificate_path(name)
        if not cert.exists():
            public = adm.identity_public_key(self.identity(name))
            files.write_bytes(cert, adm.issue_certificate(self.key, public, island=name, role=role,
                                                          run_id=self.run_id).to_bytes())
        return ["--identity-path", self.identity(name), "--authority-public-key", str(self.public_path),
                "--certificate", str(cert)]

    def revoke(self, serials: Sequence[str]) -> None:
        """Add ``serials`` to the revocation list file (the bootstrap node publishes it)."""
        current = adm.Revocations.from_bytes(self.revocations_path.read_bytes())
        self._write_revocations(adm.revoke(self.key, current, serials))

    def arm_rogues(self, victim: str) -> Path:
        """Write the rogues (:func:`make_rogues`, the "stolen" one holding island ``victim``'s
        certificate), revoke the "revoked" one's certificate, and return the folder for :func:`main`."""
        folder = self.folder / "rogues"
        rogues, serial = make_rogues(self.key_path, folder, self.run_id,
                                     adm.load_certificate(str(self.certificate_path(victim))))
        self.revoke([serial])
        save_rogues(folder, rogues, str(self.public_path), self.run_id)
        return folder


def targets_of(start_event: dict, run_id: str, fragments: int) -> list[str]:
    """``PREFIX=MADDR`` for every averager of the island whose ``start`` event this is (its peer id,
    fingerprint and addresses)."""
    from p2p_diloco.island.peer import averager_prefix

    maddr = next(m for m in start_event["maddrs"] if "/ip4/" in m)
    if "/p2p/" not in maddr:
        maddr = f"{maddr}/p2p/{start_event['peer_id']}"
    return [f"{averager_prefix(run_id, start_event['fingerprint'], p, fragments)}={maddr}" for p in range(fragments)]


def save_rogues(folder: str | Path, rogues: Sequence[Rogue], authority_public_key: str, run_id: str) -> Path:
    """Write ``rogues.json`` for :func:`main` (identities stay in their files)."""
    from p2p_diloco import files

    path = Path(folder) / "rogues.json"
    files.write_text(path, json.dumps({
        "run_id": run_id, "authority_public_key": Path(authority_public_key).read_text(),
        "rogues": [{"kind": r.kind, "identity_path": r.identity_path,
                    "certificate": r.certificate.to_bytes().decode() if r.certificate else ""} for r in rogues]}))
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2p_diloco.lab.rogues", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="the folder make_rogues wrote (rogues.json)")
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--target", nargs="*", default=[], metavar="PREFIX=MADDR",
                        help="an island's averager name and its address (with /p2p/)")
    parser.add_argument("--attacks", type=int, default=10, help="how many times every rogue tries every door")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds between attacks")
    parser.add_argument("--out", required=True, help="the report (JSON), written at the end")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s rogues %(levelname)s %(message)s")
    saved = json.loads(Path(args.dir, "rogues.json").read_text())
    rogues = [Rogue(r["kind"], r["identity_path"],
                    adm.Certificate.from_bytes(r["certificate"].encode()) if r["certificate"] else None)
              for r in saved["rogues"]]
    verifier = adm.Verifier(adm.parse_public_key(saved["authority_public_key"]), saved["run_id"])
    from p2p_diloco.procs import StopSignal, exit_with_parent, install_child_hooks

    install_child_hooks()
    stop = StopSignal().install()
    if os.environ.get("P2P_DILOCO_EXIT_WITH_PARENT") == "1":
        exit_with_parent(stop)
    attack = Attack(rogues, verifier, args.initial_peers, parse_targets(args.target))
    started = time.monotonic()
    try:
        attack.run(args.attacks, args.pause, stop.event)
    finally:
        report = attack.report() | {"seconds": round(time.monotonic() - started, 1)}
        from p2p_diloco import files

        files.write_text(args.out, json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("attempts", "refused", "breaches")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
