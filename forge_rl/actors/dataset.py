"""Hands out prompts as Episode shells (no completions yet), tokenized, with a resumable cursor."""

from __future__ import annotations

from pathlib import Path

from monarch.actor import Actor, endpoint

from forge_rl.tasks.synthetic import make_prompt
from forge_rl.tasks.tokenizer import PromptTokenizer
from forge_rl.types import Episode


class DatasetActor(Actor):
    def __init__(self, task: str, seed: int, model_dir: str):
        self.task = task
        self.seed = seed
        self.tokenizer = PromptTokenizer(Path(model_dir))
        self.cursor = 0
        """Index of the next prompt; episode ids are cursor positions, so they never repeat."""

    @endpoint
    async def next_episodes(self, num_prompts: int) -> list[Episode]:
        episodes = []
        for _ in range(num_prompts):
            prompt = make_prompt(self.task, self.seed, self.cursor)
            episodes.append(
                Episode(
                    episode_id=self.cursor,
                    prompt_text=prompt.text,
                    answer=prompt.answer,
                    prompt_token_ids=self.tokenizer.encode_prompt(prompt.text),
                )
            )
            self.cursor += 1
        return episodes

    @endpoint
    async def state(self) -> dict:
        return {"cursor": self.cursor}
