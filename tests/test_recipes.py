"""The shipped recipes (golden.runners.recipes) on the Dk = Dv fixtures, with the statuses and
the failing rows' errors that docs/validating.md cites; and from_function's keyword detection
(``keywords=``, ``__wrapped__``, a TypeError for an unexpected keyword) and ``dtypes=``.

Shape legend: B batch, H heads, Lq query length, Lk key length, D = Dk = Dv head width.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import golden
from golden.harness import check
from golden.cli import main
from golden.runners import recipes
from golden.runners.adapt import from_function, load

DKV = [n for n in golden.names() if n.startswith("sdpa_dkv_")]
ARGUMENT_LESS = {  # what each API has no argument for, among the fixtures' keywords
    "torch": {"sdpa_dkv_softcap", "sdpa_dkv_window_causal",
              "sdpa_dkv_window_lengths_mqa"},
    "jax": {"sdpa_dkv_softcap"},
    "flax": {"sdpa_dkv_softcap", "sdpa_dkv_window_causal",
             "sdpa_dkv_window_lengths_mqa"},
}


@functools.cache
def _report(name):
    return check.run(DKV, impls=[recipes.RECIPES[name]])


def _rows(name):
    return {(r["fixture"], r["dtype"]): r for r in _report(name)["rows"]}


def _expected_jax(fixture, dtype, api):
    """jax.nn's status (and Flax's, its fast path): softmax in float32 (float64 fails at ~1e-7),
    the large-negative fill on a fully masked row, float16's dot algorithm refused on CPU."""
    if fixture in ARGUMENT_LESS[api]:
        return "not supported"
    if dtype == "float16":
        return "error"
    if dtype == "float64" or fixture == "sdpa_dkv_masked_row":
        return "fail"
    return "pass"


def test_the_dkv_fixtures_cover_the_core_at_equal_widths():
    assert len(DKV) == 14
    for name in DKV:
        f = golden.load(name)
        assert f.inputs["key"].shape[-1] == f.inputs["value"].shape[-1], name
    keys = set().union(*(set(golden.load(n).inputs) | set(golden.load(n).config) for n in DKV))
    assert {"mask", "bias", "is_causal", "scale", "softcap", "local_window_size",
            "query_seq_lengths", "key_value_seq_lengths"} <= keys


def test_recipes_load_from_their_spec():
    for name, runner in recipes.RECIPES.items():
        assert load(f"golden.runners.recipes:{name}") is runner


def test_the_command_line_runs_a_recipe(capsys):
    code = main(["check", "--impl", "golden.runners.recipes:TORCH_SDPA", "-k", "sdpa_dkv_causal"])
    out = capsys.readouterr().out
    assert code == 0 and "torch F.sdpa" in out and "4 passed, 0 failed" in out


def test_torch_sdpa_passes_every_dkv_row_it_can_express():
    rows = _rows("TORCH_SDPA")
    assert {k: r["status"] for k, r in rows.items()} == {
        (n, d): "not supported" if n in ARGUMENT_LESS["torch"] else "pass"
        for n in DKV for d in golden.load(n).dtypes}
    assert sum(r["status"] == "pass" for r in rows.values()) == 26
    reason = rows["sdpa_dkv_window_lengths_mqa", "float32"]["reason"]
    assert "does not take key_value_seq_lengths, local_window_size, query_seq_lengths" in reason


@pytest.mark.parametrize("name, api", [("JAX_NN", "jax"), ("FLAX_NNX", "flax")])
def test_jax_and_flax_statuses(name, api):
    rows = _rows(name)
    assert {k: r["status"] for k, r in rows.items()} == {
        (n, d): _expected_jax(n, d, api) for n in DKV for d in golden.load(n).dtypes}
    for (fixture, dtype), row in rows.items():
        if row["status"] == "fail" and fixture != "sdpa_dkv_masked_row":  # float64 rows
            assert 5e-8 < row["max_rel"] < 5e-7, (fixture, row["max_rel"])  # float32 softmax
        if dtype == "float16":
            assert "F16_F16_F32" in row["reason"] and "CPU" in row["reason"]


