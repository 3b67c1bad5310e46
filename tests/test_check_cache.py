"""``attn-parity check``'s JAX compilation cache (golden/runners/cache.py): a cache that is not
where it is said to be, that is written with ``--no-cache``, that changes any row, that breaks
a run when corrupt, or that outlives the command in the calling process. No timings: how much
it saves is measured by bench/check_time.py (docs/performance.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from golden.cli import main
from golden.runners import cache

ROOT = Path(__file__).resolve().parents[1]
# One small fixture, through JAX alone at both its dtypes: two compiled programs.
CHECK = ["check", "sdpa_masked_row", "--framework", "jax"]


def _check(directory, *extra, report=None):
    """``attn-parity check`` of CHECK in a fresh process with its cache in ``directory``:
    (exit status, stdout but its "wrote FILE" line, stderr, the JSON report's rows without
    their times)."""
    argv = [*CHECK, *extra] + (["--json", str(report)] if report else [])
    env = {**os.environ, cache.ENV: str(directory)}
    done = subprocess.run([sys.executable, "-m", "golden.cli", *argv], capture_output=True,
                          text=True, cwd=ROOT, env=env)
    rows = None
    if report:
        rows = [{k: v for k, v in row.items() if k != "seconds"}
                for row in json.loads(Path(report).read_text())["rows"]]
    table = "".join(line for line in done.stdout.splitlines(keepends=True)
                    if not line.startswith("wrote "))
    return done.returncode, table, done.stderr, rows


def _entries(directory):
    return sorted(p.name for p in Path(directory).glob("*-cache"))


def test_cache_is_written_where_asked_and_read_back_with_the_same_rows(tmp_path):
    directory = tmp_path / "cache"
    status, cold, _, cold_rows = _check(directory, report=tmp_path / "cold.json")
    assert status == 0, cold
    written = _entries(directory)
    assert any(name.startswith("jit__value_and_grads") for name in written), written
    status, warm, err, warm_rows = _check(directory, report=tmp_path / "warm.json")
    assert status == 0, warm + err
    assert _entries(directory) == written  # every program found: nothing new written
    status, fresh, _, fresh_rows = _check(tmp_path / "unused", "--no-cache",
                                          report=tmp_path / "fresh.json")
    assert status == 0
    assert cold == warm == fresh
    assert cold_rows == warm_rows == fresh_rows
    assert len(cold_rows) == 2 and all(r["status"] == "pass" for r in cold_rows)


def test_no_cache_writes_nothing(tmp_path):
    directory = tmp_path / "cache"
    status, out, err, _ = _check(directory, "--no-cache")
    assert status == 0, out + err
    assert not directory.exists() or not any(directory.iterdir())


def test_a_corrupt_cache_is_a_warning_and_a_fresh_compilation(tmp_path):
    directory = tmp_path / "cache"
    status, good, _, _ = _check(directory)
    assert status == 0
    for entry in directory.glob("*-cache"):
        entry.write_bytes(b"not a compiled program" * 3)
    status, out, err, _ = _check(directory)
    assert status == 0, out + err
    assert out == good
    assert "Error reading persistent compilation cache entry" in err


def test_the_command_leaves_jax_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV, str(tmp_path / "cache"))
    before = jax.config.jax_compilation_cache_dir
    assert main([*CHECK, "--dtype", "float32"]) == 0
    assert jax.config.jax_compilation_cache_dir == before
    assert _entries(tmp_path / "cache")  # the run itself went through the cache


def test_default_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV, str(tmp_path / "moved"))
    assert cache.default_directory() == tmp_path / "moved"
    monkeypatch.delenv(cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.default_directory() == tmp_path / "xdg" / "attn-parity" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.default_directory() == tmp_path / "home" / ".cache" / "attn-parity" / "jax"


def test_enable_without_a_directory_warns_and_changes_nothing(tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    before = jax.config.jax_compilation_cache_dir
    with pytest.warns(UserWarning, match="no compilation cache"):
        assert cache.enable(blocker / "cache") is None
    assert jax.config.jax_compilation_cache_dir == before
    cache.disable()
    assert jax.config.jax_compilation_cache_dir == before
