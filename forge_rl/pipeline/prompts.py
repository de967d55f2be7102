"""Hands out prompts as Episode shells (no completions yet), tokenized, with a resumable cursor.

Prompt i is a function of (task, seed, i) (forge_rl/tasks), so prompts are built where they are
used: in the rollouts' process (`forge_rl.pipeline.rollouts`), with no message per prompt. After a resume, the prompts a
checkpoint left unsettled (`forge_rl.core.checkpoint`) are handed out
again first, under their own index, then the cursor continues where it stopped.

With `data` set, prompt i is row i of a file instead (`forge_rl.data.files.FileSource`: the
seed's permutation of epoch i // N, at i % N). A new prompt is the next row that fits the context
(`next_row(cursor)`; the cursor moves past skipped rows), a reissued one `row(index)`, so the state
stays {cursor, reissue} and a resume continues mid-epoch with nothing skipped or repeated.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from forge_rl.data.config import DataConfig
from forge_rl.data.rows import Row
from forge_rl.errors import ConfigError
from forge_rl.observability import metric_names as m
from forge_rl.tasks import TaskConfig, encode_task_prompt, make_task_prompt
from forge_rl.tasks.reasoning_gym import reasoning_gym_row
from forge_rl.tasks.synthetic import long_tail_length
from forge_rl.tasks.tokenizer import PromptTokenizer, tokenizer_fingerprint
from forge_rl.types import Episode

if TYPE_CHECKING:
    from forge_rl.data.files import FileSource
    from forge_rl.data.rows import Message


def encode_row_prompt(task: TaskConfig, tokenizer: PromptTokenizer, prompt: str | list[Message]) -> list[int]:
    """A row's prompt as token ids: text in the task's prompt_format, chat messages through the
    model's chat template, ending with the assistant header."""
    if isinstance(prompt, list):
        return tokenizer.encode_chat(prompt, add_generation_prompt=True)
    return encode_task_prompt(task, tokenizer, prompt)


def open_file_source(
    data: DataConfig,
    encode: Callable[[str | list[Message]], list[int]],
    max_model_len: int,
    max_new_tokens: int,
    field: str = "data",
) -> FileSource:
    """A data file as a source whose rows must fit max_model_len with max_new_tokens, counted by the
    tokens the generator will see (`encode`: a prompt as its token ids, `encode_row_prompt`);
    `field` names its DataConfig in messages ("data", "eval.sets[0].data")."""
    from forge_rl.data.files import FileSource, LengthLimit  # opens datasets and pyarrow: only for a data file

    return FileSource(data, LengthLimit(lambda prompt: len(encode(prompt)), max_model_len, max_new_tokens), field=field)


class TaskRows:
    """A built-in task as a row source (`forge_rl.data.rows.RowSource`): endless, prompt i its
    row i, with the prompt text and the answer as text (what `forge-rl data export` writes). A
    reasoning-gym question's answer is the dataset's oracle answer, for rewards that compare text
    (math_verify, exact_match); a run on the task itself scores with the dataset's own verifier."""

    num_rows = None

    def __init__(self, task: TaskConfig):
        self.task = task

    def next_row(self, index: int) -> Row:
        if self.task.name == "reasoning_gym":
            task = self.task
            text, answer = reasoning_gym_row(task.reasoning_gym_dataset, task.reasoning_gym_options, task.seed, index)
        else:
            prompt = make_task_prompt(self.task, index)
            text, answer = prompt.text, prompt.answer
        return Row(index=index, row_number=index, epoch=0, columns={}, prompt=text, answer=answer)


@dataclass(frozen=True)
class DataExportArgs:
    """Write a built-in task's first prompts, with their answers, to a JSONL file (columns prompt and
    answer) that a run reads with --data.path FILE --data.answer-column answer."""

    out: Path
    """The JSONL file to write (replaced whole when it exists)."""
    rows: int = 1000
    """How many prompts to write: prompts 0 .. rows-1 of the task (with unique or exclude, the
    first `rows` prompts kept)."""
    unique: bool = False
    """Write each prompt once: a repeat of an earlier prompt is passed over (tasks with few distinct
    prompts, such as one-digit sums)."""
    exclude: Path | None = None
    """A JSONL file (another export: the held-out set) whose prompts are passed over, so that the
    two files share none."""
    task: TaskConfig = field(default_factory=TaskConfig)


