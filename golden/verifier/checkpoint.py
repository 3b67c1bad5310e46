"""A local Hugging Face checkpoint's safetensors files, read without pickle and without torch.

``Checkpoint(directory)`` reads every ``*.safetensors`` file's header (8 bytes of length, a JSON
table of ``{key: {dtype, shape, data_offsets}}``, then the data) and nothing else: each entry is
checked against the file (a known dtype, a shape of non-negative ints, offsets inside the data
and exactly ``prod(shape)`` elements long), and ``model.safetensors.index.json``, when there is
one, against the files (each file it names present, each key it lists in the file it names).
A header that is inconsistent is a ``CheckpointError`` naming the file and the key; no tensor's
data is read until ``read(key)`` asks for it.

``read(key)`` gives the stored values as a float array: float64, float32 and float16 as stored;
bfloat16 and the FP8 formats (``F8_E4M3``, ``F8_E5M2``) as float32, exactly (each of their values
is a float32), through ml_dtypes. An FP8 weight with a scale (transformers' fine-grained FP8:
``weight_scale_inv`` per block of ``weight_block_size``; or ``weight_scale`` per tensor or per
output row) is dequantised in float64, which is exact (an FP8 value times a float32 scale has at
most 4 + 24 significant bits), as ``read_weight``. Any other dtype (integers, booleans,
complex, 4- and 6-bit floats, E8M0 scales) is refused with a message naming it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HEADER_LIMIT = 100 * 2**20  # the safetensors format's own limit on a header's size
INDEX = "model.safetensors.index.json"
# safetensors dtype -> (bits per element, what read() gives: a NumPy dtype name, or the
# ml_dtypes name of a format NumPy lacks, read as float32)
FLOATS = {"F64": (64, "float64"), "F32": (32, "float32"), "F16": (16, "float16"),
          "BF16": (16, "bfloat16"), "F8_E4M3": (8, "float8_e4m3fn"),
          "F8_E5M2": (8, "float8_e5m2")}
# safetensors dtypes that are not weights we read, with why
REFUSED = {**{d: (b, "integers: not attention weights (a quantised pack such as GPTQ's or "
                     "AWQ's int32 is not read)")
              for d, b in (("U8", 8), ("I8", 8), ("I16", 16), ("U16", 16), ("I32", 32),
                           ("U32", 32), ("I64", 64), ("U64", 64))},
           "BOOL": (8, "booleans: not attention weights"),
           "C64": (64, "complex numbers: not attention weights"),
           "F8_E8M0": (8, "an exponent-only scale format (MXFP4's block scales), not weights"),
           "F4": (4, "4-bit floats (MXFP4 packs) are not read"),
           "F6_E2M3": (6, "6-bit floats are not read"),
           "F6_E3M2": (6, "6-bit floats are not read")}
SCALES = ("weight_scale_inv", "weight_scale")  # an FP8 weight's scale, beside its "weight"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read or converted."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file, as its header describes it."""

    path: Path
    key: str
    dtype: str
    shape: tuple
    begin: int  # byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOATS


