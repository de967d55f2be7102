"""`forge-rl bench trainer`: real tokens/s of the trainer step vs a bare TorchTitan loop, per layout.

One run, `num_procs` gloo processes (FSDP2 over dp_shard = num_procs; 1 = a single process), one
randomly initialized Llama, one long-tailed batch of episodes (a fixed prompt length plus
completions of Pareto(1) lengths between `min_completion` and `max_completion` tokens: most short,
a few long, as RL rollouts are). Four variants take turns, one step each, for `repeats` rounds
after one warm-up round; the order rotates every round so none always runs first:

    bare_pad      a bare TorchTitan loop on the same model and mesh: forward over the padded rows,
                  token cross-entropy on the generated tokens, backward, grad-norm clip, AdamW.
    forge_pad     PolicyTrainer.train_step with trainer.batching=pad (one padded row per completion).
    forge_bucket  ... with trainer.batching=bucket.
    forge_pack    ... with trainer.batching=pack.
    hf_pad        one process only: the same weights as transformers' LlamaForCausalLM, the
                  padded rows with their attention mask, the same loss, clip and AdamW: what a
                  transformers-based trainer (TRL's GRPOTrainer) computes per step on CPU.

Every variant trains on the same rows (each rank on its data-parallel shard). Tokens/s counts real
tokens only (prompt + completion, never padding) over the median step time (barrier to barrier).
Ratios: `vs_bare_torchtitan` = forge_pad / bare_pad (same layout: the framework's overhead),
`packing_speedup` = forge_pack / forge_pad, `bucketing_speedup` = forge_bucket / forge_pad;
with one process `vs_transformers` = forge_pad / hf_pad (the same padded rows: the model code) and
`forge_pack_vs_transformers_padded` = forge_pack / hf_pad (each trainer's own layout).

Figures go to OUT_DIR/trainer.json and OUT_DIR/trainer_throughput.png; the last line of stdout
is the JSON summary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

VARIANTS = ("bare_pad", "forge_pad", "forge_bucket", "forge_pack")
SINGLE_PROCESS_VARIANTS = ("hf_pad",)
"""Variants timed only with num_procs 1 (transformers' model is not sharded over the ranks)."""


@dataclass(frozen=True)
class TrainerBenchArgs:
    out_dir: Path = Path("runs/bench-trainer")
    """Where trainer.json and trainer_throughput.png go."""
    num_procs: int = 2
    """Trainer processes (gloo, FSDP2 with dp_shard = num_procs); 1 runs a single process."""
    repeats: int = 5
    """Timed rounds; each round times one step of every variant (after one untimed warm-up round)."""
    num_prompts: int = 4
    group_size: int = 8
    """Completions per prompt; the batch holds num_prompts * group_size rows."""
    prompt_tokens: int = 16
    min_completion: int = 4
    max_completion: int = 256
    """Completion lengths: min_completion / U, U uniform in (0, 1], capped here (Pareto(1))."""
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 768
    seed: int = 0
    num_threads: int = 1
    """Torch threads per process (the machine this was written on has 2 cores)."""


def long_tail_episodes(args: TrainerBenchArgs) -> list:
    from forge_rl.tasks.tokenizer import VOCAB_SIZE
    from forge_rl.types import Completion, Episode

    rng = random.Random(args.seed)
    episodes = []
    for e in range(args.num_prompts):
        completions = []
        for _ in range(args.group_size):
            n = min(int(args.min_completion / (1.0 - rng.random())), args.max_completion)
            completions.append(
                Completion(
                    token_ids=[rng.randrange(4, VOCAB_SIZE) for _ in range(n)],
                    logprobs=[rng.uniform(-3.0, -0.1) for _ in range(n)],
                    policy_versions=[0] * n,
                    reward=float(rng.random() < 0.5),
                )
            )
        prompt = [1] + [rng.randrange(4, VOCAB_SIZE) for _ in range(args.prompt_tokens - 1)]
        episodes.append(Episode(e, f"P{e}", "", prompt, completions))
    return episodes


def next_token_loss(
    logits_NLV: torch.Tensor, input_ids_NL: torch.Tensor, loss_mask_NL: torch.Tensor, global_tokens: int
) -> torch.Tensor:
    """Cross-entropy of each row's next token on its generated tokens, summed over this rank's and
    divided by the batch's (FSDP2 sums gradients over ranks): the loss of the reference loops."""
    token_loss = torch.nn.functional.cross_entropy(
        logits_NLV[:, :-1].float().flatten(0, 1), input_ids_NL[:, 1:].flatten(), reduction="none"
    )
    return (token_loss * loss_mask_NL[:, 1:].flatten()).sum() / global_tokens


class BareTitanLoop:
    """What a plain TorchTitan training loop does per step, on the same model build and mesh."""

    def __init__(self, model_dir: Path, trainer_config, device: torch.device) -> None:
        from forge_rl.models.titan import build_titan_model

        self.model, _ = build_titan_model(model_dir, trainer_config.parallel, device)
        self.device = device
        self.max_grad_norm = trainer_config.max_grad_norm
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=trainer_config.lr, eps=trainer_config.adam_eps, foreach=True
        )

    def step(self, input_ids_NL: torch.Tensor, loss_mask_NL: torch.Tensor, global_tokens: int) -> float:
        from torch.distributed.tensor import DTensor
        from torchtitan.distributed.utils import clip_grad_norm_

        logits_NLV = self.model(input_ids_NL.to(self.device))
        if isinstance(logits_NLV, DTensor):
            logits_NLV = logits_NLV.full_tensor()
        loss = next_token_loss(logits_NLV, input_ids_NL.to(self.device), loss_mask_NL.to(self.device), global_tokens)
        loss.backward()
        clip_grad_norm_(list(self.model.parameters()), self.max_grad_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


class TransformersLoop:
    """The same step in transformers' LlamaForCausalLM, loaded from the same HF files."""

    def __init__(self, model_dir: Path, trainer_config) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.max_grad_norm = trainer_config.max_grad_norm
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=trainer_config.lr, eps=trainer_config.adam_eps, foreach=True
        )

    def step(
        self,
        input_ids_NL: torch.Tensor,
        attention_mask_NL: torch.Tensor,
        loss_mask_NL: torch.Tensor,
        global_tokens: int,
    ) -> float:
        logits_NLV = self.model(input_ids=input_ids_NL, attention_mask=attention_mask_NL).logits
        loss = next_token_loss(logits_NLV, input_ids_NL, loss_mask_NL, global_tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def _run_rank(rank: int, port: int, args: TrainerBenchArgs, model_dir: Path, out: Path) -> None:
    import torch.distributed as dist

    from forge_rl.core.batching import make_train_batch
    from forge_rl.models.titan import ParallelConfig
    from forge_rl.training.trainer import PolicyTrainer, TrainerConfig

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.num_procs))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    config = TrainerConfig(
        num_procs=args.num_procs,
        parallel=ParallelConfig(dp_shard=args.num_procs),
        num_threads=args.num_threads,
        seed=args.seed,
    )
    trainer = PolicyTrainer(config, model_dir)  # joins the process group
    bare = BareTitanLoop(model_dir, config, trainer.device)
    variants = VARIANTS + (SINGLE_PROCESS_VARIANTS if args.num_procs == 1 else ())
    hf = TransformersLoop(model_dir, config) if "hf_pad" in variants else None
    batch = make_train_batch(long_tail_episodes(args), pad_id=0)
    dp_rank, dp_size = (dist.get_rank(), args.num_procs) if args.num_procs > 1 else (0, 1)
    shard = batch.shard(dp_rank, dp_size)
    configs = {v: dataclasses.replace(config, batching=v.split("_")[1]) for v in VARIANTS if v.startswith("forge")}
    metrics: dict[str, dict] = {}

    def run(variant: str) -> None:
        if variant == "bare_pad":
            bare.step(shard.input_ids_NL, shard.loss_mask_NL, batch.num_generated_tokens)
        elif variant == "hf_pad":
            assert hf is not None  # "hf_pad" is among the variants only when hf is built
            hf.step(shard.input_ids_NL, attention_mask_NL, shard.loss_mask_NL, batch.num_generated_tokens)
        else:
            trainer.config = configs[variant]  # one model and optimizer for the three layouts
            metrics[variant] = trainer.train_step(batch)

    lengths = torch.tensor(shard.row_lengths)
    attention_mask_NL = (torch.arange(shard.input_ids_NL.shape[1])[None, :] < lengths[:, None]).long()
    step_s: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(args.repeats + 1):
        shift = round_ % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            _barrier()
            started = time.perf_counter()
            run(variant)
            _barrier()
            if round_ > 0:  # round 0 warms up allocators and caches
                step_s[variant].append(time.perf_counter() - started)
    if rank == 0:
        lengths = batch.row_lengths
        torch.save(
            {
                "step_s": step_s,
                "metrics": metrics,
                "lengths": lengths,
                "num_real_tokens": sum(lengths),
                "num_generated_tokens": batch.num_generated_tokens,
                "padded_slots": len(lengths) * max(lengths),
                "num_params": sum(p.numel() for p in trainer.model.parameters()),
            },
            out,
        )  # DTensor: global
    if args.num_procs > 1:
        dist.destroy_process_group()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(args: TrainerBenchArgs) -> dict:
    import torch.multiprocessing as mp

    from forge_rl.models.tiny import TinyModelConfig, create_tiny_model

    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="forge_rl-bench-trainer-") as tmp:
        model_dir = create_tiny_model(
            TinyModelConfig(
                hidden_size=args.hidden_size,
                num_layers=args.num_layers,
                num_heads=args.num_heads,
                num_kv_heads=args.num_heads,
                intermediate_size=args.intermediate_size,
                max_position_embeddings=args.prompt_tokens + args.max_completion,
                seed=args.seed,
            ),
            Path(tmp) / "model",
        )
        out = Path(tmp) / "rank0.pt"
        if args.num_procs == 1:
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                os.environ.pop(name, None)
            torch.set_num_threads(args.num_threads)
            _run_rank(0, 0, args, model_dir, out)
        else:
            mp.spawn(_run_rank, args=(_free_port(), args, model_dir, out), nprocs=args.num_procs, join=True)
        raw = torch.load(out)
    figures = _figures(args, raw)
    figures["wall_s"] = time.perf_counter() - started
    (args.out_dir / "trainer.json").write_text(json.dumps(figures, indent=2))
    _plot(figures, args.out_dir / "trainer_throughput.png")
    print(_table(figures), flush=True)
    return figures["summary"]


