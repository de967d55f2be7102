"""`forge-rl bench multi-agent`'s summary (forge_rl/bench/multi_agent.py): per-depth speedups as
flat figures (the CLI's last line keeps no nested object), and whether they grow with the chain."""

from __future__ import annotations

import pytest

from forge_rl.bench.multi_agent import MultiAgentArgs, chain_config, main, summarize
from forge_rl.config import GRPOConfig
from forge_rl.envs.rollout import resolve_environment
from forge_rl.errors import ConfigError


def comparison(speedup: float) -> dict:
    """A fake of `compare_modes`'s result: only the figures the summary reads."""
    mode = {"wall_per_step_s": 1.0}
    return {
        "speedup": speedup,
        "warnings": [],
        "sync": mode,
        "async": mode,
        "trainer_idle_fraction_sync": 0.8,
        "trainer_idle_fraction_async": 0.3,
        "generator_idle_fraction_sync": 0.5,
        "generator_idle_fraction_async": 0.1,
    }


def test_the_summary_gives_each_depths_speedup_and_whether_it_grows():
    summary = summarize({1: comparison(1.5), 2: comparison(2.0), 3: comparison(2.4)})
    assert (summary["speedup_depth_1"], summary["speedup_depth_2"], summary["speedup_depth_3"]) == (1.5, 2.0, 2.4)
    assert summary["speedup_grows_with_depth"] is True
    assert summary["trainer_idle_fraction_sync_depth_2"] == 0.8
    assert not any(isinstance(value, dict) for value in summary.values())
    assert summarize({1: comparison(1.5), 2: comparison(1.4)})["speedup_grows_with_depth"] is False


def test_each_depth_plays_its_chain_and_an_unknown_depth_is_refused_before_any_run():
    config = chain_config(GRPOConfig(), 2)
    assert len(resolve_environment(config.environment.name)(0, 0).seats) == 2
    with pytest.raises(ConfigError, match="--depths"):
        main(MultiAgentArgs(depths=(1, 9)))
