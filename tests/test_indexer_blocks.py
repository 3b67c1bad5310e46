"""Block selection for the learned indexer (issue 44 part 4: MiniMax M3's "max", Qwen4-Exp's
"mean", GroupedQueryAttention's index_blocks) in the float64 reference: block scores against a
loop written out, exact ties, local blocks kept, everything kept = dense attention exactly,
gradients against central differences with the choice fixed, bad values refused by name, the
fixtures' gaps, and against transformers' own modules at float64.

Shape legend: B batch, L tokens, H heads, H_I indexer heads, D_I indexer width, b block size.
"""

from __future__ import annotations

import numpy as np
import pytest

from golden import reference
from golden.harness.regenerate import build, draw, draw_params
from golden.reference.rotary import rope_cos_sin
from golden.specification import variants
from golden.specification.cases import CASES
from golden.specification.validate import rope_settings

GQA = "grouped_query_attention"
BLOCK_CASES = [c for c in CASES if c.name.startswith("gqa_blocks_")]
GAP = 1e-3  # the fixtures' least relative gap between the last kept and first dropped block


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _turn(x, cos, sin):
    """rotate-half on the first 2·cos.shape[-1] features, written out pair by pair."""
    y, half = x.copy(), cos.shape[-1]
    for i in range(half):
        a, b = x[..., i], x[..., i + half]
        y[..., i], y[..., i + half] = a * cos[..., i] - b * sin[..., i], b * cos[..., i] + a * sin[..., i]
    return y


def _setup(config, x, params, positions=None):
    """(c, q (L, H_I, D_I) per row, raw k (L, D_I), cos_sin) for one unbatched row x (L, d)."""
    c = {"index_local_blocks": 0, "index_norm_eps": 1e-6, **variants.get(GQA).config(config)}
    dh = c["head_dim"] or c["d_in"] // c["num_heads"]
    settings = rope_settings(c["rope_theta"], c["rope_parameters"], c["partial_rotary_factor"],
                             c["rope_precision"])
    pos = np.arange(x.shape[0]) if positions is None else positions

    def cos_sin(at):
        return rope_cos_sin(settings, dh, np.asarray(at))

    cos, sin = cos_sin(pos)
    h, d = c["index_heads"], c["index_head_dim"]
    q = _rms((x @ params["W_index_q"]).reshape(-1, h, d), params["index_q_norm"],
             c["index_norm_eps"])
    q = _turn(q, cos[:, None, :], sin[:, None, :])
    return c, q, x @ params["W_index_k"], cos_sin, pos


def loop_scores(config, x, params, allowed, positions=None):
    """Every query's block scores, written out: a list over t of (blocks, scores), blocks the
    key lists, scores (H_I, M) ("max", None where a block has no visible key) or (M,)
    ("mean"); for one row x (L, d) and its visible keys allowed (L, L)."""
    c, q, raw, cos_sin, pos = _setup(config, x, params, positions)
    b, eps, rows = c["index_block_size"], c["index_norm_eps"], []
    if c["index_blocks"] == "max":
        k = _turn(_rms(raw, params["index_k_norm"], eps), *cos_sin(pos))
        for t in range(len(x)):
            blocks = [list(range(m, min(m + b, len(x)))) for m in range(0, len(x), b)]
            s = [[max((float(q[t, h] @ k[j]) for j in blk if allowed[t, j]), default=None)
                  for blk in blocks] for h in range(q.shape[1])]
            rows.append((blocks, s))
        return c, rows
    for t in range(len(x)):
        vis = [j for j in range(len(x)) if allowed[t, j]]
        blocks = [vis[i:i + b] for i in range(0, len(vis) - b + 1, b)]
        s = []
        for blk in blocks:
            key = _rms(raw[blk].mean(0), params["index_k_norm"], eps)
            key = _turn(key[None], *(a[None] for a in cos_sin(pos[blk[0]])))[0]
            s.append(sum(max(float(q[t, h] @ key), 0.0) for h in range(q.shape[1]))
                     / np.sqrt(q.shape[-1]))
        rows.append((blocks, s, vis[len(blocks) * b:]))
    return c, rows


