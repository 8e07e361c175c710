"""Progress of the server's long loads: what is being read, how much of it, how fast, and when it will be done.

Reading wiki-18's corpus (13 GB) and flat index (65 GB) takes minutes inside single library calls (pyarrow, faiss)
that report nothing, so :func:`loading` watches from the side: every ``every_s`` seconds it logs the bytes this
process has read since the load began (``rchar`` of ``/proc/self/io``, Linux) against the file's size, with the rate
and an ETA; where ``/proc/self/io`` is missing it logs the time elapsed.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)


def _bytes_read() -> int | None:
    """Bytes this process has read so far (any file), or None where the kernel does not say."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _size(n: float) -> str:
    """``4_000_000`` -> ``"4.0 MB"``, ``65e9`` -> ``"65.00 GB"``."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


@contextmanager
def loading(what: str, path: str | None = None, every_s: float = 10.0):
    """Log ``what`` (and ``path``'s size) at the start, its progress every ``every_s`` seconds, its time at the end."""
    size = Path(path).stat().st_size if path and Path(path).is_file() else None
    logger.info("loading %s%s%s", what, f" from {path}" if path else "", f" ({_size(size)})" if size else "")
    start, first = time.monotonic(), _bytes_read()
    done = threading.Event()

    def report() -> None:
        while not done.wait(every_s):
            elapsed = time.monotonic() - start
            now = _bytes_read()
            if size and first is not None and now is not None:
                read = min(now - first, size)
                rate = read / elapsed
                eta = f", ETA {(size - read) / rate:.0f}s" if rate > 0 else ""
                logger.info("  %s: %s of %s (%d%%), %.0f MB/s%s", what, _size(read), _size(size), 100 * read // size,
                            rate / 1e6, eta)
            else:
                logger.info("  %s: %.0fs so far", what, elapsed)

    ticker = threading.Thread(target=report, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        logger.info("loaded %s in %.1fs", what, time.monotonic() - start)
