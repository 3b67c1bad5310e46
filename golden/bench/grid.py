"""The sizes of a run: one attention call's shape (``Shape``; B batch, H heads, Lq query length,
Lk key length, D head width), every section's sizes, repeats and budget (``Grid``), and the two
grids: ``FULL`` and ``QUICK`` (``--quick``, the tests' tiny one)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Shape", "Grid", "FULL", "QUICK"]


@dataclass(frozen=True)
class Shape:
    B: int
    H: int
    Lq: int
    Lk: int
    D: int

    @property
    def name(self) -> str:
        length = f"L={self.Lq}" if self.Lq == self.Lk else f"Lq={self.Lq},Lk={self.Lk}"
        return f"B={self.B},H={self.H},{length},D={self.D}"

    def flops(self, causal: bool, backward: bool) -> float:
        """4·B·H·Lq·Lk·D forward, halved when causal; forward+backward is 3.5× forward."""
        forward = 4 * self.B * self.H * self.Lq * self.Lk * self.D / (2 if causal else 1)
        return forward * (3.5 if backward else 1.0)


@dataclass(frozen=True)
class Grid:
    shapes: tuple[Shape, ...]
    bf16_shape: Shape  # the one shape also run in bfloat16 (forward only); also the target shape
    matmul_n: int      # ceiling: (n, n) @ (n, n)
    repeats: int       # most steady calls per measurement
    budget_s: float    # the attention grid's wall time (from the run's start); see run()
    gqa: tuple = (4, 8, 2, 1024, 64)  # B, H, Hkv, L, D of the grouped-query rows
    # B, d_in, H, Hkv, Dh, max_length M, P tokens prefilled (and held by the decode step's cache)
    decode: tuple = (1, 512, 8, 2, 64, 4096, 2048)
    # long sequences, causal: (B, H, D), the lengths L, and the longest L the explicit ones run at
    long: tuple = ((1, 1, 64), (4096, 16384, 65536), 4096)
    # sinks and chunked attention, causal: B, H, L, D, attention_chunk_size
    modern: tuple = (1, 4, 4096, 64, 1024)
    # positions, float32 forward: a vision tower's layer over one S × S image (B, S, d, H, Dh;
    # Qwen2-VL's tower, non-causal, axial RoPE) and a text tower's prefill (B, L, d, H, Hkv, Dh,
    # the S of an S × S image inside the text, MRoPE's chunked and interleaved mrope_section)
    positions_vision: tuple = (1, 32, 1280, 16, 80)
    positions_text: tuple = (1, 4096, 2048, 16, 2, 128, 32, (16, 24, 24), (24, 20, 20))
    # gated delta-rule linear attention, float32: H, D, and per batch size B the lengths L of
    # its forward rows and the longest L of its forward+backward rows (a decode step each B)
    # (transformers' forward+backward grows faster than L: 5.7 s at L = 4096, B = 1, on this
    # project's 2-core host, about 18 times its 1024's, hence the shorter backward rows)
    linear: tuple = (16, 128, ((1, (1024, 4096, 8192, 16384, 32768), 8192), (4, (1024, 4096), 1024)))
    # a given selection, causal, float32 (golden.bench.sparse): B, the heads (H, Hkv) of each
    # row, the widths D, the lengths L, k keys chosen per row, the longest L of the dense call
    # with the selection as an (L, L) mask, the section's budget in seconds. One head (every
    # head its own keys: HF's DeepseekV32Attention expands its latent per head) and 16 query
    # heads on one kv head (the absorbed MQA form of DeepSeek-V3.2's inference kernels: the
    # sparse cores gather each row's keys once for the 16 heads).
    sparse: tuple = (1, ((1, 1), (16, 1)), (128,), (8192, 16384, 32768, 65536), 2048, 16384,
                     1500.0)


def _self(L, B=4, H=8, D=64):
    return Shape(B, H, L, L, D)


# Self-attention smallest first, then cross-attention; the costly L=2048 last, so that the
# budget check paces its forward+backward with everything else already measured.
FULL = Grid(shapes=(_self(128), _self(512), _self(1024), Shape(4, 8, 256, 1024, 64), _self(2048)),
            bf16_shape=_self(1024), matmul_n=2048, repeats=10, budget_s=300.0)
QUICK = Grid(shapes=(_self(64, B=1, H=2, D=16), Shape(1, 2, 32, 64, 16)),
             bf16_shape=_self(64, B=1, H=2, D=16), matmul_n=256, repeats=3, budget_s=60.0,
             gqa=(1, 4, 2, 64, 16), decode=(1, 32, 4, 2, 8, 64, 16),
             long=((1, 1, 16), (256, 512), 256), modern=(1, 2, 256, 16, 64),
             positions_vision=(1, 4, 32, 2, 16),
             positions_text=(1, 48, 32, 4, 2, 16, 4, (2, 3, 3), (4, 2, 2)),
             linear=(2, 16, ((1, (64, 160), 64),)),
             sparse=(1, ((2, 2), (4, 1)), (16,), (128, 256, 512), 16, 256, 300.0))
