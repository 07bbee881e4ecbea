"""The gates of a private run (docs/DESIGN.md, "Admission"), built on hivemind's extension points:

- :class:`RunAuthorizer`, a ``TokenAuthorizerBase`` for the DHT (hivemind signs every DHT request and
  response with it): a peer without a valid certificate can neither read nor write the run's records,
  and an observer cannot write;
- :class:`AveragerGate` and :class:`GatedAveragerMixin`, for each fragment's averager (hivemind's
  averager RPCs check nobody): a join request carries the follower's certificate in its gathered
  metadata and the leader checks it against the libp2p-authenticated sender; every member checks the
  whole group before its all-reduce; parts are accepted only from admitted members; a state download
  is served only to a peer whose certificate (published on the DHT) admits it;
- the DHT records that carry certificates and the authority's revocation list.

The checks themselves are :class:`p2p_diloco.net.admission.Verifier`'s.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from functools import partial
from typing import AsyncIterator, Callable, Optional

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey

from p2p_diloco.net.admission import Certificate, Refusals, Revocations, Verifier, identity_key

logger = logging.getLogger(__name__)

CERTIFICATE_FIELD = "certificate"  # the key of the gathered metadata that carries a member's certificate
REFRESH_SECONDS = 5.0  # how often an averager's gate reads the revocation list again


def certificates_key(run_id: str) -> str:
    """The DHT key under which every admitted peer of a run publishes its certificate (subkey: its peer id)."""
    return f"{run_id}_certificates"


def revocations_key(fingerprint: str) -> str:
    """The DHT key of an authority's revocation lists (subkey: when issued)."""
    return f"p2p_diloco_revocations_{fingerprint}"


def identity_private_key(identity_path: str) -> RSAPrivateKey:
    """hivemind's ``RSAPrivateKey`` for the key of a libp2p identity file (the DHT signs its requests
    with the key the certificate binds). Built through the class's pickling protocol (DER).

    :raises ConfigError: if the file is unreadable or holds no RSA key
    """
    from cryptography.hazmat.primitives import serialization

    der = identity_key(identity_path).private_bytes(serialization.Encoding.DER,
                                                    serialization.PrivateFormat.TraditionalOpenSSL,
                                                    serialization.NoEncryption())
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})
    return key


# ------------------------------------------------------------------------------------------ the DHT

class RunAuthorizer(TokenAuthorizerBase):
    """The DHT's gate: our access token is our certificate; a request or response is accepted only
    with a certificate the run's :class:`Verifier` admits (signed by the peer's own key, as hivemind's
    protocol checks), and a store only from an island or a bootstrap node.

    :param certificate: this peer's certificate
    :param identity_path: the libp2p identity whose key the certificate binds
    :param verifier: the run's authority and revocations
    """

    def __init__(self, certificate: Certificate, identity_path: str, verifier: Verifier):
        super().__init__(identity_private_key(identity_path))
        self.certificate, self.verifier = certificate, verifier
        self.refusals = Refusals("DHT")

    async def get_token(self) -> AccessToken:
        return AccessToken(username=self.certificate.to_bytes().decode(), public_key=self.local_public_key.to_bytes(),
                           expiration_time=str(self.certificate.expires), signature=b"")

    @staticmethod
    def _parse(token: AccessToken) -> tuple[Optional[Certificate], Optional[str]]:
        if not token.username:
            return None, "no certificate"
        try:
            return Certificate.from_bytes(token.username.encode()), None
        except ValueError as e:
            return None, f"malformed certificate ({e})"

    def _certificate_of(self, token: AccessToken) -> tuple[Optional[Certificate], Optional[str]]:
        cert, reason = self._parse(token)
        if cert is None:
            return cert, reason
        reason = self.verifier.check(cert)
        if reason is None and token.public_key.decode(errors="replace").strip() != cert.public_key.strip():
            reason = f"another peer's certificate ({cert.island}): signed with a different key"
        return cert, reason

    def is_token_valid(self, access_token: AccessToken) -> bool:
        cert, reason = self._certificate_of(access_token)
        if reason is not None:
            self.refusals.refuse(cert.peer_id if cert else f"unknown ({reason.split(' (')[0]})", reason)
        return reason is None

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return False  # a certificate is renewed by restarting with a new one

    async def validate_request(self, request) -> bool:
        if type(request).__name__ == "StoreRequest":
            cert, _ = self._parse(request.auth.client_access_token)  # super() checks it
            if cert is not None and cert.role == "observer":
                self.refusals.refuse(cert.peer_id, f"{cert.island} is an observer: it may read, not store")
                return False
        return await super().validate_request(request)


