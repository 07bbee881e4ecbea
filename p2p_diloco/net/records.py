"""Signed, schema-validated, expiring progress records, one per island.

Like hivemind's ProgressTracker, every island stores its record under ``{run_id}_progress`` with the
island's public key as subkey: ``RSASignatureValidator`` signs it (nobody else can overwrite it),
``SchemaValidator`` rejects malformed values on every peer, and the record expires unless refreshed.
Observers (``p2p-diloco status``, the demo) show only what is in these records.

Both validators remember their verdicts (:class:`Memo`): a read of the run's key gets every island's
record from each of several DHT nodes, and reads come every progress period and after every round,
so most records a DHT node checks are ones it checked already. At 16 islands on 2 cores, checking
them again (an RSA signature and a pydantic schema per record) was half of every DHT process's CPU
(docs/SCALE.md, "Many islands on one machine").
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import math
import threading
from typing import Callable, Dict, List, Literal, Mapping, Optional

from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time
from pydantic.v1 import BaseModel, StrictFloat, StrictStr, confloat, conint

logger = logging.getLogger(__name__)

Count = conint(ge=0, strict=True)


class IslandProgress(BaseModel):
    """What one island publishes every ``progress_period`` seconds (docs/DESIGN.md, "DHT records")."""

    island: StrictStr
    peer_id: StrictStr
    fingerprint: StrictStr
    device: StrictStr
    state: StrictStr  # loading | training | stopping
    maddrs: List[StrictStr]
    inner_step: Count
    tokens: Count
    tokens_per_second: confloat(ge=0.0, strict=True)
    mfu: Optional[confloat(ge=0.0, le=1.0, strict=True)] = None  # model FLOPs utilization (a GPU of known peak)
    loss: Optional[StrictFloat]  # EMA of the training loss
    eval_loss: Optional[StrictFloat]
    fragment_versions: List[Count]
    fragment_hashes: List[StrictStr]
    rounds_ok: Count
    rounds_failed: Count
    rounds_rejected: Count  # results refused because a member sent garbage
    flagged: List[StrictStr]  # islands this one flags: caught sending garbage or far-off updates, or adopted
    flag_reasons: Dict[StrictStr, StrictStr] = {}  # flagged island -> garbage | outlier | reducer | adopted
    refused: List[StrictStr] = []  # peer ids this island refused admission (a private run)
    bytes_sent: Count
    bytes_received: Count
    peak_bytes_per_step: Count = 0  # largest round's bytes (sent + received) per inner step it lasted
    utilization: confloat(ge=0.0, le=1.0, strict=True)  # time in inner steps / wall time since first step
    goodput: confloat(ge=0.0, le=1.0, strict=True)  # time in inner steps / wall time since the island started
    clock_offset: StrictFloat = 0.0  # seconds this machine's clock is ahead of the swarm's (negative: behind)
    # public | nat (nobody could dial it back: a client-mode member) | client (--client-mode on) | unknown
    reachability: Literal["public", "nat", "client", "unknown"] = "unknown"
    started: StrictFloat  # wall-clock time of the first inner step (0 before it)
    time: StrictFloat  # wall-clock time of this record


def is_client(reachability: Optional[str]) -> bool:
    """True for an island that takes part in rounds as a client (behind NAT, or ``--client-mode on``):
    nobody can dial it, it reduces nothing and serves no state (docs/DESIGN.md, "Islands behind NAT")."""
    return reachability in ("nat", "client")


class ProgressSchema(BaseModel):
    """The DHT value under ``{run_id}_progress``: one signed record per island public key."""

    progress: Dict[BytesWithPublicKey, Optional[IslandProgress]]


def progress_key(run_id: str) -> str:
    """The DHT key holding a run's progress records."""
    return f"{run_id}_progress"


class Memo:
    """A hivemind record validator that remembers its last ``size`` verdicts, keyed by a BLAKE2b
    digest of the whole record (key, subkey, value with its signature, expiration): a record seen
    before gets the same verdict without being checked again (both validators below are pure
    functions of the record's bytes). Mixed in before a ``RecordValidatorBase`` subclass."""

    def __init__(self, *args, size: int = 4096, **kwargs):
        super().__init__(*args, **kwargs)
        self._size = size
        # (used by the DHT's event loop, one thread; no lock, so that the validator still pickles)
        self._verdicts: collections.OrderedDict[bytes, bool] = collections.OrderedDict()

    def validate(self, record: DHTRecord) -> bool:
        digest = hashlib.blake2b(MSGPackSerializer.dumps(dataclasses.astuple(record)), digest_size=16).digest()
        verdict = self._verdicts.get(digest)
        if verdict is not None:
            self._verdicts.move_to_end(digest)
            return verdict
        verdict = super().validate(record)
        self._verdicts[digest] = verdict
        while len(self._verdicts) > self._size:
            self._verdicts.popitem(last=False)
        return verdict


class MemoSignatureValidator(Memo, RSASignatureValidator):
    """hivemind's ``RSASignatureValidator`` with remembered verdicts."""