def _figures(args: TrainerBenchArgs, raw: dict) -> dict:
    real = raw["num_real_tokens"]
    variants = {}
    for variant, samples in raw["step_s"].items():
        median = statistics.median(samples)
        variants[variant] = {
            "step_s_median": median,
            "step_s_min": min(samples),
            "step_s_max": max(samples),
            "step_s": samples,
            "real_tokens_per_s": real / median,
            "generated_tokens_per_s": raw["num_generated_tokens"] / median,
            "padding_fraction": raw["metrics"].get(variant, {}).get("padding_fraction", 1 - real / raw["padded_slots"]),
        }

    def ratio(a: str, b: str) -> float:
        return variants[a]["real_tokens_per_s"] / variants[b]["real_tokens_per_s"]

    def paired(a: str, b: str) -> float:
        """Median over rounds of the per-round ratio (each round's steps ran back to back)."""
        return statistics.median(s_b / s_a for s_a, s_b in zip(raw["step_s"][a], raw["step_s"][b]))

    lengths = raw["lengths"]
    summary = {
        "vs_bare_torchtitan": ratio("forge_pad", "bare_pad"),
        "packing_speedup": ratio("forge_pack", "forge_pad"),
        "bucketing_speedup": ratio("forge_bucket", "forge_pad"),
        "forge_pack_vs_bare_padded": ratio("forge_pack", "bare_pad"),
        "vs_bare_torchtitan_paired": paired("forge_pad", "bare_pad"),
        "packing_speedup_paired": paired("forge_pack", "forge_pad"),
        "real_tokens_per_s_forge_pack": variants["forge_pack"]["real_tokens_per_s"],
        "real_tokens_per_s_bare_pad": variants["bare_pad"]["real_tokens_per_s"],
        "padding_fraction_pad": variants["forge_pad"]["padding_fraction"],
        "padding_fraction_pack": variants["forge_pack"]["padding_fraction"],
        "num_procs": args.num_procs,
    }
    if "hf_pad" in variants:
        summary.update(
            {
                "vs_transformers": ratio("forge_pad", "hf_pad"),
                "vs_transformers_paired": paired("forge_pad", "hf_pad"),
                "forge_pack_vs_transformers_padded": ratio("forge_pack", "hf_pad"),
                "real_tokens_per_s_hf_pad": variants["hf_pad"]["real_tokens_per_s"],
                "transformers_version": _transformers_version(),
            }
        )
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(args).items()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "batch": {
            "rows": len(lengths),
            "real_tokens": raw["num_real_tokens"],
            "generated_tokens": raw["num_generated_tokens"],
            "padded_slots": raw["padded_slots"],
            "longest": max(lengths),
            "median_length": statistics.median(lengths),
            "lengths": lengths,
        },
        "num_params": raw["num_params"],
        "variants": variants,
        "summary": summary,
    }


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _table(figures: dict) -> str:
    batch = figures["batch"]
    lines = [
        f"trainer bench: {figures['args']['num_procs']} process(es), {figures['num_params'] / 1e6:.1f}M params, "
        f"{batch['rows']} rows, {batch['real_tokens']} real tokens (median row {batch['median_length']}, "
        f"longest {batch['longest']}), padded {batch['padded_slots']} slots",
        f"{'variant':<14}{'step s (median)':>16}{'min':>8}{'max':>8}{'real tok/s':>12}{'padding':>9}",
    ]
    for name, v in figures["variants"].items():
        lines.append(
            f"{name:<14}{v['step_s_median']:>16.3f}{v['step_s_min']:>8.3f}{v['step_s_max']:>8.3f}"
            f"{v['real_tokens_per_s']:>12.0f}{v['padding_fraction']:>9.2f}"
        )
    s = figures["summary"]
    lines.append(
        f"vs_bare_torchtitan {s['vs_bare_torchtitan']:.3f} (paired {s['vs_bare_torchtitan_paired']:.3f}), "
        f"packing_speedup {s['packing_speedup']:.2f}x, bucketing_speedup {s['bucketing_speedup']:.2f}x, "
        f"forge pack vs bare padded {s['forge_pack_vs_bare_padded']:.2f}x"
    )
    if "vs_transformers" in s:
        lines.append(
            f"vs_transformers {s['vs_transformers']:.3f} (paired {s['vs_transformers_paired']:.3f}), "
            f"forge pack vs transformers padded {s['forge_pack_vs_transformers_padded']:.2f}x"
        )
    return "\n".join(lines)


def _plot(figures: dict, out: Path) -> None:
    from forge_rl.observability.plot import headless_pyplot, save_figure

    plt = headless_pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(figures["variants"])
    medians = [figures["variants"][n]["real_tokens_per_s"] for n in names]
    real = figures["batch"]["real_tokens"]
    low = [m - real / figures["variants"][n]["step_s_max"] for n, m in zip(names, medians)]
    high = [real / figures["variants"][n]["step_s_min"] - m for n, m in zip(names, medians)]
    left.bar(
        names,
        medians,
        yerr=[low, high],
        capsize=4,
        color=["grey", "tab:blue", "tab:orange", "tab:green", "tab:purple"][: len(names)],
    )
    left.set_ylabel("real tokens/s (median; bars: min-max)")
    left.set_title(f"trainer step, {figures['args']['num_procs']} gloo process(es)")
    left.tick_params(axis="x", rotation=20)
    right.hist(figures["batch"]["lengths"], bins=30)
    right.set_xlabel("row length (prompt + completion)")
    right.set_ylabel("rows")
    right.set_title("the long-tailed batch")
    save_figure(fig, out)
