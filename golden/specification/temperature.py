"""The query temperature: q times a factor that grows with the token's position p (0-based), the
kinds of ``query_temperature`` that 2025–26 decoders use, checked, and their factors.

    {"beta": β, "floor_scale": F, "shift": s}        1 + β·ln(1 + ⌊(p + s)/F⌋)    Llama 4 (s = 1),
                                                     Ministral 3 (s = 0); "kind": "llama4" implied
    {"kind": "power", "alpha": α, "length": n}       (1 + (p + 1)/n)^α            Beam (α 0.1, n 2048)
    {"kind": "log", "alpha": α, "length": n}         1 + α·ln(max((p + 1)/n, 1))  Inkling
    {"kind": "learned"}                              s_h·ln(p + 1) + b_h per head  Mistral Large 4,
                                                     s and b the parameters temperature_scale and
                                                     temperature_bias (N,)

``temperature`` computes the fixed kinds' factors from framework functions the caller passes
(both twins run it); the float64 reference states the same maths on its own
(golden.reference.stages.temperature_factors).

Shape legend: N heads, L tokens; positions (L,) or (B, L).
"""

from __future__ import annotations

from golden.specification.settings import positive
from golden.specification.validate import check_scale

TEMPERATURES = {"llama4": ("beta", "floor_scale", "shift"), "power": ("alpha", "length"),
                "log": ("alpha", "length"), "learned": ()}
TEMPERATURE_FIELDS = TEMPERATURES["llama4"]  # a dict of these alone is Llama 4's kind


def temperature_kind(t) -> str:
    """The kind of a checked ``query_temperature`` dict."""
    return t.get("kind", "llama4")


def check_temperature(name, t) -> None:
    """None or a dict of one kind's fields (its "kind" given, or Llama 4's fields alone)."""
    if t is None:
        return
    kind = t.get("kind", "llama4") if isinstance(t, dict) else None
    if kind not in TEMPERATURES:
        got = type(t).__name__ if not isinstance(t, dict) else repr(kind)
        raise ValueError(f"{name} should be None or a dict: Llama 4's keys "
                         f"{', '.join(TEMPERATURE_FIELDS)}, or 'kind' one of "
                         f"{', '.join(map(repr, TEMPERATURES))} with its keys, got {got}")
    fields = set(TEMPERATURES[kind]) | ({"kind"} if "kind" in t else set())
    if set(t) != fields:
        raise ValueError(f"{name} of kind {kind!r} should have the keys "
                         f"{', '.join(sorted(fields))}, got {', '.join(sorted(t))}")
    for field in ("beta", "alpha"):
        if field in t:
            if t[field] is None:
                raise ValueError(f"{name}[{field!r}] should be a finite number, got None")
            check_scale(f"{name}[{field!r}]", t[field])
    for field in ("floor_scale", "length"):
        if field in t:
            positive(f"{name}[{field!r}]", t[field])
    if "shift" in t and (t["shift"] not in (0, 1) or isinstance(t["shift"], bool)):
        raise ValueError(f"{name}['shift'] should be 0 or 1, got {t['shift']!r}")


def temperature_shapes(c) -> dict:
    """The learned kind's parameters temperature_scale and temperature_bias (N,)."""
    t = c["query_temperature"]
    if t is None or temperature_kind(t) != "learned":
        return {}
    return {"temperature_scale": (c["num_heads"],), "temperature_bias": (c["num_heads"],)}


def temperature(positions, t, *, real, log1p, exp=None):
    """The factors of a fixed kind (not "learned") at integer ``positions``, as they are shaped:
    ``real`` turns integers into the compute dtype, ``log1p`` and ``exp`` (power only) run on
    it."""
    kind = temperature_kind(t)
    if kind == "llama4":
        return 1 + t["beta"] * log1p(real((positions + t["shift"]) // t["floor_scale"]))
    if kind == "power":  # as Beam writes it: exp(α·ln(1 + (p + 1)/n))
        return exp(t["alpha"] * log1p(real(positions + 1) / t["length"]))
    # ln(max((p + 1)/n, 1)) = ln(1 + max(p + 1 − n, 0)/n)
    excess = positions + 1 - t["length"]
    return 1 + t["alpha"] * log1p(real(excess * (excess > 0)) / t["length"])


def learned_temperature(positions, scale, bias, *, real, log1p):
    """Mistral Large 4's factors s_h·ln(p + 1) + b_h (..., N, L) at ``positions`` (L,) or (B,
    L); ``scale`` and ``bias`` (N,) in the compute dtype."""
    return scale[:, None] * log1p(real(positions))[..., None, :] + bias[:, None]
