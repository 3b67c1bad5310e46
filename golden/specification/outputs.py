"""Grouped-query attention's output stage, its settings checked and its parameters' shapes: the
output gate and the norm of the heads' output, both between the core and out_proj.

    O (B, N, L, Dh)  ->  norm (output_norm)  ->  ⊙ act(x W_gate + b_gate) (output_gate)  ->  out_proj

``output_gate`` (the activation, and whether one gate value serves a whole head):
    "sigmoid"            σ per feature, W_gate (d_in, N·Dh): Qwen3-Next, AFMoE (True means this)
    "sigmoid_per_head"   σ per head, W_gate (d_in, N), broadcast over Dh: Step-3.5/3.7-Flash
    "softplus"           softplus per feature: Laguna's gating = "per-element"
    "softplus_per_head"  softplus per head: Laguna's gating = "per-head"
``gate_bias`` (default: as qkv_bias): whether the gate has its bias b_gate (Beam's per-head bias
is b_gate with each head's value on its Dh features).
``output_norm`` (ε = output_norm_eps):
    "rms"                RMSNorm over all heads' features N·Dh, weight output_norm_weight (N·Dh,):
                         BitNet's
                         attn_sub_norm
    "rms_per_head"       RMS normalisation of each head over its Dh, no weight: Muse Spark's o_norm

Both twins run ``normalized_output`` and ``gated_output`` (framework functions passed in, as
golden.specification.decoder's); the float64 reference states the same maths on its own
(golden.reference.block).

Shape legend: N (h) query heads, Dh (dh) head width, d_in the model width, L tokens.
"""

from __future__ import annotations

from golden.specification.decoder import qk_normalize

# kind -> (activation, one gate per head)
OUTPUT_GATES = {"sigmoid": ("sigmoid", False), "sigmoid_per_head": ("sigmoid", True),
                "softplus": ("softplus", False), "softplus_per_head": ("softplus", True)}
OUTPUT_NORMS = ("rms", "rms_per_head")


def gate_kind(output_gate):
    """(activation, per_head) of an ``output_gate`` setting, or None without a gate (False)."""
    if output_gate is False:
        return None
    return OUTPUT_GATES["sigmoid" if output_gate is True else output_gate]


def check_output_gate(name, kind) -> None:
    if kind is not False and kind is not True and kind not in OUTPUT_GATES:
        raise ValueError(f"{name} should be False, True (= 'sigmoid') or one of "
                         f"{', '.join(map(repr, OUTPUT_GATES))}, got {kind!r}")


def check_output_norm(name, kind) -> None:
    if kind is not None and kind not in OUTPUT_NORMS:
        raise ValueError(f"{name} should be None or one of {', '.join(map(repr, OUTPUT_NORMS))}, "
                         f"got {kind!r}")


def gate_has_bias(c) -> bool:
    return c["qkv_bias"] if c["gate_bias"] is None else c["gate_bias"]


def output_shapes(c, h, dh) -> dict:
    """W_gate (and b_gate with gate_bias, default qkv_bias) and output_norm_weight, as the
    configuration has them; output_norm_eps and gate_bias left at their defaults without an
    output norm or a gate."""
    if c["output_norm"] is None and c["output_norm_eps"] != 1e-6:
        raise ValueError(f"output_norm_eps should be 1e-06 (its default) unless output_norm is "
                         f"set, got {c['output_norm_eps']!r}")
    shapes = {}
    gate = gate_kind(c["output_gate"])
    if gate is None and c["gate_bias"] is not None:
        raise ValueError(f"gate_bias should be None (its default) unless output_gate is set, "
                         f"got {c['gate_bias']!r}")
    if gate is not None:
        width = h if gate[1] else h * dh
        shapes["W_gate"] = (c["d_in"], width)
        if gate_has_bias(c):
            shapes["b_gate"] = (width,)
    if c["output_norm"] == "rms":
        shapes["output_norm_weight"] = (h * dh,)
    return shapes


def normalized_output(merged, kind, weight, eps, heads, *, mean, rsqrt):
    """The output norm ``kind`` of merged (..., L, N·Dh), in merged's dtype (the caller widens
    it first): over all of a token's heads with ``weight`` (N·Dh,) ("rms"), or over each head's
    Dh without weight ("rms_per_head")."""
    if kind == "rms":
        return qk_normalize(merged, "rms", weight, eps, mean=mean, rsqrt=rsqrt)
    shaped = merged.reshape(merged.shape[:-1] + (heads, -1))  # (..., L, N, Dh)
    return qk_normalize(shaped, "l2", None, eps, mean=mean, rsqrt=rsqrt).reshape(merged.shape)


def gated_output(merged, z, kind, heads, *, sigmoid, softplus):
    """merged (..., L, N·Dh) times act(z), ``kind`` a gate_kind: z (..., L, N·Dh), or (..., L,
    N) per head, each value on its head's Dh features."""
    activation, per_head = kind
    a = sigmoid(z) if activation == "sigmoid" else softplus(z)
    if not per_head:
        return merged * a
    shaped = merged.reshape(merged.shape[:-1] + (heads, -1))  # (..., L, N, Dh)
    return (shaped * a[..., None]).reshape(merged.shape)
