"""pytest fixtures; what they hand out is defined in ``tests/helpers.py``."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

import golden
from tests.helpers import FRAMEWORKS, IMPLS, MATRIX_ENV, TWINS, WHOLE

# `attn-parity check` keeps JAX's compiled programs in a cache under the user's home
# (golden/runners/cache.py): this session's, and its subprocesses', go to a directory of its
# own, removed at the end, never to the user's.
os.environ["ATTN_PARITY_CACHE_DIR"] = tempfile.mkdtemp(prefix="attn-parity-test-cache-")

# tests/devices8 needs 8 JAX devices, which only a process started with the XLA flag has:
# tests/test_devices8.py runs it in one; this session collects it only when the flag is set.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    collect_ignore = ["devices8"]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"matrix: runs only in the whole matrix ({MATRIX_ENV}=1, what .ci/run "
                   "sets); each repeats, at another dtype, family or size, a behaviour the quick "
                   "suite runs")


def pytest_collection_modifyitems(config, items):
    """Without the whole matrix, the tests marked ``matrix`` are deselected. tests/test_devices8.py
    last in one process (it waits for the subprocess started below); first under pytest-xdist,
    whose worker starts that subprocess when it reaches the test, so that it runs beside the
    rest."""
    if not WHOLE:
        skipped = [item for item in items if item.get_closest_marker("matrix")]
        if skipped:
            config.hook.pytest_deselected(items=skipped)
            items[:] = [item for item in items if not item.get_closest_marker("matrix")]
    first = bool(os.environ.get("PYTEST_XDIST_WORKER"))
    items.sort(key=lambda item: (item.path.name == "test_devices8.py") != first)  # stable


def pytest_collection_finish(session):
    """Start tests/devices8's subprocess now, when its test is selected, so that it runs beside
    the rest of the suite; tests/test_devices8.py waits for it. Not in a pytest-xdist worker:
    every worker collects every test, and only the one that runs it should start it."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if not session.config.option.collectonly and any(
            item.path.name == "test_devices8.py" for item in session.items):
        from tests import test_devices8
        test_devices8.start()


def pytest_sessionfinish(session):
    from tests import test_devices8
    test_devices8.stop()
    shutil.rmtree(os.environ["ATTN_PARITY_CACHE_DIR"], ignore_errors=True)


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


_BUILT = {}


@pytest.fixture
def cached_builds(monkeypatch):
    """``golden.harness.regenerate.build`` computed once per case in this session: for tests of how
    regenerate writes, checks and replaces files, which call it several times. Each case is
    built by the real function the first time (the exact arithmetic, about 1 s for all 57);
    test_fixtures.py and test_reproducibility.py check that arithmetic on fresh builds."""
    from golden.harness import regenerate

    real = regenerate.build

    def build(case):
        key = (case.name, case.variant, case.seed, repr(case.inputs), repr(case.config),
               case.dtypes)
        if key not in _BUILT:
            _BUILT[key] = real(case)
        return _BUILT[key]

    monkeypatch.setattr(regenerate, "build", build)
