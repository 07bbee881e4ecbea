"""Admission control for private runs (docs/DESIGN.md, "Admission"): an authority signs expiring
certificates that bind a peer's public key (the one of its libp2p identity file, so its peer id) to an
island name, a role and a run; a signed revocation list withdraws them.

This module is the pure part: keys, certificates, revocation lists and the one check every gate uses
(:class:`Verifier`). The DHT's authorizer and the averager's gate (:mod:`p2p_diloco.net.gate`) call it.
Signatures are RSA-PSS with SHA-256 over a canonical JSON body, as hivemind signs its own records.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from p2p_diloco import files
from p2p_diloco.errors import ConfigError

logger = logging.getLogger(__name__)

CERTIFICATE_FORMAT = "p2p-diloco-certificate/1"
REVOCATIONS_FORMAT = "p2p-diloco-revocations/1"
ROLES = ("island", "observer", "bootstrap")  # island: trains and averages; the others use the DHT only
ANY_RUN = "*"
_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)
MAX_CERTIFICATE_BYTES = 4096  # a certificate from a peer larger than this is refused unread


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _sign(private_key: rsa.RSAPrivateKey, data: bytes) -> str:
    return base64.b64encode(private_key.sign(data, _PADDING, hashes.SHA256())).decode()


def _verify(public_key: rsa.RSAPublicKey, data: bytes, signature: str) -> bool:
    try:
        public_key.verify(base64.b64decode(signature, validate=True), data, _PADDING, hashes.SHA256())
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


# ---------------------------------------------------------------------------------------------- keys

def init_authority(folder: str) -> tuple[Path, Path]:
    """Create an authority key pair in ``folder``: ``authority.key`` (PKCS#8 PEM, mode 0600: keep it
    off the swarm's machines) and ``authority.pub`` (OpenSSH line, given to every peer).

    :returns: (private key path, public key path)
    :raises ConfigError: if ``authority.key`` exists already (it is never overwritten)
    """
    out = Path(folder).expanduser().absolute()
    private, public = out / "authority.key", out / "authority.pub"
    if private.exists():
        raise ConfigError(f"{private} exists already: an authority key is never overwritten (move it away first)")
    key = rsa.generate_private_key(public_exponent=65537, key_size=3072)
    files.write_bytes(private, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))
    os.chmod(private, 0o600)
    files.write_bytes(public, key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                            serialization.PublicFormat.OpenSSH) + b"\n")
    os.chmod(public, 0o644)
    return private, public


def load_authority_private(path: str) -> rsa.RSAPrivateKey:
    """The authority's private key (``authority.key``).

    :raises ConfigError: unreadable, not a PEM RSA key, or readable by others than its owner
    """
    file = Path(path).expanduser()
    if file.exists() and file.stat().st_mode & 0o077:
        raise ConfigError(f"{file} is readable by others (mode {file.stat().st_mode & 0o777:o}): chmod 600 it")
    return _read_private_key(file, lambda data: serialization.load_pem_private_key(data, password=None),
                             "authority key", "a PEM private key (made by `p2p-diloco authority init`)")


def _read_private_key(file: Path, parse, what: str, kind: str) -> rsa.RSAPrivateKey:
    """``parse`` of the file's bytes, which must give an RSA private key.

    :raises ConfigError: naming ``what`` and the file when it is unreadable or holds something else
    """
    try:
        key = parse(file.read_bytes())
    except OSError as e:
        raise ConfigError(f"{what} {file}: cannot read ({e.strerror or e})") from None
    except Exception:
        raise ConfigError(f"{what} {file} is not {kind}") from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ConfigError(f"{what} {file} is not an RSA key")
    return key


def load_public_key(path: str, what: str = "--authority-public-key") -> rsa.RSAPublicKey:
    """An RSA public key from an OpenSSH line (``authority.pub``, a peer's ``.pub``).

    :raises ConfigError: naming ``what`` when the file is unreadable or not an RSA public key
    """
    file = Path(path).expanduser()
    try:
        return parse_public_key(file.read_text().strip())
    except OSError as e:
        raise ConfigError(f"{what} {file}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise ConfigError(f"{what} {file}: {e}") from None


def parse_public_key(text: str) -> rsa.RSAPublicKey:
    """:raises ValueError: if ``text`` is not an OpenSSH RSA public key line"""
    try:
        key = serialization.load_ssh_public_key(text.encode())
    except Exception:
        raise ValueError("not an OpenSSH public key line (ssh-rsa AAAA...)") from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA key")
    return key


def openssh(public_key: rsa.RSAPublicKey) -> str:
    """The OpenSSH line of a public key (hivemind's ``RSAPublicKey.to_bytes`` format)."""
    return public_key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def identity_key(identity_path: str) -> rsa.RSAPrivateKey:
    """The private key of a libp2p identity file (a protobuf ``PrivateKey`` with an RSA DER key, as
    ``hivemind.P2P.generate_identity`` writes it).

    :raises ConfigError: if the file is unreadable or holds no RSA key
    """
    from hivemind.proto import crypto_pb2

    def parse(data: bytes):
        return serialization.load_der_private_key(crypto_pb2.PrivateKey.FromString(data).data, password=None)

    return _read_private_key(Path(identity_path).expanduser(), parse, "identity", "a libp2p RSA private key")


def identity_public_key(identity_path: str) -> rsa.RSAPublicKey:
    """The public key of a libp2p identity file (see :func:`identity_key`)."""
    return identity_key(identity_path).public_key()


def peer_id_of(public_key: rsa.RSAPublicKey) -> str:
    """The libp2p peer id (base58) of an RSA public key: the SHA-256 multihash of its protobuf
    ``PublicKey`` (libp2p's peer-id specification, as ``hivemind.PeerID.from_identity``)."""
    import multihash
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))).to_base58()


