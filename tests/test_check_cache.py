"""``attn-parity check``'s cache (golden/runners/cache.py: JAX's compiled programs;
golden/runners/stored.py: the traced programs): a cache that is not where it is said to be,
that is written with ``--no-cache``, that changes any row or any bit of a result, that breaks a
run when corrupt, that serves a program traced for something else, or that outlives the command
in the calling process. No timings: how much it saves is measured by bench/check_time.py
(docs/performance.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from golden.cli import main
import golden
from golden.runners import cache, jax_runner, stored
from tests.helpers import matrix

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


def _programs(directory):
    return {p.name: p.stat().st_mtime_ns
            for p in (Path(directory) / "programs").glob("*" + stored.SUFFIX)}


def test_cache_is_written_where_asked_and_read_back_with_the_same_rows(tmp_path):
    directory = tmp_path / "cache"
    status, cold, _, cold_rows = _check(directory, report=tmp_path / "cold.json")
    assert status == 0, cold
    written, traced = _entries(directory), _programs(directory)
    assert any(name.startswith("jit_call_exported") for name in written), written
    assert len(traced) == 2, traced  # one traced program per dtype
    status, warm, err, warm_rows = _check(directory, report=tmp_path / "warm.json")
    assert status == 0, warm + err
    assert _entries(directory) == written  # every program found: nothing new written
    assert _programs(directory) == traced  # nor traced again
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


# ---- the traced programs ------------------------------------------------------------------------

# A core call, a module, the wrapper whose per-head weights are stacked, and a module in
# training mode (a dropout mask): in the quick suite each at one dtype (float32, float64 and
# bfloat16 among them), at every dtype it holds in the whole matrix.
QUICK_ROWS = {"sdpa_sinks_gqa_causal_window": "float32", "gqa_every_option": "float64",
              "multi_head_attention_wrapper_causal_proj_dropout": "float32",
              "multi_head_attention_low_precision_dropout_masked_row": "bfloat16"}
ROWS = [pytest.param(n, d, id=f"{n}-{d}", marks=() if QUICK_ROWS[n] == d else matrix)
        for n in QUICK_ROWS for d in golden.load(n).dtypes]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a["core"] == b["core"] and a["dtype"] == b["dtype"]
    assert a["grads"].keys() == b["grads"].keys()
    for name in ("output", "weights"):
        assert (a[name] is None) == (b[name] is None)
        assert a[name] is None or np.array_equal(a[name], b[name]), name
    for name, g in a["grads"].items():
        assert np.array_equal(g, b["grads"][name]), name


@pytest.fixture
def programs(tmp_path):
    cache.enable(tmp_path / "cache")
    yield tmp_path / "cache" / "programs"
    cache.disable()


@pytest.mark.parametrize("name, dtype", ROWS)
def test_a_stored_program_gives_every_bit_the_traced_module_gives(tmp_path, name, dtype):
    fixture = golden.load(name)
    direct = jax_runner.run_fixture(fixture, dtype)
    cache.enable(tmp_path / "cache")
    try:
        assert cache.programs_directory() == tmp_path / "cache" / "programs"
        first = jax_runner.run_fixture(fixture, dtype)
        files = _programs(tmp_path / "cache")
        again = jax_runner.run_fixture(fixture, dtype)
        assert _programs(tmp_path / "cache") == files and len(files) == 1
    finally:
        cache.disable()
    assert cache.programs_directory() is None
    assert direct["core"]  # the implementation that ran is named, stored or not
    _same(direct, first)
    _same(direct, again)


def test_a_damaged_or_foreign_program_is_traced_again(programs, monkeypatch):
    fixture = golden.load("sdpa_plain")
    good = jax_runner.run_fixture(fixture, "float32")
    (path,) = programs.glob("*" + stored.SUFFIX)
    for damage in (b"not a program", stored.MAGIC + b"{}\n" + b"x",
                   path.read_bytes()[:-100]):
        path.write_bytes(damage)
        monkeypatch.setattr(stored, "_LOADED", {})  # as a new process: read from the file
        with pytest.warns(UserWarning, match="not used"):
            _same(good, jax_runner.run_fixture(fixture, "float32"))
        assert path.read_bytes().startswith(stored.MAGIC) and path.stat().st_size > 1000
    # A program stored for another fixture under this one's name is refused by its header.
    other = golden.load("sdpa_scale")
    jax_runner.run_fixture(other, "float32")
    (foreign,) = set(programs.glob("*" + stored.SUFFIX)) - {path}
    path.write_bytes(foreign.read_bytes())
    monkeypatch.setattr(stored, "_LOADED", {})
    with pytest.warns(UserWarning, match="header differs"):
        _same(good, jax_runner.run_fixture(fixture, "float32"))
    assert not list(programs.glob(".*partial"))  # nothing half-written is left


def test_an_edited_source_or_setting_traces_a_new_program(programs, monkeypatch):
    fixture = golden.load("sdpa_plain")
    jax_runner.run_fixture(fixture, "float32")
    monkeypatch.setattr(stored, "source_digest", lambda: "an edited twin")
    jax_runner.run_fixture(fixture, "float32")
    monkeypatch.undo()
    with jax.default_matmul_precision("bfloat16"):
        jax_runner.run_fixture(fixture, "float32")
    assert len(list(programs.glob("*" + stored.SUFFIX))) == 3


def test_without_flatbuffers_the_cache_keeps_no_programs(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flatbuffers" else real(name, *a))
    with pytest.warns(UserWarning, match="flatbuffers"):
        assert cache.enable(tmp_path / "cache") == tmp_path / "cache"
    try:
        assert cache.programs_directory() is None
    finally:
        cache.disable()


# ---- the regeneration check beside the rows -----------------------------------------------------

def test_the_regeneration_check_in_a_second_process_names_what_differs(tmp_path):
    from dataclasses import replace

    from golden.harness import check
    from golden.specification.fixture import to_bytes

    plain = golden.load("sdpa_plain")
    drifted = replace(plain, name="sdpa_plain_drifted", path=None,
                      expected={**plain.expected, "output": plain.expected["output"] * (1 + 2**-52)})
    path = tmp_path / "sdpa_plain_drifted.npz"
    path.write_bytes(to_bytes(drifted))
    names = [*golden.names()[:3], str(path)]
    fixtures = [golden.load(n) for n in names]
    background = check._Regeneration(fixtures, names, background=True)
    assert background.process is not None  # it did run in a second process
    assert background.result() == {"sdpa_plain_drifted": ["output"]}
    here = check._Regeneration(fixtures, names, background=False)
    assert here.process is None and here.result() == {"sdpa_plain_drifted": ["output"]}
    # Fixture objects made in memory have no name to send: checked in this process.
    assert check._Regeneration([drifted], [drifted], background=True).process is None
