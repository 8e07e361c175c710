"""Question stream: order, reshuffle on wrap, filter, resume, bad files, golden answer normalisation."""

from __future__ import annotations

import json
import pickle

import huggingface_hub
import numpy as np
import pandas as pd
import pytest

from searchr1_trl.tasks.common.data import SearchR1Dataset, SearchR1DatasetConfig, SearchR1Sample


def write_parquet(path, rows) -> str:
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


@pytest.fixture
def ten_questions(tmp_path) -> str:
    """q0..q9; even rows from nq, odd rows from hotpotqa; golden answer of qi is ai."""
    rows = [
        {"question": f"q{i}", "golden_answers": [f"a{i}"], "data_source": "nq" if i % 2 == 0 else "hotpotqa"}
        for i in range(10)
    ]
    return write_parquet(tmp_path / "ten.parquet", rows)


def stream(path, **overrides) -> SearchR1Dataset:
    return SearchR1Dataset(SearchR1DatasetConfig(data_path=path, **overrides))


def questions(samples) -> list[str]:
    return [s.question for s in samples]


def test_shuffle_false_keeps_file_order_and_wraps_to_the_start(ten_questions):
    dataset = stream(ten_questions, shuffle=False)

    drawn = [next(dataset) for _ in range(13)]

    assert questions(drawn) == [f"q{i}" for i in range(10)] + ["q0", "q1", "q2"]
    assert drawn[0] == SearchR1Sample(question="q0", golden_answers=("a0",), data_source="nq")


def test_every_epoch_is_a_new_permutation_with_every_row_once(ten_questions):
    dataset = stream(ten_questions, seed=3)

    epochs = [questions(next(dataset) for _ in range(10)) for _ in range(3)]

    for epoch in epochs:
        assert sorted(epoch) == sorted(f"q{i}" for i in range(10))
    assert epochs[0] != [f"q{i}" for i in range(10)]
    assert len({tuple(e) for e in epochs}) == 3


def test_the_same_seed_gives_the_same_stream_and_another_seed_a_different_one(ten_questions):
    first, again, other = stream(ten_questions, seed=1), stream(ten_questions, seed=1), stream(ten_questions, seed=2)

    drawn = [questions(next(d) for _ in range(25)) for d in (first, again, other)]

    assert drawn[0] == drawn[1]
    assert drawn[0] != drawn[2]


def test_data_source_keeps_only_matching_rows(ten_questions):
    dataset = stream(ten_questions, data_source="nq", shuffle=False)

    assert len(dataset) == 5
    assert questions(next(dataset) for _ in range(5)) == ["q0", "q2", "q4", "q6", "q8"]
    assert {s.data_source for s in dataset.samples} == {"nq"}


def test_without_data_path_the_file_comes_from_the_hub_dataset(ten_questions, monkeypatch):
    calls = []
    monkeypatch.setattr(
        huggingface_hub, "hf_hub_download", lambda *args, **kwargs: calls.append((args, kwargs)) or ten_questions
    )

    dataset = SearchR1Dataset(SearchR1DatasetConfig(filename="test.parquet"))

    assert calls == [(("PeterJinGo/nq_hotpotqa_train", "test.parquet"), {"repo_type": "dataset"})]
    assert dataset.path == ten_questions and len(dataset) == 10


def test_a_file_without_data_source_gives_samples_with_none(tmp_path):
    path = write_parquet(tmp_path / "plain.parquet", [{"question": "q", "golden_answers": ["a"]}])

    assert next(stream(path)) == SearchR1Sample(question="q", golden_answers=("a",), data_source=None)


@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_continues_the_exact_sequence_across_a_wrap(ten_questions, shuffle):
    uninterrupted = stream(ten_questions, seed=7, shuffle=shuffle)
    expected = questions(next(uninterrupted) for _ in range(30))

    interrupted = stream(ten_questions, seed=7, shuffle=shuffle)
    before = questions(next(interrupted) for _ in range(13))
    state = json.loads(json.dumps(interrupted.state_dict()))  # checkpoints store it as JSON or pickle
    resumed = stream(ten_questions, seed=7, shuffle=shuffle)
    resumed.load_state_dict(pickle.loads(pickle.dumps(state)))
    after = questions(next(resumed) for _ in range(17))

    assert before + after == expected


def test_resume_at_the_exact_end_of_an_epoch(ten_questions):
    uninterrupted = stream(ten_questions)
    expected = questions(next(uninterrupted) for _ in range(20))
    interrupted = stream(ten_questions)
    before = questions(next(interrupted) for _ in range(10))

    resumed = stream(ten_questions)
    resumed.load_state_dict(interrupted.state_dict())

    assert before + questions(next(resumed) for _ in range(10)) == expected


