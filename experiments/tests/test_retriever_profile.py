"""The retriever profile's requests (experiments/retriever_profile.py) are full however many questions they need."""

import json

from experiments.retriever_profile import request_bodies


def test_requests_cycle_through_the_questions_when_they_need_more_than_there_are():
    bodies = [json.loads(b) for b in request_bodies(["q0", "q1", "q2", "q3", "q4"], 3, topk=2, repeats=4)]
    assert [b["queries"] for b in bodies] == [["q0", "q1", "q2"], ["q3", "q4", "q0"], ["q1", "q2", "q3"],
                                              ["q4", "q0", "q1"]]
    assert {b["topk"] for b in bodies} == {2}


def test_thirty_requests_of_512_from_squad_dev_are_all_full():
    # gpu_path.sh's `performance` step: SQuAD dev has 10,570 questions, 30 x 512 needs 15,360
    questions = [f"q{i}" for i in range(10_570)]
    assert all(len(json.loads(b)["queries"]) == 512 for b in request_bodies(questions, 512, topk=3, repeats=30))
