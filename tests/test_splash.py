"""The "splash" implementation (jax_attn.splash: the TPU splash-attention kernel) on a CPU, in
Pallas's interpret mode: against fixtures at the kernel's shapes (built in memory from the
float64 reference: no shipped fixture has lengths that are multiples of 128), forward and
every gradient, float32 and bfloat16; exact ties and empty rows; every refusal by name; the
choice on a TPU (computed, not run: no TPU here). The sharded form (splash.sharded) runs on 8
virtual devices in tests/devices8/test_splash_mesh.py. Interpret mode is slow (seconds a
call): the quick suite runs one small fixture at float32; the sweep is in the matrix.

Shape legend: B batch, H query heads, Hkv key-value heads, Lq query length, Lk key length,
Dk key width, Dv value width.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_attn
from golden.harness import check, regenerate
from golden.runners.adapt import from_function
from golden.specification import variants
from golden.specification.cases import Case
from golden.specification.implementations import Asked, record
from jax_attn import accelerators, functional, splash
from tests.helpers import matrix, reference_fixture


def _qkv(b, h, hkv, lq, lk, dk, dv):
    return {"query": ("grid", (b, h, lq, dk)), "key": ("grid", (b, hkv, lk, dk)),
            "value": ("grid", (b, hkv, lk, dv))}


# Every dimension a different size where the kernel allows (lengths are multiples of 128).
SPLASH_CASES = [
    # the quick suite's: causal, GQA (H=4, Hkv=2), soft-cap, sinks, both lengths, a scale
    Case("splash_causal_gqa_softcap_sinks_lengths", variants.SDPA, 951,
         {**_qkv(2, 4, 2, 128, 128, 8, 8), "sinks": ("normal", (4,)),
          "query_seq_lengths": ("values", [128, 77], "int32"),
          "key_value_seq_lengths": ("values", [100, 128], "int32")},
         {"is_causal": True, "softcap": 2.5, "scale": 0.4}, dtypes=("float32", "bfloat16")),
    # a window without is_causal, Lq > Lk: rows 131 … 255 have no key (a whole block empty);
    # Dk ≠ Dv, key lengths (a batch with none)
    Case("splash_window_rect_dkv", variants.SDPA, 952,
         {**_qkv(2, 3, 3, 256, 128, 8, 12),
          "key_value_seq_lengths": ("values", [0, 90], "int32")},
         {"local_window_size": [3, 5]}, dtypes=("float32", "bfloat16")),
    # causal chunks with a window, MQA (Hkv=1): ChunkedCausalMask & LocalMask
    Case("splash_chunks_window_mqa", variants.SDPA, 953, _qkv(1, 2, 1, 256, 256, 16, 8),
         {"is_causal": True, "attention_chunk_size": 96, "local_window_size": [40, 7]},
         dtypes=("float32", "bfloat16")),
    # no mask at all, blocks of 128 and 512 (Lq = 384, Lk = 512), one head, unbatched (L, D)
    Case("splash_plain_blocks_unbatched", variants.SDPA, 954,
         {n: ("grid", shape[2:]) for n, (_, shape) in _qkv(1, 1, 1, 384, 512, 8, 8).items()},
         {}, dtypes=("float32", "bfloat16")),
]
QUICK = "splash_causal_gqa_softcap_sinks_lengths"


@functools.cache
def _fixture(name):
    """The case's fixture from the float64 reference, its inputs and output cotangent drawn as
    regenerate.build draws them and its weights cotangent zero (splash returns no weights), so
    its gradients are those of Σ output ⊙ dO. Not the shipped fixtures' exact arithmetic (nor
    check.run, which recomputes the output-only gradients in it): minutes at these lengths."""
    case = next(c for c in SPLASH_CASES if c.name == name)
    rng = np.random.default_rng(case.seed)
    inputs = {n: regenerate.draw(spec, rng) for n, spec in case.inputs.items()}
    q, v = inputs["query"], inputs["value"]
    lead = q.shape[:-1]  # (B, H, Lq)
    cot = {"output": rng.standard_normal(lead + v.shape[-1:]).astype(np.float32),
           "weights": np.zeros(lead + v.shape[-2:-1], np.float32)}
    fixture = reference_fixture(variants.SDPA, case.config, inputs, {}, cot, case.dtypes[0])
    return dataclasses.replace(fixture, name=name, dtypes=list(case.dtypes))


def _splash(query, key, value, **keywords):
    """The core with implementation="splash" (interpret mode here)."""
    return jax_attn.scaled_dot_product_attention(query, key, value, implementation="splash",
                                                 **keywords)


RUNNER = from_function(_splash, "jax", name="splash")


def _errors(name, dtype) -> dict:
    """{array: golden.specification.tolerances.Comparison} of the splash run of fixture
    ``name`` at ``dtype`` (float32 dots at precision HIGHEST), compared as check.run compares
    (golden.harness.check.compare_all, the one table), and the implementation that ran."""
    fixture = _fixture(name)
    with jax.default_matmul_precision("highest"):
        result = RUNNER(fixture, dtype)
    assert result["loss"] == "output" and set(result["grads"]) >= {"query", "key", "value"}
    return check.compare_all(fixture, result, dtype, expected=fixture.grads), result["core"]


@pytest.mark.parametrize("name, dtype", [
    pytest.param(c.name, d, marks=() if (c.name, d) == (QUICK, "float32") else matrix)
    for c in SPLASH_CASES for d in ("float32", "bfloat16")])
def test_splash_passes_the_kernel_shaped_fixtures(name, dtype):
    """Outputs and every gradient (query, key, value, sinks) within the table's bounds."""
    comparisons, core = _errors(name, dtype)
    assert core == "splash"
    failed = {what: c for what, c in comparisons.items() if c is None or not c.ok}
    assert not failed, failed


