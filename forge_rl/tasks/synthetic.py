"""Synthetic digit tasks that a tiny model learns from scratch in about a minute of RL on a CPU.

Each task maps a random draw to (prompt, answer); the reward checks the number the completion starts with.
Prompts are derived from (seed, index) alone, so the dataset cursor fully determines what comes
next: resuming at cursor k replays exactly the prompts an uninterrupted run would have seen.

    max_of_two   "M37=" -> "7"      (learns from scratch: from chance to most answers right in plain GRPO)
    copy_digit   "C5="  -> "5"
    add_mod10    "A37=" -> "0"      (needs a short supervised warm-up to leave chance level)
    repeat_digit "R8=" -> "888888888888" (the digit, REPEAT_LENGTHS[digit] times: answers of 1 to
                                      24 tokens, most short, a few long; scored by prefix_match)
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

SyntheticTaskName = Literal["max_of_two", "copy_digit", "add_mod10", "repeat_digit"]


@dataclass(frozen=True)
class Prompt:
    index: int
    """Position in the task's infinite, deterministic sequence (the dataset cursor)."""
    text: str
    answer: str


def _max_of_two(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"M{a}{b}=", str(max(a, b))


def _copy_digit(rng: random.Random) -> tuple[str, str]:
    a = rng.randrange(10)
    return f"C{a}=", str(a)


def _add_mod10(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"A{a}{b}=", str((a + b) % 10)


REPEAT_LENGTHS = (1, 1, 1, 2, 2, 3, 4, 6, 12, 24)
"""How many times repeat_digit's answer repeats each digit: a long tail of correct lengths (mean 5.6
tokens, the longest 24), so a batch of a few dozen prompts almost always holds a 24-token answer
while most of its answers are a few tokens long. That is the straggler case: a synchronous step
decodes as long as its longest completion; a generator that streams requests does not wait for it."""


def _repeat_digit(rng: random.Random) -> tuple[str, str]:
    a = rng.randrange(10)
    return f"R{a}=", str(a) * REPEAT_LENGTHS[a]


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "max_of_two": _max_of_two,
    "copy_digit": _copy_digit,
    "add_mod10": _add_mod10,
    "repeat_digit": _repeat_digit,
}


def make_prompt(task: str, seed: int, index: int) -> Prompt:
    """The index-th prompt of `task` under `seed` (independent of any other index)."""
    rng = random.Random(f"{task}:{seed}:{index}")
    text, answer = TASKS[task](rng)
    return Prompt(index=index, text=text, answer=answer)


def long_tail_length(seed: int, index: int, min_tokens: int, alpha: float, max_tokens: int) -> int:
    """A Pareto(alpha) completion length >= min_tokens, capped at max_tokens, for prompt `index`.

    Most draws are short and a few are orders of magnitude longer, as with reasoning traces: the
    regime where a synchronous step waits for its slowest completion.
    """
    rng = random.Random(f"length:{seed}:{index}")
    return min(max_tokens, int(min_tokens * rng.paretovariate(alpha)))


def leading_number_reward(completion_text: str, answer: str) -> float:
    """1.0 when the number the completion starts with is exactly the answer, else 0.0.

    Like answer extraction in GSM8K-style verifiers, what follows the answer is ignored ("7<eos>",
    "7=" and "7 " all score for answer "7"; "73" does not). A random model thus scores about
    1/vocab_size, which gives GRPO a signal from step one; exact match of the whole completion
    would need EOS too and start near 1/vocab_size**2.
    """
    match = _LEADING_NUMBER.match(completion_text)
    return 1.0 if match is not None and match.group(1) == answer else 0.0


def trailing_number_reward(completion_text: str, answer: str) -> float:
    """1.0 when the last number in the completion is exactly the answer, else 0.0: GSM8K-style
    final-answer extraction, where what comes before the answer is the model's own ("x=7" scores
    for answer "7"; "37" does not). With forced completion lengths (task.completion_lengths) the
    reward then depends on the completion's end: the workload of `forge-rl bench branches`."""
    numbers = _NUMBER.findall(completion_text)
    return 1.0 if numbers and numbers[-1] == answer else 0.0


def final_integer_reward(completion_text: str, answer: str) -> float:
    """1.0 when the last integer in the completion, with its sign, is exactly the answer, else 0.0:
    final-answer extraction for answers that may be negative ("0 - 4 = -4" and "it is -4" score
    for answer "-4"; "4" does not)."""
    numbers = _SIGNED_INTEGER.findall(completion_text)
    return 1.0 if numbers and numbers[-1] == answer.strip() else 0.0


def prefix_match_reward(completion_text: str, answer: str) -> float:
    """The share of the longer of completion and answer that their common prefix covers, in [0, 1]:
    1.0 for exactly the answer, partial credit for a completion that stops early or runs on ("8888"
    for answer "888888" scores 4/6, "88888888" scores 6/8). Surrounding whitespace is ignored. A
    reward that grows token by token, for answers whose length is part of being right
    (repeat_digit)."""
    text, answer = completion_text.strip(), answer.strip()
    longest = max(len(text), len(answer))
    if longest == 0:
        return 1.0
    shared = 0
    for a, b in zip(text, answer):
        if a != b:
            break
        shared += 1
    return shared / longest


_LEADING_NUMBER = re.compile(r"\s*(\d+)")
_NUMBER = re.compile(r"\d+")
_SIGNED_INTEGER = re.compile(r"-?\d+")
