"""`forge-rl bench branches`: branch rollouts against plain GRPO, reward vs wall time.

The config (configs/bench_branches_cpu.yaml: the reward comes at the end of a long completion)
runs once per variant and seed, same steps and prompts per step:

- `branch`: the config as it is (its `branch.rule` set, docs/branches.md);
- `plain-equal`: `branch.rule none` with as many samples per prompt as a tree holds
  (`BranchConfig.max_completions_per_group`): resampling from the prompt what branching resamples
  from the pivots, at equal samples;
- `plain-roots`: `branch.rule none` with the config's group size: the same roots, no branches.

Figures per run: the final reward (last FINAL_REWARD_WINDOW steps), the seconds and steps until the
smoothed reward reaches `target_reward`, the tokens the generators sampled, the loop time. Per
variant over its seeds: the mean and spread (sample standard deviation; lowest, highest) of the
final reward, the mean time to the target over the runs that reached it, the mean generated
tokens. The last stdout line holds the flat figures, with `branch_over_plain_equal_generated_tokens`
and `branch_over_plain_equal_time_to_target` (below 1: branching is cheaper, faster). A result
that shows no gain is reported as it is. OUT_DIR/branches.json and OUT_DIR/branches.png (reward vs
seconds, one line per run).

Runs already finished in OUT_DIR with the same config are read, not run again (common.py
`reuse_or_run_variant`): `--seeds 0`, then `--seeds 0 1 2` adds two seeds.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from forge_rl.bench.common import (
    SMOOTHING_STEPS,
    final_reward_spread,
    reuse_or_run_variant,
    seeded,
    smoothed,
    steps_to,
    time_to_reward,
)
from forge_rl.config import GRPOConfig
from forge_rl.core.branches import BranchConfig
from forge_rl.errors import ConfigError
from forge_rl.observability.metric_names import GENERATED_TOKENS_TOTAL, REWARD_MEAN, WALL_TIME_S
from forge_rl.observability.metrics import final_reward, progress
from forge_rl.observability.plot import headless_pyplot, read_metrics, save_figure

VARIANTS = ("branch", "plain-equal", "plain-roots")


@dataclass(frozen=True)
class BranchesBenchArgs:
    config: Path = Path("configs/bench_branches_cpu.yaml")
    """Recipe config with branch rollouts on (branch.rule other than none): the `branch` variant."""
    steps: int | None = None
    """Trainer steps per run; unset: the config's."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """Each variant runs once per seed, as trainer.seed, task.seed and generator.seed (the initial
    model is the same)."""
    target_reward: float = 0.7
    """Smoothed reward whose first crossing is timed."""
    out_dir: Path = Path("runs/bench-branches")
    """Where the run directories, branches.json and branches.png go."""

    def __post_init__(self) -> None:
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds ({list(self.seeds)}) must be one or more distinct seeds. Set --seeds.")


def variant_changes(base: GRPOConfig) -> dict[str, dict]:
    """The `dataclasses.replace` fields of each variant."""
    if not base.branch.enabled:
        raise ConfigError(
            "bench branches compares branch rollouts with plain GRPO, and the config's branch.rule is none. "
            "Set branch.rule in the config (configs/bench_branches_cpu.yaml has one)."
        )
    samples = base.branch.max_completions_per_group(base.group_size)
    plain = BranchConfig()
    return {
        "branch": {},
        "plain-equal": {"branch": plain, "group_size": samples, "train_batch_size": base.prompts_per_step * samples},
        "plain-roots": {"branch": plain},
    }


def run_figures(metrics: list[dict], target: float) -> dict:
    rewards = [m[REWARD_MEAN] for m in metrics]
    return {
        "final_reward": final_reward(metrics),
        "time_to_target_s": time_to_reward(metrics, target),
        "steps_to_target": steps_to(rewards, target),
        "generated_tokens": metrics[-1][GENERATED_TOKENS_TOTAL],
        "loop_time_s": metrics[-1][WALL_TIME_S],
    }


def over_seeds(runs: list[dict]) -> dict:
    """A variant's figures over its runs: mean and spread of the final reward, how many reached the
    target and their mean time and steps to it (None when none did), the mean generated tokens and
    loop time."""
    finals = [r["final_reward"] for r in runs]
    reached = [r for r in runs if r["time_to_target_s"] is not None]
    return {
        "runs": len(runs),
        **final_reward_spread(finals),
        "reached_target": len(reached),
        "time_to_target_s_mean": statistics.mean(r["time_to_target_s"] for r in reached) if reached else None,
        "steps_to_target_mean": statistics.mean(r["steps_to_target"] for r in reached) if reached else None,
        "generated_tokens_mean": statistics.mean(r["generated_tokens"] for r in runs),
        "loop_time_s_mean": statistics.mean(r["loop_time_s"] for r in runs),
    }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def plot(paths: dict[str, dict[int, Path]], target: float, out: Path) -> None:
    plt = headless_pyplot()
    fig, axis = plt.subplots(figsize=(8, 4.5))
    colors = dict(zip(VARIANTS, ("tab:red", "tab:blue", "tab:gray")))
    for name, by_seed in paths.items():
        for seed, path in by_seed.items():
            metrics = read_metrics(path)
            axis.plot(
                [m[WALL_TIME_S] for m in metrics][SMOOTHING_STEPS - 1 :],
                smoothed([m[REWARD_MEAN] for m in metrics]),
                color=colors[name],
                lw=1,
                alpha=0.8,
                label=name if seed == min(by_seed) else None,
            )
    axis.axhline(target, color="gray", ls="--", lw=0.8)
    axis.set_xlabel("seconds since the loops started")
    axis.set_ylabel(f"mean reward, mean of {SMOOTHING_STEPS} steps")
    axis.grid(alpha=0.3)
    axis.legend()
    save_figure(fig, out)


def main(args: BranchesBenchArgs) -> dict:
    from forge_rl.yaml_config import load_yaml_config

    base = load_yaml_config(GRPOConfig, args.config)
    base = dataclasses.replace(
        base, steps=args.steps or base.steps, checkpoint=dataclasses.replace(base.checkpoint, enabled=False)
    )
    changes = variant_changes(base)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, dict[int, Path]] = {name: {} for name in VARIANTS}
    runs: dict[str, dict[int, dict]] = {name: {} for name in VARIANTS}
    for seed in args.seeds:
        for name in VARIANTS:
            progress(f"bench branches: {name}, seed {seed} ({base.steps} steps)")
            path = reuse_or_run_variant(seeded(base, seed), args.out_dir, f"{name}-seed{seed}", **changes[name])
            paths[name][seed] = path
            runs[name][seed] = run_figures(read_metrics(path), args.target_reward)
    summary: dict = {
        "steps": base.steps,
        "seeds": list(args.seeds),
        "target_reward": args.target_reward,
        "samples_per_prompt_branch": changes["plain-equal"]["group_size"],
        "group_size": base.group_size,
    }
    for name in VARIANTS:
        summary[name] = over_seeds(list(runs[name].values()))
        for key in ("final_reward_mean", "final_reward_stdev", "time_to_target_s_mean", "generated_tokens_mean"):
            summary[f"{key}_{name}"] = summary[name][key]
    branch, plain = summary["branch"], summary["plain-equal"]
    summary["branch_over_plain_equal_generated_tokens"] = _ratio(
        branch["generated_tokens_mean"], plain["generated_tokens_mean"]
    )
    summary["branch_over_plain_equal_time_to_target"] = _ratio(
        branch["time_to_target_s_mean"], plain["time_to_target_s_mean"]
    )
    summary["runs"] = runs
    plot(paths, args.target_reward, args.out_dir / "branches.png")
    (args.out_dir / "branches.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
