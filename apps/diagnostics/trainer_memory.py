"""Whether the trainer's own work grows its memory: PolicyTrainer alone, in this process, no Monarch.

    python apps/diagnostics/trainer_memory.py MODEL_DIR [--steps 600] [--checkpoint-every 50]
    torchrun --nproc_per_node 2 apps/diagnostics/trainer_memory.py MODEL_DIR   # two ranks on gloo, FSDP2

Each step is what a trainer rank does per step of a run: one `train_step` on a fixed batch (16
prompts x 8 completions of 24 tokens), the publish snapshot of the weights (`hf_state_dict`, kept
on CPU, then dropped), and every `--checkpoint-every` steps a DCP checkpoint (written, then
deleted). Prints the process's unique memory (USS) every 100 steps. MODEL_DIR: an HF model
directory, e.g. a run's RUN_DIR/model. The 30-minute soak saw the trainer ranks grow about 32 KB
per step each (docs/benchmarks/README.md, "soak"); this separates PolicyTrainer's work from what the
trainer actor adds around it (Monarch, the weight store's writer, the collectives between ranks).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
from pathlib import Path

import psutil
import torch

from forge_rl.core.batching import make_train_batch
from forge_rl.models.titan import ParallelConfig
from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
from forge_rl.types import Completion, Episode


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's: one FSDP2 shard per rank
    config = TrainerConfig(num_procs=world_size, parallel=ParallelConfig(dp_shard=world_size))
    trainer = PolicyTrainer(config, args.model_dir)
    episodes = [
        Episode(
            index,
            "M56=",
            "6",
            [1, 5, 6],
            completions=[Completion([5] * 24, [-0.5] * 24, [0] * 24, reward=float(k % 2)) for k in range(8)],
        )
        for index in range(16)
    ]
    batch = make_train_batch(episodes, pad_id=0)
    process, scratch = psutil.Process(), Path(tempfile.mkdtemp())
    try:
        for step in range(1, args.steps + 1):
            trainer.train_step(batch)
            snapshot = trainer.hf_state_dict(torch.float32, keep=True)
            del snapshot
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                trainer.save_checkpoint(str(scratch / f"step-{step}"))
                shutil.rmtree(scratch / f"step-{step}")
            if step % 100 == 0:
                gc.collect()
                print(
                    f"rank {trainer.rank} step {step}: USS {process.memory_full_info().uss / 2**20:.1f} MB", flush=True
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
