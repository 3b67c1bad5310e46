"""``attn-parity hf DIR`` on tiny checkpoints written by transformers' own ``save_pretrained``
(float32 safetensors, random weights): every attention layer converted and checked by the
twins against the float64 reference and by the checkpoint's own HF attention module; the
reports; a wrong conversion caught by HF's row; unreadable and unsupported checkpoints named
with exit status 2.

By default eight decoder families (a sliding/full mix, local/global θ with QK norms, sinks with
sliding layers, fused layouts, an MoE with NoPE full layers, an MoE with sinks and a θ per
layer, eager attention only, a hybrid whose Mamba layers are named and not checked),
ModernBERT (a bidirectional window, fused Wqkv, local and global θ) and four encoder or
encoder-decoder ones (BERT, ViT, Whisper, T5: every stack and kind, T5's shared position bias table, the cross-attention's context);
The whole matrix (ATTN_PARITY_MATRIX=1) runs every family of tests/test_hf_import*.py, and
CLIP's and SigLIP's composite checkpoints (both towers).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from golden import hf
from golden.cli import main
from golden.verifier import check as hf_check
from golden.verifier.checkpoint import Checkpoint
from tests.hf_harness import BASE, TEXT_TOWERS
from tests.helpers import WHOLE

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests import test_hf_import_encoders as encoders  # noqa: E402
from tests import test_hf_import_fused as fused  # noqa: E402
from tests.test_hf_import import ENCODERS_42  # noqa: E402
from tests.test_hf_import import FAMILIES as DECODERS  # noqa: E402
from tests.test_hf_import import HYBRID_OTHERS, HYBRIDS_42  # noqa: E402

FAMILIES = {**DECODERS, **fused.FAMILIES}
QUICK = ("qwen2", "gemma3_text", "gpt_oss", "gpt_neox", "bloom", "exaone_moe",
         "granitemoe_swa", "nemotron_h", "modernbert", "deepseek_v32")
# (a family the verifier does not check yet, Family.unverified, is refused by it by name)
NAMES = [n for n in FAMILIES if not hf.FAMILIES[n].unverified] if WHOLE else list(QUICK)
# The encoders' checkpoints, saved from a model with a head where one is usual (its keys then
# have the base model's prefix, "bert.", "model.", as published checkpoints do), and the
# composite CLIP and SigLIP models (both towers, their keys under text_model. and
# vision_model.).
ENCODER_MODELS = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM",
                  "vit": "ViTForImageClassification", "clip_text_model": "CLIPTextModel",
                  "clip_vision_model": "CLIPVisionModel", "siglip_text_model": "SiglipTextModel",
                  "siglip_vision_model": "SiglipVisionModel",
                  "siglip2_text_model": "Siglip2TextModel",
                  "siglip2_vision_model": "Siglip2VisionModel",
                  "aimv2_text_model": "Aimv2TextModel", "aimv2_vision_model": "Aimv2VisionModel",
                  "metaclip_2_text_model": "MetaClip2TextModel",
                  "metaclip_2_vision_model": "MetaClip2VisionModel",
                  "dinov2": "Dinov2ForImageClassification",
                  "dinov2_with_registers": "Dinov2WithRegistersForImageClassification",
                  "whisper": "WhisperForConditionalGeneration",
                  "bart": "BartForConditionalGeneration", "t5": "T5ForConditionalGeneration"}
COMPOSITE = {"clip": ("CLIPConfig", "CLIPModel"), "siglip": ("SiglipConfig", "SiglipModel"),
             "siglip2": ("Siglip2Config", "Siglip2Model"), "aimv2": ("Aimv2Config", "Aimv2Model"),
             "metaclip_2": ("MetaClip2Config", "MetaClip2Model")}
ENCODER_NAMES = (list(ENCODER_MODELS) + list(COMPOSITE) if WHOLE
                 else ["bert", "vit", "whisper", "t5"])


CAUSAL_LM = {"mistral4": "Mistral4ForCausalLM",
             # Chameleon's published checkpoints: text decoder and VQ-VAE (model.vqmodel.)
             "chameleon": "ChameleonForConditionalGeneration"}


def _checkpoint(name, directory, seed=0):
    """A tiny causal-LM checkpoint of the family, float32, saved by save_pretrained (the
    fused-layout families without BASE's head_dim and num_key_value_heads, as their tests)."""
    family = FAMILIES[name]
    base = BASE if name in DECODERS else {k: v for k, v in BASE.items()
                                          if k not in ("head_dim", "num_key_value_heads")}
    config = getattr(transformers, family.config)(**{**base, **family.kw})
    if family.model is not None:  # a class AutoModel does not take the config of
        return _save(getattr(transformers, family.model)(config), directory, seed)
    if name in CAUSAL_LM:  # a causal LM that AutoModelForCausalLM does not map
        return _save(getattr(transformers, CAUSAL_LM[name])(config), directory, seed)
    make = (transformers.AutoModel if name in TEXT_TOWERS  # a text tower has no causal-LM head
            # issue 42's bidirectional encoders: a masked-LM checkpoint, as published
            else transformers.AutoModelForMaskedLM if name in ENCODERS_42 and (
                name != "modernbert-decoder") else transformers.AutoModelForCausalLM)
    return _save(make.from_config(config), directory, seed)


def _save(model, directory, seed):
    rng = np.random.default_rng(seed)
    with torch.no_grad():  # weights N(0, 1/fan_in), as trained checkpoints' are scaled
        for p in model.parameters():
            scale = 1 / np.sqrt(p.shape[-1]) if p.dim() == 2 else 0.5
            p.copy_(torch.from_numpy(np.asarray(  # CLIP's logit_scale: 0-d
                rng.standard_normal(tuple(p.shape)).astype(np.float32) * scale)))
    model.save_pretrained(directory)
    return directory


def _encoder_checkpoint(name, directory, seed=0):
    """A tiny checkpoint of an encoder, encoder-decoder or tower family (the sizes of
    tests/test_hf_import_encoders.py), or of a composite model of two towers, float32."""
    if name in COMPOSITE:
        config_class, model_class = COMPOSITE[name]
        towers = {t: dict(encoders.FAMILIES[f"{name}_{t}_model"].kw)
                  for t in ("text", "vision")}
        config = getattr(transformers, config_class)(text_config={**BASE, **towers["text"]},
                                                     vision_config=towers["vision"])
    else:
        family = encoders.FAMILIES[name]
        config = getattr(transformers, family.config)(**{**BASE, **family.kw})
        model_class = ENCODER_MODELS[name]
    return _save(getattr(transformers, model_class)(config), directory, seed)


def expected_layers(config) -> set:
    """The rows' names of every attention layer of a checkpoint's config.json."""
    mt = config["model_type"]
    if mt in COMPOSITE:
        return set().union(*(expected_layers(config[f"{t}_config"]) for t in ("text", "vision")))
    if mt in ("whisper", "bart", "t5"):
        encoder = config.get("encoder_layers", config.get("num_layers"))
        decoder = config.get("decoder_layers", config.get("num_decoder_layers"))
        return ({f"encoder layer {i} (encoder)" for i in range(encoder)}
                | {f"decoder layer {i} ({k})" for i in range(decoder) for k in ("decoder",
                                                                                 "cross")})
    tower = mt.rsplit("_", 2)[-2] + " " if mt.endswith("_model") else ""
    return {f"{tower}layer {i} (attention)" for i in range(config["num_hidden_layers"])}


@pytest.mark.parametrize("name", ENCODER_NAMES)
def test_every_layer_of_every_stack_passes(name, tmp_path, capsys):
    # Every attention of every stack and kind is read and checked by the twins and by HF's own
    # module, at float32 and (no float32 step in these families' HF attention) float64.
    directory = _encoder_checkpoint(name, tmp_path / name)
    report = hf_check.run(directory, log=lambda row: None)
    rows = report["rows"]
    names = expected_layers(json.loads((directory / "config.json").read_text()))
    assert {r["fixture"] for r in rows} == names
    assert {r["implementation"] for r in rows} == {"torch", "jax", "hf"}
    hf_rows = {(r["fixture"], r["dtype"]): r["status"] for r in rows
               if r["implementation"] == "hf"}
    assert hf_rows == {(n, d): "pass" for n in names for d in ("float32", "float64")}
    assert report["summary"]["ok"], [r for r in rows if r["status"] != "pass"]
    cross = [r for r in rows if "(cross)" in r["fixture"]]
    assert all(r["variant"] == "multi_head_cross_attention" for r in cross)


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
    hf_rows = [r for r in rows if r["implementation"] == "hf" and r["dtype"] == "float32"]
    # one forward row per layer; a linear-attention layer also has HF's cached decoding
    assert [r["status"] for r in hf_rows if r["core"] != "decode"] == ["pass"] * layers
    assert all(r["status"] == "pass" for r in hf_rows)
    assert "passed, 0 failed" in capsys.readouterr().out
    others = HYBRID_OTHERS.get(name)
    if others is not None:  # a hybrid's first layer, not attention: named, not checked
        assert f"layer(s) 0 ({others[1]}): not softmax attention, not checked" in \
            report["checkpoint"]["notes"], report["checkpoint"]["notes"]


@pytest.mark.parametrize("name, config_class", [("glm_moe_dsa", "GlmMoeDsaConfig"),
                                                ("hy_v4", "HYV4Config")])
def test_shared_indexer_layers_are_checked_on_a_drawn_choice(tmp_path, name, config_class):
    # GLM-5's and HY-V4's "shared" indexer layers reuse the previous layer's choice: the
    # verifier checks such a layer on a drawn choice (each query's best of drawn scores among
    # the keys it sees), given to ours as key_indices and to HF's module as prev_topk_indices;
    # a checkpoint of a full and a shared layer passes at both.
    family = FAMILIES[name]
    kw = dict(family.kw, num_hidden_layers=2, indexer_types=["full", "shared"])
    config = getattr(transformers, config_class)(**{**BASE, **kw})
    directory = _save(transformers.AutoModelForCausalLM.from_config(config),
                      tmp_path / name, 0)
    report_path = tmp_path / "report.json"
    assert main(["hf", str(directory), "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert {r["fixture"] for r in report["rows"]} == {"layer 0 (indexed_attention)",
                                                      "layer 1 (indexed_attention)"}
    assert any(r["implementation"] == "hf" and r["fixture"] == "layer 1 (indexed_attention)"
               for r in report["rows"])
    assert all(r["status"] == "pass" for r in report["rows"] if r["implementation"] != "hf"
               or r["dtype"] == "float32")
    assert not report["checkpoint"]["notes"], report["checkpoint"]["notes"]


def config_layers(name):
    """The layers the verifier checks of the family's tiny config: its softmax attention
    layers and, where the family's are converted (golden.hf.LINEAR), its linear_attention
    layers (tests/test_hf_linear_command.py), not LFM3's conv layers; a hybrid's, its test's
    layers: tests/test_hf_import.py HYBRIDS_42)."""
    if name in HYBRIDS_42:
        family = HYBRIDS_42[name]
        if name in hf.LINEAR:  # its linear_attention layers are converted and checked too
            return list(range(family.kw["num_hidden_layers"]))
        return list(family.layers)
    kw = FAMILIES[name].kw
    count = kw.get("num_hidden_layers", kw.get("n_layer", kw.get("n_layers", 1)))
    types = kw.get("layer_types") or ["full_attention"] * count
    skipped = ("conv",) if name in hf.LINEAR else ("linear_attention", "conv")
    return [i for i in range(count) if types[i] not in skipped]


def test_a_text_towers_multimodal_rope_is_exercised(tmp_path, monkeypatch):
    """A Qwen2.5-VL text tower is drawn an image's positions (3, B, L): its sections turned
    into the 1-D RoPE by a wrong conversion pass the twins (they use the converted settings)
    and fail HF's row on every layer."""
    directory = _checkpoint("qwen2_5_vl_text", tmp_path / "qwen2_5_vl_text")
    report = hf_check.run(directory, frameworks=["torch"], log=lambda row: None)
    assert {r["status"] for r in report["rows"]} <= {"pass", "not supported"}
    assert any("multimodal RoPE: exercised" in note for r in report["rows"]
               for note in r["exercised"])
    family = hf.FAMILIES["qwen2_5_vl_text"]

    def one_axis(c, layer_idx, sd):
        ours = family.settings(c, layer_idx, sd)
        rope = {k: v for k, v in ours["rope_parameters"].items() if not k.startswith("mrope")}
        return dict(ours, rope_parameters=rope)

    monkeypatch.setitem(hf.FAMILIES, "qwen2_5_vl_text", family.__class__(
        family.variant, one_axis, family.to_neutral, family.from_neutral, position_axes=3))
    report = hf_check.run(directory, frameworks=["torch"], log=lambda row: None)
    failed = {r["implementation"] for r in report["rows"] if r["status"] == "fail"}
    assert failed == {"hf"}


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


def test_a_wrong_cross_attention_conversion_fails_on_hfs_row(tmp_path, monkeypatch):
    # Drop T5's scale 1 from its cross-attention's conversion (1/√Dh instead): HF's own module,
    # given the same drawn context as its encoder output, disagrees on those layers only.
    directory = _encoder_checkpoint("t5", tmp_path / "t5")
    kinds = hf.FAMILIES["t5"]
    cross = kinds["cross"]

    def unscaled(c, layer_idx, sd):
        return {k: v for k, v in cross.settings(c, layer_idx, sd).items() if k != "scale"}

    monkeypatch.setitem(hf.FAMILIES, "t5", hf.Kinds(kinds, cross=cross.__class__(
        cross.variant, unscaled, cross.to_neutral, cross.from_neutral)))
    report = hf_check.run(directory, frameworks=["torch"], log=lambda row: None)
    failed = {(r["fixture"], r["implementation"], r["dtype"]) for r in report["rows"]
              if r["status"] != "pass"}
    assert failed == {(f"decoder layer {i} (cross)", "hf", d) for i in (0, 1)
                      for d in ("float32", "float64")}


def test_an_encoder_only_checkpoint_of_an_encoder_decoder_family(tmp_path):
    # T5EncoderModel's checkpoint (model_type t5, the text encoder of many pipelines) has no
    # decoder: its encoder's layers are read, and nothing else is looked for.
    family = encoders.FAMILIES["t5"]
    config = transformers.T5Config(**{**BASE, **family.kw})
    directory = _save(transformers.T5EncoderModel(config), tmp_path / "t5_encoder", 0)
    report = hf_check.run(directory, frameworks=["torch"], log=lambda row: None)
    assert {r["fixture"] for r in report["rows"]} == {"encoder layer 0 (encoder)",
                                                      "encoder layer 1 (encoder)"}
    assert report["summary"]["ok"]
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, model_type="bert")))
    with pytest.raises(hf_check.CheckpointError, match=r"no attention layer found: no key of "
                       r"the form '\.\.\.encoder\.layer\.N\.attention\.\*' \(model_type 'bert'\)"):
        hf_check.run(directory, log=lambda row: None)


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
    (directory / "config.json").write_text(json.dumps(dict(config, model_type="mamba")))
    assert main(["hf", str(directory)]) == 2
    assert "model_type 'mamba' is not supported" in capsys.readouterr().err
    # a composite's text tower of a kind not converted (a vision tower of such a kind is noted
    # and not read instead: tests/test_hf_composites.py)
    (directory / "config.json").write_text(json.dumps(dict(
        config, model_type="clip", text_config={"model_type": "mobilevit"},
        vision_config=dict(config, model_type="clip_vision_model"))))
    assert main(["hf", str(directory)]) == 2
    assert "model_type 'clip': its text tower's model_type 'mobilevit' is not supported" in \
        capsys.readouterr().err
    (directory / "config.json").write_text(json.dumps(dict(config, model_type="bert",
                                                           add_cross_attention=True)))
    assert main(["hf", str(directory)]) == 2
    assert "model_type 'bert': add_cross_attention = True: its crossattention layers are not " \
        "converted" in capsys.readouterr().err
    weights.unlink()
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04")  # a pickle: never read
    (directory / "config.json").write_text(json.dumps(config))
    assert main(["hf", str(directory)]) == 2
    assert "no *.safetensors file (pickled checkpoints are not read)" in (
        capsys.readouterr().err)


