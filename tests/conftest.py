"""pytest fixtures; what they hand out is defined in ``tests/helpers.py``."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings

import pytest

import golden
from tests.helpers import FRAMEWORKS, IMPLS, MATRIX_ENV, TWINS, WHOLE, fixture_of

# `attn-parity check` keeps JAX's compiled programs in a cache under the user's home
# (golden/runners/cache.py): this session's, and its subprocesses', go to a directory of its
# own, removed at the end, never to the user's.
os.environ["ATTN_PARITY_CACHE_DIR"] = tempfile.mkdtemp(prefix="attn-parity-test-cache-")

# The tests' own compiled JAX programs are kept between runs in JAX's persistent compilation
# cache, in $ATTN_PARITY_TEST_CACHE (default: ~/.cache/attn-parity/tests; "off": none): a second
# run loads each program instead of compiling it, and XLA's compiling is most of the suite's
# time. JAX keys an entry by the lowered program, its versions, the backend and the XLA flags,
# so an edited function compiles afresh, and what is loaded is the program compiled before, bit
# for bit. A load still counts as a compilation (tests/helpers.py ``count_compiles``: JAX's
# compile event wraps the cache lookup). Subprocesses that load this file share it.
TEST_CACHE_ENV = "ATTN_PARITY_TEST_CACHE"
TEST_CACHE_MOST = 2 * 2**30  # bytes: above this, the oldest half goes at a session's start


def _keep_compiled_programs():
    """Turn JAX's persistent cache on for this session; the directory, or None when off. JAX's
    own size limit is left off: it scans the whole directory at every write, which costs more
    than the compilations it saves; the session trims the directory itself, once."""
    where = os.environ.get(TEST_CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "attn-parity", "tests")
    if where.lower() == "off":
        return None
    try:
        os.makedirs(where, exist_ok=True)
        if not os.environ.get("PYTEST_XDIST_WORKER"):  # once, before the workers start
            _trim(where, TEST_CACHE_MOST)
    except OSError as e:  # a read-only home, say: the suite runs, compiling everything
        warnings.warn(f"tests: no compile cache in {where} ({e})", stacklevel=1)
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return where


def _trim(where, most):
    """When the files in ``where`` hold more than ``most`` bytes, remove the oldest written
    until they hold at most half."""
    files = [(e.stat().st_mtime, e.stat().st_size, e.path) for e in os.scandir(where)
             if e.is_file()]
    total = sum(size for _, size, _ in files)
    if total <= most:
        return
    for _, size, path in sorted(files):
        if total <= most // 2:
            break
        os.remove(path)
        total -= size


TEST_CACHE = _keep_compiled_programs()

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


_BYTES = {}  # case name -> its shipped fixture's bytes (cached_builds)


@pytest.fixture
def cached_builds(monkeypatch):
    """``golden.harness.regenerate.build`` giving each case's shipped fixture (fixture_of:
    loaded once per process) and ``to_bytes`` serialising each once: for tests of how regenerate
    writes, checks and replaces files, which call it several times and need not redo the
    exact arithmetic (a dozen seconds for every case). That arithmetic is checked on fresh
    builds elsewhere: every fixture's reference in tests/test_fixtures.py, regeneration at
    each NumPy dispatch level in tests/test_reproducibility.py, the whole regeneration's
    --check in the matrix."""
    from golden.harness import regenerate

    real_bytes = regenerate.to_bytes

    def to_bytes(fixture):  # a shipped fixture's file, serialised once (it is never changed)
        if fixture.name not in _BYTES:
            _BYTES[fixture.name] = real_bytes(fixture)
        return _BYTES[fixture.name]

    monkeypatch.setattr(regenerate, "build", lambda case: fixture_of(case.name))
    monkeypatch.setattr(regenerate, "to_bytes", to_bytes)


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_freed_per_module():
    """After each test module, JAX's in-memory caches of compiled programs are dropped (the
    persistent cache on disk keeps them for the next load): a worker of the whole matrix
    compiles thousands of programs, one set per family's tiny model. A worker crashed twice in
    test_hf_import's JAX decoding tests (the last two whole-matrix runs of 2026-11-27, 2 cores,
    24 GiB); the cause was not found, and the memory those programs hold is the suspect this
    bounds."""
    yield
    import jax
    jax.clear_caches()