@pytest.mark.parametrize("name", ["JAX_NN", "FLAX_NNX"])
def test_a_fully_masked_row_gets_the_mean_of_the_values(name):
    """Where every key is masked, the large-negative fill leaves a uniform softmax: the row's
    output is the mean of the values over keys, where ours (and the fixture) give zeros."""
    f = golden.load("sdpa_dkv_masked_row")
    value = f.inputs["value"].astype(np.float64)  # (B, H, Lk, D)
    mean = max(np.abs(value[b, h].mean(axis=0)).max() for b, h in ((0, 0), (1, 2)))
    row = _rows(name)["sdpa_dkv_masked_row", "float32"]
    assert row["reason"] == "output, grad value"
    output = next(a for a in row["arrays"] if a["name"] == "output")
    assert output["max_abs"] == pytest.approx(mean, rel=1e-6)


@pytest.mark.parametrize("name", ["JAX_NN", "FLAX_NNX"])
def test_jax_recipes_refuse_unequal_widths_as_not_supported(name):
    report = check.run(["sdpa_plain"], impls=[recipes.RECIPES[name]], dtypes=["float32"])
    (row,) = report["rows"]
    assert row["status"] == "not supported"
    assert "needs value width = key width, got Dk=4, Dv=6" in row["reason"]


# ---- from_function: which keywords fn takes ---------------------------------------------------

PLAIN = ["sdpa_dkv_plain", "sdpa_dkv_causal_rect", "sdpa_dkv_mask_bias"]


def _attention(query, key, value, *, is_causal=False):
    """A plain NumPy attention taking only is_causal (top-left aligned)."""
    scores = query @ np.swapaxes(key, -1, -2) / np.sqrt(query.shape[-1])  # (..., Lq, Lk)
    if is_causal:
        lq, lk = scores.shape[-2:]
        scores = np.where(np.tri(lq, lk, dtype=bool), scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True) @ value


def _statuses_and_reasons(fn, **options):
    report = check.run(PLAIN, impls=[from_function(fn, "numpy", **options)], dtypes=["float64"])
    return {r["fixture"]: (r["status"], r["reason"]) for r in report["rows"]}


def test_a_kwargs_wrapper_turns_an_unexpected_keyword_into_not_supported():
    def wrapper(query, key, value, **kwargs):  # no functools.wraps: any keyword looks taken
        return _attention(query, key, value, **kwargs)

    rows = _statuses_and_reasons(wrapper, name="wrapper")
    assert rows["sdpa_dkv_plain"][0] == rows["sdpa_dkv_causal_rect"][0] == "pass"
    status, reason = rows["sdpa_dkv_mask_bias"]
    assert status == "not supported"
    assert reason.startswith("wrapper does not take ") and "(TypeError: " in reason
    assert reason.split()[4] in ("mask", "bias")  # the first keyword the call refused


def test_functools_wraps_is_followed():
    @functools.wraps(_attention)
    def wrapper(*args, **kwargs):
        return _attention(*args, **kwargs)

    rows = _statuses_and_reasons(wrapper)
    assert rows["sdpa_dkv_mask_bias"] == ("not supported", "_attention does not take bias, mask")
    assert rows["sdpa_dkv_causal_rect"][0] == "pass"


def test_explicit_keywords_decide():
    def ignores_extra(query, key, value, is_causal=False, **unused):  # would run, wrongly
        return _attention(query, key, value, is_causal=is_causal)

    rows = _statuses_and_reasons(ignores_extra, keywords=["is_causal"], name="fn")
    assert rows["sdpa_dkv_mask_bias"] == ("not supported", "fn does not take bias, mask")
    assert rows["sdpa_dkv_causal_rect"][0] == "pass"
    assert _statuses_and_reasons(ignores_extra)["sdpa_dkv_mask_bias"][0] == "fail"


def test_another_type_error_stays_an_error():
    def broken(query, key, value, **kwargs):
        raise TypeError("unexpected keyword argument 'weights_dtype'")  # not one we passed

    rows = _statuses_and_reasons(broken)
    assert {s for s, _ in rows.values()} == {"error"}