async def _apply_revocations(_dht, node, revocations: Revocations) -> bool:  # runs in the DHT process
    return node.protocol.authorizer.verifier.apply(revocations)


async def _dht_refusals(_dht, node) -> dict:  # runs in the DHT process
    authorizer = node.protocol.authorizer
    return authorizer.refusals.peers() if isinstance(authorizer, RunAuthorizer) else {}


def push_revocations(dht, revocations: Revocations) -> None:
    """Hand a newer revocation list to the DHT process's authorizer (its copy of the verifier)."""
    dht.run_coroutine(partial(_apply_revocations, revocations=revocations), return_future=True)


def dht_refusals(dht) -> dict[str, str]:
    """Peers the DHT process's authorizer refused (peer id -> reason)."""
    try:
        return dht.run_coroutine(_dht_refusals)
    except Exception as e:
        logger.debug("could not read the DHT's refusals: %r", e)
        return {}


# ------------------------------------------------------------------------------------ DHT records

def publish_certificate(dht, run_id: str, certificate: Certificate, ttl: float,
                        now: Optional[Callable[[], float]] = None) -> bool:
    """Store this peer's certificate under :func:`certificates_key` for ``ttl`` seconds of ``now``'s
    time (the swarm's: an island's ``SwarmClock.now``; default hivemind's DHT time)."""
    from hivemind.utils import get_dht_time

    return bool(dht.store(certificates_key(run_id), certificate.to_bytes(), (now or get_dht_time)() + ttl,
                          subkey=certificate.peer_id))


def publish_revocations(dht, fingerprint: str, revocations: Revocations, ttl: float,
                        now: Optional[Callable[[], float]] = None) -> bool:
    """Store the authority's revocation list (anyone admitted may: it is signed) for ``ttl`` seconds
    of ``now``'s time (as :func:`publish_certificate`)."""
    from hivemind.utils import get_dht_time

    return bool(dht.store(revocations_key(fingerprint), revocations.to_bytes(), (now or get_dht_time)() + ttl,
                          subkey=f"{revocations.issued:.3f}"))


def apply_newest(entries, verifier: Verifier) -> bool:
    """Apply to ``verifier`` the newest correctly signed revocation list among a DHT dictionary's
    values (others are ignored). True if its list changed."""
    lists = []
    for item in (entries or {}).values():
        try:
            lists.append(Revocations.from_bytes(item.value))
        except (ValueError, AttributeError, TypeError):
            continue
    for lst in sorted(lists, key=lambda r: r.issued, reverse=True):
        if verifier.apply(lst):
            return True
        if verifier.revocations is not None and lst.issued <= verifier.revocations.issued:
            return False
    return False


def read_revocations(dht, verifier: Verifier) -> bool:
    """Apply the newest revocation list on the DHT that the authority signed to ``verifier``.
    True if its list changed."""
    found = dht.get(revocations_key(verifier.fingerprint), latest=True)
    return apply_newest(found.value if found is not None else None, verifier)


# --------------------------------------------------------------------------------------- averagers