class PromptSource:
    def __init__(
        self,
        task: TaskConfig,
        model_dir: str,
        max_new_tokens: int,
        data: DataConfig | None = None,
        max_model_len: int | None = None,
    ):
        self.task = task
        self.max_new_tokens = max_new_tokens
        self.tokenizer = PromptTokenizer(Path(model_dir))
        self.tokenizer_fingerprint = tokenizer_fingerprint(Path(model_dir))
        """What a checkpoint's partial groups were sampled under (`forge_rl.tasks.tokenizer`)."""
        self._encoded: tuple[str | list[Message], list[int]] | None = None
        """The last row prompt encoded, with its ids (`_encode_row_prompt`)."""
        self.file: FileSource | None = None
        """The data file's rows (data set; max_model_len then required), else None: the task's prompts."""
        if data is not None:
            if max_model_len is None:
                raise ValueError("a PromptSource over data needs max_model_len (GRPOConfig.max_model_len)")
            self.file = open_file_source(data, self._encode_row_prompt, max_model_len, max_new_tokens)
        self.cursor = 0
        """Index of the next new prompt; episode ids are prompt indices, so a prompt is counted by its id."""
        self.reissue: collections.deque[int] = collections.deque()
        """Indices below the cursor to hand out again before new ones (set by a resume)."""

    def next_episodes(self, num_prompts: int) -> list[Episode]:
        episodes = []
        for _ in range(num_prompts):
            if self.file is not None:
                episodes.append(self._row_episode())
                continue
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

    def _row_episode(self) -> Episode:
        assert self.file is not None  # next_episodes asks for a row episode of a data file only
        if self.reissue:
            row = self.file.row(self.reissue.popleft())
        else:
            row = self.file.next_row(self.cursor)
            self.cursor = row.index + 1
        prompt = row.prompt
        return Episode(
            episode_id=row.index,
            prompt_text=row.prompt_text,
            answer="" if row.answer is None else row.answer,
            prompt_token_ids=self._encode_row_prompt(prompt),
            forced_length=self._forced_length(row.index),
            columns=row.columns,
        )

    def _encode_row_prompt(self, prompt: str | list[Message]) -> list[int]:
        """`encode_row_prompt`, once per row: `next_row`'s length check encodes the very prompt the
        episode then carries (a chat template is rendered, not looked up)."""
        if self._encoded is None or self._encoded[0] is not prompt:
            self._encoded = (prompt, encode_row_prompt(self.task, self.tokenizer, prompt))
        return self._encoded[1]

    def _forced_length(self, index: int) -> int | None:
        if self.task.completion_lengths == "natural":
            return None
        return long_tail_length(
            self.task.seed, index, self.task.long_tail_min_tokens, self.task.long_tail_alpha, self.max_new_tokens
        )

    def stats(self) -> dict:
        """The data file's figures for the step's metrics (none for a task's prompts)."""
        if self.file is None:
            return {}
        return {m.DATA_SKIPPED_ROWS: len(self.file.skipped_rows), m.DATA_EPOCH: self.file.locate(self.cursor).epoch}

    def state(self) -> dict:
        state = {"cursor": self.cursor, "reissue": list(self.reissue)}
        if self.file is not None:
            state["data_fingerprint"] = self.file.fingerprint
        return state

    def load_state(self, cursor: int, reissue: list[int], data_fingerprint: str | None = None) -> None:
        if self.file is not None and data_fingerprint is not None and data_fingerprint != self.file.fingerprint:
            raise ConfigError(
                f"{self.file.where} is not the file the checkpoint was taken on (its rows differ: "
                f"forge_rl/data/files.py FileSource.fingerprint), and the checkpoint's cursor ({cursor}) counts "
                "rows of that file: resumed, the run would skip or repeat rows. Restore the file the run "
                "trained on, or start a new run on this one (without --resume)."
            )
        self.cursor = cursor
        if self.file is not None:
            # Indices a file passed over as too long are below the cursor and never trained, so the
            # checkpoint lists them as unsettled; they stay passed over.
            reissue = [index for index in reissue if self.file.next_row(index).index == index]
        self.reissue = collections.deque(reissue)
