"""``attn-parity bench --only sparse``: the cores' sparse implementation with a given selection
against dense causal attention, on the quick grid (speed is never asserted: only that every row
was measured or skipped with its reason, its ratios are the medians', the sparse rows computed
the function of the dense call with the same selection, JAX's sparse memory doubles with L, and
the crossover follows the medians)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from golden.bench import QUICK
from golden.bench.sparse import (
    DENSE,
    SAME_SELECTION,
    SPARSE_CONTENDERS,
    SPARSE_PARTS,
    causal_selection,
    crossovers,
    run_sparse,
    sparse_markdown,
)
from golden.cli import main

# The same function in float32 on the quick grid's inputs (L ≤ 512, D 16, k 16): measured at most
# 3e-7 of max |x| (outputs and gradients); 1e-5 leaves room for another host's rounding and fails
# another selection (one key more or less in a row moves the output by ~1e-2).
SAME_FUNCTION = 1e-5


def test_only_sparse_times_sparse_against_dense(tmp_path, capsys):
    assert main(["bench", "--quick", "--only", "sparse", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sparse.json").read_text())["sparse"]
    b, heads, dims, lengths, k, masked_max, _ = QUICK.sparse
    assert [(r["part"], r["L"], (r["H"], r["Hkv"]), r["D"], r["impl"]) for r in rows] == [
        (p, length, h, d, i) for p in SPARSE_PARTS for length in lengths for h in heads
        for d in dims for i in SPARSE_CONTENDERS]
    at = {(r["part"], r["L"], r["H"], r["Hkv"], r["D"], r["impl"]): r for r in rows}
    compared = 0
    for r in rows:
        assert (r["B"], r["k"]) == (b, k) and (r["H"], r["Hkv"]) in heads
        if r["impl"] == SAME_SELECTION and r["L"] > masked_max:
            assert r["skipped"].startswith(f"L > {masked_max}: its (L, L) boolean mask"), r
            continue
        assert r["skipped"] is None, r  # the quick grid fits its budget
        assert r["median_ms"] > 0 and r["repeats"] == len(r["times_ms"]) >= 2
        dense = at[r["part"], r["L"], r["H"], r["Hkv"], r["D"], DENSE[r["impl"].split("_")[0]]]
        assert r["dense_ratio"] == dense["median_ms"] / r["median_ms"]
        assert (r["xla_temp_mib"] is not None) == r["impl"].startswith("jax")
        if r["impl"].endswith("sparse") and r["L"] <= masked_max:
            assert r["diff_vs_masked"] <= SAME_FUNCTION, r
            compared += 1
        else:
            assert r["diff_vs_masked"] is None
        half = at.get((r["part"], r["L"] // 2, r["H"], r["Hkv"], r["D"], r["impl"]))
        if r["impl"].startswith("jax") and half is not None and half["xla_temp_mib"]:
            assert r["mem_x2"] == r["xla_temp_mib"] / half["xla_temp_mib"]
            if r["part"] != "decode" and r["impl"] in ("jax_sparse", SAME_SELECTION) \
                    and r["L"] >= 256:  # below, fixed buffers still weigh (×1.4 at 64 → 128)
                # XLA's temporary bytes: O(L·k) for sparse, O(L²) with the (L, L) mask
                want = 2.0 if r["impl"] == "jax_sparse" else 4.0
                assert r["mem_x2"] == pytest.approx(want, rel=0.15), r
    assert compared == 2 * len(SPARSE_PARTS) * len(heads) * len(dims) * sum(
        x <= masked_max for x in lengths)
    for c in crossovers(rows):
        cell = (c["part"], c["H"], c["Hkv"], c["D"])
        pairs = [(at[(cell[0], x) + cell[1:] + (f"{c['framework']}_sparse",)],
                  at[(cell[0], x) + cell[1:] + (DENSE[c["framework"]],)]) for x in lengths]
        wins = [s["L"] for s, d in pairs if s["median_ms"] < d["median_ms"]]
        assert c["L"] == (min(wins) if wins else None) and c["compared_at"] == list(lengths)
    assert not (tmp_path / "latest.json").exists()
    out = capsys.readouterr().out
    assert "## A given selection: sparse against dense causal attention (float32)" in out
    h = heads[0]
    assert (f"| decode | {lengths[-1]} | {h[0]}/{h[1]} | {dims[0]} | {k} | jax_masked | "
            f"skipped: L > ") in out
    assert "| framework | part | H/Hkv | D | crossover L | compared at L |" in out


def test_cells_past_the_budget_are_skipped_with_the_prediction():
    grid = replace(QUICK, sparse=QUICK.sparse[:-1] + (0.0,))
    rows = run_sparse(grid, np.random.default_rng(1))
    assert len(rows) == (len(SPARSE_PARTS) * len(QUICK.sparse[3]) * len(QUICK.sparse[1])
                         * len(SPARSE_CONTENDERS))
    for r in rows:
        assert r["median_ms"] is None and r["dense_ratio"] is None
        if not (r["impl"] == SAME_SELECTION and r["L"] > QUICK.sparse[5]):
            assert r["skipped"].startswith("budget: ") and "predicted" in r["skipped"], r
    assert all(c["L"] is None and c["compared_at"] == [] for c in crossovers(rows))


def test_causal_selection_is_k_distinct_causal_keys_per_row():
    length, k = 300, 40
    s = causal_selection(np.random.default_rng(2), length, k)
    assert s.shape == (length, k) and s.dtype == np.int32
    assert (s[:k] == np.arange(k)).all()
    rows = np.arange(length)[:, None]
    assert (s[k:] <= rows[k:]).all() and (s >= 0).all()
    assert (np.diff(s[k:], axis=-1) > 0).all()  # increasing, so distinct
    assert (s[k:, -1] > s[k:, -1].min()).any()  # not every row the same keys
    with pytest.raises(ValueError, match="selected should be a k in 1 … L = 5, got 6"):
        causal_selection(np.random.default_rng(0), 5, 6)


def test_performance_tables_are_the_committed_reports():
    """docs/performance.md's sparse tables are sparse_markdown's on the committed CPU rows
    (bench/results/sparse/sparse.json) and bench/device_sparse.py's markdown on the device
    check's (bench/results/h200-2026-11-28-issue44/sparse_gpu.json), line for line."""
    import bench.device_sparse as device
    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "performance.md").read_text(encoding="utf-8")
    rows = json.loads((root / "bench" / "results" / "sparse" / "sparse.json").read_text())
    lines = [x for x in sparse_markdown(rows["sparse"]) if x.startswith("|")]
    assert "\n".join(lines) in doc
    gpu = json.loads((root / "bench" / "results" / "h200-2026-11-28-issue44" /
                      "sparse_gpu.json").read_text())
    assert "\n".join(device.markdown(gpu)) in doc


