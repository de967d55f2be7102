"""On-policy distillation: a frozen teacher scores the student's own samples, token by token.

The student (the policy) samples completions as in GRPO; the teacher, a larger or better model
sharing the student's tokenizer, returns the logprob of each sampled token under its own
distribution (the frozen-model actor of `forge_rl.actors.frozen_model`, the same one that serves
the KL penalty's reference model). The per-token reverse KL on the sampled token,

    k_t = log pi_student(x_t | x_<t) - log pi_teacher(x_t | x_<t)

is a one-sample estimate of KL(student || teacher) at position t; its negative is the token's dense
reward (`Score.token_rewards`), added to the token's advantage unnormalized
(`forge_rl.core.advantages.token_advantages`): a token the teacher finds likelier than the student
did is pushed up, one it finds unlikely is pushed down, on every token, in every group, even when
every sample of the group gets the same task reward (where GRPO has no signal). Agarwal et al.
2024 (GKD), Gu et al. 2024 (MiniLLM), Thinking Machines' "On-Policy Distillation" (2025).

The student's logprob is the behaviour logprob the generator sampled with, and the teacher's is
taken under the same sampling distribution (the episode's temperature, the generator's top-k/top-p
kept set), so both describe the distribution the token was drawn from.

The reward is `scorer.teacher.weight * (-k_t)` per token, centered on the group's other samples at
that position once every scorer's dense rewards are added up (`center_on_group`, run by
`ScoreWriter`; `scorer.teacher.baseline none`: raw), alone (`scorer.reward_fn_weight 0`:
every completion's outcome reward is 0, so its group advantage is 0 and the teacher alone trains)
or on top of the task reward's group advantage. Plain Python: no Monarch here.
"""

from __future__ import annotations