def key_fingerprint(public_key: rsa.RSAPublicKey) -> str:
    """16 hex digits naming a key (an authority's, in DHT keys and logs)."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()[:16]


# -------------------------------------------------------------------------------------- certificates

@dataclass(frozen=True)
class Certificate:
    """An authority's statement: the holder of ``public_key`` (peer ``peer_id``) may take part in
    ``run_id`` (``*``: any run of this authority) as ``island`` with ``role``, from ``issued`` to
    ``expires`` (unix seconds). ``serial`` names it in revocation lists."""

    island: str
    role: str
    run_id: str
    peer_id: str
    public_key: str  # OpenSSH line
    issued: float
    expires: float
    serial: str
    signature: str = ""
    format: str = field(default=CERTIFICATE_FORMAT)

    def body(self) -> bytes:
        """The signed bytes: every field but the signature, as canonical JSON."""
        return _canonical({k: v for k, v in asdict(self).items() if k != "signature"})

    def to_bytes(self) -> bytes:
        return _canonical(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> "Certificate":
        """:raises ValueError: if ``data`` is not a certificate (too long, not JSON, fields missing or mistyped)"""
        if len(data) > MAX_CERTIFICATE_BYTES:
            raise ValueError(f"longer than {MAX_CERTIFICATE_BYTES} bytes")
        try:
            raw = json.loads(data)
            cert = cls(**raw)
        except (ValueError, TypeError) as e:
            raise ValueError(f"not a certificate ({e})") from None
        if cert.format != CERTIFICATE_FORMAT:
            raise ValueError(f"unknown format {cert.format!r}")
        for name in ("island", "role", "run_id", "peer_id", "public_key", "serial", "signature"):
            if not isinstance(getattr(cert, name), str):
                raise ValueError(f"field {name} is not a string")
        if not all(isinstance(getattr(cert, n), (int, float)) for n in ("issued", "expires")):
            raise ValueError("issued/expires are not numbers")
        return cert


def issue_certificate(authority: rsa.RSAPrivateKey, peer_public_key: rsa.RSAPublicKey, *, island: str, role: str,
                      run_id: str = ANY_RUN, days: float = 30.0, now: Optional[float] = None) -> Certificate:
    """Sign a certificate for the holder of ``peer_public_key``.

    :param days: validity, from now
    :raises ConfigError: for an unknown role or a non-positive validity
    """
    if role not in ROLES:
        raise ConfigError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if days <= 0:
        raise ConfigError("--days must be positive")
    now = time.time() if now is None else now
    cert = Certificate(island=island, role=role, run_id=run_id, peer_id=peer_id_of(peer_public_key),
                       public_key=openssh(peer_public_key), issued=round(now, 3), expires=round(now + days * 86400, 3),
                       serial=secrets.token_hex(8))
    return Certificate(**(asdict(cert) | {"signature": _sign(authority, cert.body())}))


def load_certificate(path: str) -> Certificate:
    """:raises ConfigError: naming the file when it is unreadable or not a certificate"""
    file = Path(path).expanduser()
    try:
        return Certificate.from_bytes(file.read_bytes())
    except OSError as e:
        raise ConfigError(f"--certificate {file}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise ConfigError(f"--certificate {file}: {e}") from None


# ----------------------------------------------------------------------------------- revocation list

@dataclass(frozen=True)
class Revocations:
    """The authority's list of revoked certificate serials, as of ``issued`` (a newer list replaces
    an older one; an older one never replaces a newer one)."""

    issued: float
    serials: tuple[str, ...]
    signature: str = ""
    format: str = field(default=REVOCATIONS_FORMAT)

    def body(self) -> bytes:
        return _canonical({"issued": self.issued, "serials": sorted(self.serials), "format": self.format})

    def to_bytes(self) -> bytes:
        return _canonical({"issued": self.issued, "serials": sorted(self.serials), "format": self.format,
                           "signature": self.signature})

    @classmethod
    def from_bytes(cls, data: bytes) -> "Revocations":
        """:raises ValueError: if ``data`` is not a revocation list"""
        if len(data) > 1 << 20:
            raise ValueError("longer than 1 MiB")
        try:
            raw = json.loads(data)
            lst = cls(issued=float(raw["issued"]), serials=tuple(str(s) for s in raw["serials"]),
                      signature=str(raw["signature"]), format=str(raw["format"]))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"not a revocation list ({e!r})") from None
        if lst.format != REVOCATIONS_FORMAT:
            raise ValueError(f"unknown format {lst.format!r}")
        return lst


def revoke(authority: rsa.RSAPrivateKey, current: Optional[Revocations], serials: Iterable[str],
           now: Optional[float] = None) -> Revocations:
    """A new signed list: ``current``'s serials and ``serials``, issued now."""
    merged = tuple(sorted(set(current.serials if current else ()) | set(serials)))
    issued = max(time.time() if now is None else now, (current.issued + 0.001) if current else 0.0)
    unsigned = Revocations(issued=round(issued, 3), serials=merged)
    return Revocations(issued=unsigned.issued, serials=merged, signature=_sign(authority, unsigned.body()))