# ---- exact ties and empty rows ------------------------------------------------------------------

def test_exact_ties_give_the_mean_of_the_allowed_values():
    """Every key the same (B=1, H=1, Lq=Lk=128, D=8): each causal row's scores tie exactly,
    so row i is the mean of values 0 … i (fresh values)."""
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (1, 1, 128, 8))
    k = jnp.broadcast_to(jax.random.normal(keys[1], (8,)), (1, 1, 128, 8))
    v = jax.random.normal(keys[2], (1, 1, 128, 8))
    out = _splash(q, k, v, is_causal=True)
    mean = np.cumsum(np.asarray(v, np.float64), axis=2) / np.arange(1, 129)[:, None]
    np.testing.assert_allclose(out, np.broadcast_to(mean, out.shape), rtol=1e-5, atol=1e-6)


def test_rows_with_no_allowed_key_are_exact_zeros_with_zero_gradients():
    """Window (0, 0), Lq=256 > Lk=128 (B=2, H=1, D=8): row i < 128 sees key i alone (weight
    exactly 1: the value itself), rows 128 … 255 (a whole block of the kernel) none; key
    lengths (128, 0): batch 1 has no key at all. Those rows are zeros, and their query
    gradients too (splash alone would give 0/0 or the values' mean there)."""
    keys = jax.random.split(jax.random.key(4), 4)
    q = jax.random.normal(keys[0], (2, 1, 256, 8))
    k, v = (jax.random.normal(x, (2, 1, 128, 8)) for x in keys[1:3])
    lengths = jnp.array([128, 0])

    def loss(q, k, v):
        out = _splash(q, k, v, local_window_size=(0, 0), key_value_seq_lengths=lengths)
        return (out * jax.random.normal(keys[3], out.shape)).sum(), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    np.testing.assert_array_equal(out[0, :, :128], v[0])
    assert not np.asarray(out[0, :, 128:]).any() and not np.asarray(out[1]).any()
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert not np.asarray(grads[0][0, :, 128:]).any() and not np.asarray(grads[0][1]).any()
    assert not np.asarray(grads[1][1]).any() and not np.asarray(grads[2][1]).any()


def test_rows_allowed_knows_chunks():
    """Causal chunks of 4, Lq=12 > Lk=6: row i's keys are 4·(i // 4) … min(i, 5), so rows
    8 … 11 (their chunk starts at key 8) have none."""
    ok = accelerators.rows_allowed(12, 6, None, None, None, is_causal=True,
                                   window=(None, None), chunk=4)
    assert ok[0, 0].tolist() == [True] * 8 + [False] * 4


# ---- the refusals -------------------------------------------------------------------------------

def _small(dtype=jnp.float32, lq=128, lk=128):
    """Fresh query, key, value (B=2, H=3, Lq, D=8), (B=2, H=3, Lk, D=8) (NumPy's generator:
    nothing to compile for a call that is refused)."""
    rng = np.random.default_rng()
    return tuple(jnp.asarray(rng.standard_normal((2, 3, n, 8)), dtype) for n in (lq, lk, lk))


