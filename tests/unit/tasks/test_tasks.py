import importlib.util

import pytest

from forge_rl.tasks.synthetic import (
    REPEAT_LENGTHS,
    TASKS,
    leading_number_reward,
    make_prompt,
    prefix_match_reward,
    trailing_number_reward,
)


def test_prompts_depend_only_on_task_seed_and_index():
    assert make_prompt("max_of_two", 0, 7) == make_prompt("max_of_two", 0, 7)
    assert [make_prompt("max_of_two", 0, i) for i in range(20)] != [make_prompt("max_of_two", 1, i) for i in range(20)]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_task_answer_is_what_its_verifier_rewards(task):
    prompt = make_prompt(task, seed=3, index=11)
    assert leading_number_reward(prompt.answer, prompt.answer) == 1.0


def test_max_of_two_answers_the_larger_digit():
    prompt = make_prompt("max_of_two", 0, 0)
    a, b = int(prompt.text[1]), int(prompt.text[2])
    assert prompt.answer == str(max(a, b))


@pytest.mark.parametrize(
    "completion,reward", [("7", 1.0), ("7=", 1.0), (" 7 ", 1.0), ("73", 0.0), ("x7", 0.0), ("", 0.0), ("1", 0.0)]
)
def test_the_reward_reads_the_leading_number(completion, reward):
    assert leading_number_reward(completion, "7") == reward


@pytest.mark.parametrize(
    ("completion", "reward"),
    [("x=7", 1.0), ("3 then 7", 1.0), ("7x", 1.0), ("37", 0.0), ("7 then 3", 0.0), ("none", 0.0)],
)
def test_the_trailing_reward_reads_the_last_number(completion, reward):
    assert trailing_number_reward(completion, "7") == reward


def test_repeat_digit_answers_its_digit_as_often_as_the_digits_length_says():
    prompts = [make_prompt("repeat_digit", 0, i) for i in range(200)]
    for prompt in prompts:
        digit = prompt.text[1]
        assert prompt.text == f"R{digit}=" and prompt.answer == digit * REPEAT_LENGTHS[int(digit)]
    lengths = sorted(len(p.answer) for p in prompts)
    assert lengths[len(lengths) // 2] <= 3 and lengths[-1] == 24  # most answers short, the longest 24 tokens


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("888888", 1.0),
        (" 888888 ", 1.0),
        ("8888", 4 / 6),
        ("88888888", 6 / 8),
        ("888188", 3 / 6),
        ("", 0.0),
        ("1", 0.0),
    ],
)
def test_the_prefix_match_reward_is_the_share_of_the_longer_text_the_common_prefix_covers(completion, reward):
    assert prefix_match_reward(completion, "888888") == pytest.approx(reward)
    assert prefix_match_reward("", "") == 1.0


# reasoning-gym as a task source (optional extra .[tasks]).
from forge_rl.errors import ConfigError  # noqa: E402
from forge_rl.tasks import TaskConfig, make_task_prompt  # noqa: E402
from forge_rl.tasks.rewards import resolve_reward_fn  # noqa: E402

needs_reasoning_gym = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None,
    reason='reasoning-gym is not installed (pip install -e ".[tasks]")',
)
CHAIN_SUM = dict(
    name="reasoning_gym",
    reward="reasoning_gym",
    reasoning_gym_dataset="chain_sum",
    reasoning_gym_options={"min_terms": 2, "max_terms": 2, "max_digits": 1},
)


@needs_reasoning_gym
def test_reasoning_gym_prompts_are_deterministic_and_scored_by_the_datasets_verifier():
    import reasoning_gym

    task = TaskConfig(**CHAIN_SUM)
    prompt = make_task_prompt(task, 5)
    assert prompt == make_task_prompt(task, 5) and prompt != make_task_prompt(task, 6)
    entry = reasoning_gym.create_dataset("chain_sum", seed=0, size=10, **CHAIN_SUM["reasoning_gym_options"])[5]
    assert prompt.text == entry["question"]
    reward = resolve_reward_fn(task.reward)
    assert reward(f" {entry['answer']}\n", prompt.answer) == 1.0
    assert reward(f"I think <answer>{entry['answer']}</answer>", prompt.answer) == 1.0
    assert reward("no idea", prompt.answer) == 0.0
    # reasoning-gym's partial credit: the oracle inside a longer answer scores len(oracle)/len(answer).
    assert 0 < reward(f"= {entry['answer']}", prompt.answer) < 1


@needs_reasoning_gym
@pytest.mark.parametrize(
    "changes, message",
    [
        ({"reasoning_gym_dataset": "gsm8k_typo"}, r"\('gsm8k_typo'\) is not a reasoning-gym dataset.*chain_sum"),
        ({"reasoning_gym_options": {"bogus": 1}}, r"\{'bogus': 1\} do not fit dataset 'chain_sum'"),
        ({"reasoning_gym_options": {"min_terms": 5, "max_terms": 2}}, r"invalid for dataset 'chain_sum'.*max_terms"),
    ],
)
def test_bad_reasoning_gym_settings_fail_naming_the_flag(changes, message):
    with pytest.raises(ConfigError, match=message):
        TaskConfig(**{**CHAIN_SUM, **changes})


@pytest.mark.parametrize("changes", [{"reward": "leading_number"}, {"name": "max_of_two"}])
def test_reasoning_gym_task_and_reward_go_together(changes):
    with pytest.raises(ConfigError, match="Set both --task.name and --task.reward to reasoning_gym"):
        TaskConfig(**{**CHAIN_SUM, **changes})


@needs_reasoning_gym
def test_the_reasoning_gym_reward_refuses_an_answer_that_is_not_a_question_key():
    with pytest.raises(ValueError, match="not a reasoning-gym question key"):
        resolve_reward_fn("reasoning_gym")("7", "7")


@needs_reasoning_gym
def test_last_number_extraction_scores_the_last_number_of_a_wordy_answer():
    task = TaskConfig(**CHAIN_SUM, reasoning_gym_extract="last_number")
    prompt = make_task_prompt(task, 5)
    oracle = eval(prompt.text.rsplit(":", 1)[1].strip(" ="))  # "5 - 9" -> -4
    reward = resolve_reward_fn(task.reward)
    assert reward(f"The answer to this problem is {oracle}.", prompt.answer) == 1.0
    assert reward(f"It is {oracle + 1}, not {oracle}... no: {oracle + 1}", prompt.answer) == 0.0
    assert reward("no number here", prompt.answer) == 0.0
    # The same wording under the default extraction earns only reasoning-gym's partial credit.
    whole = make_task_prompt(TaskConfig(**CHAIN_SUM), 5)
    assert reward(f"The answer to this problem is {oracle}.", whole.answer) < 0.1


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("0 - 4 = -4", "-4", 1.0),
        ("it is -4.", "-4", 1.0),
        ("4", "-4", 0.0),
        ("-4 then 3", "-4", 0.0),
        ("7", " 7 ", 1.0),
        ("none", "7", 0.0),
    ],
)
def test_the_final_integer_reward_reads_the_last_integer_with_its_sign(completion, answer, reward):
    from forge_rl.tasks.synthetic import final_integer_reward

    assert final_integer_reward(completion, answer) == reward
