"""The JAX core's accelerator implementations on a CPU (jax_attn.accelerators): "cudnn"'s
argument mapping, run through jax.nn's XLA path and checked against the Dk = Dv fixtures;
"pallas" in Pallas's interpret mode against the same fixtures; the refusals' reasons; and the
automatic choice, unchanged on a CPU and accelerators first on a GPU (the choice computed, not
run: no GPU here, so nothing on a GPU is measured).

Shape legend: B batch, H query heads, Hkv key-value heads, Lq query length, Lk key length,
D = Dk = Dv head width.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import golden
import jax_attn
from golden.harness import check, regenerate
from golden.specification import variants
from golden.specification.cases import Case
from golden.specification.implementations import Asked, record
from golden.runners.adapt import NotSupported, from_function
from golden.specification.validate import window
from jax_attn import accelerators, functional

DKV = [n for n in golden.names() if n.startswith("sdpa_dkv_")]
# What these tests pin down of a CPU (Pallas's interpret mode, float32 through Pallas, the
# choice without accelerators, cuDNN refused there): on a GPU (attn-parity device-check runs
# this file there) the same calls take the kernels, which test_the_kernels_on_a_gpu checks.
ON_A_CPU = pytest.mark.skipif(jax.default_backend() != "cpu",
                              reason="a CPU's behaviour (interpret mode, no accelerator)")


# ---- "cudnn"'s mapping, through jax.nn's XLA path ----------------------------------------------

def _mapped(query, key, value, *, mask=None, bias=None, is_causal=False, scale=None,
            local_window_size=None, query_seq_lengths=None, key_value_seq_lengths=None):
    """The core's call mapped as "cudnn" maps it (accelerators.jax_nn_call), run by jax.nn's
    XLA path (implementation=None) at precision HIGHEST: the mapping checkable on a CPU."""
    batch = query.shape[:1] if query.ndim == 4 else ()
    lengths = [None if x is None else functional.batch_int32(x, batch)
               for x in (query_seq_lengths, key_value_seq_lengths)]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    with jax.default_matmul_precision("highest"):
        return accelerators.jax_nn_call(query, key, value, mask, bias, *lengths, scale=scale,
                                        is_causal=bool(is_causal),
                                        window=window(local_window_size), implementation=None)


@functools.cache
def _rows(runner_name):
    runner = {"mapped": from_function(_mapped, "jax", name="cudnn mapping (XLA)"),
              "pallas": from_function(_pallas, "jax", name="pallas (interpret)")}[runner_name]
    report = check.run(DKV, impls=[runner], dtypes=["float32", "bfloat16"])
    return {(r["fixture"], r["dtype"]): r for r in report["rows"]}


def test_the_cudnn_mapping_passes_every_dkv_fixture_it_can_express():
    """Every Dk = Dv fixture but soft-capping (no such argument) passes at float32, gradients
    included; the fully masked rows and the padded query rows too (zeroed after the kernel,
    where jax.nn alone averages the values: tests/test_recipes.py); and the two bfloat16
    fixtures, the bias added in bfloat16 as cuDNN adds it."""
    rows = _rows("mapped")
    assert {k: r["status"] for k, r in rows.items()} == {
        (n, d): "not supported" if n == "sdpa_dkv_softcap" else "pass"
        for n in DKV for d in ("float32", "bfloat16") if d in golden.load(n).dtypes}
    assert sum(d == "bfloat16" for _, d in rows) == 2
    assert "does not take softcap" in rows["sdpa_dkv_softcap", "float32"]["reason"]


def _gpu_asked(name, dtype="bfloat16"):
    """The Asked of fixture ``name`` (or a Fixture) as a GPU call at ``dtype`` would make it."""
    f = golden.load(name) if isinstance(name, str) else name
    q, k, v = (f.inputs[n] for n in ("query", "key", "value"))
    c = f.config
    return functional._asked(
        q, k, v, f.inputs.get("mask"), f.inputs.get("bias"), is_causal=c.get("is_causal"),
        softcap=c.get("softcap"), local_window_size=c.get("local_window_size"),
        query_offset=None, lengths=(f.inputs.get("query_seq_lengths"),
                                    f.inputs.get("key_value_seq_lengths")),
        sinks=None, dropout_rate=0.0, return_weights=False, block_sizes=None, chunk_size=None,
        distance_bias=None)._replace(platform="gpu", dtype=dtype)


def test_which_dkv_fixtures_cudnn_would_take_on_a_gpu(monkeypatch):
    """None: cuDNN's head width (a multiple of 8) leaves the D = 8 and 16 fixtures, and those
    have a mask or bias at odd lengths (cuDNN's backward with a bias needs even ones); hence
    the kernel-shaped fixtures below."""
    monkeypatch.setattr(accelerators, "cuda_head_max", lambda: 256)  # as on an H100
    assert {n for n in DKV if accelerators.cudnn_refuses(_gpu_asked(n)) is None} == set()
    assert "multiple of 8" in accelerators.cudnn_refuses(_gpu_asked("sdpa_dkv_plain"))
    assert "even lengths" in accelerators.cudnn_refuses(_gpu_asked("sdpa_dkv_wide_head"))
    assert "a mask becomes one" in accelerators.cudnn_refuses(
        _gpu_asked("sdpa_dkv_low_precision"))
    assert "(1, 2) without is_causal" in accelerators.cudnn_refuses(
        _gpu_asked("sdpa_dkv_window_lengths_mqa")._replace(widths=(8, 8)))


# ---- fixtures at the kernels' shapes (built in memory from the float64 reference) -----------

# The shipped Dk = Dv fixtures have lengths 5 and 7 and head widths 4 to 16: cuDNN takes none of
# them (a head width a multiple of 8, even lengths with a mask or bias), nor Pallas on a GPU
# (float32 there, or a mask). These cases have B=2, H=4, Hkv=2, Lq=Lk=16 (cuDNN refuses a causal
# call with Lq ≠ Lk until its alignment is verified on a GPU), D=16 and grid inputs (exact in
# bfloat16 and float16), the reference computing their expected values.
_QKV = {"query": ("grid", (2, 4, 16, 16)), "key": ("grid", (2, 2, 16, 16)),
        "value": ("grid", (2, 2, 16, 16))}
KERNEL_CASES = [
    Case("accel_mask_bias_lengths_causal", variants.SDPA, 901,
         {**_QKV, "mask": ("mask", (2, 1, 16, 16), 0.8, ((0, 0, 3),)),
          "bias": ("grid", (4, 16, 16)), "query_seq_lengths": ("values", [8, 5], "int32"),
          "key_value_seq_lengths": ("values", [16, 6], "int32")},
         {"is_causal": True, "scale": 0.3}, dtypes=("float32", "bfloat16", "float16")),
    Case("accel_window_left", variants.SDPA, 902, _QKV, {"local_window_size": [3, 0]},
         dtypes=("float32", "bfloat16", "float16")),
    Case("accel_causal_gqa", variants.SDPA, 903, _QKV, {"is_causal": True},
         dtypes=("float32", "bfloat16", "float16")),
]


@functools.cache
def _kernel_fixtures():
    return [regenerate.build(c) for c in KERNEL_CASES]


def _by_name(implementation):
    """The core run by name (a refused call not supported, its reason the row's)."""
    def run(query, key, value, **keywords):
        try:
            return jax_attn.scaled_dot_product_attention(
                query, key, value, implementation=implementation, **keywords)
        except ValueError as e:
            if "cannot run this call" in str(e):
                raise NotSupported(str(e)) from None
            raise
    return run


def _kernel_rows(fn, name, dtypes):
    report = check.run(_kernel_fixtures(), impls=[from_function(fn, "jax", name=name)],
                       dtypes=dtypes, regeneration=False)
    return {(r["fixture"], r["dtype"]): r for r in report["rows"]}


def test_the_cudnn_mapping_at_the_kernels_shapes_on_a_cpu():
    """The mapping (jax.nn's XLA path) at even lengths and D = 16, mask, bias, lengths, GQA and
    a left window included, float32 and bfloat16 (float16's dot algorithm is refused on CPU)."""
    rows = _kernel_rows(_mapped, "cudnn mapping (XLA)", ["float32", "bfloat16"])
    assert {k: r["status"] for k, r in rows.items()} == {
        (c.name, d): "pass" for c in KERNEL_CASES for d in ("float32", "bfloat16")}


def test_on_a_gpu_cudnn_and_pallas_would_take_these_fixtures(monkeypatch):
    monkeypatch.setattr(accelerators, "cuda_head_max", lambda: 256)  # as on an H100
    for f in _kernel_fixtures():
        for dtype in ("bfloat16", "float16"):
            assert accelerators.cudnn_refuses(_gpu_asked(f, dtype)) is None, f.name
            pallas = accelerators.pallas_refuses(_gpu_asked(f, dtype))
            assert (pallas is None) == (f.name == "accel_causal_gqa"), f.name


@ON_A_CPU
def test_pallas_at_the_kernels_shapes_on_a_cpu():
    rows = _kernel_rows(_by_name("pallas"), "pallas (interpret)", ["float32", "bfloat16"])
    assert {k: r["status"] for k, r in rows.items()} == {
        (c.name, d): "pass" if c.name == "accel_causal_gqa" else "not supported"
        for c in KERNEL_CASES for d in ("float32", "bfloat16")}


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (attn-parity "
                    "device-check runs it; passed on an H200, 2026-11-27)")
@pytest.mark.parametrize("implementation, taken", [
    ("cudnn", {c.name for c in KERNEL_CASES}), ("pallas", {"accel_causal_gqa"})])
def test_the_kernels_on_a_gpu(implementation, taken):
    """On an NVIDIA GPU: each kernel by name against the fixtures it takes, bfloat16 and
    float16 (both refuse float32 there)."""
    rows = _kernel_rows(_by_name(implementation), implementation, ["bfloat16", "float16"])
    assert {k: r["status"] for k, r in rows.items()} == {
        (c.name, d): "pass" if c.name in taken else "not supported"
        for c in KERNEL_CASES for d in ("bfloat16", "float16")}
    assert all(r["core"] == implementation for r in rows.values() if r["status"] == "pass")


# ---- "pallas" in interpret mode -----------------------------------------------------------------

def _pallas(query, key, value, **keywords):
    """The core with implementation="pallas" (interpret mode on a CPU); a refused call is not
    supported, its reason the row's."""
    try:
        return jax_attn.scaled_dot_product_attention(query, key, value, implementation="pallas",
                                                     **keywords)
    except ValueError as e:
        if "cannot run this call" in str(e):
            raise NotSupported(str(e)) from None
        raise


@ON_A_CPU
def test_pallas_in_interpret_mode_passes_the_fixtures_it_takes():
    rows = _rows("pallas")
    taken = {"sdpa_dkv_plain", "sdpa_dkv_causal_square", "sdpa_dkv_causal_rect",
             "sdpa_dkv_gqa_causal_scale"}  # no mask, bias, window, lengths or soft-cap
    assert {k: r["status"] for k, r in rows.items()} == {
        (n, d): "pass" if n in taken else "not supported"
        for n in DKV for d in ("float32", "bfloat16") if d in golden.load(n).dtypes}
    assert rows["sdpa_dkv_plain", "float32"]["core"] == "pallas"
    assert "takes no mask" in rows["sdpa_dkv_mask_bias", "float32"]["reason"]


@ON_A_CPU
def test_pallas_runs_past_one_block_and_records_its_name():
    """Lengths of two 128-row blocks, causal, GQA (H=4, Hkv=2): the kernel's online
    softmax across blocks against the core's "explicit" on the same float32 inputs."""
    keys = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(keys[0], (1, 4, 256, 16), jnp.float32)
    k, v = (jax.random.normal(x, (1, 2, 256, 16), jnp.float32) for x in keys[1:])
    with record() as ran:
        out = jax_attn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                    implementation="pallas")
    want = jax_attn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 implementation="explicit")
    assert ran == [("jax", "pallas")] and out.shape == (1, 4, 256, 16)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


