"""pytest fixtures; what they hand out is defined in ``tests/helpers.py``."""

from __future__ import annotations

import pytest

import golden
from tests.helpers import FRAMEWORKS, IMPLS, TWINS


@pytest.fixture(params=golden.names())
def fixture_name(request):
    """The name of each shipped golden fixture."""
    return request.param


@pytest.fixture(params=FRAMEWORKS)
def twin(request):
    """Each framework of the twin pair (ids "torch", "jax"): see ``helpers.Twin``."""
    return TWINS[request.param]


@pytest.fixture(params=list(IMPLS))
def impl(request):
    """The reference core and each twin's core (ids "reference", "torch", "jax")."""
    return IMPLS[request.param]
