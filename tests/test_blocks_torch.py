"""torch_attn's GroupedQueryAttention with the block indexer (issue 44 part 4: MiniMax M3's
"max", Qwen4-Exp's "mean"; the maths is golden.reference.indexer's): the four gqa_blocks_*
fixtures and their stored choice (through the runner's run_module), the
choice and the output against the reference's on fresh draws whose block scores are clearly
apart, exact ties, the given-selection mode, gradients (none for the indexer), decoding through
the cache's index_key against the full forward, and bad calls refused by name.

Shape legend: B batch, L tokens, N query heads, H_I indexer heads, D_I indexer width, b the block
size, k the slots of a row's key_indices.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import golden
import torch_attn
from golden import reference
from golden.harness.check import compare_all
from golden.reference.block import linear
from golden.reference.indexer import max_block_scores
from golden.reference.norms import normalize
from golden.reference.rotary import rope_cos_sin, turn
from golden.runners import torch_runner
from golden.specification import variants
from golden.specification.indexer import BLOCK_PARAMS
from golden.specification.tolerances import compare
from golden.specification.validate import rope_settings
from tests.helpers import matrix
from tests.test_indexer_blocks import FAMILIES as BLOCK_FAMILIES
from tests.test_indexer_blocks import draw_family as _draw
from torch_attn.block_indexer import block_order, fill_keys
from torch_attn.params import export_grads, export_params

GQA = "grouped_query_attention"
F64 = torch.float64
FIXTURES = ["gqa_blocks_minimax_m3", "gqa_blocks_minimax_m3_unbatched", "gqa_blocks_qwen4_exp",
            "gqa_blocks_qwen4_exp_unbatched"]
# the two families' settings, tests/test_indexer_blocks.py's (against Hugging Face's modules):
# "max" keeps 3 blocks of 3 (one local), "mean" 3 blocks of 2 and a tail of at most 1
FAMILIES = BLOCK_FAMILIES
CLEAR = 1e-9  # the least relative gap between two block scores that both float64 sums order alike


def _module(c, p, dtype=F64):
    return torch_attn.build(GQA, c, p).to(dtype)


def _tensors(inputs):
    return {n: torch.tensor(a) for n, a in inputs.items()}


def _visible(c, inputs):
    """The keys each query may see (*lead, L, L): causal, the window, lengths and the mask."""
    x = inputs["x"]
    lead, length = x.shape[:-2], x.shape[-2]
    allowed = np.broadcast_to(np.tril(np.ones((length, length), bool)), lead + (length,) * 2)
    if c.get("sliding_window") is not None:
        allowed = allowed & ~np.tril(np.ones((length, length), bool), -c["sliding_window"])
    if "query_seq_lengths" in inputs:
        real = np.arange(length) < np.asarray(inputs["query_seq_lengths"])[:, None]  # (B, L)
        allowed = allowed & real[:, :, None] & real[:, None, :]
    return allowed & inputs["mask"] if "mask" in inputs else allowed


def least_gap(c, p, x, allowed):
    """The least relative gap between two eligible block scores of one query (and indexer head,
    "max") over the draw, by the reference's own steps (pairs of exact zeros, "mean"'s blocks
    whose every ReLU is 0, are exact ties, left out): above CLEAR, the order of blocks, and so
    key_indices, cannot depend on rounding."""
    full = variants.get(GQA).config(c)
    b, eps, h, d = c["index_block_size"], full["index_norm_eps"], c["index_heads"], \
        c["index_head_dim"]
    settings = rope_settings(full["rope_theta"], full["rope_parameters"],
                             full["partial_rotary_factor"], full["rope_precision"])
    positions = np.arange(x.shape[-2])
    cos, sin = rope_cos_sin(settings, c["head_dim"], positions)
    q = linear(x, p["W_index_q"], None).reshape(x.shape[:-1] + (h, d))
    q = turn(normalize("rms", q, p["index_q_norm"], eps)[0], cos[:, None], sin[:, None], False)
    raw = linear(x, p["W_index_k"], None)                             # (*lead, L, D_I)
    rows = []
    if c["index_blocks"] == "max":
        k = turn(normalize("rms", raw, p["index_k_norm"], eps)[0], cos, sin, False)
        scores, has = max_block_scores(q, k, allowed, b)              # (*lead, H_I, L, M)
        s = np.where(np.broadcast_to(has, scores.shape), scores, np.nan)
        rows = s.reshape(-1, s.shape[-1])
    else:
        for idx in np.ndindex(allowed.shape[:-1]):
            vis = np.nonzero(allowed[idx])[0]
            groups = vis[:len(vis) // b * b].reshape(-1, b)            # (C, b)
            if len(groups) < 2:
                continue
            pooled = raw[idx[:-1]][groups].sum(-2) / b
            cb, sb = rope_cos_sin(settings, c["head_dim"], groups[:, 0])
            key = turn(normalize("rms", pooled, p["index_k_norm"], eps)[0], cb, sb, False)
            rows.append(np.maximum(q[idx] @ key.T, 0).sum(0) / np.sqrt(d))
    gaps = [np.inf]
    for row in rows:
        v = np.sort(row[~np.isnan(row)])
        apart = (v[1:] != 0) | (v[:-1] != 0)
        a, z = v[1:][apart], v[:-1][apart]
        gaps.append(np.min((a - z) / np.maximum(np.abs(a), np.abs(z)), initial=np.inf))
    return min(gaps)


def _reference(c, inputs, p):
    forward, _ = reference.pair(GQA)
    return forward(c, inputs, p)


# ---- the fixtures ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_and_its_choice(name, dtype):
    """The module built from the fixture's config and params (the runners check the fixtures
    too), through the runner's own run_module, matches every expected
    array within the fixture's tolerances (outputs, weights, the gradients of x and of every
    parameter but the indexer's, which get none); its own choice equals the stored one and the
    reference's block_keys (through its forward) on the fixture's inputs; the stored choice
    given back (no indexer run) gives the same output bit for bit."""
    f = golden.load(name)
    module = torch_runner._prepared(f, dtype, train=False)[0]
    result = torch_runner.run_module(module, f, dtype)
    assert set(result["grads"]) == set(f.grads) and not set(BLOCK_PARAMS) & set(result["grads"])
    bad = {w: c for w, c in compare_all(f, result, dtype).items() if not c.ok}
    assert not bad, bad
    inputs = _tensors(f.inputs)
    inputs["x"] = inputs["x"].to(module.W_query.weight.dtype)
    args, kwargs = variants.lookup(f.variant).call_args(inputs)
    with torch.no_grad():
        y, chosen = module(*args, **kwargs, return_key_indices=True)
        given = module(*args, **kwargs, key_indices=torch.tensor(f.expected["key_indices"]))
    _, _, saved = _reference(f.config, {n: np.asarray(a) for n, a in f.inputs.items()},
                             {n: a.astype(np.float64) for n, a in f.params.items()})
    assert chosen.dtype == torch.int32
    np.testing.assert_array_equal(chosen.numpy(), f.expected["key_indices"])
    np.testing.assert_array_equal(chosen.numpy(), saved["key_indices"])
    assert torch.equal(y, given)


# ---- fresh draws against the reference -------------------------------------------------------

DRAWS = [  # (family, seed, lead, extra inputs, extra config)
    pytest.param("max", 11, (2,), "lengths", {}, id="max-padding"),
    pytest.param("mean", 12, (2,), "mask", {}, id="mean-mask"),
    pytest.param("max", 13, (), None, {}, id="max-unbatched"),
    pytest.param("mean", 14, (), None, {}, id="mean-unbatched"),
    pytest.param("max", 15, (2,), "mask", {"sliding_window": 11}, id="max-mask-window",
                 marks=matrix),
    pytest.param("mean", 16, (2,), "lengths", {}, id="mean-padding", marks=matrix),
]


def _inputs(rng, x, extra):
    inputs = {"x": x}
    length = x.shape[-2]
    if extra == "lengths":
        inputs["query_seq_lengths"] = np.array([length, length - 4], np.int32)
    elif extra == "mask":
        inputs["mask"] = (rng.random((2, length, length)) < 0.8) | np.eye(length, dtype=bool)
    return inputs


@pytest.mark.parametrize("family, seed, lead, extra, config", DRAWS)
def test_the_choice_and_output_equal_the_references(family, seed, lead, extra, config):
    """L = 20 keys against 9 ("max") or 7 ("mean") kept: the float64 module's key_indices equal
    the reference's exactly (the draw's block scores are all clearly apart: least_gap), its
    output and weights the reference's within float64's tolerance, and the choice drops keys
    the query could see (it matters)."""
    c, p, x, rng = _draw(family, seed, lead, **config)
    inputs = _inputs(rng, x, extra)
    allowed = _visible(c, inputs)
    assert least_gap(c, p, x, allowed) > CLEAR
    y, w, chosen = _module(c, p)(**_tensors(inputs), return_weights=True,
                                 return_key_indices=True)
    y0, w0, saved = _reference(c, inputs, p)
    np.testing.assert_array_equal(chosen.numpy(), saved["key_indices"])
    assert compare(y.detach().numpy(), y0, "float64").ok
    assert compare(w.detach().numpy(), w0, "float64", "weights").ok
    kept = reference.selected_mask(saved["key_indices"], 20)
    kept = kept if family == "max" else kept[..., None, :, :]
    assert (allowed[..., None, :, :] & ~kept).any(), "the choice dropped nothing"


def test_the_building_blocks_equal_the_references_by_hand():
    """block_order and fill_keys on small hand-made rows: kept blocks first (by score, then
    index), eligible ones by score with ties to the lowest index, the ineligible last; the
    invalid slots dropped, the rest repeating the row's first key (0 when none)."""
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]], dtype=F64)
    kept = torch.tensor([[False, False, False, True, False], [False] * 5])
    eligible = torch.tensor([[True, True, False, True, True], [False, True, True, False, True]])
    assert block_order(scores, kept, eligible).tolist() == [[3, 1, 4, 0, 2], [1, 2, 4, 0, 3]]
    keys = torch.tensor([[7, 8, 9, 10], [1, 2, 3, 4]])
    valid = torch.tensor([[False, True, False, True], [False] * 4])
    assert fill_keys(keys, valid, 3).tolist() == [[8, 10, 8], [0, 0, 0]]


