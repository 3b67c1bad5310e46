"""The ``attn-parity`` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys

from golden.cli import main


def test_check_prints_table_backend_and_summary(capsys):
    assert main(["check", "sdpa_plain", "sdpa_masked_row"]) == 0
    out = capsys.readouterr().out
    assert "JAX backend: cpu" in out
    rows = [line for line in out.splitlines() if line.startswith("sdpa_")]
    assert len(rows) == 2 * 5 and all(line.endswith("pass") for line in rows)
    assert out.strip().splitlines()[-1] == "10 passed, 0 failed"


def test_check_fails_on_a_wrong_fixture(tmp_path, capsys, monkeypatch):
    import golden.check

    real = golden.check.runners

    def broken(fixture):
        rows = real(fixture)
        name, dtype, run = rows[1]
        def off(f, d):  # a framework whose output is off by 1e-3
            result = run(f, d)
            return {**result, "output": result["output"] + 1e-3}

        return [rows[0], (name, dtype, off)]

    monkeypatch.setattr(golden.check, "runners", broken)
    assert main(["check", "sdpa_plain"]) == 1
    out = capsys.readouterr().out
    assert "FAIL output" in out and out.strip().endswith("1 passed, 1 failed")


def test_regenerate_check_via_python_m():
    done = subprocess.run([sys.executable, "-m", "golden", "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 differ" in done.stdout
