"""``golden.compare`` on Hugging Face modules as they are (golden/examples/hf_ports.py): keyword
inputs, output selection, low-precision runs, and what a port fixture keeps of them.

Shape legend: B batch, L tokens, D model width (golden/examples/hf_ports.py: D = 16, N = 4
heads, Nkv = 2, Dh = 6 for Qwen3).
"""

from __future__ import annotations

import argparse
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from torch import nn

import golden
from golden import compare as C
from golden.runners.frameworks import JAX
from golden.examples import hf_ports as H
from golden.examples import port_pair as P
from tests.test_compare import _rewrite

B, L = 2, 7
X = {"hidden_states": (B, L, H.D)}  # Qwen3
X_GPT2 = {"hidden_states": (B, L, H.GPT2_D)}


def gpt2(bug=None, dtype="float32", inputs=X_GPT2, **kw):
    return C.compare(H.make_gpt2_block, lambda: H.make_flax_gpt2_block(bug), H.GPT2_MAPPING,
                     inputs, keywords={"attention_mask": H.causal_mask(L)}, dtype=dtype, **kw)


def qwen3(bug=None, dtype="float32", keywords=None, **kw):
    keywords = keywords or {"position_embeddings": H.qwen3_position_embeddings(L),
                            "attention_mask": H.causal_mask(L)}
    return C.compare(H.make_qwen3_attention, lambda: H.make_flax_qwen3_attention(bug),
                     H.QWEN3_MAPPING, X, keywords=keywords, dtype=dtype, **kw)


def _ok(report):
    return {r["what"]: r["ok"] for r in report.rows}


# ---------------------------------------------------------------- what the HF models hand a layer


