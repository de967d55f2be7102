"""Hands out prompts as Episode shells (no completions yet), tokenized, with a resumable cursor.

Prompt i is a function of (task, seed, i) (forge_rl/tasks), so prompts are built where they are
used: in the rollouts' process (forge_rl/pipeline/rollouts.py), with no message per prompt. After a resume, the prompts a checkpoint left unsettled (forge_rl/core/checkpoint.py) are handed out
again first, under their own index, then the cursor continues where it stopped.
"""

from __future__ import annotations

import collections
from pathlib import Path

from forge_rl.tasks import TaskConfig, encode_task_prompt, make_task_prompt
from forge_rl.tasks.synthetic import long_tail_length
from forge_rl.tasks.tokenizer import PromptTokenizer
from forge_rl.types import Episode


class PromptSource:
    def __init__(self, task: TaskConfig, model_dir: str, max_new_tokens: int):
        self.task = task
        self.max_new_tokens = max_new_tokens
        self.tokenizer = PromptTokenizer(Path(model_dir))
        self.cursor = 0
        """Index of the next new prompt; episode ids are prompt indices, so a prompt is counted by its id."""
        self.reissue: collections.deque[int] = collections.deque()
        """Indices below the cursor to hand out again before new ones (set by a resume)."""

    def next_episodes(self, num_prompts: int) -> list[Episode]:
        episodes = []
        for _ in range(num_prompts):
            if self.reissue:
                index = self.reissue.popleft()
            else:
                index, self.cursor = self.cursor, self.cursor + 1
            prompt = make_task_prompt(self.task, index)
            episodes.append(
                Episode(
                    episode_id=index,
                    prompt_text=prompt.text,
                    answer=prompt.answer,
                    prompt_token_ids=encode_task_prompt(self.task, self.tokenizer, prompt.text),
                    forced_length=self._forced_length(index),
                )
            )
        return episodes

    def _forced_length(self, index: int) -> int | None:
        if self.task.completion_lengths == "natural":
            return None
        return long_tail_length(
            self.task.seed, index, self.task.long_tail_min_tokens, self.task.long_tail_alpha, self.max_new_tokens
        )

    def state(self) -> dict:
        return {"cursor": self.cursor, "reissue": list(self.reissue)}

    def load_state(self, cursor: int, reissue: list[int]) -> None:
        self.cursor = cursor
        self.reissue = collections.deque(reissue)