@pytest.mark.parametrize("keywords, reason", [
    ({"return_weights": True}, "splash takes no return_weights=True"),
    ({"dropout_rate": 0.1, "dropout_rng": jax.random.key(0)}, "splash takes no dropout"),
    ({"mask": np.ones((128, 128), bool)}, "splash takes no mask"),
    ({"bias": np.zeros((128, 128), np.float32)}, "splash takes no bias"),
    ({"query_offset": 1}, "splash takes no query_offset"),
    ({"distance_bias": np.zeros((3, 9), np.float32)}, "splash takes no distance_bias"),
    ({"distance_query": np.zeros((3, 128, 2), np.float32),
      "distance_keys": np.zeros((3, 9, 2), np.float32)},
     "splash takes no distance_query and distance_keys"),
    ({"block_sizes": (128, 128)}, "splash takes no block_sizes (for 'blockwise')"),
    ({"attention_chunk_size": 64}, "attention_chunk_size needs is_causal=True"),
])
def test_splash_refuses_by_name(keywords, reason):
    q, k, v = _small()
    with pytest.raises(ValueError, match=r"implementation='splash' cannot run this call: .*"
                                         + re.escape(reason)):
        jax_attn.scaled_dot_product_attention(q, k, v, implementation="splash", **keywords)


@pytest.mark.parametrize("dtype, lengths, reason", [
    ("float16", (128, 128), "splash takes float32 or bfloat16 (it accumulates in float32), "
                            "got float16"),
    ("float64", (128, 128), "got float64"),
    ("float32", (100, 128), "splash needs each length a multiple of 128 (its blocks of 512, "
                            "256, 128 divide the lengths), got Lq, Lk = (100, 128)"),
    ("float32", (128, 640 + 64), "got Lq, Lk = (128, 704)"),
])
def test_splash_refuses_dtypes_and_lengths(dtype, lengths, reason):
    with jax.enable_x64(dtype == "float64"):
        q, k, v = _small(jnp.dtype(dtype), *lengths)
        with pytest.raises(ValueError, match=re.escape(reason)):
            jax_attn.scaled_dot_product_attention(q, k, v, implementation="splash")


def test_splash_refuses_float32_on_a_tpu_and_arrays_on_an_explicit_mesh():
    """What a CPU cannot force through the core: a TPU's float32 (Asked as a TPU call makes it)
    and arrays on a mesh with explicit axes (forced on 8 devices in tests/devices8)."""
    tpu = Asked(platform="tpu", dtype="bfloat16", lengths=(256, 512), widths=(64, 64))
    assert splash.splash_refuses(tpu) is None
    assert "precision HIGHEST: it takes bfloat16 there" in splash.splash_refuses(
        tpu._replace(dtype="float32"))
    assert "splash takes no arrays on a mesh with explicit axes" in splash.splash_refuses(
        tpu._replace(sharded=True))
    # A GPU (attn-parity device-check's grid asks): the TPU kernel's emulation, refused there.
    assert "splash is the TPU kernel: on a GPU only its interpret mode" in splash.splash_refuses(
        tpu._replace(platform="gpu"))


@pytest.mark.parametrize("n, block", [(128, 128), (256, 256), (384, 128), (512, 512),
                                      (768, 256), (1536, 512), (100, None), (64, None)])
def test_blocks_are_the_largest_that_divide(n, block):
    assert splash.block(n) == block


# ---- the automatic choice -----------------------------------------------------------------------

TPU_BF16 = Asked(platform="tpu", dtype="bfloat16", lengths=(256, 512), widths=(64, 64),
                 heads=(8, 2))


def test_on_a_tpu_splash_comes_first_where_it_takes_the_call():
    order = functional.choose((1, 8, 256, 64), (1, 2, 512, 64), "tpu")
    assert order == ("splash", "explicit", "blockwise")
    assert functional.choose((8, 2048, 64), (8, 2048, 64), "tpu") == (
        "splash", "blockwise", "explicit")
    pick = lambda **c: functional.IMPLEMENTATIONS.select(  # noqa: E731
        None, TPU_BF16._replace(**c), order).name
    assert pick() == "splash"
    assert pick(causal=True, softcap=True, sinks=True, seq_lengths=True, window=(8, 0)) == (
        "splash")
    assert pick(dtype="float32") == "explicit"  # its float32 dots' precision unknown there
    assert pick(lengths=(100, 512)) == "explicit"
    assert pick(return_weights=True) == "explicit"
    assert pick(mask=True) == "explicit"
    with record() as ran:
        functional.IMPLEMENTATIONS.select(None, TPU_BF16._replace(chunk=True), order)
    assert ran == [("jax", "explicit")]  # chunks without is_causal


def test_off_a_tpu_splash_is_never_chosen():
    for platform in ("cpu", "gpu"):
        assert "splash" not in functional.choose((1, 8, 256, 64), (1, 2, 512, 64), platform)
    q, k, v = _small()
    with record() as ran:
        jax_attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert ran == [("jax", "explicit")]
