"""Checkpoints of a run, and what the controller needs to continue one. Plain Python (no Monarch).

    RUN_DIR/checkpoints/
      step-000120/          complete: renamed into place after COMPLETE was written
        trainer/            torch.distributed.checkpoint (DCP): every trainer rank writes its own
                            FSDP2/TP shards of the weights and AdamW moments, plus its torch RNG state
                            and the policy version (`forge_rl.training.trainer.PolicyTrainer.save_checkpoint`)
        controller.json     `ControllerState`: step, dataset position, prompt accounting, buffer, RNG
        teacher/            a self-distillation teacher's schedule and served and staged weights
                            (`forge_rl.scoring.teacher.PinnedTeacherRefresh`; only with one)
        COMPLETE            written last, once every trainer rank's shards are written (in the
                            background, while the next steps train:
                            `forge_rl.run.lifecycle.Lifecycle.save_checkpoint`), then the directory is
                            renamed from .step-000120.partial
      step-000160/
      .step-000200.partial  a save cut short (killed mid-write): never picked, removed by the next save

A checkpoint is taken between two optimizer steps, while generation goes on. Prompts that were
handed out but not yet trained at that moment (being generated, scored, or waiting in the buffer)
are re-issued after a resume, so none is skipped, and the prompts already trained are not trained
again: the rollouts' process lists every prompt index below the dataset cursor that is not settled
(trained, dropped as stale, skipped for a non-finite step, or restored with the buffer;
`forge_rl.core.accounting.PromptAccounting.unsettled_ids`), and the dataset hands those out again before any new
one. Prompt i depends only on (task, seed, i) (`forge_rl.tasks.synthetic`), so a re-issued prompt
is the same prompt.

What is not restored: vLLM's sampler state (a fresh engine starts from `generator.seed` again) and
the exact interleaving of asynchronous generation, so completions after a resume differ from those
of an uninterrupted run. The trainer's side is exact: the same batches after a resume give the same
losses and weights as without one (tests/integration/test_resume.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

CHECKPOINTS_DIR = "checkpoints"
TRAINER_DIR = "trainer"


def policy_trainer_dir(policy: str) -> str:
    """The checkpoint directory of one of the run's other policies' trainer (`policies`)."""
    return f"{TRAINER_DIR}-{policy}"


CONTROLLER_FILE = "controller.json"
COMPLETE_FILE = "COMPLETE"
_STEP_DIR = re.compile(r"step-(\d{6,})")


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints under RUN_DIR/checkpoints, and `forge-rl grpo --resume RUN_DIR` to continue (docs/checkpointing.md)."""

    enabled: bool = False
    """Write checkpoints. Off: a run that stops cannot be continued."""
    every_n_steps: int = 50
    """Steps between checkpoints (a checkpoint after step n when n is a multiple of this)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted once a newer one is complete."""
    save_buffer: bool = False
    """Also save the episodes waiting in the replay buffer, so a resume trains them instead of
    generating their prompts again. Off: those prompts are re-issued (the checkpoint stays small)."""
    on_shutdown: bool = True
    """Also checkpoint at the end of the run and when it is stopped with Ctrl-C or SIGTERM (after
    the optimizer step in flight, if any, finishes)."""
    partial_groups_on_error: Literal["refuse", "regenerate"] = "refuse"
    """What `--resume` does when the checkpoint's partial groups (`ControllerState.partial_groups`)
    cannot be continued: malformed, with token ids outside the model's vocabulary, or sampled under
    another tokenizer. refuse: stop before anything starts, naming the file and the problem.
    regenerate: warn, and generate those prompts again from the start (their saved tokens are
    counted as salvage_discarded_tokens)."""

    def __post_init__(self) -> None:
        checks = {
            "every_n_steps": (self.every_n_steps >= 1, ">= 1"),
            "keep_last": (self.keep_last >= 1, ">= 1 (the newest checkpoint is what --resume needs)"),
        }
        for name, (ok, constraint) in checks.items():
            if not ok:
                flag = name.replace("_", "-")
                raise ValueError(
                    f"checkpoint.{name} ({getattr(self, name)}) must be {constraint}. Set --checkpoint.{flag}."
                )