def test_loading_state_of_a_different_sized_stream_is_refused(ten_questions):
    state = stream(ten_questions).state_dict()

    with pytest.raises(ValueError, match=r"ten\.parquet: the saved stream state is for 10 samples, this dataset has 5"):
        stream(ten_questions, data_source="nq").load_state_dict(state)


def test_take_is_a_fixed_slice_that_does_not_move_the_stream(ten_questions):
    validation = stream(ten_questions, shuffle=False)

    assert questions(validation.take(3)) == ["q0", "q1", "q2"]
    assert questions(validation.take(3)) == ["q0", "q1", "q2"]
    assert questions(validation.take(50)) == [f"q{i}" for i in range(10)]  # at most one epoch
    assert next(validation).question == "q0"


def test_take_of_a_shuffled_stream_is_the_start_of_a_fresh_stream(ten_questions):
    dataset = stream(ten_questions, seed=5)
    for _ in range(4):
        next(dataset)

    fresh = stream(ten_questions, seed=5)
    assert dataset.take(6) == [next(fresh) for _ in range(6)]


@pytest.mark.parametrize(
    "stored, expected",
    [
        (np.array(["Paris", "City of Light"], dtype=object), ("Paris", "City of Light")),
        (["Paris"], ("Paris",)),
        ("Paris", ("Paris",)),
    ],
)
def test_golden_answers_become_a_tuple_of_strings(tmp_path, stored, expected):
    path = tmp_path / "answers.parquet"
    pd.DataFrame({"question": ["Capital of France?"], "golden_answers": pd.Series([stored], dtype=object)}).to_parquet(
        path
    )

    assert next(stream(str(path))).golden_answers == expected


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.parquet: no such file \(expected a parquet with columns question"):
        stream(str(tmp_path / "nope.parquet"))


def test_a_file_that_is_not_parquet_names_the_file(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text('{"question": "q", "golden_answers": ["a"]}\n')

    with pytest.raises(ValueError, match=r"questions\.jsonl: not a readable parquet file"):
        stream(str(path))


def test_missing_columns_are_named(tmp_path):
    path = write_parquet(tmp_path / "bad.parquet", [{"query": "q", "answer": "a"}])

    expected = r"bad\.parquet: missing column\(s\) question, golden_answers; found query, answer"
    with pytest.raises(ValueError, match=expected):
        stream(path)


def test_empty_file_is_refused(tmp_path):
    path = tmp_path / "empty.parquet"
    pd.DataFrame({"question": pd.Series([], dtype=str), "golden_answers": pd.Series([], dtype=object)}).to_parquet(path)

    with pytest.raises(ValueError, match=r"empty\.parquet: the file has no rows"):
        stream(str(path))


def test_empty_after_filtering_names_the_filter_and_what_exists(ten_questions):
    expected = r"ten\.parquet: empty after filtering: no row has data_source='triviaqa' \(found \['hotpotqa', 'nq'\]\)"
    with pytest.raises(ValueError, match=expected):
        stream(ten_questions, data_source="triviaqa")


def test_filtering_a_file_without_data_source_is_refused(tmp_path):
    path = write_parquet(tmp_path / "plain.parquet", [{"question": "q", "golden_answers": ["a"]}])

    with pytest.raises(ValueError, match=r"plain\.parquet: data_source='nq' asked for but the file has no data_source"):
        stream(path, data_source="nq")


@pytest.mark.parametrize(
    "row, problem",
    [
        ({"question": "q", "golden_answers": []}, r"row 0: golden_answers is empty"),
        ({"question": "q", "golden_answers": [1, 2]}, r"row 0: golden_answers must be a string or a list of strings"),
        ({"question": " ", "golden_answers": ["a"]}, r"row 0: question must be a non-empty string, got ' '"),
    ],
)
def test_bad_rows_name_the_file_the_row_and_the_problem(tmp_path, row, problem):
    path = write_parquet(tmp_path / "rows.parquet", [row])

    with pytest.raises(ValueError, match=r"rows\.parquet: " + problem):
        stream(path)


def test_the_real_offline_squad_questions_load(offline_assets):
    dataset = stream(offline_assets.test_questions, shuffle=False)

    first = next(dataset)
    assert len(dataset) > 10_000
    assert first == SearchR1Sample(
        question="Which NFL team represented the AFC at Super Bowl 50?",
        golden_answers=("Denver Broncos",),
        data_source="squad",
    )
    assert all(isinstance(a, str) for s in dataset.take(100) for a in s.golden_answers)
