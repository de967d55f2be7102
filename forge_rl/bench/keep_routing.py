"""`forge-rl bench keep-routing`: how far the trainer's logprobs drift from the sampler's on a
mixture-of-experts policy, with and without Keep Routing (`forge_rl.routing`), and what the
routing record costs.

One tiny Qwen3-MoE: from scratch (`TinyModelConfig` with experts), or `--model-path`, pre-trained
first on the task's text with `--pretrain-steps` (from scratch its routers are near-uniform; a
trained MoE's experts carry the function, so a routing flip can cost more). vLLM samples a GRPO batch of the
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
    affected_kl_share        share of the KL (without the replay) on tokens whose own or an
                             earlier generated row differs: what the replay can reach
    ratio_floor              the ratio a replay removing exactly that part would give (`_measure`)
    router_topk_mass         the router's probability on its top-k: how decisive it is

`mismatch_kl_ratio` is with over without at the same staleness; the headline is staleness 0 (the
training-inference mismatch Keep Routing is for), `mismatch_kl_ratio_by_staleness` all of them,
`mismatch_kl_ratio_stale` the mean over 1..max_staleness, where the weights themselves have moved
(the KL then holds the intended policy change, which Keep Routing does not remove). The KL mean
is heavy-tailed (a few tokens routed through another trained expert can carry nearly all of it):
compare several batches (`--seed`, `--num-prompts`) before reading one ratio. With `--generator-dtype float32` both
sides compute the same function on CPU and route identically at staleness 0 (both KLs are 0).
`routing_bytes_per_token` is the record's size per generated token.
Reward curves with and without: the demo recipe (`--reward-config`) on a from-scratch MoE of
`--model`'s expert shape, `--reward-steps` steps per seed with generator.record_routing on and
trainer.keep_routing on, then off (routing still recorded, not replayed: the same sampling path),
side by side (`reward_curves`, OUT_DIR/reward_curves.png, and the final rewards); `--reward-steps 0`
skips them. Figures go to OUT_DIR/keep_routing.json; the last stdout line is the JSON summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from forge_rl.models.tiny import TinyModelConfig
from forge_rl.observability.metrics import progress


@dataclass(frozen=True)
class KeepRoutingArgs:
    model: TinyModelConfig = field(default_factory=lambda: TinyModelConfig(num_layers=4, num_experts=16))
    """The from-scratch Qwen3-MoE (every layer MoE; top-k = num_experts_per_tok); not read with --model-path."""
    model_path: Path | None = None
    """A Qwen3-MoE HF directory with the character tokenizer to start from instead, e.g. what
    `forge-rl export` wrote from a GRPO run with --model.tiny.num-experts (copied, never modified)."""
    pretrain_steps: int = 0
    """Supervised steps on the task's text before sampling (0: none): the from-scratch routers are
    near-uniform, and a trained MoE routes decisively (see `_pretrain`)."""
    pretrain_batch_size: int = 32
    """Sequences per pre-training step."""
    pretrain_lr: float = 1e-3
    """Pre-training AdamW learning rate."""
    num_prompts: int = 16
    """Prompts of the batch (task max_of_two)."""
    group_size: int = 8
    """Completions per prompt."""
    max_new_tokens: int = 8
    """Tokens per completion (EOS ignored, so every completion has them all)."""
    max_staleness: int = 3
    """Optimizer steps between sampling and the last measurement."""
    resubmit_after: int | None = None
    """Tokens of each completion sampled before it is resubmitted to the next version's weights
    (None: half of max_new_tokens, where max_staleness >= 1; 0: no resubmission measurement).
    Its continuation attends to KV the new weights encoded anew, not the recorded passes: the
    case where the replay is not exact (`_resubmitted`)."""
    lr: float = 3e-4
    """Trainer learning rate (the demo's)."""
    seed: int = 0
    """Sampling and trainer seed (the model's is model.seed)."""
    generator_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """vLLM's dtype (generator.dtype); the trainer computes in float32."""
    reward_steps: int = 60
    """GRPO steps per reward-curve run (0: no reward curves)."""
    reward_seeds: tuple[int, ...] = (0,)
    """Seeds of the reward-curve runs (one run per seed with Keep Routing, one without)."""
    reward_config: Path = Path("configs/grpo_tiny_cpu.yaml")
    """The recipe config the reward-curve runs start from (its model becomes a MoE of --model's
    num_experts and num_experts_per_tok)."""
    out_dir: Path = Path("runs/bench-keep-routing")
    """Where the model and keep_routing.json go (a model already there is reused as it is,
    pre-training included, so a different --model, --model-path or --pretrain-* needs a new OUT_DIR)."""

    def __post_init__(self) -> None:
        if self.model_path is None and not self.model.num_experts:
            raise ValueError("bench keep-routing needs a mixture of experts: set --model.num-experts > 0.")
        if self.reward_steps and not self.reward_seeds:
            raise ValueError("reward_seeds is empty but reward_steps is set. Set --reward-seeds or --reward-steps 0.")
        if self.resubmit_after is None:
            half = self.max_new_tokens // 2 if self.max_staleness >= 1 else 0
            object.__setattr__(self, "resubmit_after", half)
        if self.resubmit_after and not 0 < self.resubmit_after < self.max_new_tokens:
            raise ValueError(
                f"resubmit_after ({self.resubmit_after}) must be between 1 and max_new_tokens - 1 "
                f"({self.max_new_tokens - 1}): a completion is resubmitted with tokens left to sample. "
                "Set --resubmit-after, or 0 for none."
            )
        if self.resubmit_after and self.max_staleness < 1:
            raise ValueError(
                "resubmit_after needs the next version (max_staleness >= 1): the continuation runs on "
                "the weights after one optimizer step. Set --max-staleness 1 or more, or --resubmit-after 0."
            )
        for name, least in (
            ("pretrain_steps", 0),
            ("pretrain_batch_size", 1),
            ("max_staleness", 0),
            ("reward_steps", 0),
        ):
            if getattr(self, name) < least:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= {least}. Set --{name.replace('_', '-')}.")


def _sample(args: KeepRoutingArgs, model_dir: Path):
    """The batch's episodes, sampled by vLLM with routing recorded, rewarded by the task; and, with
    `resubmit_after`, per prompt the first `resubmit_after` tokens of another group (the heads
    `_resubmitted` continues on the next version), else None."""
    from forge_rl.tasks import TaskConfig, make_task_prompt
    from forge_rl.tasks.tokenizer import PromptTokenizer
    from forge_rl.types import Episode

    task, tokenizer = TaskConfig(), PromptTokenizer(model_dir)
    episodes = []
    heads: list[list] | None = [] if args.resubmit_after else None
    with _recording_engine(args, model_dir, args.seed) as (engine, run):
        for index in range(args.num_prompts):
            prompt = make_task_prompt(task, index)
            ids = tokenizer.encode_prompt(prompt.text)
            completions = run(engine.generate(ids, args.group_size, eos_id=None))
            for completion in completions:
                _score(completion, tokenizer, prompt.answer)
            episodes.append(Episode(index, prompt.text, prompt.answer, ids, completions))
            if heads is not None:
                pieces = run(engine.generate_segment(ids, None, args.group_size, None, None, args.resubmit_after))
                heads.append([piece for piece, _ in pieces])
    return episodes, heads


@contextlib.contextmanager
def _recording_engine(args: KeepRoutingArgs, model_dir: Path, seed: int):
    """A started vLLM engine on `model_dir` recording routing, and `run` (a coroutine to its
    result on the engine's own event loop); shut down on exit."""
    from forge_rl.engines.config import GeneratorConfig
    from forge_rl.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(
        GeneratorConfig(max_new_tokens=args.max_new_tokens, record_routing=True, seed=seed, dtype=args.generator_dtype)
    )
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(engine.start(model_dir, max_model_len=64))
        yield engine, loop.run_until_complete
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()


@functools.cache
def _task_reward():
    from forge_rl.tasks import TaskConfig
    from forge_rl.tasks.rewards import resolve_reward_fn

    return resolve_reward_fn(TaskConfig().only_reward)


def _score(completion, tokenizer, answer: str) -> None:
    """The completion's text and the task's reward for it."""
    completion.text = tokenizer.decode(completion.token_ids)
    completion.reward = _task_reward()(completion.text, answer)


def _resubmitted(args: KeepRoutingArgs, trainer, model_dir: Path, episodes, heads, version: int):
    """The heads' completions continued by a vLLM engine on the trainer's weights now (`version`),
    each in a request of its own, as a swap that re-encodes the KV of the requests in flight, or
    an abort-mode resubmission, continues them: the continuation's prefix (prompt and head) is
    prefilled anew by the new weights, so its tokens attend to KV the routing record does not
    describe. Returns the episodes of the joined completions; their `kv_versions` mark the
    continuation."""
    import shutil

    from forge_rl.models.hf_checkpoint import export_hf_model_dir
    from forge_rl.tasks.tokenizer import PromptTokenizer
    from forge_rl.types import Episode, join_pieces

    next_dir = args.out_dir / f"model-version-{version}"
    shutil.rmtree(next_dir, ignore_errors=True)
    export_hf_model_dir(trainer.hf_state_dict(), model_dir, next_dir)
    tokenizer = PromptTokenizer(model_dir)
    out = []
    assert args.resubmit_after is not None  # __post_init__ sets it
    with _recording_engine(args, next_dir, args.seed + 1) as (engine, run):
        for episode, group in zip(episodes, heads):
            tails = run(
                engine.generate_segment(
                    episode.prompt_token_ids,
                    [head.token_ids for head in group],
                    1,
                    None,
                    None,
                    args.max_new_tokens - args.resubmit_after,
                )
            )
            completions = []
            for head, (tail, _) in zip(group, tails):
                # This engine loaded `version` from a directory, so it labels its tokens 0: they
                # were sampled by `version`, and the re-encoded KV they attend to is its too.
                tail.policy_versions = [version] * tail.num_tokens
                tail.kv_versions = [version] * tail.num_tokens
                completion = join_pieces(head, tail)
                _score(completion, tokenizer, episode.answer)
                completions.append(completion)
            out.append(
                Episode(episode.episode_id, episode.prompt_text, episode.answer, episode.prompt_token_ids, completions)
            )
    return out


def reencoded_tokens_T(completions) -> list[bool]:
    """Per generated token, in batch order: whether the KV it attended to was encoded by newer
    weights than sampled an earlier token of its completion (a re-encoding swap or a
    resubmission: `Completion.kv_versions` newer than the oldest sampling version so far), so
    the routing record does not describe how that KV was computed."""
    out = []
    for completion in completions:
        oldest = None
        for sampled, kv in zip(completion.policy_versions, completion.kv_versions or completion.policy_versions):
            oldest = sampled if oldest is None else min(oldest, sampled)
            out.append(kv > oldest)
    return out


_PROBLEMS_PER_SEQUENCE = 4
"""Solved problems per pre-training sequence."""


def _pretrain(args: KeepRoutingArgs, model_dir: Path) -> dict:
    """Train the model in `model_dir` in place with cross-entropy on sequences of solved problems,
    "<bos>M37=7<eos>M52=5<eos>..." (every token but bos a target): the experts specialize and the
    routers, near-uniform from scratch, become decisive. Several problems per sequence, so that
    the benchmark's completions (EOS ignored) stay in distribution: after an answer and EOS
    comes the next problem."""
    import time

    from forge_rl.tasks import TaskConfig
    from forge_rl.tasks.tokenizer import PromptTokenizer
    from forge_rl.training.warmup import TEXT_TASK_SEED, task_text_samples, train_in_place

    start = time.perf_counter()
    tokenizer = PromptTokenizer(model_dir)
    samples = task_text_samples(
        tokenizer,
        TaskConfig(seed=TEXT_TASK_SEED),
        args.pretrain_steps * args.pretrain_batch_size,
        _PROBLEMS_PER_SEQUENCE,
    )
    losses = train_in_place(
        model_dir, samples, args.pretrain_steps, args.pretrain_batch_size, args.pretrain_lr, args.seed, tokenizer.pad_id
    )
    return {
        "steps": args.pretrain_steps,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "seconds": time.perf_counter() - start,
    }


def _router_decisiveness(scores_BLE: list, top_k: int, rows_NL) -> dict[str, float]:
    """Over the rows that sampled a recorded token and every MoE layer: the router probability
    mass on its top-k (k / num_experts when uniform, 1 when fully decisive) and the gap between
    its k-th and (k+1)-th probability (a numerics error larger than the gap flips the routing)."""
    import torch

    sorted_RXE = torch.stack([scores[rows_NL] for scores in scores_BLE], dim=1).sort(-1, descending=True).values
    margin = (
        sorted_RXE[..., top_k - 1] - sorted_RXE[..., top_k] if sorted_RXE.shape[-1] > top_k else sorted_RXE[..., -1]
    )
    return {"router_topk_mass": sorted_RXE[..., :top_k].sum(-1).mean().item(), "router_margin": margin.mean().item()}


def _split(kl_T, group_T, prefix: str) -> dict[str, float]:
    """Token-mean KL inside and outside `group_T`, and the group's share of the total."""
    total = kl_T.sum().item()
    inside, outside = kl_T[group_T], kl_T[~group_T]
    return {
        f"{prefix}_kl_mean": inside.mean().item() if len(inside) else 0.0,
        f"{prefix}_rest_kl_mean": outside.mean().item() if len(outside) else 0.0,
        f"{prefix}_kl_share": inside.sum().item() / total if total > 0 else 0.0,
    }


def _measure(trainer, batch, reencoded_T=None) -> dict[str, float]:
    """Mismatch with and without the replay, how often the trainer's own routing differs, how
    decisive its routers are, and where the mismatch lives.

    Per generated token: "differs" when the row that sampled it is routed, by the trainer alone,
    to another expert set than the record in some layer; "affected" when that row or an earlier
    generated row of the sequence differs (the token reads those rows through attention). The
    replay pins exactly the affected tokens' routing; the prompt's rows route normally on both
    sides and are not recorded, so a prompt routed differently by the generator stays invisible
    here. `ratio_floor` is the unaffected tokens' mean KL (without the replay) over all tokens'
    mean: the ratio a replay that left affected tokens no worse off than the rest would reach.
    `reencoded_T` (a bool per generated token, `reencoded_tokens_T`) splits the KL once more.
    """
    import torch

    from forge_rl.models.moe import last_routing, replay_routers
    from forge_rl.routing import routing_differs_NL
    from forge_rl.training.losses.corrections import k3_kl_NL

    mask_NL = batch.loss_mask_NL
    unreplayed = dataclasses.replace(batch, routed_experts_NLXK=None, routed_NL=None)
    routers = replay_routers(trainer.model)
    scores_BLE = []
    hooks = [router.register_forward_hook(lambda _m, _i, out: scores_BLE.append(out[2].detach())) for router in routers]
    try:
        trainer_without_NL = trainer.compute_logprobs(unreplayed)  # "pad": one forward, rows = the batch's rows
    finally:
        for hook in hooks:
            hook.remove()
    own_NLXK = last_routing(trainer.model)[:, :-1]
    trainer_with_NL = trainer.compute_logprobs(batch)
    # Token t (position >= 1) was sampled by row t - 1.
    recorded_NL = torch.zeros_like(mask_NL)
    recorded_NL[:, 1:] = batch.routed_NL[:, 1:] & mask_NL[:, 1:]
    differs_NL = torch.zeros_like(mask_NL)
    differs_NL[:, 1:] = routing_differs_NL(own_NLXK, batch.routed_experts_NLXK[:, 1:]) & recorded_NL[:, 1:]
    affected_NL = differs_NL.int().cummax(dim=1).values.bool()
    out = {
        "routing_differs_fraction": differs_NL[recorded_NL].float().mean().item(),
        "routing_affected_fraction": affected_NL[mask_NL].float().mean().item(),
    }
    sampling_rows_NL = recorded_NL[:, 1:]
    out.update(
        _router_decisiveness([s[:, :-1] for s in scores_BLE], batch.routed_experts_NLXK.shape[-1], sampling_rows_NL)
    )
    for name, trainer_NL in (("without", trainer_without_NL), ("with", trainer_with_NL)):
        log_ratio_T = (trainer_NL - batch.behaviour_logprobs_NL)[mask_NL]
        kl_T = k3_kl_NL(log_ratio_T.clamp(-20, 20))
        out[f"mismatch_kl_{name}"] = kl_T.mean().item()
        out[f"ratio_variance_{name}"] = torch.exp(log_ratio_T).var().item()
        # The mean is heavy-tailed: a few tokens routed through another expert can carry most of it.
        out[f"max_token_kl_{name}"] = kl_T.max().item()
        out.update(_split(kl_T, differs_NL[mask_NL], f"{name}/differs"))
        out.update(_split(kl_T, affected_NL[mask_NL], f"{name}/affected"))
        if reencoded_T is not None:
            out.update(_split(kl_T, reencoded_T, f"{name}/reencoded"))
    # No mismatch to remove (an fp32 generator at staleness 0): no ratio.
    without = out["mismatch_kl_without"]
    out["mismatch_kl_ratio"] = out["mismatch_kl_with"] / without if without > 0 else None
    out["ratio_floor"] = out["without/affected_rest_kl_mean"] / without if without > 0 else None
    if reencoded_T is not None:
        reencoded_without = out["without/reencoded_kl_mean"]
        out["reencoded_mismatch_kl_ratio"] = (
            out["with/reencoded_kl_mean"] / reencoded_without if reencoded_without > 0 else None
        )
    return out


def _measure_resubmitted(args: KeepRoutingArgs, trainer, model_dir: Path, episodes, heads) -> dict:
    """The mismatch of a batch whose completions were resubmitted to the trainer's weights now
    (version 1) after `resubmit_after` tokens, on the continued tokens apart: each was sampled by
    the weights the trainer holds (staleness 0), so its mismatch is numerics and routing only,
    but the record replayed on its head's rows is the version-0 decode's, not the routing of
    the prefill that encoded the KV it read."""
    import torch

    from forge_rl.core.batching import make_train_batch

    progress(f"bench keep-routing: resubmitting after {args.resubmit_after} tokens to version 1's weights")
    resubmitted = _resubmitted(args, trainer, model_dir, episodes, heads, version=1)
    batch = make_train_batch(resubmitted, pad_id=0)
    reencoded_T = reencoded_tokens_T([c for e in resubmitted for c in e.completions])
    if len(reencoded_T) != int(batch.loss_mask_NL.sum()):
        raise AssertionError(f"{len(reencoded_T)} flags for {int(batch.loss_mask_NL.sum())} generated tokens")
    measured = _measure(trainer, batch, torch.tensor(reencoded_T))
    measured["reencoded_tokens"] = sum(reencoded_T)
    progress(
        "bench keep-routing: resubmitted, on the continued tokens: "
        + ", ".join(
            f"{k} {measured[k]:.4g}"
            for k in ("without/reencoded_kl_mean", "with/reencoded_kl_mean", "reencoded_mismatch_kl_ratio")
            if measured.get(k) is not None
        )
    )
    return measured


def _prepare_model(args: KeepRoutingArgs, model_dir: Path) -> None:
    """OUT_DIR/model: the from-scratch model or a copy of --model-path, pre-trained when asked
    (figures in its pretrain.json), assembled beside and renamed into place."""
    import shutil

    from forge_rl.models.tiny import create_tiny_model

    partial = model_dir.with_name(f".{model_dir.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    if args.model_path is not None:
        hf_config = json.loads((args.model_path / "config.json").read_text())
        if "num_experts_per_tok" not in hf_config:
            raise ValueError(
                f"--model-path {args.model_path} is a dense model ({hf_config.get('architectures')}); "
                "bench keep-routing needs a Qwen3-MoE (a GRPO run with --model.tiny.num-experts, then forge-rl export)."
            )
        shutil.copytree(args.model_path, partial)
    else:
        create_tiny_model(args.model, partial)
    if args.pretrain_steps:
        progress(f"bench keep-routing: pre-training {args.pretrain_steps} steps on the task's text")
        (partial / "pretrain.json").write_text(json.dumps(_pretrain(args, partial), indent=2) + "\n")
    partial.rename(model_dir)


def main(args: KeepRoutingArgs) -> dict:
    from forge_rl.core.batching import make_train_batch
    from forge_rl.models.moe import routing_shape
    from forge_rl.models.titan import read_hf_config
    from forge_rl.training.trainer import PolicyTrainer, TrainerConfig

    args.out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = args.out_dir / "model"
    if not (model_dir / "config.json").is_file():
        _prepare_model(args, model_dir)
    progress(f"bench keep-routing: sampling {args.num_prompts} x {args.group_size} with routing recorded")
    episodes, heads = _sample(args, model_dir)
    batch = make_train_batch(episodes, pad_id=0)
    record = episodes[0].completions[0].routed_experts
    trainer = PolicyTrainer(TrainerConfig(keep_routing=True, batching="pad", lr=args.lr, seed=args.seed), model_dir)
    per_staleness = []
    for staleness in range(args.max_staleness + 1):
        measured: dict[str, Any] = {"staleness": staleness, **_measure(trainer, batch)}
        progress(
            "bench keep-routing: "
            + ", ".join(f"{k} {measured[k]:.4g}" for k in _PROGRESS_KEYS if measured.get(k) is not None)
        )
        if staleness == 1 and heads is not None:
            measured["resubmitted"] = _measure_resubmitted(args, trainer, model_dir, episodes, heads)
        per_staleness.append(measured)
        if staleness < args.max_staleness:
            trainer.train_step(batch)
    stale = [m["mismatch_kl_ratio"] for m in per_staleness if m["staleness"] > 0 and m["mismatch_kl_ratio"] is not None]
    fresh = per_staleness[0]
    shape = routing_shape(read_hf_config(model_dir))
    pretrain_json = model_dir / "pretrain.json"
    summary = {
        "mismatch_kl_ratio": fresh["mismatch_kl_ratio"],
        "mismatch_kl_ratio_by_staleness": [m["mismatch_kl_ratio"] for m in per_staleness],
        "mismatch_kl_ratio_stale": statistics.mean(stale) if stale else None,
        "mismatch_kl_without": fresh["mismatch_kl_without"],
        "mismatch_kl_with": fresh["mismatch_kl_with"],
        "ratio_floor": fresh["ratio_floor"],
        "routing_differs_fraction": fresh["routing_differs_fraction"],
        "differs_kl_share": fresh["without/differs_kl_share"],
        "affected_kl_share": fresh["without/affected_kl_share"],
        "router_topk_mass": fresh["router_topk_mass"],
        "generator_dtype": args.generator_dtype,
        "routing_bytes_per_token": record.bytes_per_token,
        "routing_differs_fraction_max": max(m["routing_differs_fraction"] for m in per_staleness),
        "num_generated_tokens": batch.num_generated_tokens,
        "mean_reward": statistics.mean(c.reward for e in episodes for c in e.completions),
        "model": {
            "path": None if args.model_path is None else str(args.model_path),
            "num_layers": shape.num_layers,
            "num_experts": shape.num_experts,
            "top_k": shape.top_k,
        },
        "pretrain": json.loads(pretrain_json.read_text()) if pretrain_json.is_file() else None,
        "per_staleness": per_staleness,
    }
    if heads is not None:
        resubmitted = per_staleness[1]["resubmitted"]
        summary.update(
            {
                "resubmit_after": args.resubmit_after,
                "reencoded_mismatch_kl_ratio": resubmitted["reencoded_mismatch_kl_ratio"],
                "reencoded_mismatch_kl_without": resubmitted["without/reencoded_kl_mean"],
                "reencoded_mismatch_kl_with": resubmitted["with/reencoded_kl_mean"],
                "reencoded_tokens": resubmitted["reencoded_tokens"],
            }
        )
    if args.reward_steps:
        summary.update(reward_curves(args))
    (args.out_dir / "keep_routing.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def reward_curves(args: KeepRoutingArgs) -> dict:
    """The demo recipe on a from-scratch MoE, per seed with Keep Routing and without: the mean
    reward and mismatch KL per step, the final rewards (mean of the last FINAL_REWARD_WINDOW
    steps), and a plot of the curves."""
    import time

    from forge_rl.bench.common import run_variant, seeded
    from forge_rl.config import GRPOConfig
    from forge_rl.observability.metric_names import MISMATCH_KL, REWARD_MEAN
    from forge_rl.observability.metrics import final_reward
    from forge_rl.observability.plot import plot_per_step, read_metrics
    from forge_rl.yaml_config import load_yaml_config

    base = load_yaml_config(GRPOConfig, args.reward_config)
    tiny = dataclasses.replace(
        base.model.tiny, num_experts=args.model.num_experts, num_experts_per_tok=args.model.num_experts_per_tok
    )
    base = dataclasses.replace(
        base,
        steps=args.reward_steps,
        model=dataclasses.replace(base.model, tiny=tiny),
        checkpoint=dataclasses.replace(base.checkpoint, enabled=False),
        generator=dataclasses.replace(base.generator, record_routing=True),
    )
    started = time.perf_counter()
    curves: dict[str, list[float]] = {}
    finals: dict[str, list[float]] = {"keep_routing": [], "without": []}
    mismatch: dict[str, list[float]] = {"keep_routing": [], "without": []}
    for seed in args.reward_seeds:
        for variant in finals:
            progress(f"bench keep-routing: GRPO on the MoE, {variant}, seed {seed}, {args.reward_steps} steps")
            config = seeded(base, seed)
            run = run_variant(
                config,
                args.out_dir / "reward-runs",
                f"{variant}-seed{seed}",
                trainer=dataclasses.replace(config.trainer, keep_routing=variant == "keep_routing"),
            )
            metrics = read_metrics(run)
            curves[f"{variant}, seed {seed}"] = [m[REWARD_MEAN] for m in metrics]
            finals[variant].append(final_reward(metrics))
            mismatch[variant].append(statistics.mean(m[MISMATCH_KL] for m in metrics))
    plot_per_step(curves, "mean reward", 0.0, args.out_dir / "reward_curves.png")
    return {
        "reward_curves": curves,
        "final_reward_keep_routing": finals["keep_routing"],
        "final_reward_without": finals["without"],
        "mismatch_kl_run_mean_keep_routing": mismatch["keep_routing"],
        "mismatch_kl_run_mean_without": mismatch["without"],
        "reward_runs": {
            "config": str(args.reward_config),
            "steps": args.reward_steps,
            "seeds": list(args.reward_seeds),
            "num_experts": tiny.num_experts,
            "num_experts_per_tok": tiny.num_experts_per_tok,
            "wall_s": time.perf_counter() - started,
        },
    }


_PROGRESS_KEYS = (
    "staleness",
    "mismatch_kl_without",
    "mismatch_kl_with",
    "mismatch_kl_ratio",
    "ratio_floor",
    "max_token_kl_without",
    "max_token_kl_with",
    "routing_differs_fraction",
    "routing_affected_fraction",
    "without/affected_kl_share",
    "with/affected_kl_mean",
    "with/affected_rest_kl_mean",
    "router_topk_mass",
    "router_margin",
)
"""What each staleness prints on stderr (keep_routing.json has every field)."""