# ---- exact ties --------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_equal_block_scores_go_to_the_lowest_block_index(family):
    """W_index_q = 0: every indexer query is 0, so every block scores exactly 0 and the lowest
    blocks win (after the local one, "max"), as the reference's rule; by hand for the last
    queries."""
    c, p, x, _ = _draw(family, 21)
    p["W_index_q"] = np.zeros_like(p["W_index_q"])
    _, chosen = _module(c, p)(torch.tensor(x), return_key_indices=True)
    _, _, saved = _reference(c, {"x": x}, p)
    np.testing.assert_array_equal(chosen.numpy(), saved["key_indices"])
    if family == "max":  # query 19 at block 6 (keys 18, 19): its own, then blocks 0 and 1
        np.testing.assert_array_equal(chosen[:, :, 19].numpy(),
                                      np.broadcast_to([18, 19, 0, 1, 2, 3, 4, 5, 18], (2, 4, 9)))
    else:  # blocks 0, 1, 2 of 2 keys; query 18 sees 19 keys: its tail is key 18
        np.testing.assert_array_equal(chosen[:, 19].numpy(), [[0, 1, 2, 3, 4, 5, 0]] * 2)
        np.testing.assert_array_equal(chosen[:, 18].numpy(), [[0, 1, 2, 3, 4, 5, 18]] * 2)


