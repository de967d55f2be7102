"""Reward functions that misbehave on cue, for the scorer's fault tests (task.reward = "tests.support.faulty_rewards:scripted")."""

import os
import time
from pathlib import Path

HANG_TIMEOUT_S = 5.0
"""scorer.reward_timeout_s of the tests that wait for a hung reward: what the hang costs them. Every
other reward here returns in microseconds, far from it even on a loaded host (the pool starts the
clock once the worker has reported ready, so its start-up is not counted)."""

MEET_TIMEOUT_S = 60.0
"""How long "meet" waits for the other worker: bounds a hang, never reached when workers overlap."""


def scripted(completion_text: str, answer: str) -> float:
    """Behaves as the completion text says: raise, hang, nan, exit, spin, meet; anything else scores 1.0.

    "spin" and "meet" read the answer as a directory: "spin" marks `answer/spinning` and then hangs;
    "meet" waits until two "meet" calls (two workers) are inside it at once (a barrier through the
    directory), so it scores only if the pool runs them in parallel.
    """
    if completion_text == "raise":
        raise ValueError("verifier bug on purpose")
    if completion_text == "hang":
        while True:  # a pure-Python loop: no thread can interrupt it
            pass
    if completion_text == "nan":
        return float("nan")
    if completion_text == "exit":
        os._exit(3)
    if completion_text == "spin":
        (Path(answer) / "spinning").touch()
        while True:
            pass
    if completion_text == "meet":
        return _meet(Path(answer), parties=2)
    return 1.0


def _meet(directory: Path, parties: int) -> float:
    (directory / f"arrived-{os.getpid()}").touch()
    deadline = time.monotonic() + MEET_TIMEOUT_S
    while len(list(directory.glob("arrived-*"))) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no other worker arrived in {MEET_TIMEOUT_S} s: rewards ran one at a time")
        time.sleep(0.01)
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
