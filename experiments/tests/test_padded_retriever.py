"""The wiki-18-scale stand-in for speed benchmarks (experiments/padded_retriever.py): padded by random rows and
width, the real index still answers every question with the same passages and scores."""

import pytest

from experiments.padded_retriever import PadConfig, main, pad_retriever
from retriever_server.encoder import EncoderConfig
from retriever_server.index import SearchConfig
from retriever_server.retriever import Retriever

PAD_ROWS = 50_000  # ~25x the test corpus; random 768-wide rows reach cosines near 0.15 with a query


@pytest.fixture(scope="module")
def real(retriever_server):
    return Retriever.from_paths(retriever_server.index_path, retriever_server.corpus_path,
                                EncoderConfig(retriever_model=retriever_server.retriever_model, device="cpu"),
                                SearchConfig())


def test_padded_index_answers_every_question_as_the_real_one(real, squad_dev_sample):
    _, questions = squad_dev_sample
    queries = list(questions["question"][:64])
    padded = pad_retriever(real, PadConfig(pad_to_rows=PAD_ROWS, pad_to_dim=768, pad_device="cpu"))

    assert (padded.index.ntotal, padded.index.d, len(padded.corpus)) == (PAD_ROWS, 768, PAD_ROWS)
    for ours, theirs in zip(padded.search(queries, [3] * len(queries)), real.search(queries, [3] * len(queries)),
                            strict=True):
        assert [d["id"] for d in ours.documents] == [d["id"] for d in theirs.documents]
        assert ours.scores == pytest.approx(theirs.scores, abs=1e-5)
    # A random row is answered with a real passage rather than failing.
    n = len(real.corpus)
    assert padded.corpus.take([n + 5]) == real.corpus.take([5])


def test_padding_below_the_real_index_is_refused_by_name(real, retriever_server):
    with pytest.raises(ValueError, match="smaller than the real index"):
        pad_retriever(real, PadConfig(pad_to_rows=10, pad_to_dim=768, pad_device="cpu"))
    # The same through the server's command line: one line saying why, before anything is served.
    with pytest.raises(SystemExit, match="smaller than the real index"):
        main(["--index_path", retriever_server.index_path, "--corpus_path", retriever_server.corpus_path,
              "--retriever_model", retriever_server.retriever_model, "--device", "cpu", "--pad_to_dim", "128"])
