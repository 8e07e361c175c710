"""searchr1-assets --search_r1: Search-R1's corpus, index and data through huggingface_hub's own download, from a
local stand-in for the Hub (HF_ENDPOINT): joined and unpacked where the recipes read them, a download cut off
resumed, a file whose sum is wrong refused, a rerun that fetches nothing it has."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from searchr1_trl.serving.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "5" * 40
CORPUS_LINES = b'{"id": "0", "contents": "\\"Paris\\"\\nParis is the capital of France."}\n' * 2000


class LocalHub:
    """Hub datasets served from memory the way huggingface_hub asks for them: HEAD and GET (with Range) of
    ``/datasets/<repo>/resolve/<revision>/<file>``, POST ``/api/datasets/<repo>/paths-info/<revision>``.
    ``cut``: files whose first GET stops halfway (a dropped connection); ``corrupt``: files served with other bytes
    than the sum listed for them. Every GET is logged as ``(repo/file, first byte)``."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.cut, self.corrupt, self.gets = files, set(), set(), []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_HEAD(self):
                name = self._name()
                if name is None:
                    return self._reply(404, b"")
                self.send_response(200)
                self._file_headers(name, len(hub.files[name]))
                self.end_headers()

            def do_GET(self):
                name = self._name()
                if name is None:
                    return self._reply(404, b"")
                data = hub.files[name] if name not in hub.corrupt else b"x" * len(hub.files[name])
                start = int(re.match(r"bytes=(\d+)-", self.headers.get("Range", "bytes=0-")).group(1))
                hub.gets.append((name, start))
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self._file_headers(name, len(data) - start)
                self.end_headers()
                body = data[start:]
                if name in hub.cut:
                    hub.cut.discard(name)
                    self.wfile.write(body[:len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def do_POST(self):
                repo = re.fullmatch(r"/api/datasets/(.+)/paths-info/main", self.path).group(1)
                form = parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
                listed = [{"type": "file", "path": p, "size": len(hub.files[f"{repo}/{p}"]),
                           "oid": hashlib.sha1(hub.files[f"{repo}/{p}"]).hexdigest(),
                           "lfs": {"oid": hashlib.sha256(hub.files[f"{repo}/{p}"]).hexdigest(),
                                   "size": len(hub.files[f"{repo}/{p}"]), "pointerSize": 134}}
                          for p in form["paths"] if f"{repo}/{p}" in hub.files]
                self._reply(200, json.dumps(listed).encode())

            def _name(self) -> str | None:
                match = re.fullmatch(r"/datasets/(.+)/resolve/main/(.+)", self.path)
                name = match and f"{match.group(1)}/{match.group(2)}"
                return name if name in hub.files else None

            def _file_headers(self, name: str, length: int) -> None:
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(hub.files[name]).hexdigest()}"')
                self.send_header("Content-Length", str(length))

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"


@pytest.fixture
def hub():
    files = {"PeterJinGo/wiki-18-corpus/wiki-18.jsonl.gz": gzip.compress(CORPUS_LINES),
             # more than huggingface_hub's download chunk (10 MiB), which it writes whole: a cut in the second
             # chunk resumes after the first
             "PeterJinGo/wiki-18-e5-index/part_aa": os.urandom(24 * 2**20),
             "PeterJinGo/wiki-18-e5-index/part_ab": os.urandom(123_457),
             "PeterJinGo/wiki-18-e5-index-HNSW64/part_aa": os.urandom(1000),
             "PeterJinGo/wiki-18-e5-index-HNSW64/part_ab": os.urandom(1000),
             "PeterJinGo/nq_hotpotqa_train/train.parquet": os.urandom(5000),
             "PeterJinGo/nq_hotpotqa_train/test.parquet": os.urandom(3000)}
    hub = LocalHub(files)
    yield hub
    hub.server.shutdown()


def fetch(hub: LocalHub, folder: Path, cache: Path, *flags: str) -> subprocess.CompletedProcess:
    """``searchr1-assets --search_r1 <folder>``, its Hub requests going to the stand-in (a fresh process: the
    endpoint and the cache are read when huggingface_hub is imported)."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(cache),
           "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "searchr1_trl.assets.offline", "--search_r1", str(folder), *flags],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def cached(cache: Path, repo: str, filename: str) -> bytes:
    [path] = (cache / "hub" / f"datasets--{repo.replace('/', '--')}" / "snapshots").glob(f"*/{filename}")
    return path.read_bytes()


def test_the_assets_land_joined_and_unpacked_where_the_recipes_read_them_and_a_cut_download_resumes(hub, tmp_path):
    hub.cut.add("PeterJinGo/wiki-18-e5-index/part_aa")
    folder, cache = tmp_path / "search_r1", tmp_path / "hf"
    done = fetch(hub, folder, cache)
    assert done.returncode == 0, done.stderr[-2000:]

    index = hub.files["PeterJinGo/wiki-18-e5-index/part_aa"] + hub.files["PeterJinGo/wiki-18-e5-index/part_ab"]
    assert (folder / "e5_Flat.index").read_bytes() == index
    assert (folder / "wiki-18.jsonl").read_bytes() == CORPUS_LINES
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [
        "e5_Flat.index", "wiki-18-e5-index", "wiki-18.jsonl"]  # the parts and the .gz are gone once used
    assert not any((folder / "wiki-18-e5-index").glob("part_*"))
    for name in ("train.parquet", "test.parquet"):  # where the recipes' train_repo_id and searchr1-eval read them
        assert cached(cache, "PeterJinGo/nq_hotpotqa_train", name) == hub.files[f"PeterJinGo/nq_hotpotqa_train/{name}"]
    part = "PeterJinGo/wiki-18-e5-index/part_aa"
    starts = [start for name, start in hub.gets if name == part]
    assert len(starts) == 2 and starts[0] == 0 and 0 < starts[1] <= 12 * 2**20  # resumed, not started over
    assert re.search(r"the e5 flat index \(PeterJinGo/wiki-18-e5-index\): [\d.]+ GB in 2 parts, joined into "
                     r"e5_Flat.index: [\d.]+ GB at most on disk while joining", done.stderr)  # said before fetching
    paths = json.loads(done.stdout)
    assert paths["e5_Flat.index"] == str(folder / "e5_Flat.index") and "e5_HNSW64.index" not in paths

    hub.gets.clear()
    again = fetch(hub, folder, cache, "--hnsw")  # everything it has is skipped; the HNSW index is new
    assert again.returncode == 0, again.stderr[-2000:]
    assert {name.rsplit("/", 1)[0] for name, _ in hub.gets} == {"PeterJinGo/wiki-18-e5-index-HNSW64"}
    assert (folder / "e5_HNSW64.index").stat().st_size == 2000


def test_a_file_whose_sum_is_wrong_is_refused_and_the_rerun_goes_on_from_the_last_part_appended(hub, tmp_path):
    hub.corrupt.add("PeterJinGo/wiki-18-e5-index/part_ab")
    folder, cache = tmp_path / "search_r1", tmp_path / "hf"
    refused = fetch(hub, folder, cache)
    expected = hashlib.sha256(hub.files["PeterJinGo/wiki-18-e5-index/part_ab"]).hexdigest()
    assert refused.returncode == 1
    assert re.search(rf"error: PeterJinGo/wiki-18-e5-index/part_ab: sha256 [0-9a-f]{{64}}, the Hub lists {expected}; "
                     "the file was removed, run the command again to download it anew", refused.stderr)
    assert not (folder / "e5_Flat.index").exists()

    hub.corrupt.clear()
    hub.gets.clear()
    done = fetch(hub, folder, cache)
    assert done.returncode == 0, done.stderr[-2000:]
    index = hub.files["PeterJinGo/wiki-18-e5-index/part_aa"] + hub.files["PeterJinGo/wiki-18-e5-index/part_ab"]
    assert (folder / "e5_Flat.index").read_bytes() == index
    assert [name for name, _ in hub.gets if "e5-index" in name] == ["PeterJinGo/wiki-18-e5-index/part_ab"]