def read_header(path) -> tuple[dict, dict]:
    """({key: Entry}, metadata) of one safetensors file, every entry checked against the file's
    size; nothing of the data is read."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else None
            if length is None or length > min(HEADER_LIMIT, size - 8):
                raise CheckpointError(f"{path}: not a readable safetensors file (its first 8 "
                                      f"bytes should give a header length of at most "
                                      f"{min(HEADER_LIMIT, max(size - 8, 0))} bytes, got "
                                      f"{'fewer than 8 bytes' if length is None else length})")
            raw = f.read(length)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        table = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file (its header is not "
                              f"JSON: {e})") from None
    if not isinstance(table, dict):
        raise CheckpointError(f"{path}: not a readable safetensors file (its header should be "
                              f"a JSON object, got {type(table).__name__})")
    metadata = table.pop("__metadata__", None) or {}
    data = size - 8 - length
    return {key: _entry(path, key, value, 8 + length, data) for key, value in table.items()}, \
        metadata


def _entry(path, key, value, start, data) -> Entry:
    def bad(what):
        return CheckpointError(f"{path}: not a readable safetensors file ({key}: {what})")

    if not isinstance(value, dict) or not {"dtype", "shape", "data_offsets"} <= set(value):
        raise bad(f"should have dtype, shape and data_offsets, got {value!r}")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if dtype not in FLOATS and dtype not in REFUSED:
        raise bad(f"dtype should be one of {', '.join([*FLOATS, *REFUSED])}, got {dtype!r}")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
        raise bad(f"shape should be a list of ints >= 0, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(type(n) is int for n in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets should be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    if offsets[1] > data:
        raise bad(f"data_offsets {offsets} go past the file's {data} bytes of data (the file "
                  f"is truncated)")
    bits = (FLOATS.get(dtype) or REFUSED[dtype])[0]
    want = math.ceil(math.prod(shape) * bits / 8)
    if offsets[1] - offsets[0] != want:
        raise bad(f"shape {shape} of {dtype} is {want} bytes, its data_offsets {offsets} hold "
                  f"{offsets[1] - offsets[0]}")
    return Entry(path, key, dtype, tuple(shape), start + offsets[0], start + offsets[1])


class Checkpoint:
    """Every tensor's header of the checkpoint's safetensors files (``entries``), the index
    checked against them; ``read`` reads one tensor."""

    def __init__(self, directory):
        directory = Path(directory)
        files = sorted(directory.glob("*.safetensors"))
        index = directory / INDEX
        if not files and not index.exists():
            raise CheckpointError(f"{directory}: no *.safetensors file (pickled checkpoints "
                                  f"are not read)")
        self.files = files
        self.entries: dict[str, Entry] = {}
        for path in files:
            entries, _ = read_header(path)
            for key, entry in entries.items():
                if key in self.entries:
                    raise CheckpointError(f"{key}: in two files, {self.entries[key].path.name} "
                                          f"and {path.name}")
                self.entries[key] = entry
        self.index = _check_index(index, self.entries) if index.exists() else None

    def keys(self):
        return self.entries.keys()

    def read(self, key) -> np.ndarray:
        """The tensor's stored values (see the module's docstring), refused by name when its
        dtype is not a float we read."""
        entry = self.entries[key]
        if not entry.is_float:
            raise CheckpointError(f"{entry.path.name}: {key} is {entry.dtype}, "
                                  f"{REFUSED[entry.dtype][1]}")
        try:
            with open(entry.path, "rb") as f:
                f.seek(entry.begin)
                raw = f.read(entry.nbytes)
        except OSError as e:
            raise CheckpointError(f"{entry.path}: {key} cannot be read "
                                  f"({e.strerror or e})") from None
        if len(raw) != entry.nbytes:
            raise CheckpointError(f"{entry.path}: {key}: the file ends before its data")
        return _values(raw, entry.dtype).reshape(entry.shape)

    def read_weight(self, key, block=None) -> np.ndarray:
        """``read(key)``, an FP8 weight times its scale (``<name>.weight_scale_inv`` per block
        of ``block`` = (rows, columns), or ``<name>.weight_scale`` per tensor or per output row)
        in float64."""
        values = self.read(key)
        scale_key = next((s for s in scale_keys(key) if s in self.entries), None)
        if not self.entries[key].dtype.startswith("F8") or scale_key is None:
            return values
        scale = self.read(scale_key).astype(np.float64)
        return values.astype(np.float64) * expand_scale(scale, values.shape, scale_key, block)


def scale_keys(key) -> list[str]:
    """The keys an FP8 weight's scale may have (``q_proj.weight`` -> ``q_proj.weight_scale_inv``,
    ``q_proj.weight_scale``)."""
    if not key.endswith(".weight"):
        return []
    return [key[: -len("weight")] + s for s in SCALES]


def expand_scale(scale, shape, key, block=None) -> np.ndarray:
    """A scale broadcast to a weight of ``shape``: one per tensor, per output row, or per block
    of ``block`` (rows, columns) (an edge block may be partial); CheckpointError when its shape
    is none of these."""
    if scale.size == 1:
        return scale.reshape(())
    if len(shape) == 2 and scale.shape in ((shape[0], 1), (shape[0],)):
        return scale.reshape(shape[0], 1)
    if len(shape) == 2 and scale.ndim == 2:
        rows, cols = block or (math.ceil(shape[0] / scale.shape[0]),
                               math.ceil(shape[1] / scale.shape[1]))
        if (math.ceil(shape[0] / rows), math.ceil(shape[1] / cols)) == scale.shape:
            full = np.repeat(np.repeat(scale, rows, axis=0), cols, axis=1)
            return full[: shape[0], : shape[1]]
    raise CheckpointError(f"{key}: shape {scale.shape} is not a scale of a weight of shape "
                          f"{tuple(shape)} (one value, one per row, or one per block"
                          f"{f' of {tuple(block)}' if block else ''})")


def _values(raw, dtype) -> np.ndarray:
    name = FLOATS[dtype][1]
    if name in ("float64", "float32", "float16"):
        return np.frombuffer(raw, dtype=np.dtype(name).newbyteorder("<")).copy()
    import ml_dtypes  # bfloat16 and FP8: formats NumPy lacks, each value exact in float32

    return np.frombuffer(raw, dtype=getattr(ml_dtypes, name)).astype(np.float32)


def _check_index(index, entries) -> dict:
    """``model.safetensors.index.json``'s weight_map, checked: each file it names is present
    and holds each key the map puts there."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(type(weight_map).__name__)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: should be JSON with a weight_map of key -> file "
                              f"({type(e).__name__}: {e})") from None
    missing_files = sorted({f for f in weight_map.values()
                            if not (index.parent / str(f)).is_file()})
    if missing_files:
        lost = [k for k, f in weight_map.items() if f in missing_files]
        raise CheckpointError(f"{index.name} lists {len(missing_files)} file(s) that are not in "
                              f"{index.parent}: {', '.join(missing_files)} ({len(lost)} "
                              f"tensors, e.g. {lost[0]})")
    absent = [(k, f) for k, f in weight_map.items()
              if k not in entries or entries[k].path.name != f]
    if absent:
        key, file = absent[0]
        raise CheckpointError(f"{index.name}: {len(absent)} key(s) are not where it says, e.g. "
                              f"{key} should be in {file}"
                              + (f", found in {entries[key].path.name}" if key in entries
                                 else ", not in any file"))
    return weight_map
