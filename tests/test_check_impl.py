"""Any implementation through the golden suite: the runner helpers (golden.runners.adapt),
``attn-parity check --impl``, "not supported" rows, tolerance profiles and the report files.

Shape legend: B batch, H heads, Lq query length, Lk key length, Dk key width, Dv value width.
"""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest

import jax_attn
import torch_attn
from golden.harness import check
from golden.specification import variants
from golden.cli import main
from golden.runners.adapt import NotSupported, combine, from_function, from_module, load

# Core fixtures that between them set every keyword of the core, and one at all four dtypes.
CORE_FIXTURES = ["sdpa_window_causal_offset", "sdpa_lengths", "sdpa_dropout_causal_bias",
                 "sdpa_gqa_causal_offset", "sdpa_softcap_masked_row", "sdpa_bias_2d_masked_rows",
                 "sdpa_low_precision_gqa_softcap"]
MODULE_FIXTURES = ["multi_head_attention_dropout", "gqa_window_softcap_lengths_mask",
                   "cross_attention_kv", "self_attention_batched_bias_mask",
                   "multi_head_attention_wrapper_one_head"]


def _statuses(report):
    return {(r["fixture"], r["implementation"], r["dtype"]): r["status"] for r in report["rows"]}


# ---- from_function ----------------------------------------------------------------------------

def test_our_cores_pass_through_from_function_with_gradients():
    impls = [from_function(torch_attn.scaled_dot_product_attention, "torch", name="torch-fn"),
             from_function(jax_attn.scaled_dot_product_attention, "jax", name="jax-fn")]
    report = check.run(CORE_FIXTURES, impls=impls)
    assert report["rows"] and all(r["status"] == "pass" for r in report["rows"]), [
        (r["fixture"], r["implementation"], r["dtype"], r["reason"]) for r in report["rows"]
        if r["status"] != "pass"]
    assert report["implementations"] == ["torch-fn", "jax-fn"]  # --impl alone: no twins
    for row in report["rows"]:  # the output, the weights and every gradient were compared
        names = {a["name"] for a in row["arrays"]}
        assert {"output", "weights", "grad query", "grad key", "grad value"} <= names
    assert {r["dtype"] for r in report["rows"]} == {"float32", "float64", "bfloat16", "float16"}


def test_a_function_without_weights_is_checked_on_its_output_and_its_gradients():
    def no_weights(query, key, value, *, mask=None, bias=None, is_causal=False, scale=None):
        return jax_attn.scaled_dot_product_attention(query, key, value, mask, bias,
                                                     is_causal=is_causal, scale=scale)

    runner = from_function(no_weights, "jax")
    report = check.run(["sdpa_mask_bias", "sdpa_causal_tall"], impls=[runner])
    for row in report["rows"]:
        assert row["status"] == "pass", row
        assert [a["name"] for a in row["arrays"]][:2] == ["output", "grad query"]
    fixture = __import__("golden").load("sdpa_mask_bias")
    result = runner(fixture, "float64")
    assert result["loss"] == "output" and "weights" not in result
    # The gradients are those of Σ O ⊙ dO alone: the fixture's (with Σ A ⊙ dA) differ.
    assert not np.allclose(result["grads"]["query"], fixture.grads["query"])


def test_a_missing_gradient_fails_and_is_named():
    def detached_key(query, key, value, *, mask=None, return_weights=False):
        return torch_attn.scaled_dot_product_attention(query, key.detach(), value, mask,
                                                       return_weights=return_weights)

    report = check.run(["sdpa_mask"], impls=[from_function(detached_key, "torch")],
                       dtypes=["float64"])
    [row] = report["rows"]
    assert row["status"] == "fail" and row["reason"] == "grad key"
    assert [a for a in row["arrays"] if a["name"] == "grad key"][0]["missing"]


