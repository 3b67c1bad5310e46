"""The recurrent token mixers, described once (issue 43): gated delta-rule linear attention.

Not softmax attention: each head carries a state S (Dk, Dv) from token to token, so these are
kept out of golden.specification.variants' ``VARIANTS`` (whose every entry is attention with
weights, and which the generic tests sweep) and listed in ``MIXERS`` here, each a
golden.specification.variants.Variant (its arguments with their checks, its parameters' shapes in
the neutral layout, its inputs). Both twins' ``build`` and the float64 reference
(golden.reference.delta_rule) read them from here.

Shape legend: B batch, L tokens, Hk key heads of width Dk, Hv value heads of width Dv (Hk divides
Hv: value head h reads key head h // (Hv/Hk), Hugging Face's ``repeat_interleave``), K the
causal convolution's width, C = 2·Hk·Dk + Hv·Dv its channels.

``gated_delta_net`` (GatedDeltaNet: Qwen3-Next, Qwen3.5/3.6, OLMo hybrid), on x (B, L, d_in) with
mask (B, L) bool, True = a real token (None: all real):
    x̃ = x ⊙ mask                                  padded tokens zeroed at the input (HF's
                                                   apply_mask_to_padding_states)
    q, k, v = SiLU(conv_K(x̃ W_query)), ...        a causal depthwise convolution per channel,
                                                   conv_*[c] (K,) over the last K inputs (the
                                                   earliest first), zeros before the first
    q̂ = q / √(Σ q² + ε_l2) · Dk^−1/2, k̂ = k / √(Σ k² + ε_l2)     per head, ε_l2 = l2norm_eps
    β = σ(x̃ W_beta)   (2σ with allow_neg_eigval: OLMo hybrid)    (B, L, Hv)
    g = −exp(A_log) · softplus(x̃ W_decay + dt_bias)              (B, L, Hv), the log-decay
    S′_t = e^{g_t} S_{t−1};  S_t = S′_t + k̂_t ⊗ β_t (v_t − S′_tᵀ k̂_t);  o_t = S_tᵀ q̂_t
    y = merge(RMSNorm_Dv(o) · norm_weight ⊙ SiLU(x̃ W_gate)) W_out    RMSNorm ε = norm_eps
S_0 = 0, or a cache's state; no biases anywhere (none of the families has one).

``kimi_delta_attention`` (KimiDeltaAttention: Kimi Linear, GLM-5.3-Flash, Ling 3.0), the same
with H heads of D (Hk = Hv, Dk = Dv) and three differences:
    the decay per key channel: f = x̃ W_decay (or x̃ W_decay_a W_decay_b, rank decay_rank),
        g = −exp(A_log_h) · softplus(f + dt_bias)               forget_gate "softplus"
        g = λ · σ(exp(A_log_h) · (f + dt_bias)), λ < 0          "bounded_sigmoid", λ =
                                                                  decay_lower_bound (GLM-5.3,
                                                                  Ling 3.0's safe gate)
        (B, L, H, D), S′_t = diag(e^{g_t}) S_{t−1}
    β = σ(x̃ W_beta)
    y = merge(RMSNorm_D(o) · norm_weight ⊙ σ(x̃ W_gate)) W_out   (W_gate or W_gate_a W_gate_b,
                                                                  rank gate_rank: σ, not SiLU)

``lightning_attention`` (LightningAttention: MiniMax-Text-01 / M1's linear layers), H heads of
D, no convolution and no delta rule, a fixed decay per head:
    q, k, v = SiLU(x̃ W_query), SiLU(x̃ W_key), SiLU(x̃ W_value)     (no normalisation, no scale)
    S_t = e^{−slope_h} S_{t−1} + k_t ⊗ v_t;  o_t = S_tᵀ q_t
        (o_t = Σ_{s≤t} e^{−slope_h (t − s)} (q_t·k_s) v_s)
    y = (σ(x̃ W_gate) ⊙ RMSNorm_{H·D}(merge(o)) · norm_weight) W_out   the norm over all heads
``slope`` (H,) a parameter (MiniMax's slope_rate buffer: 2^{−8(h+1)/H} scaled by the layer's
depth). ``block_size``: the chunk length of the chunked implementations (MiniMax's block_size,
the length of its decay tables); the function does not depend on it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from golden.specification.settings import epsilon, positive, positive_or_none
from golden.specification.validate import check_flags, check_sequence, dtype_name
from golden.specification.description import Arg, Variant


class RecurrentCache(NamedTuple):
    """A recurrent mixer's cache, the same fields in torch and JAX (a pytree in JAX): not keys
    and values per token but what the recurrence carries.

    conv: (B, K − 1, C), the last K − 1 projected inputs before the convolution (channels
    [query | key | value] as the neutral W_query, W_key, W_value order them; zeros before the
    first token, padded tokens' zero inputs included); state: (B, Hv, Dk, Dv), the delta rule's
    S after the last token; lengths: (B,) int32, the tokens seen per row (padding included).
    Unbatched: the same without B. A call never changes the cache it is given: it returns a new
    one. Made by a module's ``init_cache(batch_size, max_length)`` (zeros; max_length bounds
    the tokens a cache takes, as the KV cache's, though the state's size does not grow)."""

    conv: Any
    state: Any
    lengths: Any


def sizes(config) -> tuple:
    """(Hk, Hv, Dk, Dv) of a mixer's full configuration (Kimi Delta Attention, lightning
    attention: H, H, D, D)."""
    c = config
    if "num_heads" in c:
        return c["num_heads"], c["num_heads"], c["head_dim"], c["head_dim"]
    return c["num_k_heads"], c["num_v_heads"], c["head_k_dim"], c["head_v_dim"]


def cache_shapes(config, batch_size=None) -> dict:
    """{field: shape} of a RecurrentCache for the mixer's full configuration (``batch_size``
    None: unbatched)."""
    hk, hv, dk, dv = sizes(config)
    lead = () if batch_size is None else (batch_size,)
    width = config.get("conv_kernel", 1) - 1  # lightning attention: no convolution
    return {"conv": lead + (width, 2 * hk * dk + hv * dv),
            "state": lead + (hv, dk, dv), "lengths": lead}


def check_cache(config, cache, lead) -> None:
    """ValueError unless ``cache`` is a RecurrentCache whose fields have the shapes
    ``cache_shapes`` gives for the full ``config`` and the input's leading (batch) shape
    ``lead`` (() unbatched), each field named."""
    if not isinstance(cache, RecurrentCache):
        raise ValueError(f"cache should be a RecurrentCache (conv, state, lengths), as the "
                         f"module's init_cache makes, got {type(cache).__name__}")
    want = cache_shapes(config, lead[0] if lead else None)
    for name, shape in want.items():
        got = tuple(getattr(getattr(cache, name), "shape", ()))
        if got != shape:
            raise ValueError(f"cache.{name} shape should be {shape} (for this module and an "
                             f"input of batch shape {tuple(lead)}), got {got}")


def _flag(name, b) -> None:
    check_flags(**{name: b})


def _gated_delta_shapes(c):
    hk, hv, dk, dv = c["num_k_heads"], c["num_v_heads"], c["head_k_dim"], c["head_v_dim"]
    if hv % hk:
        raise ValueError(f"num_k_heads should divide num_v_heads = {hv} (each key head serves "
                         f"num_v_heads // num_k_heads value heads), got {hk}")
    d_in, k = c["d_in"], c["conv_kernel"]
    d_out = d_in if c["d_out"] is None else c["d_out"]
    return {"W_query": (d_in, hk * dk), "W_key": (d_in, hk * dk), "W_value": (d_in, hv * dv),
            "W_gate": (d_in, hv * dv), "W_beta": (d_in, hv), "W_decay": (d_in, hv),
            "W_out": (hv * dv, d_out), "conv_query": (hk * dk, k), "conv_key": (hk * dk, k),
            "conv_value": (hv * dv, k), "A_log": (hv,), "dt_bias": (hv,),
            "norm_weight": (dv,)}


def _sequence_inputs(c, arrays, rate=0.0):
    """x (B, L, d_in) or (L, d_in) and a mask (B, L) (or (L,)) of booleans; returns None (no
    attention weights)."""
    x, mask = arrays["x"], arrays.get("mask")
    lead = check_sequence("x", x, "d_in", c["d_in"])
    if mask is not None:
        check_padding_mask(mask, lead, x.shape[-2])
    return None


def check_padding_mask(mask, lead, length) -> None:
    """A recurrent mixer's mask: booleans of shape lead + (L,), True = a real token."""
    want = tuple(lead) + (length,)
    got = dtype_name(mask.dtype) if hasattr(mask, "dtype") else type(mask).__name__
    if got != "bool":
        raise ValueError(f"mask dtype should be bool (True = a real token), got {got}")
    if tuple(mask.shape) != want:
        raise ValueError(f"mask shape should be {want} (one flag per token, True = real, as "
                         f"Hugging Face's attention_mask), got {tuple(mask.shape)}")


