"""The supervised warm-up on an environment's turn format, before RL (the calculator recipe's).

From scratch, the tiny model never writes a well-formed tool call, so every reward is 0 and GRPO
has no signal. `warm_up_model` trains the freshly created model with cross-entropy on the
generated tokens of a few hundred demonstration episodes (`forge_rl.envs.demonstrations`: the
environment's own turns, laid out by the same runner and renderer as RL's episodes), then writes
the weights back into the model directory the run starts from. It runs once, when the run
directory is created (`forge_rl.run.run_dir`), in the controller process: the tiny model trains in
seconds on one thread. The model is TorchTitan's, as the trainer builds it (build_titan_model),
and the weights go back through the HF export the weight store publishes with.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from forge_rl.envs.demonstrations import demonstration_samples
from forge_rl.envs.renderers import PlainTextRenderer
from forge_rl.envs.trajectory import TrajectorySample
from forge_rl.models.hf_checkpoint import export_hf_model_dir
from forge_rl.models.titan import ParallelConfig, build_titan_model, export_hf_state_dict
from forge_rl.tasks import Prompt, make_task_prompt
from forge_rl.tasks.tokenizer import PromptTokenizer

TEXT_TASK_SEED = 1_000_003
"""Task seed of supervised task text (`task_text_samples`) that benchmarks train on before a run:
not the runs' prompts (task seed 0)."""


@dataclass(frozen=True)
class TextSample:
    """One supervised sequence, in the shape `train_in_place` reads."""

    token_ids: list[int]
    loss_mask: list[bool]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def task_text_samples(
    tokenizer: PromptTokenizer,
    task,
    num_samples: int,
    problems_per_sample: int,
    answer: Callable[[Prompt], str] = lambda prompt: prompt.answer,
) -> list[TextSample]:
    """Sequences "<bos>M37=7<eos>M52=5<eos>..." of `task`'s problems (a TaskConfig), each followed by
    `answer(prompt)` (by default its solution), every token but bos a target. Several problems per
    sequence, so that completions that run past their EOS stay in distribution: after an answer
    and EOS comes the next problem."""
    samples = []
    for index in range(num_samples):
        ids = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
        for problem in range(problems_per_sample):
            prompt = make_task_prompt(task, index * problems_per_sample + problem)
            ids += tokenizer.encode_text(prompt.text + answer(prompt)) + [tokenizer.eos_id]
        samples.append(TextSample(ids, [False] + [True] * (len(ids) - 1)))
    return samples


def warm_up_model(model_dir: Path, environment) -> dict:
    """Warm the model in `model_dir` up on demonstrations of `environment` (an EnvironmentConfig
    with warmup.episodes > 0) and write it back in place; returns what it measured."""
    start = time.perf_counter()
    config = environment.warmup
    tokenizer = PromptTokenizer(model_dir)
    play = demonstration_samples(
        environment.make_env(), config.seed, config.episodes, PlainTextRenderer(tokenizer), environment.limits
    )
    # The run directory is created inside the recipe's event loop, so the environments' coroutines
    # get a loop of their own, on a thread.
    with ThreadPoolExecutor(1) as thread:
        samples = thread.submit(asyncio.run, play).result()
    losses = train_in_place(
        model_dir, samples, config.steps, config.batch_size, config.lr, config.seed, tokenizer.pad_id
    )
    return {
        "warmup/episodes": config.episodes,
        "warmup/steps": config.steps,
        "warmup/first_loss": losses[0],
        "warmup/final_loss": losses[-1],
        "warmup/seconds": time.perf_counter() - start,
    }


def train_in_place(
    model_dir: Path, samples: list, steps: int, batch_size: int, lr: float, seed: int, pad_id: int
) -> list[float]:
    """Train the model in `model_dir` with cross-entropy on the generated tokens of `samples`
    (anything with `token_ids`, `loss_mask` and `num_tokens`, like a `TrajectorySample`), `batch_size`
    of them per AdamW step, taken in order and wrapping around; write it back in place and return
    each step's loss."""
    torch.manual_seed(seed)
    model, _ = build_titan_model(model_dir, ParallelConfig(), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        first = step * batch_size
        batch = [samples[(first + i) % len(samples)] for i in range(batch_size)]
        input_ids_NL, target_ids_NL, loss_mask_NL = next_token_batch(batch, pad_id)
        logits_NLV = model(input_ids_NL, attention_masks=None).float()
        loss = demonstration_loss(logits_NLV, target_ids_NL, loss_mask_NL)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    trained = model_dir.with_name(f".{model_dir.name}.trained")
    shutil.rmtree(trained, ignore_errors=True)
    export_hf_model_dir(export_hf_state_dict(model), model_dir, trained)
    shutil.rmtree(model_dir)
    trained.rename(model_dir)
    return losses


def next_token_batch(samples: list[TrajectorySample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, L-1] inputs, [N, L-1] next-token targets and [N, L-1] loss mask (the target is a
    generated token) of `samples`, right-padded to the longest (padding is never in the loss)."""
    length = max(sample.num_tokens for sample in samples)
    token_ids_NL = torch.full((len(samples), length), pad_id, dtype=torch.long)
    generated_NL = torch.zeros((len(samples), length), dtype=torch.bool)
    for row, sample in enumerate(samples):
        token_ids_NL[row, : sample.num_tokens] = torch.tensor(sample.token_ids)
        generated_NL[row, : sample.num_tokens] = torch.tensor(sample.loss_mask)
    return token_ids_NL[:, :-1], token_ids_NL[:, 1:], generated_NL[:, 1:]


def demonstration_loss(
    logits_NLV: torch.Tensor, target_ids_NL: torch.Tensor, loss_mask_NL: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy over the masked (generated) target tokens."""
    token_loss_NL = torch.nn.functional.cross_entropy(logits_NLV.transpose(1, 2), target_ids_NL, reduction="none")
    return (token_loss_NL * loss_mask_NL).sum() / loss_mask_NL.sum().clamp(min=1)
