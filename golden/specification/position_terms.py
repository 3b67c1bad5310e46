"""Grouped-query attention's position terms, their settings checked and their parameters'
shapes (the rows of golden.specification.variants' description that say them): ALiBi, T5's and
Phi-4's relative buckets, and the relative positions (Transformer-XL's, Shaw's, the USM
Conformer's); also its input norm and its (left, right) window, checked here beside them.

``position_shapes(c, h, dh)`` checks the combination (one position bias at a time, each
setting given only with its term) and returns the parameters the terms add; the ``_name(name,
value)`` checks are the variant's ``Arg`` checks of single settings.

Shape legend: N (h) query heads, Dh (dh) head width, d_in the model width, M a table's farthest
distance.
"""

from __future__ import annotations

from golden.specification.decoder import ALIBI_KINDS, BUCKET_RULES, RELATIVE_POSITIONS
from golden.specification.settings import epsilon, positive_or_none


def position_shapes(c, h, dh) -> dict:
    """The parameters (name -> shape) of the configuration's position terms, each combination
    checked first."""
    if c["alibi"] != "mpt" and c["alibi_bias_max"] != 8:
        raise ValueError(f"alibi_bias_max should be 8 (its default) unless alibi is 'mpt', got "
                         f"{c['alibi_bias_max']!r} with alibi = {c['alibi']!r}")
    _relative_buckets(c)
    _shaw(c)
    shapes = {}
    if c["relative_attention_num_buckets"] is not None:
        shapes["relative_attention_bias"] = (c["relative_attention_num_buckets"], h)
    if c["relative_positions"] in ("transformer_xl", "conformer_timing"):  # a projected table
        _transformer_xl(c)
        shapes["W_pos"] = (c["d_in"], h * dh)
        if c["relative_positions"] == "transformer_xl":
            shapes.update(bias_u=(h, dh), bias_v=(h, dh))
    if c["relative_positions"] == "shaw":
        shapes["relative_key_table"] = (2 * c["relative_max_distance"] + 1, dh)
    _conformer_timing(c, shapes, dh)
    return shapes


def check_alibi(name, kind) -> None:
    if kind is not None and kind not in ALIBI_KINDS:
        raise ValueError(f"{name} should be None or one of {', '.join(map(repr, ALIBI_KINDS))}, "
                         f"got {kind!r}")


def check_relative_positions(name, kind) -> None:
    if kind is not None and kind not in RELATIVE_POSITIONS:
        raise ValueError(f"{name} should be None or one of "
                         f"{', '.join(map(repr, RELATIVE_POSITIONS))}, got {kind!r}")


def check_bucket_rule(name, rule) -> None:
    if rule not in BUCKET_RULES:
        raise ValueError(f"{name} should be one of {', '.join(map(repr, BUCKET_RULES))}, got "
                         f"{rule!r}")


def check_alibi_bias_max(name, x) -> None:
    """A finite number > 0 (MPT's alibi_bias_max)."""
    epsilon(name, x)


