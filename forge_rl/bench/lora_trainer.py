"""LoRA vs full fine-tuning: trainer step time and peak memory, for `forge-rl bench lora-sync`.

`lora_vs_full_step(model_dir, lora)` runs each variant in its own fresh process (peak RSS only
grows within a process, so one process per variant is the only fair peak), one PolicyTrainer on
one process, the same long-tailed batch (`bench.trainer.long_tail_episodes`), one untimed warm-up
step, then `repeats` timed steps. Returns {"full": {...}, "lora": {...}, "lora_vs_full": {...}}
with the median step time (s) and the peak RSS (MiB) of each, and their ratios.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import resource
import statistics
import time
from pathlib import Path

from forge_rl.models.lora import LoRAConfig


def _measure(model_dir: str, lora: LoRAConfig, repeats: int, num_threads: int, queue) -> None:
    from forge_rl.bench.trainer import TrainerBenchArgs, long_tail_episodes
    from forge_rl.core.batching import make_train_batch
    from forge_rl.training.trainer import PolicyTrainer, TrainerConfig

    trainer = PolicyTrainer(TrainerConfig(num_threads=num_threads, lora=lora), model_dir)
    # Token ids below the tiny tokenizer's vocabulary: valid for any model at least that large.
    batch = make_train_batch(long_tail_episodes(TrainerBenchArgs(max_completion=64)), pad_id=0)
    trainer.train_step(batch)
    step_s = []
    for _ in range(repeats):
        started = time.perf_counter()
        trainer.train_step(batch)
        step_s.append(time.perf_counter() - started)
    queue.put(
        {"step_s": statistics.median(step_s), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    )


def lora_vs_full_step(
    model_dir: Path | str, lora: LoRAConfig = LoRAConfig(enabled=True), repeats: int = 3, num_threads: int = 1
) -> dict[str, dict[str, float]]:
    """Median trainer step time and peak RSS, full fine-tuning vs `lora` (enabled), each measured in
    a fresh single-process trainer on the same batch (module docstring)."""
    context = multiprocessing.get_context("spawn")
    results = {}
    for name, variant in (("full", LoRAConfig()), ("lora", dataclasses.replace(lora, enabled=True))):
        queue = context.Queue()
        process = context.Process(target=_measure, args=(str(model_dir), variant, repeats, num_threads, queue))
        process.start()
        results[name] = queue.get()
        process.join()
        if process.exitcode:
            raise RuntimeError(f"the {name} trainer measurement exited with code {process.exitcode}")
    results["lora_vs_full"] = {
        "step_time_ratio": results["lora"]["step_s"] / results["full"]["step_s"],
        "peak_rss_ratio": results["lora"]["peak_rss_mib"] / results["full"]["peak_rss_mib"],
    }
    return results
