"""The whole checkpoint accounted for before anything is computed: ``account`` reads headers
only, ``check_values`` reads the selected layers' arrays once and computes nothing with them.

``account(config, checkpoint)``: every stack's attention layers that the config implies
(``golden.verifier.layout.expected_layers``) are in the checkpoint, and each layer has every array
its conversion needs (``golden.hf.expected_state``), with the shape the config implies and a
float dtype we read; a layer beyond the config's count is named and not checked (transformers
does not load it either: DeepSeek-V3's multi-token-prediction layer). Every problem found is
listed in one ``CheckpointError`` (file, key, expected and actual), before any tensor's data
is read: a header claiming a huge tensor the config does not imply is refused unread.

``check_values``: NaN or infinite values in the arrays a layer's conversion reads are refused
with the key and the counts, before the layer is computed (the module's other arrays go to HF's
own module as they are: Gemma 4's clip bounds are infinite as HF initialises them).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from golden.hf import expected_state
from golden.hf.family import LayerNotSupported
from golden.verifier.checkpoint import REFUSED, SCALES, CheckpointError, expand_scale, scale_keys
from golden.verifier.layout import (expected_layers, is_attention, layer_count, layer_name,
                                    other_kind, other_layers, stacks, unread_towers)

SHOWN = 12  # problems listed in the error; the rest counted


@dataclass
class Layer:
    """One attention layer to convert: its stack's config, the stack, its index there, its
    name in the rows, and {the module's key: the checkpoint's key} of its arrays (those the
    conversion needs, checked; any other float array of the module, for HF's own)."""

    config: dict
    stack: object
    index: int
    name: str
    keys: dict
    variant: str = ""
    settings: dict = field(default_factory=dict)
    converted: frozenset = frozenset()  # the module's keys the conversion reads


@dataclass
class Accounting:
    """What ``account`` found: the layers (every expected one), how many the config implies,
    notes for the header (stacks absent, layers beyond the count, keys not read), and the
    dtypes of the arrays the layers are converted from."""

    layers: list
    expected: int
    notes: list
    dtypes: Counter


def account(config, checkpoint) -> Accounting:
    """Every layer the config implies, checked against the checkpoint's headers (see the
    module's docstring); CheckpointError listing every problem."""
    problems, notes, layers, expected = [], unread_towers(config), [], 0
    entries = checkpoint.entries
    found_any = False
    for c, stack in stacks(config):
        by_layer = _keys_by_layer(stack, entries)
        found_any = found_any or bool(by_layer)
        want = expected_layers(c, stack)
        others = other_layers(c, stack)
        skipped = {i for where in others.values() for i in where} | other_kind(c, stack)
        label = " ".join(dict.fromkeys(x for x in (stack.label, stack.kind) if x))
        said = f"{label}: " if label else ""
        if want is None:
            want = [i for i in by_layer if i not in skipped]
            notes.append(f"{said}the config gives no layer count; the {len(want)} layers "
                         f"found are checked")
        if not by_layer and want and _encoder_only(config) and stack.kind in ("decoder",
                                                                                 "cross"):
            notes.append(f"{said}no layers in this checkpoint ({config['architectures'][0]}"
                         f" is an encoder alone)")
            continue
        if not by_layer:  # no layer of this stack at all: said below if no stack has any
            if want and len(stacks(config)) > 1:
                notes.append(f"{said}no layers found (no '{stack.form()}'): not checked")
            continue
        expected += len(want)
        field_name, count = layer_count(c, stack) or ("layers found", len(want))
        missing = [i for i in want if i not in by_layer]
        if missing:
            problems.append(f"{said}{field_name} = {count} implies layers 0 to {count - 1}, "
                            f"the checkpoint has no '{stack.form()}' for layer(s) "
                            f"{_ranges(missing)}")
        for kind, where in others.items():  # a hybrid's Mamba layers, ...: named, not checked
            notes.append(f"{said}layer(s) {_ranges(where)} ({kind}): "
                         + (f"softmax attention of model_type {c['model_type']!r}, not "
                            f"converted (its linear-attention layers are), not checked"
                            if is_attention(kind) else "not softmax attention, not checked"))
        extra = sorted(set(by_layer) - set(want) - skipped)
        if extra:
            notes.append(f"{said}layer(s) {_ranges(extra)}: beyond {field_name} = {count} "
                         f"(transformers does not load them); not checked")
        for i in want:
            if i in by_layer:
                layer = _layer(c, stack, i, by_layer, entries, config, problems, notes)
                if layer is not None:
                    layers.append(layer)
    if not found_any:
        forms = " or ".join(f"'{s.form()}'" for _, s in stacks(config))
        raise CheckpointError(f"no attention layer found: no key of the form {forms} "
                              f"(model_type {config['model_type']!r})")
    if problems:
        more = len(problems) - SHOWN
        raise CheckpointError("the checkpoint does not hold what its config.json implies:\n  "
                              + "\n  ".join(problems[:SHOWN])
                              + (f"\n  ... and {more} more" if more > 0 else ""))
    dtypes = Counter(entries[k].dtype for layer in layers for v in layer.keys.values()
                     for k in pieces(v))
    return Accounting(layers, expected, list(dict.fromkeys(notes)), dtypes)


def _keys_by_layer(stack, entries) -> dict:
    """{layer index: {the module's key: the checkpoint's key}} of the stack; the prefix of a
    layer's keys under "" (ViT's file names its arrays otherwise than its module). Two modules
    of one layer index (a vision tower's encoder.layers.N.self_attn under a text tower's
    layers.N.self_attn) are refused, never read one as the other."""
    pattern = stack.pattern()
    layers = {}
    for key in entries:
        m = pattern.match(key)
        if m:
            found = layers.setdefault(int(m.group(2)), {"": m.group(1)})
            if found[""] != m.group(1):
                raise CheckpointError(
                    f"{stack.label + ' ' if stack.label else ''}layer {m.group(2)}: two modules "
                    f"match '{stack.form()}': {found['']!r} and {m.group(1)!r}; which is the "
                    f"layer is ambiguous (a composite model's towers each need their key "
                    f"prefix: golden.hf.COMPOSITES)")
            found[stack.rename(key[len(m.group(1)):])] = key
    for found in layers.values():  # the module's arrays the file keeps apart: one, joined
        for target, parts in stack.joined:
            if target not in found and all(p in found for p in parts):
                found[target] = tuple(found.pop(p) for p in parts)
    return dict(sorted(layers.items()))


def pieces(value) -> tuple:
    """The checkpoint's keys of one of a layer's arrays: itself, or the pieces the module
    holds joined along their first axis (``Stack.joined``)."""
    return value if isinstance(value, tuple) else (value,)


def _joined_entry(parts, key, problems):
    """The entry of an array the file keeps in ``parts`` (pieces joined along their first
    axis, Stack.joined): the first piece's, with the joined shape; None (a problem appended)
    when the pieces' other axes or dtypes differ."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if len({(p.shape[1:], p.dtype) for p in parts}) != 1:
        problems.append(f"{first.path.name}: {', '.join(p.key for p in parts)} should differ "
                        f"in their first axis alone (the module's {key}, joined), got "
                        f"{', '.join(f'{p.dtype} {p.shape}' for p in parts)}")
        return None
    return replace(first, shape=(sum(p.shape[0] for p in parts),) + tuple(first.shape[1:]))


def _layer(c, stack, i, by_layer, entries, config, problems, notes):
    """The layer, its keys checked against what its conversion needs; None (and problems
    appended) when they are not there, not float or not of the implied shape."""
    keys = dict(by_layer[i])
    prefix = keys.pop("")
    if stack.shared and stack.shared not in keys and 0 in by_layer \
            and stack.shared in by_layer[0]:
        keys[stack.shared] = by_layer[0][stack.shared]  # T5's table, layer 0's
    base = prefix[:prefix.rindex(f"{stack.stack}.{i}.")]
    for name in stack.beside:  # the model's arrays beside the stack (Phi-4's position table)
        for held in (name, stack.file_name(name)):  # its name, or the file's (Mistral's)
            if base + held in entries:
                keys[name] = base + held
                break
    name = layer_name(c, stack, i)
    try:
        variant, ours, shapes = expected_state(c, {k: entries[pieces(v)[0]]
                                                   for k, v in keys.items()},
                                               layer_idx=i, kind=stack.kind)
    except LayerNotSupported as e:  # a kind of layer we do not convert: the others are checked
        notes.append(f"{name}: not checked: {e}")
        return None
    except ValueError as e:
        problems.append(f"{name}: {e}")
        return None
    before = len(problems)
    for key, shape in shapes.items():
        if key not in keys:
            problems.append(f"{name}: the checkpoint has no {prefix}{stack.file_name(key)} "
                            f"(expected shape {shape})")
            continue
        entry = _joined_entry([entries[k] for k in pieces(keys[key])], key, problems)
        if entry is None:
            continue
        if entry.dtype in REFUSED:
            problems.append(f"{entry.path.name}: {entry.key} is {entry.dtype}, "
                            f"{REFUSED[entry.dtype][1]}")
        elif entry.shape != shape:
            problems.append(f"{entry.path.name}: {entry.key} has shape {entry.shape}, the "
                            f"config implies {shape}")
        elif entry.dtype.startswith("F8"):
            _check_scale(entry, keys, entries, _block(config), problems)
    scales = {s for k in shapes for s in scale_keys(k)}
    unused = sorted(k for k in keys if k not in shapes and k not in scales)
    if unused:
        notes.append(f"not converted (HF's own module is given them): {', '.join(unused)}")
    if len(problems) > before:
        return None
    return Layer(c, stack, i, name, {k: v for k, v in keys.items()
                                     if k in shapes or entries[pieces(v)[0]].is_float}, variant,
                 ours,
                 frozenset(k for k in keys if k in shapes or k in scales))


def _check_scale(entry, keys, entries, block, problems):
    """An FP8 weight's scale, when it has one: float, and of a shape that scales it."""
    module_key = next(k for k, v in keys.items() if v == entry.key)
    for s in scale_keys(module_key):
        if s in keys:
            scale = entries[keys[s]]
            if scale.dtype in REFUSED:
                problems.append(f"{scale.path.name}: {scale.key} is {scale.dtype}, "
                                f"{REFUSED[scale.dtype][1]}")
                return
            try:
                expand_scale(np.zeros(scale.shape, np.int8), entry.shape, scale.key, block)
            except CheckpointError as e:
                problems.append(f"{scale.path.name}: {e}")
            return


def _block(config):
    """The FP8 scales' block (rows, columns) of the config's quantization_config, or None."""
    q = config.get("quantization_config")
    size = q.get("weight_block_size") if isinstance(q, dict) else None
    return tuple(size) if isinstance(size, list) and len(size) == 2 else None


def _encoder_only(config) -> bool:
    """Whether the config names an encoder-only class (T5EncoderModel): its decoder's stacks
    are not looked for."""
    names = config.get("architectures") or []
    return bool(names) and all("Encoder" in n and "Decoder" not in n for n in names)


def _ranges(indices) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, n in enumerate(indices):
        if start is None:
            start = n
        if i + 1 == len(indices) or indices[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)


def layer_state(checkpoint, layer, config) -> dict:
    """The layer's arrays by the module's names, read (FP8 dequantised), scales left out."""
    block = _block(config)
    return {k: _read(checkpoint, v, block) for k, v in layer.keys.items()
            if not k.endswith(SCALES)}


def _read(checkpoint, value, block):
    parts = [checkpoint.read_weight(k, block) for k in pieces(value)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def check_values(checkpoint, layers, config) -> dict:
    """Each layer's arrays read once, NaN and infinities counted in those its conversion reads;
    CheckpointError naming every array that has any. Returns {"arrays", "bytes", "seconds"}."""
    start, problems, seen = time.perf_counter(), [], {}
    for layer in layers:
        for key, array in layer_state(checkpoint, layer, config).items():
            full = layer.keys[key]
            if full in seen:
                continue
            seen[full] = sum(checkpoint.entries[k].nbytes for k in pieces(full))
            if key not in layer.converted:  # HF's own module's, given as they are
                continue
            nan, inf = int(np.isnan(array).sum()), int(np.isinf(array).sum())
            if nan or inf:
                first = checkpoint.entries[pieces(full)[0]]
                problems.append(f"{first.path.name}: {' + '.join(pieces(full))}: {nan} NaN and "
                                f"{inf} infinite of {array.size} values")
    if problems:
        more = len(problems) - SHOWN
        raise CheckpointError("weights that are not finite:\n  " + "\n  ".join(problems[:SHOWN])
                              + (f"\n  ... and {more} more" if more > 0 else ""))
    return {"arrays": len(seen), "bytes": sum(seen.values()),
            "seconds": time.perf_counter() - start}
