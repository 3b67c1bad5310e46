"""``attn-parity device-check``'s run (``main``): the refusal without a GPU, the phases and the
files (golden.device_check.plan says which), env.json rewritten after each phase, progress
printed as it goes and kept in progress.log. A phase that fails is recorded and the run goes
on; the exit status is 0 when every phase ran and passed, 1 otherwise, 2 for a refusal.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from golden.device_check.plan import (
    CAPS_S,
    FILES,
    PHASES,
    QUICK,
    FULL,
    check_command,
    dry_run,
    tests_command,
)
from golden.specification.fixture import write_atomic

__all__ = ["ROOT", "PREALLOCATE", "GPU_PACKAGES", "main", "gpu_refusal", "environment"]

ROOT = Path(__file__).resolve().parents[2]  # the source tree: golden/, tests/
# JAX and torch share the GPU in one process: JAX must not take 75 % of its memory at start.
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"


class _Log:
    """Prints each line at once (flushed) and keeps it in progress.log."""

    def __init__(self, path: Path | None):
        self.file = None if path is None else open(path, "a", encoding="utf-8")  # noqa: SIM115

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()

    def close(self):
        if self.file is not None:
            self.file.close()


def gpu_refusal() -> str | None:
    """Why this run cannot go on here (None: JAX's default backend is a GPU). Sets
    XLA_PYTHON_CLIENT_PREALLOCATE=false first when JAX is not yet imported."""
    if "jax" not in sys.modules:
        os.environ[PREALLOCATE] = "false"
    try:
        import jax

        backend = jax.default_backend()
    except Exception as e:  # noqa: BLE001 - no JAX, or no backend at all
        return f"JAX cannot start here ({type(e).__name__}: {e})"
    if backend != "gpu":
        return (f"no GPU visible to JAX: its default backend is {backend!r} (devices: "
                f"{', '.join(map(str, jax.devices()))}); this command times and checks a GPU. "
                f"--dry-run lists what it would do")
    return None


def _phase_subprocess(name, command, output: Path, cap_s: float, log):
    """Start ``command`` in its own process group, its stdout and stderr into ``output``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", PREALLOCATE: "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    log(f"phase {name}: {shlex.join(command)} > {output} (stopped at {cap_s:.0f} s)")
    handle = open(output, "w", encoding="utf-8")  # noqa: SIM115 - closed in _wait
    # A process group of its own (in this session, so that whatever ends this run's session
    # ends it too), which _stop ends whole: pytest's or check's own subprocesses included.
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=handle,
                               stderr=subprocess.STDOUT, **group)
    return {"name": name, "process": process, "handle": handle, "start": time.perf_counter(),
            "cap_s": cap_s, "output": output}


def _wait(job, log) -> dict:
    """Wait for a phase's process until its cap; stop its process group past it. Its record:
    exit status, seconds, whether it was stopped, its output's last line."""
    process, timed_out = job["process"], False
    try:
        process.wait(timeout=max(0.0, job["start"] + job["cap_s"] - time.perf_counter()))
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop(process)
    job["handle"].close()
    seconds = time.perf_counter() - job["start"]
    last = _last_line(job["output"])
    ok = process.returncode == 0 and not timed_out
    record = {"status": "pass" if ok else "fail", "exit_status": process.returncode,
              "seconds": round(seconds, 1), "stopped_at_cap": timed_out, "last_line": last}
    why = f"stopped at its cap of {job['cap_s']:.0f} s" if timed_out else (
        f"exit status {process.returncode}")
    log(f"phase {job['name']}: {'passed' if ok else 'FAILED (' + why + ')'} in {seconds:.0f} s"
        f"{': ' + last if last else ''}")
    return record


def _stop(process) -> None:
    """End a phase's process group (the group this run started, and only it)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _last_line(path: Path) -> str:
    try:
        lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def environment(command: list[str]) -> dict:
    """env.json's machine block: GPU, driver, library versions, the command line."""
    from golden.report import environment as versions

    env = {"command": command, "cwd": os.getcwd(), "source": str(ROOT),
           "python_executable": sys.executable, "host": platform.node(),
           PREALLOCATE: os.environ.get(PREALLOCATE), **versions()}
    env["gpu_packages"] = {name: _installed(name) for name in GPU_PACKAGES}
    env["gpu"] = _guarded(_gpu)
    env["nvidia_smi"] = _guarded(_nvidia_smi)
    env["git_commit"] = _guarded(_git_commit)
    env["jax_environment_info"] = _guarded(_jax_info)
    return env


def _jax_info() -> list[str]:
    import jax

    return jax.print_environment_info(return_string=True).splitlines()


# The distributions behind JAX's and torch's GPU kernels (None where not installed).
GPU_PACKAGES = ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                "nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "triton", "ml_dtypes")