GATED_DELTA_NET = Variant(
    "gated_delta_net", "GatedDeltaNet",
    (Arg("d_in", positive), Arg("num_k_heads", positive), Arg("num_v_heads", positive),
     Arg("head_k_dim", positive), Arg("head_v_dim", positive),
     Arg("d_out", positive_or_none, None), Arg("conv_kernel", positive, 4),
     Arg("norm_eps", epsilon, 1e-6), Arg("l2norm_eps", epsilon, 1e-6),
     Arg("allow_neg_eigval", _flag, False)),
    shapes=_gated_delta_shapes, check_inputs=_sequence_inputs,
    layers={"query": "W_query", "key": "W_key", "value": "W_value", "gate": "W_gate",
            "beta": "W_beta", "decay": "W_decay", "out": "out_proj"},
    vectors=("conv_query", "conv_key", "conv_value", "A_log", "dt_bias", "norm_weight"),
    sample=dict(d_in=5, num_k_heads=2, num_v_heads=4, head_k_dim=3, head_v_dim=6, d_out=7,
                conv_kernel=3))

FORGET_GATES = ("softplus", "bounded_sigmoid")


def _forget_gate(name, kind) -> None:
    if kind not in FORGET_GATES:
        raise ValueError(f"{name} should be one of {', '.join(map(repr, FORGET_GATES))}, got "
                         f"{kind!r}")


