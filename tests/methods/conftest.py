"""Module-scoped fixtures of the method tests: the tiny llama and one capture of it (batch 2, chunks of CHUNK)."""
import pytest

from tests.families import tiny_model
from tests.methods.tiny_runs import CHUNK


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def captured(llama):
    from kvrewrite.capture import capture

    return capture(llama, batch_size=2, prefill_chunk=CHUNK)