class MemoSchemaValidator(Memo, SchemaValidator):
    """hivemind's ``SchemaValidator`` with remembered verdicts."""


def make_validators(run_id: str) -> tuple[list, bytes]:
    """Validators to pass to ``hivemind.DHT(record_validators=...)`` and this process's public key."""
    signature = MemoSignatureValidator()
    return [MemoSchemaValidator(ProgressSchema, prefix=run_id), signature], signature.local_public_key


class ProgressBoard:
    """Reads (and, for islands, writes) a run's progress records.

    :param dht: a running ``hivemind.DHT`` created with :func:`make_validators`'s validators
    :param public_key: this process's public key (the subkey of its own record)
    :param now: the swarm's time, seconds since the epoch (an island's
        :meth:`~p2p_diloco.algo.clock.SwarmClock.now`; default hivemind's DHT time): records expire
        ``ttl`` seconds after they are published on it, so that an island whose clock runs behind
        does not vanish from the others' view early
    """

    def __init__(self, dht, run_id: str, public_key: bytes, *, timeout: float = 10.0,
                 now: Callable[[], float] = get_dht_time):
        self.dht, self.key, self.public_key, self.timeout = dht, progress_key(run_id), public_key, timeout
        self.now = now
        self._lock = threading.Lock()
        self._withdrawn = False
        self._last_expiration = 0.0

    def publish(self, record: IslandProgress, ttl: float) -> bool:
        """Store this island's record for ``ttl`` seconds; False if the DHT did not accept it in time
        or the record was withdrawn."""
        return self._store(record.dict(), self.now() + ttl)

    def withdraw(self) -> bool:
        """Replace this island's record by an empty one so observers drop it at once; later
        :meth:`publish` calls do nothing."""
        # the DHT keeps the value with the latest expiration: outlast the last record we published
        return self._store(None, max(self.now() + self.timeout, self._last_expiration + 1.0), final=True)

    def _store(self, value, expiration_time: float, final: bool = False) -> bool:
        try:
            with self._lock:
                if self._withdrawn:
                    return False
                self._withdrawn = final
                self._last_expiration = max(self._last_expiration, expiration_time)
                future = self.dht.store(
                    self.key, subkey=self.public_key, value=value, expiration_time=expiration_time, return_future=True
                )
            return bool(future.result(timeout=self.timeout))
        except Exception as e:  # a dead daemon during shutdown, a timeout
            logger.debug("could not store progress record: %r", e)
            return False

    def read(self) -> list[IslandProgress]:
        """Every live, valid island record of the run (expired and withdrawn ones are left out); empty
        when the DHT could not be asked."""
        return self.try_read() or []

    def try_read(self) -> Optional[list[IslandProgress]]:
        """Like :meth:`read`, but None when the DHT could not be asked (an error or a timeout), so that
        an observer can tell "no island" from "no answer"."""
        try:
            with self._lock:
                future = self.dht.get(self.key, latest=True, return_future=True)
            found = future.result(timeout=self.timeout)
        except Exception as e:
            logger.debug("could not read progress records: %r", e)
            return None
        if not isinstance(found, ValueWithExpiration) or not isinstance(found.value, dict):
            return []
        records = []
        for entry in found.value.values():
            if not isinstance(entry, ValueWithExpiration) or entry.value is None:
                continue
            try:
                records.append(IslandProgress.parse_obj(entry.value))
            except Exception:
                logger.debug("skipping a malformed progress record")
        return sorted(records, key=lambda r: r.island)


def finite_or_none(value):
    """``value``, or None for a NaN or infinite float (no eval yet, a diverged loss, a faulty peer's
    record: JSON and the metrics get null, never NaN)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


METRICS = ("inner_step", "tokens", "tokens_per_second", "loss", "eval_loss", "rounds_ok", "rounds_failed",
           "rounds_rejected", "utilization", "goodput", "bytes_sent", "bytes_received", "bytes_per_token",
           "clock_offset", "client_mode", "mfu")


def island_metrics(record: Mapping) -> dict[str, float]:
    """A record's numeric metrics (``record``: an :class:`IslandProgress` as a dict) under the names
    that the dashboard (``/api/status``), ``/metrics`` (prefixed ``p2p_diloco_island_``), Weights &
    Biases and TensorBoard all use. Units: tokens, tokens/s, nats (loss), bytes, fractions (utilization,
    goodput, mfu), seconds (clock offset);
    ``client_mode`` is 1 for a member that reduces nothing (behind NAT), else 0. Metrics without a finite
    value (no eval yet; a NaN from a faulty peer) are left out."""
    values = {name: record.get(name) for name in METRICS}
    values["client_mode"] = float(is_client(record.get("reachability")))
    values["bytes_per_token"] = record["bytes_sent"] / record["tokens"] if record.get("tokens") else None
    values = {name: finite_or_none(value) for name, value in values.items()}
    return {name: float(value) for name, value in values.items() if value is not None}
