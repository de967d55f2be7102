"""Fake reward functions that read a data row's columns by name, for the tests of rewards over data
files (task.reward = "tests.support.row_rewards:fake_difficulty_reward")."""


def fake_difficulty_reward(completion_text: str, answer: str, difficulty) -> float:
    """The row's difficulty column as the reward; takes no other column, so a call that passed any
    (a wide row sent whole) raises TypeError."""
    return float(difficulty)


def fake_hint_reward(completion_text: str, answer: str, hint: str | None = None) -> float:
    """1.0 where the row has a hint column, else 0.0: an optional column."""
    return 0.0 if hint is None else 1.0


def fake_every_column_reward(completion_text: str, answer: str, **columns) -> float:
    """How many columns the row passed (every one, by name)."""
    return float(len(columns))


def fake_reward_raising_on_row(completion_text: str, answer: str, row_id: int) -> float:
    """1.0, except on the row whose row_id is 1, where it raises: a verifier bug on one row."""
    if row_id == 1:
        raise ValueError(f"no verdict for row {row_id}")
    return 1.0


def fake_positional_only_reward(completion_text, answer, difficulty, /) -> float:
    return 0.0


def exact_match(completion_text: str, answer: str) -> float:
    """A function of the built-in exact_match's name: the two share a metric name."""
    return 0.0
