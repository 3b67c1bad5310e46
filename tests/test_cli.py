"""The ``attn-parity`` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys

from golden.cli import main
from golden.runners import jax_runner


def _rows(out, prefix="sdpa_"):
    return [line for line in out.splitlines() if line.startswith(prefix)]


def test_check_prints_table_backend_and_summary(capsys):
    assert main(["check", "sdpa_plain", "sdpa_masked_row"]) == 0
    out = capsys.readouterr().out
    assert "JAX backend: cpu" in out
    rows = _rows(out)
    assert len(rows) == 2 * 5 and all(line.endswith("pass") for line in rows)
    assert out.strip().splitlines()[-1] == "10 passed, 0 failed"


def test_check_filters_by_pattern_framework_and_dtype(capsys):
    assert main(["check", "-k", "sdpa_masked_*", "--framework", "jax",
                 "--dtype", "float64"]) == 0
    rows = [line.split()[:3] for line in _rows(capsys.readouterr().out)]
    assert rows == [["sdpa_masked_row", "jax", "float64"],
                    ["sdpa_masked_row_causal", "jax", "float64"]]
    assert main(["check", "-k", "masked_row_c", "--framework", "reference"]) == 0
    rows = [line.split()[:3] for line in _rows(capsys.readouterr().out)]
    assert rows == [["sdpa_masked_row_causal", "reference", "float64"]]


def test_check_with_nothing_selected(capsys):
    assert main(["check", "-k", "no_such_fixture"]) == 2
    assert "nothing selected" in capsys.readouterr().out


def test_check_fails_on_a_wrong_fixture(capsys, monkeypatch):
    real = jax_runner.run_fixture

    def off(fixture, dtype):  # a JAX whose output is off by 1e-3
        result = real(fixture, dtype)
        return {**result, "output": result["output"] + 1e-3}

    monkeypatch.setattr(jax_runner, "run_fixture", off)
    assert main(["check", "sdpa_plain", "--framework", "reference", "--framework", "jax",
                 "--dtype", "float64"]) == 1
    out = capsys.readouterr().out
    assert "FAIL output" in out and out.strip().endswith("1 passed, 1 failed")


def test_regenerate_check_via_python_m():
    done = subprocess.run([sys.executable, "-m", "golden", "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 differ" in done.stdout