# ---- the given-selection mode --------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_a_given_selection_is_used_as_given(family):
    """The reference's key_indices given back reproduce the module's own choice's output bit
    for bit (the indexer not run), and come back as given (int32); another selection (each row's
    first key alone, repeated) changes the output."""
    c, p, x, rng = _draw(family, 31)
    mask = (rng.random((2, 20, 20)) < 0.8) | np.eye(20, dtype=bool)
    module = _module(c, p)
    _, _, saved = _reference(c, {"x": x, "mask": mask}, p)
    args = (torch.tensor(x), torch.tensor(mask))
    with torch.no_grad():
        own, chosen = module(*args, return_key_indices=True)
        given, back = module(*args, key_indices=torch.tensor(saved["key_indices"]),
                             return_key_indices=True)
        other = module(*args, key_indices=torch.zeros_like(torch.tensor(saved["key_indices"])))
    shape = (2, 4, 20, 9) if family == "max" else (2, 20, 7)
    assert chosen.shape == back.shape == shape and back.dtype == torch.int32
    assert torch.equal(own, given)
    np.testing.assert_array_equal(back.numpy(), saved["key_indices"])
    assert torch.linalg.norm(other - own) > 1e-3 * torch.linalg.norm(own)


# ---- gradients ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_equal_the_references_with_the_choice_constant(family):
    """float64, with a mask: the gradient of Σ y ⊙ dy + Σ w ⊙ dw for x and every parameter
    against the reference's (its backward holds the choice constant); no gradient reaches
    W_index_q, W_index_k, index_q_norm, index_k_norm, and export_grads leaves them out."""
    c, p, x, rng = _draw(family, 41, length=16)
    mask = (rng.random((2, 16, 16)) < 0.85) | np.eye(16, dtype=bool)
    module = _module(c, p)
    xt = torch.tensor(x, requires_grad=True)
    y, w = module(xt, torch.tensor(mask), return_weights=True)
    dy, dw = rng.standard_normal(y.shape), rng.standard_normal(w.shape)
    ((y * torch.tensor(dy)).sum() + (w * torch.tensor(dw)).sum()).backward()
    forward, backward = reference.pair(GQA)
    _, _, saved = forward(c, {"x": x, "mask": mask}, p)
    g0 = backward(saved, dy, dw)
    grads = {**export_grads(module), "x": xt.grad.numpy()}
    assert set(grads) == set(g0) == set(p) - set(BLOCK_PARAMS) | {"x"}
    for n, g in g0.items():
        assert compare(grads[n], g, "float64", "grad").ok, n
    for n in BLOCK_PARAMS:
        held = getattr(module, n)
        assert (held.weight if n.startswith("W_") else held).grad is None, n