import collections
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from forge_rl.errors import ConfigError
from forge_rl.observability import metric_names as m
from forge_rl.observability.timeline import Timeline
from forge_rl.store.index import version_key
from forge_rl.training.reference import ReferenceConfig
from forge_rl.types import Completion

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TeacherConfig(ReferenceConfig):
    """The teacher of on-policy distillation; unset `path`: none runs. It is served like the
    reference model (same fields for its processes, parallelism and threads)."""

    section: ClassVar[str] = "scorer.teacher"

    path: Path | None = None
    """HF model directory of the teacher (config.json, safetensors weights, tokenizer files). Its
    tokenizer must be the student's: checked before any process starts. Unset with `pin` other
    than fixed: the teacher is the policy itself (self-distillation)."""
    pin: Literal["fixed", "lagged", "ema", "best"] = "fixed"
    """fixed: the model at `path`, never changed. Self-distillation, the teacher a snapshot of the
    policy served by its own processes and refreshed from the weight store every
    `refresh_every_n_steps` steps (`TeacherPin`): lagged, policy version v - `versions_back`; ema,
    an exponential moving average of the versions at each refresh (`ema_decay`); best, the version
    published after the step with the highest mean reward so far. It starts as the initial policy."""
    versions_back: int = 4
    """pin lagged: how many versions behind the newest the teacher is right after a refresh
    (1 <= versions_back <= refresh_every_n_steps)."""
    refresh_every_n_steps: int = 4
    """Self-distillation: trainer steps between two refreshes of the teacher."""
    ema_decay: float = 0.5
    """pin ema: teacher <- ema_decay * teacher + (1 - ema_decay) * newest version, at each refresh."""
    keep_ema_average: bool = True
    """pin ema: after each refresh the teacher's process writes its average to
    RUN_DIR/teacher_ema.pt, so a replacement of that process serves the same average. Off: a replacement
    serves the newest version averaged in and the average starts again from it (a progress line
    says so); for a model whose write per refresh costs more than that."""
    weight: float = 1.0
    """Coefficient of the per-token reverse KL in each token's advantage:
    A_t += -weight * (log pi_student - log pi_teacher), less its baseline."""
    baseline: Literal["group", "none"] = "group"
    """group: each token's dense reward (the weighted -reverse KL, plus any other scorer's) less
    its mean over the group's other usable completions at the same position (`center_on_group`),
    which keeps every sampled token's direction and removes the part all samples share; none: the
    raw -reverse KL. See `center_on_group` for why."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(
                f"scorer.teacher.weight ({self.weight}) must be finite and > 0. Set --scorer.teacher.weight."
            )
        if self.pin == "fixed":
            return
        if self.path is not None:
            raise ValueError(
                f"scorer.teacher.path ({self.path}) with scorer.teacher.pin {self.pin}: a pinned teacher is a snapshot "
                "of the policy itself. Leave --scorer.teacher.path unset, or set --scorer.teacher.pin fixed."
            )
        if self.refresh_every_n_steps < 1:
            raise ValueError(
                f"scorer.teacher.refresh_every_n_steps ({self.refresh_every_n_steps}) must be >= 1. "
                "Set --scorer.teacher.refresh-every-n-steps."
            )
        if self.pin == "lagged" and not 1 <= self.versions_back <= self.refresh_every_n_steps:
            raise ValueError(
                f"scorer.teacher.versions_back ({self.versions_back}) must be in [1, refresh_every_n_steps "
                f"({self.refresh_every_n_steps})]: the teacher keeps one staged version, taken versions_back steps "
                "before the refresh that serves it. Set --scorer.teacher.versions-back or raise "
                "--scorer.teacher.refresh-every-n-steps."
            )
        if self.pin == "ema" and not 0 <= self.ema_decay < 1:
            raise ValueError(
                f"scorer.teacher.ema_decay ({self.ema_decay}) must be in [0, 1). Set --scorer.teacher.ema-decay."
            )

    @property
    def enabled(self) -> bool:
        """Whether a teacher runs: a fixed one at `path`, or a pinned snapshot of the policy."""
        return self.path is not None or self.pin != "fixed"


@dataclass(frozen=True)
class TeacherRefresh:
    """What the pinned teacher does after a trained step: `actions` in order, each "stage" (load
    policy version `version` from the weight store as the staged weights, blended as blend * teacher
    + (1 - blend) * version when `blend` is set) or "swap" (serve the staged weights from now on)."""

    actions: tuple[str, ...] = ()
    version: int | None = None
    blend: float | None = None


class TeacherPin:
    """Self-distillation's schedule: which policy version the teacher serves, decided after each
    trained step from (step, the version that step published, the step's mean reward). Plain
    Python; the recipe carries the refresh out on the teacher's actor (`stage`, `swap`).

    The weight store keeps only the newest versions, so a version the teacher will serve later is
    staged (copied into the teacher's process) while it is the newest, and swapped in at a refresh:

        lagged   stage the newest at steps s with (s + versions_back) % n == 0, swap at s % n == 0:
                 right after each refresh the teacher is version v - versions_back
        ema      at s % n == 0: stage teacher * decay + newest * (1 - decay), swap
        best     stage the newest after a step whose mean reward beats every earlier step's; swap at
                 s % n == 0 when a new best was staged (the version trained on the best batch: a
                 proxy for evaluating each version, which would cost generation)

    (n = refresh_every_n_steps.) `serving` is the version the teacher serves (0: the initial
    policy; for ema, the newest version blended in)."""

    def __init__(self, config: TeacherConfig):
        self.config = config
        self.serving = 0
        self._staged: int | None = None
        self._best_reward = -math.inf

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the schedule (JSON; an unset best reward is None)."""
        best = None if self._best_reward == -math.inf else self._best_reward
        return {"serving": self.serving, "staged": self._staged, "best_reward": best}

    def load_state_dict(self, state: dict) -> None:
        """Continue the schedule `state_dict` saved, as if the run had not stopped."""
        self.serving, self._staged = state["serving"], state["staged"]
        self._best_reward = -math.inf if state["best_reward"] is None else state["best_reward"]

    def after_step(self, step: int, policy_version: int, reward: float) -> TeacherRefresh:
        config = self.config
        refresh = step % config.refresh_every_n_steps == 0
        if config.pin == "ema":
            if not refresh:
                return TeacherRefresh()
            self.serving = policy_version  # an average is served as soon as it is made
            return TeacherRefresh(("stage", "swap"), policy_version, config.ema_decay)
        actions: list[str] = []
        if refresh and self._staged is not None:
            self.serving, self._staged = self._staged, None
            actions.append("swap")
        stage = None
        if config.pin == "lagged" and (step + config.versions_back) % config.refresh_every_n_steps == 0:
            stage = policy_version
        elif config.pin == "best" and reward > self._best_reward:
            self._best_reward, stage = reward, policy_version
        if stage is not None:
            self._staged = stage
            actions.append("stage")
        return TeacherRefresh(tuple(actions), stage)


def teacher_store_reader(incarnation: str, rank: int) -> str:
    """The weight-store reader id of a pinned teacher's rank: one per rank (each reads the version,
    and a host's shared copies count their readers by id), new with each incarnation (the store
    refuses a dead reader's id)."""
    return f"{incarnation}-rank{rank}"


class TeacherVersions:
    """The policy versions a pinned teacher's replacement must load again, and the weight-store
    leases that keep them there (the store keeps only the newest versions otherwise). Plain
    Python; the teacher's supervisor (`forge_rl.actors.frozen_model_supervisor`) acquires and
    releases the leases this names.

        lease v (`leased`), stage v: staged = v, and every lease beyond one each on served and
        staged is returned for release (`staged_now`); swap: served = staged (`swapped`), likewise.

    `served` 0 is the initial policy, loaded from the model directory, never leased."""

    def __init__(self) -> None:
        self.served = 0
        self.staged: int | None = None
        self._leases: collections.Counter[str] = collections.Counter()
        self.weights_file: str | None = None
        """A file with weights the teacher serves or has staged that the store does not hold
        (`save_teacher_weights`): a checkpoint's, which a resume loaded (the resumed run's store
        holds none of its versions), or the ema average the teacher wrote after a refresh. A
        replacement loads them from there."""
        self._served_in_file = self._staged_in_file = False

    def restored(self, checkpoint_file: str, served: int, staged: int | None) -> None:
        """A resume loaded `served` and `staged` from `checkpoint_file` (no lease holds them)."""
        self.served, self.staged, self.weights_file = served, staged, checkpoint_file
        self._served_in_file, self._staged_in_file = True, staged is not None

    def served_saved(self, weights_file: str) -> list[str]:
        """The teacher wrote the weights it serves (an ema average, nothing staged) to
        `weights_file`; returns the leases no longer needed (the served version's: a replacement
        loads the file instead)."""
        if self.staged is not None:
            raise RuntimeError(
                f"teacher weights saved with version {self.staged} staged: only an ema teacher's, after a swap"
            )
        self.weights_file, self._served_in_file = weights_file, True
        return self._surplus()

    def leased(self, key: str) -> None:
        """The supervisor holds one more lease on snapshot `key` (before staging it)."""
        self._leases[key] += 1

    def staged_now(self, version: int) -> list[str]:
        """The teacher staged `version`; returns the leases no longer needed."""
        self.staged, self._staged_in_file = version, False
        return self._surplus()

    def swapped(self) -> list[str]:
        """The teacher serves its staged version; returns the leases no longer needed."""
        if self.staged is not None:
            self.served, self.staged = self.staged, None
            self._served_in_file, self._staged_in_file = self._staged_in_file, False
        return self._surplus()

    def stage_failed(self) -> list[str]:
        """A stage failed: the lease taken for it is surplus unless served or staged still needs it."""
        return self._surplus()

    def reload_plan(self, pin: str) -> tuple[list[tuple], str | None]:
        """What a replacement teacher does after it is built, to serve what the dead one served:
        calls in order, each ("stage", version), ("swap",) or ("load", file, served, staged) (the
        weights a resume loaded, from its checkpoint's file), and a line to print (pin ema only: its
        average died with it, so it serves the newest version averaged in, and averages on from there)."""
        calls: list[tuple] = []
        if self._served_in_file or self._staged_in_file:
            # Exact, an ema average included: the weights as the checkpoint saved them.
            calls.append(("load", self.weights_file, self._served_in_file, self._staged_in_file))
        if self.served and not self._served_in_file:
            calls += [("stage", self.served), ("swap",)]
        if self.staged is not None and not self._staged_in_file:
            calls.append(("stage", self.staged))
        note = None
        if pin == "ema" and self.served and not self._served_in_file:  # written with ema_file off
            note = (
                f"teacher (pin ema): the averaged weights died with its process; the replacement serves policy "
                f"version {self.served} (the newest averaged in) and averages on from there"
            )
        return calls, note

    def _surplus(self) -> list[str]:
        needed = {
            version_key(v)
            for v, in_file in ((self.served, self._served_in_file), (self.staged, self._staged_in_file))
            if v and not in_file
        }
        surplus = []
        for key, count in list(self._leases.items()):
            extra = count - (key in needed)
            surplus += [key] * extra
            self._leases[key] -= extra
            if not self._leases[key]:
                del self._leases[key]
        return sorted(surplus)


class PinnedTeacherRefresh:
    """The recipe's `RunActors.after_publish` for self-distillation: `TeacherPin`'s schedule carried
    out on the teacher's supervisor (`stage`, `swap`, `forge_rl.actors.frozen_model_supervisor`);
    logs the version it serves. Each stage and swap is a busy interval on the run's timeline
    (components "teacher_stage" and "teacher_swap"): the swap is the moment the teacher's version
    changes, which the generators take no part in (they decode across it:
    tests/integration/test_judge_run.py checks it).

    Also one of the run's checkpointed parts (`RunActors.checkpointed`): a checkpoint holds the
    schedule (TEACHER_SCHEDULE_FILE) and the teacher's served and staged weights
    (TEACHER_WEIGHTS_FILE, an ema average included), so a resumed run's teacher serves what it
    served at the checkpoint and refreshes on the same schedule, instead of starting again from the
    initial policy."""

    def __init__(self, teacher, config: TeacherConfig):
        self.teacher = teacher
        self.pin = TeacherPin(config)

    async def __call__(self, step: int, policy_version: int, metrics: dict, timeline: Timeline) -> dict:
        refresh = self.pin.after_step(step, policy_version, metrics[m.REWARD_MEAN])
        for action in refresh.actions:
            with timeline.busy(f"teacher_{action}"):
                if action == "stage":
                    await self.teacher.stage.call_one(refresh.version, refresh.blend)
                else:
                    await self.teacher.swap.call_one()
        return {m.TEACHER_POLICY_VERSION: self.pin.serving}

    async def save_checkpoint(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        await self.teacher.save_checkpoint.call_one(str(directory / TEACHER_WEIGHTS_FILE))
        (directory / TEACHER_SCHEDULE_FILE).write_text(json.dumps(self.pin.state_dict()))

    async def load_checkpoint(self, directory: Path) -> None:
        weights = directory / TEACHER_WEIGHTS_FILE
        if not weights.is_file():
            raise FileNotFoundError(
                f"checkpoint {directory.parent} has no teacher weights ({weights}): it was written by a run without a "
                "pinned teacher, or by a forge_rl older than teacher checkpoints. Resume it with the config it was "
                "written with, or start a new run."
            )
        self.pin.load_state_dict(json.loads((directory / TEACHER_SCHEDULE_FILE).read_text()))
        await self.teacher.load_checkpoint.call_one(str(weights))


TEACHER_WEIGHTS_FILE = "teacher_weights.pt"
"""In a checkpoint's teacher directory: the served and staged weights (`save_teacher_weights`)."""
TEACHER_EMA_FILE = "teacher_ema.pt"
"""In the run directory: an ema teacher's average, written after each refresh (`keep_ema_average`)."""
TEACHER_SCHEDULE_FILE = "schedule.json"
"""In a checkpoint's teacher directory: `TeacherPin.state_dict()`."""


def pinned_teacher_refresh(teacher, config: TeacherConfig) -> PinnedTeacherRefresh:
    return PinnedTeacherRefresh(teacher, config)


def save_teacher_weights(
    path: Path,
    served: dict[str, torch.Tensor],
    served_version: int,
    staged: dict[str, torch.Tensor] | None,
    staged_version: int | None,
) -> None:
    """Write a pinned teacher's weights, written whole and then renamed into place."""
    import torch

    partial = path.with_name(path.name + ".partial")
    torch.save(
        {
            "served": {name: tensor.detach().cpu() for name, tensor in served.items()},
            "served_version": served_version,
            "staged": None if staged is None else {name: tensor.detach().cpu() for name, tensor in staged.items()},
            "staged_version": staged_version,
        },
        partial,
    )
    os.replace(partial, path)


def load_teacher_weights(path: Path) -> dict:
    """What `save_teacher_weights` wrote: served, served_version, staged, staged_version."""
    import torch

    return torch.load(path, weights_only=True)


def reverse_kl_token_rewards(completion: Completion, teacher_logprobs: list[float]) -> list[float]:
    """-(student logprob - teacher logprob) of each token of `completion`, [T]; 0 on context tokens
    (a multi-turn trajectory's prompt, observations and tool output: the student did not sample
    them, so their behaviour logprob is 0 and they never reach a loss)."""
    if len(teacher_logprobs) != completion.num_tokens:
        raise ValueError(f"{len(teacher_logprobs)} teacher logprobs for {completion.num_tokens} tokens")
    generated = completion.generated or [True] * completion.num_tokens
    return [
        teacher - student if sampled else 0.0
        for student, teacher, sampled in zip(completion.logprobs, teacher_logprobs, generated)
    ]


def center_on_group(token_rewards: list[list[float]], generated: list[list[bool]]) -> list[list[float]]:
    """Each completion's token rewards less a leave-one-out baseline: the mean, at the same
    position, over the group's other completions that sampled a token there (context tokens stay
    0 and out of every mean). Where no other completion sampled a token at that position (the tail
    of the longest completion), there is nothing to compare with, and the token keeps its raw
    reward, as with baseline none. The caller passes the group's usable completions only
    (`ScoreWriter`: ERRORED ones are never trained, so their rewards are no baseline).

    Why: -k_t on a sampled token is an unbiased but noisy signal. Its mean under the student's
    sampling is -KL(student || teacher) <= 0, so without a baseline nearly every sampled token is
    pushed down, by amounts that swing with how unlikely the teacher finds it, and the one the
    teacher prefers is found only through the renormalization. Subtracting what the group's other
    samples got at that position (a baseline, as GRPO subtracts its group mean from the outcome)
    leaves each token's advantage relative to its alternatives: on the demo from scratch
    (`forge-rl bench distill`, docs/benchmarks/README.md), the raw signal learns slower than GRPO
    and the centered one faster. The baseline leaves the sample itself out, so it does not
    depend on the token it judges (RLOO's baseline) and a position one sample alone reaches keeps
    its signal instead of being centered to exactly 0. Positions are compared as they are (token t
    of each sample), the same prefix length under the same prompt."""
    longest = max((len(r) for r in token_rewards), default=0)
    sums, counts = [0.0] * longest, [0] * longest
    for rewards, sampled in zip(token_rewards, generated):
        for position, (reward, is_sampled) in enumerate(zip(rewards, sampled)):
            if is_sampled:
                sums[position] += reward
                counts[position] += 1

    def centered(reward: float, position: int) -> float:
        others = counts[position] - 1
        return reward - (sums[position] - reward) / others if others else reward

    return [
        [centered(reward, t) if is_sampled else 0.0 for t, (reward, is_sampled) in enumerate(zip(rewards, sampled))]
        for rewards, sampled in zip(token_rewards, generated)
    ]


def check_same_tokenizer(teacher_dir: Path, student_dir: Path) -> None:
    """ConfigError unless the teacher and the student map every token to the same id: the teacher
    scores the student's token ids, which mean nothing under another vocabulary. Compares the
    tokenizers' full vocabularies (added and special tokens included) and their special tokens."""
    teacher, student = _vocabulary(teacher_dir), _vocabulary(student_dir)
    if teacher == student:
        return
    differing = sorted(token for token in teacher.keys() | student.keys() if teacher.get(token) != student.get(token))
    fix = (
        "Distill from a teacher with the student's tokenizer, or point --model.path at a student with "
        "the teacher's (for the tiny from-scratch student: a teacher built with forge_rl's character tokenizer)."
    )
    raise ConfigError(
        f"scorer.teacher.path ({teacher_dir}) has a different tokenizer than the student ({student_dir}): "
        f"{len(teacher)} vs {len(student)} entries, {len(differing)} tokens missing from one or with other "
        f"ids, e.g. {differing[:5]}. The teacher scores the student's token ids, so they must mean the same tokens. {fix}"
    )


def _vocabulary(model_dir: Path) -> dict[str, int]:
    """Token -> id of `model_dir`'s tokenizer.json (added tokens included), plus its special tokens
    by role from tokenizer_config.json (as "<role>:<token>" entries)."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir} has no tokenizer.json: the teacher and student tokenizers cannot be compared.")
    vocabulary = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    config_path = Path(model_dir) / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        for role in ("bos_token", "eos_token", "pad_token", "unk_token"):
            token = config.get(role)
            token = token.get("content") if isinstance(token, dict) else token
            if token is not None:
                vocabulary[f"{role}:{token}"] = vocabulary.get(token, -1)
    return vocabulary
