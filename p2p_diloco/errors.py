"""Errors that reach the user as one clear line (no traceback) and a non-zero exit code."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix: bad flag, unreadable file, unreachable peer, refused fingerprint.

    The command-line entry points print ``error: <message>`` on stderr and exit with ``exit_code``
    instead of showing a traceback.
    """

    exit_code: int = 2

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(UserError):
    """An invalid configuration value; the message names the field and its flag."""

    exit_code = 2


class NetworkError(UserError):
    """The swarm could not be reached (dead or malformed initial peers, port in use)."""

    exit_code = 3


class FingerprintMismatch(UserError):
    """The island's model/tokenizer/outer-algorithm fingerprint differs from the swarm's."""

    exit_code = 4


class Interrupted(UserError):
    """SIGINT/SIGTERM arrived before the command got going (while connecting, say)."""

    exit_code = 130
