"""Shared fixtures: tiny models of every family are built once per session."""
import pytest
import torch

from tests.families import FAMILIES, tiny_model


@pytest.fixture(scope="session", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
