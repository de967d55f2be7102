"""`forge-rl bench elastic`: the throughput of a run whose generator pool grows and shrinks while
it trains (`forge-rl scale`, `forge_rl.run.scaling`), on SIMULATED engines and trainer at large
counts or on real vLLM engines and the real trainer at small ones.

One run of `config` at a fixed batch through `counts` generators. With a simulated config
(configs/sim_scale.yaml: generators decode on a latency model of Qwen3-8B on one H100 each;
nothing is trained, `forge_rl.engines.simulated`) the trainer step costs nothing, so generation
sets the pace. With a real one (configs/grpo_tiny_cpu.yaml, `--counts 2 4 1`) the run trains as
it would, its trainer's step part of the pace, and a new generator starts a real engine. It goes
through `counts` generators in turn: it starts with the first, and after every
`steps_per_phase` steps asks for the next, the way the command does (a request the controller
reads after the step), and after one more step waits for the answer. Reported per phase: the
generators it had, how long the change took, and the generated and trained tokens per second over
its steps that ran with its whole pool, the first of them left out (`generated_tokens_per_s` counts what the generators
produced, `trained_tokens_per_s` what reached the loss). Also the prompt accounting of the whole
run (`accounting_ok`: none lost, none trained twice).

Figures go to OUT_DIR/elastic.json; the last line of stdout is the JSON summary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from forge_rl.config import GRPOConfig
from forge_rl.observability.metric_names import GENERATED_TOKENS_PER_S, NUM_GENERATORS, TRAINED_TOKENS_PER_S
from forge_rl.observability.metrics import progress
from forge_rl.observability.plot import read_metrics


@dataclass(frozen=True)
class ElasticArgs:
    config: Path = Path("configs/sim_scale.yaml")
    """The recipe config: a simulated one (generator.engine sim, trainer.engine sim), or a real one
    at small counts (configs/grpo_tiny_cpu.yaml)."""
    counts: tuple[int, ...] = field(default=(8, 32, 4))
    """The pool's size in each phase, in order."""
    steps_per_phase: int = 10
    prompts_per_step: int = 32
    """Fixed across the phases, so each phase's tokens/s shows what its pool feeds."""
    time_scale: float = 0.1
    """Wall seconds per simulated second (as bench scale's control-plane part)."""
    grace_s: float = 5.0
    """A removed generator's groups in flight get this long to finish (`forge-rl scale --grace-s`)."""
    answer_timeout_s: float = 600.0
    out_dir: Path = Path("runs/bench-elastic")


def main(args: ElasticArgs) -> dict:
    from forge_rl.bench.scale_runs import run_probed
    from forge_rl.errors import ConfigError
    from forge_rl.yaml_config import load_yaml_config

    base = load_yaml_config(GRPOConfig, args.config)
    if not args.counts or min(args.counts) < 1 or args.steps_per_phase < 2:
        raise ConfigError(
            f"--counts ({list(args.counts)}) must be generator counts >= 1 and --steps-per-phase ({args.steps_per_phase}) "
            ">= 2 (a phase's first step is left out of its figures)."
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if base.simulated:
        generator = dataclasses.replace(
            base.generator, sim=dataclasses.replace(base.generator.sim, time_scale=args.time_scale)
        )
        # A trainer step that costs nothing: generation sets the pace, so the pool's size shows.
        trainer = dataclasses.replace(
            base.trainer, sim=dataclasses.replace(base.trainer.sim, step_fixed_s=0.0, step_per_token_s=0.0)
        )
    else:
        generator, trainer = base.generator, base.trainer
    config = dataclasses.replace(
        base,
        run_dir=args.out_dir,
        run_name="elastic",
        steps=args.steps_per_phase * len(args.counts),
        num_generators=args.counts[0],
        train_batch_size=args.prompts_per_step * base.group_size,
        generator=generator,
        trainer=trainer,
        checkpoint=dataclasses.replace(base.checkpoint, enabled=False),  # a save would be part of a phase's time
    )
    assert config.run_name is not None  # set above
    shutil.rmtree(config.run_dir / config.run_name, ignore_errors=True)  # this benchmark's previous run
    phases = _Phases(config.run_dir / config.run_name, args)
    figures, run_path = run_probed(config, after_step=phases.after_step)
    metrics = read_metrics(run_path)
    per_phase = []
    for number, count in enumerate(args.counts):
        # The phase's steps trained with its whole pool, the first of them left out.
        phase_steps = metrics[number * args.steps_per_phase : (number + 1) * args.steps_per_phase]
        steps = [m for m in phase_steps if m[NUM_GENERATORS] == count][1:]
        if not steps:
            raise RuntimeError(
                f"phase {number} ({count} generators) had fewer than 2 steps with its whole pool: raise --steps-per-phase"
            )
        per_phase.append(
            {
                "generators": count,
                "steps_measured": len(steps),
                "change_s": phases.change_s[number - 1] if number else 0.0,
                "generated_tokens_per_s": statistics.mean(m[GENERATED_TOKENS_PER_S] for m in steps),
                "trained_tokens_per_s": statistics.mean(m[TRAINED_TOKENS_PER_S] for m in steps),
            }
        )
    accounting = figures["accounting"]
    summary = {
        "simulated": base.simulated,
        "counts": list(args.counts),
        "generated_tokens_per_s": [phase["generated_tokens_per_s"] for phase in per_phase],
        "trained_tokens_per_s": [phase["trained_tokens_per_s"] for phase in per_phase],
        "change_s": [phase["change_s"] for phase in per_phase[1:]],
        "accounting_ok": accounting["trained_more_than_once"] == 0
        and accounting["trained"] == config.steps * config.prompts_per_step,
        "phases": per_phase,
        "accounting": accounting,
    }
    (args.out_dir / "elastic.json").write_text(json.dumps(summary, indent=2))
    return summary


class _Phases:
    """After each phase's last step, ask for the next phase's pool (`request_scale`, as the
    command does: the controller reads it right after that step); after the next step, wait
    for the run's answer, so the rest of the phase runs with the new pool."""

    def __init__(self, run_path: Path, args: ElasticArgs):
        self.run_path, self.args = run_path, args
        self.change_s: list[float] = []
        self._pending: tuple[str, int, float] | None = None

    async def after_step(self, probe, step: int) -> None:
        from forge_rl.run.scaling import request_scale, wait_for_answer

        if self._pending is not None:
            request, target, started = self._pending
            self._pending = None
            answer = await asyncio.to_thread(wait_for_answer, self.run_path, request, self.args.answer_timeout_s)
            if "error" in answer:
                raise RuntimeError(f"the run could not scale to {target} generators: {answer['error']}")
            self.change_s.append(time.monotonic() - started)
        phase, into_phase = divmod(step, self.args.steps_per_phase)
        if into_phase == 0 and phase < len(self.args.counts):
            target = self.args.counts[phase]
            progress(f"bench elastic: after step {step}, {target} generators")
            self._pending = (request_scale(self.run_path, target, self.args.grace_s), target, time.monotonic())
