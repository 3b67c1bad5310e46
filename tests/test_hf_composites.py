"""Vision-language composites (issue 42, golden.hf.vision.COMPOSITES): a tiny checkpoint of each,
written by transformers' own ``save_pretrained``, checked by ``attn-parity hf`` tower by tower:
every attention layer of the text tower, and of the vision tower where its kind is one we
convert (CLIP's, SigLIP's, Pixtral's), every row passing (HF's own module among them); a vision
tower (or perceiver, VQ-VAE) of a kind we do not convert named in the report's notes as not
checked; a vision tower's layer never read as a text layer; and ``golden.convert.from_hf`` on
each composite's ``text_config`` (the sub-config a user passes).

LLaVA, Mistral 3 (Pixtral's tower) and Idefics 2 (text tower alone, a perceiver noted) in the
quick suite; the others in the whole matrix (ATTN_PARITY_MATRIX=1).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass

import numpy as np
import pytest

import golden.convert
from golden.hf.vision import COMPOSITES
from tests.helpers import matrix

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.hf_harness import BASE, assert_gives_back, state_dict  # noqa: E402
from tests.test_hf_import import DECODERS_42, FAMILIES as DECODERS  # noqa: E402
from tests.test_hf_import_mistral_large4 import FAMILY as MISTRAL_LARGE4  # noqa: E402

# DeepSeek-V3's MLA as tiny as it builds (Kimi K2.5's text tower), every size distinct
MLA = dict(q_lora_rank=9, kv_lora_rank=7, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=10,
           n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
           first_k_dense_replace=2, n_group=1, topk_group=1)
# a CLIP, SigLIP or Pixtral vision tower of two layers (the other kinds' defaults are made small
# below, by model_type)
VISION = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              image_size=28, patch_size=14)


@dataclass(frozen=True)
class Composite:
    """A composite's tiny case: ``vision`` whether its vision tower is checked (rows "vision
    layer 0/1"); ``notes`` the sub-configs attn-parity hf names as not checked; ``needs`` a
    package its model needs (FastVLM's and Perception LM's timm: without it, the text tower's
    arrays alone beside the composite's config, ``_text_tower_alone``); ``released``: the key
    renames from what save_pretrained writes to the released checkpoints' layout."""

    vision: bool = False
    notes: tuple = ()
    needs: str | None = None
    released: tuple = ()


# model_type -> its case (in issue 42's order); each text tower's and vision tower's model_type
# the config class's default, as the released checkpoints have it
CASES = {
    "llava": Composite(vision=True),
    # the released checkpoints' layout: CLIP's tower under vision_tower.vision_model.
    "llava_next": Composite(vision=True, released=(("vision_tower.encoder.",
                                                    "vision_tower.vision_model.encoder."),)),
    "llava_next_video": Composite(vision=True),
    "llava_onevision": Composite(vision=True, released=(  # SigLIP and Qwen2
        ("vision_tower.encoder.", "vision_tower.vision_model.encoder."),)),
    "vipllava": Composite(vision=True),
    "mistral3": Composite(vision=True),  # Pixtral and Mistral
    "aya_vision": Composite(vision=True),  # SigLIP and Cohere 2
    "internvl": Composite(notes=("vision_config",)),
    "idefics2": Composite(notes=("perceiver_config", "vision_config")),
    "idefics3": Composite(notes=("vision_config",)),
    "smolvlm": Composite(notes=("vision_config",)),
    "got_ocr2": Composite(notes=("vision_config",)),
    "fast_vlm": Composite(notes=("vision_config",), needs="timm"),
    "lighton_ocr": Composite(vision=True),  # Pixtral and Qwen3
    "perception_lm": Composite(notes=("vision_config",), needs="timm"),
    "cohere2_vision": Composite(vision=True),
    "janus": Composite(notes=("vision_config", "vq_config")),
    "deepseek_vl": Composite(vision=True),
    "ovis2": Composite(notes=("vision_config",)),
    "video_llama_3": Composite(notes=("vision_config",)),
    "qianfan_ocr": Composite(notes=("vision_config",)),
    # save_pretrained turns every "layers" into "blocks" (transformers' load-time rename of the
    # vision tower's blocks, undone on save); the released checkpoint keeps language_model.model.
    # layers.N
    "kimi_k25": Composite(notes=("vision_config",),
                          released=(("language_model.model.blocks.", "language_model.model."
                                     "layers."),)),
    "exaone4_5": Composite(notes=("vision_config",)),
    # issue 44's learned-selection models: Mistral Large 4 (Pixtral), MiniMax M3 and Qwen4-Exp
    # (vision towers of their own), dots.3-note (vision and audio towers of its own)
    "mistral_large4": Composite(notes=("vision_config",)),  # Pixtral in Mistral's layout
    "minimax_m3_vl": Composite(notes=("vision_config",)),
    "qwen4_exp": Composite(notes=("vision_config",)),
    "dots3_note": Composite(notes=("audio_config", "vision_config")),
}
# Composites whose text tower is refused: PaliGemma's Gemma attends both ways (its config sets
# use_bidirectional_attention); Molmo 2's checkpoints keep q, k and v fused (Family.unverified)
REFUSED = {"paligemma": "use_bidirectional_attention = True is not supported",
           "molmo2": "does not check Molmo 2 checkpoints yet"}
QUICK = ("llava", "mistral3", "idefics2")
# the text towers' variant (their first softmax layer's): grouped-query attention, but these
TEXT_VARIANT = {mt: "multi_head_latent_attention" for mt in ("kimi_k25", "mistral_large4",
                                                             "dots3_note")}


# the model class where it is not the config's name with ForConditionalGeneration
CLASSES = {"minimax_m3_vl": "MiniMaxM3SparseForConditionalGeneration"}


def _params(names):
    return [pytest.param(mt, marks=() if mt in QUICK else (matrix,)) for mt in names]


def _text(mt):
    """A text tower's tiny settings: tests/test_hf_import.py's of its family, two layers."""
    known = {**DECODERS, **DECODERS_42, "mistral_large4_text": MISTRAL_LARGE4}
    kw = dict(known[mt].kw) if mt in known else {}
    if kw.get("layer_types"):  # one entry a layer: the family's first two kinds
        kw["layer_types"] = (list(kw["layer_types"]) * 2)[:2]
    return {**BASE, **kw, **(MLA if mt == "deepseek_v3" else {}), "num_hidden_layers": 2,
            "model_type": mt}


def _config(mt):
    """A tiny config of the composite ``mt``: its default towers' kinds, made small."""
    cls = transformers.CONFIG_MAPPING[mt]
    default = cls()
    vision = dict(VISION, model_type=default.vision_config.model_type)
    if mt == "molmo2":
        vision = {}
    towers = {}
    if mt == "dots3_note":  # its vision tower's per-layer settings are for its 42 layers;
        vision.update(per_layer_config={}, adapter_in_dim=VISION["hidden_size"],  # audio small
                      adapter_out_dim=BASE["hidden_size"])
        towers["audio_config"] = dict(adapter_out_dim=BASE["hidden_size"],
            model_type=default.audio_config.model_type, hidden_size=32, intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
            adapter_input_size=32, downsample_hidden_size=16, conv_output_size=96)
    return cls(text_config=_text(default.text_config.model_type), vision_config=vision,
               **towers)


def _checkpoint(mt, directory):
    """The composite's tiny model, written by save_pretrained (in the released layout where
    ``CASES[mt].released`` says)."""
    from safetensors.numpy import load_file, save_file
    config = _config(mt)
    needs = CASES.get(mt, Composite()).needs
    if needs and importlib.util.find_spec(needs) is None:
        return _text_tower_alone(config, directory)
    model = getattr(transformers, CLASSES.get(mt, type(config).__name__.replace(
        "Config", "ForConditionalGeneration")))(config)
    model.save_pretrained(directory)
    if CASES.get(mt, Composite()).released:
        path = directory / "model.safetensors"
        arrays = load_file(path)
        for old, new in CASES[mt].released:
            arrays = {k.replace(old, new): a for k, a in arrays.items()}
        save_file(arrays, path, metadata={"format": "pt"})
    return directory


def _text_tower_alone(config, directory):
    """Without the package its vision tower needs (FastVLM's timm model): the composite's
    config.json and its text tower's arrays under "language_model." as save_pretrained writes
    them, beside one array of a timm ViT block (vision_tower.timm_model.blocks.0.attn.qkv)."""
    from safetensors.numpy import load_file, save_file
    transformers.AutoModelForCausalLM.from_config(config.text_config).save_pretrained(
        directory / "text")
    arrays = {f"language_model.{k}": a
              for k, a in load_file(directory / "text" / "model.safetensors").items()}
    arrays["vision_tower.timm_model.blocks.0.attn.qkv.weight"] = np.zeros((6, 2), np.float32)
    save_file(arrays, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(config.to_json_string())
    return directory


def _run(directory):
    from golden.verifier import check as hf_check
    return hf_check.run(directory, frameworks=["torch"], log=lambda row: None)


def test_every_composite_of_issue_42_is_read():
    """The table covers every composite attn-parity hf reads of this batch, and the refused
    ones are not read (their text towers refused by name below)."""
    issue_42 = set(CASES) | set(REFUSED) - {"molmo2"}
    assert issue_42 <= set(COMPOSITES)
    assert "molmo2" not in COMPOSITES


@pytest.mark.parametrize("mt", _params(CASES))
def test_a_composite_checkpoint_is_checked_tower_by_tower(mt, tmp_path):
    """Every attention layer of the text tower (layers 0 and 1) and, where its kind is
    converted, of the vision tower (vision layers 0 and 1), every row passing, HF's own
    module's among them; each tower not converted named in the notes, and no other."""
    case = CASES[mt]
    report = _run(_checkpoint(mt, tmp_path))
    names = {r["fixture"] for r in report["rows"]}
    text = {n for n in names if n.startswith("layer ")}
    vision = {n for n in names if n.startswith("vision layer ")}
    assert {n.split(" (")[0] for n in text} == {"layer 0", "layer 1"}, names
    assert vision == ({"vision layer 0 (attention)", "vision layer 1 (attention)"}
                      if case.vision else set()), names
    assert names == text | vision
    bad = [(r["fixture"], r["implementation"], r["dtype"], r["reason"])
           for r in report["rows"] if r["status"] not in ("pass", "not supported")]
    assert not bad, bad
    for name in names:  # HF's own module, on every layer
        assert any(r["fixture"] == name and r["implementation"] == "hf"
                   and r["status"] == "pass" for r in report["rows"]), name
    notes = [n for n in report["checkpoint"]["notes"] if ": not checked: " in n]
    assert sorted(n.split(" (")[0] for n in notes) == sorted(case.notes), notes


@pytest.mark.parametrize("mt", [*CASES, *REFUSED])
def test_from_hf_takes_each_composites_text_config(mt):
    """golden.convert.from_hf on the composite's text_config (what a user passes) and its text
    tower's layer 0: converted as its text tower's family, to_hf giving the state dict back; or
    refused by name (PaliGemma's bidirectional Gemma)."""
    config = _config(mt)
    text = config.text_config
    text._attn_implementation = "sdpa"
    model = transformers.AutoModel.from_config(text) if mt != "molmo2" else \
        transformers.Molmo2TextModel(text)
    layers = model.layers if hasattr(model, "layers") else model.model.layers
    i = next(i for i, layer in enumerate(layers) if hasattr(layer, "self_attn"))  # Qwen4-Exp: 1
    sd = state_dict(layers[i].self_attn)
    rotary = getattr(model, "rotary_emb", None)
    if hasattr(rotary, "alpha"):  # Mistral Large 4's RoPE scales, beside the layers
        sd["rotary_emb.alpha"] = rotary.alpha.detach().numpy().copy()
    if mt == "paligemma":
        with pytest.raises(ValueError, match=REFUSED[mt]):
            golden.convert.from_hf(text, sd, layer_idx=i)
        return
    variant, ours, params = golden.convert.from_hf(text, sd, layer_idx=i)
    assert variant == TEXT_VARIANT.get(mt, "grouped_query_attention")
    assert ours.model_type == text.model_type
    assert_gives_back(sd, golden.convert.to_hf(variant, ours, params))


def test_a_refused_text_tower_leaves_the_composite_unsupported(tmp_path):
    """PaliGemma (its Gemma text tower bidirectional) refused by the reason, the layers named;
    Molmo 2 (its checkpoints' fused q, k, v) refused by name from its config alone."""
    from golden.verifier.checkpoint import CheckpointError
    from golden.verifier.layout import read_config
    with pytest.raises(CheckpointError, match=r"layer 0 \(attention\): model_type 'gemma': "
                                              + REFUSED["paligemma"]):
        _run(_checkpoint("paligemma", tmp_path / "paligemma"))
    (tmp_path / "config.json").write_text(json.dumps(_config("molmo2").to_dict()))
    with pytest.raises(CheckpointError, match="'molmo2_text': attn-parity hf " + REFUSED["molmo2"]):
        read_config(tmp_path)


def test_an_unknown_text_tower_leaves_the_composite_unsupported(tmp_path):
    from golden.verifier.checkpoint import CheckpointError
    from golden.verifier.layout import read_config
    config = _config("llava").to_dict()
    config["text_config"]["model_type"] = "mamba"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model_type 'llava': its text tower's model_type "
                                              "'mamba' is not supported"):
        read_config(tmp_path)


def test_a_vision_tower_of_a_kind_not_converted_is_noted(tmp_path, monkeypatch):
    """LLaVA with a DINOv2 vision tower: converted, its layers are checked under their own
    names ("vision layer N", beside the text tower's "layer N"); taken out of the families
    converted, its text tower is checked and the vision tower named in the notes, none of its
    layers read."""
    from golden.verifier import layout
    config = _config("llava")
    config.vision_config = transformers.Dinov2Config(**dict(VISION, image_size=28))
    transformers.LlavaForConditionalGeneration(config).save_pretrained(tmp_path)
    report = _run(tmp_path)
    assert {r["fixture"].split(" (")[0] for r in report["rows"]} == {
        "layer 0", "layer 1", "vision layer 0", "vision layer 1"}
    assert all(r["status"] in ("pass", "not supported") for r in report["rows"]), report["rows"]
    monkeypatch.setattr(layout, "FAMILIES", {k: v for k, v in layout.FAMILIES.items()
                                             if k != "dinov2"})
    report = _run(tmp_path)
    assert {r["fixture"].split(" (")[0] for r in report["rows"]} == {"layer 0", "layer 1"}
    assert [n for n in report["checkpoint"]["notes"] if "not checked" in n] == [
        "vision_config (dinov2): not checked: its attention is not converted"]


def test_a_vision_layer_is_never_read_as_a_text_layer(tmp_path, monkeypatch):
    """LLaVA's vision tower sits at vision_tower.encoder.layers.N.self_attn, which a text
    tower's layers.N.self_attn read under any prefix also matches: with COMPOSITES' text prefix
    dropped (or LLaVA not a composite at all, as before issue 42's batch F) the checkpoint is
    refused, both modules named, not checked with one tower's arrays for the other's."""
    from golden.verifier import layout
    from golden.verifier.checkpoint import CheckpointError
    _checkpoint("llava", tmp_path)
    ambiguous = (r"layer 0: two modules match '\.\.\.layers\.N\.self_attn\.\*': "
                 r"'language_model\.model\.layers\.0\.self_attn\.' and "
                 r"'vision_tower\.encoder\.layers\.0\.self_attn\.'")
    monkeypatch.setitem(layout.COMPOSITES, "llava",
                        {"text_config": "", "vision_config": "vision_tower."})
    with pytest.raises(CheckpointError, match=ambiguous):
        _run(tmp_path)
    monkeypatch.delitem(layout.COMPOSITES, "llava")
    with pytest.raises(CheckpointError, match=ambiguous):
        _run(tmp_path)


@pytest.mark.parametrize("within, stack, module, key, layer", [
    # a text tower under language_model.: save_pretrained's layout and transformers 5's
    ("language_model.", "layers", "self_attn", "language_model.model.layers.3.self_attn.q", 3),
    ("language_model.", "layers", "self_attn", "model.language_model.layers.3.self_attn.q", 3),
    ("language_model.", "layers", "self_attn", "vision_tower.encoder.layers.3.self_attn.q", None),
    ("language_model.", "layers", "self_attn", "my_language_model.layers.3.self_attn.q", None),
    ("language_model.", "layers", "self_attn", "language_model.sublayers.3.self_attn.q", None),
    # a CLIP tower under vision_tower.: released, save_pretrained's, transformers 5's
    ("vision_tower.", "encoder.layers", "self_attn",
     "vision_tower.vision_model.encoder.layers.1.self_attn.q", 1),
    ("vision_tower.", "encoder.layers", "self_attn", "vision_tower.encoder.layers.1.self_attn.q",
     1),
    ("vision_tower.", "encoder.layers", "self_attn",
     "model.vision_tower.encoder.layers.1.self_attn.q", 1),
    ("vision_tower.", "encoder.layers", "self_attn",
     "language_model.model.layers.1.self_attn.q", None),
    # Idefics 2's text tower, not its perceiver's layers
    ("text_model.", "layers", "self_attn", "model.text_model.layers.0.self_attn.q", 0),
    ("text_model.", "layers", "self_attn",
     "model.connector.perceiver_resampler.layers.0.self_attn.q", None),
    # no within: any prefix, the stack whole segments
    ("", "layers", "self_attn", "vision_tower.encoder.layers.2.self_attn.q", 2),
    ("", "layers", "self_attn", "model.sublayers.2.self_attn.q", None),
])
def test_a_towers_prefix_is_whole_segments_anywhere_before_its_stack(within, stack, module, key,
                                                                      layer):
    from golden.hf import Stack
    m = Stack(stack, module, within=within).pattern().match(key)
    assert (int(m.group(2)) if m else None) == layer
    if m:
        assert m.group(1) == key[:-1]


# Gemma 3n's tiny towers: the text tower of tests/test_hf_import.py's gemma3n_text row, the audio
# tower of tests/test_hf_speech_command.py's gemma3n_audio (both read), the vision tower a timm
# MobileNet (noted, never built: the checkpoint holds one array of it)
GEMMA3N_AUDIO = dict(hidden_size=12, conf_num_attention_heads=3, conf_num_hidden_layers=2,
                     conf_attention_chunk_size=4, conf_attention_context_left=4,
                     conf_attention_context_right=2, input_feat_size=8,
                     sscp_conv_channel_size=[4, 2], conf_conv_kernel_size=3)


@matrix
def test_gemma3n_checkpoint_is_checked_text_and_audio_towers(tmp_path):
    """Gemma 3n's checkpoint (Gemma3nForConditionalGeneration's layout: model.language_model.,
    model.audio_tower., model.vision_tower.timm_model.): the text tower's two layers and the
    audio encoder's two, every row passing with HF's own module among them; the vision tower
    named as not checked."""
    from safetensors.numpy import load_file, save_file
    config = transformers.Gemma3nConfig(text_config=_text("gemma3n_text"),
                                        audio_config=GEMMA3N_AUDIO)
    transformers.Gemma3nForCausalLM(config.text_config).save_pretrained(tmp_path / "text")
    transformers.Gemma3nAudioEncoder(config.audio_config).save_pretrained(tmp_path / "audio")
    arrays = {f"model.language_model.{k.removeprefix('model.')}": a
              for k, a in load_file(tmp_path / "text" / "model.safetensors").items()}
    arrays.update({f"model.audio_tower.{k}": a
                   for k, a in load_file(tmp_path / "audio" / "model.safetensors").items()})
    arrays["model.vision_tower.timm_model.blocks.0.0.conv.weight"] = np.zeros((2, 2), np.float32)
    save_file(arrays, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(config.to_json_string())
    report = _run(tmp_path)
    names = {r["fixture"] for r in report["rows"]}
    assert names == {"layer 0 (sliding_attention)", "layer 1 (full_attention)",
                     "encoder layer 0 (attention)", "encoder layer 1 (attention)"}, names
    bad = [(r["fixture"], r["implementation"], r["dtype"], r["reason"])
           for r in report["rows"] if r["status"] not in ("pass", "not supported")]
    assert not bad, bad
    for name in names:
        assert any(r["fixture"] == name and r["implementation"] == "hf"
                   and r["status"] == "pass" for r in report["rows"]), name
    notes = [n for n in report["checkpoint"]["notes"] if ": not checked: " in n]
    assert [n.split(" (")[0] for n in notes] == ["vision_config"], notes
