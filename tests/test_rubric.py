"""EM rubric: normalisation, the final answer, every reward path, truncation, and the TRL reward signature."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from searchr1_trl.engine.rollout import RolloutStatus
from searchr1_trl.tasks.common.data import SearchR1Sample
from searchr1_trl.tasks.common.rubric import (
    RewardExactMatch,
    RewardExactMatchConfig,
    Rubric,
    final_answer,
    normalize_answer,
    token_f1,
)

QUESTION = {"role": "user", "content": "Where is the Eiffel Tower?"}


def search_call(query: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "search", "arguments": {"query": query}}}
    ]}


def search_result(text: str) -> dict:
    return {"role": "tool", "name": "search", "content": text}


def answer(text: str) -> dict:
    return {"role": "assistant", "content": text}


SEARCHED_THEN_PARIS = [
    QUESTION, search_call("Eiffel Tower location"), search_result("Doc 1(Title: Eiffel Tower) A tower in Paris."),
    answer("Paris"),
]
PARIS_FROM_MEMORY = [QUESTION, answer("Paris")]
SEARCHED_THEN_WRONG = [*SEARCHED_THEN_PARIS[:3], answer("Lyon")]
ENDED_ON_A_TOOL_CALL = [*SEARCHED_THEN_PARIS[:3], search_call("Paris")]

LEVERS = RewardExactMatchConfig(no_search_penalty=0.2, retrieval_score=0.1)


@pytest.mark.parametrize(
    "text, normalized",
    [
        ("The  Eiffel Tower!", "eiffel tower"),
        ("The  Eiffel-Tower!", "eiffeltower"),  # SQuAD deletes punctuation, it does not turn it into a space
        ("  an Apple a day ", "apple day"),
        ("Theatre", "theatre"),  # articles only as whole words
        ("U.S.A.", "usa"),
    ],
)
def test_normalize_answer_follows_squad(text, normalized):
    assert normalize_answer(text) == normalized


def test_final_answer_is_the_last_assistant_content_stripped():
    assert final_answer(SEARCHED_THEN_PARIS) == "Paris"
    assert final_answer([QUESTION, answer("  Paris \n")]) == "Paris"


@pytest.mark.parametrize(
    "messages",
    [ENDED_ON_A_TOOL_CALL, [QUESTION, answer("   ")], [QUESTION, {"role": "assistant", "content": None}], [QUESTION]],
    ids=["ended on a tool call", "blank content", "no content", "no assistant turn"],
)
def test_there_is_no_final_answer(messages):
    assert final_answer(messages) is None


def test_default_is_pure_exact_match():
    reward = RewardExactMatch()

    assert reward.score(SEARCHED_THEN_PARIS, ["Paris"]) == 1.0
    assert reward.score(PARIS_FROM_MEMORY, ["Paris"]) == 1.0
    assert reward.score(SEARCHED_THEN_WRONG, ["Paris"]) == 0.0


def test_correct_after_searching_earns_the_full_score():
    assert RewardExactMatch(LEVERS).score(SEARCHED_THEN_PARIS, ["paris", "City of Light"]) == 1.0


def test_correct_without_any_search_pays_the_no_search_penalty():
    assert RewardExactMatch(LEVERS).score(PARIS_FROM_MEMORY, ["Paris"]) == pytest.approx(0.8)


def test_wrong_but_retrieved_earns_the_retrieval_score():
    assert RewardExactMatch(LEVERS).score(SEARCHED_THEN_WRONG, ["Paris"]) == 0.1


def test_no_answer_but_retrieved_earns_the_retrieval_score():
    assert RewardExactMatch(LEVERS).score(ENDED_ON_A_TOOL_CALL, ["Paris"]) == 0.1


def test_ended_on_a_tool_call_scores_zero_by_default():
    assert RewardExactMatch().score(ENDED_ON_A_TOOL_CALL, ["Paris"]) == 0.0


def test_wrong_and_not_retrieved_scores_zero():
    assert RewardExactMatch(LEVERS).score(SEARCHED_THEN_WRONG, ["Marseille"]) == 0.0


def test_answers_match_after_normalisation():
    messages = [QUESTION, answer("The  Eiffel tower!")]

    assert RewardExactMatch().score(messages, ["eiffel tower"]) == 1.0
    assert RewardExactMatch().score(messages, ["Tower"]) == 0.0  # exact, not contained


def test_retrieval_matches_whole_words_only():
    retrieved = [*SEARCHED_THEN_PARIS[:2], search_result("Doc 1(Title: Tennis) Tennis is played with rackets."),
                 answer("nine")]

    assert RewardExactMatch(LEVERS).score(retrieved, ["ten"]) == 0.0
    assert RewardExactMatch(LEVERS).score(retrieved, ["Rackets!"]) == 0.1


def test_a_golden_answer_that_normalises_to_nothing_matches_nothing():
    messages = [QUESTION, answer("The"), search_result("a b c")]

    assert RewardExactMatch(LEVERS).score(messages, ["the"]) == 0.0


def rollout(messages, status=RolloutStatus.DONE, golden_answers=("Paris",)):
    return SimpleNamespace(
        sample=SearchR1Sample(question="Where is the Eiffel Tower?", golden_answers=golden_answers),
        messages=messages, status=status,
    )


def test_rubric_scores_a_rollout_with_exact_match_by_default():
    assert Rubric().score(rollout(SEARCHED_THEN_PARIS)) == 1.0
    assert Rubric().score(rollout(SEARCHED_THEN_WRONG)) == 0.0


@pytest.mark.parametrize(
    "status", [RolloutStatus.TRUNCATED_MAX_TURNS, RolloutStatus.TRUNCATED_PROMPT_TOO_LONG,
               RolloutStatus.TRUNCATED_LENGTH],
)
def test_a_truncated_rollout_gets_the_truncation_reward(status):
    rubric = Rubric([RewardExactMatch(LEVERS)], truncation_reward=-0.5)

    assert rubric.score(rollout(SEARCHED_THEN_PARIS, status)) == -0.5
    assert Rubric().score(rollout(ENDED_ON_A_TOOL_CALL, status)) == 0.0


def test_an_errored_rollout_is_scored_on_its_messages():
    assert Rubric().score(rollout(SEARCHED_THEN_PARIS, RolloutStatus.ERROR_TIMEOUT)) == 1.0


def test_a_rollout_the_retriever_did_not_answer_gets_no_reward_so_trl_gives_it_no_advantage():
    rubric = Rubric([RewardExactMatch(LEVERS)], truncation_reward=-0.5)
    metrics = {}

    rewards = rubric([None] * 2, [None] * 2, log_metric=metrics.__setitem__,
                     rollout=[rollout(SEARCHED_THEN_PARIS, "error_tool"), rollout(SEARCHED_THEN_PARIS)])

    assert rewards == [None, 1.0] and metrics["rubric/unscored_tool_failures"] == 0.5


def test_rubric_sums_weighted_reward_functions():
    def says_paris(prompts, completions, *, messages, golden_answers, status=None, **kwargs):
        return [float("paris" in (final_answer(m) or "").lower()) for m in messages]

    rubric = Rubric([RewardExactMatch(RewardExactMatchConfig(weight=0.5)), says_paris])

    assert rubric.score(rollout(SEARCHED_THEN_PARIS)) == 1.5
    assert rubric.score(rollout(PARIS_FROM_MEMORY, golden_answers=("France",))) == 1.0


def test_reward_exact_match_is_a_trl_reward_function():
    reward = RewardExactMatch(LEVERS)

    rewards = reward(
        prompts=[[QUESTION]] * 3, completions=[[{"role": "assistant", "content": "..."}]] * 3,
        completion_ids=[[1], [2], [3]], trainer_state=None,  # TRL passes these and every dataset column too
        messages=[SEARCHED_THEN_PARIS, PARIS_FROM_MEMORY, SEARCHED_THEN_WRONG],
        golden_answers=[["Paris"], ("Paris",), ["Paris"]], status=["done", "done", "done"], num_tool_calls=[1, 0, 1],
    )

    assert rewards == pytest.approx([1.0, 0.8, 0.1])
    assert reward.__name__ == "exact_match"


def test_rubric_is_a_trl_reward_function_that_logs_its_parts():
    logged = []
    rubric = Rubric([RewardExactMatch(LEVERS)], truncation_reward=0.0)

    rewards = rubric(
        prompts=[None] * 4, completions=[None] * 4, completion_ids=[[1], [2], [3], [4]],
        rollout=[rollout(SEARCHED_THEN_PARIS), rollout(SEARCHED_THEN_PARIS, RolloutStatus.TRUNCATED_LENGTH),
                 rollout(PARIS_FROM_MEMORY), rollout(SEARCHED_THEN_WRONG)],
        log_metric=lambda name, value: logged.append((name, value)),
    )

    assert rewards == pytest.approx([1.0, 0.0, 0.8, 0.1])
    # correct: plain EM of the final answers, whatever the levers and the truncation make of them
    assert logged == [("rubric/correct", pytest.approx(3 / 4)), ("rubric/exact_match", pytest.approx(2.9 / 4)),
                      ("rubric/truncated", pytest.approx(1 / 4)), ("rubric/unscored_tool_failures", 0.0)]
    assert rubric.__name__ == "rubric"


def test_the_rubric_scores_each_rollout_from_its_own_sample_not_from_trl_columns():
    # TRL also passes every row column and extra field; a golden_answers column out of step with the rollouts (a
    # reordered batch) must not decide the reward.
    rewards = Rubric()(prompts=[None] * 2, completions=[None] * 2, golden_answers=[["Lyon"], ["Paris"]],
                       messages=[SEARCHED_THEN_WRONG, SEARCHED_THEN_PARIS], status=["done", "done"],
                       rollout=[rollout(SEARCHED_THEN_PARIS), rollout(SEARCHED_THEN_WRONG)])

    assert rewards == [1.0, 0.0]


def test_token_f1_follows_squad():
    assert token_f1("denver broncos team", "denver broncos") == pytest.approx(0.8)
    assert token_f1("carolina panthers", "denver broncos") == 0.0


def test_a_near_miss_earns_answer_f1_in_proportion_to_its_overlap():
    near_miss = [*SEARCHED_THEN_PARIS[:3], answer("the Denver Broncos team")]
    config = RewardExactMatchConfig(answer_f1=0.5)

    assert RewardExactMatch(config).score(near_miss, ["Denver Broncos", "Broncos"]) == pytest.approx(0.5 * 0.8)
    assert RewardExactMatch(config).score(SEARCHED_THEN_WRONG, ["Paris"]) == 0.0  # "Lyon" shares nothing
    assert RewardExactMatch().score(near_miss, ["Denver Broncos"]) == 0.0  # off by default


def test_answer_f1_pays_nothing_for_ending_without_an_answer_and_retrieval_credit_takes_the_larger():
    both = RewardExactMatchConfig(answer_f1=0.5, retrieval_score=0.1)
    partly_right = [*SEARCHED_THEN_PARIS[:3], answer("Paris Texas")]

    assert RewardExactMatch(RewardExactMatchConfig(answer_f1=0.5)).score(ENDED_ON_A_TOOL_CALL, ["Paris"]) == 0.0
    assert RewardExactMatch(both).score(ENDED_ON_A_TOOL_CALL, ["Paris"]) == 0.1
    assert RewardExactMatch(both).score(partly_right, ["Paris"]) == pytest.approx(0.5 * 2 / 3)
