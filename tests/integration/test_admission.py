"""A private run's gates on real hivemind DHTs and averagers, in this test process: peers whose
certificate is missing, forged, expired, revoked or another peer's cannot join the DHT; an observer
reads but cannot store; an averager refuses a rogue's join request and state download (asked
directly, past the DHT) while admitted members average and download as usual."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
import uuid
from dataclasses import replace

import pytest
import torch

from p2p_diloco.errors import NetworkError
from p2p_diloco.net import admission as adm
from p2p_diloco.net.channel import HivemindChannel
from p2p_diloco.net.dht import ensure_identity, start_dht, visible_maddrs
from p2p_diloco.lab.rogues import RogueAuthorizer
from p2p_diloco.net.gate import Admission, publish_certificate

pytestmark = pytest.mark.integration
RUN = "private"
SHAPES = [torch.Size([64]), torch.Size([8, 8])]


class Authority:
    def __init__(self, folder):
        self.folder = folder
        private, public = adm.init_authority(str(folder))
        self.key, self.public = adm.load_authority_private(str(private)), adm.load_public_key(str(public))
        self.revoked: list[str] = []

    def identity(self, name: str) -> str:
        return ensure_identity(str(self.folder / f"{name}.key"))

    def certificate(self, name: str, role: str = "island", holder: str = "", **kwargs) -> adm.Certificate:
        public = adm.identity_public_key(self.identity(holder or name))
        return adm.issue_certificate(self.key, public, island=name, role=role, run_id=RUN, **kwargs)

    def verifier(self) -> adm.Verifier:
        verifier = adm.Verifier(self.public, RUN)
        if self.revoked:
            verifier.apply(adm.revoke(self.key, None, self.revoked))
        return verifier

    def admission(self, name: str, cert: adm.Certificate | None = None, identity: str = "") -> Admission:
        return Admission(self.verifier(), cert or self.certificate(name), identity or self.identity(name), RUN)


def _dht(admission: Admission | None, peers=(), identity: str = "", rogue: bool = False, **kwargs):
    authorizer = None
    if admission is not None:
        authorizer = (RogueAuthorizer(admission.certificate, admission.identity_path, admission.verifier) if rogue
                      else admission.authorizer())
    return start_dht(initial_peers=list(peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"], wait_timeout=1.0,
                     identity_path=identity or (admission.identity_path if admission else ""),
                     authorizer=authorizer, **kwargs)


def test_only_certified_peers_use_the_dht_and_observers_only_read(tmp_path):
    authority = Authority(tmp_path)
    revoked = authority.certificate("revoked")
    authority.revoked.append(revoked.serial)
    dhts = []
    try:
        dhts.append(_dht(authority.admission("boot", authority.certificate("boot", "bootstrap"))))
        peers = visible_maddrs(dhts[0])
        island = authority.admission("island")
        dhts.append(_dht(island, peers))
        assert dhts[1].store("private_probe", b"ok", time.time() + 30)
        assert dhts[0].get("private_probe", latest=True).value == b"ok"
        observer = _dht(authority.admission("watcher", authority.certificate("watcher", "observer")), peers,
                        client_mode=True)
        dhts.append(observer)
        assert observer.get("private_probe", latest=True).value == b"ok"  # reads
        observer.store("private_probe", b"overwritten", time.time() + 60)  # but may not store:
        for dht in dhts[:2]:  # the others refuse it
            assert dht.get("private_probe", latest=True).value == b"ok"

        # each rogue signs its requests with its own key, as hivemind's protocol does
        rogues = {
            "no certificate": None,
            "forged": authority.admission("forger", replace(authority.certificate("forger"), island="island")),
            "expired": authority.admission("late", authority.certificate("late", now=time.time() - 3 * 86400, days=1)),
            "another peer's": authority.admission("thief", authority.certificate("island"), authority.identity("thief")),
            "revoked": authority.admission("revoked", revoked),
        }
        for what, rogue in rogues.items():
            identity = authority.identity(f"rogue-{what[:4]}") if rogue is None else ""
            with pytest.raises(NetworkError, match="could not reach any initial peer"):
                dhts.append(_dht(rogue, peers, identity=identity, rogue=True, join_timeout=1.0))
        time.sleep(0.5)
        refused = dhts[0].run_coroutine(_refusals)
        reasons = " | ".join(refused.values())
        for needle in ("no certificate", "forged", "expired", "another peer's certificate", "revoked",
                       "is an observer: it may read, not store"):
            assert needle in reasons, reasons
    finally:
        for dht in dhts:
            dht.shutdown()


async def _refusals(_dht, node) -> dict:
    return node.protocol.authorizer.refusals.peers()


def _channel(dht, admission, prefix, fill):
    channel = HivemindChannel(dht, shapes=SHAPES, codec="none", ceilings=[0, 0], allreduce_timeout=3.0,
                              state_provider=lambda: ({"fill": fill}, [torch.full(s, float(fill)) for s in SHAPES]),
                              prefix=prefix, quorum=2, matchmaking_time=1.0, request_timeout=0.5, admission=admission)
    channel.share_state()
    return channel


def test_averagers_admit_members_and_refuse_a_rogue_that_calls_them_directly(tmp_path):
    from hivemind.p2p import P2P, PeerID
    from hivemind.proto import averaging_pb2
    from hivemind.utils.mpfuture import MPFuture

    authority = Authority(tmp_path)
    prefix = f"t{uuid.uuid4().hex[:8]}"
    admissions = [authority.admission(f"island-{i}") for i in range(2)]
    dhts, channels = [], []
    try:
        for admission in admissions:
            dhts.append(_dht(admission, visible_maddrs(dhts[0]) if dhts else []))
            publish_certificate(dhts[-1], RUN, admission.certificate, ttl=60)
        channels = [_channel(dht, admission, prefix, i + 1) for i, (dht, admission) in enumerate(zip(dhts, admissions))]

        # two admitted members average and end identical. On a loaded machine a reducer may miss its
        # timeout: then its part keeps each member's own values (the report says so) and we try again
        for attempt in range(3):
            for i, channel in enumerate(channels):
                with channel.tensors() as tensors:
                    for tensor in tensors:
                        tensor.fill_(float(i))
            slot, results = time.time() + 2.5, [None, None]

            def one(i):
                results[i] = channels[i].all_reduce(gather={"island": f"island-{i}"}, weight=1.0, scheduled_time=slot,
                                                    deadline=slot + 2, stop=threading.Event())

            threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert all(r is not None and len(r) == 2 for r in results), results
            if all(channel.report().failed == 0 for channel in channels):
                break
        assert all("certificate" not in m for m in results[0].values())  # the gate's, not the island's
        for channel in channels:
            with channel.tensors() as tensors:
                assert all(torch.allclose(t, torch.full_like(t, 0.5)) for t in tensors)
        # an admitted member downloads the other's state
        state = channels[0].load_state(timeout=10)
        assert state is not None and state[0]["fill"] == 2

        # a rogue that knows the island's address and peer id asks it directly
        async def rogue():
            p2p = await P2P.create(initial_peers=visible_maddrs(dhts[1]))
            try:
                stub = type(channels[1].averager).get_stub(p2p, PeerID.from_base58(str(dhts[1].peer_id)),
                                                           namespace=prefix)
                downloaded = [m async for m in await stub.rpc_download_state(averaging_pb2.DownloadRequest())]
                join = await stub.rpc_join_group(averaging_pb2.JoinRequest(
                    schema_hash=b"x", expiration=time.time() + 5, gather=b"", group_key="k"))
                first = await join.__anext__()
                return str(p2p.peer_id), downloaded, first.code
            finally:
                await p2p.shutdown()

        rogue_id, downloaded, code = asyncio.run(rogue())
        assert downloaded == []  # no state
        assert code == averaging_pb2.PROTOCOL_VIOLATION  # not admitted to the group
        assert rogue_id in channels[1].refused()
        assert channels[0].refused() == []
    finally:
        for dht in dhts:
            dht.shutdown()
        for channel in channels:
            channel.close()
        MPFuture.reset_backend()


def test_a_private_swarm_refuses_rogues_and_drops_a_revoked_island_within_a_record_ttl(tmp_path):
    """Processes as users start them: a bootstrap node that publishes the revocation list, three
    admitted islands, an admitted observer and a stranger without a certificate; rogue peers (no
    certificate, a forged, an expired, a stolen and a revoked one) knock on every door, the DHT and
    an island's averagers, while the swarm forms; then the operator revokes island-2's certificate."""
    from p2p_diloco.lab.localswarm import LocalSwarm
    from p2p_diloco.lab.rogues import DOORS, KINDS, PrivateRun, targets_of
    from tests.integration.helpers import FAST, PACED, assert_clean_error, cli_in_background, events_of, wait_for

    run = PrivateRun(tmp_path / "keys", RUN)
    names = ["island-0", "island-1", "island-2"]
    flags = {name: run.flags(name) for name in names}
    rogues = run.arm_rogues(victim="island-0")  # the "stolen" rogue holds island-0's certificate
    swarm = LocalSwarm(tmp_path / "swarm", run_id=RUN)
    try:
        swarm.start_bootstrap(*run.flags("boot", "bootstrap"), "--revocations", str(run.revocations_path),
                              "--dashboard-port", "0")
        for name in names:
            swarm.start_island(name, *FAST, *PACED, "--max-steps", "2000", *flags[name])
        # island-1's averager of fragment 0 (the "stolen" rogue poses as island-0 there; the bench attacks
        # every averager of every island),
        # once they serve rounds and state: after its first round
        wait_for(lambda: events_of(swarm.events_path("island-1"), "round"), 150, message="island-1's first round")
        start = events_of(swarm.events_path("island-1"), "start")
        report_path = tmp_path / "rogues.json"
        attack = swarm.start_process("rogues", "p2p_diloco.lab.rogues", "--dir", str(rogues), "--initial-peers",
                                     *swarm.initial_peers, "--target", *targets_of(start[0], RUN, 2)[:1],
                                     "--attacks", "1", "--pause", "0", "--out", str(report_path))

        def live():  # the islands the bootstrap node's dashboard sees (it reads the DHT as an admitted peer)
            with urllib.request.urlopen(swarm.dashboard_url + "api/status", timeout=10) as response:
                status = json.load(response)
            return {row["island"] for row in status["islands"] if not row.get("departed")}, status["totals"]

        def three_member_round():
            return any(e.get("outcome") == "ok" and len(e.get("members", [])) == 3
                       for e in events_of(swarm.events_path("island-0"), "round"))

        wait_for(three_member_round, 150, message="a round of all three islands")
        assert live()[0] == set(names)
        # a stranger cannot read the run: its status finds no peer that answers (checked below, it
        # runs meanwhile)
        stranger = cli_in_background("status", "--initial-peers", *swarm.initial_peers, "--run-id", RUN,
                                     "--join-timeout", "3")

        run.revoke([adm.load_certificate(str(run.certificate_path("island-2"))).serial])
        revoked_at = time.time()
        wait_for(lambda: "island-2" not in live()[0], 30, interval=0.5, message="island-2 gone after its revocation")
        gone_after = time.time() - revoked_at
        settled = time.time() + 6  # the averagers' gates read the list every few seconds

        def rounds_after(island, since):
            return [e for e in events_of(swarm.events_path(island), "round") if e["t_start"] > since]

        wait_for(lambda: sum(e["outcome"] == "ok" for e in rounds_after("island-0", settled)) >= 2, 60,
                 message="island-0's rounds after the revocation")
        # an admitted observer sees the two islands left (it runs while the rogues finish)
        observer = cli_in_background("status", "--initial-peers", *swarm.initial_peers, "--run-id", RUN, "--json",
                                     "--join-timeout", "15", *run.flags("watcher", "observer"))
        assert_clean_error(stranger(), 3, "could not reach any initial peer")
        assert attack.popen.wait(120) == 0
        report = json.loads(report_path.read_text())
        assert report["breaches"] == 0 and report["refused"] == report["attempts"], report
        assert all(report["by_kind"][kind][door]["refused"] >= 1 for kind in KINDS for door in DOORS), report
        # and the refusals are the gates': the bootstrap node's DHT named each reason, and island-1's
        # averagers refused every rogue's peer id (not a closed door for some other cause)
        bootstrap_log = swarm.bootstrap.log_path.read_text()
        for reason in ("no certificate", "forged certificate", "expired at", "another peer's certificate", "revoked"):
            assert reason in bootstrap_log, reason
        island_log = swarm.islands["island-1"].log_path.read_text()
        for kind in KINDS:
            rogue_id = adm.peer_id_of(adm.identity_public_key(str(rogues / f"rogue-{kind}.key")))
            assert f"refused peer {rogue_id} (averager)" in island_log, kind
        for island in ("island-0", "island-1"):
            assert all("island-2" not in e.get("members", []) for e in rounds_after(island, settled))
            rounds = rounds_after(island, 0)  # no rogue, not even one that claims island-0's name
            assert all(set(e["members"]) <= set(names) and len(set(e["members"])) == e["group_size"]
                       for e in rounds if "members" in e), rounds
        status = live()
        refused = status[1]["refused"]
        assert status[0] == {"island-0", "island-1"} and refused >= 1  # island-2 and the rogues that reached one
        watched = observer()
        assert watched.returncode == 0, watched.stderr
        assert {r["island"] for r in json.loads(watched.stdout.strip().splitlines()[-1])["islands"]} == {
            "island-0", "island-1"}
        print(f"island-2 left the records {gone_after:.1f} s after its revocation; {refused} peer(s) refused; "
              f"rogues: {report['attempts']} attempts in {report['seconds']} s, all refused")
    finally:
        swarm.close()
