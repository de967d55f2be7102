"""`forge-rl bench task-baseline`: a model's reward on a task before any training.

A task is worth training on when its baseline reward is neither ~0 (GRPO gets no signal: every
group's samples score alike) nor close to 1 (nothing left to learn). This samples
`samples_per_prompt` completions for each of `num_prompts` task prompts with the real vLLM engine,
at the recipe's sampling settings, and scores them with the task's reward function, in this
process (the trusted verifier parses text; it runs no model output).

    forge-rl convert   # models/SmolLM2-135M-Instruct
    forge-rl bench task-baseline --model-path models/SmolLM2-135M-Instruct \\
        --task.name reasoning_gym --task.reward reasoning_gym --task.prompt-format chat \\
        --task.reasoning-gym-dataset chain_sum \\
        --task.reasoning-gym-options min_terms 2 max_terms 2 max_digits 1

The last stdout line is the JSON summary (mean reward, its standard error over prompts, the
fraction of prompts whose samples all scored alike); OUT_DIR/task_baseline.json adds every
prompt's completions and rewards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from forge_rl.engines.config import GeneratorConfig
from forge_rl.plumbing.threads import with_chosen_threads
from forge_rl.tasks import TaskConfig, encode_task_prompt, make_task_prompt
from forge_rl.tasks.rewards import resolve_reward_fn


@dataclass(frozen=True)
class TaskBaselineArgs:
    model_path: Path = Path("models/SmolLM2-135M-Instruct")
    """HF model directory (`forge-rl convert` writes SmolLM2-135M-Instruct there)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The task, as in the recipe's `task:` section."""
    generator: GeneratorConfig = field(default_factory=lambda: GeneratorConfig(max_new_tokens=32))
    """Sampling settings, as in the recipe's `generator:` section (temperature, top_p, max_new_tokens)."""
    num_prompts: int = 128
    """Prompts scored: indices 0..num_prompts-1 of the task's sequence."""
    samples_per_prompt: int = 4
    """Completions per prompt (the recipe's group size)."""
    max_model_len: int = 512
    """vLLM's context: longest prompt plus generator.max_new_tokens must fit."""
    out_dir: Path = Path("runs/bench-task-baseline")
    """Where task_baseline.json goes."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "generator", with_chosen_threads(None, self.generator, trainer_procs=0, generators=1)[1]
        )
        for name in ("num_prompts", "samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1. Set --{name.replace('_', '-')}.")


async def _sample(args: TaskBaselineArgs, prompts: list[list[int]], eos_id: int):
    from forge_rl.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(args.generator)
    await engine.start(args.model_path, max_model_len=args.max_model_len)
    try:
        return await asyncio.gather(*(engine.generate(p, n=args.samples_per_prompt, eos_id=eos_id) for p in prompts))
    finally:
        await engine.shutdown()


def main(args: TaskBaselineArgs) -> dict:
    from forge_rl.tasks.tokenizer import PromptTokenizer

    tokenizer = PromptTokenizer(args.model_path)
    reward_fn = resolve_reward_fn(args.task.only_reward)
    task_prompts = [make_task_prompt(args.task, i) for i in range(args.num_prompts)]
    token_ids = [encode_task_prompt(args.task, tokenizer, p.text) for p in task_prompts]
    start = time.perf_counter()
    groups = asyncio.run(_sample(args, token_ids, tokenizer.eos_id))
    sample_s = time.perf_counter() - start
    records, prompt_means = [], []
    for prompt, group in zip(task_prompts, groups):
        texts = [tokenizer.decode(c.token_ids) for c in group]
        rewards = [float(reward_fn(text, prompt.answer)) for text in texts]
        prompt_means.append(sum(rewards) / len(rewards))
        records.append({"prompt": prompt.text, "completions": texts, "rewards": rewards})
    mean = sum(prompt_means) / len(prompt_means)
    variance = sum((m - mean) ** 2 for m in prompt_means) / max(1, len(prompt_means) - 1)
    tokens = sum(c.num_tokens for group in groups for c in group)
    summary = {
        "model_path": str(args.model_path),
        "task": dataclasses.asdict(args.task),
        "temperature": args.generator.temperature,
        "top_p": args.generator.top_p,
        "max_new_tokens": args.generator.max_new_tokens,
        "num_prompts": args.num_prompts,
        "samples_per_prompt": args.samples_per_prompt,
        "reward_mean": mean,
        "reward_stderr": math.sqrt(variance / len(prompt_means)),
        # Groups whose samples all scored alike give GRPO no advantage signal.
        "frac_groups_all_alike": sum(len(set(r["rewards"])) == 1 for r in records) / len(records),
        "mean_completion_tokens": tokens / (args.num_prompts * args.samples_per_prompt),
        "sample_s": sample_s,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "task_baseline.json").write_text(json.dumps({**summary, "prompts": records}, indent=1) + "\n")
    return summary
