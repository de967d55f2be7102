import atexit
import os
import shutil
import tempfile

import pytest
import torch

from forge_rl.models.tiny import CACHE_ENV

# Two cores are shared by the engine, the trainer ranks and pytest itself.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Tiny models are built once per session and copied after (forge_rl/models/tiny.py): every run a
# test starts (its processes inherit the variable) skips the ~5 s build, and no test reads what an
# earlier session, or the user's own runs, left in ~/.cache.
_TINY_MODEL_CACHE = tempfile.mkdtemp(prefix="forge_rl_test_cache-")
os.environ[CACHE_ENV] = _TINY_MODEL_CACHE
atexit.register(shutil.rmtree, _TINY_MODEL_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    # The integration tests first: `make test` runs the suite on two pytest-xdist workers, a file to
    # a worker (their module-scoped runs start once), and the unit files' short tests then fill the
    # gap while the last whole run ends. A stable sort: each group keeps its files' order.
    items.sort(key=lambda item: "integration" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (a GPU machine); none is visible here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


_MONARCH_FAULTS: list[str] = []


def _record_monarch_fault(failure) -> None:
    """Monarch's fault hook for this process: a mesh it owns failed and no supervisor handled it.
    Monarch's default exits the process through a KeyboardInterrupt, which takes the pytest-xdist
    worker and the whole session down with it; here the test that was running fails instead,
    naming the failure. (A test that installs its own hook, as a run does, restores this one.)"""
    _MONARCH_FAULTS.append(str(failure).strip()[:3000])


@pytest.fixture(scope="session", autouse=True)
def _monarch_faults_are_recorded():
    import sys

    monarch_actor = sys.modules.get("monarch.actor")  # imported at collection by the tests that use it
    if monarch_actor is not None:
        monarch_actor.unhandled_fault_hook = _record_monarch_fault
    yield


@pytest.fixture(autouse=True)
def _a_monarch_fault_fails_the_test(_monarch_faults_are_recorded):
    seen = len(_MONARCH_FAULTS)
    yield
    if len(_MONARCH_FAULTS) > seen:
        faults = "\n".join(_MONARCH_FAULTS[seen:])
        pytest.fail(f"a Monarch mesh owned by this test process failed and nothing supervised it:\n{faults}")
