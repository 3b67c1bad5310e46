"""``attn-parity hf DIR``: every attention layer of a local Hugging Face checkpoint, converted
(golden.hf.from_hf) and checked.

It reads ``DIR/config.json`` and the ``*.safetensors`` files with the safetensors package's
NumPy API (torch is not needed to read them, nothing is unpickled), one layer at a time (only
that layer's arrays are read: memory is bounded by a layer), and for each layer builds an
in-memory fixture on drawn inputs x (B, L, d_in): the float64 reference's output, weights and
gradients with the layer's weights. Then, as ``attn-parity check`` does, each installed twin
runs it at float32 and float64 against the tolerance table, and, when transformers and torch
are installed, the checkpoint's own Hugging Face attention module does too (a one-layer model
of the same configuration holding this layer's weights, the layer's input replaced by x, its
output read from the model's own forward, so its own masks and positions are used), at
float32: HF computes RoPE's angles in float32, so float64 is not its level.

Exit status: 0 when every row passed, 1 when any failed, 2 for a directory that cannot be
read (no config.json, a corrupt or foreign safetensors file, a model_type or setting we do
not convert: the message names it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

from golden import check, reference
from golden.fixture import Fixture
from golden.hf import FAMILIES, _layer_type, from_hf
from golden.runners import FRAMEWORKS

B, L = 2, 8  # the drawn inputs' batch and length
# Where each family's attention modules sit in a checkpoint's keys: (the stack, the module, the
# submodule whose output is the attention's when not the module's own), e.g.
# "model.layers.3.self_attn.q_proj.weight"; the layer number is the stack's index. The
# encoders and encoder-decoders (several stacks, kind=) are not read by the command yet.
DECODERS = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_next", "starcoder2",
            "granite", "smollm3", "olmo", "olmo2", "gemma2", "gemma3_text", "cohere", "gpt_oss",
            "llama4_text", "deepseek_v3", "phi3", "stablelm")
LAYOUTS = {**{mt: ("layers", "self_attn", None) for mt in DECODERS},
           "gpt2": ("h", "attn", None), "gpt_neox": ("layers", "attention", None),
           "falcon": ("h", "self_attention", None), "mpt": ("blocks", "attn", None),
           # BLOOM adds the residual inside its attention: ours is the output of its dense
           "bloom": ("h", "self_attention", "dense")}
FEED_FORWARD = ("mlp", "block_sparse_moe", "feed_forward", "ffn")  # replaced by nothing
# Families whose attention module reads its index in the whole model beyond layer_types (GPT-2's
# scale_attn_by_inverse_layer_idx: GPT2Attention's scaling is divided by layer_idx + 1): in the
# one-layer model it is built again with the layer's own index.
OWN_INDEX = ("gpt2",)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read or converted."""


def read_config(directory) -> dict:
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: not JSON ({e})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"{path}: should be a transformers config with a model_type")
    for sub in ("text_config", "decoder"):  # composite models: the decoder's own config
        if config["model_type"] not in FAMILIES and isinstance(config.get(sub), dict):
            config = config[sub]
    if config.get("model_type") not in FAMILIES:
        raise CheckpointError(f"model_type {config.get('model_type')!r} is not supported; "
                              f"supported: {', '.join(sorted(FAMILIES))}")
    if config["model_type"] not in LAYOUTS:
        raise CheckpointError(f"model_type {config['model_type']!r}: attn-parity hf reads the "
                              f"decoder-only families ({', '.join(sorted(LAYOUTS))}); convert "
                              f"this one layer by layer with golden.convert.from_hf(..., kind=)")
    return config


