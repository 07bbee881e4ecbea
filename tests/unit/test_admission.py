"""Certificates, revocation lists and the one check every gate uses (p2p_diloco.net.admission), and
the operator's commands (p2p-diloco identity / authority)."""

from __future__ import annotations

import json
import pickle
import stat
import time
from dataclasses import asdict, replace

import pytest

from p2p_diloco.admin import run as admin_run
from p2p_diloco.cli import build_parser
from p2p_diloco.errors import ConfigError
from p2p_diloco.net import admission as adm
from p2p_diloco.net.dht import ensure_identity


@pytest.fixture(scope="module")
def authority(tmp_path_factory):
    folder = tmp_path_factory.mktemp("authority")
    private, public = adm.init_authority(str(folder))
    peers = {name: adm.identity_public_key(ensure_identity(str(folder / f"{name}.key"))) for name in ("a", "b")}
    return adm.load_authority_private(str(private)), adm.load_public_key(str(public)), peers, folder


def test_a_certificate_admits_its_holder_only_as_issued(authority):
    key, public, peers, _ = authority
    verifier = adm.Verifier(public, "run")
    cert = adm.issue_certificate(key, peers["a"], island="alice", role="island", run_id="run", days=1)
    a, b = adm.peer_id_of(peers["a"]), adm.peer_id_of(peers["b"])
    assert cert.peer_id == a
    assert verifier.check(cert, peer_id=a, role="island") is None
    assert verifier.check(adm.Certificate.from_bytes(cert.to_bytes()), peer_id=a) is None  # survives the wire
    assert "another peer's certificate" in verifier.check(cert, peer_id=b)
    assert "admitted as island, not as observer" in verifier.check(cert, role="observer")
    assert "expired" in verifier.check(cert, now=cert.expires + 1)
    assert "not valid yet" in verifier.check(cert, now=cert.issued - 3600)
    assert "for run 'run', not 'other'" in adm.Verifier(public, "other").check(cert)
    assert adm.Verifier(public, "").check(cert) is None  # a bootstrap node serving every run
    assert verifier.check(None) == "no certificate"


@pytest.mark.parametrize("change", [dict(island="mallory"), dict(role="bootstrap"), dict(expires=4e9),
                                    dict(run_id="*"), dict(peer_id="QmSomebodyElse")])
def test_any_change_to_a_signed_certificate_is_a_forgery(authority, change):
    key, public, peers, _ = authority
    cert = adm.issue_certificate(key, peers["a"], island="alice", role="island", run_id="run")
    assert "forged" in adm.Verifier(public, "run").check(replace(cert, **change))


def test_a_certificate_signed_by_another_authority_or_bound_to_another_key_is_refused(authority, tmp_path):
    key, public, peers, _ = authority
    other_private, _ = adm.init_authority(str(tmp_path))
    other = adm.issue_certificate(adm.load_authority_private(str(other_private)), peers["a"], island="alice",
                                  role="island")
    assert "forged" in adm.Verifier(public).check(other)
    # the authority signed a certificate whose peer id is not its key's (a tampered issuer): refused
    cert = adm.issue_certificate(key, peers["a"], island="alice", role="island")
    bogus = replace(cert, peer_id=adm.peer_id_of(peers["b"]))
    resigned = replace(bogus, signature=adm._sign(key, bogus.body()))
    assert "does not match its key" in adm.Verifier(public).check(resigned)


def test_malformed_certificates_are_refused_unread():
    with pytest.raises(ValueError, match="longer than"):
        adm.Certificate.from_bytes(b"{" + b" " * adm.MAX_CERTIFICATE_BYTES + b"}")
    for garbage in (b"not json", b"[]", b'{"island": 1}', json.dumps({"format": "other/1"}).encode()):
        with pytest.raises(ValueError):
            adm.Certificate.from_bytes(garbage)


