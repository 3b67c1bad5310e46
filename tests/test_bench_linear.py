"""``attn-parity bench --only linear``: the gated delta rule's chunked cores against transformers'
own functions, on the quick grid (speed is never asserted: only that every row was measured, its
ratio is the medians', and every contender computed the same function), and the verbatim excerpt
of transformers' functions that a machine without transformers times instead."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import torch

from golden.bench import QUICK
from golden.bench.linear import LINEAR_PARTS, PEER, linear_inputs
from golden.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = {"forward": ("jax_chunked", "torch_chunked", "hf_chunked"),
              "forward+backward": ("jax_chunked", "torch_chunked", "hf_chunked"),
              "decode": ("jax_recurrent", "torch_recurrent", "hf_recurrent")}
# The same function in float32 on the quick grid's inputs (L ≤ 160, D 16): measured at most
# 3e-7 of max |o|; 1e-5 leaves room for another host's rounding and fails a different function
# (a missing scale, a decay applied once too often) by orders of magnitude.
SAME_FUNCTION = 1e-5


def test_only_linear_times_our_cores_against_transformers(tmp_path, capsys):
    assert main(["bench", "--quick", "--only", "linear", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "linear.json").read_text())["linear"]
    h, d, batches = QUICK.linear
    cells = [(p, b, length) for b, lengths, longest in batches for length in lengths
             for p in ("forward", "forward+backward") if p == "forward" or length <= longest]
    cells += [("decode", b, 1) for b, _, _ in batches]
    assert sorted((r["part"], r["B"], r["L"], r["impl"]) for r in rows) == sorted(
        (p, b, length, i) for p, b, length in cells for i in CONTENDERS[p])
    at = {(r["part"], r["B"], r["L"], r["impl"]): r for r in rows}
    for r in rows:
        assert r["part"] in LINEAR_PARTS and (r["H"], r["D"]) == (h, d)
        assert r["median_ms"] > 0 and r["repeats"] == len(r["times_ms"]) >= 2
        peer = at[r["part"], r["B"], r["L"], PEER[r["part"]]]
        assert r["peer_ratio"] == peer["median_ms"] / r["median_ms"]
        assert (r["xla_temp_mib"] is not None) == r["impl"].startswith("jax")
        if r["part"] == "forward+backward":
            assert r["diff_vs_peer"] is None
        else:
            assert r["diff_vs_peer"] <= SAME_FUNCTION, r
    assert not (tmp_path / "latest.json").exists()
    out = capsys.readouterr().out
    assert "## Gated delta-rule linear attention (float32)" in out
    assert "| decode | 1 | 2 | 1 | 16 | hf_recurrent |" in out


def test_linear_inputs_are_what_the_cores_take():
    a = linear_inputs(np.random.default_rng(0), 2, 3, 5, 4)
    assert {n: x.shape for n, x in a.items()} == {
        "q": (2, 3, 5, 4), "k": (2, 3, 5, 4), "v": (2, 3, 5, 4), "g": (2, 3, 5),
        "beta": (2, 3, 5), "state": (2, 3, 4, 4)}
    assert all(x.dtype == np.float32 for x in a.values())
    assert np.allclose(np.linalg.norm(a["q"], axis=-1), 1, atol=1e-6)
    assert (a["g"] <= 0).all() and ((0 < a["beta"]) & (a["beta"] < 1)).all()


def _excerpt(tmp_path):
    spec = importlib.util.spec_from_file_location("hf_excerpt", ROOT / "bench" / "hf_excerpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path)
    path = tmp_path / "transformers" / "models" / "qwen3_next" / "modeling_qwen3_next.py"
    spec = importlib.util.spec_from_file_location("excerpt_qwen3_next", path)
    excerpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(excerpt)
    return excerpt


def test_the_excerpt_is_transformers_own_functions(tmp_path):
    """The stand-in's functions give transformers' results bit for bit (the same source), with
    and without an initial state, grouped value heads and a length past one chunk."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf
    excerpt = _excerpt(tmp_path)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 70, 2, 8, generator=gen) for _ in range(2))
    v = torch.randn(1, 70, 4, 8, generator=gen)
    g, beta = -torch.rand(1, 70, 4, generator=gen), torch.rand(1, 70, 4, generator=gen)
    state = torch.randn(1, 4, 8, 8, generator=gen)
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        for kw in ({}, dict(initial_state=state, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)):
            ours = getattr(excerpt, name)(q, k, v, g, beta, **kw)
            theirs = getattr(hf, name)(q, k, v, g, beta, **kw)
            for a, b in zip(ours, theirs):
                assert (a is None and b is None) or torch.equal(a, b), (name, kw)


