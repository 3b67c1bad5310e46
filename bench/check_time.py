"""How long ``attn-parity check`` takes: cold (an empty compilation cache), warm (the same cache
a second time) and, with ``--no-cache-too``, without the cache; each configuration run
``--repeats`` times in turn. Prints one line per run (wall seconds, and the CPU seconds of the
process), the medians, the host's CPU, and whether every run printed the same table.

    python bench/check_time.py                    # cold and warm twice: about 5 minutes here
    python bench/check_time.py --no-cache-too     # and twice with --no-cache
    python bench/check_time.py -- -k sdpa_causal  # the arguments after -- go to check

Each run is ``python -m golden.cli check ...`` (what the ``attn-parity`` script runs) in a
fresh process, with ATTN_PARITY_CACHE_DIR set to a temporary directory (emptied for each cold
run, removed at the end): the user's own cache is neither read nor written. Not a test: a
shared machine's timings vary from run to run, so quote the medians with the host and date.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def cpu_model() -> str:
    """The CPU's model name (as ``lscpu`` gives it), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def timed(argv, env) -> tuple[float, float, str, int]:
    """(wall seconds, CPU seconds (user + system), stdout, exit status) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout, done.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration")
    parser.add_argument("--no-cache-too", action="store_true",
                        help="also time check --no-cache (the time without the cache)")
    parser.add_argument("check_args", nargs="*", help="arguments for check (after --)")
    args = parser.parse_args(argv)
    command = [sys.executable, "-m", "golden.cli", "check", *args.check_args]
    directory = tempfile.mkdtemp(prefix="attn-parity-check-time-")
    env = {**os.environ, "ATTN_PARITY_CACHE_DIR": directory}
    plan = [("cold", []), ("warm", [])] + ([("no cache", ["--no-cache"])]
                                           if args.no_cache_too else [])
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; attn-parity {' '.join(command[3:])}")
    times, tables = {}, set()
    try:
        for repeat in range(args.repeats):
            for name, extra in plan:
                if name == "cold":
                    shutil.rmtree(directory)
                    os.mkdir(directory)
                wall, cpu, out, status = timed(command + extra, env)
                times.setdefault(name, []).append(wall)
                tables.add(out)
                print(f"{name:8} run {repeat + 1}: {wall:6.1f} s wall, {cpu:6.1f} s CPU, "
                      f"exit {status}, load average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    for name, walls in times.items():
        print(f"{name:8} median {statistics.median(walls):6.1f} s wall "
              f"({', '.join(f'{w:.1f}' for w in walls)})")
    print(f"the same table from every run: {'yes' if len(tables) == 1 else 'NO'}")
    return 0 if len(tables) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
