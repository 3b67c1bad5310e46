"""Vision towers in the checkpoint verifier: how each draws its one image and how HF's model is
given it, in one table (``TOWERS``), read by golden.verifier.exercise (the positions our module
takes) and golden.verifier.model (HF's one-layer model's inputs, from which it computes the same
positions itself).

A tower's entry: ``draw(config) -> Image``, the patches of its one image, their positions (2, L)
int64 in the order the attention sees them and, for a tower with windowed layers, the window
of each patch; ``inputs(config, b, length,
positions, dtype) -> {name: tensor}``, the model's inputs for that image (zeros: the
attention's input is replaced), positions (2, B, L) as the exercise drew them.

- Qwen-VL-like towers (any vision config with ``spatial_merge_size``: Qwen2/2.5/3-VL, Qwen3.5,
  the Omni encoders, GLM-4V, ERNIE-4.5-VL): an image of m × 2m patches (``vision_grid``) in
  merge-block order (``vision_positions``); the model takes the flattened patches and grid_thw.
  Qwen2.5-VL's (``window_size``, windows of w = window_size / m / patch_size merged patches a
  side): m(w + 1) patches a side, so that it spans four windows, three of them cut short, in
  the window order the model permutes them into (``window_order``).
- Pixtral: 2 × 4 patches row-major (row, column); the model takes the image and its size.
- Gemma 4: 2 × 4 patches as its pixel_position_ids (x, y) = (column, row).
- Llama 4: its fixed grid (image_size / patch_size a side) as (column + 1, row + 1), its class
  token, last, at (0, 0); the model takes the image.
- DINOv3: the config's image_size (H × W patches, the size its RoPE's scale was converted
  for), its class token and registers first at (0, 0), then each patch at (2i + 1 − H,
  2j + 1 − W) (golden.hf.vision.dinov3_positions); the model takes the image.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from golden.hf.vision import dinov3_positions


@dataclass(frozen=True)
class Tower:
    draw: Callable
    inputs: Callable


@dataclass
class Image:
    """One drawn image: its patches (rows, cols), their positions (2, L) in the attention's
    order, and the window of each (L,) (None: no windows)."""

    rows: int
    cols: int
    positions: np.ndarray
    windows: np.ndarray | None = None


def merged_window(c) -> int | None:
    """Qwen2.5-VL's window side in merged patches (window_size / m / patch_size), None without
    windows."""
    if c.get("window_size") is None:
        return None
    m = int(c.get("spatial_merge_size", 1))
    return int(c["window_size"]) // m // int(c.get("patch_size", 1))


def vision_grid(c) -> tuple[int, int]:
    """The patches (rows, columns) of the one image drawn for a Qwen-VL-like tower: m × 2m (m
    its spatial_merge_size); with windows of w merged patches a side, m(w + 1) a side."""
    m, w = int(c.get("spatial_merge_size", 1)), merged_window(c)
    return (m, 2 * m) if w is None else (m * (w + 1), m * (w + 1))


def window_order(rows, cols, m, w) -> tuple[np.ndarray, np.ndarray]:
    """Hugging Face's get_vision_window_index for one image (t = 1) of rows × cols patches, m
    the merge size, windows of w × w merged patches: (the patches' order (L,), indices into
    the merge-block order of vision_positions; the window of each patch in that order (L,)).
    The merged grid is padded to whole windows (a whole extra window row or column where it
    divides, empty), windows taken row-major, each window's merged patches row-major, each
    merged patch's m² patches together."""
    gh, gw = rows // m, cols // m
    index = np.arange(gh * gw).reshape(gh, gw)
    padded = np.pad(index, ((0, w - gh % w), (0, w - gw % w)), constant_values=-1)
    nh, nw = padded.shape[0] // w, padded.shape[1] // w
    windows = padded.reshape(nh, w, nw, w).transpose(0, 2, 1, 3).reshape(nh * nw, w * w)
    merged = windows[windows >= 0]
    order = (merged[:, None] * m * m + np.arange(m * m)).reshape(-1)
    counts = (windows >= 0).sum(axis=1)
    return order, np.repeat(np.arange(len(counts)), counts * m * m)


