"""``attn-parity device-check`` on a CPU (golden.device_check): its options, the refusal without
a GPU, the dry run's phases, grid and files, the FLOP and memory rules on hand-derived values,
and the phases' machinery run for real at a tiny size (the timing of a few cells, a phase's
process stopped at its cap, a whole timing phase writing its files), past the GPU refusal.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from golden.cli import main, parser
from golden.device_check import plan, run, timing
from golden.device_check.plan import FULL, IMPLS, QUICK, Impl, TimingGrid

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


# ---- the options --------------------------------------------------------------------------------

def test_defaults_and_options_parse():
    args = parser().parse_args(["device-check"])
    assert (args.out, args.only, args.quick, args.dry_run, args.budget) == (
        "bench/results/device", [], False, False, plan.DEFAULT_BUDGET_S)
    args = parser().parse_args(["device-check", "--out", "x", "--only", "timing", "--only",
                                "check", "--quick", "--budget", "12.5", "--dry-run"])
    assert (args.out, args.only, args.quick, args.dry_run, args.budget) == (
        "x", ["timing", "check"], True, True, 12.5)


@pytest.mark.parametrize("argv, named", [
    (["--budget", "-1"], "argument --budget: should be a time > 0 s, got -1"),
    (["--budget", "soon"], "argument --budget: should be a number of seconds, got 'soon'"),
    (["--only", "bench"], "argument --only: invalid choice: 'bench'")])
def test_bad_options_name_the_argument(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["device-check", *argv])
    assert exit_.value.code == 2 and named in capsys.readouterr().err


# ---- the refusal and the dry run ----------------------------------------------------------------

def test_without_a_gpu_it_refuses_with_status_2_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(run.PREALLOCATE, raising=False)  # restored after the test
    assert main(["device-check", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "device-check: error: no GPU visible to JAX: its default backend is 'cpu'" in err
    assert "--dry-run" in err and not (tmp_path / "out").exists()


def test_the_dry_run_lists_the_phases_the_grid_and_the_files(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["device-check", "--dry-run", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert not out.exists()
    for phase in plan.PHASES:
        assert f"phase {phase} " in text
    assert f"check --framework jax --json {out}/check_jax.json" in text
    assert "pytest -q -ra -p no:cacheprovider --junitxml" in text and "test_accelerators" in text
    assert "B=4,H=16,D=128,bfloat16, L in 1024, 4096, 16384: 108 cells" in text
    assert all(f"  {cell.label} " in text for cell in FULL.cells())
    assert re.search(r"L=16384 full fwd jax explicit +memory ≤ 129.0 GiB", text)
    assert f"files: {', '.join(plan.FILES)}" in text


def test_the_quick_dry_run_of_one_phase(tmp_path, capsys):
    assert main(["device-check", "--dry-run", "--quick", "--only", "timing", "--out",
                 str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "phase check" not in text and "phase tests" not in text
    assert "L in 1024: 36 cells" in text and "L=4096" not in text
    assert text.rstrip().endswith("files: env.json, progress.log, timing.json, timing.md")


def test_the_dry_run_imports_neither_framework():
    """``--dry-run`` works on any machine: JAX and torch are not even imported."""
    code = ("import sys; from golden.cli import main; "
            "assert main(['device-check', '--dry-run', '--out', 'x']) == 0; "
            "assert not {'jax', 'torch'} & set(sys.modules), 'imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.skipif(shutil.which("python3") is None or shutil.which("bash") is None,
                    reason="needs bash and python3")
def test_the_wrapper_runs_the_command_into_OUT(tmp_path):
    script = ROOT / "bench" / "device_check.sh"
    assert os.access(script, os.X_OK)
    text = script.read_text()
    assert 'python3 -m golden.cli device-check --out "${OUT:-bench/results/device}" "$@"' in text
    assert "export XLA_PYTHON_CLIENT_PREALLOCATE=false" in text
    done = subprocess.run(["bash", str(script), "--dry-run", "--quick"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OUT": str(tmp_path)})
    if "No module named" in done.stderr:
        pytest.skip("this python3 is not the one with the project's requirements")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"output in {tmp_path}/" in done.stdout and "36 cells" in done.stdout


# ---- what a run writes, and what it covers ------------------------------------------------------

def test_the_files_fit_what_comes_back_from_a_device():
    """At most 8 files, each in the --out folder itself, named in letters, digits, '.', '_', '-'."""
    assert len(plan.FILES) <= 8
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in plan.FILES)
    assert set(plan.FILES.values()) <= {None, *plan.PHASES}


def test_every_named_jax_implementation_is_timed():
    from jax_attn import IMPLEMENTATIONS

    # but "sparse", which runs only given key_indices: the grid draws no selection (its timing
    # against dense attention is issue 44's bench, still to come)
    assert {i.name for i in IMPLS if i.framework == "jax"} == {
        None, *IMPLEMENTATIONS.names} - {"sparse"}
    assert IMPLS[0] == Impl("jax", None)  # the baseline first in every group


def test_every_test_file_that_skips_off_a_gpu_is_run():
    """The tests phase runs every file of tests/ with a test skipped where JAX has no GPU."""
    needs_gpu = {f"tests/{p.name}" for p in (ROOT / "tests").rglob("test_*.py")
                 if re.search(r"default_backend\(\) != \"gpu\"", p.read_text())}
    assert needs_gpu and needs_gpu <= set(plan.TEST_FILES)


# ---- FLOPs and memory, by hand ------------------------------------------------------------------

def test_flops_by_hand():
    """B=4, H=16, L=1024, D=128: 4·4·16·1024²·128 = 2⁸·2²⁰·2⁷ = 2³⁵ forward."""
    assert plan.flops(4, 16, 1024, 128, causal=False, backward=False) == 2**35
    assert plan.flops(4, 16, 1024, 128, causal=True, backward=True) == 2**34 * 3.5
    from golden.bench.grid import Shape

    assert plan.flops(2, 3, 5, 4, causal=True, backward=True) == Shape(2, 3, 5, 5, 4).flops(
        True, True)  # the benchmark's convention


def test_memory_estimates_by_hand():
    """B=4, H=16, L=16384, D=128, bfloat16: each (B, H, L, D) array 2²⁷ elements, 256 MiB; q,
    k, v and the output 1 GiB; explicit's two float32 (B, H, L, L) arrays 2·4·2⁶·2²⁸ bytes =
    128 GiB."""
    assert plan.memory_bytes("explicit", 4, 16, 16384, 128, backward=False) == 129 * GIB
    assert plan.memory_bytes("cudnn", 4, 16, 16384, 128, backward=True) == 2 * GIB
    assert plan.memory_bytes(None, 4, 16, 16384, 128, backward=False) == GIB  # a fused kernel
    # blockwise: three float32 blocks of 1024² per (batch, head): 3·4·2⁶·2²⁰ bytes = 768 MiB
    assert plan.memory_bytes("blockwise", 4, 16, 16384, 128, backward=False) == GIB + 768 * 2**20
    # explicit at L=4096 forward+backward: 0.5 GiB of arrays, four (B, H, L, L) float32: 16 GiB
    assert plan.memory_bytes("explicit", 4, 16, 4096, 128, backward=True) == 16.5 * GIB


def test_the_memory_rule():
    needed = plan.memory_bytes("explicit", 4, 16, 16384, 128, backward=False)
    assert plan.memory_skip(needed, 80 * GIB) == (
        "needs about 129.0 GiB (estimate), more than 90% of the 80.0 GiB free")
    assert plan.memory_skip(needed, 139 * GIB) is not None  # nor an H200's whole memory
    assert plan.memory_skip(plan.memory_bytes("blockwise", 4, 16, 16384, 128, backward=True),
                            80 * GIB) is None
    assert plan.memory_skip(90, 100) is None and plan.memory_skip(91, 100) is not None
    assert plan.memory_skip(needed, None) is None  # free memory unknown (a CPU): it runs


# ---- the machinery, on a CPU --------------------------------------------------------------------

def test_measure_counts_its_calls():
    """A call of next to no time: k = INNER_MOST calls a sample; with no steady time the
    least samples; a first and a warm call before them."""
    calls, syncs = [], []
    got = timing.measure(lambda: calls.append(1), syncs.append, steady_s=0.0)
    assert (got["calls_per_sample"], got["samples"]) == (timing.INNER_MOST, timing.SAMPLES_LEAST)
    assert len(calls) == 2 + timing.SAMPLES_LEAST * timing.INNER_MOST
    assert len(syncs) == 2 + timing.SAMPLES_LEAST
    assert 0 <= got["min_ms"] <= got["median_ms"]
    late = timing.measure(lambda: None, lambda r: None, steady_s=1.0,
                          deadline=time.perf_counter() - 1)
    assert late["samples"] == 1  # past the budget: one sample, not the least three


TINY = TimingGrid(batch=1, heads=2, width=16, lengths=(32,), dtype="float32", steady_s=0.01,
                  impls=(Impl("jax", None), Impl("jax", "cudnn"), Impl("jax.nn", "cudnn"),
                         Impl("torch", "flash")))


def test_the_timing_of_a_tiny_grid_on_a_cpu():
    """Every kind of row, none raised: None timed (and what it ran recorded), the registry's
    refusal of "cudnn" off a GPU with its reason, jax.nn's cuDNN failing as an error row, torch
    on the CPU; the ratios to None; the table."""
    saved = []
    report = timing.run_timing(TINY, deadline=time.perf_counter() + 120, device="cpu",
                               log=lambda line: None, save=lambda r: saved.append(len(r["rows"])))
    rows = {(r["impl"], r["causal"], r["pass"]): r for r in report["rows"]}
    assert saved == list(range(1, len(TINY.cells()) + 1))  # the files kept current, cell by cell
    for causal in (False, True):
        for phase in ("fwd", "fwd+bwd"):
            none = rows["jax None", causal, phase]
            assert none["status"] == "timed" and none["ran"] == "explicit", none
            assert none["vs_none"] == 1.0 and none["tflops"] > 0 and none["compile_s"] >= 0
            cudnn = rows["jax cudnn", causal, phase]
            assert cudnn["status"] == "refused" and "cuDNN runs on an NVIDIA GPU" in cudnn["reason"]
            assert rows["jax.nn cudnn", causal, phase]["status"] in ("error", "refused")
            assert rows["torch flash", causal, phase]["status"] in ("timed", "refused")
    assert report["counts"]["timed"] >= 4 and sum(report["counts"].values()) == 16
    table = timing.markdown(report, "a CPU")
    assert table.startswith("# Attention timing on a CPU")
    assert "| 32 | no | fwd | jax None |" in table and "ran explicit |" in table
    assert len(table.splitlines()) == 10 + 16


def test_cells_past_the_budget_or_the_free_memory_are_skipped(monkeypatch):
    grid = TimingGrid(1, 2, 16, (32,), "float32", impls=(Impl("jax", None),), steady_s=0.0)
    late = timing.run_timing(grid, deadline=time.perf_counter() - 1, device="cpu",
                             log=lambda line: None)
    assert {(r["status"], r["reason"]) for r in late["rows"]} == {
        ("skipped", "past the run's budget (--budget)")}
    monkeypatch.setattr(timing, "_jax_free", lambda: 1000)  # bytes
    full = timing.run_timing(grid, deadline=time.perf_counter() + 60, device="cpu",
                             log=lambda line: None)
    assert all(r["status"] == "skipped" and "GiB free" in r["reason"] for r in full["rows"])
    assert all(r["memory_estimate_gib"] > 0 and r["ran"] == "explicit" for r in full["rows"])


def test_a_phase_past_its_cap_is_stopped_and_recorded(tmp_path):
    job = run._phase_subprocess("tests", [sys.executable, "-c", "import time; print('x', "
                                "flush=True); time.sleep(60)"], tmp_path / "tests.log", 1.0,
                                log=lambda line: None)
    record = run._wait(job, log=lambda line: None)
    assert record["status"] == "fail" and record["stopped_at_cap"] and record["seconds"] < 30
    assert record["last_line"] == "x"


def test_inputs_that_cannot_be_made_are_each_cells_error(monkeypatch):
    def fail(*args):
        raise MemoryError("no room")

    monkeypatch.setattr(timing, "_jax_inputs", fail)
    grid = TimingGrid(1, 2, 16, (32,), "float32", impls=(Impl("jax", None),), steady_s=0.0)
    report = timing.run_timing(grid, deadline=time.perf_counter() + 60, device="cpu",
                               log=lambda line: None)
    assert {(r["status"], r["reason"]) for r in report["rows"]} == {
        ("error", "making the inputs: MemoryError: no room")}


def test_sigterm_ends_the_run_as_an_exit():
    """The handler device-check installs: SIGTERM unwinds (phases stopped, env.json written)."""
    with pytest.raises(SystemExit) as exit_:
        run._terminated(15, None)
    assert exit_.value.code == 143


def test_a_timing_phase_writes_its_files(tmp_path):
    """The run past the GPU refusal, timing alone at a tiny size: env.json, progress.log,
    timing.json and timing.md, and exit status 0 (torch's cells skipped: no CUDA here)."""
    log = run._log_for(tmp_path)
    grid = TimingGrid(1, 2, 16, (32,), "float32", impls=(Impl("jax", None),
                                                          Impl("torch", "cudnn")), steady_s=0.0)
    try:
        status = run._run(["timing"], grid, tmp_path, 60.0, log, ["attn-parity", "device-check"])
    finally:
        log.close()
    assert status == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "env.json", "progress.log", "timing.json", "timing.md"]
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["phases"]["timing"]["status"] == "pass" and env["budget_s"] == 60.0
    assert env["command"] == ["attn-parity", "device-check"] and "jax" in env
    rows = json.loads((tmp_path / "timing.json").read_text())["rows"]
    assert [r["status"] for r in rows if r["impl"] == "torch cudnn"] == ["skipped"] * 4
    assert "torch sees no CUDA device" in rows[-1]["reason"]
    assert "phase timing: done" in (tmp_path / "progress.log").read_text()


