"""A run's trained policy as an HF model directory: `forge-rl export RUN_DIR OUT_DIR`.

Loads the run's newest complete checkpoint (`forge_rl.core.checkpoint`) into one trainer process on
this machine and writes its weights with the run's config and tokenizer files
(`forge_rl.models.hf_checkpoint.export_hf_model_dir`): what vLLM, `transformers`, a later run's
`--model.path` and a distillation teacher's `--scorer.teacher.path` read. One process, whatever
parallelism trained it: DCP reshards on load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from forge_rl.core.checkpoint import TRAINER_DIR, newest_complete_checkpoint
from forge_rl.errors import ConfigError


def export_run(run_path: Path, out_dir: Path, checkpoint: Path | None = None) -> Path:
    """Write the policy of `run_path`'s newest complete checkpoint (or of `checkpoint`, one of its
    complete checkpoints) to `out_dir` (new or empty); returns `out_dir`."""
    # torch and TorchTitan: loaded only when exporting.
    from forge_rl.config import GRPOConfig
    from forge_rl.models.hf_checkpoint import export_hf_model_dir
    from forge_rl.run.run_dir import prepare_model_dir, saved_config_path
    from forge_rl.training.trainer import PolicyTrainer, TrainerConfig
    from forge_rl.yaml_config import load_yaml_config

    run_path = Path(run_path)
    checkpoint = newest_complete_checkpoint(run_path) if checkpoint is None else Path(checkpoint)
    if checkpoint is None:
        raise ConfigError(
            f"{run_path} has no complete checkpoint to export (RUN_DIR/checkpoints/step-*/COMPLETE). Run with "
            "--checkpoint.enabled true (the demo config does), or pass the run directory a run printed."
        )
    config = load_yaml_config(GRPOConfig, saved_config_path(run_path))
    model_dir = prepare_model_dir(config, run_path)
    trainer = PolicyTrainer(TrainerConfig(num_threads=config.trainer.num_threads), model_dir)
    trainer.load_checkpoint(checkpoint / TRAINER_DIR)
    return export_hf_model_dir(trainer.hf_state_dict(), model_dir, out_dir)


@dataclass(frozen=True)
class ExportArgs:
    run: Path
    """The run directory (RUN_DIR, as the run printed it)."""
    out: Path
    """Where the HF model directory goes (must not exist, or be empty)."""