# ---- decoding through the cache's index_key ------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decode_equals_the_full_forward(family):
    """L = 16 above the budget, rows of 16 and 11 real tokens: 7 tokens at once, then one at a
    time through the cache (its index_key written beside the keys, moved through export_cache
    and load_cache once), equal to the full forward at float64's floor on the real tokens, the
    same keys chosen."""
    c, p, x, _ = _draw(family, 51, length=16)
    module = _module(c, p)
    lengths = torch.tensor([16, 11], dtype=torch.int32)
    with torch.no_grad():
        full, chosen = module(torch.tensor(x), query_seq_lengths=lengths,
                              return_key_indices=True)
        cache = module.init_cache(2, 16)
        assert cache.index_key.shape == (2, 16, 5 if family == "max" else 4)
        ys, keys = [], []
        for start, stop in [(0, 7)] + [(t, t + 1) for t in range(7, 16)]:
            new = (lengths - start).clamp(0, stop - start).to(torch.int32)
            (y, k), cache = module(torch.tensor(x[:, start:stop]), cache=cache,
                                   query_seq_lengths=new, return_key_indices=True)
            ys.append(y)
            keys.append(k)
            if start == 7:
                moved = torch_attn.export_cache(cache)
                assert isinstance(moved.index_key, np.ndarray)
                cache = torch_attn.load_cache(moved)
                assert torch.equal(cache.index_key, torch.tensor(moved.index_key))
    assert cache.lengths.tolist() == [16, 11]
    assert not cache.index_key[1, 11:].any() and cache.index_key[1, :11].abs().min() > 0
    stepped, picked = torch.cat(ys, 1).numpy(), torch.cat(keys, -2).numpy()
    for b, n in enumerate(lengths.tolist()):  # the real tokens
        assert compare(stepped[b, :n], full[b, :n].numpy(), "float64").ok, b
        np.testing.assert_array_equal(picked[b, ..., :n, :], chosen[b, ..., :n, :].numpy())
    dense = _module(*({n: v for n, v in d.items() if "index" not in n} for d in (c, p)))
    with torch.no_grad():
        far = dense(torch.tensor(x), query_seq_lengths=lengths)
    assert torch.linalg.norm(far - full) > 1e-3 * torch.linalg.norm(full)  # the choice matters