def test_every_family_has_a_layout():
    # A family golden.hf converts is a family the command reads: each knows its stacks.
    assert set(hf_check.LAYOUTS) == set(hf.FAMILIES)


def test_a_bfloat16_checkpoint_is_read_exactly(tmp_path):
    # Most checkpoints are bfloat16, which NumPy (and safetensors' NumPy API) cannot hold: read
    # from the file as float32, exactly, and the whole check passes.
    directory = tmp_path / "bf16"
    family = FAMILIES["qwen2"]
    config = getattr(transformers, family.config)(**{**BASE, **family.kw})
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    arrays = Checkpoint(directory)
    for key, tensor in model.state_dict().items():
        if key in arrays.keys():
            np.testing.assert_array_equal(arrays.read(key), tensor.float().numpy(), err_msg=key)
    assert main(["hf", str(directory), "--framework", "torch"]) == 0


def test_a_kv_sharing_checkpoint_names_its_reusing_layers(tmp_path):
    # Gemma 4 with num_kv_shared_layers = 2 (tests/test_hf_import.py GEMMA4_SHARED): layers 2
    # and 3 reuse layers 0's and 1's keys and values; they are checked by the twins against the
    # reference as the attention with those layers' k and v weights and their own q and o, and
    # the notes say HF's row is not run for them; the storing layers get HF's row as usual.
    from tests.test_hf_import import GEMMA4_SHARED

    config = transformers.Gemma4TextConfig(**{**BASE, **GEMMA4_SHARED.kw})
    directory = _save(transformers.AutoModelForCausalLM.from_config(config),
                      tmp_path / "gemma4_shared", 0)
    report = hf_check.run(directory, log=lambda row: None)
    notes = report["checkpoint"]["notes"]
    for i, j, kind in ((2, 0, "sliding_attention"), (3, 1, "full_attention")):
        assert any(n.startswith(f"layer {i} ({kind}) reuses layer {j} ({kind})'s keys and "
                                f"values: HF's row not run") for n in notes), notes
    rows = report["rows"]
    hf_rows = {(r["fixture"], r["dtype"]): r["status"] for r in rows
               if r["implementation"] == "hf"}
    assert {f for f, d in hf_rows} == {"layer 0 (sliding_attention)", "layer 1 (full_attention)"}
    assert all(s == "pass" for (f, d), s in hf_rows.items() if d == "float32")
    reused = [r for r in rows if r["fixture"].startswith(("layer 2", "layer 3"))]
    assert {r["implementation"] for r in reused} == {"torch", "jax"}
    assert report["summary"]["ok"], [r for r in rows if r["status"] != "pass"]
