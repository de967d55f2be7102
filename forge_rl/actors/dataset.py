"""Hands out prompts as Episode shells (no completions yet), tokenized, with a resumable cursor."""

from __future__ import annotations

from pathlib import Path

from monarch.actor import Actor, endpoint

from forge_rl.config import TaskConfig
from forge_rl.tasks.synthetic import long_tail_length, make_prompt
from forge_rl.tasks.tokenizer import PromptTokenizer
from forge_rl.types import Episode


class DatasetActor(Actor):
    def __init__(self, task: TaskConfig, model_dir: str, max_new_tokens: int):
        self.task = task
        self.max_new_tokens = max_new_tokens
        self.tokenizer = PromptTokenizer(Path(model_dir))
        self.cursor = 0
        """Index of the next prompt; episode ids are cursor positions, so they never repeat."""

    @endpoint
    async def next_episodes(self, num_prompts: int) -> list[Episode]:
        episodes = []
        for _ in range(num_prompts):
            prompt = make_prompt(self.task.name, self.task.seed, self.cursor)
            episodes.append(
                Episode(
                    episode_id=self.cursor,
                    prompt_text=prompt.text,
                    answer=prompt.answer,
                    prompt_token_ids=self.tokenizer.encode_prompt(prompt.text),
                    forced_length=self._forced_length(self.cursor),
                )
            )
            self.cursor += 1
        return episodes

    def _forced_length(self, index: int) -> int | None:
        if self.task.completion_lengths == "natural":
            return None
        return long_tail_length(
            self.task.seed, index, self.task.long_tail_min_tokens, self.task.long_tail_alpha, self.max_new_tokens
        )

    @endpoint
    async def state(self) -> dict:
        return {"cursor": self.cursor}