def test_readme_figures_are_the_committed_rows():
    """The README's sparse figures: JAX's 16/1 forward crossover and its ratio at 64k, on the
    CPU and the GPU rows committed."""
    import bench.device_sparse  # noqa: F401  (the GPU rows' script)
    root = Path(__file__).resolve().parents[1]
    readme = " ".join((root / "README.md").read_text(encoding="utf-8").split())
    rows = json.loads((root / "bench" / "results" / "sparse" / "sparse.json").read_text())
    rows = rows["sparse"]
    cross = next(c for c in crossovers(rows) if (c["framework"], c["part"], c["H"], c["Hkv"])
                 == ("jax", "forward", 16, 1))
    at = next(r for r in rows if (r["impl"], r["part"], r["H"], r["L"]) ==
              ("jax_sparse", "forward", 16, 65536))
    assert cross["L"] == 32768 and "from L = 32k" in readme
    assert f"{at['dense_ratio']:.1f} times at 64k" in readme
    gpu = json.loads((root / "bench" / "results" / "h200-2026-11-28-issue44" /
                      "sparse_gpu.json").read_text())
    ms = {r["impl"]: r["median_ms"] for r in gpu if (r["H"], r["L"], r["part"]) ==
          (16, 65536, "forward") and "median_ms" in r}
    assert f"{ms['blockwise'] / ms['sparse']:.1f} times on an H200" in readme