@dataclass
class ControllerState:
    """Everything besides the trainer's shards that a resume needs, as JSON."""

    step: int
    """Train-loop steps done (skipped non-finite steps included); the resumed run starts at step + 1."""
    policy_version: int
    """The trainer's policy version after `step` (fewer than `step` if steps were skipped)."""
    dataset_cursor: int
    """Prompt indices below this were handed out at least once."""
    reissue: list[int]
    """Prompt indices below the cursor not settled at the checkpoint: handed out again first."""
    accounting: dict[str, Any]
    """`PromptAccounting.state_dict()`."""
    buffer: dict[str, Any]
    """`ReplayBuffer.state_dict()`: tallies always, held episodes only with checkpoint.save_buffer."""
    num_generated_tokens: int
    rng: dict[str, Any]
    """The controller's python, numpy and torch RNG states (`capture_rng_state`)."""
    data_fingerprint: str | None = None
    """With data.path: the file's fingerprint (`forge_rl.data.files.FileSource.fingerprint`),
    which a resume must find unchanged, since the cursor counts rows of that file."""
    partial_groups: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The groups that were being generated a segment at a time (generator.segment_tokens), each
    as far as its last finished segment (`forge_rl.pipeline.partial_groups.PartialGroup.to_dict`):
    their prompts are among `reissue`, and a resume continues them from there."""
    tokenizer_fingerprint: str | None = None
    """The model directory's tokenizer (`forge_rl.tasks.tokenizer.tokenizer_fingerprint`) the
    partial groups' token ids were sampled under: a resume continues them only under the same one."""
    num_generators: int | None = None
    """The generator pool's size at the checkpoint (it changes while a run goes on: `forge-rl scale`):
    a resume starts that many unless --num-generators chooses another count."""
    policy_versions: dict[str, int] = dataclasses.field(default_factory=dict)
    """Each of the run's other policies' version after `step` (`policies`), by name; its trainer's
    shards are in `policy_trainer_dir(name)`."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ControllerState:
        return cls(**json.loads(text))


def checkpoints_root(run_path: Path) -> Path:
    return Path(run_path) / CHECKPOINTS_DIR


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def complete_checkpoints(run_path: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint of the run, oldest first. A directory counts only
    under its final name and with COMPLETE in it: a save cut short leaves neither."""
    root = checkpoints_root(run_path)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.fullmatch(path.name)
        if match and (path / COMPLETE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def newest_complete_checkpoint(run_path: Path) -> Path | None:
    complete = complete_checkpoints(run_path)
    return complete[-1][1] if complete else None


def begin_checkpoint(run_path: Path, step: int) -> Path:
    """An empty RUN_DIR/checkpoints/.step-NNNNNN.partial to write the checkpoint of `step` into."""
    partial = checkpoints_root(run_path) / f".{step_dir_name(step)}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def commit_checkpoint(partial: Path, controller: ControllerState) -> Path:
    """Write controller.json, then COMPLETE, then rename `partial` to its final name; returns it.

    The rename is atomic, so a reader sees either no checkpoint or a complete one. Writing the
    checkpoint of a step that already has one (a resumed run reaching it again) replaces it.
    """
    _write_synced(partial / CONTROLLER_FILE, controller.to_json())
    _write_synced(
        partial / COMPLETE_FILE, json.dumps({"step": controller.step, "policy_version": controller.policy_version})
    )
    final = partial.parent / step_dir_name(controller.step)
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    _fsync_dir(partial.parent)
    return final


def prune_checkpoints(run_path: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints, and any save or delete cut
    short; returns what was deleted. Call it only when no save is in progress.

    A checkpoint is renamed out of sight (`.step-NNNNNN.deleting`, atomic) before its files are
    deleted: a controller killed while deleting (test_resume kills one as soon as a checkpoint is
    complete, which is when the one before is pruned) left an empty `step-NNNNNN` behind, which no
    later prune removed; now it leaves a `.deleting` directory, and the next prune removes it."""
    root = checkpoints_root(run_path)
    complete = complete_checkpoints(run_path)
    doomed = [path for _, path in complete[: max(len(complete) - keep_last, 0)]]
    cut_short = [*root.glob(".step-*.partial"), *root.glob(".step-*.deleting")]
    out_of_sight = [path.rename(path.with_name(f".{path.name}.deleting")) for path in doomed]
    for path in [*cut_short, *out_of_sight]:
        shutil.rmtree(path, ignore_errors=True)
    return doomed + cut_short


def read_controller_state(checkpoint: Path) -> ControllerState:
    return ControllerState.from_json((checkpoint / CONTROLLER_FILE).read_text())


def capture_rng_state() -> dict[str, Any]:
    """This process's python, numpy and torch (CPU) RNG states as JSON-friendly values; numpy's and
    torch's only if this process imported them. The run's controller imports neither (torch's
    import costs seconds of CPU, docs/architecture.md; numpy's less, but the first checkpoint would
    hold training for it), and a library it never imported has drawn nothing to restore."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss]}
    if "numpy" in sys.modules:
        numpy_state = sys.modules["numpy"].random.get_state(legacy=False)
        numpy_state["state"]["key"] = numpy_state["state"]["key"].tolist()
        state["numpy"] = numpy_state
    if "torch" in sys.modules:
        state["torch"] = sys.modules["torch"].get_rng_state().tolist()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        numpy_state = dict(state["numpy"])
        numpy_state["state"] = {**numpy_state["state"], "key": np.array(numpy_state["state"]["key"], dtype=np.uint32)}
        np.random.set_state(numpy_state)
    if "torch" in state:
        import torch

        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def resume_hint(run_path: Path, config: CheckpointConfig) -> str:
    """What a user can do after the run stopped: the resume command, or how to enable checkpoints."""
    newest = newest_complete_checkpoint(run_path)
    if newest is not None:
        return f"Continue it from its newest complete checkpoint ({newest}) with: forge-rl grpo --resume {run_path}"
    if config.enabled:
        return (
            f"It had written no complete checkpoint yet (one is written every {config.every_n_steps} steps), "
            "so it cannot be continued; start it again (--checkpoint.every-n-steps sets how often)."
        )
    return (
        "Checkpoints are disabled (checkpoint.enabled is false), so it cannot be continued; start it again "
        "with --checkpoint.enabled (and --checkpoint.every-n-steps N) to be able to resume."
    )


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