def _lower_bound(name, x) -> None:
    if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))
                          or not x < 0 or x != x or x in (float("-inf"),)):
        raise ValueError(f"{name} should be None or a finite number < 0 (the log-decay's lower "
                         f"bound), got {x!r}")


def _low_rank(shapes, name, d_in, rank, width) -> None:
    if rank is None:
        shapes[name] = (d_in, width)
    else:
        shapes[f"{name}_a"], shapes[f"{name}_b"] = (d_in, rank), (rank, width)


def _kimi_delta_shapes(c):
    h, d, d_in, k = c["num_heads"], c["head_dim"], c["d_in"], c["conv_kernel"]
    if (c["forget_gate"] == "bounded_sigmoid") != (c["decay_lower_bound"] is not None):
        raise ValueError(f"decay_lower_bound should be a number < 0 with forget_gate "
                         f"'bounded_sigmoid' and None with 'softplus', got "
                         f"{c['decay_lower_bound']!r} with {c['forget_gate']!r}")
    d_out = d_in if c["d_out"] is None else c["d_out"]
    shapes = {"W_query": (d_in, h * d), "W_key": (d_in, h * d), "W_value": (d_in, h * d),
              "W_beta": (d_in, h)}
    _low_rank(shapes, "W_decay", d_in, c["decay_rank"], h * d)
    _low_rank(shapes, "W_gate", d_in, c["gate_rank"], h * d)
    shapes.update({"W_out": (h * d, d_out), "conv_query": (h * d, k), "conv_key": (h * d, k),
                   "conv_value": (h * d, k), "A_log": (h,), "dt_bias": (h * d,),
                   "norm_weight": (d,)})
    return shapes


KIMI_DELTA_ATTENTION = Variant(
    "kimi_delta_attention", "KimiDeltaAttention",
    (Arg("d_in", positive), Arg("num_heads", positive), Arg("head_dim", positive),
     Arg("d_out", positive_or_none, None), Arg("conv_kernel", positive, 4),
     Arg("norm_eps", epsilon, 1e-6), Arg("l2norm_eps", epsilon, 1e-6),
     Arg("decay_rank", positive_or_none, None), Arg("gate_rank", positive_or_none, None),
     Arg("forget_gate", _forget_gate, "softplus"),
     Arg("decay_lower_bound", _lower_bound, None)),
    shapes=_kimi_delta_shapes, check_inputs=_sequence_inputs,
    layers={"query": "W_query", "key": "W_key", "value": "W_value", "beta": "W_beta",
            "decay": "W_decay", "decay_a": "W_decay_a", "decay_b": "W_decay_b",
            "gate": "W_gate", "gate_a": "W_gate_a", "gate_b": "W_gate_b", "out": "out_proj"},
    vectors=("conv_query", "conv_key", "conv_value", "A_log", "dt_bias", "norm_weight"),
    sample=dict(d_in=5, num_heads=2, head_dim=4, d_out=7, conv_kernel=3, decay_rank=3,
                gate_rank=2))

