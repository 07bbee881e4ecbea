"""Front-end files the dashboard serves: uPlot, a small charting library (MIT), from the npm registry.

The dashboard needs no CDN (many clusters have no internet): ``p2p-diloco fetch-assets`` (run by
``scripts/setup_venv.sh``) downloads the pinned uPlot release once, checks its SHA-512 against the
registry's integrity value pinned here, and puts its files under ``p2p_diloco/observe/static/vendor/``, where
they are package data (a wheel built afterwards carries them). On an offline machine, copy the
``.tgz`` over and pass it with ``--from``. The files are not committed to this repository.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import io
import tarfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from p2p_diloco.errors import ConfigError, NetworkError
from p2p_diloco import files

STATIC = Path(__file__).parent / "static"
VENDOR = STATIC / "vendor"


@dataclass(frozen=True)
class NpmAsset:
    """One pinned npm package: its tarball, its integrity (``sha512-<base64>``, as npm records it) and
    the files taken from it (path inside the tarball -> name under ``VENDOR``)."""

    name: str
    version: str
    integrity: str
    files: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"https://registry.npmjs.org/{self.name}/-/{self.name}-{self.version}.tgz"


UPLOT = NpmAsset(
    name="uplot", version="1.6.32",
    integrity="sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+jabjLgSLMasNuGGzQm/ep3tOkyTxpiQIw==",
    files={"package/dist/uPlot.iife.min.js": "uPlot.iife.min.js", "package/dist/uPlot.min.css": "uPlot.min.css",
           "package/LICENSE": "uPlot.LICENSE"},
)
ASSETS = (UPLOT,)


def missing(vendor: Path = VENDOR) -> list[str]:
    """Names of vendored files that are not there yet."""
    return [name for asset in ASSETS for name in asset.files.values() if not (vendor / name).is_file()]


def require(vendor: Path = VENDOR) -> None:
    """:raises ConfigError: a vendored file is missing (it names the command that fetches it)"""
    if missing(vendor):
        raise ConfigError(f"the dashboard's charting library is missing ({', '.join(missing(vendor))}): "
                          "run `p2p-diloco fetch-assets` (or scripts/setup_venv.sh) once")


def _integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def fetch(source: Optional[str] = None, vendor: Path = VENDOR, timeout: float = 60.0) -> list[Path]:
    """Download (or read from the local tarball ``source``) every pinned asset, check its integrity
    and write its files under ``vendor``; returns the paths written. Does nothing for files present.

    :raises NetworkError: the npm registry cannot be reached (pass ``--from FILE.tgz`` instead)
    :raises ConfigError: ``source`` is unreadable, the tarball's SHA-512 is not the pinned one, or
        ``vendor`` cannot be written
    """
    written = []
    for asset in ASSETS:
        if source is None and all((vendor / name).is_file() for name in asset.files.values()):
            continue
        if source is not None:
            try:
                data = Path(source).read_bytes()
            except OSError as e:
                raise ConfigError(f"--from {source}: cannot read it ({e.strerror or e})") from None
        else:
            try:
                with urllib.request.urlopen(asset.url, timeout=timeout) as response:
                    data = response.read()
            except (OSError, http.client.HTTPException) as e:
                raise NetworkError(
                    f"cannot download {asset.url} ({e}); on a machine without internet, copy that file over and "
                    f"run `p2p-diloco fetch-assets --from {asset.name}-{asset.version}.tgz`"
                ) from None
        if _integrity(data) != asset.integrity:
            raise ConfigError(f"{source or asset.url} is not {asset.name} {asset.version}: its SHA-512 differs "
                              f"from the pinned {asset.integrity}")
        try:
            vendor.mkdir(parents=True, exist_ok=True)
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
                for inside, name in asset.files.items():
                    member = tar.extractfile(inside)
                    if member is None:
                        raise ConfigError(f"{asset.name} {asset.version} has no {inside}")
                    # atomic: a half-written file is never served
                    written.append(files.write_bytes(vendor / name, member.read()))
        except OSError as e:
            raise ConfigError(f"cannot write the dashboard's files to {vendor} ({e.strerror or e}): run "
                              "fetch-assets as the user who installed the package") from None
    return written