# ---- the refusals -------------------------------------------------------------------------------

GPU_BF16 = Asked(platform="gpu", dtype="bfloat16", lengths=(128, 256), widths=(64, 64),
                 heads=(8, 2))


@pytest.mark.parametrize("change, reason", [
    ({"platform": "cpu"}, "cuDNN runs on an NVIDIA GPU, and this call runs on cpu"),
    ({"dtype": "float32"}, "cuDNN's flash attention takes float16 or bfloat16, got float32"),
    ({"widths": (64, 32)}, "cuDNN needs value width = key width, got Dk=64, Dv=32"),
    ({"widths": (12, 12)}, "a multiple of 8 and at most 256 (256 from compute capability"),
    ({"return_weights": True}, "cuDNN takes no return_weights=True"),
    ({"softcap": True, "sinks": True}, "cuDNN takes no softcap, sinks: 'explicit' or"),
    ({"dropout": True}, "cuDNN takes no dropout"),
    ({"offset": True}, "cuDNN takes no query_offset"),
    ({"chunk": True}, "cuDNN takes no attention_chunk_size"),
    ({"distance_bias": True}, "cuDNN takes no distance_bias"),
    ({"distance_keys": True}, "cuDNN takes no distance_query and distance_keys"),
    ({"window": (3, 1)}, "got local_window_size (3, 1) without is_causal"),
    ({"window": (3, None)}, "got local_window_size (3, None) without is_causal"),
    ({"bias": True, "lengths": (127, 256)}, "even lengths"),
    ({"mask": True, "lengths": (128, 255)}, "a mask becomes one"),
    ({"causal": True}, "cuDNN's causal alignment (top-left, as ours, or bottom-right) is not "
                       "yet verified on a GPU, got Lq, Lk = (128, 256)"),
])
def test_cudnn_refusals(change, reason, monkeypatch):
    monkeypatch.setattr(accelerators, "cuda_head_max", lambda: 256)  # as on an H100
    assert accelerators.cudnn_refuses(GPU_BF16) is None
    assert reason in accelerators.cudnn_refuses(GPU_BF16._replace(**change))


