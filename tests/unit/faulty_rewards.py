"""Reward functions that misbehave on cue, for the scorer's fault tests (task.reward = "tests.unit.faulty_rewards:scripted")."""

import os
import time


def scripted(completion_text: str, answer: str) -> float:
    """Behaves as the completion text says: raise, hang, nan, exit, slow; anything else scores 1.0."""
    if completion_text == "raise":
        raise ValueError("verifier bug on purpose")
    if completion_text == "hang":
        while True:  # a pure-Python loop: no thread can interrupt it
            pass
    if completion_text == "nan":
        return float("nan")
    if completion_text == "exit":
        os._exit(3)
    if completion_text == "slow":
        time.sleep(0.2)
    return 1.0


def one_argument(completion_text: str) -> float:
    return 0.0


def flaky_leading_number(completion_text: str, answer: str) -> float:
    """The task's reward, except that completions starting with A-F raise and with Z hang."""
    from forge_rl.tasks.synthetic import leading_number_reward

    if completion_text[:1] == "Z":
        while True:
            pass
    if completion_text[:1] in "ABCDEF" and completion_text:
        raise KeyError(completion_text)
    return leading_number_reward(completion_text, answer)
