"""The torch core's ``implementation`` (issue 11): "blockwise" against every sdpa golden fixture
and against "dense" on fresh inputs, its memory (no (Lq, Lk) tensor kept for the backward), its
drawn dropout, the automatic choice (None) and the errors.

Blockwise runs with tiny chunks here (BLOCKWISE_ROWS of 1 to 3 query rows), so that every case
has several chunks, a ragged last one, and key ranges cut by the causal and window bounds.

Shape legend: B batch, H heads (Hkv of key and value), Lq query length, Lk key length, Dk key
width, Dv value width.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import golden
import torch_attn.functional as functional
from golden import reference
from golden.tolerances import compare
from tests.helpers import fresh_rng
from torch_attn import scaled_dot_product_attention as sdpa

B, H, HKV, LQ, LK, DK, DV = 2, 6, 2, 5, 7, 4, 3
# (fixture, dtype) for every sdpa fixture and every dtype it is run at.
SDPA_RUNS = [(n, d) for n in golden.names() if n.startswith("sdpa_") for d in golden.load(n).dtypes]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
TORCH_SDPA = F.scaled_dot_product_attention  # before any monkeypatch


@pytest.fixture
def chunks(monkeypatch):
    """Sets the query rows per chunk; returns the explicit-path calls' query row counts."""
    rows = []
    explicit = functional._explicit

    def counted(query, *args):
        rows.append(query.shape[-2])
        return explicit(query, *args)

    monkeypatch.setattr(functional, "_explicit", counted)
    return lambda n: monkeypatch.setattr(functional, "BLOCKWISE_ROWS", n) or rows


def leaves(arrays, dtype):
    """Float arrays as leaves of ``dtype`` that need gradients; masks and integers as they are."""
    out = {}
    for name, a in arrays.items():
        t = torch.from_numpy(np.require(a, requirements="C"))
        out[name] = t.to(dtype).requires_grad_() if t.is_floating_point() else t
    return out


def reference_grads(fixture):
    """The float64 reference's gradients of the output-only loss Σ O ⊙ dO."""
    arrays = {n: a.astype(np.float64) if a.dtype.kind == "f" else a
              for n, a in fixture.inputs.items()}
    _, weights, cache = reference.sdpa_forward(**arrays, **fixture.config)
    d_out = fixture.cotangents["output"].astype(np.float64)
    return reference.sdpa_backward(cache, d_out, np.zeros_like(weights))


