"""Progress records are schema-checked and signed like hivemind's ProgressTracker records."""

import time

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.dht.routing import DHTID
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from p2p_diloco.net.records import IslandProgress, make_validators, progress_key


def _record(**overrides):
    fields = dict(
        island="i0", peer_id="12D3KooW", fingerprint="abc", device="cpu", state="training", maddrs=["/ip4/x"],
        inner_step=3, tokens=100, tokens_per_second=10.0, loss=5.0, eval_loss=None, fragment_versions=[1, 2],
        fragment_hashes=["a", "b"], rounds_ok=1, rounds_failed=0, rounds_rejected=0, flagged=[], bytes_sent=10, bytes_received=10,
        utilization=0.99, goodput=0.9, started=1.0, time=time.time(),
    )
    return IslandProgress(**(fields | overrides))


def _dht_record(validators, public_key, value):
    serializer = DHTProtocol.serializer
    record = DHTRecord(
        key=DHTID.generate(source=progress_key("run")).to_bytes(),
        subkey=serializer.dumps(public_key),
        value=serializer.dumps(value),
        expiration_time=time.time() + 10,
    )
    schema, signature = validators
    signed = DHTRecord(record.key, record.subkey, signature.sign_value(record), record.expiration_time)
    return schema, signature, signed


def test_valid_record_passes_schema_and_signature():
    validators, public_key = make_validators("run")
    schema, signature, signed = _dht_record(validators, public_key, _record().dict())
    stripped = DHTRecord(signed.key, signed.subkey, signature.strip_value(signed), signed.expiration_time)
    assert signature.validate(signed) and schema.validate(stripped)


@pytest.mark.parametrize("bad", [{"inner_step": 3.0}, {"tokens": -1}, {"utilization": 1.5}, {"loss": "low"},
                                 {"reachability": "relay"}])
def test_malformed_records_are_rejected(bad):
    validators, public_key = make_validators("run")
    value = _record().dict() | bad
    schema, signature, signed = _dht_record(validators, public_key, value)
    stripped = DHTRecord(signed.key, signed.subkey, signature.strip_value(signed), signed.expiration_time)
    assert not schema.validate(stripped)


def test_signature_binds_the_record_to_its_subkey():
    validators, public_key = make_validators("run")
    other_key = RSASignatureValidator(RSAPrivateKey()).local_public_key  # another island's key
    schema, signature, signed = _dht_record(validators, public_key, _record().dict())
    # the same signed value stored under another island's subkey
    forged = DHTRecord(signed.key, DHTProtocol.serializer.dumps(other_key), signed.value, signed.expiration_time)
    assert signature.validate(signed)
    assert not signature.validate(forged)


def test_validators_remember_their_verdicts_and_still_refuse_what_they_refused():
    from hivemind.dht.crypto import RSASignatureValidator as Plain

    validators, public_key = make_validators("run")
    schema, signature, signed = _dht_record(validators, public_key, _record().dict())
    other_key = RSASignatureValidator(RSAPrivateKey()).local_public_key
    forged = DHTRecord(signed.key, DHTProtocol.serializer.dumps(other_key), signed.value, signed.expiration_time)
    checked = []
    original = Plain.validate

    def counting(self, record):
        checked.append(record)
        return original(self, record)

    Plain.validate = counting
    try:
        assert [signature.validate(signed) for _ in range(3)] == [True] * 3
        assert [signature.validate(forged) for _ in range(3)] == [False] * 3
    finally:
        Plain.validate = original
    assert checked == [signed, forged]  # each record checked once, then remembered
    # another record of the same island (a later one) is checked anew
    _, _, later = _dht_record(validators, public_key, _record(inner_step=4).dict())
    assert signature.validate(later) and len(signature._verdicts) == 3


def test_status_shows_bytes_per_token_and_peak_bytes_per_step():
    from rich.console import Console

    from p2p_diloco.observe.status import render_table, swarm_snapshot

    records = [_record(tokens=1000, bytes_sent=5000, peak_bytes_per_step=700),
               _record(island="i1", tokens=3000, bytes_sent=3000, peak_bytes_per_step=900), _record(island="i2", tokens=0)]
    snapshot = swarm_snapshot(records, "run")
    assert [i["bytes_per_token"] for i in snapshot["islands"]] == [5.0, 1.0, None]
    assert snapshot["totals"]["bytes_per_token"] == pytest.approx(8010 / 4000, abs=1e-3)
    assert snapshot["totals"]["peak_bytes_per_step"] == 900
    console = Console(width=250, record=True)
    console.print(render_table(snapshot))
    text = console.export_text()
    assert "bytes/tok" in text and "900" in text and "2.0 bytes/token sent" in text
    assert _record().peak_bytes_per_step == 0  # records of older islands still validate


def test_status_says_which_islands_are_behind_nat():
    from rich.console import Console

    from p2p_diloco.net.records import island_metrics
    from p2p_diloco.observe.status import render_table, swarm_snapshot

    records = [_record(reachability="public"), _record(island="home", reachability="nat"),
               _record(island="forced", reachability="client")]
    snapshot = swarm_snapshot(records, "run")
    assert snapshot["totals"]["behind_nat"] == 1
    console = Console(width=260, record=True)
    console.print(render_table(snapshot))
    rows = {line.split()[1]: line for line in console.export_text().splitlines() if line.count("│") > 5}
    assert "NAT (client)" in rows["home"] and "public" in rows["i0"] and " client " in rows["forced"]
    assert [island_metrics(r.dict())["client_mode"] for r in records] == [0.0, 1.0, 1.0]
    assert _record().reachability == "unknown"  # records of older islands still validate


def test_records_expire_on_the_swarms_time_when_our_clock_is_off():
    from concurrent.futures import Future

    from hivemind.utils import get_dht_time

    from p2p_diloco.net.records import ProgressBoard

    class StoringDHT:
        def __init__(self):
            self.expirations = []

        def store(self, key, subkey, value, expiration_time, return_future):
            self.expirations.append(expiration_time)
            done = Future()
            done.set_result(True)
            return done

    dht = StoringDHT()
    behind = ProgressBoard(dht, "run", b"key", now=lambda: get_dht_time() + 2.0)  # our clock runs 2 s behind the swarm's
    before = get_dht_time()
    assert behind.publish(_record(), ttl=30.0)  # (longer than the board's timeout: withdraw must outlast it)
    assert before + 32.0 <= dht.expirations[-1] <= get_dht_time() + 32.0  # 30 s of the swarm's time
    assert behind.withdraw() and dht.expirations[-1] > dht.expirations[0]  # the empty record outlasts it
    assert not behind.publish(_record(), ttl=30.0) and len(dht.expirations) == 2
