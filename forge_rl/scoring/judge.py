"""LLM-as-judge: a language model reads completions through a prompt template and answers with
a verdict, which a parser turns into rewards. Two modes (`JudgeConfig.mode`):

grade (default): each completion on its own, one verdict each.
    template.format(prompt=..., completion=..., answer=...)   what the judge reads
    judge model (a vLLM engine on its own generator mesh)   samples its verdict text
    parse_verdict(text)                                      the last "Score: N" in it, N in
                                                             [score_min, score_max] -> reward in [0, 1]
rank: the whole group of one prompt at once, one verdict per group. GRPO normalizes rewards within
a group, so the order of the group is all it needs, and a judge compares answers side by side more
reliably than it grades one on an absolute scale.
    rank_template.format(prompt=..., answer=..., completions="[1] ...\n[2] ...")
    parse_ranking(text, n)                                   the last "Ranking: 3 > 1 > 2" in it, a
                                                             permutation of 1..n, best first ->
                                                             rewards evenly spaced from 1 (best) to 0

A judge fails like a model: it rambles, answers in another format, or is slow. A verdict the parser
cannot read (no score, or one out of range) and a judge call past `timeout_s` each fail that
completion only (`forge_rl.scoring.scorers.JudgeScorer` returns a `ScoreFailure`, kinds "unparsable
verdict" and "timeout"): it is ERRORED, never
trained, its reward kept out of its group's statistics, and counted (`scorer/judge/unparsable`,
`scorer/judge/timed_out`, `scorer/errored`). The run never stops for a verdict.

The judge model is served by the same GeneratorActor (`forge_rl.actors.generator`) as the policy,
on a process of its own, with the judge's directory and sampling settings and no weight store (its
weights never change). `judge_client` adapts that actor's `generate` endpoint to "prompt text in,
verdict text out". Plain Python: no Monarch here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from forge_rl.engines.config import GeneratorConfig
from forge_rl.types import Completion, Episode

DEFAULT_TEMPLATE = (
    "You grade answers to a question.\n"
    "Question: {prompt}\n"
    "Reference answer: {answer}\n"
    "Answer to grade: {completion}\n"
    "How correct is the answer to grade, from 0 (wrong) to 10 (correct)? "
    "End your reply with a line 'Score: N'."
)
"""Placeholders: {prompt} (the episode's prompt text), {completion} (the completion's text),
{answer} (the task's reference answer, empty when the task has none)."""

DEFAULT_VERDICT_PATTERN = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
"""'Score: 7', 'score=7.5', 'SCORE : 10'; the last match in the verdict counts (a judge that
reasons first often quotes the scale before its own score)."""

DEFAULT_RANK_TEMPLATE = (
    "You compare answers to a question.\n"
    "Question: {prompt}\n"
    "Reference answer: {answer}\n"
    "Answers:\n{completions}\n"
    "Order the answers from the most correct to the least correct. "
    "End your reply with a line 'Ranking: ' and the answers' numbers, best first, separated by '>' "
    "(for example 'Ranking: 2 > 1 > 3')."
)
"""Placeholders: {prompt}, {answer} (as in the grade template), {completions} (every completion of
the group, numbered from 1: "[1] text" per line)."""

DEFAULT_RANKING_PATTERN = r"(?i)ranking\s*[:=]\s*(\d+(?:\s*>\s*\d+)*)"
"""'Ranking: 2 > 1 > 3'; the last match counts. Its first group holds the numbers, best first."""


@dataclass(frozen=True)
class JudgeConfig:
    path: Path | None = None
    """HF model directory of the judge (config.json, safetensors weights, tokenizer files); unset:
    no judge runs. Its tokenizer is its own (the judge reads text, not the policy's token ids)."""
    weight: float = 1.0
    """Weight of the judge's reward (in [0, 1]) in the run's reward."""
    mode: Literal["grade", "rank"] = "grade"
    """grade: one verdict per completion, a score on a scale (template, verdict_pattern); rank: one
    verdict per group, the group's completions ordered best first (rank_template, ranking_pattern),
    rewards evenly spaced from 1 (best) to 0 (worst)."""
    template: str = DEFAULT_TEMPLATE
    """What the judge reads for one completion (mode grade); placeholders {prompt}, {completion}, {answer}."""
    rank_template: str = DEFAULT_RANK_TEMPLATE
    """What the judge reads for one group (mode rank); placeholders {prompt}, {answer}, {completions}."""
    ranking_pattern: str = DEFAULT_RANKING_PATTERN
    """Regular expression (mode rank) whose first group holds the completions' numbers, best first,
    separated by anything but digits; its last match in the verdict counts."""
    prompt_format: Literal["chat", "plain"] = "chat"
    """chat: the rendered template is the user turn of the judge's chat template (an instruct
    model); plain: the judge reads it as is, after its bos token."""
    verdict_pattern: str = DEFAULT_VERDICT_PATTERN
    """Regular expression (mode grade) whose first group is the score; its last match in the verdict counts."""
    score_min: float = 0.0
    """Lowest score the template asks for (reward 0)."""
    score_max: float = 10.0
    """Highest score the template asks for (reward 1); a score outside [score_min, score_max] is unparsable."""
    timeout_s: float = 60.0
    """Seconds one verdict may take; past it the completion (mode rank: the group) is ERRORED (kind
    "timeout") and counted."""
    generator: GeneratorConfig = field(default_factory=lambda: GeneratorConfig(max_new_tokens=64, temperature=0.3))
    """How the judge's engine samples its verdicts (max_new_tokens bounds a verdict's length)."""
    max_model_len: int = 2048
    """The judge engine's context: the rendered template plus generator.max_new_tokens must fit."""
    replicas: int = 1
    """Judge engines, one process each; each verdict request goes to the one with the fewest in
    flight (`LeastBusyReplica`, `forge_rl.actors.reward_model`). Each engine is a whole copy of the
    judge with generator.cpu_threads threads (preflight counts them all)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"scorer.judge.weight ({self.weight}) must be finite and > 0. Set --scorer.judge.weight.")
        if self.replicas < 1:
            raise ValueError(f"scorer.judge.replicas ({self.replicas}) must be >= 1. Set --scorer.judge.replicas.")
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(
                f"scorer.judge.timeout_s ({self.timeout_s}) must be > 0 and finite. Set --scorer.judge.timeout-s."
            )
        if not self.score_min < self.score_max:
            raise ValueError(
                f"scorer.judge.score_min ({self.score_min}) must be below score_max ({self.score_max}). "
                "Set --scorer.judge.score-min and --scorer.judge.score-max to the scale the template asks for."
            )
        for flag, pattern in (("verdict_pattern", self.verdict_pattern), ("ranking_pattern", self.ranking_pattern)):
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                raise ValueError(f"scorer.judge.{flag} ({pattern!r}) is not a regular expression: {e}") from None
            if compiled.groups < 1:
                raise ValueError(
                    f"scorer.judge.{flag} ({pattern!r}) has no group: its first group must capture the "
                    + (
                        r"score, e.g. 'Score: (\d+)'."
                        if flag == "verdict_pattern"
                        else r"ranking, e.g. 'Ranking: ([\d >]+)'."
                    )
                )
        _check_template("template", self.template, ("prompt", "completion", "answer"))
        _check_template("rank_template", self.rank_template, ("prompt", "completions", "answer"))


def _check_template(flag: str, template: str, placeholders: tuple[str, ...]) -> None:
    try:
        template.format(**{name: "" for name in placeholders})
    except (KeyError, IndexError, ValueError) as e:
        named = ", ".join(f"{{{name}}}" for name in placeholders)
        raise ValueError(
            f"scorer.judge.{flag} has a placeholder other than {named} "
            f"({type(e).__name__}: {e}); write literal braces as {{{{ and }}}}."
        ) from None
    graded = placeholders[1]
    if f"{{{graded}}}" not in template:
        raise ValueError(f"scorer.judge.{flag} lacks {{{graded}}}: the judge would never see what it grades.")


def render_judge_prompt(template: str, episode: Episode, completion: Completion) -> str:
    return template.format(prompt=episode.prompt_text, completion=completion.text, answer=episode.answer)


def parse_verdict(text: str, pattern: str, score_min: float, score_max: float) -> float | None:
    """The reward in [0, 1] of the last score `pattern` finds in `text`, scaled from
    [score_min, score_max]; None when there is none, or it is out of range or not a number."""
    matches = re.findall(pattern, text)
    if not matches:
        return None
    last = matches[-1]
    try:
        score = float(last[0] if isinstance(last, tuple) else last)
    except ValueError:
        return None
    if not (math.isfinite(score) and score_min <= score <= score_max):
        return None
    return (score - score_min) / (score_max - score_min)


def render_rank_prompt(template: str, episode: Episode) -> str:
    numbered = "\n".join(f"[{i}] {c.text}" for i, c in enumerate(episode.completions, start=1))
    return template.format(prompt=episode.prompt_text, completions=numbered, answer=episode.answer)


def parse_ranking(text: str, pattern: str, num_completions: int) -> list[float] | None:
    """Per completion (in the group's order), its reward from the last ranking `pattern` finds in
    `text`: numbers 1..num_completions, best first, each exactly once; the best gets 1, the worst
    0, the rest evenly between. None when there is no ranking, or it is not such a permutation (a
    number missing, repeated or out of range: a judge that ranks half the group has not ranked it)."""
    matches = re.findall(pattern, text)
    if not matches or num_completions < 2:  # GRPO's groups have two or more (config.py checks it)
        return None
    last = matches[-1]
    order = [int(n) for n in re.findall(r"\d+", last[0] if isinstance(last, tuple) else last)]
    if sorted(order) != list(range(1, num_completions + 1)):
        return None
    rewards = [0.0] * num_completions
    for position, number in enumerate(order):
        rewards[number - 1] = (num_completions - 1 - position) / (num_completions - 1)
    return rewards


def judge_client(
    tokenizer, prompt_format: str, generate: Callable[[list[Episode], int], Awaitable[list[Episode]]]
) -> Callable[[str], Awaitable[str]]:
    """ "Prompt text in, verdict text out" over a generator's `generate(episodes, group_size)`
    (GeneratorActor.generate: episodes whose first completion's text is the verdict). `tokenizer`:
    the judge's PromptTokenizer (`forge_rl.tasks.tokenizer`)."""

    async def verdict(prompt: str) -> str:
        if prompt_format == "chat":
            token_ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        else:
            token_ids = tokenizer.encode_prompt(prompt)
        (judged,) = await generate([Episode(-1, prompt, "", token_ids)], 1)
        return judged.completions[0].text

    return verdict
