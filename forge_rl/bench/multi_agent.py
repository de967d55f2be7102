"""`forge-rl bench multi-agent`: chains of 1, 2, 3 roles run synchronously and asynchronously.

Each episode is a chain of `depth` roles (`forge_rl.envs.long_tail.ChainEnv`, an episode graph
of `forge_rl.envs.graph`): each role takes one turn after the one before it, and each role's
environment step awaits a Pareto latency (20 ms to 2 s, median about 40 ms), so one role's
completion time is long-tailed and the episode's reward is known only when its last role has
answered. Synchronously (max_policy_age 0) a step waits for its slowest chain; the deeper the
chain, the longer its slowest one (a sum of depth long-tailed waits, stragglers of every role). An
asynchronous loop keeps decoding other chains (of this step and the next ones) while those wait,
so its step time follows the pipeline's throughput instead. Per depth, the same recipe and real
engine run in both modes (the runs, timeline analysis and charts of `forge-rl bench
async-vs-sync`), into OUT_DIR/depth<d>.

The last line of stdout is the JSON summary: `speedup_depth_<d>` (sync wall per step over async,
per depth), the idle fractions of both modes per depth, and `speedup_grows_with_depth`. Figures go
to OUT_DIR/multi_agent.json.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from forge_rl.bench.async_vs_sync import AsyncVsSyncArgs, compare_modes, write_summary
from forge_rl.config import GRPOConfig
from forge_rl.envs.long_tail import CHAINS
from forge_rl.errors import ConfigError


@dataclass(frozen=True)
class MultiAgentArgs(AsyncVsSyncArgs):
    config: Path = Path("configs/bench_multi_agent_cpu.yaml")
    """Recipe config every run uses; its environment is replaced by each depth's chain."""
    out_dir: Path = Path("runs/bench-multi-agent")
    """Where every run directory, the JSON figures and the charts go."""
    depths: tuple[int, ...] = (1, 2, 3)
    """Chain depths (roles per episode) to compare, each in both modes."""


def chain_config(base: GRPOConfig, depth: int) -> GRPOConfig:
    """`base` playing chains of `depth` roles."""
    name = f"forge_rl.envs.long_tail:{CHAINS[depth].__name__}"
    return dataclasses.replace(base, environment=dataclasses.replace(base.environment, name=name))


def main(args: MultiAgentArgs) -> dict:
    from forge_rl.observability.metrics import progress
    from forge_rl.yaml_config import load_yaml_config

    unknown = [d for d in args.depths if d not in CHAINS]
    if unknown or not args.depths:
        raise ConfigError(f"--depths {list(args.depths)}: each must be one of {sorted(CHAINS)}. Set --depths 1 2 3.")
    base = load_yaml_config(GRPOConfig, args.config)
    per_depth = {}
    for depth in args.depths:
        progress(f"bench multi-agent: chains of {depth} role(s)")
        per_depth[depth] = compare_modes(
            chain_config(base, depth), dataclasses.replace(args, out_dir=args.out_dir / f"depth{depth}"), "multi-agent"
        )
    summary = summarize(per_depth)
    summary.update(
        config=str(args.config),
        max_policy_age_async=args.max_policy_age,
        by_depth={str(d): c for d, c in per_depth.items()},
    )
    write_summary(summary, args.out_dir / "multi_agent.json", "multi-agent")
    return summary


def summarize(per_depth: dict[int, dict]) -> dict:
    """The per-depth comparisons (`compare_modes`) as flat figures, and whether the speedup grows."""
    summary: dict = {"warnings": []}
    for depth, comparison in per_depth.items():
        summary[f"speedup_depth_{depth}"] = comparison["speedup"]
        for mode in ("sync", "async"):
            summary[f"wall_per_step_s_{mode}_depth_{depth}"] = comparison[mode]["wall_per_step_s"]
            summary[f"trainer_idle_fraction_{mode}_depth_{depth}"] = comparison[f"trainer_idle_fraction_{mode}"]
            summary[f"generator_idle_fraction_{mode}_depth_{depth}"] = comparison[f"generator_idle_fraction_{mode}"]
        summary["warnings"] += [f"depth {depth}: {warning}" for warning in comparison["warnings"]]
    speedups = [per_depth[d]["speedup"] for d in sorted(per_depth)]
    summary["speedup_grows_with_depth"] = all(a < b for a, b in zip(speedups, speedups[1:]))
    return summary