def _lightning_shapes(c):
    h, d, d_in = c["num_heads"], c["head_dim"], c["d_in"]
    d_out = d_in if c["d_out"] is None else c["d_out"]
    return {"W_query": (d_in, h * d), "W_key": (d_in, h * d), "W_value": (d_in, h * d),
            "W_gate": (d_in, h * d), "W_out": (h * d, d_out), "norm_weight": (h * d,),
            "slope": (h,)}


LIGHTNING_ATTENTION = Variant(
    "lightning_attention", "LightningAttention",
    (Arg("d_in", positive), Arg("num_heads", positive), Arg("head_dim", positive),
     Arg("d_out", positive_or_none, None), Arg("norm_eps", epsilon, 1e-6),
     Arg("block_size", positive, 256)),
    shapes=_lightning_shapes, check_inputs=_sequence_inputs,
    layers={"query": "W_query", "key": "W_key", "value": "W_value", "gate": "W_gate",
            "out": "out_proj"},
    vectors=("norm_weight", "slope"),
    sample=dict(d_in=5, num_heads=3, head_dim=4, d_out=7))

MIXERS = {v.name: v for v in (GATED_DELTA_NET, KIMI_DELTA_ATTENTION, LIGHTNING_ATTENTION)}


def get(name) -> Variant:
    """A recurrent mixer's description by name; ValueError listing the known ones otherwise."""
    if name not in MIXERS:
        raise ValueError(f"mixer should be one of {', '.join(MIXERS)}, got {name!r}")
    return MIXERS[name]


# ---- the twins' checks of a call (issue 43's torch twin) --------------------------------------

def check_cache_dtypes(cache) -> None:
    """ValueError unless a RecurrentCache's conv and state are float and its lengths integers
    (``check_cache`` reads the shapes)."""
    for field, kinds, what in (("conv", ("float", "bfloat"), "a float"),
                               ("state", ("float", "bfloat"), "a float"),
                               ("lengths", ("int", "uint"), "an integer")):
        name = dtype_name(getattr(cache, field).dtype)
        if not name.startswith(kinds):
            raise ValueError(f"cache.{field} dtype should be {what} dtype, got {name}")


def check_delta_rule_inputs(q, k, v, g, beta, initial_state=None, chunk_size=64) -> None:
    """The delta-rule core's arrays: q, k (B, H, L, Dk), v (B, H, L, Dv), g (B, H, L) or per key
    channel (B, H, L, Dk), beta (B, H, L), initial_state (B, H, Dk, Dv) or None; chunk_size a
    positive int."""
    if len(q.shape) != 4:
        raise ValueError(f"q shape should be (B, H, L, Dk), got {tuple(q.shape)}")
    b, h, length, dk = q.shape
    dv = v.shape[-1] if len(v.shape) == 4 else None
    wants = [("k", k, "(B, H, L, Dk)", (b, h, length, dk)),
             ("v", v, "(B, H, L, Dv)", (b, h, length, dv)),
             ("g", g, "(B, H, L) or (B, H, L, Dk)",
              (b, h, length) + ((dk,) if len(g.shape) == 4 else ())),
             ("beta", beta, "(B, H, L)", (b, h, length))]
    if initial_state is not None:
        wants.append(("initial_state", initial_state, "(B, H, Dk, Dv)", (b, h, dk, dv)))
    for name, a, letters, want in wants:
        if tuple(a.shape) != want:
            raise ValueError(f"{name} shape should be {letters} = {want}, got {tuple(a.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size should be a positive int, got {chunk_size!r}")


def check_lightning_inputs(q, k, v, slope, initial_state=None, block_size=256) -> None:
    """Lightning attention's core arrays: q, k (B, H, L, Dk), v (B, H, L, Dv), slope (H,),
    initial_state (B, H, Dk, Dv) or None; block_size a positive int."""
    if len(q.shape) != 4:
        raise ValueError(f"q shape should be (B, H, L, Dk), got {tuple(q.shape)}")
    b, h, length, dk = q.shape
    dv = v.shape[-1] if len(v.shape) == 4 else None
    wants = [("k", k, "(B, H, L, Dk)", (b, h, length, dk)),
             ("v", v, "(B, H, L, Dv)", (b, h, length, dv)), ("slope", slope, "(H,)", (h,))]
    if initial_state is not None:
        wants.append(("initial_state", initial_state, "(B, H, Dk, Dv)", (b, h, dk, dv)))
    for name, a, letters, want in wants:
        if tuple(a.shape) != want:
            raise ValueError(f"{name} shape should be {letters} = {want}, got {tuple(a.shape)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size should be a positive int, got {block_size!r}")
