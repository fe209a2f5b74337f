import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py, metrics.py, references.py, distributed.py

# Without a GPU, our Triton kernels run in Triton's interpreter (set before any kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
