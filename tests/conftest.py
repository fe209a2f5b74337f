import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py, metrics.py, references.py, distributed.py

# Without a GPU, our Triton kernels run in Triton's interpreter (set before any kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# `make test` runs the suite on two workers (pytest-xdist, --dist loadgroup). The tests of these modules are
# independent calls (op cases, no module fixtures), spread one by one; every other module runs whole on
# one worker, in order, with its module fixtures (servers, engines, models) made once.
SPREAD_MODULES = {"test_kernels", "test_ops"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the marks to group the items
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__
        if module not in SPREAD_MODULES:
            item.add_marker(pytest.mark.xdist_group(module))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tests (pytestmark = pytest.mark.usefixtures("one_torch_thread")):
    tiny models gain nothing from intra-op threads, and many small steps on busy cores lose a lot to them
    (x20 on a shared 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