def test_explicits_slow_backward_compile_is_skipped_on_a_gpu_only():
    """SLOW_COMPILE (measured on an H200: explicit's forward+backward compiled for 102 s at
    L = 4096): skipped there with the reason, before anything is traced; its forward and a CPU
    run are not."""
    from golden.device_check.plan import SLOW_COMPILE, Cell

    grid = TimingGrid(1, 2, 16, (4096,), "bfloat16")
    slow = Cell(4096, True, True, Impl("jax", "explicit"))
    row = timing.time_cell(slow, grid, {}, steady_s=0.0, platform="gpu")
    assert (row["status"], row["reason"]) == (
        "skipped", "its compile at L ≥ 4096 takes minutes (SLOW_COMPILE)")
    assert SLOW_COMPILE == {("explicit", True): 4096}
    forward = timing.time_cell(slow._replace(backward=False), grid, {}, steady_s=0.0,
                               platform="gpu")
    assert forward["status"] == "error"  # it went on to trace (no inputs given here)


def test_the_command_line_recorded_is_the_one_given(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(run, "_run", lambda *a: seen.setdefault("command", a[-1]) and 0)
    monkeypatch.setattr(run, "gpu_refusal", lambda: None)
    argv = ["device-check", "--out", str(tmp_path), "--only", "timing"]
    assert main(argv) == 0
    assert seen["command"] == ["attn-parity", *argv]