def vision_positions(rows, cols, m) -> np.ndarray:
    """(2, rows · cols) int64: each patch's (row, column) in the order the tower sees them,
    HF's get_vision_position_ids: the m × m merge blocks in row-major order, each block's
    patches row-major."""
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    shape = (rows // m, m, cols // m, m)
    return np.stack([t.reshape(shape).transpose(0, 2, 1, 3).reshape(-1) for t in (r, c)])


def _qwen_draw(c):
    rows, cols = vision_grid(c)
    m, w = int(c.get("spatial_merge_size", 1)), merged_window(c)
    positions = vision_positions(rows, cols, m)
    if w is None:
        return Image(rows, cols, positions)
    order, windows = window_order(rows, cols, m, w)
    return Image(rows, cols, positions[:, order], windows)


def _qwen_inputs(c, b, length, positions, dtype):
    import torch
    rows, cols = positions[:, 0]  # one image: its patches' grid (in any order)
    width = c.in_channels * c.temporal_patch_size * c.patch_size ** 2
    return {"hidden_states": torch.zeros((length, width), dtype=dtype),
            "grid_thw": torch.tensor([[1, int(rows.max()) + 1, int(cols.max()) + 1]])}


def _row_major(rows, cols):
    return np.divmod(np.arange(rows * cols), cols)  # (row, column) of each patch


def _pixtral_draw(c):
    return Image(2, 4, np.stack(_row_major(2, 4)))


def _pixtral_inputs(c, b, length, positions, dtype):
    import torch
    rows, cols = (int(a.max()) + 1 for a in positions[:, 0])
    size = (rows * c.patch_size, cols * c.patch_size)
    return {"pixel_values": torch.zeros((b, c.num_channels) + size, dtype=dtype),
            "image_sizes": [size] * b}


def _gemma4_draw(c):
    r, w = _row_major(2, 4)
    return Image(2, 4, np.stack([w, r]))


def _gemma4_inputs(c, b, length, positions, dtype):
    import torch
    ids = np.moveaxis(positions, 0, -1)  # (B, L, 2)
    return {"pixel_values": torch.zeros((b, length, 3 * c.patch_size ** 2), dtype=dtype),
            "pixel_position_ids": torch.from_numpy(np.array(ids, np.int64))}


def _llama4_draw(c):
    side = int(c["image_size"]) // int(c["patch_size"])
    rows, cols = _row_major(side, side)
    return Image(side, side, np.concatenate([np.stack([cols + 1, rows + 1]), [[0], [0]]],
                                            axis=1))


def _llama4_inputs(c, b, length, positions, dtype):
    import torch
    return {"pixel_values": torch.zeros((b, c.num_channels, c.image_size, c.image_size),
                                        dtype=dtype)}


def _sides(value) -> tuple[int, int]:
    """An int or a pair (height, width) of a config, as a pair."""
    return (int(value), int(value)) if isinstance(value, int) else tuple(int(v) for v in value)


def _dinov3_image(c) -> tuple[int, int, int, int]:
    """(H, W, height, width): the patches and pixels of the config's image_size."""
    get = c.get if isinstance(c, dict) else lambda k: getattr(c, k)
    (ih, iw), (ph, pw) = _sides(get("image_size")), _sides(get("patch_size"))
    return ih // ph, iw // pw, ih, iw


def _dinov3_draw(c):
    h, w, _, _ = _dinov3_image(c)
    return Image(h, w, dinov3_positions(h, w, 1 + int(c.get("num_register_tokens") or 0)))


def _dinov3_inputs(c, b, length, positions, dtype):
    import torch
    _, _, ih, iw = _dinov3_image(c)
    return {"pixel_values": torch.zeros((b, c.num_channels, ih, iw), dtype=dtype)}


QWEN = Tower(_qwen_draw, _qwen_inputs)
TOWERS = {"pixtral": Tower(_pixtral_draw, _pixtral_inputs),
          "gemma4_vision": Tower(_gemma4_draw, _gemma4_inputs),
          "llama4_vision_model": Tower(_llama4_draw, _llama4_inputs),
          "dinov3_vit": Tower(_dinov3_draw, _dinov3_inputs)}


def tower(config) -> Tower | None:
    """The entry of a tower's config (a dict, or HF's config object), None for a model that is
    not a vision tower with axial RoPE."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    if get("model_type") in TOWERS:
        return TOWERS[get("model_type")]
    return QWEN if get("spatial_merge_size") is not None else None