def test_decoding_at_explicit_positions_equals_the_full_forward():
    """"max" turns its keys at the tokens' own positions (here 5 … 16, a left-padded prompt's
    shift) and keeps the query's own block by position: prefill then decode with the same
    positions equals the full forward, and differs from positions 0 … 11 (the local block
    moves)."""
    c, p, x, _ = _draw("max", 52, length=12)
    module, at = _module(c, p), torch.arange(5, 17).expand(2, 12)
    with torch.no_grad():
        full, chosen = module(torch.tensor(x), positions=at, return_key_indices=True)
        plain = module(torch.tensor(x), return_key_indices=True)[1]
        cache, ys, keys = module.init_cache(2, 12), [], []
        for start, stop in [(0, 6)] + [(t, t + 1) for t in range(6, 12)]:
            (y, k), cache = module(torch.tensor(x[:, start:stop]), cache=cache,
                                   positions=at[:, start:stop], return_key_indices=True)
            ys.append(y)
            keys.append(k)
    assert compare(torch.cat(ys, 1).numpy(), full.numpy(), "float64").ok
    np.testing.assert_array_equal(torch.cat(keys, -2).numpy(), chosen.numpy())
    assert not torch.equal(chosen, plain)


# ---- the parameters, the cache, bad calls ------------------------------------------------------

def test_the_parameters_round_trip_and_are_absent_without_the_indexer():
    """build then export_params gives the indexer's parameters back as loaded; without
    index_blocks the module holds None for each, and init_cache no index_key."""
    c, p, _, _ = _draw("max", 61)
    out = export_params(_module(c, p))
    assert set(out) == set(p)
    for n in BLOCK_PARAMS:
        np.testing.assert_array_equal(out[n], p[n])
    plain = torch_attn.GroupedQueryAttention(6, 4, 2, head_dim=6, rope_theta=100.0)
    assert all(getattr(plain, n) is None for n in BLOCK_PARAMS)
    assert plain.init_cache(2, 5).index_key is None


