"""The warm-start mix benchmark (experiments/warm_start_mix.py) splits scripted traces by which search found the
gold."""

import pytest

from experiments.warm_start_mix import mix


@pytest.mark.slow
def test_the_warm_start_mix_benchmark_splits_the_traces_by_what_found_the_gold(retriever_url, questions_file):
    rows = {topk: mix("offline_gpu", retriever_url, topk, num_traces=48, seed=0,
                      overrides=["--train_data_path", questions_file]) for topk in (1, 3)}
    for row in rows.values():
        assert row["traces"] == 48 and row["kept"] == round(48 * (1 - row["left_out"]))
        assert row["first_search_holds_gold"] + row["second_search_rescues"] + row["left_out"] == pytest.approx(1)
    # three passages hold the gold more often than one (here 0.79 against 0.62; the keyword query rescued 1 and 0 of
    # the misses: the headroom a better second query has)
    assert rows[3]["first_search_holds_gold"] > rows[1]["first_search_holds_gold"]