def test_what_a_function_cannot_run_is_not_supported_with_the_reason():
    def plain(query, key, value, *, mask=None, is_causal=False, return_weights=False):
        return torch_attn.scaled_dot_product_attention(query, key, value, mask,
                                                       is_causal=is_causal,
                                                       return_weights=return_weights)

    report = check.run(["sdpa_window_softcap_mask", "multi_head_attention_causal", "sdpa_mask"],
                       impls=[from_function(plain, "torch", name="plain")])
    reasons = {r["fixture"]: r["reason"] for r in report["rows"]
               if r["status"] == "not supported"}
    assert reasons == {
        "sdpa_window_softcap_mask": "plain does not take local_window_size, scale, softcap",
        "multi_head_attention_causal": "plain is a function of the core's signature; "
                                       "multi_head_attention is a module"}
    assert report["summary"]["not_supported"] == 4 and report["summary"]["passed"] == 2
    assert report["summary"]["ok"]


def test_numpy_runs_float32_and_float64_only():
    numpy_fn = from_function(lambda query, key, value: query, "numpy", name="np")
    fixture = __import__("golden").load("sdpa_low_precision")
    with pytest.raises(NotSupported, match="np runs float32, float64 .numpy., not bfloat16"):
        numpy_fn(fixture, "bfloat16")
    with pytest.raises(ValueError, match="dtypes should be drawn from float32, float64 for "
                                         "numpy, got bfloat16"):
        from_function(lambda q, k, v: q, "numpy", dtypes=["bfloat16"])
    with pytest.raises(ValueError, match="framework should be one of numpy, torch, jax, got "
                                         "'tf'"):
        from_function(lambda q, k, v: q, "tf")


# ---- from_module ------------------------------------------------------------------------------

def _neutral_zeros(variant, config):
    shapes = variants.get(variant).param_shapes(config)
    return {n: np.zeros(s, np.float32) for n, s in shapes.items()}


def _mapping(layout):
    """Neutral names -> our modules' layers: torch's nn.Linear (out, in), so "T"; Flax's
    nnx.Linear kernels are (in, out) already."""
    weight, rule = ("weight", "T") if layout == "torch" else ("kernel", "")

    def table(variant, config):
        roles = variants.get(variant).layers
        out = {f"W_{r}": (f"{p}.{weight}", rule) for r, p in roles.items()}
        return {**out, **{f"b_{r}": f"{p}.bias" for r, p in roles.items()}}
    return table


def _factory(build):
    def factory(variant, config):
        if "*" in "".join(variants.get(variant).layers.values()):
            return None  # per-head layers: not a one-to-one table
        return build(variant, config, _neutral_zeros(variant, config))
    return factory


@pytest.mark.parametrize("framework,build", [("torch", torch_attn.build),
                                             ("jax", jax_attn.build)])
def test_our_modules_pass_through_from_module_with_every_gradient(framework, build):
    runner = from_module(_factory(build), framework, mapping=_mapping(framework), name="mod")
    report = check.run(MODULE_FIXTURES, impls=[runner], dtypes=["float32", "float64"])
    by_status = {}
    for row in report["rows"]:
        by_status.setdefault(row["status"], []).append(row["fixture"])
    assert set(by_status) == {"pass", "not supported"}, report["rows"]
    assert set(by_status["not supported"]) == {"multi_head_attention_wrapper_one_head"}
    for row in report["rows"]:
        if row["status"] == "pass":
            fixture = __import__("golden").load(row["fixture"])
            names = {a["name"] for a in row["arrays"]}
            assert {f"grad {n}" for n in fixture.params} <= names


def test_a_mapping_that_does_not_fit_is_an_error_naming_both_sides():
    def wrong(variant, config):
        return {**_mapping("torch")(variant, config), "W_query": ("W_query.weight", "")}

    runner = from_module(_factory(torch_attn.build), "torch", mapping=wrong)
    report = check.run(["multi_head_attention_causal", "self_attention_unbatched"],
                       impls=[runner], dtypes=["float64"])
    rows = {r["fixture"]: r for r in report["rows"]}
    non_square = rows["multi_head_attention_causal"]  # W_query (5, 12): the shapes disagree
    assert non_square["status"] == "error"
    assert non_square["reason"] == ("ValueError: mapping: W_query -> W_query.weight: rule = "
                                    "gives shape (5, 12), the module's has shape (12, 5)")