@pytest.mark.parametrize("keywords", ["is_causal", [1], ["is causal"]])
def test_bad_keywords_are_refused(keywords):
    with pytest.raises(ValueError, match=r"keywords should be an iterable of keyword names"):
        from_function(_attention, "numpy", keywords=keywords)


def test_dtypes_limits_the_rows_run():
    report = check.run(["sdpa_dkv_plain"], impls=[
        from_function(_attention, "numpy", name="fn", dtypes=["float64"])])
    rows = {r["dtype"]: (r["status"], r["reason"]) for r in report["rows"]}
    assert rows == {"float64": ("pass", None),
                    "float32": ("not supported", "fn runs float64 (numpy), not float32")}


@pytest.mark.parametrize("fn", [recipes.jax_nn, recipes.flax_nnx])
def test_jax_recipes_ask_for_highest_precision_in_float32(fn):
    """Every product of the forward and backward pass says HIGHEST: the default float32 matmul
    is TF32 on NVIDIA GPUs and one bfloat16 pass on TPUs, and neither API takes precision."""
    import jax
    import jax.numpy as jnp

    q, k, v = (jnp.ones(s, jnp.float32) for s in ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 4)))
    loss = jax.grad(lambda q, k, v: fn(q, k, v, scale=0.5).sum(), argnums=(0, 1, 2))
    text = str(jax.make_jaxpr(loss)(q, k, v))
    dots = text.count("dot_general[")
    assert dots >= 4 and text.count("precision=(Precision.HIGHEST, Precision.HIGHEST)") == dots


@pytest.mark.parametrize("fn", [recipes.jax_nn, recipes.flax_nnx])
def test_jax_recipes_take_unbatched_two_dimensional_inputs(fn):
    """(Lq, D) arrays, which no fixture of the recipes has, give what (1, Lq, D) gives."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((5, 4), (7, 4), (7, 4)))
    mask = jnp.asarray(rng.random((5, 7)) < 0.8) | jnp.eye(5, 7, dtype=bool)
    out = fn(q, k, v, mask=mask, scale=0.7)
    assert out.shape == (5, 4)
    np.testing.assert_array_equal(out, fn(q[None], k[None], v[None], mask=mask, scale=0.7)[0])


@pytest.mark.parametrize("framework, fn", [("torch", recipes.torch_sdpa), ("jax", recipes.jax_nn)])
def test_an_unexpected_keyword_is_not_supported_in_torch_and_under_jit(framework, fn):
    def wrapper(query, key, value, **kwargs):
        return fn(query, key, value, **kwargs)

    report = check.run(["sdpa_dkv_softcap", "sdpa_dkv_plain"], dtypes=["float32"],
                       impls=[from_function(wrapper, framework, name="w")])
    rows = {r["fixture"]: (r["status"], r["reason"]) for r in report["rows"]}
    assert rows["sdpa_dkv_plain"] == ("pass", None)
    assert rows["sdpa_dkv_softcap"] == (
        "not supported", f"w does not take softcap (TypeError: {fn.__name__}() got an "
        "unexpected keyword argument 'softcap')")


def test_a_builtin_without_signature_runs_what_it_takes():
    """torch's F.scaled_dot_product_attention has no Python signature: it is called without
    return_weights, and a keyword it refuses (our bias) makes the row not supported."""
    import torch.nn.functional as F

    report = check.run(["sdpa_dkv_plain", "sdpa_dkv_causal_rect", "sdpa_dkv_mask_bias"],
                       impls=[from_function(F.scaled_dot_product_attention, "torch", name="F")],
                       dtypes=["float32"])
    rows = {r["fixture"]: (r["status"], r["reason"]) for r in report["rows"]}
    assert rows["sdpa_dkv_plain"] == rows["sdpa_dkv_causal_rect"] == ("pass", None)
    assert rows["sdpa_dkv_mask_bias"][0] == "not supported"
    assert rows["sdpa_dkv_mask_bias"][1].startswith("F does not take bias (TypeError: ")