@pytest.mark.parametrize("change", [{"window": (3, 0)},
                                    {"window": (3, 1), "causal": True, "lengths": (256, 256)},
                                    {"mask": True, "bias": True, "seq_lengths": True},
                                    {"dtype": "float16"}])
def test_cudnn_takes(change, monkeypatch):
    monkeypatch.setattr(accelerators, "cuda_head_max", lambda: 256)
    assert accelerators.cudnn_refuses(GPU_BF16._replace(**change)) is None


@pytest.mark.parametrize("change, reason", [
    ({"mask": True, "seq_lengths": True},
     "takes no mask, query_seq_lengths or key_value_seq_lengths: only is_causal and scale"),
    ({"window": (2, 0)}, "takes no local_window_size"),
    ({"dtype": "float32"}, "TF32, not precision HIGHEST"),
    ({"lengths": (200, 256)}, "each length ≤ 128 or a multiple of 128, got Lq, Lk = (200, 256)"),
    ({"lengths": (256, 128), "causal": True}, "Lq > Lk"),
    ({"platform": "tpu"}, "not wired in yet"),
    ({"platform": "cpu", "dtype": "float64"}, "float64 needs 'explicit' or 'blockwise'"),
    ({"widths": (64, 32)}, "needs value width = key width"),
])
def test_pallas_refusals(change, reason):
    assert accelerators.pallas_refuses(GPU_BF16) is None
    assert accelerators.pallas_refuses(GPU_BF16._replace(platform="cpu", dtype="float32")) is None
    assert reason in accelerators.pallas_refuses(GPU_BF16._replace(**change))