class AveragerGate:
    """The averager process's gate (pickled into it): who may join our group, be in our group, send
    us parts and download our state. Refused peers go to ``refused`` (shared memory) for the island's
    progress record.

    :param verifier: the run's authority and revocations
    :param certificate: this island's certificate (sent in its gathered metadata)
    :param run_id: the run (where certificates are published)
    :param refused: uint8 [slots, 64], shared with the island: peer ids of refused peers, NUL-padded
    """

    def __init__(self, verifier: Verifier, certificate: Certificate, run_id: str, refused=None):
        self.verifier, self.certificate, self.run_id, self.refused = verifier, certificate, run_id, refused
        self.admitted: dict[str, float] = {}  # peer id -> until when its certificate holds (checked ones)
        self.refusals = Refusals("averager")
        self._last_refresh = 0.0

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("refusals",)}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.refusals = Refusals("averager")

    def check(self, peer_id: str, cert: Optional[Certificate], claimed: Optional[str] = None) -> Optional[str]:
        """None if ``cert`` admits ``peer_id`` as an island now (under the island name it ``claimed``,
        when given); else the reason (logged once, recorded)."""
        reason = self.verifier.check(cert, peer_id=peer_id, role="island")
        if reason is None and claimed is not None and claimed != cert.island:
            reason = f"claims to be {claimed!r} but is certified as {cert.island!r}"
        if reason is None:
            self.admitted[peer_id] = cert.expires
        else:
            self.admitted.pop(peer_id, None)
            self.refusals.refuse(peer_id, reason)
            self._record(peer_id)
        return reason

    def is_admitted(self, peer_id: str) -> bool:
        return self.admitted.get(peer_id, 0.0) > time.time()

    def check_gathered(self, peer_id: str, gathered: bytes, serializer) -> Optional[str]:
        """:meth:`check` on the certificate in a member's gathered metadata (hivemind's [bandwidth,
        mode, user bytes]); the island name the member gives must be the certified one."""
        cert, claimed = None, None
        try:
            user = serializer.loads(serializer.loads(gathered)[2])
            claimed = user.get("island")
            cert = Certificate.from_bytes(bytes(user[CERTIFICATE_FIELD]))
        except Exception:
            pass
        return self.check(peer_id, cert, claimed)

    def _record(self, peer_id: str) -> None:
        if self.refused is None:
            return
        encoded = peer_id.encode()[: self.refused.shape[1]]
        rows = [bytes(row).rstrip(b"\0") for row in self.refused.tolist()]
        if encoded in rows or b"" not in rows:
            return
        slot = rows.index(b"")
        self.refused[slot, : len(encoded)] = self.refused.new_tensor(list(encoded))

    async def refresh(self, dht) -> None:
        """Read the revocation list again if it is older than :data:`REFRESH_SECONDS` (in the background)."""
        now = time.time()
        if now - self._last_refresh < REFRESH_SECONDS:
            return
        self._last_refresh = now
        try:
            found = await dht.get(revocations_key(self.verifier.fingerprint), latest=True, return_future=True)
            if apply_newest(found.value if found is not None else None, self.verifier):
                self.admitted.clear()  # every member is checked again at its next round
        except Exception as e:
            logger.debug("could not read the revocation list: %r", e)

    async def certificate_on_dht(self, dht, peer_id: str) -> Optional[Certificate]:
        """The certificate ``peer_id`` published under :func:`certificates_key`, or None."""
        try:
            found = await dht.get(certificates_key(self.run_id), latest=True, return_future=True)
            entry = (found.value if found is not None else {}).get(peer_id)
            return Certificate.from_bytes(entry.value) if entry is not None else None
        except Exception as e:
            logger.debug("could not read %s's certificate: %r", peer_id, e)
            return None


class GatedAveragerMixin:
    """Put before ``DecentralizedAverager`` in a subclass's bases: its RPCs and its all-reduce go
    through ``self._gate`` (an :class:`AveragerGate`; None: an open run)."""

    _gate: Optional[AveragerGate] = None

    def _refresh_gate(self) -> None:
        asyncio.create_task(self._gate.refresh(self.dht))

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self._gate is not None:
            self._refresh_gate()
            peer = context.remote_id.to_base58()
            if self._gate.check_gathered(peer, request.gather, self.serializer) is not None:
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if self._gate is not None and not self._gate.is_admitted(context.remote_id.to_base58()):
            self._gate.refusals.refuse(context.remote_id.to_base58(), "a part from a peer outside our admitted group")
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest, context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if self._gate is not None:
            self._refresh_gate()
            peer = context.remote_id.to_base58()
            if self._gate.check(peer, await self._gate.certificate_on_dht(self.dht, peer)) is not None:
                return  # hivemind's downloader moves on to the next donor
        async for message in super().rpc_download_state(request, context):
            yield message

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        if self._gate is not None:
            for peer, gathered in zip(group_info.peer_ids, group_info.gathered):
                if peer == self.peer_id:
                    continue
                reason = self._gate.check_gathered(peer.to_base58(), gathered, self.serializer)
                if reason is not None:
                    from hivemind.averaging.matchmaking import MatchmakingException

                    raise MatchmakingException(f"group member {peer} is not admitted: {reason}")
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)


# ------------------------------------------------------------------------------------ one peer's view

