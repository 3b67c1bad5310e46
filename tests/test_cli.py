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
    rows = [line.split()[1:4] for line in _rows(out)]
    # Per fixture: torch with gradients (explicit) and forward-only (fused), JAX, at float32 and
    # float64, each row naming the core implementation that ran
    assert rows == 2 * [["torch", "explicit", "float32"], ["torch", "explicit", "float64"],
                        ["torch", "fused", "float32"], ["torch", "fused", "float64"],
                        ["jax", "explicit", "float32"], ["jax", "explicit", "float64"]]
    assert all(line.endswith("pass") for line in _rows(out))
    last = out.strip().splitlines()[-2:]  # implementations first, the reference apart
    assert last == ["12 passed, 0 failed", "regeneration check: the reference reproduces 2 of 2 "
                    "fixtures bit for bit"]


def test_check_has_no_fused_row_for_dropout(capsys):
    assert main(["check", "sdpa_dropout", "--framework", "torch", "--dtype", "float32"]) == 0
    assert [line.split()[1:3] for line in _rows(capsys.readouterr().out)] == [
        ["torch", "explicit"]]


def test_check_filters_by_pattern_framework_and_dtype(capsys):
    assert main(["check", "-k", "sdpa_masked_*", "--framework", "jax",
                 "--dtype", "float64"]) == 0
    rows = [line.split()[:4] for line in _rows(capsys.readouterr().out)]
    assert rows == [["sdpa_masked_row", "jax", "explicit", "float64"],
                    ["sdpa_masked_row_causal", "jax", "explicit", "float64"]]
    assert main(["check", "-k", "masked_row_c", "--framework", "reference"]) == 0
    out = capsys.readouterr().out
    assert _rows(out) == [] and "reproduces 1 of 1 fixtures" in out


def test_check_with_nothing_selected(capsys):
    assert main(["check", "-k", "no_such_fixture"]) == 2
    assert "nothing selected" in capsys.readouterr().out


def test_check_fails_on_a_wrong_fixture(capsys, monkeypatch):
    real = jax_runner.run_fixture

    def off(fixture, dtype):  # a JAX whose output is off by 1e-3
        result = real(fixture, dtype)
        return {**result, "output": result["output"] + 1e-3}

    monkeypatch.setattr(jax_runner, "run_fixture", off)
    assert main(["check", "sdpa_plain", "--framework", "jax", "--dtype", "float64"]) == 1
    out = capsys.readouterr().out
    assert "FAIL output" in out and out.strip().endswith("0 passed, 1 failed")


def test_check_fails_when_the_reference_no_longer_reproduces_a_fixture(capsys, monkeypatch):
    from golden import reference

    forward, backward = reference.VARIANTS["scaled_dot_product_attention"]

    def drifted(config, inputs, params):
        out, weights, saved = forward(config, inputs, params)
        return out * (1 + 2**-52), weights, saved

    monkeypatch.setitem(reference.VARIANTS, "scaled_dot_product_attention", (drifted, backward))
    assert main(["check", "sdpa_plain", "--framework", "reference"]) == 1
    out = capsys.readouterr().out
    assert "sdpa_plain: the reference does not reproduce output" in out
    assert "reproduces 0 of 1 fixtures" in out


def test_regenerate_check_via_python_m():
    done = subprocess.run([sys.executable, "-m", "golden", "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 differ" in done.stdout