def loop_choice(c, rows, positions):
    """The chosen keys of each query (and each indexer head for "max"), as sets, and the least
    relative gap between the last kept and the first dropped score (inf where none is dropped)."""
    b, n, gap, chosen = c["index_block_size"], c["index_topk_blocks"], np.inf, []
    for t, (blocks, s, *tail) in enumerate(rows):
        if c["index_blocks"] == "mean":
            order = sorted(range(len(s)), key=lambda m: (-s[m], m))
            if len(s) > n:
                gap = min(gap, (s[order[n - 1]] - s[order[n]]) / max(abs(s[order[n - 1]]), 1e-300))
            chosen.append({j for m in order[:n] for j in blocks[m]} | set(tail[0]))
            continue
        qb = positions[t] // b
        local = {max(qb - i, 0) for i in range(c["index_local_blocks"])}
        per_head = []
        for sh in s:
            rest = sorted((m for m in range(len(blocks)) if m not in local and sh[m] is not None),
                          key=lambda m: (-sh[m], m))
            slots = n - len(local)
            if 0 < slots < len(rest):
                hi, lo = sh[rest[slots - 1]], sh[rest[slots]]
                gap = min(gap, (hi - lo) / max(abs(hi), abs(lo), 1e-300))
            per_head.append({j for m in sorted(local) + rest[:slots] for j in blocks[m]})
        chosen.append(per_head)
    return chosen, gap


def case_arrays(case):
    """A case's drawn inputs and parameters (as golden.harness.regenerate.build draws them),
    float64, and each batch row's visible keys (B', L, L) (causal, lengths, mask)."""
    rng = np.random.default_rng(case.seed)
    inputs = {name: draw(spec, rng) for name, spec in case.inputs.items()}
    params = draw_params(case.variant, case.config, rng)
    x = np.asarray(inputs["x"], dtype=np.float64)
    rows = x.reshape((-1,) + x.shape[-2:])
    length = rows.shape[-2]
    allowed = np.tril(np.ones((len(rows), length, length), dtype=bool))
    lengths = inputs.get("query_seq_lengths")
    for i in range(len(rows)):
        if lengths is not None:
            allowed[i, lengths[i]:, :] = allowed[i, :, lengths[i]:] = False
        if "mask" in inputs:
            allowed[i] &= np.asarray(inputs["mask"]).reshape(allowed.shape)[i]
    return inputs, {n: a.astype(np.float64) for n, a in params.items()}, rows, allowed


def _chosen_sets(key_indices, c, i, t):
    """The reference's choice for batch row i, query t: a set ("mean") or one per KV group."""
    k = np.asarray(key_indices).reshape((-1,) + np.shape(key_indices)[-3 if c["index_blocks"] == "max" else -2:])[i]
    if c["index_blocks"] == "mean":
        return set(k[t].tolist())
    per = c["num_heads"] // c["index_heads"]
    return [set(k[g * per, t].tolist()) for g in range(c["index_heads"])]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: c.name)
def test_fixture_choice_equals_the_loop_and_gaps_are_clear(case):
    """The reference's block choice (float64) equals the loop written out, query by query; and
    every row's last kept and first dropped block scores differ by ≥ GAP relative, far above
    float32's error (Hugging Face scores in float32), so that every implementation must
    choose the same blocks."""
    inputs, params, rows, allowed = case_arrays(case)
    forward = reference.VARIANTS[GQA][0]
    _, _, saved = forward(case.config, inputs, params)
    least = np.inf
    for i, x in enumerate(rows):
        c, scored = loop_scores(case.config, x, params, allowed[i])
        chosen, gap = loop_choice(c, scored, np.arange(len(x)))
        least = min(least, gap)
        for t in range(len(x)):
            seen = set(np.nonzero(allowed[i, t])[0].tolist())  # the keys that count
            got = _chosen_sets(saved["key_indices"], c, i, t)
            want = chosen[t]
            if c["index_blocks"] == "mean":
                got, want = [got], [want]
            assert [g & seen for g in got] == [w & seen for w in want], (i, t)
    assert GAP <= least < np.inf, f"{case.name}: least gap {least:.2e} (inf: nothing dropped)"


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: c.name)
def test_numpy_port_reproduces_the_fixture(case):
    """The NumPy port (tests/port_numpy.py, its own code: vectorised max-pooling, its own loop
    for "mean") against the fixture, every dtype, through the harness's check."""
    import golden.harness.check
    from tests import port_numpy

    report = golden.harness.check.run([case.name], impls=[port_numpy.RUNNER],
                                      progress=False)
    rows = [r for r in report["rows"] if r["implementation"] == port_numpy.RUNNER.name]
    assert rows and all(r["status"] == "pass" for r in rows), rows
