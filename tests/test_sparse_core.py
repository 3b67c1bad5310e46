"""The core's given selection, ``key_indices`` (issue 44: DeepSeek-V3.2's indexer's top-k), and
the "sparse" implementation of both twins that reads only the chosen keys: the reference's
selection equals the boolean mask it stands for (exactly) and its backward equals central
differences; each twin's "sparse" and dense implementations against the reference at float64
(output and every gradient) over GQA, shared and per-head selections, causal, padding, window,
chunks, offsets, bias, soft-cap and sinks, unbatched inputs; rows whose chosen keys are all
disallowed; repeated indices; float32 and bfloat16 within the tolerance table; the validation
messages and refusals; the automatic choice; and the memory: the JAX backward's residuals, the
JAX program at L = 4096, k = 64 and torch's saved tensors hold no (Lq, Lk) array.

Shape legend: B batch, H query heads, Hkv key-value heads, Lq query length, Lk key length, k keys
chosen per row, Dk key width, Dv value width.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_attn
import torch_attn
from golden import reference
from golden.reference.core import selected_mask
from golden.specification.implementations import Asked, record
from golden.specification.tolerances import compare, compare_terms
from golden.specification.validate import with_head_axis
from jax_attn import accelerators, splash
from tests.helpers import TWINS, assert_central_differences, fresh_rng

B, H, HKV, LQ, LK, DK, DV, K = 2, 4, 2, 5, 9, 3, 6, 4  # every size different; G = 2
GRAD_NAMES = ("query", "key", "value", "bias", "sinks")
IMPLEMENTATIONS = {"torch": ("sparse", "explicit", "row_chunks"),
                   "jax": ("sparse", "explicit", "blockwise")}
BLOCKS = {"sparse": {"torch": (2, None), "jax": (2, 1)}, "row_chunks": {"torch": (2, None)},
          "blockwise": {"jax": (2, 4)}}  # small blocks: every length spans several


def _case(name, rng, dtype="float64"):
    """(arrays {query, key, value, mask, bias, sinks, key_indices}, keyword arguments) of one
    configuration, drawn fresh."""
    normal = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    pick = lambda *shape: rng.integers(0, LK, shape)  # noqa: E731
    if name == "gqa_shared":  # (B, Lq, k), causal, padding on both sides, a mask
        arrays = dict(query=normal(B, H, LQ, DK), key=normal(B, HKV, LK, DK),
                      value=normal(B, HKV, LK, DV), mask=rng.random((B, 1, LQ, LK)) < 0.8,
                      key_indices=pick(B, LQ, K))
        return arrays, dict(is_causal=True, query_offset=np.array([4, 2]),
                            query_seq_lengths=np.array([5, 4]),
                            key_value_seq_lengths=np.array([9, 6]))
    if name == "per_head":  # (B, H, Lq, k), bias, soft-cap, sinks, a window
        arrays = dict(query=normal(B, H, LQ, DK), key=normal(B, HKV, LK, DK),
                      value=normal(B, HKV, LK, DV), bias=normal(H, LQ, LK), sinks=normal(H),
                      key_indices=pick(B, H, LQ, K))
        return arrays, dict(local_window_size=(3, 2), softcap=1.5, query_offset=np.array([1, 3]))
    if name == "one_head_axis":  # (B, 1, Lq, k), chunks, a bias over keys alone
        arrays = dict(query=normal(B, H, LQ, DK), key=normal(B, HKV, LK, DK),
                      value=normal(B, HKV, LK, DV), bias=normal(LK),
                      key_indices=pick(B, 1, LQ, K))
        return arrays, dict(is_causal=True, attention_chunk_size=5, query_offset=3)
    if name == "heads":  # (H, Lq, Dk) inputs, (Lq, k) shared
        arrays = dict(query=normal(H, LQ, DK), key=normal(H, LK, DK), value=normal(H, LK, DV),
                      sinks=normal(H), key_indices=pick(LQ, K))
        return arrays, dict(is_causal=True, query_offset=4)
    arrays = dict(query=normal(LQ, DK), key=normal(LK, DK), value=normal(LK, DV),  # unbatched
                  mask=rng.random((LQ, LK)) < 0.7, key_indices=pick(LQ, K))
    return arrays, dict(local_window_size=4)


CASES = ("gqa_shared", "per_head", "one_head_axis", "heads", "unbatched")


def _reference(arrays, kw, d_out):
    """(output, {name: gradient}, the terms' sizes) of the float64 reference."""
    a = dict(arrays)
    out, weights, saved = reference.sdpa_forward(
        a.pop("query"), a.pop("key"), a.pop("value"), a.pop("mask", None), a.pop("bias", None),
        **a, **kw)
    zeros = np.zeros(weights.shape)
    return (out, reference.sdpa_backward(saved, d_out, zeros),
            reference.sdpa_term_sizes(saved, d_out, zeros))


def _torch(arrays, kw, d_out, dtype, **call):
    twin = TWINS["torch"]
    t = {n: twin.array(a, dtype) for n, a in arrays.items()}
    floats = [n for n in GRAD_NAMES if n in t]
    for n in floats:
        t[n].requires_grad_(True)
    tkw = {n: twin.array(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    out = twin.sdpa(**t, **tkw, **call)
    (out * twin.array(d_out, dtype)).sum().backward()
    return twin.numpy(out), {n: twin.numpy(t[n].grad) for n in floats}


def _jax(arrays, kw, d_out, dtype, **call):
    twin = TWINS["jax"]
    with twin.float64(dtype == "float64"):
        j = {n: twin.array(a, dtype) for n, a in arrays.items()}
        floats = {n: j.pop(n) for n in GRAD_NAMES if n in j}
        jkw = {n: twin.array(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}

        def loss(floats):
            out = twin.sdpa(**j, **floats, **jkw, **call)
            return jnp.sum(out.astype(jnp.float32 if dtype != "float64" else jnp.float64)
                           * twin.array(d_out)), out

        grads, out = jax.grad(loss, has_aux=True)(floats)
        return twin.numpy(out), {n: twin.numpy(g) for n, g in grads.items()}


RUN = {"torch": _torch, "jax": _jax}


def _grad_ok(actual, expected, dtype="float64"):
    """The gradient within the table; one that is zero in exact arithmetic (every row with at
    most one allowed key gives the bias none) by the absolute bound alone."""
    return compare(actual, expected, dtype, "grad", zero=not np.any(expected)).ok


def _pairs():
    return [pytest.param(t, i, id=f"{t}-{i}") for t in IMPLEMENTATIONS for i in IMPLEMENTATIONS[t]]


# ---- the reference -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_reference_selection_is_its_mask_exactly(name):
    rng, seed = fresh_rng()
    arrays, kw = _case(name, rng)
    d_out = rng.standard_normal(arrays["query"].shape[:-1] + (DV,))
    out, grads, _ = _reference(arrays, kw, d_out)
    masked = dict(arrays)
    chosen = selected_mask(with_head_axis(masked.pop("key_indices"), arrays["query"]), LK)
    masked["mask"] = chosen if "mask" not in arrays else arrays["mask"] & chosen
    out_m, grads_m, _ = _reference(masked, kw, d_out)
    np.testing.assert_array_equal(out, out_m, err_msg=f"seed {seed}")
    for n in grads:
        np.testing.assert_array_equal(grads[n], grads_m[n], err_msg=f"{n}, seed {seed}")
    assert np.abs(out).max() > 0  # something was attended


def test_selected_mask_by_hand():
    # Row 0 chooses keys 2 and 0, row 1 key 3 twice: a repeat means what it means once.
    chosen = selected_mask(np.array([[2, 0], [3, 3]]), 4)
    np.testing.assert_array_equal(chosen, [[True, False, True, False], [False, False, False, True]])


def test_reference_backward_matches_central_differences():
    rng, seed = fresh_rng()
    arrays, kw = _case("per_head", rng)
    d_out = rng.standard_normal((B, H, LQ, DV))
    _, grads, _ = _reference(arrays, kw, d_out)
    floats = {n: arrays[n] for n in GRAD_NAMES if n in arrays}

    def loss():
        return float((_reference({**arrays, **floats}, kw, d_out)[0] * d_out).sum())

    assert_central_differences(loss, [floats], grads, what=f"seed {seed}")


# ---- the twins against the reference -----------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("framework,implementation", _pairs())
def test_twins_match_the_reference_at_float64(framework, implementation, name):
    rng, seed = fresh_rng()
    arrays, kw = _case(name, rng)
    d_out = rng.standard_normal(arrays["query"].shape[:-1] + (DV,))
    expected, expected_grads, _ = _reference(arrays, kw, d_out)
    blocks = BLOCKS.get(implementation, {}).get(framework)
    with record() as ran:
        out, grads = RUN[framework](arrays, kw, d_out, "float64", implementation=implementation,
                                    block_sizes=blocks)
    assert (framework, implementation) in ran
    assert compare(out, expected, "float64").ok, (seed, np.abs(out - expected).max())
    for n, g in grads.items():
        assert _grad_ok(g, expected_grads[n]), (n, seed, np.abs(g - expected_grads[n]).max())


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_rows_whose_chosen_keys_are_all_disallowed_give_zeros(framework):
    # Causal with offset 0: row i chooses only keys after it (rows 0-2), or keys 0 and after
    # (rows 3, 4): the first three attend nothing, give zeros and pass back zero gradients.
    rng, seed = fresh_rng()
    arrays, _ = _case("gqa_shared", rng)
    del arrays["mask"]
    later = np.array([[5, 6, 7, 8], [5, 6, 7, 8], [3, 4, 5, 6], [0, 1, 5, 8], [0, 4, 4, 4]])
    arrays["key_indices"] = np.broadcast_to(later, (B, LQ, K)).copy()
    d_out = rng.standard_normal((B, H, LQ, DV))
    expected, expected_grads, _ = _reference(arrays, {"is_causal": True}, d_out)
    out, grads = RUN[framework](arrays, {"is_causal": True}, d_out, "float64",
                                implementation="sparse")
    np.testing.assert_array_equal(out[:, :, :3], 0.0)
    np.testing.assert_array_equal(grads["query"][:, :, :3], 0.0)
    assert np.abs(out[:, :, 3:]).min() > 0
    assert compare(out, expected, "float64").ok, seed
    for n, g in grads.items():
        assert _grad_ok(g, expected_grads[n]), (n, seed)


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_repeated_indices_count_once(framework):
    # A row choosing key 2 three times and key 5 once equals one choosing keys 2 and 5 (and the
    # reference's mask): a sparse path that summed gathered copies would give key 2 triple
    # weight.
    rng, seed = fresh_rng()
    arrays, _ = _case("gqa_shared", rng)
    del arrays["mask"]
    arrays["key_indices"] = np.broadcast_to(np.array([2, 5, 2, 2]), (B, LQ, K)).copy()
    d_out = rng.standard_normal((B, H, LQ, DV))
    expected, expected_grads, _ = _reference(arrays, {}, d_out)
    once = dict(arrays, key_indices=arrays["key_indices"][..., :2])
    out, grads = RUN[framework](arrays, {}, d_out, "float64", implementation="sparse")
    out_once, _ = RUN[framework](once, {}, d_out, "float64", implementation="sparse")
    assert compare(out, out_once, "float64").ok, seed
    assert compare(out, expected, "float64").ok, seed
    for n, g in grads.items():
        assert _grad_ok(g, expected_grads[n]), (n, seed)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_low_precision_within_the_table(framework, dtype):
    # Inputs on the dtype's grid (the arithmetic alone), against the float64 reference on the
    # same values: the table's rows for values and gradients, or failing them the same rows
    # relative to the terms' sizes (compare_terms: a softmax backward that cancels).
    rng, seed = fresh_rng()
    arrays, kw = _case("per_head", rng)
    arrays = {n: a if a.dtype.kind != "f" else
              TWINS["torch"].numpy(TWINS["torch"].array(a, dtype)) for n, a in arrays.items()}
    d_out = TWINS["torch"].numpy(TWINS["torch"].array(rng.standard_normal((B, H, LQ, DV)), dtype))
    expected, expected_grads, sizes = _reference(arrays, kw, d_out)
    out, grads = RUN[framework](arrays, kw, d_out, dtype, implementation="sparse")
    c = compare_terms(out, expected, sizes["output"], dtype, terms=K)
    assert c.ok, (seed, c)
    for n, g in grads.items():
        terms = 1 if n in ("query", "key", "value") else max(1, B * H * LQ * LK // arrays[n].size)
        c = compare_terms(g, expected_grads[n], sizes[n], dtype, "grad", terms=terms,
                          zero=not np.any(expected_grads[n]))
        assert c.ok, (n, seed, c)


# ---- bad inputs and refusals -------------------------------------------------------------------

BAD = [
    (np.zeros((B, LQ, K, 1), np.int64), r"key_indices shape should be \(B, H, Lq, k\) = "
                                         r"\(2, 4, 5, \?\), got \(2, 5, 4, 1\)"),
    (np.zeros((B, 3, LQ, K), np.int64), r"key_indices shape should be \(B, H, Lq, k\) = "
                                         r"\(2, 4, 5, \?\), got \(2, 3, 5, 4\)"),
    (np.zeros((B, LQ + 1, K), np.int64), r"key_indices shape should be \(B, Lq, k\) = "
                                         r"\(2, 5, \?\), got \(2, 6, 4\)"),
    (np.zeros((B, LQ, 0), np.int64), r"key_indices's last axis k should be at least 1, got "
                                     r"k = 0"),
    (np.zeros((B, LQ, K), np.float32), r"key_indices dtype should be an integer type, got "
                                       r"float32"),
    (np.full((B, LQ, K), LK), r"key_indices values should lie in \[0, Lk\) = \[0, 9\), got 9"),
    (np.full((B, LQ, K), -1), r"key_indices values should lie in \[0, Lk\) = \[0, 9\), got -1"),
]


@pytest.mark.parametrize("implementation", ("sparse", "explicit"))
@pytest.mark.parametrize("bad,message", BAD)
def test_bad_key_indices_are_refused_by_name(impl, implementation, bad, message):
    rng, _ = fresh_rng()
    arrays, _ = _case("gqa_shared", rng)
    args = [impl.array(arrays[n]) for n in ("query", "key", "value")]
    call = {} if impl.name == "reference" else {"implementation": implementation}
    with pytest.raises(ValueError, match=message):
        impl.sdpa(*args, key_indices=impl.array(bad), **call)


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
def test_sparse_refuses_what_it_cannot_honour(framework):
    twin = TWINS[framework]
    rng, _ = fresh_rng()
    arrays, _ = _case("gqa_shared", rng)
    q, k, v = (twin.array(arrays[n], "float32") for n in ("query", "key", "value"))
    chosen = twin.array(arrays["key_indices"])
    with pytest.raises(ValueError, match="'sparse' cannot run this call: it needs key_indices"):
        twin.sdpa(q, k, v, implementation="sparse")
    with pytest.raises(ValueError, match="return_weights=True needs 'explicit'"):
        twin.sdpa(q, k, v, key_indices=chosen, implementation="sparse", return_weights=True)
    with pytest.raises(ValueError, match="a dropout mask is"):
        twin.sdpa(q, k, v, key_indices=chosen, implementation="sparse", dropout_rate=0.5,
                  dropout_rng=twin.dropout_rng(0))


def test_the_accelerator_kernels_refuse_a_selection():
    asked = Asked(key_indices=True, platform="gpu", dtype="bfloat16", lengths=(128, 128),
                  widths=(64, 64), heads=(1, 1))
    for refuses in (accelerators.cudnn_refuses, accelerators.pallas_refuses,
                    splash.splash_refuses):
        assert "key_indices" in refuses(asked)


@pytest.mark.parametrize("framework", IMPLEMENTATIONS)
@pytest.mark.parametrize("selected,expected", [(1, "sparse"), (2, None)])
def test_the_automatic_choice_takes_sparse_for_few_keys(framework, selected, expected):
    # Lk = 9: k = 1 ≤ 9 / 8 (SPARSE_UP_TO) runs "sparse"; k = 2 the dense choice, with the
    # mask.
    twin = TWINS[framework]
    rng, seed = fresh_rng()
    arrays, kw = _case("gqa_shared", rng)
    arrays["key_indices"] = arrays["key_indices"][..., :selected]
    d_out = rng.standard_normal((B, H, LQ, DV))
    expected_out = _reference(arrays, kw, d_out)[0]
    with record() as ran:
        out, _ = RUN[framework](arrays, kw, d_out, "float64")
    names = [name for _, name in ran]
    assert ("sparse" in names) == (expected == "sparse"), names
    assert compare(out, expected_out, "float64").ok, seed


# ---- memory: never an (Lq, Lk) array -----------------------------------------------------------


def test_jax_residuals_hold_no_lq_by_lk_array():
    # The residuals jax.vjp keeps (its pullback's leaves) at Lq = Lk = 512, k = 8, in blocks of
    # 64 rows: each at most O(Lq·k) or O(L·D), far below one (Lq, Lk); explicit's, the check's
    # control, holds the (Lq, Lk) weights.
    rng, _ = fresh_rng()
    length, selected, d = 512, 8, 16
    q = jnp.asarray(rng.standard_normal((1, 2, length, d)), jnp.float32)
    chosen = jnp.asarray(rng.integers(0, length, (1, length, selected)))

    def residuals(name, **kw):
        _, pullback = jax.vjp(lambda q, k, v: jax_attn.scaled_dot_product_attention(
            q, k, v, is_causal=True, key_indices=chosen, implementation=name, **kw), q, q, q)
        return [int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(pullback)]

    sparse = residuals("sparse", block_sizes=(64, 1))
    assert max(sparse) <= 2 * length * max(selected, d), sparse  # (H, Lq, k) or (H, L, D)
    assert sum(sparse) <= 16 * 2 * length * (selected + d), sparse
    assert max(residuals("explicit")) >= length * length // 4  # its causal tiles


def test_jax_program_forms_no_lq_by_lk_array_at_4096():
    length, selected, d = 4096, 64, 64
    x = jax.ShapeDtypeStruct((1, 1, length, d), jnp.float32)
    chosen = jax.ShapeDtypeStruct((1, length, selected), jnp.int32)

    def loss(q, k, v, chosen):
        return jnp.sum(jax_attn.scaled_dot_product_attention(
            q, k, v, is_causal=True, key_indices=chosen, implementation="sparse"))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x, chosen).as_text()
    sizes = [int(np.prod([int(n) for n in dims.split("x")[:-1]]))
             for dims in re.findall(r"tensor<((?:\d+x)+)\w+>", text)]
    assert "stablehlo.while" in text  # the blocks ran
    assert max(sizes) <= length * length // 4, max(sizes)  # one block's (Bq, k, D) at most
    assert not re.search(rf"tensor<(\d+x)*{length}x{length}x", text)
    dots = re.findall(r"stablehlo\.dot_general.*", text)
    assert dots and all("precision = [HIGHEST, HIGHEST]" in t for t in dots), dots


def test_torch_saves_no_lq_by_lk_tensor():
    # What autograd keeps between the passes (saved_tensors_hooks sees every tensor saved):
    # "sparse" recomputes each block, so it keeps the inputs and small per-block pieces, never
    # an (Lq, Lk) tensor nor every row's gathered keys; "explicit", the control, keeps its
    # weights.
    rng, _ = fresh_rng()
    length, selected, d = 512, 8, 16
    q = torch.tensor(rng.standard_normal((1, 2, length, d)), dtype=torch.float32)
    chosen = torch.tensor(rng.integers(0, length, (1, length, selected)))

    def saved(name):
        sizes = []
        inputs = [q.clone().requires_grad_(True) for _ in range(3)]
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: sizes.append(t.numel()) or t, lambda t: t):
            out = torch_attn.scaled_dot_product_attention(
                *inputs, is_causal=True, key_indices=chosen, implementation=name)
        out.sum().backward()
        return sizes

    assert max(saved("sparse")) <= 2 * length * max(selected, d)
    assert max(saved("explicit")) >= 2 * length * length


@pytest.mark.parametrize("per_head", (False, True))
def test_jax_grouped_heads_share_one_gather_per_kv_head(per_head):
    # H = 6 query heads on Hkv = 2 (G = 3), Lq = 40 in blocks of 8 rows, k = 7, D = 5: the
    # program's gathers of keys and values (forward and backward) are (B, Hkv, 8, 7, 5) for a
    # selection shared by the heads, one per kv head; a selection per head, the control, needs
    # one per query head (B, Hkv, G, 8, 7, 5).
    rng, _ = fresh_rng()
    q = jnp.asarray(rng.standard_normal((1, 6, 40, 5)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 2, 50, 5)), jnp.float32)
    chosen = jnp.asarray(rng.integers(0, 50, (1, 6, 40, 7) if per_head else (1, 40, 7)))

    def loss(q, k, v):
        return jax_attn.scaled_dot_product_attention(
            q, k, v, key_indices=chosen, implementation="sparse", block_sizes=(8, 1)).sum()

    program = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, k))
    shapes = set(re.findall(r"f32\[([\d,]+)\] = gather", program))
    assert shapes == ({"1,2,3,8,7,5"} if per_head else {"1,2,8,7,5"}), shapes
