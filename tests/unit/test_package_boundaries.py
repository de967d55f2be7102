"""What importing forge_rl's modules loads, in a fresh interpreter; every actor endpoint is async.

The layers and the static bans live in the import contract (pyproject.toml `[tool.importlinter]`,
test_import_contract.py). Here the rules that hold at import time: no module of the functional core
loads Monarch, vLLM or TorchTitan (the engine imports vLLM inside its methods, the model layer
TorchTitan); environments load not even torch or transformers; the processes that train and serve
nothing start without torch.
"""

import inspect
import subprocess
import sys

import pytest

# A sample of the core checked at run time: the import contract (pyproject.toml, checked by
# test_import_contract.py) reads forge_rl's own import statements, lazy ones included; this also
# catches a third-party package that pulls Monarch in, and holds the import-time rules (vLLM and
# TorchTitan imported only inside the functions that use them).
CORE_MODULES = [
    "forge_rl.types",
    "forge_rl.errors",
    "forge_rl.config",
    "forge_rl.core.buffer",
    "forge_rl.core.admission",
    "forge_rl.run.loop",
    "forge_rl.run.recipes",
    "forge_rl.core.advantages",
    "forge_rl.core.batching",
    "forge_rl.core.columns",
    "forge_rl.training.losses.policy",
    "forge_rl.training.losses.corrections",
    "forge_rl.tasks.synthetic",
    "forge_rl.store.shm",
    "forge_rl.observability.metrics",
    "forge_rl.observability.metric_names",
    "forge_rl.observability.sinks",
    "forge_rl.core.accounting",
    "forge_rl.observability.timeline",
    "forge_rl.scoring.reward_workers",
    "forge_rl.scoring.scorers",
    "forge_rl.scoring.restarts",
    "forge_rl.scoring.reward_model",
    "forge_rl.run.preflight",
    "forge_rl.tasks.rewards",
    "forge_rl.tasks.reasoning_gym",
    "forge_rl.models.convert",
    "forge_rl.models.lora",
    "forge_rl.training.reference",
    "forge_rl.scoring.teacher",
    "forge_rl.scoring.judge",
    "forge_rl.plumbing.placement",
    "forge_rl.envs.environment",
    "forge_rl.envs.trajectory",
    "forge_rl.envs.renderers",
    "forge_rl.envs.runner",
    "forge_rl.envs.calculator",
    "forge_rl.envs.python_tool",
    "forge_rl.envs.sandbox",
    "forge_rl.envs.rollout",
    "forge_rl.envs.chat_client",
    "forge_rl.envs.tool_calls",
    "forge_rl.envs.openenv_adapter",
    "forge_rl.envs.verifiers_adapter",
]
ENV_MODULES = [m for m in CORE_MODULES if m.startswith("forge_rl.envs.")]
"""Environments are lighter still: the rollout shell may run them in processes of their own, beside
the generators, where importing torch (seconds, hundreds of MB) would be pure cost."""


def loaded_in_a_fresh_interpreter(modules: list[str], heavy: tuple[str, ...]) -> str:
    """Which of `heavy` a fresh interpreter holds after importing `modules` (comma-separated)."""
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + f"print(','.join(m for m in {heavy!r} if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_functional_core_imports_neither_monarch_nor_vllm_nor_torchtitan():
    assert loaded_in_a_fresh_interpreter(CORE_MODULES, ("monarch", "vllm", "torchtitan")) == ""


def test_environments_import_not_even_torch_or_transformers():
    assert loaded_in_a_fresh_interpreter(ENV_MODULES, ("torch", "transformers", "monarch", "vllm")) == ""


