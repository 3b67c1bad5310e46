"""The tests' own compile cache (tests/conftest.py): this session compiles through JAX's
persistent cache in the directory asked, and the directory is trimmed, oldest first."""

from __future__ import annotations

import os

import jax
import pytest

from tests import conftest


def test_the_session_compiles_through_the_cache():
    if conftest.TEST_CACHE is None:
        pytest.skip(f"this session has no cache ({conftest.TEST_CACHE_ENV}=off, or its "
                    "directory could not be made: a warning said why)")
    assert jax.config.jax_compilation_cache_dir == conftest.TEST_CACHE
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0  # every program
    assert jax.config.jax_compilation_cache_max_size == -1  # JAX's scan at every write: off


def test_trim_removes_the_oldest_until_half(tmp_path):
    for i in range(10):  # 10 files of 100 bytes, file i written at time i
        path = tmp_path / f"f{i}"
        path.write_bytes(b"x" * 100)
        os.utime(path, (i, i))
    conftest._trim(tmp_path, 1000)  # at the limit: nothing goes
    assert len(list(tmp_path.iterdir())) == 10
    conftest._trim(tmp_path, 900)  # past it: the oldest go until at most 450 bytes are left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f6", "f7", "f8", "f9"]
