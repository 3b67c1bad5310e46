"""``attn-parity hf DIR`` on tiny checkpoints written by transformers' own ``save_pretrained``
(float32 safetensors, random weights): every attention layer converted and checked by the
twins against the float64 reference and by the checkpoint's own HF attention module; the
reports; a wrong conversion caught by HF's row; unreadable and unsupported checkpoints named
with exit status 2.

By default three families (a sliding/full mix, local/global θ with QK norms, sinks with
sliding layers); ATTN_PARITY_LONG=1 runs every decoder family of tests/test_hf_import.py.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from golden import hf, hf_check
from golden.cli import main
from tests.hf_harness import BASE

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests import test_hf_import_fused as fused  # noqa: E402
from tests.test_hf_import import FAMILIES as DECODERS  # noqa: E402

FAMILIES = {**DECODERS, **fused.FAMILIES}
QUICK = ("qwen2", "gemma3_text", "gpt_oss", "gpt_neox", "bloom")
NAMES = list(FAMILIES) if os.environ.get("ATTN_PARITY_LONG") == "1" else list(QUICK)


def _checkpoint(name, directory, seed=0):
    """A tiny causal-LM checkpoint of the family, float32, saved by save_pretrained (the
    fused-layout families without BASE's head_dim and num_key_value_heads, as their tests)."""
    family = FAMILIES[name]
    base = BASE if name in DECODERS else {k: v for k, v in BASE.items()
                                          if k not in ("head_dim", "num_key_value_heads")}
    config = getattr(transformers, family.config)(**{**base, **family.kw})
    model = transformers.AutoModelForCausalLM.from_config(config)
    rng = np.random.default_rng(seed)
    with torch.no_grad():  # weights N(0, 1/fan_in), as trained checkpoints' are scaled
        for p in model.parameters():
            scale = 1 / np.sqrt(p.shape[-1]) if p.dim() == 2 else 0.5
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32)
                                     * scale))
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("name", NAMES)
def test_every_layer_passes(name, tmp_path, capsys):
    directory = _checkpoint(name, tmp_path / name)
    report_path = tmp_path / "report.json"
    assert main(["hf", str(directory), "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    rows = report["rows"]
    layers = len(config_layers(name))
    assert len({r["fixture"] for r in rows}) == layers  # every attention layer
    assert {r["implementation"] for r in rows} == {"torch", "jax", "hf"}
    hf_rows = [r for r in rows if r["implementation"] == "hf"]
    assert [r["status"] for r in hf_rows if r["dtype"] == "float32"] == ["pass"] * layers
    assert "passed, 0 failed" in capsys.readouterr().out


def config_layers(name):
    kw = FAMILIES[name].kw
    return range(kw.get("num_hidden_layers", kw.get("n_layer", kw.get("n_layers", 1))))


def test_a_wrong_conversion_fails_on_hfs_row(tmp_path, monkeypatch):
    # Drop the sliding window from Qwen2's conversion: the twins still agree with the reference
    # (both use the converted settings), HF's own module does not, on the sliding layer only.
    directory = _checkpoint("qwen2", tmp_path / "qwen2")
    family = hf.FAMILIES["qwen2"]

    def no_window(c, layer_idx, sd):
        return {k: v for k, v in family.settings(c, layer_idx, sd).items()
                if k != "sliding_window"}

    monkeypatch.setitem(hf.FAMILIES, "qwen2", family.__class__(
        family.variant, no_window, family.to_neutral, family.from_neutral))
    report = hf_check.run(directory, frameworks=["torch"], log=lambda row: None)
    failed = {(r["fixture"], r["implementation"]) for r in report["rows"]
              if r["status"] == "fail"}
    assert failed == {("layer 1 (sliding_attention)", "hf")}
    assert not report["summary"]["ok"]


def test_gpt2s_scale_by_the_inverse_layer_index_is_checked_by_hfs_row(tmp_path, monkeypatch):
    # HF's one-layer model rebuilds GPT2Attention with the layer's own index: converting
    # layer 1 as if it were layer 0 (its scale not divided by 2) fails HF's row on layer 1 only.
    directory = _checkpoint("gpt2", tmp_path / "gpt2")
    report = hf_check.run(directory, frameworks=["torch"], log=lambda row: None)
    assert [r["status"] for r in report["rows"] if r["implementation"] == "hf"
            and r["dtype"] == "float32"] == ["pass", "pass"]
    family = hf.FAMILIES["gpt2"]

    def as_layer_0(c, layer_idx, sd):
        return family.settings(c, 0, sd)

    monkeypatch.setitem(hf.FAMILIES, "gpt2", family.__class__(
        family.variant, as_layer_0, family.to_neutral, family.from_neutral))
    report = hf_check.run(directory, frameworks=["torch"], log=lambda row: None)
    failed = {(r["fixture"], r["implementation"]) for r in report["rows"]
              if r["status"] == "fail"}
    assert failed == {("layer 1 (attention)", "hf")}


def test_unreadable_and_unsupported_checkpoints_exit_2(tmp_path, capsys):
    assert main(["hf", str(tmp_path / "nothing")]) == 2
    assert "config.json: cannot be read" in capsys.readouterr().err
    directory = _checkpoint("qwen2", tmp_path / "qwen2")
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # truncated
    assert main(["hf", str(directory)]) == 2
    assert "model.safetensors: not a readable safetensors file" in capsys.readouterr().err
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, model_type="qwen2_vl")))
    assert main(["hf", str(directory)]) == 2
    assert "model_type 'qwen2_vl' is not supported" in capsys.readouterr().err
    (directory / "config.json").write_text(json.dumps(dict(config, model_type="bert")))
    assert main(["hf", str(directory)]) == 2
    assert "model_type 'bert': attn-parity hf reads the decoder-only families" in (
        capsys.readouterr().err)
    weights.unlink()
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04")  # a pickle: never read
    (directory / "config.json").write_text(json.dumps(config))
    assert main(["hf", str(directory)]) == 2
    assert "no *.safetensors file (pickled checkpoints are not read)" in (
        capsys.readouterr().err)


def test_a_bfloat16_checkpoint_is_read_exactly(tmp_path):
    # Most checkpoints are bfloat16, which NumPy (and safetensors' NumPy API) cannot hold: read
    # from the file as float32, exactly, and the whole check passes.
    directory = tmp_path / "bf16"
    family = FAMILIES["qwen2"]
    config = getattr(transformers, family.config)(**{**BASE, **family.kw})
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    arrays = hf_check.Arrays(directory)
    for key, tensor in model.state_dict().items():
        if key in arrays.keys():
            np.testing.assert_array_equal(arrays.get(key), tensor.float().numpy(), err_msg=key)
    assert main(["hf", str(directory), "--framework", "torch"]) == 0
