"""reasoning-gym as a task source: procedural questions with their own verifiers, offline.

`reasoning-gym` (optional extra `.[tasks]`) generates each question of a dataset from
Random(seed + index), so prompt i depends only on (dataset, options, seed, i), as the synthetic
tasks do, and a resumed dataset cursor replays exactly. The answer handed to the scorer is not
the oracle string but a JSON key of the question; `reasoning_gym_reward` regenerates the entry
from it and calls the dataset's own `score_answer`, because several verifiers need the entry's
metadata (and some give partial credit, e.g. the oracle found inside a longer answer).

    task:
      name: reasoning_gym
      reasoning_gym_dataset: chain_sum
      reasoning_gym_options: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}
      reward: reasoning_gym
      prompt_format: chat        # an instruct model: the question as a user message

What the completion is scored on (`task.reasoning_gym_extract`):
- "tag_or_all": the text inside its last <answer>...</answer> tags when it writes them
  (reasoning-gym's convention), else the whole completion, stripped.
- "last_number": the last number in the completion, as GSM8K-style verifiers extract it: for
  numeric datasets and models too small to follow the tag format. SmolLM2-135M-Instruct answers
  "1 + 5 =" with "The answer is 6." and rarely tags anything; scored whole, that earns
  reasoning-gym's partial credit len("6") / len(completion), about 0.01 (docs/recipes.md).
"""

from __future__ import annotations

import functools
import json
import re

from forge_rl.errors import ConfigError
from forge_rl.tasks.synthetic import Prompt

INSTALL = 'pip install -e ".[tasks]"'
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(
            f"task.name 'reasoning_gym' needs the optional package reasoning-gym, which is not installed. "
            f"Install it with: {INSTALL}"
        ) from None
    return reasoning_gym


@functools.lru_cache(maxsize=16)
def _dataset(name: str, options_json: str, seed: int):
    """The dataset object (cheap to build; cached because the scorer regenerates entries per
    completion). Its size is only the bound of valid indices: entries are generated on access."""
    reasoning_gym = _reasoning_gym()
    options = json.loads(options_json)
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=2**62, **options)
    except (ValueError, AssertionError) as e:  # reasoning-gym validates its configs with asserts
        if "not registered" not in str(e):
            raise ConfigError(
                f"task.reasoning_gym_options {options} are invalid for dataset {name!r}: {e}. Fix "
                "--task.reasoning-gym-options."
            ) from None
        from reasoning_gym.factory import DATASETS

        raise ConfigError(
            f"task.reasoning_gym_dataset ({name!r}) is not a reasoning-gym dataset. Set "
            f"--task.reasoning-gym-dataset to one of: {', '.join(sorted(DATASETS))}."
        ) from None
    except TypeError as e:  # an option the dataset's config does not have
        raise ConfigError(
            f"task.reasoning_gym_options {options} do not fit dataset {name!r} ({e}). Use the fields of its "
            "config class (reasoning_gym/<category>/<dataset>.py)."
        ) from None


def check_dataset(name: str, options: dict, seed: int) -> None:
    """ConfigError naming the fix unless reasoning-gym is installed and builds `name` with `options`."""
    _dataset(name, json.dumps(options, sort_keys=True), seed)


def make_reasoning_gym_prompt(name: str, options: dict, seed: int, index: int, extract: str = "tag_or_all") -> Prompt:
    """The index-th question of dataset `name`; its answer is the key `reasoning_gym_reward` reads
    (which also says how to extract the completion's answer)."""
    options_json = json.dumps(options, sort_keys=True)
    entry = _dataset(name, options_json, seed)[index]
    key = json.dumps(
        {"dataset": name, "options": options, "seed": seed, "index": index, "extract": extract}, sort_keys=True
    )
    return Prompt(index=index, text=entry["question"], answer=key)


def reasoning_gym_row(name: str, options: dict, seed: int, index: int) -> tuple[str, str]:
    """The index-th question of dataset `name` with its answer as text (the dataset's oracle
    answer): what a file of its questions holds, for rewards that compare text (math_verify,
    exact_match) rather than the dataset's own verifier."""
    entry = _dataset(name, json.dumps(options, sort_keys=True), seed)[index]
    return entry["question"], str(entry["answer"])


def extract_answer(completion_text: str, extract: str = "tag_or_all") -> str:
    """tag_or_all: the last <answer>...</answer> span when there is one, else the whole completion,
    stripped. last_number: the last number in the completion ("" when there is none)."""
    if extract == "last_number":
        numbers = _NUMBER.findall(completion_text)
        return numbers[-1] if numbers else ""
    from reasoning_gym.utils import extract_answer as tagged

    answer = tagged(completion_text)
    return (completion_text if answer is None else answer).strip()


def reasoning_gym_reward(completion_text: str, answer: str) -> float:
    """The dataset's own verifier on the completion's answer, in [0, 1]. `answer` is the key
    written by `make_reasoning_gym_prompt` (JSON: dataset, options, seed, index)."""
    try:
        key = json.loads(answer)
        dataset = _dataset(key["dataset"], json.dumps(key["options"], sort_keys=True), key["seed"])
    except (json.JSONDecodeError, TypeError, KeyError):
        raise ValueError(
            f"the answer {answer[:80]!r} is not a reasoning-gym question key: task.reward 'reasoning_gym' scores "
            "only prompts of task.name 'reasoning_gym'."
        ) from None
    answer_text = extract_answer(completion_text, key.get("extract", "tag_or_all"))
    return float(dataset.score_answer(answer_text, dataset[key["index"]]))
