"""`forge-rl bench keep-routing`: how far the trainer's logprobs drift from the sampler's on a
mixture-of-experts policy, with and without Keep Routing (forge_rl/routing.py), and what the
routing record costs.

One tiny Qwen3-MoE from scratch (`TinyModelConfig` with experts). vLLM samples a GRPO batch of the
task (version 0) with routing recorded (generator.record_routing, the CPU capture hook), in
bfloat16 by default while the trainer computes in float32: the numerics gap between a GPU
generator and its trainer, which is what flips routings at equal weights. Then one trainer process
measures the batch at staleness 0, takes an optimizer step on it (Keep Routing on), measures again
at staleness 1, and so on up to `max_staleness`. At each staleness, over the generated tokens:

    mismatch_kl              token mean of k3 KL between trainer and behaviour logprobs (what
                             the trainer logs as mismatch_kl), with and without the replay
    ratio_variance           variance of the importance ratio exp(trainer - behaviour)
    routing_differs_fraction tokens whose sampling pass the trainer routes, left alone, to another
                             expert set than the record in at least one layer

`mismatch_kl_ratio` is with over without at the same staleness; the headline is staleness 0 (the
training-inference mismatch Keep Routing is for), `mismatch_kl_ratio_stale` the mean over
1..max_staleness, where the weights themselves have moved. With `--generator-dtype float32` both
sides compute the same function on CPU and route identically at staleness 0 (both KLs are 0).
`routing_bytes_per_token` is the record's size per generated token.
Reward curves with and without need two GRPO runs (`forge-rl grpo` with
--trainer.keep-routing on and off); this benchmark does not run them. Figures go to
OUT_DIR/keep_routing.json; the last stdout line is the JSON summary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from forge_rl.models.tiny import TinyModelConfig


@dataclass(frozen=True)
class KeepRoutingArgs:
    model: TinyModelConfig = field(default_factory=lambda: TinyModelConfig(num_layers=4, num_experts=16))
    """The from-scratch Qwen3-MoE (every layer MoE; top-k = num_experts_per_tok)."""
    num_prompts: int = 16
    """Prompts of the batch (task max_of_two)."""
    group_size: int = 8
    """Completions per prompt."""
    max_new_tokens: int = 8
    """Tokens per completion (EOS ignored, so every completion has them all)."""
    max_staleness: int = 3
    """Optimizer steps between sampling and the last measurement."""
    lr: float = 3e-4
    """Trainer learning rate (the demo's)."""
    seed: int = 0
    """Sampling and trainer seed (the model's is model.seed)."""
    generator_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """vLLM's dtype (generator.dtype); the trainer computes in float32."""
    out_dir: Path = Path("runs/bench-keep-routing")
    """Where the model and keep_routing.json go (a model already there is reused as it is, so a
    different --model needs a new OUT_DIR)."""


def _sample(args: KeepRoutingArgs, model_dir: Path):
    """The batch's episodes, sampled by vLLM with routing recorded, rewarded by the task."""
    from forge_rl.engines.vllm_engine import GeneratorConfig, VLLMEngine
    from forge_rl.tasks import TaskConfig, make_task_prompt
    from forge_rl.tasks.rewards import resolve_reward_fn
    from forge_rl.tasks.tokenizer import PromptTokenizer
    from forge_rl.types import Episode

    task, tokenizer = TaskConfig(), PromptTokenizer(model_dir)
    reward_fn = resolve_reward_fn(task.reward)
    engine = VLLMEngine(GeneratorConfig(
        max_new_tokens=args.max_new_tokens, record_routing=True, seed=args.seed, dtype=args.generator_dtype
    ))
    loop = asyncio.new_event_loop()
    episodes = []
    try:
        loop.run_until_complete(engine.start(model_dir, max_model_len=64))
        for index in range(args.num_prompts):
            prompt = make_task_prompt(task, index)
            ids = tokenizer.encode_prompt(prompt.text)
            completions = loop.run_until_complete(engine.generate(ids, args.group_size, eos_id=None))
            for completion in completions:
                completion.text = tokenizer.decode(completion.token_ids)
                completion.reward = reward_fn(completion.text, prompt.answer)
            episodes.append(Episode(index, prompt.text, prompt.answer, ids, completions))
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()
    return episodes


def _measure(trainer, batch) -> dict[str, float]:
    """Mismatch with and without the replay, and how often the trainer's own routing differs."""
    import torch

    from forge_rl.losses.corrections import k3_kl_NL
    from forge_rl.models.moe import last_routing
    from forge_rl.routing import routing_differs_NL

    mask_NL = batch.loss_mask_NL
    unreplayed = dataclasses.replace(batch, routed_experts_NLXK=None, routed_NL=None)
    out = {}
    for name, variant in (("without", unreplayed), ("with", batch)):
        log_ratio = (trainer.compute_logprobs(variant) - batch.behaviour_logprobs_NL)[mask_NL]
        out[f"mismatch_kl_{name}"] = k3_kl_NL(log_ratio.clamp(-20, 20)).mean().item()
        out[f"ratio_variance_{name}"] = torch.exp(log_ratio).var().item()
        if name == "without":  # "pad": one forward whose rows are the batch's rows
            own_NLXK = last_routing(trainer.model)[:, :-1]
            differs_NL = routing_differs_NL(own_NLXK, batch.routed_experts_NLXK[:, 1:])
            recorded_NL = batch.routed_NL[:, 1:] & mask_NL[:, 1:]
            out["routing_differs_fraction"] = differs_NL[recorded_NL].float().mean().item()
    # No mismatch to remove (an fp32 generator at staleness 0): no ratio.
    without = out["mismatch_kl_without"]
    out["mismatch_kl_ratio"] = out["mismatch_kl_with"] / without if without > 0 else None
    return out


def main(args: KeepRoutingArgs) -> dict:
    from forge_rl.batching import make_train_batch
    from forge_rl.metrics import progress
    from forge_rl.models.tiny import create_tiny_model
    from forge_rl.trainer import PolicyTrainer, TrainerConfig

    args.out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = args.out_dir / "model"
    if not args.model.num_experts:
        raise ValueError("bench keep-routing needs a mixture of experts: set --model.num-experts > 0.")
    if not (model_dir / "config.json").is_file():
        create_tiny_model(args.model, model_dir)
    progress(f"bench keep-routing: sampling {args.num_prompts} x {args.group_size} with routing recorded")
    episodes = _sample(args, model_dir)
    batch = make_train_batch(episodes, pad_id=0)
    record = episodes[0].completions[0].routed_experts
    trainer = PolicyTrainer(TrainerConfig(keep_routing=True, batching="pad", lr=args.lr, seed=args.seed), model_dir)
    per_staleness = []
    for staleness in range(args.max_staleness + 1):
        measured = {"staleness": staleness, **_measure(trainer, batch)}
        progress("bench keep-routing: " + ", ".join(f"{k} {v:.4g}" for k, v in measured.items() if v is not None))
        per_staleness.append(measured)
        if staleness < args.max_staleness:
            trainer.train_step(batch)
    stale = [m["mismatch_kl_ratio"] for m in per_staleness if m["staleness"] > 0 and m["mismatch_kl_ratio"] is not None]
    summary = {
        "mismatch_kl_ratio": per_staleness[0]["mismatch_kl_ratio"],
        "mismatch_kl_ratio_stale": statistics.mean(stale) if stale else None,
        "mismatch_kl_without": per_staleness[0]["mismatch_kl_without"],
        "mismatch_kl_with": per_staleness[0]["mismatch_kl_with"],
        "generator_dtype": args.generator_dtype,
        "routing_bytes_per_token": record.bytes_per_token,
        "routing_differs_fraction_max": max(m["routing_differs_fraction"] for m in per_staleness),
        "num_generated_tokens": batch.num_generated_tokens,
        "model": dataclasses.asdict(args.model),
        "per_staleness": per_staleness,
    }
    (args.out_dir / "keep_routing.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