def test_performance_table_is_the_committed_report():
    """docs/performance.md's linear-attention table is linear_markdown's on the committed rows
    (bench/results/linear/linear.json), line for line and in one block: no figure typed by
    hand."""
    from golden.bench.linear import linear_markdown
    rows = json.loads((ROOT / "bench" / "results" / "linear" / "linear.json").read_text())
    lines = [x for x in linear_markdown(rows["linear"]) if x.startswith("|")]
    doc = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert "\n".join(lines) in doc


def test_readme_ratios_are_the_committed_rows():
    """README's CPU figures for the gated delta rule: the range of JAX's chunked ÷ transformers'
    over the committed rows at L ≥ 4096, forward and forward+backward."""
    rows = json.loads((ROOT / "bench" / "results" / "linear" / "linear.json").read_text())
    ratios = {"forward": [], "forward+backward": []}
    for r in rows["linear"]:
        if r["impl"] == "jax_chunked" and r["L"] >= 4096:
            ratios[r["part"]].append(r["peer_ratio"])
    forward, both = ratios["forward"], ratios["forward+backward"]
    assert forward and both and min(forward) >= 1.0  # the goal
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert (f"runs its forward {min(forward):.1f}–{max(forward):.1f} times and its "
            f"forward+backward {min(both):.1f}–{max(both):.1f} times as fast as "
            f"transformers'") in readme


def test_gpu_grouping_table_is_the_committed_device_rows():
    """docs/performance.md's table of the two chunk groupings on a GPU is
    bench/device_grouping.py's markdown of the committed rows, and its stated range theirs."""
    import bench.device_grouping as grouping
    rows = json.loads((ROOT / "bench" / "results" / "h200-2026-11-28-issue44b"
                       / "grouping.json").read_text())
    doc = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert "\n".join(grouping.markdown(rows)) in doc
    ratios = [float(line.rsplit("|", 2)[-2]) for line in grouping.markdown(rows)[2:]]
    assert f"one chunk at a time is {min(ratios):.1f}–{max(ratios):.1f}" in " ".join(doc.split())
    assert all(r["rel_max_diff"] == 0.0 for r in rows if r["part"] == "agreement")


def test_gpu_table_is_the_committed_device_report():
    """docs/performance.md's GPU table of the gated delta rule is linear_markdown's on the rows
    the device check committed (bench/results/h200-2026-11-28-issue44/linear.json)."""
    from golden.bench.linear import linear_markdown
    path = ROOT / "bench" / "results" / "h200-2026-11-28-issue44" / "linear.json"
    rows = json.loads(path.read_text())["linear"]
    lines = [x for x in linear_markdown(rows) if x.startswith("|")]
    doc = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert "\n".join(lines) in doc
    ratios = {(r["impl"], r["part"]): [] for r in rows}
    for r in rows:
        if r["peer_ratio"] is not None:
            ratios[r["impl"], r["part"]].append(r["peer_ratio"])
    forward, both = ratios["jax_chunked", "forward"], ratios["jax_chunked", "forward+backward"]
    assert (f"{min(forward):.1f}–{max(forward):.1f} times transformers' forward and "
            f"{min(both):.1f}–{max(both):.1f} times its") in doc.replace("\n  ", " ")