def _relative_buckets(c) -> None:
    """Relative buckets: T5's (max_exact = (num_buckets, halved when bidirectional) // 2 exact
    buckets, at least 1, and max_distance beyond them) or the clipped distances (num_buckets
    2·max_distance, or max_distance when symmetric); max_distance and the rule left at their
    defaults without them."""
    nb, far = c["relative_attention_num_buckets"], c["relative_attention_max_distance"]
    rule = c["relative_attention_buckets"]
    if nb is None:
        if far != 128:
            raise ValueError(f"relative_attention_max_distance should be 128 (its default) "
                             f"unless relative_attention_num_buckets is set, got {far!r}")
        if rule != "t5":
            raise ValueError(f"relative_attention_buckets should be 't5' (its default) unless "
                             f"relative_attention_num_buckets is set, got {rule!r}")
        return
    if c["alibi"] is not None:
        raise ValueError(f"alibi should be None with relative_attention_num_buckets (one "
                         f"position bias), got {c['alibi']!r}")
    if rule != "t5":
        rows = 2 * far if rule == "clipped" else far
        if nb != rows:
            raise ValueError(f"relative_attention_num_buckets should be {rows} with "
                             f"relative_attention_buckets={rule!r} (relative_attention_max_"
                             f"distance {far}: one bucket per clipped distance), got {nb}")
        return
    least = 2 if c["causal"] else 4
    if nb < least:
        raise ValueError(f"relative_attention_num_buckets should be at least {least} "
                         f"({'causal' if c['causal'] else 'bidirectional'}), got {nb}")
    max_exact = (nb if c["causal"] else nb // 2) // 2
    if far <= max_exact:
        raise ValueError(f"relative_attention_max_distance should exceed the {max_exact} exact "
                         f"buckets, got {far}")


def _transformer_xl(c) -> None:
    """Transformer-XL's relative positions: the sinusoidal table is d_in wide (its sin and cos
    in pairs: d_in even), and it is the one position bias."""
    if c["d_in"] % 2:
        raise ValueError(f"d_in should be even with relative_positions (the sinusoidal table's "
                         f"sin and cos pairs), got {c['d_in']}")
    for other in ("alibi", "relative_attention_num_buckets"):
        if c[other] is not None:
            raise ValueError(f"{other} should be None with relative_positions (one position "
                             f"bias), got {c[other]!r}")


def _shaw(c) -> None:
    """Shaw's relative positions: relative_max_distance M (the table's rows: distances −M … M)
    given with them and only with them, and they are the one position bias."""
    far, shaw = c["relative_max_distance"], c["relative_positions"] == "shaw"
    if shaw and far is None:
        raise ValueError("relative_max_distance should be given with relative_positions='shaw' "
                         "(the table's rows: distances −M … M), got None")
    if not shaw and far is not None:
        raise ValueError(f"relative_max_distance should be None unless relative_positions is "
                         f"'shaw', got {far!r}")
    for other in ("alibi", "relative_attention_num_buckets") if shaw else ():
        if c[other] is not None:
            raise ValueError(f"{other} should be None with relative_positions (one position "
                             f"bias), got {c[other]!r}")


# The norm of the module's input before its projections (Granite Speech's pre_norm inside its
# attention): kind -> an example family. "layer": LayerNorm over d_in with weight and bias.
INPUT_NORMS = {"layer": "Granite Speech's Conformer attention: LayerNorm(d_in), weight and bias"}


def check_input_norm(name, kind) -> None:
    if kind is not None and kind not in INPUT_NORMS:
        raise ValueError(f"{name} should be None or one of {', '.join(map(repr, INPUT_NORMS))}, "
                         f"got {kind!r}")


def input_norm_shapes(c) -> dict:
    """input_norm_weight and input_norm_bias (d_in,) with input_norm; input_norm_eps left at its
    default without."""
    if c["input_norm"] is None:
        if c["input_norm_eps"] != 1e-5:
            raise ValueError(f"input_norm_eps should be 1e-05 (its default) unless input_norm "
                             f"is set, got {c['input_norm_eps']!r}")
        return {}
    return {"input_norm_weight": (c["d_in"],), "input_norm_bias": (c["d_in"],)}
def _conformer_timing(c, shapes, dh) -> None:
    """The USM Conformer's relative positions (Gemma 3n's and Gemma 4's audio attention): a
    learned per_dim_scale (Dh,) on the queries; ``key_scale`` (Gemma 4's constant on the keys)
    only with them; a (left, right) ``sliding_window`` (its left context and lookahead) not
    causal."""
    kind, w = c["relative_positions"], c["sliding_window"]
    if kind == "conformer_timing":
        shapes["per_dim_scale"] = (dh,)
    elif c["key_scale"] is not None:
        raise ValueError(f"key_scale should be None unless relative_positions is "
                         f"'conformer_timing', got {c['key_scale']!r} with relative_positions "
                         f"= {kind!r}")
    if isinstance(w, (tuple, list)) and c["causal"]:
        raise ValueError(f"sliding_window should be an int when causal (a pair (left, right) "
                         f"is a bidirectional window), got {tuple(w)!r}")


def check_sliding_window(name, w) -> None:
    """None, a positive int (Hugging Face's W keys, the query's own included), or a pair (left,
    right) of ints ≥ 0: keys p − left … p + right."""
    if isinstance(w, (tuple, list)):
        if len(w) != 2 or any(not isinstance(n, int) or isinstance(n, bool) or n < 0
                              for n in w):
            raise ValueError(f"{name} should be a positive int or a pair (left, right) of "
                             f"ints >= 0, got {w!r}")
        return
    positive_or_none(name, w)
