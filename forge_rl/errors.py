"""The failures forge_rl names, in one place, and what each one does to a run.

Recoverable: the run goes on.
    GeneratorLost    a generator's process died during a call, or the call outlived its timeout
                     (a hung generator is replaced like a dead one); the rollout loop hands its
                     prompts out again and waits for the replacement (`forge_rl.actors.generator_pool`).
    ScorerLost       a scorer-side process (the scorer, its reward model or its judge) died during a
                     scoring call; the scorer's supervisor restarts them and scores the call's
                     episodes again (`forge_rl.scoring.restarts`). Never reaches the rollout loop.
                     Likewise a rank of the reference model or a distillation teacher under a
                     `token_logprobs` call (`forge_rl.actors.frozen_model_supervisor`).
Fatal: the run stops, every process of it is shut down, and the message says what to do.
    ConfigError      a config, file or machine that cannot run it; raised before anything
                     expensive starts (`forge_rl.config`, `forge_rl.run.preflight`).
    ProcessDied      a trainer rank or a service process died; the message names the command
                     that resumes the run (`forge_rl.run.lifecycle`).
    ProcessNotStarted  a process of the run showed no progress in starting for Monarch's spawn
                     bound (HYPERACTOR_MESH_PROC_SPAWN_MAX_IDLE); the message names the setting
                     (`forge_rl.run.launch.spawn_timed_out`, `forge_rl.run.lifecycle`).
    TrainStepTimedOut  a train step outlived train_step_timeout_s (a hung rank or collective); the
                     message names the flag that raises it and the command that resumes the run.
    ScorerFailed     the scorer died more than scorer.max_restarts times (a crash on every start, or
                     too little memory): restarting it again would not help (`forge_rl.scoring.restarts`);
                     or the reference model (teacher) more than reference.max_restarts
                     (scorer.teacher.max_restarts) times.
    NoLearningSignal  dynamic sampling filtered every group for dynamic_sampling_max_filtered_steps
                     steps' worth of groups in a row: no batch can be filled
                     (`forge_rl.core.advantages.DynamicSampling`); the message names what the groups held and the fixes.
    StoreError       the weight store refused an operation (`forge_rl.store.index`): a version
                     published twice, a lease on a version that is gone.
    SandboxUnavailable  (a ConfigError) this machine cannot confine untrusted code as
                     `forge_rl.envs.sandbox` promises; raised at its first use, never worked around.

Plain Python: importing this module imports nothing else of forge_rl, Monarch or vLLM.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot run: the message names the field, the value and the flag that fixes it."""


class GeneratorLost(RuntimeError):
    """Generator `index` died while serving a call (or is being replaced); nothing it was asked
    for came back. Recoverable: hand the call's prompts out again once it serves again."""

    def __init__(self, index: int, reason: str):
        super().__init__(f"generator {index} lost: {reason}")
        self.index = index
        self.reason = reason

    def __reduce__(self):  # crosses process boundaries (raised in the pool, caught in the loop)
        return type(self), (self.index, self.reason)


class GeneratorFailed(RuntimeError):
    """Generator `index` died and no replacement could be started (its host is gone, say): the
    pool gave it up. The run goes on with the others, or stops with this cause if it was the last."""

    def __init__(self, index: int, reason: str):
        super().__init__(f"generator {index} could not be replaced: {reason}")
        self.index = index
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.index, self.reason)


class ScorerLost(RuntimeError):
    """A scorer-side process died while scoring; the call's episodes were not scored (a completion
    is not to blame for it, so none is ERRORED). Recoverable: score them again once a restarted
    scorer serves. Raised through `guarded_group` (`forge_rl.scoring.scorers`), never turned into a
    completion's failure."""

    def __reduce__(self):  # crosses process boundaries (raised in the scorer, caught by its supervisor)
        return type(self), self.args


class ScorerFailed(RuntimeError):
    """The scorer (or the reference model, a teacher) died more than its max_restarts times; the
    message names the last cause and the flag."""

    def __reduce__(self):
        return type(self), self.args


class ProcessDied(RuntimeError):
    """A process of the run (a trainer rank, or the services) died; the message says how to resume."""


class ProcessNotStarted(RuntimeError):
    """A process of the run did not start within Monarch's spawn bound; the message names the
    setting that allows longer and what to look at."""


class TrainStepTimedOut(RuntimeError):
    """Train step `step` did not finish within `timeout_s` (GRPOConfig.train_step_timeout_s).

    Raised by the train loop (`forge_rl.run.loop`) without `resume_hint`; the lifecycle, which knows
    the run directory and its checkpoints, raises it again with the hint (`forge_rl.run.lifecycle`)."""

    def __init__(self, step: int, timeout_s: float, resume_hint: str = ""):
        super().__init__(
            f"train step {step} did not finish within train_step_timeout_s ({timeout_s:g} s): a trainer rank "
            "or one of its collectives is hung, so the run stopped. If steps of this run legitimately take "
            f"longer, raise --train-step-timeout-s. {resume_hint}".rstrip()
        )
        self.step = step
        self.timeout_s = timeout_s


class NoLearningSignal(RuntimeError):
    """Dynamic sampling found no group with a nonzero advantage on a token that trains for too
    long; the message names the setting, what the groups held and the fixes."""

    def __reduce__(self):  # crosses process boundaries (raised in the rollouts, caught by the controller)
        return type(self), self.args


class StoreError(RuntimeError):
    """The weight store refused an operation; the message says which version and why."""


def raised_by_actor(error: BaseException) -> BaseException:
    """The exception an actor's endpoint raised, unwrapped from Monarch's ActorError (which keeps
    it as `.exception`), so callers can catch the types above without importing Monarch."""
    return getattr(error, "exception", None) or error


def generator_lost(error: BaseException) -> GeneratorLost | None:
    """The GeneratorLost that `error` carries (raised by the pool, wrapped by Monarch), else None.
    Callers re-raise anything else unchanged, with Monarch's report of where it was raised."""
    unwrapped = raised_by_actor(error)
    return unwrapped if isinstance(unwrapped, GeneratorLost) else None


class SandboxUnavailable(ConfigError):
    """This machine cannot confine untrusted code as `forge_rl.envs.sandbox` states (no Landlock,
    no seccomp, not Linux, ...): the message names the missing mechanism and how to get it. Fatal:
    every episode that runs code would fail the same way, and running it unconfined is not an option."""