def test_revocations_apply_newest_first_and_never_roll_back(authority):
    key, public, peers, _ = authority
    verifier = adm.Verifier(public, "run")
    cert = adm.issue_certificate(key, peers["a"], island="alice", role="island", run_id="run")
    first = adm.revoke(key, None, ["0123456789abcdef"])
    second = adm.revoke(key, first, [cert.serial])
    assert second.issued > first.issued and set(second.serials) == {"0123456789abcdef", cert.serial}
    assert verifier.apply(second)
    assert "revoked" in verifier.check(cert)
    assert not verifier.apply(first)  # an older list (republished by anyone) does not un-revoke
    assert "revoked" in verifier.check(cert)
    forged = replace(adm.revoke(key, second, []), serials=())  # a newer list with the serials removed
    assert not verifier.apply(forged)
    assert verifier.revocations == second
    assert adm.Revocations.from_bytes(second.to_bytes()) == second
    copy = pickle.loads(pickle.dumps(verifier))  # as the DHT and averager processes get it
    assert "revoked" in copy.check(cert)


def _admin(*argv):
    admin_run(build_parser().parse_args(list(argv)))


def test_the_operator_commands_make_keys_certificates_and_revocations(tmp_path, capsys):
    _admin("authority", "init", "--dir", str(tmp_path))
    assert stat.S_IMODE((tmp_path / "authority.key").stat().st_mode) == 0o600
    with pytest.raises(ConfigError, match="never overwritten"):
        _admin("authority", "init", "--dir", str(tmp_path))
    _admin("identity", str(tmp_path / "peer.key"))
    out = capsys.readouterr().out
    peer_id = out.split("peer id ")[1].split()[0]
    key = str(tmp_path / "authority.key")
    _admin("authority", "admit", str(tmp_path / "peer.key.pub"), "--island", "alice", "--run-id", "run",
           "--authority-key", key, "--out", str(tmp_path / "alice.cert"))
    cert = adm.load_certificate(str(tmp_path / "alice.cert"))
    verifier = adm.Verifier(adm.load_public_key(str(tmp_path / "authority.pub")), "run")
    assert cert.peer_id == peer_id and verifier.check(cert, peer_id=peer_id, role="island") is None
    _admin("authority", "revoke", str(tmp_path / "alice.cert"), "--authority-key", key,
           "--revocations", str(tmp_path / "revoked.json"))
    assert verifier.apply(adm.Revocations.from_bytes((tmp_path / "revoked.json").read_bytes()))
    assert "revoked" in verifier.check(cert)
    with pytest.raises(ConfigError, match="neither a certificate file nor a serial"):
        _admin("authority", "revoke", "nonsense!", "--authority-key", key, "--revocations", str(tmp_path / "r.json"))
    (tmp_path / "authority.key").chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        _admin("authority", "admit", str(tmp_path / "peer.key.pub"), "--island", "x", "--authority-key", key,
               "--out", str(tmp_path / "x.cert"))


def test_a_peers_own_certificate_is_checked_at_start(authority, tmp_path):
    from p2p_diloco.config import AdmissionConfig
    from p2p_diloco.net.gate import load_admission

    key, _, peers, folder = authority
    cert = adm.issue_certificate(key, peers["a"], island="alice", role="island", run_id="run",
                                 now=time.time() - 3 * 86400, days=1)
    (tmp_path / "old.cert").write_bytes(cert.to_bytes())
    config = AdmissionConfig(authority_public_key=str(folder / "authority.pub"), certificate=str(tmp_path / "old.cert"))
    with pytest.raises(ConfigError, match="expired .* ask the run's operator"):
        load_admission(config, identity_path=str(folder / "a.key"), run_id="run", role="island", where="test")
    with pytest.raises(ConfigError, match="needs --identity-path"):
        load_admission(config, identity_path="", run_id="run", role="island", where="test")
    fresh = adm.issue_certificate(key, peers["a"], island="alice", role="island", run_id="run")
    (tmp_path / "fresh.cert").write_bytes(fresh.to_bytes())
    config = AdmissionConfig(authority_public_key=str(folder / "authority.pub"), certificate=str(tmp_path / "fresh.cert"))
    with pytest.raises(ConfigError, match="another peer's certificate"):
        load_admission(config, identity_path=str(folder / "b.key"), run_id="run", role="island", where="test")
    assert load_admission(config, identity_path=str(folder / "a.key"), run_id="run", role="island",
                          where="test").certificate == fresh
    assert asdict(fresh)["signature"]