TORCH_FREE_PROCESSES = {
    # What parsing a command line imports: a bad flag is refused in well under a second.
    "the CLI validating a config": ["forge_rl.cli", "forge_rl.config"],
    # What a process unpickles to host these actors (their modules, their arguments' classes, the
    # handles they hold): they pass configs, episodes and calls on, and train or serve nothing; the
    # rollouts turn each batch into columns for the trainer (forge_rl/core/columns.py) without torch.
    "the rollouts' process": [
        "forge_rl.actors.rollouts",
        "forge_rl.config",
        "forge_rl.actors.generator_pool",
        "forge_rl.actors.scoring_stage",
        "forge_rl.store.actors",
        "forge_rl.core.columns",
    ],
    "a scorer's process": ["forge_rl.actors.scorer", "forge_rl.actors.scorer_supervisor", "forge_rl.scoring.scorers"],
    # The services' process hosts the weight store's index and volume (the volume serves files)
    # and the supervisors that spawn generators, scorers and frozen models.
    "the services' process": [
        "forge_rl.store.actors",
        "forge_rl.store.shm",
        "forge_rl.actors.generator_pool",
        "forge_rl.actors.scorer_supervisor",
        "forge_rl.actors.frozen_model_supervisor",
        "forge_rl.config",
    ],
    # A multi-host run probes every host before it spawns anything (forge_rl/run/launch.py).
    "a host's probe": ["forge_rl.actors.host_probe", "monarch.rdma"],
    # The run's controller spawns every actor (so imports their classes), runs the loop and the
    # lifecycle, and unpickles the trainer's replies (forge_rl/training/trainer_steps.py).
    "a run's controller": [
        "apps.grpo.main",
        "forge_rl.run.lifecycle",
        "forge_rl.run.loop",
        "forge_rl.actors.trainer",
        "forge_rl.actors.simulated_trainer",
        "forge_rl.training.trainer_steps",
        "forge_rl.core.checkpoint",
        "forge_rl.run.preflight",
    ],
}
"""Processes that must start without torch: importing it costs each ~3-4 s of CPU on this machine,
at every run's start, while the generators' vLLM and the trainer start on the same cores, and the
controller's and the services' come before any generator is spawned (docs/architecture.md,
"How processes start and end"). What they do at run time is checked by test_shutdown (the controller mid-run)."""


@pytest.mark.parametrize("process", sorted(TORCH_FREE_PROCESSES))
def test_processes_that_train_and_serve_nothing_import_no_torch(process):
    assert loaded_in_a_fresh_interpreter(TORCH_FREE_PROCESSES[process], ("torch", "transformers")) == ""


def test_the_adapters_import_without_the_packages_they_adapt():
    """openenv and verifiers are optional (verifiers needs Python >= 3.11): imported when an
    environment is made, never when forge_rl or an adapter module is."""
    adapters = ["forge_rl.envs.chat_client", "forge_rl.envs.openenv_adapter", "forge_rl.envs.verifiers_adapter"]
    assert loaded_in_a_fresh_interpreter(adapters, ("openenv", "verifiers", "openai")) == ""


@pytest.mark.parametrize(
    "module,name",
    [
        ("forge_rl.actors.scorer", "ScorerActor"),
        ("forge_rl.actors.scorer_supervisor", "ScorerSupervisor"),
        ("forge_rl.actors.rollouts", "RolloutsActor"),
        ("forge_rl.actors.generator", "GeneratorActor"),
        ("forge_rl.actors.generator_pool", "GeneratorPool"),
        ("forge_rl.actors.trainer", "TrainerActor"),
        ("forge_rl.actors.frozen_model", "FrozenModelActor"),
        ("forge_rl.actors.frozen_model_supervisor", "FrozenModelSupervisor"),
        ("forge_rl.actors.restarting_owner", "RestartingOwner"),
        ("forge_rl.actors.reward_model", "RewardModelActor"),
    ],
)
def test_every_actor_endpoint_is_async(module, name):
    """Monarch refuses actors that mix sync and async endpoints; forge_rl uses async throughout."""
    import importlib

    from monarch._src.actor.endpoint import EndpointProperty

    cls = getattr(importlib.import_module(module), name)
    endpoints = {k: v for k, v in vars(cls).items() if isinstance(v, EndpointProperty)}
    assert endpoints, f"{name} exposes no endpoint"
    for endpoint_name, prop in endpoints.items():
        assert inspect.iscoroutinefunction(prop._method), f"{name}.{endpoint_name} is not async"