@pytest.mark.parametrize("family, key_indices, match", [
    ("max", torch.zeros(2, 8, 6, dtype=torch.int64),
     r"key_indices shape should be \(B, Lq, k\) = \(2, 4, 8, 8\), got \(2, 8, 6\)"),
    ("mean", torch.zeros(2, 4, 8, 7, dtype=torch.int64),
     r"key_indices shape should be \(B, Lq, k\) = \(2, 8, 7\), got \(2, 4, 8, 7\)"),
    ("mean", torch.zeros(2, 8, 7), "key_indices dtype should be an integer type, got float32"),
    ("max", torch.full((2, 4, 8, 8), 8), (r"key_indices should lie in \[0, Lk\) = \[0, 8\), "
                                          r"got values in \[8, 8\]")),
    ("mean", torch.full((2, 8, 7), -1), r"key_indices should lie in \[0, Lk\) = \[0, 8\)"),
    ("max", np.zeros((2, 4, 8, 8), np.int64), "key_indices should be a torch.Tensor, got ndarray"),
])
def test_bad_key_indices_are_refused_by_name(family, key_indices, match):
    c, p, x, _ = _draw(family, 62, length=8)
    with pytest.raises(ValueError, match=match):
        _module(c, p)(torch.tensor(x), key_indices=key_indices)


def test_bad_calls_are_refused_by_name():
    """A mask with several heads, multimodal positions, the indexer's arguments without it, a
    cache without (or with a wrong) index_key, and "mean" with a cache and explicit positions;
    kv_shared and merged_context with the indexer (not built)."""
    c, p, x, _ = _draw("mean", 63, length=8)
    module, xt = _module(c, p), torch.tensor(x)
    with pytest.raises(ValueError, match=r"mask should have no head axis, or one of size 1, "
                                         r"with index_blocks .*got shape \(2, 4, 8, 8\)"):
        module(xt, torch.ones(2, 4, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"index_blocks should be None with a multi-axis "
                                         r"RoPE"):  # MRoPE refused with the configuration
        _module({**c, "rope_parameters": {"rope_theta": 100.0, "mrope_section": [1, 0, 0]}}, p)
    cache = module.init_cache(2, 10)
    with pytest.raises(ValueError, match=r"cache.index_key should be an array of shape "
                                         r"\(B, M, index_head_dim\) = \(2, 10, 4\) with "
                                         r"index_blocks .* got None"):
        module(xt, cache=cache._replace(index_key=None))
    with pytest.raises(ValueError, match=r"cache.index_key should be \(B, M, index_head_dim\) = "
                                         r"\(2, 10, 4\) in x's dtype torch.float64, got "
                                         r"\(2, 10, 3\)"):
        module(xt, cache=cache._replace(index_key=cache.index_key[..., :3]))
    with pytest.raises(ValueError, match=r"positions should be None with index_blocks = 'mean' "
                                         r"and a cache"):
        module(xt, cache=cache, positions=torch.arange(8).expand(2, 8))
    plain = _module(*({n: v for n, v in d.items() if "index" not in n} for d in (c, p)))
    with pytest.raises(ValueError, match="key_indices should be None without "
                                         "index_blocks"):
        plain(xt, key_indices=torch.zeros(2, 8, 7, dtype=torch.int64))
    with pytest.raises(ValueError, match="return_key_indices should be False without "
                                         "index_blocks"):
        plain(xt, return_key_indices=True)
    with pytest.raises(ValueError, match="return_key_indices should be True or False, got 1"):
        module(xt, return_key_indices=1)
    for name in ("kv_shared", "merged_context"):
        with pytest.raises(ValueError, match=f"{name} should be False with index_blocks = "
                                             f"'max'"):
            torch_attn.GroupedQueryAttention(**FAMILIES["max"], **{name: True})


@pytest.mark.parametrize("given, match", [
    (dict(index_heads=3), "index_heads should be num_kv_heads = 2 with index_blocks = 'max'"),
    (dict(index_local_blocks=4), "index_local_blocks should be at most index_topk_blocks = 3"),
    (dict(index_block_size=None), ("index_block_size should be a positive int with "
                                   "index_blocks = 'max'")),
    (dict(rope_interleaved=True), "index_blocks should be None without rotate-half RoPE"),
    (dict(index_blocks=None), "index_heads should be None without index_blocks"),
])
def test_bad_settings_are_refused_by_name(given, match):
    with pytest.raises(ValueError, match=match):
        torch_attn.GroupedQueryAttention(**{**FAMILIES["max"], **given})