def test_combine_sends_each_fixture_to_the_runner_that_takes_it():
    core = from_function(jax_attn.scaled_dot_product_attention, "jax", name="core")
    modules = from_module(_factory(jax_attn.build), "jax", mapping=_mapping("jax"), name="mods")
    both = combine(core, modules, name="both")
    report = check.run(["sdpa_plain", "cross_attention_kv"], impls=[both], dtypes=["float32"])
    assert [(r["fixture"], r["status"]) for r in report["rows"]] == [
        ("sdpa_plain", "pass"), ("cross_attention_kv", "pass")]
    # The function ran our core inside a fresh trace, which recorded its implementation (a
    # module's own compiled call records only when it is first traced: not asserted here).
    assert report["rows"][0]["core"] == "explicit"


# ---- load, the command line -------------------------------------------------------------------

@pytest.mark.parametrize("spec,message", [
    ("", "spec should be 'package.module:name', got ''"),
    ("a:b:c", "spec should be 'package.module:name', got 'a:b:c'"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ("golden.harness.check:no_such_name", "golden.harness.check has no attribute 'no_such_name'"),
    ("golden.harness.check:FRAMEWORK_RUNS",
     "spec 'golden.harness.check:FRAMEWORK_RUNS' should name a runner "
     "\\(fixture, dtype\\) -> dict, got tuple"),
])
def test_load_rejects_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        load(spec)


def test_check_impl_takes_a_module_with_run_fixture(capsys):
    # Our own JAX runner follows the contract: "package.module" alone names its run_fixture.
    assert main(["check", "sdpa_plain", "--impl", "golden.runners.jax_runner"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("sdpa_plain")]
    assert [r[1:4] + r[-1:] for r in rows] == [
        ["golden.runners.jax_runner", "explicit", "float32", "pass"],
        ["golden.runners.jax_runner", "explicit", "float64", "pass"]]
    assert "2 passed, 0 failed" in out and "regeneration" not in out


def test_check_answers_a_bad_impl_with_one_line_and_status_2():
    done = subprocess.run([sys.executable, "-m", "golden.cli", "check", "--impl", "nope:f"],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "attn-parity check: error: spec 'nope:f': cannot import 'nope' "
        "(No module named 'nope')"]


def test_check_selects_by_variant(capsys):
    assert main(["check", "--variant", "cross_attention", "--framework", "jax",
                 "--dtype", "float32"]) == 0
    fixtures = {line.split()[0] for line in capsys.readouterr().out.splitlines()
                if line.startswith("cross_")}
    assert fixtures == {"cross_attention_kv", "cross_attention_low_precision",
                        "cross_attention_separate_values"}


def test_check_writes_json_junit_and_html_that_agree(tmp_path, capsys):
    j, x, h = tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "html"
    assert main(["check", "sdpa_plain", "sdpa_dropout", "--framework", "jax", "--json", str(j),
                 "--junit", str(x), "--html", str(h)]) == 0
    report = json.loads(j.read_text())
    assert report["schema"] == "attn-parity-check" and report["summary"]["passed"] == 4
    assert report["command"].startswith("attn-parity check sdpa_plain")
    cases = ET.parse(x).getroot().findall(".//testcase")
    assert len(cases) == 4 and {c.get("classname") for c in cases} == {"sdpa_plain",
                                                                        "sdpa_dropout"}
    assert sorted(p.name for p in (h / "fixtures").iterdir()) == ["sdpa_dropout.png",
                                                                  "sdpa_plain.png"]


# ---- profiles: tf32 and bfloat16 matmuls ------------------------------------------------------

def _round(a, bits):
    """``a`` to ``bits`` bits of precision (the implicit bit counted), nearest, ties to even:
    written apart from golden.reference.round_to_bits, with frexp/ldexp."""
    m, e = np.frexp(a.astype(np.float64))
    return np.ldexp(np.round(m * 2.0**bits) / 2.0**bits, e).astype(a.dtype)


def _matmul_sdpa(bits, scale_first=False):
    """A float32 attention whose two matmuls take operands of ``bits`` bits: what JAX's
    default precision does on GPUs (TF32, 11 bits) and TPUs (bfloat16, 8 bits). The plain
    implementation scales the scores; ``scale_first`` scales the query instead, so that the
    roundings fall elsewhere (errors up to 1.55x the plain one's, sdpa_wide_key)."""
    def sdpa(query, key, value, *, mask=None, bias=None, is_causal=False, scale=None,
             return_weights=False):
        r = (lambda a: _round(a, bits)) if bits else (lambda a: a)
        scale = np.float32(1 / np.sqrt(query.shape[-1]) if scale is None else scale)
        if scale_first:
            query, scale = query * scale, np.float32(1)
        scores = (r(query) @ np.swapaxes(r(key), -1, -2)) * scale
        if bias is not None:
            scores = scores + bias
        lq, lk = scores.shape[-2:]
        allowed = np.ones(scores.shape, bool)
        if mask is not None:
            allowed = allowed & mask
        if is_causal:
            allowed = allowed & np.tril(np.ones((lq, lk), bool))
        scores = np.where(allowed, scores, -np.inf)
        top = np.max(scores, axis=-1, keepdims=True)
        p = np.where(allowed, np.exp(scores - np.where(np.isfinite(top), top, 0)), 0)
        total = p.sum(axis=-1, keepdims=True)
        weights = np.where(total > 0, p / np.where(total > 0, total, 1), 0).astype(query.dtype)
        out = r(weights) @ r(value)
        return (out, weights) if return_weights else out
    return sdpa


PROFILE_FIXTURES = ["sdpa_plain", "sdpa_bias", "sdpa_mask", "sdpa_causal_rect", "sdpa_scale",
                    "sdpa_large_logits", "sdpa_wide_key", "sdpa_mask_bias"]


@pytest.mark.parametrize("bits,scale_first,passes", [
    (None, False, {"exact", "tf32", "bf16"}), (11, False, {"tf32", "bf16"}),
    (11, True, {"tf32", "bf16"}), (8, False, {"bf16"}), (8, True, {"bf16"})])
def test_profiles_judge_against_a_plain_implementation_of_the_same_precision(bits, scale_first,
                                                                            passes):
    runner = from_function(_matmul_sdpa(bits, scale_first), "numpy", dtypes=["float32"])
    for name in ("exact", "tf32", "bf16"):
        report = check.run(PROFILE_FIXTURES, impls=[runner], profile_name=name,
                           dtypes=["float32"])
        statuses = {r["fixture"]: r["status"] for r in report["rows"]}
        assert len(statuses) == len(PROFILE_FIXTURES)
        expected = "pass" if name in passes else "fail"
        assert set(statuses.values()) == {expected}, (bits, name, statuses)
        assert report["profile"]["k"] == (None if name == "exact" else 2.0)


def test_run_takes_a_plain_callable_and_rejects_anything_else():
    from golden.runners import jax_runner

    report = check.run(["sdpa_plain"], impls=[jax_runner.run_fixture], dtypes=["float32"])
    assert [(r["implementation"], r["status"]) for r in report["rows"]] == [
        ("run_fixture", "pass")]
    with pytest.raises(ValueError, match="implementation should be a runner \\(fixture, "
                                         "dtype\\) -> dict, got str"):
        check.run(["sdpa_plain"], impls=["golden.runners.jax_runner"])