# ---------------------------------------------------------------------------------------- the check

class Verifier:
    """Checks certificates against one authority and its newest revocation list (thread-safe).

    :param authority: the authority's public key
    :param run_id: the run being protected ("" on a bootstrap node that serves every run)
    """

    def __init__(self, authority: rsa.RSAPublicKey, run_id: str = ""):
        self.authority, self.run_id = authority, run_id
        self.fingerprint = key_fingerprint(authority)
        self.revocations: Optional[Revocations] = None
        self._lock = threading.Lock()

    def __getstate__(self):  # pickled into the DHT and averager processes
        return {"authority": openssh(self.authority), "run_id": self.run_id, "revocations": self.revocations}

    def __setstate__(self, state):
        self.__init__(parse_public_key(state["authority"]), state["run_id"])
        self.revocations = state["revocations"]

    def apply(self, revocations: Revocations) -> bool:
        """Take a newer, correctly signed revocation list. Returns True if it replaced the current one."""
        if not _verify(self.authority, revocations.body(), revocations.signature):
            logger.debug("ignored a revocation list not signed by this run's authority")
            return False
        with self._lock:
            if self.revocations is not None and revocations.issued <= self.revocations.issued:
                return False
            self.revocations = revocations
        return True

    def check(self, cert: Optional[Certificate], *, peer_id: Optional[str] = None, role: Optional[str] = None,
              now: Optional[float] = None) -> Optional[str]:
        """None if ``cert`` admits its holder (as ``peer_id`` and for ``role``, when given), else the
        reason it does not, in a few words (logged and shown as such)."""
        if cert is None:
            return "no certificate"
        if not _verify(self.authority, cert.body(), cert.signature):
            return f"forged certificate (not signed by authority {self.fingerprint})"
        try:
            holder = peer_id_of(parse_public_key(cert.public_key))
        except ValueError:
            return "certificate with a malformed public key"
        if holder != cert.peer_id:
            return "certificate whose peer id does not match its key"
        if peer_id is not None and peer_id != cert.peer_id:
            return f"another peer's certificate ({cert.island}, peer {cert.peer_id[-8:]})"
        now = time.time() if now is None else now
        if now > cert.expires:
            return f"certificate of {cert.island} expired at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(cert.expires))} UTC"
        if now < cert.issued - 300:
            return f"certificate of {cert.island} not valid yet"
        with self._lock:
            revoked = self.revocations is not None and cert.serial in self.revocations.serials
        if revoked:
            return f"revoked certificate of {cert.island} (serial {cert.serial})"
        if self.run_id and cert.run_id not in (ANY_RUN, self.run_id):
            return f"certificate of {cert.island} for run {cert.run_id!r}, not {self.run_id!r}"
        if role is not None and cert.role != role:
            return f"{cert.island} is admitted as {cert.role}, not as {role}"
        return None


class Refusals:
    """Peers refused so far (peer id -> reason): each is logged once; ``peers()`` lists them for the
    progress record (at most ``limit``)."""

    def __init__(self, where: str, limit: int = 64):
        self.where, self.limit = where, limit
        self._seen: dict[str, str] = {}
        self._lock = threading.Lock()

    def refuse(self, peer: str, reason: str) -> None:
        with self._lock:
            if peer in self._seen or len(self._seen) >= self.limit:
                return
            self._seen[peer] = reason
        logger.warning("refused peer %s (%s): %s", peer, self.where, reason)

    def peers(self) -> dict[str, str]:
        with self._lock:
            return dict(self._seen)
