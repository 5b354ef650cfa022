"""Shared fixtures. Tiny models are built per test module from tests/families.py (no downloads)."""
import pytest
import torch

from tests.families import FAMILIES


@pytest.fixture(autouse=True)
def _threads(request):
    """One intra-op thread for tiny-model tests: a second OpenMP thread only adds spin-waits on
    these tiny ops (10-100x slower on a loaded 2-core machine). Real-model tests keep every thread."""
    n = torch.get_num_threads()
    if request.node.get_closest_marker("real_model") is None:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session", params=FAMILIES)
def family(request):
    """Every supported family (tests/families.py); fixtures built on it run once per family."""
    return request.param
