"""The declarative list of golden cases. Each case owns its seed: adding one changes no other.

An input spec is a tuple naming how the array is drawn from the case's generator:
    ("normal", shape)                 standard normal, rounded to float32
    ("ints", shape, high)             integers in [-high, high] (exact in any float dtype)
    ("mask", shape, p, dead_rows)     bool, True with probability p; rows listed as index tuples
                                      of the leading axes plus the query index are all False
    ("keep", shape, rate)             dropout keep-mask: True with probability 1 − rate

Shape legend: B=2 batch, H=3 heads, Lq=5 query length, Lk=7 key length, Dk=4, Dv=6.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SDPA = "scaled_dot_product_attention"
B, H, LQ, LK, DK, DV = 2, 3, 5, 7, 4, 6


@dataclass(frozen=True)
class Case:
    name: str
    variant: str
    seed: int
    inputs: dict
    config: dict = field(default_factory=dict)


def _qkv(lead=(B, H), lq=LQ, lk=LK, dk=DK, dv=DV):
    return {"query": ("normal", lead + (lq, dk)), "key": ("normal", lead + (lk, dk)),
            "value": ("normal", lead + (lk, dv))}


CASES = [
    Case("sdpa_plain", SDPA, 101, _qkv()),
    Case("sdpa_causal_square", SDPA, 102, _qkv(lk=LQ), {"is_causal": True}),
    Case("sdpa_causal_rect", SDPA, 103, _qkv(), {"is_causal": True}),
    Case("sdpa_causal_tall", SDPA, 104, _qkv(lq=LK, lk=LQ), {"is_causal": True}),
    Case("sdpa_mask", SDPA, 105, {**_qkv(), "mask": ("mask", (B, 1, LQ, LK), 0.7, ())}),
    Case("sdpa_bias", SDPA, 106, {**_qkv(), "bias": ("normal", (H, LQ, LK))}),
    Case("sdpa_mask_bias", SDPA, 107,
         {**_qkv(), "mask": ("mask", (LQ, LK), 0.6, ()), "bias": ("normal", (B, H, LQ, LK))}),
    Case("sdpa_wide_key", SDPA, 108, _qkv(dk=9, dv=3)),
    Case("sdpa_scale", SDPA, 109, _qkv(), {"scale": 0.3}),
    Case("sdpa_masked_row", SDPA, 110,
         {**_qkv(), "mask": ("mask", (B, H, LQ, LK), 0.7, ((1, 2, 3), (0, 0, 0)))}),
    Case("sdpa_masked_row_causal", SDPA, 111,
         {**_qkv(), "mask": ("mask", (B, 1, LQ, LK), 0.8, ((0, 0, 4),))}, {"is_causal": True}),
    Case("sdpa_unbatched_2d", SDPA, 112, _qkv(lead=())),
    Case("sdpa_unbatched_3d", SDPA, 113, _qkv(lead=(H,))),
    Case("sdpa_dropout", SDPA, 114, {**_qkv(), "dropout_mask": ("keep", (B, H, LQ, LK), 0.25)},
         {"dropout_rate": 0.25}),
    Case("sdpa_dropout_causal_bias", SDPA, 115,
         {**_qkv(), "bias": ("normal", (LK,)), "dropout_mask": ("keep", (B, 1, LQ, LK), 0.4)},
         {"dropout_rate": 0.4, "is_causal": True}),
    # Scores of order 1e3: exp overflows float32 without the max shift. Integer q and k with Dk=4
    # (scale 1/2) keep the scores exact in float32, so the float32 tolerance still applies.
    Case("sdpa_large_logits", SDPA, 116,
         {"query": ("ints", (B, H, LQ, 4), 40), "key": ("ints", (B, H, LK, 4), 40),
          "value": ("normal", (B, H, LK, DV))}),
]
