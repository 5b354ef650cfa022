"""Shared fixtures. Tiny models are built per test module from tests/families.py (no downloads)."""
import os

import pytest
import torch

from tests.families import FAMILIES


def _interpreter_takes_numpy_2_4():
    """Triton 3.6's interpreter (TRITON_INTERPRET=1) turns a runtime scalar into an int with int(ndarray), which numpy
    >= 2.4 refuses for an array of one element that is not 0-dimensional ("only 0-dimensional arrays can be converted
    to Python scalars"): every kernel loop to a runtime bound, `range(0, K, BLOCK_K)`, failed under it. Its element is
    taken instead (the same int under every numpy). Only while interpreting, and only where Triton is installed."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "kvrewrite_numpy_2_4", False):
        return

    def _patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    _patch_lang_tensor.kvrewrite_numpy_2_4 = True
    interpreter._patch_lang_tensor = _patch_lang_tensor


_interpreter_takes_numpy_2_4()


@pytest.fixture(autouse=True)
def _threads(request):
    """One intra-op thread for tiny-model tests: a second OpenMP thread only adds spin-waits on
    these tiny ops (10-100x slower on a loaded 2-core machine). Real-model tests keep every thread,
    except under pytest-xdist (`-n N`), where the workers already share the cores."""
    n = torch.get_num_threads()
    if request.node.get_closest_marker("real_model") is None or os.environ.get("PYTEST_XDIST_WORKER"):
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


def pytest_collection_modifyitems(config, items):
    """Every test of a `*_gpu.py` module carries the `gpu` marker, so `python -m pytest -m gpu` (the README's GPU
    command) selects them all, whether or not the module marks itself (eleven kernel modules only skip without
    CUDA; a `-m gpu` run on the H200 in stop 43 left them out)."""
    for item in items:
        if item.path.name.endswith("_gpu.py") and item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.gpu)
