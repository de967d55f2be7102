"""The functional core imports neither Monarch nor vLLM; every actor endpoint is async."""

import inspect
import subprocess
import sys

import pytest

CORE_MODULES = [
    "forge_rl.types",
    "forge_rl.config",
    "forge_rl.buffer",
    "forge_rl.staleness",
    "forge_rl.advantages",
    "forge_rl.batching",
    "forge_rl.losses.policy",
    "forge_rl.losses.corrections",
    "forge_rl.tasks.synthetic",
    "forge_rl.store.shm",
    "forge_rl.metrics",
    "forge_rl.accounting",
    "forge_rl.timeline",
    "forge_rl.scoring",
    "forge_rl.preflight",
    "forge_rl.tasks.rewards",
    "forge_rl.reference",
    "forge_rl.placement",
]


def test_functional_core_imports_neither_monarch_nor_vllm_nor_torchtitan():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in CORE_MODULES)
        + "print(','.join(m for m in ('monarch', 'vllm', 'torchtitan') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


@pytest.mark.parametrize(
    "module,name",
    [
        ("forge_rl.actors.dataset", "DatasetActor"),
        ("forge_rl.actors.scorer", "ScorerActor"),
        ("forge_rl.actors.buffer", "ReplayBufferActor"),
        ("forge_rl.actors.generator", "GeneratorActor"),
        ("forge_rl.actors.generator_pool", "GeneratorPool"),
        ("forge_rl.actors.trainer", "TrainerActor"),
        ("forge_rl.actors.reference", "ReferenceActor"),
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
