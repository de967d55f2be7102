"""Which modules may import Monarch, vLLM and TorchTitan, checked over the whole package; every actor
endpoint is async.

The rule (docs/architecture.md): Monarch is imported by the actor shells and what owns processes
(actors/, launch, lifecycle, the store's actor and client, a benchmark that spawns actors); vLLM by
nobody at import time (the engine imports it inside its methods); TorchTitan only by the model
layer (models/). Everything else is plain Python and PyTorch: the functional core. Environments
(envs/) import not even torch or transformers.
"""

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "forge_rl"
HEAVY = ("monarch", "vllm", "torchtitan")
ALLOWED = {
    "monarch": (
        "forge_rl.actors.",
        "forge_rl.run.launch",
        "forge_rl.run.lifecycle",
        "forge_rl.plumbing.proc_main",  # the entry point of the processes forge_rl spawns
        "forge_rl.store.actors",
        "forge_rl.store.client",
        "forge_rl.bench.weight_sync",
        "forge_rl.bench.lora_sync",  # reuses weight_sync's load generator; spawns the store
    ),
    "vllm": (),
    "torchtitan": ("forge_rl.models.",),
}
"""Module-name prefixes that may import each package (directly or through other forge_rl modules)."""

# A sample of the core checked at run time too: the static check below reads only forge_rl's own
# imports, this one also catches a third-party package that pulls Monarch in.
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


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_time_imports(path: Path) -> set[str]:
    """Modules `path` imports when it is imported: module level, not under `if TYPE_CHECKING:`,
    not inside functions (a lazy import is the sanctioned way to use a heavy package)."""
    name, found = module_name(path), set()

    def visit(body) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
                module = ".".join(filter(None, [base, node.module]))
                found.add(module)
                found.update(f"{module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return found


def heavy_imports_by_module() -> dict[str, set[str]]:
    """module -> the heavy packages importing it imports, through any chain of forge_rl modules."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    direct = {name: import_time_imports(path) for name, path in modules.items()}

    def forge_modules(imported: str) -> list[str]:  # a.b.c imports the packages a and a.b too
        parts = imported.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules]

    result = {}
    for name in modules:
        seen, stack, heavy = {name}, [name], set()
        while stack:
            for imported in direct[stack.pop()]:
                if imported.split(".")[0] in HEAVY:
                    heavy.add(imported.split(".")[0])
                for module in forge_modules(imported):
                    if module not in seen:
                        seen.add(module)
                        stack.append(module)
        result[name] = heavy
    return result


def test_only_the_shells_import_monarch_and_only_the_model_layer_imports_torchtitan():
    violations = [
        f"{module} imports {package}"
        for module, packages in sorted(heavy_imports_by_module().items())
        for package in sorted(packages)
        if not module.startswith(ALLOWED[package])
    ]
    assert violations == []


def test_the_boundary_check_sees_imports_through_other_modules():
    heavy = heavy_imports_by_module()
    assert "monarch" in heavy["forge_rl.run.lifecycle"]  # through forge_rl.run.launch
    assert heavy["forge_rl.run.loop"] == set()


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
        "forge_rl.actors.rollouts", "forge_rl.config", "forge_rl.actors.generator_pool",
        "forge_rl.actors.scoring_stage", "forge_rl.store.actors", "forge_rl.core.columns",
    ],
    "a scorer's process": ["forge_rl.actors.scorer", "forge_rl.actors.scorer_supervisor", "forge_rl.scoring.scorers"],
    # The services' process hosts the weight store's index and volume (the volume serves files)
    # and the supervisors that spawn generators, scorers and frozen models.
    "the services' process": [
        "forge_rl.store.actors", "forge_rl.store.shm", "forge_rl.actors.generator_pool",
        "forge_rl.actors.scorer_supervisor", "forge_rl.actors.frozen_model_supervisor", "forge_rl.config",
    ],
    # A multi-host run probes every host before it spawns anything (forge_rl/run/launch.py).
    "a host's probe": ["forge_rl.actors.host_probe", "monarch.rdma"],
    # The run's controller spawns every actor (so imports their classes), runs the loop and the
    # lifecycle, and unpickles the trainer's replies (forge_rl/training/trainer_steps.py).
    "a run's controller": [
        "apps.grpo.main", "forge_rl.run.lifecycle", "forge_rl.run.loop", "forge_rl.actors.trainer",
        "forge_rl.actors.simulated_trainer", "forge_rl.training.trainer_steps",
        "forge_rl.core.checkpoint", "forge_rl.run.preflight",
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
