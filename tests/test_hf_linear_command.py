"""``attn-parity hf DIR`` on hybrid checkpoints, both kinds of layer (issue 43): tiny models of
tests/test_hf_import_linear.py's families written by transformers' ``save_pretrained`` (float32
safetensors, random weights), every layer accounted for; each linear-attention layer converted
and run by the twins ("recurrent" and "chunked"), the float64 reference and HF's own module in
its one-layer model, on inputs past a chunk of HF's chunked form with a left-padded row: the
output and dL/dx (each row's "grad x", against the reference's analytic backward), and decoding
(a prefill, then one token at a time: the twins through their RecurrentCache, HF through its
model's own cache) against the reference's full forward. A mixer a twin has no module for says
"not supported", naming the class. A wrong conversion of a linear layer (A_log scaled) passes
the twins, which use it, and fails HF's rows.

Quick tier: Qwen3-Next (one linear and one full-attention layer); the whole matrix
(``matrix``): OLMo hybrid, Qwen3.5's text model, Kimi Linear, GLM-5.3-Flash's text model (no
causal-LM class in transformers: its base model's checkpoint, as the verifier loads it with
AutoModel), Ling 3.0 (its files in Ling's own names, layers.N.attention), MiniMax.
"""

from __future__ import annotations

import json

import pytest

from golden import hf
from golden.cli import main
from golden.verifier import check as hf_check
from tests.helpers import matrix

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from tests.hf_harness import BASE  # noqa: E402
from tests.test_hf_command import _save  # noqa: E402
from tests.test_hf_import_linear import FAMILIES as LINEAR_FAMILIES  # noqa: E402

# Beyond tests/test_hf_import_linear.py's: a second linear layer (Qwen3-Next), the softmax
# layer's settings as tests/test_hf_import.py's (MiniMax's window shorter than the input,
# Qwen3.5's MRoPE sections on its rotary slice). OLMo hybrid's and Kimi Linear's softmax
# layers are not converted: named in the notes, not checked.
KW = {"qwen3_5_text": dict(rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                                           "partial_rotary_factor": 0.67,
                                           "mrope_section": [1, 1, 0]}),
      "qwen3_next": dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention",
                                                             "linear_attention"],
                         head_dim=8),
      "minimax": dict(sliding_window=4)}
QUICK = ("qwen3_next",)
NAMES = [pytest.param(n, marks=[] if n in QUICK else [matrix])
         for n in ("qwen3_next", "olmo_hybrid", "qwen3_5_text", "kimi_linear", "glm5_next_text",
                   "bailing_hybrid", "minimax")]
# transformers has no causal-LM class for GLM-5.3-Flash's text model: its base model is saved
BASE_MODEL_ONLY = ("glm5_next_text",)


def _checkpoint(name, directory):
    family = LINEAR_FAMILIES[name]
    config = getattr(transformers, family.config)(**{**BASE, **family.kw, **KW.get(name, {})})
    config._experts_implementation = "eager"
    auto = (transformers.AutoModel if name in BASE_MODEL_ONLY
            else transformers.AutoModelForCausalLM)
    return _save(auto.from_config(config), directory, 0), config


def _kinds(config):
    return list(config.layer_types)


def _converted(name, kind):
    """Whether the verifier converts the family's layers of ``kind``."""
    return kind == "linear_attention" or name in hf.FAMILIES


def _supported(name):
    """Whether both twins have the family's linear mixer's module."""
    import torch_attn.recurrent

    class_name = {"gated_delta_net": "GatedDeltaNet", "kimi_delta_attention":
                  "KimiDeltaAttention", "lightning_attention": "LightningAttention"}[
        hf.LINEAR[name].variant]
    return hasattr(torch_attn.recurrent, class_name)


