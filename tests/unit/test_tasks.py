import pytest

from forge_rl.tasks.synthetic import TASKS, leading_number_reward, make_prompt


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
