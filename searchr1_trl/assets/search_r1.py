"""Search-R1's assets by name, fetched from the Hugging Face Hub into the folder the Search-R1 recipes point at.

    searchr1-assets --search_r1                 # into $SEARCHR1_CACHE/search_r1 (the recipes' retriever_*_path)
    searchr1-assets --search_r1 DIR --hnsw      # another folder; also the HNSW64 index (CPU search)

- ``PeterJinGo/wiki-18-corpus``: ``wiki-18.jsonl.gz``, unpacked to ``wiki-18.jsonl`` (21M passages);
- ``PeterJinGo/wiki-18-e5-index``: ``part_aa`` + ``part_ab``, joined into ``e5_Flat.index`` (e5-base-v2, exact);
- ``PeterJinGo/nq_hotpotqa_train``: ``train.parquet`` and ``test.parquet`` (the seven test sets, by ``data_source``)
  into the Hub cache, where the recipes' ``train_repo_id`` and ``searchr1-eval --data PeterJinGo/nq_hotpotqa_train``
  read them;
- with ``--hnsw``, ``PeterJinGo/wiki-18-e5-index-HNSW64`` joined into ``e5_HNSW64.index``.

Every file goes through huggingface_hub's own ``hf_hub_download``: a download cut off goes on where it stopped, and
``HF_ENDPOINT`` points it at a mirror. Each file's size and sha256 come from the Hub first (``get_paths_info``), so
the disk the run needs is stated and checked before anything is fetched, and each file is checked against its sha256
once downloaded. An index is joined part by part, each part removed once appended, so the disk holds the index and
one part at most; a record in the folder (:data:`RECORD`) says what is done, so a rerun picks up where a run stopped
and skips what is complete.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

RECORD = ".searchr1_assets.json"  # in the target folder: {product: {"bytes": n, "sha256": {file: sum}}}
GB = 1e9


@dataclass(frozen=True)
class HubAsset:
    """Files of a Hub dataset and what they become: parts ``join``\\ ed into one file, a ``.gz`` unpacked, or (no
    product) the files themselves, kept in the Hub cache."""

    name: str
    repo_id: str
    files: tuple[str, ...]
    product: str | None = None  # in the target folder
    unpack: bool = False


CORPUS = HubAsset("the wiki-18 corpus", "PeterJinGo/wiki-18-corpus", ("wiki-18.jsonl.gz",), "wiki-18.jsonl",
                  unpack=True)
FLAT_INDEX = HubAsset("the e5 flat index", "PeterJinGo/wiki-18-e5-index", ("part_aa", "part_ab"), "e5_Flat.index")
HNSW_INDEX = HubAsset("the e5 HNSW64 index", "PeterJinGo/wiki-18-e5-index-HNSW64", ("part_aa", "part_ab"),
                      "e5_HNSW64.index")
DATA = HubAsset("the NQ + HotpotQA data", "PeterJinGo/nq_hotpotqa_train", ("train.parquet", "test.parquet"))


def assets(hnsw: bool = False) -> list[HubAsset]:
    return [CORPUS, FLAT_INDEX, *([HNSW_INDEX] if hnsw else []), DATA]


def _record(folder: Path) -> dict:
    path = folder / RECORD
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_record(folder: Path, record: dict) -> None:
    tmp = folder / f"{RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, folder / RECORD)


def _done(asset: HubAsset, folder: Path, record: dict) -> bool:
    """Whether ``asset`` is complete: recorded, and its product of the recorded size there (or its files in the Hub
    cache)."""
    if "bytes" not in record.get(asset.product or asset.repo_id, {}):
        return False
    if asset.product is None:
        from huggingface_hub import try_to_load_from_cache

        return all(isinstance(try_to_load_from_cache(asset.repo_id, f, repo_type="dataset"), str) for f in asset.files)
    product = folder / asset.product
    return product.is_file() and product.stat().st_size == record[asset.product]["bytes"]


def _sizes_and_sums(asset: HubAsset) -> dict[str, tuple[int, str | None]]:
    """``{file: (bytes, sha256 or None)}`` as the Hub lists them (a sum where the file is stored in LFS)."""
    from huggingface_hub import HfApi

    listed = {f.path: f for f in HfApi().get_paths_info(asset.repo_id, list(asset.files), repo_type="dataset")}
    missing = [f for f in asset.files if f not in listed]
    if missing:
        raise ValueError(f"{asset.repo_id} lists no {', '.join(missing)}: the dataset changed; expected "
                         f"{', '.join(asset.files)}")
    return {f: (listed[f].size, listed[f].lfs.sha256 if listed[f].lfs else None) for f in asset.files}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _download(asset: HubAsset, filename: str, folder: Path | None, expected: tuple[int, str | None]) -> Path:
    """One file through ``hf_hub_download`` (into ``folder``, or the Hub cache for None), checked against its sum;
    ValueError naming the file, the sums and what to do."""
    from huggingface_hub import hf_hub_download

    path = Path(hf_hub_download(asset.repo_id, filename, repo_type="dataset",
                                local_dir=str(folder) if folder is not None else None))
    size, sha256 = expected
    if sha256 is not None and (actual := _sha256(path)) != sha256:
        path.unlink()
        raise ValueError(f"{asset.repo_id}/{filename}: sha256 {actual}, the Hub lists {sha256}; the file was "
                         "removed, run the command again to download it anew")
    if path.stat().st_size != size:
        raise ValueError(f"{asset.repo_id}/{filename}: {path.stat().st_size} bytes, the Hub lists {size}")
    return path


def _join(asset: HubAsset, folder: Path, files: dict[str, tuple[int, str | None]], record: dict) -> None:
    """The parts appended in order into the product, each downloaded, checked and removed in turn; the record says
    how far it got, so a rerun goes on from the last part appended."""
    entry = record.setdefault(asset.product, {"appended": [], "sha256": {}})
    partial = folder / f"{asset.product}.partial"
    with partial.open("ab") as out:
        out.truncate(sum(files[f][0] for f in entry["appended"]))  # an append cut off midway is undone
        for filename in asset.files:
            if filename in entry["appended"]:
                continue
            part = _download(asset, filename, folder / asset.repo_id.split("/")[1], files[filename])
            with part.open("rb") as f:
                shutil.copyfileobj(f, out, 1 << 24)
            out.flush()
            os.fsync(out.fileno())
            entry["appended"].append(filename)
            entry["sha256"][filename] = files[filename][1]
            _write_record(folder, record)
            part.unlink()
    os.replace(partial, folder / asset.product)
    entry["bytes"] = (folder / asset.product).stat().st_size
    _write_record(folder, record)


def _unpack(asset: HubAsset, folder: Path, files: dict[str, tuple[int, str | None]], record: dict) -> None:
    [(filename, expected)] = files.items()
    packed = _download(asset, filename, folder, expected)
    tmp = folder / f"{asset.product}.partial"
    try:
        with gzip.open(packed, "rb") as source, tmp.open("wb") as out:
            shutil.copyfileobj(source, out, 1 << 24)
    except (gzip.BadGzipFile, EOFError) as error:
        packed.unlink()
        raise ValueError(f"{asset.repo_id}/{filename} does not unpack ({error}); it was removed, run the command "
                         "again to download it anew") from None
    os.replace(tmp, folder / asset.product)
    record[asset.product] = {"bytes": (folder / asset.product).stat().st_size, "sha256": {filename: expected[1]}}
    _write_record(folder, record)
    packed.unlink()


def fetch(folder: Path, hnsw: bool = False) -> dict[str, str]:
    """Fetch what is not complete yet; ``{product: path}`` of everything (data: the Hub dataset's name)."""
    folder.mkdir(parents=True, exist_ok=True)
    record = _record(folder)
    todo = [a for a in assets(hnsw) if not _done(a, folder, record)]
    listed = {a.name: _sizes_and_sums(a) for a in todo}
    needed = 0
    for asset in todo:
        download = sum(size for size, _ in listed[asset.name].values())
        if asset.product is None:
            logger.info("%s (%s): %.2f GB into the Hub cache", asset.name, asset.repo_id, download / GB)
        elif asset.unpack:
            logger.info("%s (%s): %.1f GB to download, then unpacked into %s (the Hub lists no unpacked size)",
                        asset.name, asset.repo_id, download / GB, asset.product)
            needed += download
        else:
            logger.info("%s (%s): %.1f GB in %d parts, joined into %s: %.1f GB at most on disk while joining",
                        asset.name, asset.repo_id, download / GB, len(asset.files), asset.product,
                        (download + max(s for s, _ in listed[asset.name].values())) / GB)
            needed += download + max(s for s, _ in listed[asset.name].values())
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise ValueError(f"{folder} needs about {needed / GB:.1f} GB for what is left to fetch and has "
                         f"{free / GB:.1f} GB free: free some, or give another folder")
    for asset in todo:
        files = listed[asset.name]
        if asset.product is None:
            for filename, expected in files.items():
                _download(asset, filename, None, expected)
            record[asset.repo_id] = {"bytes": sum(s for s, _ in files.values()),
                                     "sha256": {f: s for f, (_, s) in files.items()}}
            _write_record(folder, record)
        elif asset.unpack:
            _unpack(asset, folder, files, record)
        else:
            _join(asset, folder, files, record)
        logger.info("%s: done", asset.name)
    return {a.product or a.repo_id: str(folder / a.product) if a.product else a.repo_id for a in assets(hnsw)}
