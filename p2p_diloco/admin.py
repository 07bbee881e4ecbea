"""``p2p-diloco identity`` and ``p2p-diloco authority``: the keys and certificates of a private run
(docs/DEPLOY.md, "A private run"). Everything here runs offline, on the operator's or the peer's
machine; nothing touches the swarm."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from p2p_diloco import files
from p2p_diloco.errors import ConfigError
from p2p_diloco.net import admission as adm


def run(args: argparse.Namespace) -> None:
    """Carry out ``identity`` or ``authority {init,admit,revoke}``; prints what it wrote.

    :raises ConfigError: unreadable keys, an existing authority key, a bad role or validity
    """
    if args.command == "identity":
        from p2p_diloco.net.dht import ensure_identity

        path = ensure_identity(args.path)
        public = adm.identity_public_key(path)
        pub_path = files.write_text(path + ".pub", adm.openssh(public) + "\n")
        pub_path.chmod(0o644)
        print(f"peer id {adm.peer_id_of(public)}\npublic key {pub_path} (send it to the run's operator)")
    elif args.action == "init":
        private, public = adm.init_authority(args.dir)
        fingerprint = adm.key_fingerprint(adm.load_public_key(str(public)))
        print(f"authority {fingerprint}\nprivate key {private} (mode 0600: keep it off the swarm's machines)\n"
              f"public key {public} (give it to every peer: --authority-public-key)")
    elif args.action == "admit":
        authority = adm.load_authority_private(args.authority_key)
        cert = adm.issue_certificate(authority, _peer_public_key(args.public_key), island=args.island,
                                     role=args.role, run_id=args.run_id, days=args.days)
        out = files.write_bytes(args.out, cert.to_bytes() + b"\n")
        out.chmod(0o644)
        print(f"certificate {out}: {cert.island} as {cert.role} of run {cert.run_id}, peer {cert.peer_id}, "
              f"serial {cert.serial}, valid until {time.strftime('%Y-%m-%d %H:%M', time.gmtime(cert.expires))} UTC")
    elif args.action == "revoke":
        authority = adm.load_authority_private(args.authority_key)
        current = None
        if Path(args.revocations).exists():
            try:
                current = adm.Revocations.from_bytes(Path(args.revocations).read_bytes())
            except ValueError as e:
                raise ConfigError(f"--revocations {args.revocations}: {e}") from None
        serials = [_serial(item) for item in args.certificates]
        updated = adm.revoke(authority, current, serials)
        out = files.write_bytes(args.revocations, updated.to_bytes() + b"\n")
        out.chmod(0o644)
        print(f"revocation list {out}: {len(updated.serials)} certificate(s) revoked ({', '.join(serials)} added); "
              "peers started with --revocations on this file publish it, and every peer applies it within one "
              "record TTL")


def _peer_public_key(path: str):
    """A peer's public key from its ``.pub`` file, or from its identity file itself."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{path}: no such file (the peer's public key, written by `p2p-diloco identity`)")
    try:
        return adm.parse_public_key(file.read_bytes().decode().strip())
    except (ValueError, UnicodeDecodeError):
        return adm.identity_public_key(path)


def _serial(item: str) -> str:
    """A certificate file's serial, or ``item`` itself when it is no file."""
    if Path(item).expanduser().is_file():
        return adm.load_certificate(item).serial
    if not item or not all(c in "0123456789abcdef" for c in item):
        raise ConfigError(f"{item!r} is neither a certificate file nor a serial (16 hex digits)")
    return item