@ON_A_CPU
def test_cudnn_by_name_on_a_cpu_raises_its_reason():
    q = jnp.ones((2, 3, 5, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"implementation='cudnn' cannot run this call: cuDNN "
                                         r"runs on an NVIDIA GPU, and this call runs on cpu"):
        jax_attn.scaled_dot_product_attention(q, q, q, implementation="cudnn")


def test_empty_rows_in_closed_form():
    """Lq=6, Lk=3, window (1, unbounded): row i's keys are max(i − 1, 0) … 2, so rows 4 and 5
    have none; with key lengths (3, 1) batch 1 keeps rows 0 … 1 (lo = 0 < 1); query lengths
    (6, 1) leave batch 1 row 0 alone."""
    ok = accelerators.rows_allowed(6, 3, None, jnp.array([6, 1]), jnp.array([3, 1]),
                                   is_causal=False, window=(1, None))
    assert ok.shape == (2, 1, 6)
    assert ok[:, 0].tolist() == [[True] * 4 + [False] * 2, [True] + [False] * 5]
    assert accelerators.rows_allowed(6, 3, None, None, None, is_causal=True,
                                     window=(None, 2)) is None


# ---- the automatic choice -----------------------------------------------------------------------

def _portable(q_shape, k_shape):
    """The order before the accelerators (functional.BLOCKWISE_ABOVE)."""
    big = q_shape[-2] * k_shape[-2] > 2**20
    return ("blockwise", "explicit") if big else ("explicit", "blockwise")


@ON_A_CPU
def test_the_choice_on_a_cpu_is_the_portable_one_for_every_core_fixture():
    """Every core fixture, at every dtype it has: the choice on this CPU never names an
    accelerator, and selects what the portable order alone selects."""
    assert jax.default_backend() == "cpu"
    for name in golden.names():
        f = golden.load(name)
        if f.variant != variants.SDPA:
            continue
        q, k = f.inputs["query"], f.inputs["key"]
        order = functional.choose(q.shape, k.shape)
        assert order == _portable(q.shape, k.shape), name
        for dtype in f.dtypes:
            asked = _gpu_asked(name, dtype)._replace(platform="cpu") if name in DKV else Asked(
                platform="cpu", dtype=dtype)
            assert functional.IMPLEMENTATIONS.select(None, asked, order).name == order[0]


def test_on_a_gpu_the_accelerators_come_first_where_they_take_the_call(monkeypatch):
    monkeypatch.setattr(accelerators, "cuda_head_max", lambda: 256)  # as on an H100
    order = functional.choose((1, 8, 128, 64), (1, 2, 256, 64), "gpu")
    assert order == ("cudnn", "pallas", "explicit", "blockwise")
    pick = lambda **c: functional.IMPLEMENTATIONS.select(  # noqa: E731
        None, GPU_BF16._replace(**c), order).name
    assert pick() == "cudnn"
    assert pick(widths=(12, 12)) == "pallas"  # cuDNN's head width; Pallas pads to 16
    assert pick(dtype="float32") == "explicit"  # HIGHEST: neither kernel takes float32
    assert pick(return_weights=True) == "explicit"
    with record() as ran:
        functional.IMPLEMENTATIONS.select(None, GPU_BF16._replace(softcap=True), order)
    assert ran == [("jax", "explicit")]
    # The portable order after them: explicit first up to GPU_BLOCKWISE_ABOVE = 2²⁴ on a GPU
    # (measured on an H200), BLOCKWISE_ABOVE = 2²⁰ elsewhere.
    assert functional.choose((8, 4096, 64), (8, 4096, 64), "gpu")[2] == "explicit"
    assert functional.choose((8, 4097, 64), (8, 4096, 64), "gpu")[2] == "blockwise"
    assert functional.choose((8, 2048, 64), (8, 2048, 64), "tpu") == (
        "splash", "blockwise", "explicit")  # tests/test_splash.py


class _Device:
    def __init__(self, capability):
        self.compute_capability = capability


@pytest.mark.parametrize("capability, widest", [("8.0", 128), ("9.0", 256), ("10.0", 256)])
def test_cudnn_head_width_by_compute_capability(capability, widest, monkeypatch):
    monkeypatch.setattr(jax, "devices", lambda backend=None: [_Device(capability)])
    assert accelerators.cuda_head_max() == widest
    assert f"at most {widest}" in accelerators.cudnn_refuses(GPU_BF16._replace(
        widths=(widest + 8, widest + 8)))


@ON_A_CPU
def test_without_a_cuda_gpu_cudnn_refuses_a_gpu_call():
    """This machine has no GPU: a call claiming one is refused, not run."""
    assert accelerators.cuda_head_max() is None
    assert "reports no compute capability" in accelerators.cudnn_refuses(GPU_BF16)
