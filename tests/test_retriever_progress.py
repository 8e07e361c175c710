"""The retrieval server's start: each long load says what it reads, how far it is and when it will be done."""

from __future__ import annotations

import logging
import time

from retriever_server.progress import loading


def test_a_load_logs_its_size_then_bytes_read_with_rate_and_eta_then_its_time(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="retriever_server.progress")
    path = tmp_path / "index.faiss"
    path.write_bytes(b"v" * 4_000_000)
    with loading("index", str(path), every_s=0.05), path.open("rb") as f:
        for _ in range(4):
            f.read(1_000_000)
            time.sleep(0.12)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == f"loading index from {path} (4.0 MB)"
    assert any(line.startswith("  index: ") and "of 4.0 MB (" in line and "MB/s, ETA " in line for line in lines)
    assert lines[-1].startswith("loaded index in ")