@pytest.mark.parametrize("name", NAMES)
def test_every_layer_of_both_kinds_is_checked(name, tmp_path, capsys):
    directory, config = _checkpoint(name, tmp_path / name)
    report_path = tmp_path / "report.json"
    status = main(["hf", str(directory), "--json", str(report_path)])
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    rows, notes = report["rows"], report["checkpoint"]["notes"]
    kinds = _kinds(config)
    want = {f"layer {i} ({k})" for i, k in enumerate(kinds) if _converted(name, k)}
    assert {r["fixture"] for r in rows} == want
    assert not any("linear_attention" in n for n in notes), notes  # no longer skipped
    for i, kind in enumerate(kinds):
        if not _converted(name, kind):
            assert any(f"layer(s) {i} ({kind})" in n and "not converted" in n for n in notes)
    linear = [r for r in rows if "(linear_attention)" in r["fixture"]]
    assert {r["variant"] for r in linear} == {hf.LINEAR[name].variant}
    assert any("linear attention in chunks of" in n and "exercised" in n
               for r in linear for n in r["exercised"])
    hf_rows = {r["fixture"]: r for r in linear if r["implementation"] == "hf"
               and r["core"] == "" and r["dtype"] == "float32"}
    assert set(hf_rows) == {f"layer {i} (linear_attention)" for i, k in enumerate(kinds)
                            if k == "linear_attention"}
    assert all(r["status"] == "pass" for r in hf_rows.values()), hf_rows
    assert {(r["core"], r["dtype"]) for r in linear if r["implementation"] == "hf"} == {
        (core, d) for core in ("", "decode") for d in ("float32", "float64")}
    hf_decode = [r for r in linear if r["implementation"] == "hf" and r["core"] == "decode"
                 and r["dtype"] == "float32"]
    assert hf_decode and all(r["status"] == "pass" for r in hf_decode), hf_decode
    assert all([a["name"] for a in r["arrays"]] == ["output", "grad x"]
               for r in hf_rows.values())
    twins = [r for r in linear if r["implementation"] in ("torch", "jax")]
    if _supported(name):
        assert {(r["implementation"], r["core"], r["dtype"]) for r in twins} == {
            (fw, impl, d) for fw in ("torch", "jax") for impl in ("recurrent", "chunked",
                                                                  "decode")
            for d in ("float32", "float64")}
        assert all([a["name"] for a in r["arrays"]] == (
            ["output"] if r["core"] == "decode" else ["output", "grad x"]) for r in twins)
        assert all(a["rule"] == "table" for r in twins for a in r["arrays"]
                   if a["name"] == "grad x")
        assert all(r["status"] == "pass" for r in twins), twins
        assert status == 0
        assert "passed, 0 failed" in out
    else:  # the twins' module is not there yet: said, not failed
        assert {r["status"] for r in twins} == {"not supported"}
        assert all("has no" in r["reason"] for r in twins)
        assert "not supported (" in out
    assert all(r["status"] == "pass" for r in rows if r["status"] != "not supported"), rows
    f32 = [a for r in linear if r["dtype"] == "float32" and r["status"] == "pass"
           for a in r["arrays"]]
    assert f32 and all(a["rule"] in ("recurrence", "table", "profile") for a in f32)
    if any(r["implementation"] != "hf" for r in linear if r["dtype"] == "float32"
           and r["status"] == "pass"):
        assert any(a["rule"] == "recurrence" for a in f32)


def test_a_wrong_conversion_of_a_linear_layer_fails_hfs_row(tmp_path, monkeypatch):
    # A_log (the decay's rate) scaled by the conversion: the twins compute what the reference
    # does with it, HF's module with the checkpoint's own, and its row fails.
    directory, _ = _checkpoint("qwen3_next", tmp_path / "qwen3_next")
    family = hf.LINEAR["qwen3_next"]

    def scaled(sd, ours):
        params = family.to_neutral(sd, ours)
        return {**params, "A_log": params["A_log"] + 1.0}

    monkeypatch.setitem(hf.LINEAR, "qwen3_next", family.__class__(
        family.variant, family.settings, scaled, family.from_neutral, stacks=family.stacks))
    report = hf_check.run(directory, frameworks=["torch"], dtypes=["float32"],
                          log=lambda row: None, layers=[0])
    rows = {(r["implementation"], r["core"]): r["status"] for r in report["rows"]}
    assert rows == {("torch", "recurrent"): "pass", ("torch", "chunked"): "pass",
                    ("torch", "decode"): "pass", ("hf", ""): "fail", ("hf", "decode"): "fail"}
    hf_row = next(r for r in report["rows"] if (r["implementation"], r["core"]) == ("hf", ""))
    assert hf_row["reason"] == "output, grad x"  # its gradient moved far too
    assert not report["summary"]["ok"]


@matrix
def test_a_qwen3_5_composite_checks_its_text_towers_linear_layers(tmp_path):
    # Qwen3.5's vision-language checkpoint (tests/test_hf_import_vision.py's tiny one): its
    # text tower's linear-attention layer is checked beside its full-attention layer and the
    # vision tower's blocks, HF's row among them.
    from tests.test_hf_import_vision import _vl_config
    config, make = _vl_config("qwen3_5")
    make(config).save_pretrained(tmp_path)
    report = hf_check.run(tmp_path, frameworks=["torch"], log=lambda row: None)
    linear = [r for r in report["rows"] if r["fixture"] == "layer 0 (linear_attention)"]
    assert {(r["implementation"], r["status"]) for r in linear
            if r["dtype"] == "float32"} == {("torch", "pass"), ("hf", "pass")}
    assert report["summary"]["ok"], [r for r in report["rows"] if r["status"] != "pass"]
    assert not any("linear_attention" in n for n in report["checkpoint"]["notes"])