class Arrays:
    """The checkpoint's arrays by key, read lazily from its safetensors files (NumPy)."""

    def __init__(self, directory):
        from safetensors import SafetensorError, safe_open

        files = sorted(Path(directory).glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors file (pickled checkpoints "
                                  f"are not read)")
        self._open, self._where = {}, {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="np")
                keys = list(handle.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
            self._open[path] = handle
            self._where.update({k: path for k in keys})
        self._error = SafetensorError

    def keys(self):
        return self._where.keys()

    def get(self, key) -> np.ndarray:
        path = self._where[key]
        try:
            handle = self._open[path]
            if handle.get_slice(key).get_dtype() == "BF16":  # NumPy has no bfloat16
                return _bfloat16(path, key)
            return handle.get_tensor(key)
        except (self._error, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: {key} cannot be read ({e})") from None


def _bfloat16(path, key) -> np.ndarray:
    """A BF16 array of a safetensors file as float32 (exact: bfloat16 is float32's upper 16
    bits), read from the file's own header (8-byte length, JSON, then the data)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        entry = header[key]
        begin, end = entry["data_offsets"]
        count = int(np.prod(entry["shape"], dtype=np.int64))
        if end - begin != 2 * count:
            raise ValueError(f"{key}: {end - begin} bytes for {count} bfloat16 values")
        f.seek(8 + size + begin)
        raw = np.frombuffer(f.read(end - begin), dtype="<u2")
        if raw.size != count:
            raise ValueError(f"{key}: the file ends before its data")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])


def attention_layers(config, keys) -> dict:
    """{layer index: key prefix of its attention module} found in the checkpoint's keys."""
    stack, module, _ = LAYOUTS[config["model_type"]]
    pattern = re.compile(rf"^(.*?(?:^|\.){stack}\.(\d+)\.{module}\.)")
    layers = {}
    for key in keys:
        m = pattern.match(key)
        if m:
            layers.setdefault(int(m.group(2)), m.group(1))
    if not layers:
        raise CheckpointError(f"no attention layer found: no key of the form "
                              f"'...{stack}.N.{module}.*' (model_type {config['model_type']!r})")
    return dict(sorted(layers.items()))


def layer_fixture(config, layer_idx, state_dict, rng) -> Fixture:
    """The layer's converted weights on drawn inputs, with the float64 reference's results."""
    variant, ours, params = from_hf(config, state_dict, layer_idx=layer_idx)
    params = {n: np.asarray(a, np.float64) for n, a in params.items()}
    x = rng.standard_normal((B, L, ours["d_in"])).astype(np.float32).astype(np.float64)
    forward, backward = reference.VARIANTS[variant]
    out, weights, saved = forward(dict(ours), {"x": x}, params)
    cot = {"output": rng.standard_normal(out.shape).astype(np.float32).astype(np.float64),
           "weights": rng.standard_normal(weights.shape).astype(np.float32).astype(np.float64)}
    grads = backward(saved, cot["output"], cot["weights"])
    kind = _layer_type(config, layer_idx) or "attention"
    return Fixture(name=f"layer {layer_idx} ({kind})", variant=variant, seed=0,
                   config=dict(ours), inputs={"x": x}, dtypes=["float32", "float64"],
                   params=params, cotangents=cot, expected={"output": out, "weights": weights},
                   grads=grads, zero=reference.zero_grads(dict(ours), grads))


def hf_runner(config, layer_idx, state_dict):
    """A runner of the checkpoint's own HF attention module for this layer (float32 only)."""
    from golden.runners.adapt import NotSupported, Runner

    def run(fixture, dtype):
        if dtype != "float32":
            raise NotSupported("HF computes RoPE's angles in float32: compared at float32")
        return {"output": _hf_output(config, layer_idx, state_dict, fixture.inputs["x"]),
                "dtype": dtype}

    return Runner("hf", "torch", run)


def _one_layer_config(config, layer_idx):
    import transformers

    c = dict(config)
    for key in ("layer_types", "no_rope_layers"):
        if isinstance(c.get(key), list):
            c[key] = [c[key][layer_idx]]
    c.update(pad_token_id=None, bos_token_id=None, eos_token_id=None,
             max_window_layers=0 if c.get("max_window_layers") else None)
    c = {k: v for k, v in c.items() if v is not None or k in ("pad_token_id",)}
    model_type = c.pop("model_type")
    names = getattr(transformers.CONFIG_MAPPING[model_type], "attribute_map", {})
    c[names.get("num_hidden_layers", "num_hidden_layers")] = 1  # GPT-2's n_layer, ...
    c[names.get("vocab_size", "vocab_size")] = 8
    return transformers.AutoConfig.for_model(model_type, **c)


def _hf_output(config, layer_idx, state_dict, x):
    """The HF attention module's output on x, float32: a one-layer model of the config (its
    feed-forward replaced by nothing), the layer's weights loaded, x fed in place of the
    attention's input by a pre-hook, the output read by a hook."""
    import torch
    import transformers

    class _Zero(torch.nn.Module):
        def forward(self, hidden_states, *args, **kwargs):
            return hidden_states * 0

    hf_config = _one_layer_config(config, layer_idx)
    hf_config._experts_implementation = "eager"
    for attention in ("sdpa", "eager"):
        hf_config._attn_implementation = attention
        try:
            model = transformers.AutoModel.from_config(hf_config, dtype=torch.float32).eval()
            break
        except ValueError:  # this family has no sdpa path
            continue
    stack, module, output = LAYOUTS[config["model_type"]]
    layer = getattr(model, stack)[0]
    for name in FEED_FORWARD:
        if hasattr(layer, name):
            setattr(layer, name, _Zero())  # adds nothing: the attention's output is all we read
    attn = getattr(layer, module)
    if config["model_type"] in OWN_INDEX:
        attn = type(attn)(hf_config, layer_idx=layer_idx).to(torch.float32).eval()
        setattr(layer, module, attn)
    attn.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in
                          state_dict.items()}, strict=True)
    fed = torch.from_numpy(np.asarray(x, np.float32))
    seen = {}

    def feed(mod, args, kwargs):
        if "hidden_states" in kwargs:
            return args, dict(kwargs, hidden_states=fed)
        return (fed,) + tuple(args[1:]), kwargs

    def read(mod, args, kwargs, out):
        out = out if isinstance(out, torch.Tensor) else out[0]
        seen["out"] = out.detach().numpy().astype(np.float64)

    read_from = attn if output is None else getattr(attn, output)
    handles = [attn.register_forward_pre_hook(feed, with_kwargs=True),
               read_from.register_forward_hook(read, with_kwargs=True)]
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(x.shape[:2], dtype=torch.long), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen["out"]


def _hf_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def run(directory, *, frameworks=(), with_hf=True, log=print, progress=None, seed=0,
        weights=None) -> dict:
    """The report (golden.report's format) of every attention layer of the checkpoint;
    ``weights``, a dict, receives each layer's attention weights for the HTML page."""
    config = read_config(directory)
    arrays = Arrays(directory)
    layers = attention_layers(config, arrays.keys())
    rng = np.random.default_rng(seed)
    with_hf = with_hf and _hf_available()
    report = None
    bar = _bar(layers, progress)
    for layer_idx in bar:
        prefix = layers[layer_idx]
        state_dict = {k[len(prefix):]: arrays.get(k) for k in arrays.keys()
                      if k.startswith(prefix)}
        try:
            fixture = layer_fixture(config, layer_idx, state_dict, rng)
        except ValueError as e:
            raise CheckpointError(f"layer {layer_idx}: {e}") from None
        impls = [hf_runner(config, layer_idx, state_dict)] if with_hf else []
        part = check.run([fixture], frameworks=list(frameworks) or list(FRAMEWORKS), impls=impls,
                         regeneration=False, weights=weights, progress=False)
        for row in part["rows"]:
            row["model_type"] = config["model_type"]
            log(row)
        if report is None:
            report = part
        else:
            report["rows"] += part["rows"]
            report["implementations"] = sorted(set(report["implementations"])
                                               | set(part["implementations"]))
    report["command"] = f"attn-parity hf {directory}"
    report["summary"] = check._summary(report, sum(r["seconds"] for r in report["rows"]))
    return report


def _bar(layers, progress):
    if progress is False or not sys.stderr.isatty():
        return list(layers)
    try:
        from tqdm import tqdm
    except ImportError:
        return list(layers)
    return tqdm(list(layers), desc="layers", unit="layer", file=sys.stderr)


def _line(row) -> str:
    rel = "—" if row["max_rel"] is None else f"{row['max_rel']:.1e}"
    reason = f"  ({row['reason']})" if row["reason"] and row["status"] != "pass" else ""
    label = row["implementation"] + (f" {row['core']}" if row["core"] else "")
    return (f"{row['model_type']:<12} {row['fixture']:<28} {label:<22} "
            f"{row['dtype']:<8} {rel:>8}  {row['status']}{reason}")


def main(args) -> int:
    weights = {} if args.html else None
    try:
        report = run(args.directory, frameworks=args.framework, with_hf=not args.no_hf,
                     log=lambda row: print(_line(row)), weights=weights)
    except CheckpointError as e:
        print(f"attn-parity hf: error: {e}", file=sys.stderr)
        return 2
    s = report["summary"]
    print(f"{s['passed']} passed, {s['failed'] + s['errors']} failed"
          + (f" ({s['not_supported']} not supported)" if s["not_supported"] else ""))
    check._write_reports(report, weights, args.json, args.junit, args.html, None, print)
    return 0 if s["ok"] else 1


def add_arguments(parser) -> None:
    parser.add_argument("directory", help="a local checkpoint: config.json and *.safetensors")
    parser.add_argument("--framework", action="append", choices=FRAMEWORKS, default=[],
                        help="only this framework (repeatable; default: all installed)")
    parser.add_argument("--no-hf", action="store_true",
                        help="do not run the checkpoint's own transformers modules")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
    parser.add_argument("--junit", metavar="FILE", help="write the report as JUnit XML")
    parser.add_argument("--html", metavar="DIR", help="write an HTML page")


def _cli(argv=None) -> int:  # python -m golden.hf_check DIR
    parser = argparse.ArgumentParser(prog="attn-parity hf", description=__doc__)
    add_arguments(parser)
    return main(parser.parse_args(argv))