def _installed(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _guarded(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a missing tool is a value, not a failed run
        return f"unknown ({type(e).__name__}: {str(e)[:200]})"


def _gpu() -> dict:
    import jax

    devices = jax.devices()
    out = {"jax_devices": [str(d) for d in devices],
           "jax_device_kind": getattr(devices[0], "device_kind", None),
           "compute_capability": getattr(devices[0], "compute_capability", None)}
    try:
        import torch
    except ImportError as e:
        return {**out, "torch": f"not importable ({e})"}
    out.update({"torch_cuda": torch.version.cuda, "torch_cudnn": torch.backends.cudnn.version()})
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(0)
        out.update({"torch_device_name": torch.cuda.get_device_name(0),
                    "memory_total_gib": total / 2**30, "memory_free_gib_at_start": free / 2**30})
    return out


def _nvidia_smi() -> str:
    query = "name,driver_version,memory.total,power.limit,clocks.max.sm"
    done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=20)
    return f"{query}: {done.stdout.strip() or done.stderr.strip()}"


def _git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, timeout=10)
    return done.stdout.strip() or "not a git checkout"


def _write_json(path: Path, data) -> None:
    write_atomic(path, (json.dumps(data, indent=1, default=str) + "\n").encode())


def main(args, argv=None) -> int:
    """Run the phases asked for (``args`` from golden.device_check.plan.add_arguments)."""
    phases = [p for p in PHASES if p in (args.only or PHASES)]
    grid = QUICK if args.quick else FULL
    out = Path(args.out)
    if args.dry_run:
        print("\n".join(dry_run(phases, grid, out, args.budget, python=Path(sys.executable).name)))
        return 0
    refusal = gpu_refusal()
    if refusal:
        print(f"attn-parity device-check: error: {refusal}", file=sys.stderr)
        return 2
    out = out.absolute()  # the phases' processes run from the source tree
    out.mkdir(parents=True, exist_ok=True)
    log = _log_for(out)
    # SIGTERM (a `timeout`, a lease ending) as an exit: the phases' processes are ended and
    # env.json written on the way out.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return _run(phases, grid, out, args.budget, log,
                    ["attn-parity", *(sys.argv[1:] if argv is None else argv)])  # argv: its
        # subcommand first (device-check), as the command line gave it
    finally:
        signal.signal(signal.SIGTERM, previous)
        log.close()


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def _log_for(out: Path) -> _Log:
    path = out / "progress.log"
    path.write_text("")
    return _Log(path)


def _run(phases, grid, out, budget_s, log, command) -> int:
    start = time.perf_counter()
    deadline = start + budget_s
    log(f"attn-parity device-check: {', '.join(phases)}; budget {budget_s:.0f} s; into {out}/")
    jobs = [_phase_subprocess(name, make(sys.executable, out), out / output,
                              min(CAPS_S[name], budget_s), log)
            for name, make, output in (("check", check_command, "check_jax.txt"),
                                       ("tests", tests_command, "tests.log")) if name in phases]
    env = {"phases": {}, "budget_s": budget_s}
    try:
        env.update(environment(command))  # while the phases' processes run
        log(f"GPU: {env['gpu']}")
        _write_json(out / "env.json", env)
        for job in jobs:
            env["phases"][job["name"]] = _wait(job, log)
            _write_json(out / "env.json", env)
        if "timing" in phases:
            env["phases"]["timing"] = _timing(grid, out, deadline, log, env)
    finally:
        for job in jobs:  # stopped early (an exception, SIGTERM): none outlives the run
            if job["process"].poll() is None:
                _stop(job["process"])
        env["seconds"] = round(time.perf_counter() - start, 1)
        _write_json(out / "env.json", env)
    failed = [name for name, record in env["phases"].items() if record["status"] != "pass"]
    written = [name for name in FILES if (out / name).exists()]
    log(f"done in {env['seconds']:.0f} s: {', '.join(written)} in {out}/"
        + (f"; FAILED: {', '.join(failed)}" if failed else "; every phase passed"))
    return 1 if failed else 0


def _timing(grid, out, deadline, log, env) -> dict:
    from golden.device_check.timing import markdown, run_timing

    start = time.perf_counter()
    name = env["gpu"].get("torch_device_name") if isinstance(env["gpu"], dict) else None
    name = name or (env["gpu"].get("jax_device_kind") if isinstance(env["gpu"], dict) else None)
    left = deadline - start
    log(f"phase timing: {grid.shape}, L in {', '.join(map(str, grid.lengths))}, "
        f"{len(grid.cells())} cells in the {max(left, 0):.0f} s left")

    def save(report):
        _write_json(out / "timing.json", {**report, "device": name})
        write_atomic(out / "timing.md", markdown(report, name or "").encode())

    try:
        report = run_timing(grid, deadline=deadline, log=log, save=save)
    except Exception as e:  # noqa: BLE001 - the run reports it and goes on
        log(f"phase timing: FAILED: {type(e).__name__}: {e}")
        return {"status": "fail", "seconds": round(time.perf_counter() - start, 1),
                "error": f"{type(e).__name__}: {e}"}
    save(report)
    seconds = time.perf_counter() - start
    counts = ", ".join(f"{n} {s}" for s, n in report["counts"].items())
    log(f"phase timing: done in {seconds:.0f} s: {counts}")
    return {"status": "pass", "seconds": round(seconds, 1), "counts": report["counts"]}
