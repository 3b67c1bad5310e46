"""The multi-device tests (``tests/devices8``), run in a subprocess on 8 virtual CPU devices.

XLA reads ``--xla_force_host_platform_device_count`` once, when JAX starts, and this session
has already started JAX with one device; so the sharded tests get a process of their own. It
starts when collection ends (``tests/conftest.py``), so that it runs beside the rest of the
suite on the cores this one leaves idle (JAX compiles on one), and this test waits for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLAG = "--xla_force_host_platform_device_count=8"
_RUN: dict = {}


def flagged() -> bool:
    """Whether this process has the flag, and so collects tests/devices8 itself."""
    return "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")


def start() -> None:
    """Start the subprocess (once)."""
    if "process" in _RUN or flagged():
        return
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAG).strip()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    log = tempfile.TemporaryFile(mode="w+")
    _RUN["log"] = log
    _RUN["process"] = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
         str(ROOT / "tests" / "devices8")], cwd=ROOT, env=env, stdout=log,
        stderr=subprocess.STDOUT, text=True)


def stop() -> None:
    """Kill the subprocess if it is still running (an interrupted session); close its log."""
    process = _RUN.get("process")
    if process is not None and process.poll() is None:
        process.kill()
        process.wait()
    if "log" in _RUN and not _RUN["log"].closed:
        _RUN["log"].close()


def test_devices8_suite():
    if flagged():
        pytest.skip("this session has the XLA flag and collects tests/devices8 itself")
    start()  # a no-op when collection started it
    process, log = _RUN["process"], _RUN["log"]
    try:
        code = process.wait(timeout=1200)
        log.seek(0)
        report = log.read()[-20000:]
    finally:
        stop()
    assert code == 0, f"tests/devices8 on 8 virtual devices failed:\n{report}"
    last = report.strip().splitlines()[-1]
    assert " passed" in last and "skipped" not in last, report