def _layer_call(model, module, ids):
    """(args, kwargs) of ``module``'s call inside ``model(ids)``."""
    seen = {}
    handle = module.register_forward_pre_hook(
        lambda m, a, k: seen.update(args=a, kwargs=k), with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return seen["args"], seen["kwargs"]


def test_the_keywords_are_what_the_hf_models_hand_their_layers():
    """causal_mask and qwen3_position_embeddings equal what GPT2Model and Qwen3Model build and
    pass to layer 0 (float32 models, a batch without padding)."""
    ids = torch.arange(L)[None].expand(B, L)
    model = transformers.GPT2Model(H.gpt2_config()).eval()
    args, _ = _layer_call(model, model.h[0], ids)
    mask = args[2]  # GPT2Model passes (hidden_states, past_key_values, causal_mask, ...)
    np.testing.assert_array_equal(mask.numpy(), np.broadcast_to(H.causal_mask(L), (B, 1, L, L)))
    model = transformers.Qwen3Model(H.qwen3_config()).eval()
    _, kwargs = _layer_call(model, model.layers[0].self_attn, ids)
    np.testing.assert_array_equal(kwargs["attention_mask"].numpy(),
                                  np.broadcast_to(H.causal_mask(L), (B, 1, L, L)))
    for got, ours in zip(kwargs["position_embeddings"], H.qwen3_position_embeddings(L)):
        np.testing.assert_array_equal(got.numpy(), ours)


# ---------------------------------------------------------------- GPT-2


def test_gpt2_block_as_it_is_passes_with_the_causal_mask_as_a_keyword():
    report = gpt2()
    print(report.text())
    assert report.ok and report.first_divergent is None
    assert [r["what"] for r in report.rows if r["what"].startswith("grad input")] == [
        "grad input hidden_states"]  # the mask is not differentiated
    # the mask reached HF's block: without it the float64 output differs (not causal)
    unmasked = C.compare(H.make_gpt2_block, H.make_flax_gpt2_block, H.GPT2_MAPPING, X_GPT2)
    assert unmasked.ok
    a, b = report.data["expected"]["output"], unmasked.data["expected"]["output"]
    np.testing.assert_array_equal(a[:, -1], b[:, -1])  # the last token sees every key anyway
    assert np.abs(a[:, 0] - b[:, 0]).max() > 0.1


@pytest.mark.parametrize("bug, first", [("mask_ignored", "attn.c_proj ~ attn.c_proj"),
                                        ("key_value_swapped", "attn.c_proj ~ attn.c_proj")])
def test_gpt2_planted_bugs_fail(bug, first):
    report = gpt2(bug)
    print(report.text())
    assert not report.ok and report.first_divergent == first
    ok = _ok(report)
    assert ok["submodule ln_1 ~ ln_1"] and ok["submodule attn.c_attn ~ attn.c_attn"]
    assert "attn.c_attn.weight" in report.failing_params


# ---------------------------------------------------------------- Qwen3


def test_qwen3_attention_as_it_is_passes_with_position_embeddings_and_mask():
    report = qwen3()
    print(report.text())
    assert report.ok and report.first_divergent is None
    assert [r["what"] for r in report.rows if r["what"].startswith("submodule")] == [
        "submodule q_proj ~ q_proj", "submodule q_norm ~ q_norm", "submodule k_proj ~ k_proj",
        "submodule k_norm ~ k_norm", "submodule v_proj ~ v_proj", "submodule o_proj ~ o_proj"]
    # judged on the first array of HF's (output, weights): (B, L, D)
    assert report.data["expected"]["output"].shape == (B, L, H.D)


@pytest.mark.parametrize("bug", ["rope_interleaved", "norm_after_rope"])
def test_qwen3_planted_bugs_fail(bug):
    report = qwen3(bug)
    print(report.text())
    assert not report.ok
    ok = _ok(report)
    assert ok["submodule q_proj ~ q_proj"] and ok["submodule v_proj ~ v_proj"]
    assert ok["submodule k_norm ~ k_norm"] == (bug == "rope_interleaved")  # before RoPE
    assert not ok["submodule o_proj ~ o_proj"]
    assert {"q_proj.weight", "k_proj.weight"} <= set(report.failing_params)


def test_qwen3_selected_output_by_index_and_a_missing_name():
    weights = qwen3(output=1)  # HF's attention weights (B, N, L, L), softmax in float32
    assert weights.ok and weights.data["expected"]["output"].shape == (B, H.N, L, L)
    rows = weights.data["expected"]["output"].sum(-1)
    np.testing.assert_allclose(rows, 1.0, rtol=1e-6)  # each row of weights sums to one
    with pytest.raises(ValueError, match=r"^output: the torch module's output \(tuple\) has no "
                       r"'logits'; it has no names$"):
        qwen3(output="logits")
    with pytest.raises(ValueError, match=r"^output: index 2 is out of range for the torch "
                       r"module's output \(tuple of 2 items\)$"):
        qwen3(output=2)


def test_factories_are_called_once_per_run_with_framework_and_dtype():
    calls = []

    def cache(framework, dtype):
        calls.append((framework, dtype))
        return transformers.DynamicCache(config=H.qwen3_config()) if framework == "torch" else None

    keywords = {"position_embeddings": H.qwen3_position_embeddings(L),
                "attention_mask": H.causal_mask(L), "past_key_values": cache}
    torch_sides = []
    report = C.compare(
        H.make_qwen3_attention, _flax_taking("past_key_values"), H.QWEN3_MAPPING, X,
        keywords={**keywords, "past_key_values": cache})
    assert report.ok, report.text()
    # then the two float64 runs that find and undo HF's float32 steps (report.reference)
    assert report.reference["float32_steps"]
    assert calls == [("torch", "float64"), ("torch", "float32"), ("flax", "float32"),
                     ("torch", "float64"), ("torch", "float64")]
    # per_framework: a callable of the dtype for torch (a fresh empty cache each run), None
    made = C.per_framework(torch=lambda dtype: torch_sides.append(dtype) or
                           transformers.DynamicCache(config=H.qwen3_config()))
    report = C.compare(H.make_qwen3_attention, _flax_taking("past_key_values"),
                       H.QWEN3_MAPPING, X, keywords={**keywords, "past_key_values": made},
                       dtype="bfloat16")
    assert report.ok and torch_sides == ["float64", "bfloat16", "float64", "float64"]
    assert made("flax", "float32") is None


def _flax_taking(name):
    """The Qwen3 port, taking (and ignoring) one more keyword."""
    class Port(H.FlaxQwen3Attention):
        def __call__(self, hidden_states, position_embeddings, attention_mask=None, **kw):
            assert set(kw) == {name} and kw[name] is None
            return super().__call__(hidden_states, position_embeddings, attention_mask)

    return lambda: Port(nnx.Rngs(0))


def test_keyword_gradients_only_when_listed():
    keywords = {"position_embeddings": H.qwen3_position_embeddings(L),
                "attention_mask": (1, 1, L, L)}  # an additive bias, drawn N(0, 1)
    report = qwen3(keywords=keywords, keyword_grads=["attention_mask"])
    assert report.ok, report.text()
    assert [r["what"] for r in report.rows if r["what"].startswith("grad input")] == [
        "grad input hidden_states", "grad input attention_mask"]
    g = report.data["expected"]["grads"]["input.attention_mask"]
    assert g.shape == (1, 1, L, L) and np.abs(g).max() > 0
    # the softmax of each row ignores a constant: the bias's gradient sums to zero per row,
    # to float32 rounding here (HF's eager softmax is float32 even in the float64 run)
    assert np.abs(g.sum(-1)).max() < 1e-5 * np.abs(g).sum(-1).max()
    with pytest.raises(ValueError, match=r"keyword_grads should name keywords whose value is a "
                       r"float array or a shape, got \['position_embeddings'\]"):
        qwen3(keywords=keywords, keyword_grads=["position_embeddings"])


# ---------------------------------------------------------------- low precision


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_faithful_ports_pass_at_low_precision(dtype):
    for report in (gpt2(dtype=dtype), qwen3(dtype=dtype)):
        print(report.text())
        assert report.ok and report.text().splitlines()[0].endswith(f"flax {dtype}")
        assert report.data["dtype"] == dtype and report.to_json()["dtype"] == dtype
        # the baseline ran at that dtype: its error is that dtype's, far above float32's
        out = report.rows[0]
        assert out["torch_float32"]["rel_norm"] > 1e-4 and out["flax_float32"]["rel_norm"] > 1e-4


def test_a_low_precision_bug_passes_float32_and_fails_bfloat16_and_float16():
    """LayerNorm's variance as E[x²] − E[x]² in the run's dtype cancels when the mean (4)
    is large against the spread (1): within float32's bounds, not within bfloat16's or
    float16's, and ln_1 is named."""
    x = {"hidden_states": np.random.default_rng(5).standard_normal((B, L, H.GPT2_D)) + 4}
    assert gpt2("one_pass_variance", inputs=x).ok
    for dtype in ("bfloat16", "float16"):
        assert gpt2(None, dtype, inputs=x).ok
        report = gpt2("one_pass_variance", dtype, inputs=x)
        print(report.text())
        assert not report.ok and report.first_divergent == "ln_1 ~ ln_1"


def test_a_torch_module_that_cannot_run_in_float16_is_named():
    """golden/examples/port_pair.py fills masked scores with -1e30, which float16 cannot hold."""
    with pytest.raises(ValueError, match=r"^inputs: the torch module failed on inputs "
                       r"\{'x': \(2, 5, 8\)\}: RuntimeError: value cannot be converted to type "
                       r"c10::Half without overflow"):
        C.compare(P.make_torch, P.make_flax, P.MAPPING, {"x": (2, 5, 8)}, dtype="float16")


def test_low_precision_weights_and_inputs_are_on_the_dtype_grid():
    report = qwen3(dtype="bfloat16")
    for a in (*report.data["weights"].values(), report.data["inputs"]["hidden_states"],
              *report.data["keywords"]["position_embeddings"]):
        np.testing.assert_array_equal(a, a.astype(jnp.bfloat16).astype(np.float64))


def test_bad_dtype_and_keywords_are_named():
    with pytest.raises(ValueError, match=r"^dtype should be one of float32, bfloat16, float16, "
                       r"got 'float64'$"):
        gpt2(dtype="float64")
    with pytest.raises(ValueError, match=r"keywords: \['hidden_states'\] are also positional "
                       r"inputs"):
        C.compare(H.make_gpt2_block, H.make_flax_gpt2_block, H.GPT2_MAPPING, X_GPT2,
                  keywords={"hidden_states": (B, L, H.GPT2_D)})
    with pytest.raises(ValueError, match=r"keywords\['attention_mask'\]\[1\] should be a shape, "
                       r"a NumPy array, .* got object"):
        C.compare(H.make_gpt2_block, H.make_flax_gpt2_block, H.GPT2_MAPPING, X_GPT2,
                  keywords={"attention_mask": (H.causal_mask(L), object())})


# ---------------------------------------------------------------- structured outputs


class TorchInner(nn.Linear):
    """nn.Linear returning a dict: a paired submodule whose output is not an array."""

    def forward(self, x):  # a submodule's dict is read at its smallest key, "a"
        return {"z": x.sum(), "a": super().forward(x)}


class TorchNamed(nn.Module):
    """Its submodule's output a dict, its own a ModelOutput."""

    def __init__(self):
        super().__init__()
        self.inner = TorchInner(8, 6)

    def forward(self, x):
        h = self.inner(x)["a"]
        return transformers.modeling_outputs.BaseModelOutput(last_hidden_state=torch.tanh(h),
                                                             hidden_states=(h,))


class FlaxInner(nnx.Linear):
    def __call__(self, x):
        return {"z": x.sum(), "a": super().__call__(x)}


class FlaxNamed(nnx.Module):
    def __init__(self, rngs):
        self.inner = FlaxInner(8, 6, precision=P.HIGHEST, rngs=rngs)

    def __call__(self, x):
        h = self.inner(x)["a"]
        return {"last_hidden_state": jnp.tanh(h), "hidden_states": (h,)}


NAMED = {"inner.weight": ("inner.kernel", "T"), "inner.bias": "inner.bias"}


@pytest.mark.parametrize("output", [None, "last_hidden_state", 0,
                                    lambda out: out["hidden_states"][0]])
def test_dict_and_model_output_selected_alike(output):
    report = C.compare(TorchNamed, lambda: FlaxNamed(nnx.Rngs(0)), NAMED, {"x": (3, 8)},
                       output=output)
    assert report.ok, report.text()
    e = report.data["expected"]["output"]
    h = report.data["expected"]["submodules"]["inner"]  # the dict's "a", no crash
    np.testing.assert_allclose(e, h if callable(output) else np.tanh(h), rtol=1e-15)
    assert report.rows[-1]["what"] == "submodule inner ~ inner" and report.rows[-1]["ok"]


def test_absent_name_lists_what_exists():
    with pytest.raises(ValueError, match=r"^output: the torch module's output "
                       r"\(BaseModelOutput\) has no 'logits'; it has \['last_hidden_state', "
                       r"'hidden_states'\]$"):
        C.compare(TorchNamed, lambda: FlaxNamed(nnx.Rngs(0)), NAMED, {"x": (3, 8)},
                  output="logits")
    with pytest.raises(ValueError, match=r"^output: what 'hidden_states' selects from the "
                       r"torch module's output is a tuple, not an array$"):
        C.compare(TorchNamed, lambda: FlaxNamed(nnx.Rngs(0)), NAMED, {"x": (3, 8)},
                  output="hidden_states")


# ---------------------------------------------------------------- integers into JAX


def test_int64_goes_to_jax_as_int32_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = JAX.array(np.arange(5, dtype=np.int64))
        assert a.dtype == jnp.int32 and a.tolist() == [0, 1, 2, 3, 4]
        report = C.compare(P.make_torch, P.make_flax, P.MAPPING,
                           {"x": (2, 5, 8), "mask": np.ones((2, 5), dtype=bool)},
                           keywords=None)
        assert report.ok
    with JAX.float64():
        assert JAX.array(np.arange(3, dtype=np.int64)).dtype == jnp.int64
    with pytest.raises(ValueError, match=r"a int64 array with values in \[0, 4294967296\] does "
                       r"not fit int32, which JAX uses without x64"):
        JAX.array(np.array([0, 2**32]))


def test_integer_keyword_reaches_both_modules():
    """An int64 keyword (positions) is passed to torch as int64 and to JAX as int32."""
    seen = {}

    class TorchPos(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x, *, shift):
            seen["torch"] = shift.dtype
            return self.proj(x) * (1 + shift[:, None])

    class FlaxPos(nnx.Module):
        def __init__(self):
            self.proj = nnx.Linear(8, 8, precision=P.HIGHEST, rngs=nnx.Rngs(0))

        def __call__(self, x, *, shift):
            seen["flax"] = shift.dtype
            return self.proj(x) * (1 + shift[:, None])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = C.compare(TorchPos, FlaxPos, {"proj.weight": ("proj.kernel", "T"),
                                               "proj.bias": "proj.bias"}, {"x": (5, 8)},
                           keywords={"shift": np.arange(5, dtype=np.int64)})
    assert report.ok and seen == {"torch": torch.int64, "flax": jnp.int32}


# ---------------------------------------------------------------- port fixtures


@pytest.fixture(scope="module")
def frozen_qwen3(tmp_path_factory):
    report = qwen3(dtype="bfloat16", output=0)
    path = tmp_path_factory.mktemp("hf") / "qwen3.npz"
    C.freeze(report, path, torch_factory_spec="golden.examples.hf_ports:make_qwen3_attention",
             flax_factory_spec="golden.examples.hf_ports:make_flax_qwen3_attention")
    return report, path


def test_frozen_keywords_dtype_and_output_round_trip(frozen_qwen3):
    report, path = frozen_qwen3
    port = C.load_port(path)
    meta = port["meta"]
    assert (meta["format_version"], meta["dtype"], meta["output"]) == (3, "bfloat16", 0)
    assert meta["keywords"]["position_embeddings"] == {"tuple": [
        {"array": "keywords/position_embeddings/0"}, {"array": "keywords/position_embeddings/1"}]}
    cos, sin = port["keywords"]["position_embeddings"]
    np.testing.assert_array_equal(cos, report.data["keywords"]["position_embeddings"][0])
    again = C.check_port(path)
    assert again.ok and again.data["dtype"] == "bfloat16"
    assert [r["flax_float32"] for r in again.rows] == [r["flax_float32"] for r in report.rows]
    assert not C.check_port(path, flax_factory=lambda: H.make_flax_qwen3_attention(
        "rope_interleaved"), torch_factory=False).ok
    assert C.freeze(again, path.with_name("again.npz")).read_bytes() == path.read_bytes()


def test_freeze_refuses_factories_and_callable_outputs(tmp_path):
    report = C.compare(P.make_torch, P.make_flax, P.MAPPING, {"x": (2, 5, 8)},
                       keywords={"mask": C.per_framework(torch=None, flax=None)})
    with pytest.raises(ValueError, match=r"^freeze: keywords\['mask'\] holds a factory "
                       r"\(per_framework\(torch=None, flax=None\)\), which a port fixture "
                       r"cannot hold"):
        C.freeze(report, tmp_path / "f.npz")
    report = C.compare(P.make_torch, P.make_flax, P.MAPPING, {"x": (2, 5, 8)},
                       output=lambda out: out)
    with pytest.raises(ValueError, match=r"^freeze: output is a callable"):
        C.freeze(report, tmp_path / "g.npz")
    assert not (tmp_path / "f.npz").exists() and not (tmp_path / "g.npz").exists()


def test_versions_1_and_2_still_read_and_unknown_versions_are_refused(tmp_path):
    report = C.compare(P.make_torch, P.make_flax, P.MAPPING, {"x": (2, 5, 8)})
    path = C.freeze(report, tmp_path / "v3.npz",
                    flax_factory_spec="golden.examples.port_pair:make_flax")

    def as_version(version):  # what formats 1 and 2 wrote: no dtype, keywords, output
        def change(meta, members):
            for key in ("dtype", "keywords", "keyword_grads", "output"):
                del meta[key]
            if version == 1:  # nor submodule inputs
                del meta["submodule_inputs"]
                for k in [k for k in members if k.startswith("submodule_inputs/")]:
                    del members[k]
            meta["format_version"] = version
        return change

    for version in (1, 2):
        old = C.load_port(_rewrite(path, tmp_path / f"v{version}.npz", as_version(version)))
        assert (old["meta"]["dtype"], old["keywords"], old["meta"]["output"]) == (
            "float32", {}, None)
        again = C.check_port(tmp_path / f"v{version}.npz")
        assert again.ok and again.data["dtype"] == "float32"
    future = _rewrite(path, tmp_path / "v4.npz", lambda m, a: m.update(format_version=4))
    with pytest.raises(golden.FixtureError, match=r"v4.npz: meta.format_version should be one "
                       r"of \[1, 2, 3\] \(this attn-parity reads those\), got 4"):
        C.load_port(future)
    bad = _rewrite(path, tmp_path / "dt.npz", lambda m, a: m.update(dtype="float64"))
    with pytest.raises(golden.FixtureError, match=r"meta.dtype should be one of float32, "
                       r"bfloat16, float16, got 'float64'"):
        C.load_port(bad)
    missing = _rewrite(path, tmp_path / "kw.npz", lambda m, a: m.update(
        keywords={"mask": {"array": "keywords/mask"}}))
    with pytest.raises(golden.FixtureError, match=r"missing \['keywords/mask'\]"):
        C.load_port(missing)


# ---------------------------------------------------------------- command line


def _cli(*argv):
    parser = argparse.ArgumentParser(prog="attn-parity compare")
    C.add_arguments(parser)
    lines = []
    return C.run_cli(parser.parse_args(argv), log=lines.append), "\n".join(lines)


PAIR = ("--torch", "golden.examples.port_pair:make_torch",
        "--flax", "golden.examples.port_pair:make_flax",
        "--mapping", "golden.examples.port_pair:MAPPING", "--input", "x=2,5,8")


def test_cli_dtype_and_output(tmp_path):
    fixture = tmp_path / "bf16.npz"
    code, out = _cli(*PAIR, "--dtype", "bfloat16", "--freeze", str(fixture))
    assert code == 0, out
    assert "torch bfloat16" in out.splitlines()[0]
    assert C.load_port(fixture)["meta"]["dtype"] == "bfloat16"
    code, out = _cli("--fixture", str(fixture))
    assert code == 0 and "flax bfloat16" in out.splitlines()[0]
    code, out = _cli("--fixture", str(fixture), "--dtype", "float16")
    assert code == 2 and out == ("attn-parity compare: error: --dtype: a port fixture records "
                                 "its own; leave them out with --fixture")
    code, out = _cli(*PAIR, "--output", "logits")
    assert code == 2 and "output: the torch module's output (Tensor) has no 'logits'" in out
    code, out = _cli(*PAIR, "--output", "0")
    assert code == 2 and out.endswith("output: index 0 given, but the torch module's output is "
                                      "a Tensor, not a tuple, list, dict or dataclass")


HF_PORTS = "golden.examples.hf_ports"
GPT2_CLI = ("--torch", f"{HF_PORTS}:make_gpt2_block", "--flax", f"{HF_PORTS}:make_flax_gpt2_block",
            "--mapping", f"{HF_PORTS}:GPT2_MAPPING", "--input", f"hidden_states={B},{L},{H.GPT2_D}")


def test_cli_keywords_reach_both_modules():
    """``--keywords`` names a dict of keyword inputs: GPT-2's block passes with its causal mask
    and fails without it (the Flax port applies the mask it is given; HF's eager block is not
    causal without one, and the port's planted ``mask_ignored`` shows what the mask changes)."""
    code, out = _cli(*GPT2_CLI, "--keywords", f"{HF_PORTS}:GPT2_KEYWORDS")
    assert code == 0, out
    code, out = _cli(*GPT2_CLI[:2], "--flax", f"{HF_PORTS}:make_flax_gpt2_block_mask_ignored",
                     *GPT2_CLI[4:], "--keywords", f"{HF_PORTS}:GPT2_KEYWORDS")
    assert code == 1 and out.splitlines()[-1].startswith("FAIL: output"), out
    code, out = _cli(*GPT2_CLI, "--keywords", f"{HF_PORTS}:GPT2_KEYWORDS",
                     "--keyword-grad", "nothing")
    assert code == 2 and out.startswith("attn-parity compare: error: keyword_grads should name "
                                        "keywords"), out
    code, out = _cli(*GPT2_CLI, "--keywords", f"{HF_PORTS}:GPT2_D")
    assert code == 2 and out == ("attn-parity compare: error: --keywords "
                                 f"'{HF_PORTS}:GPT2_D' should name a dict {{name: value}}, "
                                 "got int")
