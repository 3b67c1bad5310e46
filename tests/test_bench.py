"""The benchmark harness runs end to end on its tiny grid and writes both reports. Speed is never
asserted here: only that the numbers exist and the files have the expected structure."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from golden.bench import (
    DECODE_IMPLS,
    IMPLS,
    LONG_IMPLS,
    MODERN_IMPLS,
    MODULES,
    QUICK,
    Shape,
    ceiling,
    POSITION_IMPLS,
    decode_features,
    emulation_gap,
    latent_models,
    interleaved,
    position_encodings,
    positions_markdown,
    text_positions,
    steady_repeats,
    xla_isa,
    xla_max_isa,
)
from golden.cli import main
from tests.helpers import matrix

ROOT = Path(__file__).resolve().parents[1]


def host_flags() -> set[str]:
    """This host's x86 flags, read here rather than through golden.bench."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "flags:")
    return set(line.split(":", 1)[1].split())


def quick_section(env: dict, out: Path) -> subprocess.CompletedProcess:
    """``python -m golden.bench --quick --only latent_decode --out OUT`` in a subprocess with
    ``env`` (this checkout first on its PYTHONPATH), from the repository root."""
    env = {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "golden.bench", "--quick", "--only",
                           "latent_decode", "--out", str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def bench_script(name: str):
    """bench/NAME.py as a module (bench/ is not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_machine(m: dict) -> None:
    """The machine fields say what this process's environment and CPU say."""
    assert {"cpu", "cores", "cpu_isa", "cpu_flags", "xla_isa", "torch_isa", "numpy_isa",
            "numpy_dispatch", "XLA_FLAGS", "ATEN_CPU_CAPABILITY", "NPY_DISABLE_CPU_FEATURES",
            "torch", "jax", "date"} <= set(m)
    assert m["cores"] == os.cpu_count() and m["cpu"]
    for name in ("XLA_FLAGS", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                 "ONEDNN_MAX_CPU_ISA", "NPY_DISABLE_CPU_FEATURES"):
        assert m[name] == os.environ.get(name)
    flags = host_flags()
    assert set(m["cpu_flags"]) <= flags
    if "avx512f" in flags:
        assert m["cpu_isa"].startswith("AVX512") or m["cpu_isa"] == "AMX"
    elif "avx2" in flags:
        assert m["cpu_isa"] == "AVX2" and m["torch_isa"] != "AVX512"
        assert not any("AVX512" in t or t == "X86_V4" for t in m["numpy_dispatch"])


# The smallest grid that still runs every section: the quick grid's first shape, its first long
# length. The quick suite runs the whole bench on it; the matrix on the quick grid itself.
TINY = dataclasses.replace(QUICK, shapes=QUICK.shapes[:1],
                           long=(QUICK.long[0], QUICK.long[1][:1], QUICK.long[2]))


@pytest.mark.parametrize("grid", [pytest.param(TINY, id="tiny"),
                                  pytest.param(QUICK, id="quick", marks=matrix)])
def test_quick_run_writes_both_reports(tmp_path, monkeypatch, grid):
    monkeypatch.setattr("golden.bench.cli.QUICK", grid)  # what --quick runs
    # --budget 0: every forward+backward block predicted past the budget; each row is still
    # measured, at 3 steady calls, where the forwards take round(0.5 s / first call) ≤ 5
    assert main(["bench", "--quick", "--budget", "0", "--repeats", "5",
                 "--out", str(tmp_path)]) == 0  # as attn-parity bench
    report = json.loads((tmp_path / "latest.json").read_text())
    assert {"machine", "grid", "ceilings", "results", "modules", "gqa", "decode", "choice",
            "long", "modern", "targets", "budget", "wall_s"} <= set(report)
    assert "skipped" not in report
    check_machine(report["machine"])
    budget = report["budget"]
    assert budget["budget_s"] == 0 and budget["within"] is False
    assert [n.split(" forward+backward")[0] for n in budget["notes"][:-1]] == [
        s.name for s in grid.shapes]
    assert all("at the least steady calls per row" in n for n in budget["notes"][:-1])
    assert "past its 0 s budget, with every row measured" in budget["notes"][-1]
    blocks = {(r["shape"], r["dtype"], r["causal"], r["pass"], r["impl"])
              for r in report["results"]}
    assert blocks == {(s.name, "float32", c, p, i) for s in grid.shapes for c in (False, True)
                      for p in ("fwd", "fwd+bwd") for i in IMPLS} | {
        (Shape(**report["grid"]["bf16_shape"]).name, "bfloat16", c, "fwd", i)
        for c in (False, True) for i in IMPLS}
    for r in report["results"]:  # the rule: round(steady_s / first steady call) in [3, 5]
        assert r["most_repeats"] == 5 and r["repeats"] == len(r["times_ms"])
        assert r["steady_s"] == (0.0 if r["pass"] == "fwd+bwd" else 0.5)
        assert r["repeats"] == max(3, min(5, round(r["steady_s"] / (r["times_ms"][0] / 1e3))))
    assert all(r["repeats"] == 3 for r in report["results"] if r["pass"] == "fwd+bwd")
    modern = report["modern"]  # sinks, chunks, ALiBi: every implementation, both passes
    assert {(r["feature"], r["pass"], r["impl"]) for r in modern} == {
        (f, p, i) for f in ("sinks", "chunks", "alibi") for p in ("fwd", "fwd+bwd")
        for i in MODERN_IMPLS}
    assert all(r["median_ms"] > 0 and r["peer_ratio"] > 0 for r in modern)
    options = report["decode_features"]  # the decode step with each option, both frameworks
    assert {(r["feature"], r["impl"]) for r in options} == {
        (f, i) for f in decode_features(report["grid"]["decode"][-1])
        for i in ("torch_module", "jax_module")}
    assert all(r["median_ms"] > 0 and r["plain_ratio"] > 0 for r in options)
    latent = report["latent_decode"]  # MLA plain and absorbed against GQA, both frameworks
    assert len(latent) == 2 * 4 and all(r["median_ms"] > 0 for r in latent)
    assert {(c["framework"], c["dtype"]) for c in report["ceilings"]} >= {
        ("jax", "float32"), ("torch", "float32")}
    rows = report["results"]
    assert {r["impl"] for r in rows} == set(IMPLS)
    assert {r["pass"] for r in rows} == {"fwd", "fwd+bwd"}
    assert {r["causal"] for r in rows} == {False, True}
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16"}
    for r in rows:
        assert {"shape", "median_ms", "gflop_s", "pct_ceiling", "compile_ms", "first_call_ms",
                "rss_peak_growth_mb", "xla_memory", "jax_core_speedup",
                "torch_core_speedup"} <= set(r)
        assert r["median_ms"] > 0 and r["repeats"] >= 1
        assert (r["xla_memory"] is not None) == (r["framework"] == "jax")
    assert all(t["ratio"] is not None for t in report["targets"])
    assert "decode step" in report["targets"][3]["name"]
    assert [r["impl"] for r in report["modules"]] == list(MODULES)
    for r in report["modules"]:
        assert {"shape", "median_ms", "first_call_ms", "repeats", "ours_speedup"} <= set(r)
        assert r["median_ms"] > 0 and r["repeats"] >= 1
    md = (tmp_path / "latest.md").read_text()
    assert "budget; forward only" not in md and "## Skipped" not in md  # the old skip
    assert "## Budget" in md and "Every row measured" in md
    m = report["machine"]
    assert (f"in use: XLA code generation {m['xla_isa']}, torch {m['torch_isa']}, "
            f"NumPy {m['numpy_isa']}") in md
    assert "| impl |" in md and "jax_core×" in md and "## Targets" in md
    assert "## Module calls" in md and "| ours× |" in md
    assert all(f"| {impl} |" in md for impl in MODULES)
    gqa = report["gqa"]  # grouped-query rows: every implementation, causal and not
    assert {(r["impl"], r["causal"]) for r in gqa} == {
        (i, c) for i in ("jax_core", "jax_peer", "torch_core", "torch_peer") for c in (False, True)}
    assert all(r["median_ms"] > 0 and "Hkv=" in r["shape"] for r in gqa)
    assert "## Grouped-query attention" in md
    decode = report["decode"]  # KV-cache rows: both modules' prefill and decode step, donated
    assert [(r["phase"], r["impl"]) for r in decode] == [
        ("decode step", i) for i in DECODE_IMPLS] + [
        ("prefill", i) for i in DECODE_IMPLS if i != "jax_donated"]
    for r in decode:
        assert r["median_ms"] > 0 and r["repeats"] >= 1 and "P=" in r["shape"]
        assert math.isfinite(r["torch_ratio"]) and r["torch_ratio"] > 0
    assert "## KV-cache decoding" in md
    assert all(f"| {r['phase']} | {r['impl']} |" in md for r in decode)
    long = report["long"]  # long sequences: every implementation at both quick lengths
    assert {(r["L"], r["pass"], r["impl"]) for r in long} == {
        (n, p, i) for n in grid.long[1] for p in ("fwd", "fwd+bwd") for i in LONG_IMPLS
        if n <= grid.long[2] or not i.endswith("explicit")}  # explicit ones up to the grid's
    for r in long:
        assert r["median_ms"] > 0 and math.isfinite(r["peer_ratio"]) and r["peer_ratio"] > 0
    assert "## Long sequences" in md
    assert all(f"| {r['L']} | {r['pass']} | {r['impl']} |" in md for r in long)
    assert not list(tmp_path.glob("*.tmp"))


def test_ring_comm_paper_figures_are_the_hand_derived_ones():
    # bench/ring_comm.py's table for the README's layer (B=1, H=32, Hkv=8, L=128k, D=128,
    # bfloat16, P=8), derived by hand: a device's K and V block is 2·1·8·16384·128·2 bytes =
    # 64 MiB, sent P − 1 = 7 times = 448 MiB, what an all-gather receives (7/8 of 2·8·131072·
    # 128·2 bytes = 512 MiB); the forward step hides its transfer on a v5e (197 TFLOP/s, 50 GB/s
    # one way) when L/P ≥ (Hkv/H)·s·F/(2·share·W) = (1/4)·2·197e12/(2·0.5·50e9) = 1970.
    ring_comm = bench_script("ring_comm")
    mib = 2**20
    f = ring_comm.paper(1, 32, 8, 131072, 128, 8, "bfloat16")
    assert (f["block"], f["ring_fwd"], f["gather_fwd"]) == (64 * mib, 448 * mib, 448 * mib)
    assert (f["held_ring"], f["held_gather"]) == (128 * mib, 512 * mib)
    flops, link = ring_comm.DEVICES["TPU v5e (ICI)"]
    _, _, least_fwd, _ = ring_comm.overlap(1, 32, 8, 131072, 128, 8, "bfloat16", flops, link,
                                           causal=True)
    assert math.isclose(least_fwd, 1970.0)


@matrix  # the quick suite runs this section in the whole run on the tiny grid
def test_only_modern_runs_that_section_alone(tmp_path, capsys):
    assert main(["bench", "--quick", "--only", "modern", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "modern.json").read_text())
    assert len(report["modern"]) == 3 * 2 * len(MODERN_IMPLS)
    assert not (tmp_path / "latest.json").exists()
    assert "## Attention sinks, chunked attention and ALiBi" in capsys.readouterr().out


def test_only_choice_times_none_beside_each_named_implementation(tmp_path, capsys):
    """Every quick grid shape, causal and not, both passes; None's recorded implementations:
    explicit at these sizes, forward and backward (below functional.SPLIT_ABOVE scores JAX
    differentiates it; the full grid's rows from L = 512 on add blockwise's backward)."""
    assert main(["bench", "--quick", "--only", "choice", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "choice.json").read_text())["choice"]
    from golden.bench import QUICK
    assert [(r["shape"], r["pass"], r["causal"]) for r in rows] == [
        (s.name, p, c) for s in QUICK.shapes for p in ("fwd", "fwd+bwd") for c in (False, True)]
    assert [r["none_ran"] for r in rows] == ["explicit"] * 8
    for r in rows:
        assert set(r["median_ms"]) == {"None", "explicit", "blockwise"}
        assert r["fastest"] == min(r["median_ms"], key=r["median_ms"].get)
        assert r["none_over_fastest"] == r["median_ms"]["None"] / r["median_ms"][r["fastest"]]
    assert not (tmp_path / "latest.json").exists()
    assert "## The automatic choice" in capsys.readouterr().out


@matrix  # the quick suite runs this section in the whole run on the tiny grid
def test_only_decode_features_runs_that_section_alone(tmp_path, capsys):
    assert main(["bench", "--quick", "--only", "decode_features", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode_features.json").read_text())
    assert len(report["decode_features"]) == 2 * len(decode_features(16))
    assert not (tmp_path / "latest.json").exists()
    assert "## The decode step with each option" in capsys.readouterr().out


def test_only_latent_decode_runs_that_section_alone(tmp_path, capsys):
    """MLA's decode step, plain and absorbed, beside GQA's and MHA's of the same width, both
    frameworks; cache bytes per token counted by hand for the quick grid (d_in 32, H 4, Hkv 2,
    Dh 8; MLA r 32, Dr 4): GQA 2·2·8·4 = 128, MHA 2·4·8·4 = 256, MLA (32 + 4)·4 = 144."""
    assert main(["bench", "--quick", "--only", "latent_decode", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "latent_decode.json").read_text())["latent_decode"]
    from golden.bench import QUICK
    models = [m[0] for m in latent_models(QUICK)]
    assert [(r["model"], r["impl"]) for r in rows] == [
        (m, i) for m in models for i in ("torch_module", "jax_module")]
    assert [r["cache_bytes_per_token"] for r in rows[::2]] == [128, 256, 144, 144]
    assert all(r["median_ms"] > 0 and r["gqa_ratio"] > 0 for r in rows)
    assert not (tmp_path / "latest.json").exists()
    assert "## Multi-head latent attention's decode step" in capsys.readouterr().out


def test_text_positions_are_get_rope_index_s_for_text_an_image_text():
    """L = 8 with a 2 × 2 image, by hand: 2 text tokens (0, 1 on every axis), the image at
    t = 2, h = 2 + row, w = 2 + column, then text from max + 1 = 4 on."""
    assert text_positions(8, 2).tolist() == [[[0, 1, 2, 2, 2, 2, 4, 5]],
                                             [[0, 1, 2, 2, 3, 3, 4, 5]],
                                             [[0, 1, 2, 3, 2, 3, 4, 5]]]


def test_interleaved_calls_each_in_turn_round_by_round():
    """A first call of each, then rounds of one call of each in the given order: fast calls get
    the most rounds (round(0.5 s / a few µs) > 4), each row its own times."""
    order = []
    calls = {key: (lambda key: order.append(key), [key]) for key in ("a", "b", "c")}
    measured = interleaved(calls, 4)
    assert order == ["a", "b", "c"] * 5  # first calls, then 4 rounds
    assert [m["repeats"] for m in measured.values()] == [4, 4, 4]
    assert all(len(m["times_ms"]) == 4 and m["most_repeats"] == 4 for m in measured.values())


def test_only_positions_times_each_encoding_against_1d_in_both_twins(tmp_path, capsys):
    """Every tower's encodings, the layer and the rope alone, both twins, on the quick grid's
    small shapes; the positions each module was given have the axes its encoding takes. Speed is
    not asserted: only that each row was measured and its ratios are the medians'."""
    assert main(["bench", "--quick", "--only", "positions", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "positions.json").read_text())["positions"]
    encodings = position_encodings(QUICK)
    assert [n for _, _, e in encodings.values() for n in e] == [
        "1-D", "axial", "1-D", "MRoPE chunked [2, 3, 3]", "MRoPE interleaved [4, 2, 2]"]
    assert [e["axial"][1].shape for *_, e in encodings.values() if "axial" in e] == [(2, 1, 16)]
    assert encodings["text"][2]["MRoPE chunked [2, 3, 3]"][1].shape == (3, 1, 48)
    assert {(r["tower"], r["encoding"], r["part"], r["impl"]) for r in rows} == {
        (t, n, p, i) for t, (_, _, e) in encodings.items() for n in e
        for p in ("layer", "rope") for i in POSITION_IMPLS}
    assert len(rows) == 5 * 2 * 2
    at = {(r["tower"], r["encoding"], r["part"], r["impl"]): r for r in rows}
    for r in rows:
        assert r["median_ms"] > 0 and r["repeats"] == len(r["times_ms"]) >= 2
        plain = at[r["tower"], "1-D", r["part"], r["impl"]]["median_ms"]
        peer = at[r["tower"], r["encoding"], r["part"], "torch_module"]["median_ms"]
        assert r["enc_ratio"] == r["median_ms"] / plain and r["torch_ratio"] == (
            r["median_ms"] / peer)
    assert not (tmp_path / "latest.json").exists()
    out = capsys.readouterr().out
    assert "## Positions in more than one dimension: MRoPE and axial RoPE" in out
    assert "| text | MRoPE interleaved [4, 2, 2] | layer |" in out
    assert "| vision | axial |" in out.split("extra % of layer")[-1]


def test_steady_repeats_fills_half_a_second_within_three_and_the_most():
    assert steady_repeats(0.1, 0.5, 10) == 5   # 0.5 s / 0.1 s
    assert steady_repeats(0.001, 0.5, 10) == 10  # 500 wanted, 10 at most
    assert steady_repeats(0.9, 0.5, 10) == 3   # a slow call: never fewer than 3
    assert steady_repeats(1.0, 0.5, 10) == 2   # a call of a second or more: 2
    assert steady_repeats(2.0, 0.0, 10) == 2
    assert steady_repeats(0.1, 0.0, 10) == 3   # a run short of budget: the least everywhere
    assert steady_repeats(0.12, 0.5, 10) == 4  # round(4.17)
    with pytest.raises(ValueError, match="most should be at least MIN_REPEATS = 3, got 2"):
        steady_repeats(0.1, 0.5, 2)
    with pytest.raises(ValueError, match="first_s and steady_s"):
        steady_repeats(-1.0, 0.5, 10)


def test_ceiling_halves_a_product_predicted_too_slow(monkeypatch):
    # A product predicted (from one a quarter the size) to take more than CEILING_CALL_S is
    # measured at half the size, and so on down to 64; the row says the n measured.
    # (The budget is set both ways, not left to the host: on a loaded machine a real 256³
    # product can be predicted past the default budget, and the first assertion was a timing.)
    rng = np.random.default_rng(0)
    monkeypatch.setattr("golden.bench.attention.CEILING_CALL_S", float("inf"))
    assert ceiling("torch", 256, "float32", 3, rng)["n"] == 256  # never predicted too slow
    monkeypatch.setattr("golden.bench.attention.CEILING_CALL_S", 0.0)  # where ceiling reads it
    row = ceiling("jax", 256, "float32", 3, rng)
    assert row["n"] == 64
    assert row["gflop_s"] == pytest.approx(2 * 64**3 / (row["median_ms"] * 1e-3) / 1e9)


def test_xla_isa_is_the_hosts_capped_by_xla_cpu_max_isa():
    avx2 = {"sse4_2", "avx", "avx2", "fma"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert xla_max_isa(None) is None and xla_max_isa("--xla_dump_to=/tmp") is None
    assert xla_max_isa("--xla_cpu_max_isa=avx2 --xla_dump_to=/tmp") == "AVX2"
    assert xla_max_isa("--xla_cpu_max_isa=AVX512 --xla_cpu_max_isa=AVX") == "AVX"  # last wins
    assert xla_isa(avx512, None) == "AVX512_VNNI"
    assert xla_isa(avx512, "AVX2") == "AVX2"
    assert xla_isa(avx2, "AVX512") == "AVX2"  # a cap above the host changes nothing
    assert xla_isa(avx512, "NOT_AN_ISA") is None
    assert xla_isa({"asimd", "sve"}, None) is None  # Arm: not in XLA_ISAS' x86 names


@pytest.mark.skipif("avx2" not in host_flags(), reason="needs an x86 CPU with AVX2")
def test_report_states_the_emulated_instruction_set(tmp_path):
    """A run under the three switches (as a user emulating an AVX2 host would set them) says
    so: XLA capped at AVX2, torch's kernels AVX2, no AVX-512 target among NumPy's."""
    disabled = ("X86_V4", "AVX512_ICL", "AVX512_SPR")
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_max_isa=AVX2", "ATEN_CPU_CAPABILITY": "avx2",
           "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
           "NPY_DISABLE_CPU_FEATURES": " ".join(disabled)}
    done = quick_section(env, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    m = json.loads((tmp_path / "latent_decode.json").read_text())["machine"]
    assert m["XLA_FLAGS"] == "--xla_cpu_max_isa=AVX2" and m["ATEN_CPU_CAPABILITY"] == "avx2"
    assert m["NPY_DISABLE_CPU_FEATURES"] == " ".join(disabled)
    assert m["xla_isa"] == "AVX2" and m["torch_isa"] == "AVX2"
    assert not set(m["numpy_dispatch"]) & set(disabled) and m["numpy_isa"] not in disabled
    assert m["cpu_isa"] == ("AVX2" if "avx512f" not in host_flags() else m["cpu_isa"])
    assert ("in use: XLA code generation AVX2, torch AVX2, NumPy " + m["numpy_isa"]
            in done.stdout)
    assert m["MKL_ENABLE_INSTRUCTIONS"] == "AVX2" and m["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert ("XLA_FLAGS=--xla_cpu_max_isa=AVX2; ATEN_CPU_CAPABILITY=avx2; "
            "MKL_ENABLE_INSTRUCTIONS=AVX2; ONEDNN_MAX_CPU_ISA=AVX2" in done.stdout)


def test_emulation_gap_names_the_missing_torch_caps():
    """ATEN_CPU_CAPABILITY below an AVX-512 host's, without MKL's and oneDNN's caps, is refused
    with the missing variables named; a complete set, AVX-512 asked for, or a host without
    AVX-512 (nothing to cap) is not."""
    avx512, avx2 = {"avx2", "avx512f"}, {"avx2"}
    gap = emulation_gap(avx512, {"ATEN_CPU_CAPABILITY": "avx2"})
    assert "set MKL_ENABLE_INSTRUCTIONS=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2 too" in gap
    gap = emulation_gap(avx512, {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert "set MKL_ENABLE_INSTRUCTIONS=AVX2 too" in gap and "ONEDNN" not in gap.split("too")[0]
    full = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert emulation_gap(avx512, full) is None
    assert emulation_gap(avx512, {"ATEN_CPU_CAPABILITY": "avx512"}) is None
    assert emulation_gap(avx512, {}) is None
    assert emulation_gap(avx2, {"ATEN_CPU_CAPABILITY": "avx2"}) is None


@pytest.mark.skipif("avx512f" not in host_flags(), reason="needs an x86 CPU with AVX-512")
def test_bench_refuses_an_emulation_that_leaves_torchs_products_uncapped(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")}
    done = quick_section({**env, "ATEN_CPU_CAPABILITY": "avx2"}, tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "set MKL_ENABLE_INSTRUCTIONS=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2 too" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_isa_table_pairs_the_two_reports_row_by_row():
    """bench/isa_table.py on the committed native and AVX2 reports: one line per grid and GQA
    row, each report's jax_core and torch_peer medians and their ratio as the reports hold."""
    isa_table = bench_script("isa_table")
    native, other = (json.loads((ROOT / "bench" / "results" / p).read_text())
                     for p in ("latest.json", "avx2/latest.json"))
    lines = isa_table.table(native, other).splitlines()
    keys = list(isa_table.medians(native))
    assert len(lines) == 2 + len(keys) and len(keys) == len(native["results"]) // 6 + 2
    first = next(r for r in native["results"] if r["impl"] == "jax_core")
    peer = next(r for r in native["results"] if r["impl"] == "torch_peer")
    cells = lines[2].split(" | ")
    assert cells[4] == isa_table._ms(first["median_ms"]) and cells[5] == isa_table._ms(
        peer["median_ms"])
    assert cells[6] == f"{peer['median_ms'] / first['median_ms']:.2f}×"
    alone = isa_table.table(other).splitlines()  # one report: a host's own run
    assert len(alone) == len(lines) and len(alone[2].split(" | ")) == 9


@pytest.mark.parametrize("reports", [("latest.json", "avx2/latest.json"),
                                     ("avx2_host/latest.json",),
                                     ("intel_host/latest.json", "intel_host/avx2/latest.json")],
                         ids=["amd_zen4", "amd_zen3", "intel_amx"])
def test_performance_tables_are_the_committed_reports(reports):
    """Each Speed table of docs/performance.md is bench/isa_table.py's output on the committed
    reports it names, character for character: no figure typed by hand."""
    isa_table = bench_script("isa_table")
    loaded = [json.loads((ROOT / "bench" / "results" / p).read_text()) for p in reports]
    table = isa_table.table(*loaded).strip()
    assert table in (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("report", ["positions.json", "avx2/positions.json",
                                    "one_core/positions.json", "one_core/avx2/positions.json"])
def test_positions_tables_are_the_committed_reports(report):
    """Both tables of each run in docs/performance.md's positions section are
    positions_markdown's on the committed rows (bench/results/positions/), line for line and
    in one block each: no figure typed by hand."""
    path = ROOT / "bench" / "results" / "positions" / report
    lines = [x for x in positions_markdown(json.loads(path.read_text())["positions"])
             if x.startswith("|")]
    cut = [n for n, x in enumerate(lines) if x.startswith("| tower |")][1]  # the second table
    doc = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert "\n".join(lines[:cut]) in doc and "\n".join(lines[cut:]) in doc
