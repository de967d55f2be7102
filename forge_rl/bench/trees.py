"""`forge-rl bench trees`: trained tokens/s of the trainer step with groups laid out as prefix
trees (trainer.batching=tree: a group's prompt computed once) against flat packing
(trainer.batching=pack: every sequence whole), per group size and prompt length.

One process, one randomly initialized Llama, one `PolicyTrainer`. For each cell (a group size G
and a prompt length P), a batch of `num_prompts` groups: G completions of lengths drawn uniformly
from [min_completion, max_completion] after each group's prompt. The two layouts take turns, one
step each, for `repeats` rounds after one warm-up round, the order alternating every round. Trained
tokens/s counts the batch's tokens (every sequence's prompt + completion, as the flat layouts
compute them) over the median step time; `tree_over_pack` is their ratio in that cell. The saving
grows with the share of the batch that is shared prefix: P / (P + mean completion), times (G - 1) / G.

Figures go to OUT_DIR/trees.json and OUT_DIR/trees.png; the last line of stdout is the JSON summary.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

LAYOUTS = ("pack", "tree")


@dataclass(frozen=True)
class TreesBenchArgs:
    out_dir: Path = Path("runs/bench-trees")
    """Where trees.json and trees.png go."""
    group_sizes: tuple[int, ...] = (8, 16)
    prompt_tokens: tuple[int, ...] = (64, 128, 256, 512)
    num_prompts: int = 1
    """Groups per batch."""
    min_completion: int = 32
    max_completion: int = 96
    repeats: int = 3
    """Timed rounds per cell; each times one step of each layout (after one untimed warm-up round)."""
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 768
    seed: int = 0
    num_threads: int = 2
    """Torch threads of the trainer (the machine this was written on has 2 cores)."""
    headline: tuple[int, int] = field(default=(8, 256))
    """The (group size, prompt length) cell whose ratio the summary leads with."""


def group_episodes(num_prompts: int, group_size: int, prompt_tokens: int, args: TreesBenchArgs) -> list:
    """`num_prompts` groups of `group_size` random completions after a random prompt each."""
    from forge_rl.tasks.tokenizer import VOCAB_SIZE
    from forge_rl.types import Completion, Episode

    rng = random.Random(args.seed * 1000 + group_size * 10 + prompt_tokens)
    episodes = []
    for e in range(num_prompts):
        completions = []
        for _ in range(group_size):
            n = rng.randint(args.min_completion, args.max_completion)
            completions.append(
                Completion(
                    token_ids=[rng.randrange(4, VOCAB_SIZE) for _ in range(n)],
                    logprobs=[rng.uniform(-3.0, -0.1) for _ in range(n)],
                    policy_versions=[0] * n,
                    reward=float(rng.random() < 0.5),
                )
            )
        prompt = [1] + [rng.randrange(4, VOCAB_SIZE) for _ in range(prompt_tokens - 1)]
        episodes.append(Episode(e, f"P{e}", "", prompt, completions))
    return episodes


def main(args: TreesBenchArgs) -> dict:
    from forge_rl.core.batching import make_train_batch
    from forge_rl.models.tiny import TinyModelConfig, create_tiny_model
    from forge_rl.training.trainer import PolicyTrainer, TrainerConfig

    if args.headline not in [(g, p) for g in args.group_sizes for p in args.prompt_tokens]:
        raise ValueError(f"headline {args.headline} is not a cell of group_sizes x prompt_tokens; set --headline G P")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.num_threads)
    started = time.perf_counter()
    cells = []
    with tempfile.TemporaryDirectory(prefix="forge_rl-bench-trees-") as tmp:
        model_dir = create_tiny_model(
            TinyModelConfig(
                hidden_size=args.hidden_size,
                num_layers=args.num_layers,
                num_heads=args.num_heads,
                num_kv_heads=args.num_heads,
                intermediate_size=args.intermediate_size,
                max_position_embeddings=max(args.prompt_tokens) + args.max_completion,
                seed=args.seed,
            ),
            Path(tmp) / "model",
        )
        config = TrainerConfig(num_threads=args.num_threads, seed=args.seed)
        trainer = PolicyTrainer(config, model_dir)
        layouts = {layout: dataclasses.replace(config, batching=layout) for layout in LAYOUTS}
        for group_size in args.group_sizes:
            for prompt_tokens in args.prompt_tokens:
                batch = make_train_batch(group_episodes(args.num_prompts, group_size, prompt_tokens, args), pad_id=0)
                step_s: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
                metrics: dict[str, dict] = {}
                for round_ in range(args.repeats + 1):
                    for layout in LAYOUTS if round_ % 2 == 0 else LAYOUTS[::-1]:
                        trainer.config = layouts[layout]  # one model and optimizer for both layouts
                        began = time.perf_counter()
                        metrics[layout] = trainer.train_step(batch)
                        if round_ > 0:  # round 0 warms up allocators and caches
                            step_s[layout].append(time.perf_counter() - began)
                cells.append(_cell(group_size, prompt_tokens, batch, step_s, metrics))
                print(_row(cells[-1]), flush=True)
    figures: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(args).items()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cells": cells,
        "wall_s": time.perf_counter() - started,
    }
    headline = next(c for c in cells if (c["group_size"], c["prompt_tokens"]) == tuple(args.headline))
    figures["summary"] = {
        "tree_over_pack": headline["tree_over_pack"],
        "group_size": headline["group_size"],
        "prompt_tokens": headline["prompt_tokens"],
        "trained_tokens_per_s_tree": headline["trained_tokens_per_s"]["tree"],
        "trained_tokens_per_s_pack": headline["trained_tokens_per_s"]["pack"],
        "shared_token_fraction": headline["shared_token_fraction"],
        "tree_over_pack_min": min(c["tree_over_pack"] for c in cells),
        "tree_over_pack_max": max(c["tree_over_pack"] for c in cells),
    }
    (args.out_dir / "trees.json").write_text(json.dumps(figures, indent=2))
    _plot(figures, args.out_dir / "trees.png")
    return figures["summary"]


def _cell(group_size: int, prompt_tokens: int, batch, step_s: dict[str, list[float]], metrics: dict[str, dict]) -> dict:
    tokens = sum(batch.row_lengths)
    per_s = {layout: tokens / statistics.median(samples) for layout, samples in step_s.items()}
    return {
        "group_size": group_size,
        "prompt_tokens": prompt_tokens,
        "trained_tokens": tokens,
        "step_s": step_s,
        "trained_tokens_per_s": per_s,
        "tree_over_pack": per_s["tree"] / per_s["pack"],
        # each round's two steps ran back to back: the median of their ratios
        "tree_over_pack_paired": statistics.median(p / t for p, t in zip(step_s["pack"], step_s["tree"])),
        "shared_token_fraction": metrics["tree"]["shared_token_fraction"],
        "padding_fraction": {layout: metrics[layout]["padding_fraction"] for layout in LAYOUTS},
    }


def _row(cell: dict) -> str:
    per_s = cell["trained_tokens_per_s"]
    return (
        f"group {cell['group_size']:>3} prompt {cell['prompt_tokens']:>4}: {cell['trained_tokens']:>6} tokens, "
        f"pack {per_s['pack']:>8.0f} tok/s, tree {per_s['tree']:>8.0f} tok/s, tree/pack {cell['tree_over_pack']:.2f}x "
        f"(paired {cell['tree_over_pack_paired']:.2f}x), shared {cell['shared_token_fraction']:.2f}"
    )


def _plot(figures: dict, out: Path) -> None:
    from forge_rl.observability.plot import headless_pyplot, save_figure

    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for group_size in sorted({c["group_size"] for c in figures["cells"]}):
        cells = [c for c in figures["cells"] if c["group_size"] == group_size]
        ax.plot(
            [c["prompt_tokens"] for c in cells],
            [c["tree_over_pack"] for c in cells],
            marker="o",
            label=f"group {group_size}",
        )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("trained tokens/s, tree over pack")
    ax.set_title("prefix-tree layout vs flat packing")
    ax.legend()
    save_figure(fig, out)