def terms(name, arrays, weights_size) -> int:
    """Partial gradients summed per element: a bias's over its broadcast axes."""
    return max(1, weights_size // arrays[name].size) if name == "bias" else 1


def as_numpy(t):
    return t.detach().to(torch.float64).numpy()


@pytest.mark.parametrize("name, dtype", SDPA_RUNS)
def test_blockwise_matches_the_golden_fixture(name, dtype, chunks):
    fixture = golden.load(name)
    rows = chunks(2)
    inputs = leaves(fixture.inputs, DTYPES[dtype])
    out = sdpa(**inputs, **fixture.config, implementation="blockwise")
    lq = out.shape[-2]
    assert rows == [min(2, lq - s) for s in range(0, lq, 2)][::-1], "not chunked as asked"
    out.backward(torch.from_numpy(fixture.cotangents["output"]).to(out.dtype))
    assert len(rows) == 2 * math.ceil(lq / 2), "the backward did not recompute each chunk"
    assert compare(as_numpy(out), fixture.expected["output"], dtype).ok, name
    size = fixture.expected["weights"].size
    for n, expected in reference_grads(fixture).items():
        c = compare(as_numpy(inputs[n].grad), expected, dtype, "grad",
                    terms=terms(n, fixture.inputs, size))
        assert c.ok, f"{name} grad {n} at {dtype}: {c}"


# Allowed-set arguments and extras on top of q (B, H, Lq, Dk), k (B, Hkv, Lk, Dk), v, a bias
# (H, 1, Lk) and a mask (B, 1, Lq, Lk) with one row of batch 1 masked out.
CASES = {
    "plain": dict(),
    "causal_tensor_offset": dict(is_causal=True, query_offset=np.array([0, 3])),
    "causal_int_offset": dict(is_causal=True, query_offset=2),
    "window": dict(local_window_size=(1, 2), query_offset=np.array([1, 4])),
    "window_left_causal": dict(local_window_size=(2, None), is_causal=True),
    "window_right_only": dict(local_window_size=(None, 0), query_offset=np.array([2, 0])),
    "lengths": dict(query_seq_lengths=np.array([5, 2]), key_value_seq_lengths=np.array([7, 3]),
                    is_causal=True),
    "softcap": dict(softcap=0.8, scale=2.0, is_causal=True),
    "dropout_keep_mask": dict(dropout_rate=0.3, keep_shape=(LQ, LK)),
    "dropout_full_keep_mask": dict(dropout_rate=0.4, keep_shape=(B, H, LQ, LK), softcap=2.0),
    "empty_rows": dict(query_offset=9, local_window_size=(0, 0)),
    "all": dict(query_offset=np.array([1, 4]), local_window_size=(3, 0), is_causal=True,
                key_value_seq_lengths=np.array([6, 4]), query_seq_lengths=np.array([4, 5]),
                softcap=1.5, dropout_rate=0.2, keep_shape=(B, 1, LQ, LK)),
}
BIAS_SHAPES = [(H, 1, LK), (B, 1, LQ, LK), (LQ, LK), (LK,)]  # each sliced differently


def random_case(rng, case, hkv, bias_shape):
    """(arrays for ``leaves``, keyword arguments) of a CASES entry."""
    kw = dict(CASES[case])
    arrays = {"query": rng.standard_normal((B, H, LQ, DK)),
              "key": rng.standard_normal((B, hkv, LK, DK)),
              "value": rng.standard_normal((B, hkv, LK, DV)),
              "bias": rng.standard_normal(bias_shape)}
    mask = rng.random((B, 1, LQ, LK)) < 0.8
    mask[1, 0, 2] = False  # an empty row
    arrays["mask"] = mask
    if "keep_shape" in kw:
        arrays["dropout_mask"] = rng.random(kw.pop("keep_shape")) < 0.7
    kw = {n: torch.from_numpy(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    return arrays, kw


def run_with_grads(arrays, kw, d_out, implementation):
    """Output and the gradients of Σ O ⊙ dO for every float input, float64 NumPy."""
    inputs = leaves(arrays, torch.float64)
    out = sdpa(**inputs, **kw, implementation=implementation)
    out.backward(d_out)
    return as_numpy(out), {n: as_numpy(t.grad) for n, t in inputs.items() if t.requires_grad}


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias_shape", BIAS_SHAPES, ids=lambda s: "bias" + "x".join(map(str, s)))
@pytest.mark.parametrize("hkv", [HKV, H], ids=["gqa", "mha"])
@pytest.mark.parametrize("case", CASES)
def test_blockwise_matches_dense_on_fresh_inputs(case, hkv, bias_shape, rows, chunks):
    rng, seed = fresh_rng()
    chunks(rows)
    arrays, kw = random_case(rng, case, hkv, bias_shape)
    d_out = torch.tensor(rng.standard_normal((B, H, LQ, DV)))
    out, grads = run_with_grads(arrays, kw, d_out, "blockwise")
    dense_out, dense_grads = run_with_grads(arrays, kw, d_out, "dense")
    assert np.isfinite(out).all() and (out[1, :, 2] == 0).all(), f"empty row, seed {seed}"
    assert compare(out, dense_out, "float64").ok, f"output, seed {seed}"
    assert set(grads) == {"query", "key", "value", "bias"}
    for n, g in grads.items():
        c = compare(g, dense_grads[n], "float64", "grad", terms=terms(n, arrays, B * H * LQ * LK))
        assert c.ok, f"grad {n}: {c}, seed {seed}"
    with torch.no_grad():  # forward only: the chunks without a backward
        inputs = leaves(arrays, torch.float64)
        alone = sdpa(**inputs, **kw, implementation="blockwise")
    np.testing.assert_array_equal(alone.numpy(), out, err_msg=f"seed {seed}")


def test_blockwise_low_precision_gradients_accumulate_in_float32(chunks):
    """bfloat16 key and value gradients summed over 256 chunks of one row stay within the
    tolerance (seen: at most 0.9u relative error norm over 20 seeds); summed in bfloat16 they
    reach 3.7u to 6.3u and fail."""
    rng, seed = fresh_rng()
    chunks(1)
    shapes = [(1, 256, 8), (1, 24, 8), (1, 24, 8), (1, 256, 8)]
    *grid, d_out = (np.round(rng.standard_normal(s) * 8) / 8 for s in shapes)  # exact in bf16
    q, k, v = (torch.tensor(a, dtype=torch.bfloat16, requires_grad=True) for a in grid)
    out = sdpa(q, k, v, implementation="blockwise")
    out.backward(torch.tensor(d_out, dtype=torch.bfloat16))
    _, w, cache = reference.sdpa_forward(*grid)
    expected = reference.sdpa_backward(cache, d_out, np.zeros_like(w))
    for n, x in zip(("query", "key", "value"), (q, k, v)):
        c = compare(as_numpy(x.grad), expected[n], "bfloat16", "grad")
        assert c.ok, f"{n}: {c}, seed {seed}"


def test_drawn_dropout_is_redrawn_identically_in_the_backward(chunks):
    """With V = I the output is the weights, so the keep-mask blockwise drew is read off the
    output; dense with that keep-mask must give the same output and gradients."""
    rng, seed = fresh_rng()
    chunks(3)
    q, k = rng.standard_normal((B, H, LQ, DK)), rng.standard_normal((B, H, LK, DK))
    arrays = dict(query=q, key=k, value=np.broadcast_to(np.eye(LK), (B, H, LK, LK)))
    d_out = torch.tensor(rng.standard_normal((B, H, LQ, LK)))
    kw = dict(dropout_rate=0.5, dropout_rng=torch.Generator().manual_seed(seed), is_causal=True)
    out, grads = run_with_grads(arrays, kw, d_out, "blockwise")
    causal = np.tril(np.ones((LQ, LK), dtype=bool))
    kept = out != 0
    assert kept[..., ~causal].sum() == 0 and 0 < kept[..., causal].mean() < 1, f"seed {seed}"
    kw = dict(dropout_rate=0.5, dropout_mask=torch.from_numpy(kept), is_causal=True)
    dense_out, dense_grads = run_with_grads(arrays, kw, d_out, "dense")
    assert compare(out, dense_out, "float64").ok, f"seed {seed}"
    for n, g in grads.items():
        assert compare(g, dense_grads[n], "float64", "grad").ok, f"grad {n}, seed {seed}"


def test_drawn_dropout_keeps_the_rate_and_follows_the_generator(chunks):
    rng, seed = fresh_rng()
    chunks(5)
    q, k = (torch.tensor(rng.standard_normal((B, H, 40, 8))) for _ in range(2))
    v = torch.eye(40, dtype=torch.float64).expand(B, H, 40, 40)  # the output is the weights

    def draw(generator_seed):
        return sdpa(q, k, v, dropout_rate=0.25, implementation="blockwise",
                    dropout_rng=torch.Generator().manual_seed(generator_seed))

    kept = (draw(seed) != 0).numpy()
    bound = 5 * math.sqrt(0.25 * 0.75 / kept.size)
    assert abs(kept.mean() - 0.75) <= bound, f"keep rate {kept.mean()}, seed {seed}"
    torch.testing.assert_close(draw(seed), draw(seed), rtol=0, atol=0)
    assert not torch.equal(draw(seed), draw(seed + 1))


def test_blockwise_keeps_no_weights_for_the_backward():
    """At L = 4096 (B = H = 1, D = 64, float32, causal) dense saves (Lq, Lk) tensors for its
    backward; blockwise, forward and backward, never holds more than a chunk of rows."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 4096, 64, generator=g).requires_grad_() for _ in range(3))
    largest = {}
    for implementation in ("dense", "blockwise"):
        saved = [0]

        def pack(t, saved=saved):
            saved[0] = max(saved[0], t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = sdpa(q, k, v, is_causal=True, implementation=implementation)
            out.backward(torch.ones_like(out))
        largest[implementation] = saved[0]
    assert largest["dense"] >= 4096 * 4096
    assert largest["blockwise"] <= functional.BLOCKWISE_ELEMENTS < 4096 * 4096 // 4, largest


@pytest.fixture
def paths(monkeypatch):
    """Records which path each call took: "blockwise", "fused" or "explicit"."""
    taken = []
    blockwise, explicit = functional._Blockwise.apply, functional._explicit

    def spy_blockwise(*args):
        taken.append("blockwise")
        monkeypatch.setattr(functional, "_explicit", explicit)  # its chunks are not counted
        return blockwise(*args)

    monkeypatch.setattr(functional._Blockwise, "apply", spy_blockwise)
    monkeypatch.setattr(functional, "_explicit",
                        lambda *a: taken.append("explicit") or explicit(*a))
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: taken.append("fused") or TORCH_SDPA(*a, **k))
    return taken


# (call, the path None takes when the weights have ≥ BLOCKWISE_MIN_ELEMENTS elements)
AUTO = {
    "grad": (dict(grad=True), "blockwise"),
    "grad_return_weights": (dict(grad=True, return_weights=True), "explicit"),
    "no_grad": (dict(), "fused"),
    "no_grad_softcap": (dict(softcap=1.0), "blockwise"),
    "no_grad_dropout": (dict(dropout_rate=0.1), "blockwise"),
    "grad_disabled": (dict(grad=True, no_grad=True), "fused"),
}


@pytest.mark.parametrize("large", [True, False], ids=["large", "small"])
@pytest.mark.parametrize("call", AUTO)
def test_automatic_choice(call, large, paths, monkeypatch):
    """None is blockwise where dense would form weights nobody asked for and they are large
    (here the threshold is the test's size: B·H·Lq·Lk elements); dense otherwise."""
    kw, expected = AUTO[call]
    kw = dict(kw)
    size = B * H * LQ * LK
    monkeypatch.setattr(functional, "BLOCKWISE_MIN_ELEMENTS", size if large else size + 1)
    rng, _ = fresh_rng()
    grad, no_grad = kw.pop("grad", False), kw.pop("no_grad", False)
    q, k, v = (torch.tensor(rng.standard_normal(s), requires_grad=grad)
               for s in [(B, H, LQ, DK), (B, HKV, LK, DK), (B, HKV, LK, DV)])
    with torch.set_grad_enabled(not no_grad):
        sdpa(q, k, v, is_causal=True, **kw)
    if not large and expected == "blockwise":
        expected = "explicit"
    assert paths == [expected]


@pytest.mark.parametrize("implementation", ["dense", "blockwise"])
def test_a_named_implementation_is_taken_at_any_size(implementation, paths):
    rng, _ = fresh_rng()
    q, k, v = (torch.tensor(rng.standard_normal((LQ, DK)), requires_grad=True)
               for _ in range(3))
    out = sdpa(q, k, v, implementation=implementation)
    assert paths == ["explicit" if implementation == "dense" else "blockwise"]
    out.sum().backward()


def test_default_threshold_and_rows():
    """The measured constants: None switches at 2²⁴ weights; chunks of about 2²¹ weights and
    at least 64 rows (see the core's docstring)."""
    choose = functional._choose
    assert choose(None, (4, 8, 1024, 1024), True, False) == "blockwise"  # 2²⁵
    assert choose(None, (1, 1, 4096, 4096), True, False) == "blockwise"  # 2²⁴
    assert choose(None, (1, 1, 4096, 4095), True, False) == "dense"
    assert choose(None, (4, 8, 512, 1024), False, False) == "dense"  # forward only: fused
    assert functional._chunk_rows((1, 1), 16384) == 128
    assert functional._chunk_rows((1, 1), 65536) == 64  # the floor
    assert functional._chunk_rows((4, 8), 1024) == 64


def test_dense_is_todays_explicit_path():
    rng, _ = fresh_rng()
    q, k, v = (torch.tensor(rng.standard_normal((B, H, LQ, DK))) for _ in range(3))
    out = sdpa(q, k, v, is_causal=True, softcap=2.0, implementation="dense")
    out_w, _ = sdpa(q, k, v, is_causal=True, softcap=2.0, return_weights=True)
    torch.testing.assert_close(out, out_w, rtol=0, atol=0)


@pytest.mark.parametrize("implementation", ["flash", "Dense", ""])
def test_unknown_implementation(implementation):
    q = torch.zeros(LQ, DK)
    with pytest.raises(ValueError, match=r"implementation should be None, 'dense' or "
                                         rf"'blockwise', got '{implementation}'"):
        sdpa(q, q, q, implementation=implementation)


def test_blockwise_cannot_return_weights():
    q = torch.zeros(LQ, DK)
    with pytest.raises(ValueError, match=r"return_weights=True needs implementation='dense' "
                                         r"or None: the blockwise path never forms"):
        sdpa(q, q, q, implementation="blockwise", return_weights=True)
