"""The torch core's named implementations (torch_attn.IMPLEMENTATIONS): "row_chunks" against
every sdpa golden fixture and against "explicit" on fresh inputs, its memory (no (Lq, Lk) tensor
kept for the backward), its drawn dropout; that each name runs the algorithm it names and is
the one recorded (golden.specification.implementations.record); the automatic choice (None); and
that an argument an implementation cannot honour raises instead of falling back.

row_chunks runs with tiny chunks here (1 to 3 query rows), so that every case has several
chunks, a ragged last one, and key ranges cut by the causal and window bounds.

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
import torch_attn.explicit as explicit_module
import torch_attn.functional as functional
import torch_attn.row_chunks as row_chunks
from golden import reference
from golden.specification.implementations import Asked, record
from golden.specification.tolerances import compare
from tests.helpers import fixture_of, fresh_rng
from torch_attn import scaled_dot_product_attention as sdpa

B, H, HKV, LQ, LK, DK, DV = 2, 6, 2, 5, 7, 4, 3
# (fixture, dtype) for every sdpa fixture and every dtype it is run at.
SDPA_RUNS = [(n, d) for n in golden.names() if n.startswith("sdpa_") for d in fixture_of(n).dtypes]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
TORCH_SDPA = F.scaled_dot_product_attention  # before any monkeypatch


@pytest.fixture
def chunks(monkeypatch):
    """Sets row_chunks' default rows per chunk; returns the query row counts of the explicit
    calls its chunks make."""
    rows = []
    explicit = explicit_module.explicit

    def counted(query, *args):
        rows.append(query.shape[-2])
        return explicit(query, *args)

    monkeypatch.setattr(explicit_module, "explicit", counted)
    return lambda n: monkeypatch.setattr(row_chunks, "chunk_rows", lambda *a: n) or rows


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
    _, weights, saved = reference.sdpa_forward(**arrays, **fixture.config)
    d_out = fixture.cotangents["output"].astype(np.float64)
    return reference.sdpa_backward(saved, d_out, np.zeros_like(weights))


def terms(name, arrays, weights_size) -> int:
    """Partial gradients summed per element: a bias's over its broadcast axes, the sinks' over
    each head's rows."""
    return max(1, weights_size // arrays[name].size) if name in ("bias", "sinks") else 1


def as_numpy(t):
    return t.detach().to(torch.float64).numpy()


@pytest.mark.parametrize("name, dtype", SDPA_RUNS)
def test_row_chunks_matches_the_golden_fixture(name, dtype, chunks):
    fixture = golden.load(name)
    rows = chunks(2)
    inputs = leaves(fixture.inputs, DTYPES[dtype])
    out = sdpa(**inputs, **fixture.config, implementation="row_chunks")
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
    "sinks_chunks": dict(attention_chunk_size=2, is_causal=True, query_offset=np.array([1, 4]),
                         sinks=True),
    "window_chunks": dict(attention_chunk_size=3, local_window_size=(2, 1),
                          query_offset=np.array([2, 5])),  # chunk bounds tighter than the window
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
    if kw.pop("sinks", False):
        arrays["sinks"] = rng.standard_normal(H)
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
def test_row_chunks_matches_explicit_on_fresh_inputs(case, hkv, bias_shape, rows, chunks):
    rng, seed = fresh_rng()
    chunks(rows)
    arrays, kw = random_case(rng, case, hkv, bias_shape)
    d_out = torch.tensor(rng.standard_normal((B, H, LQ, DV)))
    out, grads = run_with_grads(arrays, kw, d_out, "row_chunks")
    explicit_out, explicit_grads = run_with_grads(arrays, kw, d_out, "explicit")
    assert np.isfinite(out).all() and (out[1, :, 2] == 0).all(), f"empty row, seed {seed}"
    assert compare(out, explicit_out, "float64").ok, f"output, seed {seed}"
    assert set(grads) == {"query", "key", "value", "bias"} | set(arrays) & {"sinks"}
    for n, g in grads.items():
        c = compare(g, explicit_grads[n], "float64", "grad",
                    terms=terms(n, arrays, B * H * LQ * LK))
        assert c.ok, f"grad {n}: {c}, seed {seed}"
    with torch.no_grad():  # forward only: the chunks without a backward
        inputs = leaves(arrays, torch.float64)
        alone = sdpa(**inputs, **kw, implementation="row_chunks")
    np.testing.assert_array_equal(alone.numpy(), out, err_msg=f"seed {seed}")


def test_row_chunks_low_precision_gradients_accumulate_in_float32(chunks):
    """bfloat16 key and value gradients summed over 256 chunks of one row stay within the
    tolerance (seen: at most 0.9u relative error norm over 20 seeds); summed in bfloat16 they
    reach 3.7u to 6.3u and fail."""
    rng, seed = fresh_rng()
    chunks(1)
    shapes = [(1, 256, 8), (1, 24, 8), (1, 24, 8), (1, 256, 8)]
    *grid, d_out = (np.round(rng.standard_normal(s) * 8) / 8 for s in shapes)  # exact in bf16
    q, k, v = (torch.tensor(a, dtype=torch.bfloat16, requires_grad=True) for a in grid)
    out = sdpa(q, k, v, implementation="row_chunks")
    out.backward(torch.tensor(d_out, dtype=torch.bfloat16))
    _, w, saved = reference.sdpa_forward(*grid)
    expected = reference.sdpa_backward(saved, d_out, np.zeros_like(w))
    for n, x in zip(("query", "key", "value"), (q, k, v)):
        c = compare(as_numpy(x.grad), expected[n], "bfloat16", "grad")
        assert c.ok, f"{n}: {c}, seed {seed}"


def test_drawn_dropout_is_redrawn_identically_in_the_backward(chunks):
    """With V = I the output is the weights, so the dropout mask row_chunks drew is read off
    the output; explicit with that mask must give the same output and gradients."""
    rng, seed = fresh_rng()
    chunks(3)
    q, k = rng.standard_normal((B, H, LQ, DK)), rng.standard_normal((B, H, LK, DK))
    arrays = dict(query=q, key=k, value=np.broadcast_to(np.eye(LK), (B, H, LK, LK)))
    d_out = torch.tensor(rng.standard_normal((B, H, LQ, LK)))
    kw = dict(dropout_rate=0.5, dropout_rng=torch.Generator().manual_seed(seed), is_causal=True)
    out, grads = run_with_grads(arrays, kw, d_out, "row_chunks")
    causal = np.tril(np.ones((LQ, LK), dtype=bool))
    kept = out != 0
    assert kept[..., ~causal].sum() == 0 and 0 < kept[..., causal].mean() < 1, f"seed {seed}"
    kw = dict(dropout_rate=0.5, dropout_mask=torch.from_numpy(kept), is_causal=True)
    explicit_out, explicit_grads = run_with_grads(arrays, kw, d_out, "explicit")
    assert compare(out, explicit_out, "float64").ok, f"seed {seed}"
    for n, g in grads.items():
        assert compare(g, explicit_grads[n], "float64", "grad").ok, f"grad {n}, seed {seed}"


def test_drawn_dropout_keeps_the_rate_and_follows_the_generator(chunks):
    rng, seed = fresh_rng()
    chunks(5)
    q, k = (torch.tensor(rng.standard_normal((B, H, 40, 8))) for _ in range(2))
    v = torch.eye(40, dtype=torch.float64).expand(B, H, 40, 40)  # the output is the weights

    def draw(generator_seed):
        return sdpa(q, k, v, dropout_rate=0.25, implementation="row_chunks",
                    dropout_rng=torch.Generator().manual_seed(generator_seed))

    kept = (draw(seed) != 0).numpy()
    bound = 5 * math.sqrt(0.25 * 0.75 / kept.size)
    assert abs(kept.mean() - 0.75) <= bound, f"keep rate {kept.mean()}, seed {seed}"
    torch.testing.assert_close(draw(seed), draw(seed), rtol=0, atol=0)
    assert not torch.equal(draw(seed), draw(seed + 1))


def test_row_chunks_keeps_no_weights_for_the_backward():
    """At L = 4096 (B = H = 1, D = 64, float32, causal) explicit saves (Lq, Lk) tensors for
    its backward; row_chunks, forward and backward, never holds more than a chunk of rows."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 4096, 64, generator=g).requires_grad_() for _ in range(3))
    largest = {}
    for implementation in ("explicit", "row_chunks"):
        saved = [0]

        def pack(t, saved=saved):
            saved[0] = max(saved[0], t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = sdpa(q, k, v, is_causal=True, implementation=implementation)
            out.backward(torch.ones_like(out))
        largest[implementation] = saved[0]
    assert largest["explicit"] >= 4096 * 4096
    assert largest["row_chunks"] <= row_chunks.CHUNK_ELEMENTS < 4096 * 4096 // 4, largest


@pytest.fixture
def paths(monkeypatch):
    """Which algorithm each call ran, seen from the inside ("row_chunks": its autograd
    Function; "explicit": the weights formed outside it; "fused": PyTorch's kernel), and, as a
    second list, what golden.specification.implementations.record() reported."""
    taken = []
    apply, explicit = row_chunks._RowChunks.apply, functional.explicit

    def spy_row_chunks(*args):
        taken.append("row_chunks")
        return apply(*args)

    monkeypatch.setattr(row_chunks._RowChunks, "apply", spy_row_chunks)
    monkeypatch.setattr(functional, "explicit",
                        lambda *a: taken.append("explicit") or explicit(*a))
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: taken.append("fused") or TORCH_SDPA(*a, **k))
    with record() as recorded:
        yield taken, recorded


# (call, what None runs when the weights have more than ROW_CHUNKS_ABOVE elements)
AUTO = {
    "grad": (dict(grad=True), "row_chunks"),
    "grad_return_weights": (dict(grad=True, return_weights=True), "explicit"),
    "no_grad": (dict(), "fused"),
    "no_grad_softcap": (dict(softcap=1.0), "row_chunks"),
    "no_grad_dropout": (dict(dropout_rate=0.1), "row_chunks"),
    "grad_disabled": (dict(grad=True, no_grad=True), "fused"),
}


@pytest.mark.parametrize("large", [True, False], ids=["large", "small"])
@pytest.mark.parametrize("call", AUTO)
def test_automatic_choice(call, large, paths, monkeypatch):
    """None is row_chunks where the weights would be formed though nobody asked for them, and
    are large (here the threshold is the test's size: B·H·Lq·Lk elements); explicit where they
    are asked for or small; fused where nothing needs them. The record says the same."""
    kw, expected = AUTO[call]
    kw = dict(kw)
    size = B * H * LQ * LK
    monkeypatch.setattr(functional, "ROW_CHUNKS_ABOVE", size - 1 if large else size)
    rng, _ = fresh_rng()
    grad, no_grad = kw.pop("grad", False), kw.pop("no_grad", False)
    q, k, v = (torch.tensor(rng.standard_normal(s), requires_grad=grad)
               for s in [(B, H, LQ, DK), (B, HKV, LK, DK), (B, HKV, LK, DV)])
    with torch.set_grad_enabled(not no_grad):
        sdpa(q, k, v, is_causal=True, **kw)
    if not large and expected == "row_chunks":
        expected = "explicit"
    taken, recorded = paths
    assert taken == [expected] and recorded == [("torch", expected)]


@pytest.mark.parametrize("implementation", ["explicit", "row_chunks", "fused"])
def test_each_name_runs_the_algorithm_it_names_at_any_size(implementation, paths):
    rng, _ = fresh_rng()
    grad = implementation != "fused"  # fused refuses gradients (below)
    q, k, v = (torch.tensor(rng.standard_normal((LQ, DK)), requires_grad=grad)
               for _ in range(3))
    out = sdpa(q, k, v, implementation=implementation)
    taken, recorded = paths
    assert taken == [implementation] and recorded == [("torch", implementation)]
    expected = sdpa(q, k, v, return_weights=True)[0]
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def auto(shape, **asked):
    """The implementation None runs for weights of ``shape`` and these demands."""
    return functional.IMPLEMENTATIONS.select(None, Asked(**asked), functional.choose(shape)).name


def test_default_threshold_and_rows():
    """The measured constants: None takes row_chunks from 2²⁴ weights up; chunks of about 2²¹
    weights and at least 64 rows (see the core's docstring)."""
    assert auto((4, 8, 1024, 1024), gradients=True) == "row_chunks"  # 2²⁵
    assert auto((1, 1, 4096, 4096), gradients=True) == "row_chunks"  # 2²⁴
    assert auto((1, 1, 4096, 4095), gradients=True) == "explicit"
    assert auto((4, 8, 1024, 1024), gradients=True, return_weights=True) == "explicit"
    assert auto((4, 8, 1024, 1024)) == "fused"  # forward only
    assert auto((1, 1, 4, 4), block_sizes=(2, None)) == "row_chunks"  # blocks asked for
    assert row_chunks.chunk_rows((1, 1), 16384) == 128
    assert row_chunks.chunk_rows((1, 1), 65536) == 64  # the floor
    assert row_chunks.chunk_rows((4, 8), 1024) == 64


def test_block_sizes_set_the_rows_per_chunk(monkeypatch):
    rows = []
    explicit = explicit_module.explicit
    monkeypatch.setattr(explicit_module, "explicit",
                        lambda q, *a: rows.append(q.shape[-2]) or explicit(q, *a))
    q = torch.zeros(2, 7, DK)
    sdpa(q, q, q, implementation="row_chunks", block_sizes=(3, None))
    assert rows == [1, 3, 3]  # the last chunk first


@pytest.mark.parametrize("implementation", ["flash", "Dense", "", "blockwise"])
def test_unknown_implementation(implementation):
    q = torch.zeros(LQ, DK)
    with pytest.raises(ValueError, match=r"implementation should be None or one of 'explicit', "
                                         rf"'fused', 'row_chunks', 'sparse' \(torch\), "
                                         rf"got '{implementation}'"):
        sdpa(q, q, q, implementation=implementation)


def test_dense_names_its_successor():
    q = torch.zeros(LQ, DK)
    with pytest.raises(ValueError, match=r"got 'dense' \('dense' is now 'explicit'"):
        sdpa(q, q, q, implementation="dense")


# (implementation, arguments it cannot honour, the reason it gives)
REFUSED = [
    ("row_chunks", dict(return_weights=True), "never forms all the"),
    ("fused", dict(return_weights=True), "does not return the weights"),
    ("fused", dict(softcap=2.0), "cannot soft-cap"),
    ("fused", dict(dropout_rate=0.1), "draws its own dropout"),
    ("fused", dict(grad=True), "backward loses accuracy"),
    ("fused", dict(block_sizes=(2, None)), "block_sizes is for 'row_chunks'"),
    ("explicit", dict(block_sizes=(2, None)), "block_sizes is for 'row_chunks'"),
]


@pytest.mark.parametrize("implementation, kw, reason", REFUSED)
def test_an_argument_it_cannot_honour_raises_instead_of_falling_back(implementation, kw, reason,
                                                                     paths):
    kw = dict(kw)
    q = torch.zeros(LQ, DK, requires_grad=kw.pop("grad", False))
    with pytest.raises(ValueError, match=rf"implementation='{implementation}' cannot run this "
                                         rf"call: .*{reason}"):
        sdpa(q, q, q, implementation=implementation, **kw)
    assert paths == ([], [])  # nothing ran


@pytest.mark.parametrize("block_sizes", [(2, 2), (0, None), 3, (None, None), (True, None)])
def test_bad_block_sizes(block_sizes):
    q = torch.zeros(LQ, DK)
    with pytest.raises(ValueError, match=r"block_sizes should be None or a pair \(rows, None\)"):
        sdpa(q, q, q, block_sizes=block_sizes)
