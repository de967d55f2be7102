import os

import pytest
import torch

# Two cores are shared by the engine, the trainer ranks and pytest itself.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (a GPU machine); none is visible here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