class Admission:
    """A private run's credentials as one peer holds them (built by :func:`load_admission`): the
    verifier, this peer's certificate, the gates to hand to hivemind, and the chores a peer does on
    every progress tick (:meth:`tick`)."""

    def __init__(self, verifier: Verifier, certificate: Certificate, identity_path: str, run_id: str,
                 revocations_file: str = ""):
        self.verifier, self.certificate, self.identity_path = verifier, certificate, identity_path
        self.run_id, self.revocations_file = run_id, revocations_file
        self._file_mtime = 0.0
        self._pushed: Optional[float] = None  # issued time of the list the DHT process has

    def authorizer(self) -> RunAuthorizer:
        """The DHT's authorizer (``hivemind.DHT(authorizer=...)``)."""
        return RunAuthorizer(self.certificate, self.identity_path, self.verifier)

    def averager_gate(self, refused=None) -> AveragerGate:
        """A gate for one averager process (``refused``: its shared peer-id slots, see :class:`AveragerGate`)."""
        return AveragerGate(self.verifier, self.certificate, self.run_id, refused)

    def read_revocations_file(self) -> None:
        """Apply ``--revocations`` to the verifier when the file changed since the last read.

        :raises OSError, ValueError: an unreadable file or no revocation list
        """
        if not self.revocations_file:
            return
        mtime = os.stat(self.revocations_file).st_mtime
        if mtime != self._file_mtime:
            with open(self.revocations_file, "rb") as f:
                self.verifier.apply(Revocations.from_bytes(f.read()))
            self._file_mtime = mtime

    def tick(self, dht, ttl: float, now: Optional[Callable[[], float]] = None) -> None:
        """Publish this peer's certificate (when it has a run) and the newest revocation list it knows
        (re-reading ``--revocations`` when the file changed) for ``ttl`` seconds of ``now``'s time
        (see :func:`publish_certificate`); take newer lists from the DHT and hand them to the DHT
        process. Errors are logged, never raised."""
        try:
            self.read_revocations_file()
            read_revocations(dht, self.verifier)
            current = self.verifier.revocations
            if current is not None:
                publish_revocations(dht, self.verifier.fingerprint, current, ttl, now)
                if self._pushed != current.issued:
                    push_revocations(dht, current)
                    self._pushed = current.issued
                    logger.info("revocation list of %s: %d certificate(s) revoked",
                                time.strftime("%H:%M:%S", time.localtime(current.issued)), len(current.serials))
            if self.run_id:
                publish_certificate(dht, self.run_id, self.certificate, ttl, now)
        except Exception as e:
            logger.warning("admission chores failed: %r", e)


def load_admission(config, *, identity_path: str, run_id: str, role: Optional[str], where: str) -> Optional[Admission]:
    """A peer's :class:`Admission` from its ``AdmissionConfig``, its own certificate checked; None for
    an open run (said once in the log).

    :param role: the role this command needs (None: any)
    :param where: the command, for the open-run notice ("": none, for observers)
    :raises ConfigError: a missing identity, an unreadable or invalid file, or a certificate that does
        not admit this peer (expired, revoked, another peer's, another role or run), with the fix
    """
    from p2p_diloco.errors import ConfigError
    from p2p_diloco.net import admission as adm

    if not config.private:
        if where:
            logger.info("%s: open run (no --authority-public-key): anyone who knows a peer's address may join, "
                        "read the records and download the model; docs/DEPLOY.md shows how to make it private", where)
        return None
    if not identity_path:
        raise ConfigError("a private run needs --identity-path: the certificate binds that key")
    admission = Admission(Verifier(adm.load_public_key(config.authority_public_key), run_id),
                          adm.load_certificate(config.certificate), identity_path, run_id, config.revocations)
    try:
        admission.read_revocations_file()
    except (OSError, ValueError) as e:
        raise ConfigError(f"--revocations {config.revocations}: {e}") from None
    verifier, certificate = admission.verifier, admission.certificate
    own = adm.peer_id_of(adm.identity_public_key(identity_path))
    reason = verifier.check(certificate, peer_id=own, role=role)
    if reason is not None:
        raise ConfigError(f"--certificate {config.certificate}: {reason}; ask the run's operator for a certificate "
                          f"of this identity (peer {own}): p2p-diloco authority admit")
    logger.info("%s: private run of authority %s; admitted as %s (%s), certificate valid until %s UTC", where,
                verifier.fingerprint, certificate.island, certificate.role,
                time.strftime("%Y-%m-%d %H:%M", time.gmtime(certificate.expires)))
    return admission
