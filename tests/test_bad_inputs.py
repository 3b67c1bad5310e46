"""Bad input at every public entry point, one table: the cores, rotary_embedding, every module
constructor and call, init_cache, build, export_params, load_params, export_cache, load_cache,
golden.load, the converters, golden.runners.adapt, golden.specification.mapping and the command
line.

Each ``BadInput`` is a call that must raise ``ValueError`` or ``TypeError`` (TypeError where the
argument is not the kind of thing asked for: a list for an array, None for a dict; Python's own
TypeError for a missing or unknown keyword) whose message names the argument, says what was
expected and what it got; ``says_got=False`` marks the few messages that state the problem
another way ("parameter W_key is missing: expected shape (5, 4)"). Entries that exist in both
frameworks are listed once and run in each (ids ``torch-…`` and ``jax-…``).

The command line. User errors exit with status 2 and never print a traceback. Errors found by
the project itself (a missing fixture, a bad --impl, an unwritable report) are one line on
stderr. Errors found by argparse (an unknown option, a bad --dtype) are argparse's standard
form: the sub-command's usage, which argparse wraps over several lines for ``check``, then
one ``attn-parity <command>: error: …`` line. That form is accepted here. The tests check that
the last line is the error line, that it names the option, and that everything before it is
the usage. Most cases run ``golden.cli.main`` in-process. Four run ``python -m golden.cli``
as a user would.

Shape legend: B batch, H heads, Lq query length, Lk key length, Dk key width, Dv value width;
every size is different (B=2, H=3, Lq=5, Lk=7, Dk=4, Dv=6) so a swapped axis cannot pass.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from flax import nnx

import golden
import jax_attn
import torch_attn
from golden import convert as golden_convert
from golden.specification import mapping, variants
from golden.cli import main
from golden.specification.positions import KVCache, LatentCache
from golden.runners import adapt
from tests.helpers import FRAMEWORKS, TWINS, Reference, missing_mixer, other

ROOT = Path(__file__).resolve().parents[1]
Q, K, V = (2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6)
FLOATS = "float16, bfloat16, float32, float64"
E = re.escape


def not_an_array(arg, got):
    """The message for a non-array: torch's core asks for a tensor, everything else an array."""
    return rf"{arg} should be (an array \(NumPy, torch or JAX\)|a torch\.Tensor), got {got}"


@dataclass(frozen=True)
class BadInput:
    id: str
    call: Callable[[], object]
    error: type | tuple
    match: str               # a regex searched for in the message
    says_got: bool = True    # the message says "got …"


CASES: list[BadInput] = []


def case(id, call, error, match, says_got=True) -> None:
    """A bad input of an entry point that has no twin."""
    CASES.append(BadInput(id, call, error, match, says_got))


def twin_case(id, call, error, match, says_got=True, only=FRAMEWORKS) -> None:
    """A bad input run in each framework (``only``: those it exists in): ``call(twin)``."""
    for name in only:
        CASES.append(BadInput(f"{name}-{id}", lambda t=TWINS[name]: call(t), error, match,
                              says_got))


# ---- helpers: arrays, cores, modules ----------------------------------------------------------

def arr(t, shape, dtype="float32"):
    return t.array(np.ones(shape, dtype=dtype))


def core(t, shapes=(Q, K, V), dtypes=("float32",) * 3, **kw):
    """The twin's core on ones of ``shapes``; NumPy keyword arrays become the twin's arrays."""
    q, k, v = (arr(t, s, d) for s, d in zip(shapes, dtypes))
    kw = {n: t.array(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    return t.sdpa(q, k, v, **kw)


_MODULES: dict = {}


def module(t, variant, *, train=False, **config):
    """A module of ``variant`` (its sample configuration, updated by ``config``), in training
    or eval mode; made once per framework and configuration."""
    config = {**variants.get(variant).sample, **config}
    key = (t.name, variant, train, tuple(sorted(config.items())))
    if key not in _MODULES:
        m = t.make(variant, config)
        m.train() if train else m.eval()
        _MODULES[key] = m
    return _MODULES[key]


def make(t, variant, **config):
    """The constructor of ``variant`` called with exactly ``config`` (JAX: and rngs)."""
    return t.make(variant, config)


def params(variant, config=None, **changes):
    """Ones of the neutral parameter shapes of ``variant``'s sample configuration; ``changes``
    replace (an array), drop (None) or add entries."""
    config = variants.get(variant).sample if config is None else config
    out = {n: np.ones(s, np.float32) for n, s in variants.get(variant).param_shapes(config).items()}
    out.update(changes)
    return {n: a for n, a in out.items() if a is not None}


def cache(t, key=(2, 2, 8, 4), value=None, lengths=(2,), dtype="float32", lengths_dtype="int32"):
    """A KVCache of the twin's arrays (GroupedQueryAttention's sample: Nkv = 2, Dh = 4)."""
    return KVCache(arr(t, key, dtype), arr(t, key if value is None else value, dtype),
                   t.array(np.zeros(lengths, dtype=lengths_dtype)))


def gqa_call(t, x=(2, 3, 5), **kw):
    """The sample GroupedQueryAttention (d_in=5, N=6, Nkv=2, Dh=4) in eval mode on ones."""
    return module(t, "grouped_query_attention")(arr(t, x), **kw)


# ---- the cores --------------------------------------------------------------------------------

twin_case("core-query-rank-5", lambda t: core(t, shapes=((1,) + Q, (1,) + K, (1,) + V)),
          ValueError, E("query should have rank 2, 3 or 4: (Lq, Dk), (H, Lq, Dk) or "
                        "(B, H, Lq, Dk), got shape (1, 2, 3, 5, 4)"))
twin_case("core-query-rank-1", lambda t: core(t, shapes=((4,), (4,), (4,))), ValueError,
          E("query should have rank 2, 3 or 4") + ".*" + E("got shape (4,)"))
twin_case("core-query-list",
          lambda t: t.sdpa(np.ones(Q).tolist(), arr(t, K), arr(t, V)), TypeError,
          not_an_array("query", "list"))
twin_case("core-query-numpy", lambda t: t.sdpa(np.ones(Q, np.float32), arr(t, K), arr(t, V)),
          TypeError, E("query should be a torch.Tensor, got ndarray"), only=["torch"])
twin_case("core-key-width", lambda t: core(t, shapes=(Q, (2, 3, 7, 5), V)), ValueError,
          E("key shape should be (B, Hkv, Lk, Dk) = (2, ?, ?, 4), got (2, 3, 7, 5)"))
twin_case("core-key-batch", lambda t: core(t, shapes=(Q, (3, 3, 7, 4), (3, 3, 7, 6))),
          ValueError, E("key shape should be (B, Hkv, Lk, Dk) = (2, ?, ?, 4), got (3, 3, 7, 4)"))
twin_case("core-key-rank", lambda t: core(t, shapes=(Q, (3, 7, 4), V)), ValueError,
          E("key shape should be (B, Hkv, Lk, Dk) = (2, ?, ?, 4), got (3, 7, 4)"))
twin_case("core-value-length", lambda t: core(t, shapes=(Q, K, (2, 3, 6, 6))), ValueError,
          E("value shape should be (B, Hkv, Lk, Dv) = (2, 3, 7, ?), got (2, 3, 6, 6)"))
twin_case("core-value-heads", lambda t: core(t, shapes=(Q, K, (2, 1, 7, 6))), ValueError,
          E("value shape should be (B, Hkv, Lk, Dv) = (2, 3, 7, ?), got (2, 1, 7, 6)"))
twin_case("core-heads-not-multiple",
          lambda t: core(t, shapes=(Q, (2, 2, 7, 4), (2, 2, 7, 6))), ValueError,
          E("key and value heads Hkv should divide the query's H = 3, got Hkv = 2"))
twin_case("core-query-int", lambda t: core(t, dtypes=("int32",) * 3), ValueError,
          E(f"query dtype should be one of {FLOATS}, got int32"))
twin_case("core-value-dtype", lambda t: core(t, dtypes=("float32", "float32", "float16")),
          ValueError, E("value dtype should be float32 (the query's), got float16"))
twin_case("core-mask-float", lambda t: core(t, mask=np.ones((5, 7), np.float32)), ValueError,
          E("mask dtype should be bool (True = may attend), got float32"))
twin_case("core-mask-shape", lambda t: core(t, mask=np.ones((2, 3, 5, 6), bool)), ValueError,
          E("mask shape should broadcast to (B, H, Lq, Lk) = (2, 3, 5, 7), got (2, 3, 5, 6)"))
twin_case("core-mask-list", lambda t: core(t, mask=[[True] * 7] * 5), TypeError,
          not_an_array("mask", "list"))
twin_case("core-bias-int", lambda t: core(t, bias=np.ones((5, 7), np.int32)), ValueError,
          E(f"bias dtype should be one of {FLOATS}, got int32"))
twin_case("core-bias-shape", lambda t: core(t, bias=np.ones((3, 7, 5), np.float32)), ValueError,
          E("bias shape should broadcast to (B, H, Lq, Lk) = (2, 3, 5, 7), got (3, 7, 5)"))
twin_case("core-scale-inf", lambda t: core(t, scale=float("inf")), ValueError,
          E("scale should be a finite number or None, got inf"))
twin_case("core-scale-str", lambda t: core(t, scale="2"), ValueError,
          E("scale should be a finite number or None, got '2'"))
# One validator per kind of argument: a bool is no scale nor rate, in the core as in a constructor
twin_case("core-scale-bool", lambda t: core(t, scale=True), ValueError,
          E("scale should be a finite number or None, got True"))
twin_case("core-dropout-rate-bool", lambda t: core(t, dropout_rate=True), ValueError,
          E("dropout_rate should be in [0, 1), got True"))
twin_case("core-softcap-zero", lambda t: core(t, softcap=0), ValueError,
          E("softcap should be a positive number or None, got 0"))
twin_case("core-softcap-bool", lambda t: core(t, softcap=True), ValueError,
          E("softcap should be a positive number or None, got True"))
WINDOW = "local_window_size should be None, an int ≥ 0 or a pair (left, right) of ints ≥ 0 or None"
twin_case("core-window-triple", lambda t: core(t, local_window_size=(1, 2, 3)), ValueError,
          E(f"{WINDOW}, got (1, 2, 3)"))
twin_case("core-window-float-side", lambda t: core(t, local_window_size=(1.5, None)),
          ValueError, E(f"{WINDOW}, got (1.5, None)"))
twin_case("core-window-str", lambda t: core(t, local_window_size="4"), ValueError,
          E(f"{WINDOW}, got '4'"))
twin_case("core-sinks-shape", lambda t: core(t, sinks=np.ones((2, 3), np.float32)), ValueError,
          E("sinks shape should be (H,) = (3,), got (2, 3)"))
twin_case("core-sinks-unbatched", lambda t: core(t, shapes=((5, 4), (7, 4), (7, 6)),
                                                 sinks=np.ones(1, np.float32)), ValueError,
          E("sinks shape should be () = (), got (1,)"))
twin_case("core-sinks-dtype", lambda t: core(t, sinks=np.ones(3, np.float16)), ValueError,
          E("sinks dtype should be float32 (the query's), got float16"))
twin_case("core-sinks-list", lambda t: core(t, sinks=[0.0, 0.0, 0.0]), TypeError,
          not_an_array("sinks", "list"))
CHUNK = "attention_chunk_size should be None or an int ≥ 1"
twin_case("core-chunk-zero", lambda t: core(t, attention_chunk_size=0), ValueError,
          E(f"{CHUNK}, got 0"))
twin_case("core-chunk-float", lambda t: core(t, attention_chunk_size=2.0), ValueError,
          E(f"{CHUNK}, got 2.0"))
twin_case("core-chunk-bool", lambda t: core(t, attention_chunk_size=True), ValueError,
          E(f"{CHUNK}, got True"))
twin_case("core-offset-python-float", lambda t: core(t, query_offset=1.5), ValueError,
          E("query_offset dtype should be an integer type, got float"))
twin_case("core-offset-negative", lambda t: core(t, query_offset=-1), ValueError,
          E("query_offset should be an int ≥ 0 or an integer array, got -1"))
twin_case("core-offset-shape", lambda t: core(t, query_offset=np.ones((2, 1), np.int32)),
          ValueError, E("query_offset shape should be (B,) = (2,), got (2, 1)"))
twin_case("core-kv-lengths-negative", lambda t: core(t, key_value_seq_lengths=-2), ValueError,
          E("key_value_seq_lengths should be an int ≥ 0 or an integer array, got -2"))
twin_case("core-kv-lengths-shape",
          lambda t: core(t, key_value_seq_lengths=np.ones(3, np.int32)), ValueError,
          E("key_value_seq_lengths shape should be (B,) = (2,), got (3,)"))
twin_case("core-q-lengths-float",
          lambda t: core(t, query_seq_lengths=np.ones(2, np.float32)), ValueError,
          E("query_seq_lengths dtype should be an integer type, got float32"))
twin_case("core-unbatched-lengths-shape",
          lambda t: core(t, shapes=((3, 5, 4), (3, 7, 4), (3, 7, 6)),
                         query_seq_lengths=np.ones(3, np.int32)), ValueError,
          E("query_seq_lengths shape should be () = (), got (3,)"))
twin_case("core-dropout-rate-one", lambda t: core(t, dropout_rate=1.0), ValueError,
          E("dropout_rate should be in [0, 1), got 1.0"))
twin_case("core-dropout-rate-negative", lambda t: core(t, dropout_rate=-0.1), ValueError,
          E("dropout_rate should be in [0, 1), got -0.1"))
twin_case("core-dropout-rate-str", lambda t: core(t, dropout_rate="0.5"), ValueError,
          E("dropout_rate should be in [0, 1), got '0.5'"))
twin_case("core-dropout-mask-shape",
          lambda t: core(t, dropout_rate=0.5, dropout_mask=np.ones((2, 3, 7, 5), bool)),
          ValueError, E("dropout_mask shape should broadcast to (B, H, Lq, Lk) = (2, 3, 5, 7), "
                        "got (2, 3, 7, 5)"))
twin_case("core-dropout-mask-float",
          lambda t: core(t, dropout_rate=0.5, dropout_mask=np.ones((5, 7), np.float32)),
          ValueError, E("dropout_mask dtype should be bool (True = may attend), got float32"))
twin_case("core-dropout-mask-without-rate",
          lambda t: core(t, dropout_mask=np.ones((5, 7), bool)), ValueError,
          E("dropout_mask was given but dropout_rate is 0.0"), says_got=False)
twin_case("core-dropout-rng-int", lambda t: core(t, dropout_rate=0.5, dropout_rng=3), TypeError,
          r"dropout_rng should be a (torch\.Generator|jax\.random key).*, got int")
twin_case("core-dropout-rng-missing", lambda t: core(t, dropout_rate=0.5), ValueError,
          E("dropout_rng should be a jax.random key when dropout_rate > 0 and no dropout_mask "
            "is given, got None"), only=["jax"])
twin_case("core-implementation-unknown", lambda t: core(t, implementation="flash"), ValueError,
          r"implementation should be None or one of 'explicit', .* \((torch|jax)\), "
          r"got 'flash'")
twin_case("core-explicit-weights-only",
          lambda t: core(t, implementation="explicit", block_sizes=(2, 2)), ValueError,
          r"(block_sizes should be None or a pair \(rows, None\)|implementation='explicit' "
          r"cannot run this call: block_sizes is for 'blockwise')", says_got=False)
twin_case("core-return-weights-str", lambda t: core(t, return_weights="yes"), ValueError,
          E("return_weights should be True or False, got 'yes'"))
twin_case("core-is-causal-none", lambda t: core(t, is_causal=None), ValueError,
          E("is_causal should be True or False, got None"))
BLOCKS = "block_sizes should be None or a pair (block_q, block_k) of positive ints"
twin_case("core-block-sizes-zero", lambda t: core(t, block_sizes=(0, 16)), ValueError,
          E(f"{BLOCKS}, got (0, 16)"), only=["jax"])
twin_case("core-block-sizes-int", lambda t: core(t, block_sizes=64), ValueError,
          E(f"{BLOCKS}, got 64"), only=["jax"])

# ---- rotary_embedding -------------------------------------------------------------------------

twin_case("rope-odd-head-dim", lambda t: t.lib.rotary_embedding(arr(t, (2, 3, 5)), theta=10.0),
          ValueError, E("x's last axis Dh should be even for rotary embeddings, got 5"))
twin_case("rope-theta-zero", lambda t: t.lib.rotary_embedding(arr(t, (2, 3, 4)), theta=0.0),
          ValueError, E("theta should be a positive number, got 0.0"))
twin_case("rope-theta-none", lambda t: t.lib.rotary_embedding(arr(t, (2, 3, 4)), theta=None),
          ValueError, E("theta should be a positive number, got None"))
twin_case("rope-x-list", lambda t: t.lib.rotary_embedding([[1.0, 2.0]], theta=10.0), TypeError,
          E("x should be an array (NumPy, torch or JAX), got list"))

# ---- module constructors ----------------------------------------------------------------------

MLA_NEW = "multi_head_latent_attention"
MLA_SIZES = dict(d_in=8, num_heads=2, kv_lora_rank=4, qk_nope_head_dim=3, qk_rope_head_dim=2,
                 v_head_dim=5)

for id, variant, config, message in [
    ("self-d_in-zero", "self_attention", dict(d_in=0, d_k=4), "d_in should be a positive int, "
     "got 0"),
    ("self-d_k-float", "self_attention", dict(d_in=5, d_k=2.5), "d_k should be a positive int, "
     "got 2.5"),
    ("self-d_in-bool", "self_attention", dict(d_in=True, d_k=4), "d_in should be a positive "
     "int, got True"),
    ("self-d_v-str", "self_attention", dict(d_in=5, d_k=4, d_v="4"), "d_v should be a positive "
     "int, got '4'"),
    ("self-qkv_bias-str", "self_attention", dict(d_in=5, d_k=4, qkv_bias="yes"),
     "qkv_bias should be True or False, got 'yes'"),
    ("causal-dropout-one", "causal_self_attention", dict(d_in=5, d_k=3, dropout=1.0),
     "dropout should be in [0, 1), got 1.0"),
    ("causal-dropout-negative", "causal_self_attention", dict(d_in=5, d_k=3, dropout=-0.5),
     "dropout should be in [0, 1), got -0.5"),
    ("cross-d_kv_in-none", "cross_attention", dict(d_q_in=5, d_kv_in=None, d_k=4),
     "d_kv_in should be a positive int, got None"),
    ("wrapper-num_heads-zero", "multi_head_attention_wrapper",
     dict(d_in=5, d_head=2, num_heads=0), "num_heads should be a positive int, got 0"),
    ("mhca-kv-heads-divide", "multi_head_cross_attention",
     dict(d_in=5, d_context=3, num_heads=4, num_kv_heads=3),
     "num_kv_heads should divide num_heads = 4, got 3"),
    ("mhca-key_bias-str", "multi_head_cross_attention",
     dict(d_in=5, d_context=3, num_heads=4, key_bias="no"),
     "key_bias should be True or False, got 'no'"),
    ("mhca-d_context-zero", "multi_head_cross_attention",
     dict(d_in=5, d_context=0, num_heads=4), "d_context should be a positive int, got 0"),
    ("mhca-qk_norm-layer", "multi_head_cross_attention",
     dict(d_in=5, d_context=3, num_heads=4, qk_norm="layer"),
     "qk_norm should be None or one of 'rms' (MultiHeadCrossAttention: RMSNorm per head"),
    ("mhca-qk_norm_eps-zero", "multi_head_cross_attention",
     dict(d_in=5, d_context=3, num_heads=4, qk_norm="rms", qk_norm_eps=0.0),
     "qk_norm_eps should be a positive number, got 0.0"),
    ("mhca-softcap-negative", "multi_head_cross_attention",
     dict(d_in=5, d_context=3, num_heads=4, softcap=-1.0),
     "softcap should be a positive number or None, got -1.0"),
    ("wrapper-causal-int", "multi_head_attention_wrapper",
     dict(d_in=5, d_head=2, num_heads=3, causal=1), "causal should be True or False, got 1"),
    ("wrapper-out_proj-none", "multi_head_attention_wrapper",
     dict(d_in=5, d_head=2, num_heads=3, out_proj=None),
     "out_proj should be True or False, got None"),
    ("mha-d_out-not-divisible", "multi_head_attention", dict(d_in=5, d_out=10, num_heads=3),
     "d_out should be divisible by num_heads = 3, got 10"),
    ("mha-out_bias-str", "multi_head_attention",
     dict(d_in=5, d_out=12, num_heads=3, out_bias="no"),
     "out_bias should be True or False, got 'no'"),
    ("gqa-kv-heads-not-dividing", "grouped_query_attention",
     dict(d_in=12, num_heads=6, num_kv_heads=4), "num_kv_heads should divide num_heads = 6, "
     "got 4"),
    ("gqa-odd-head-dim-rope", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, head_dim=3, rope_theta=10.0),
     "head_dim should be even with rotary embeddings (rope_theta), got 3"),
    ("gqa-rope-theta-zero", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, rope_theta=0.0),
     "rope_theta should be a positive number or None, got 0.0"),
    ("gqa-rope-theta-negative", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, rope_theta=-1e4),
     "rope_theta should be a positive number or None, got -10000.0"),
    ("gqa-d_in-below-heads", "grouped_query_attention", dict(d_in=3, num_heads=4, num_kv_heads=2),
     "head_dim should be given when d_in < num_heads (d_in // num_heads = 0), got d_in = 3, "
     "num_heads = 4"),
    ("gqa-softcap-negative", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, softcap=-1.0),
     "softcap should be a positive number or None, got -1.0"),
    ("gqa-window-one-side", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, sliding_window=(2,)),
     "sliding_window should be a positive int or a pair (left, right) of ints >= 0, got (2,)"),
    ("gqa-qk_norm-unknown", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, qk_norm="rmsnorm"),
     "qk_norm should be None or one of 'rms', 'rms_one_plus', 'rms_across_heads', 'layer', "
     "'layer_with_bias', 'l2', 'rms_after_rope', got 'rmsnorm'"),
    ("gqa-qk_norm_eps-zero", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, qk_norm="rms", qk_norm_eps=0.0),
     "qk_norm_eps should be a positive number, got 0.0"),
    ("gqa-v_head_dim-k_eq_v", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, head_dim=4, v_head_dim=6, k_eq_v=True),
     "v_head_dim should be None or head_dim = 4 with k_eq_v (the values are the keys' "
     "projection), got 6"),
    ("gqa-clip_after_norm-no-norm", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, clip_qkv=2.0, clip_qkv_after_norm=True),
     "clip_qkv_after_norm should be False unless clip_qkv is set and qk_norm is one before "
     "RoPE (OLMoE: its q and k clamped after their norm), got True with clip_qkv = 2.0, "
     "qk_norm = None"),
    ("mla-rope-false-theta", "multi_head_latent_attention",
     dict(d_in=5, num_heads=2, kv_lora_rank=3, qk_nope_head_dim=2, qk_rope_head_dim=2,
          v_head_dim=2, rope=False, rope_theta=100.0),
     "rope_theta and rope_parameters should be None with rope=False (no rotary embedding: Kimi "
     "Linear's latent attention), got 100.0 and None"),
    ("gqa-value_scale-zero", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, value_scale=0.0),
     "value_scale should be None or a finite number other than 0, got 0.0"),
    ("gqa-temperature-fields", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, query_temperature={"beta": 0.1}),
     "query_temperature of kind 'llama4' should have the keys beta, floor_scale, shift, got "
     "beta"),
    ("gqa-temperature-floor-float", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1,
          query_temperature={"beta": 0.1, "floor_scale": 8192.0, "shift": 1}),
     "query_temperature['floor_scale'] should be a positive int, got 8192.0"),
    ("gqa-temperature-shift", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1,
          query_temperature={"beta": 0.1, "floor_scale": 8, "shift": 2}),
     "query_temperature['shift'] should be 0 or 1, got 2"),
    ("gqa-sinks-str", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, sinks="yes"),
     "sinks should be True or False, got 'yes'"),
    ("gqa-output_gate-none", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, output_gate=None),
     "output_gate should be False, True (= 'sigmoid') or one of 'sigmoid', 'sigmoid_per_head', "
     "'softplus', 'softplus_per_head', got None"),
    ("gqa-chunk-zero", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, attention_chunk_size=0),
     "attention_chunk_size should be a positive int, got 0"),
    ("gqa-scale-inf", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, scale=float("inf")),
     "scale should be a finite number or None, got inf"),
    ("gqa-rope_interleaved-str", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, rope_interleaved="yes"),
     "rope_interleaved should be True or False, got 'yes'"),
    ("gqa-dropout-str", "grouped_query_attention",
     dict(d_in=8, num_heads=2, num_kv_heads=1, dropout="0.1"),
     "dropout should be in [0, 1), got '0.1'"),
    ("mla-rope-odd", MLA_NEW, dict(MLA_SIZES, qk_rope_head_dim=3),
     "qk_rope_head_dim should be even (RoPE turns pairs), got 3"),
    ("mla-kv_lora_rank-zero", MLA_NEW, dict(MLA_SIZES, kv_lora_rank=0),
     "kv_lora_rank should be a positive int, got 0"),
    ("mla-q_lora_rank-float", MLA_NEW, dict(MLA_SIZES, q_lora_rank=1.5),
     "q_lora_rank should be a positive int, got 1.5"),
    ("mla-rms_norm_eps-zero", MLA_NEW, dict(MLA_SIZES, rms_norm_eps=0.0),
     "rms_norm_eps should be a positive number, got 0.0"),
    ("mla-attention_bias-str", MLA_NEW, dict(MLA_SIZES, attention_bias="yes"),
     "attention_bias should be True or False, got 'yes'"),
    ("mla-mscale_all_dim-str", MLA_NEW, dict(MLA_SIZES, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale_all_dim": "big"}),
     "rope_parameters['mscale_all_dim'] should be a number or None, got 'big'"),
]:
    twin_case(f"new-{id}", lambda t, v=variant, c=config: make(t, v, **c), ValueError, E(message))
twin_case("new-gqa-local_window_size-renamed",  # the argument of before sliding_window
          lambda t: make(t, "grouped_query_attention", d_in=6, num_heads=2, num_kv_heads=1,
                         local_window_size=3), ValueError,
          E("local_window_size is not an argument of GroupedQueryAttention any more, got "
            "local_window_size=3: pass sliding_window=W, Hugging Face's meaning (W keys "
            "including the query: local_window_size=w with causal=True is sliding_window="
            "w + 1;"))
twin_case("new-self-unknown-keyword", lambda t: make(t, "self_attention", d_in=5, d_k=4, bogus=1),
          TypeError, E("got an unexpected keyword argument 'bogus'"))
case("jax-new-rngs-none", lambda: jax_attn.SelfAttention(5, 4, rngs=None), TypeError,
     E("rngs should be a flax.nnx.Rngs (nnx.Rngs(seed)), got NoneType"))
case("jax-new-rngs-int", lambda: jax_attn.CrossAttention(5, 3, 4, rngs=0), TypeError,
     E("rngs should be a flax.nnx.Rngs (nnx.Rngs(seed)), got int"))
case("jax-new-rngs-missing", lambda: jax_attn.MultiHeadAttention(5, 12, 3), TypeError,
     E("missing 1 required keyword-only argument: 'rngs'"), says_got=False)

# ---- module calls -----------------------------------------------------------------------------

X = (2, 7, 5)  # (B, L, d_in) of the samples with d_in = 5
twin_case("call-x-width", lambda t: module(t, "self_attention")(arr(t, (2, 7, 4))), ValueError,
          E("x shape should be (B, L, d_in) = (?, ?, 5), got (2, 7, 4)"))
twin_case("call-x-rank-4", lambda t: module(t, "self_attention")(arr(t, (1,) + X)), ValueError,
          E("x should have rank 2 or 3: (L, d_in) or (B, L, d_in), got shape (1, 2, 7, 5)"))
twin_case("call-x-rank-1", lambda t: module(t, "multi_head_attention")(arr(t, (5,))),
          ValueError, E("x should have rank 2 or 3: (L, d_in) or (B, L, d_in), got shape (5,)"))
twin_case("call-x-int", lambda t: module(t, "simple_self_attention")(arr(t, X, "int32")),
          ValueError, E(f"x dtype should be one of {FLOATS}, got int32"))
twin_case("call-x-list", lambda t: module(t, "self_attention")(np.ones(X).tolist()), TypeError,
          E("x should be an array (NumPy, torch or JAX), got list"))
twin_case("call-mask-float",
          lambda t: module(t, "self_attention")(arr(t, X), arr(t, (2, 7, 7))), ValueError,
          E("mask dtype should be bool (True = may attend), got float32"))
twin_case("call-mask-shape",
          lambda t: module(t, "multi_head_attention")(arr(t, X), arr(t, (2, 7, 6), bool)),
          ValueError, E("mask shape should broadcast to (B, Lq, Lk) = (2, 7, 7), got (2, 7, 6)"))
twin_case("call-dropout-mask-in-eval",
          lambda t: module(t, "causal_self_attention")(arr(t, X),
                                                        dropout_mask=arr(t, (2, 7, 7), bool)),
          ValueError, E("dropout_mask was given but dropout is inactive"), says_got=False)
twin_case("call-dropout-mask-shape",
          lambda t: module(t, "causal_self_attention", train=True)(
              arr(t, X), dropout_mask=arr(t, (2, 7, 6), bool)), ValueError,
          E("dropout_mask shape should broadcast to (B, Lq, Lk) = (2, 7, 7), got (2, 7, 6)"))
twin_case("call-dropout-mask-heads",
          lambda t: module(t, "multi_head_attention", train=True)(
              arr(t, X), dropout_mask=arr(t, (2, 4, 7, 7), bool)), ValueError,
          E("dropout_mask shape should broadcast to (B, N, Lq, Lk) = (2, 3, 7, 7), "
            "got (2, 4, 7, 7)"))
XQ = (2, 6, 5)  # cross attention: x_q (B, Lq, d_q_in); x_kv (2, 9, 3) is (B, Lk, d_kv_in)
twin_case("call-cross-x_kv-width",
          lambda t: module(t, "cross_attention")(arr(t, XQ), arr(t, (2, 9, 4))), ValueError,
          E("x_kv shape should be (B, L, d_kv_in) = (2, ?, 3), got (2, 9, 4)"))
twin_case("call-cross-x_kv-batch",
          lambda t: module(t, "cross_attention")(arr(t, XQ), arr(t, (3, 9, 3))), ValueError,
          E("x_kv shape should be (B, L, d_kv_in) = (2, ?, 3), got (3, 9, 3)"))
twin_case("call-cross-x_v-shape",
          lambda t: module(t, "cross_attention")(arr(t, XQ), arr(t, (2, 9, 3)), arr(t, (2, 8, 3))),
          ValueError, E("x_v shape should equal x_kv's (2, 9, 3), got (2, 8, 3)"))
twin_case("call-cross-mask-shape",
          lambda t: module(t, "cross_attention")(arr(t, XQ), arr(t, (2, 9, 3)),
                                                 mask=arr(t, (2, 9, 6), bool)),
          ValueError, E("mask shape should broadcast to (B, Lq, Lk) = (2, 6, 9), got (2, 9, 6)"))
MHCA = "multi_head_cross_attention"  # x (2, 6, 5) is (B, Lq, d_in); context (B, Lc, 3)
twin_case("call-mhca-context-width",
          lambda t: module(t, MHCA)(arr(t, XQ), arr(t, (2, 9, 4))), ValueError,
          E("context shape should be (B, L, d_context) = (2, ?, 3), got (2, 9, 4)"))
twin_case("call-mhca-no-context", lambda t: module(t, MHCA)(arr(t, XQ)), ValueError,
          E("context should be an array (B, Lc, d_context) when no cache is given, got None"))
twin_case("call-mhca-context-lengths-float",
          lambda t: module(t, MHCA)(arr(t, XQ), arr(t, (2, 9, 3)),
                                    context_lengths=arr(t, (2,))), ValueError,
          E("context_lengths dtype should be an integer type, got float32"))
twin_case("call-mhca-context-lengths-shape",
          lambda t: module(t, MHCA)(arr(t, XQ), arr(t, (2, 9, 3)),
                                    context_lengths=arr(t, (3,), "int32")), ValueError,
          E("context_lengths shape should be (B,) = (2,), got (3,)"))
twin_case("call-mhca-mask-shape",
          lambda t: module(t, MHCA)(arr(t, XQ), arr(t, (2, 9, 3)), arr(t, (2, 9, 6), bool)),
          ValueError, E("mask shape should broadcast to (B, Lq, Lk) = (2, 6, 9), got (2, 9, 6)"))
MLA = "multi_head_latent_attention"  # the sample: d_in 5, N 3, r 7, Dr 4; x (2, 3, 5)


def mla_call(t, x=(2, 3, 5), **kw):
    return module(t, MLA)(arr(t, x), **kw)


def latent_cache(t, latent=(2, 8, 7), rope_key=(2, 8, 4), dtype="float32"):
    return t.lib.LatentCache(arr(t, latent, dtype), arr(t, rope_key, dtype),
                             t.array(np.zeros(latent[:1], dtype=np.int32)))


twin_case("call-mla-cache-not-a-cache", lambda t: mla_call(t, cache=(1, 2)), ValueError,
          E("cache should be a LatentCache (latent, rope_key, lengths) from init_cache, "
            "got tuple"))
twin_case("call-mla-cache-a-kv-cache", lambda t: mla_call(t, cache=cache(t)), ValueError,
          E("cache should be a LatentCache (latent, rope_key, lengths) from init_cache, "
            "got KVCache"))
twin_case("call-mla-cache-latent-width",
          lambda t: mla_call(t, cache=latent_cache(t, latent=(2, 8, 6))), ValueError,
          E("cache.latent shape should be (B, M, kv_lora_rank) = (2, ?, 7), got (2, 8, 6)"))
twin_case("call-mla-cache-rope-key-shape",
          lambda t: mla_call(t, cache=latent_cache(t, rope_key=(2, 8, 2))), ValueError,
          E("cache.rope_key shape should be (B, M, qk_rope_head_dim) = (2, 8, 4), "
            "got (2, 8, 2)"))
twin_case("call-mla-cache-dtype",
          lambda t: mla_call(t, cache=latent_cache(t, dtype="float16")), ValueError,
          E("cache.latent dtype should be float32 (x's), got float16"))
twin_case("call-mla-cache-too-short",
          lambda t: mla_call(t, cache=latent_cache(t, latent=(2, 2, 7), rope_key=(2, 2, 4))),
          ValueError, E("x length L should be at most the cache's max_length M = 2, got 3"))
twin_case("call-mla-mask-with-cache",
          lambda t: mla_call(t, mask=arr(t, (2, 3, 3), bool), cache=latent_cache(t)), ValueError,
          E("mask shape should broadcast to (B, Lq, Lk) = (2, 3, 8), got (2, 3, 3)"))
twin_case("call-mla-absorb-str", lambda t: mla_call(t, absorb="yes"), ValueError,
          E("absorb should be True or False, got 'yes'"))
twin_case("call-mla-query-lengths-shape",
          lambda t: mla_call(t, query_seq_lengths=arr(t, (3,), "int32")), ValueError,
          E("query_seq_lengths shape should be (B,) = (2,), got (3,)"))
twin_case("call-mla-init-cache-zero", lambda t: module(t, MLA).init_cache(2, 0), ValueError,
          E("max_length should be a positive int, got 0"))
twin_case("call-gqa-cache-not-a-cache", lambda t: gqa_call(t, cache=(1, 2)), ValueError,
          E("cache should be a KVCache (key, value, lengths) from init_cache, got tuple"))
twin_case("call-gqa-cache-heads", lambda t: gqa_call(t, cache=cache(t, key=(2, 3, 8, 4))),
          ValueError, E("cache.key shape should be (B, Hkv, M, Dh) = (2, 2, ?, 4), "
                        "got (2, 3, 8, 4)"))
twin_case("call-gqa-cache-dtype", lambda t: gqa_call(t, cache=cache(t, dtype="float16")),
          ValueError, E("cache.key dtype should be float32 (x's), got float16"))
twin_case("call-gqa-cache-lengths-float",
          lambda t: gqa_call(t, cache=cache(t, lengths_dtype="float32")), ValueError,
          E("cache.lengths dtype should be an integer type, got float32"))
twin_case("call-gqa-cache-unbatched-x", lambda t: gqa_call(t, x=(3, 5), cache=cache(t)),
          ValueError, E("x shape should be (B, L, d_in) with a cache, got (3, 5)"))
twin_case("call-gqa-cache-too-short",
          lambda t: gqa_call(t, cache=cache(t, key=(2, 2, 2, 4))), ValueError,
          E("x length L should be at most the cache's max_length M = 2, got 3"))
twin_case("call-gqa-query-lengths-float",
          lambda t: gqa_call(t, query_seq_lengths=arr(t, (2,))), ValueError,
          E("query_seq_lengths dtype should be an integer type, got float32"))
twin_case("call-gqa-query-lengths-shape",
          lambda t: gqa_call(t, query_seq_lengths=arr(t, (3,), "int32")), ValueError,
          E("query_seq_lengths shape should be (B,) = (2,), got (3,)"))
twin_case("call-gqa-positions-float", lambda t: gqa_call(t, positions=arr(t, (2, 3))),
          ValueError, E("positions dtype should be an integer type, got float32"))
twin_case("call-gqa-positions-shape",
          lambda t: gqa_call(t, positions=arr(t, (3,), "int32")), ValueError,
          E("positions shape should be (B, L) = (2, 3), got (3,)"))
twin_case("call-gqa-positions-list", lambda t: gqa_call(t, positions=[[0, 1, 2]] * 2),
          TypeError, E("positions should be an array (NumPy, torch or JAX), got list"))
# strict=True reads the lengths' values on a cached call, in both twins (without it both drop
# what does not fit, tests/test_grouped_query.py)
twin_case("call-gqa-query-lengths-range",
          lambda t: gqa_call(t, cache=cache(t), query_seq_lengths=t.array(np.array([5, 1])),
                             strict=True),
          ValueError, E("query_seq_lengths should be in [0, L = 3], got [5, 1]"))
twin_case("call-gqa-cache-full",
          lambda t: gqa_call(t, cache=cache(t, key=(2, 2, 4, 4))._replace(
              lengths=t.array(np.array([3, 3], dtype=np.int32))), strict=True), ValueError,
          E("cache is full: rows holding [3, 3] tokens cannot take [3, 3] more within "
            "max_length M = 4"), says_got=False)
twin_case("call-gqa-strict-str", lambda t: gqa_call(t, strict="yes"), ValueError,
          E("strict should be True or False, got 'yes'"))
twin_case("init-cache-batch-zero",
          lambda t: module(t, "grouped_query_attention").init_cache(0, 8), ValueError,
          E("batch_size should be a positive int, got 0"))
twin_case("init-cache-max-length-float",
          lambda t: module(t, "grouped_query_attention").init_cache(2, 8.0), ValueError,
          E("max_length should be a positive int, got 8.0"))

# ---- build, export_params, load_params --------------------------------------------------------

SELF = dict(d_in=5, d_k=4)
VARIANT_NAMES = ", ".join(v.name for v in variants.MODULES)
twin_case("build-unknown-variant", lambda t: t.lib.build("foo", {}, {}), ValueError,
          E(f"variant should be one of {VARIANT_NAMES}, got 'foo'"))
twin_case("build-core-variant", lambda t: t.lib.build("scaled_dot_product_attention", {}, {}),
          ValueError,
          E("variant should be one of") + ".*" + E("got 'scaled_dot_product_attention'"))
twin_case("build-variant-not-str", lambda t: t.lib.build(["self_attention"], SELF, {}),
          TypeError, E("variant should be a variant's name (a str), got list"))
twin_case("build-config-none", lambda t: t.lib.build("self_attention", None, {}), TypeError,
          E("config should be a dict of constructor arguments, got NoneType"))
twin_case("build-config-missing-arg", lambda t: t.lib.build("self_attention", {"d_in": 5}, {}),
          TypeError, E("missing 1 required positional argument: 'd_k'"), says_got=False)
twin_case("build-config-bad-value",
          lambda t: t.lib.build("self_attention", {"d_in": 5, "d_k": 0}, {}), ValueError,
          E("d_k should be a positive int, got 0"))
twin_case("build-params-none", lambda t: t.lib.build("self_attention", SELF, None), TypeError,
          E("params should be a dict {name: array} in the neutral layout, got NoneType"))
twin_case("build-param-missing",
          lambda t: t.lib.build("self_attention", SELF, params("self_attention", SELF,
                                                               W_key=None)),
          ValueError, E("parameter W_key is missing: expected shape (5, 4); parameters should be "
                        "W_key, W_query, W_value, got W_query, W_value"))
twin_case("build-param-extra",
          lambda t: t.lib.build("self_attention", SELF,
                                params("self_attention", SELF, W_foo=np.ones(3, np.float32))),
          ValueError, E("parameters should be exactly W_key, W_query, W_value for "
                        "self_attention with config {'d_in': 5, 'd_k': 4, 'd_v': None, "
                        "'qkv_bias': False}, got an unexpected W_foo"))
twin_case("build-bias-missing",
          lambda t: t.lib.build("self_attention", {**SELF, "qkv_bias": True},
                                params("self_attention", SELF)),
          ValueError, E("parameter b_key is missing: expected shape (4,)"))
twin_case("build-param-shape",
          lambda t: t.lib.build("self_attention", SELF,
                                params("self_attention", SELF,
                                       W_query=np.ones((4, 5), np.float32))),
          ValueError, E("parameter W_query shape should be (5, 4), got (4, 5)"))
twin_case("build-param-int",
          lambda t: t.lib.build("self_attention", SELF,
                                params("self_attention", SELF, W_query=np.ones((5, 4), int))),
          ValueError, E(f"parameter W_query dtype should be one of {FLOATS}, got int64"))
twin_case("build-param-list",
          lambda t: t.lib.build("self_attention", SELF,
                                params("self_attention", SELF, W_query=[[1.0] * 4] * 5)),
          TypeError, E("parameter W_query should be an array (NumPy, torch or JAX), got list"))
case("jax-build-rngs-int",
     lambda: jax_attn.build("causal_self_attention", {"d_in": 5, "d_k": 3, "dropout": 0.5},
                            params("causal_self_attention", {"d_in": 5, "d_k": 3}), rngs=3),
     TypeError, E("rngs should be a flax.nnx.Rngs (nnx.Rngs(seed)), got int"))
case("torch-export-params-linear", lambda: torch_attn.export_params(torch.nn.Linear(2, 3)),
     ValueError, E("module should be a torch_attn or jax_attn variant, got Linear"))
case("jax-export-params-linear",
     lambda: jax_attn.export_params(nnx.Linear(2, 3, rngs=nnx.Rngs(0))), ValueError,
     E("module should be a torch_attn or jax_attn variant, got Linear"))
OURS = r"module should be a (torch_attn variant \(a torch\.nn\.Module\)|jax_attn variant " \
       r"\(a flax\.nnx\.Module\)), got "
twin_case("export-params-none", lambda t: t.lib.export_params(None), ValueError,
          OURS + E("builtins.NoneType"))
twin_case("export-params-other-framework",
          lambda t: t.lib.export_params(module(other(t), "self_attention")), ValueError,
          OURS + r"(jax|torch)_attn\.modules\.SelfAttention")
twin_case("load-params-other-framework",
          lambda t: t.lib.load_params(module(other(t), "self_attention"),
                                      params("self_attention")), ValueError,
          OURS + r"(jax|torch)_attn\.modules\.SelfAttention")
twin_case("load-params-not-a-dict",
          lambda t: t.lib.load_params(module(t, "self_attention"),
                                      list(params("self_attention").values())),
          TypeError, E("params should be a dict {name: array} in the neutral layout, got list"))
twin_case("load-params-shape",
          lambda t: t.lib.load_params(module(t, "self_attention"),
                                      params("self_attention", W_value=np.ones((5, 4), "f4"))),
          ValueError, E("parameter W_value shape should be (5, 6), got (5, 4)"))

# ---- export_cache, load_cache -----------------------------------------------------------------

def np_cache(**kw):
    """A KVCache of NumPy arrays (what export_cache gives and load_cache takes)."""
    return cache(Reference(), **kw)


CACHES = "cache should be a KVCache (key, value, lengths) or a LatentCache (latent, rope_key, " \
    "lengths) from init_cache, got "
twin_case("load-cache-dict", lambda t: t.lib.load_cache({"key": np.ones((2, 2, 8, 4))}),
          ValueError, E(CACHES + "dict"))
twin_case("load-cache-key-rank", lambda t: t.lib.load_cache(np_cache(key=(2, 8, 4))),
          ValueError, E("cache.key shape should be (B, Hkv, M, Dh), got (2, 8, 4)"))
twin_case("load-cache-value-shape",
          lambda t: t.lib.load_cache(np_cache(value=(2, 2, 7, 4))), ValueError,
          E("cache.value shape should be (B, Hkv, M, Dv) = (2, 2, 8, ?), got (2, 2, 7, 4)"))
twin_case("load-cache-key-int", lambda t: t.lib.load_cache(np_cache(dtype="int32")), ValueError,
          E(f"cache.key dtype should be one of {FLOATS}, got int32"))
twin_case("load-cache-lengths-float",
          lambda t: t.lib.load_cache(np_cache(lengths_dtype="float64")), ValueError,
          E("cache.lengths dtype should be an integer type, got float64"))
twin_case("load-cache-lengths-shape", lambda t: t.lib.load_cache(np_cache(lengths=(3,))),
          ValueError, E("cache.lengths shape should be (B,) = (2,), got (3,)"))
twin_case("load-cache-lengths-list",
          lambda t: t.lib.load_cache(np_cache()._replace(lengths=[0, 0])), TypeError,
          E("cache.lengths should be an array (NumPy, torch or JAX), got list"))
twin_case("export-cache-none", lambda t: t.lib.export_cache(None), ValueError,
          E(CACHES + "NoneType"))


def np_latent(latent=(2, 8, 7), rope_key=(2, 8, 4), dtype="float32", rope_dtype=None,
              lengths=(2,)):
    """A LatentCache of NumPy arrays (MultiHeadLatentAttention's sample: r = 7, Dr = 4)."""
    return LatentCache(np.ones(latent, dtype), np.ones(rope_key, rope_dtype or dtype),
                       np.zeros(lengths, np.int32))


twin_case("load-latent-cache-latent-rank", lambda t: t.lib.load_cache(np_latent(latent=(2, 8))),
          ValueError, E("cache.latent shape should be (B, M, kv_lora_rank), got (2, 8)"))
twin_case("load-latent-cache-rope-key-shape",
          lambda t: t.lib.load_cache(np_latent(rope_key=(2, 7, 4))), ValueError,
          E("cache.rope_key shape should be (B, M, qk_rope_head_dim) = (2, 8, ?), got (2, 7, 4)"))
twin_case("load-latent-cache-latent-int", lambda t: t.lib.load_cache(np_latent(dtype="int32")),
          ValueError, E(f"cache.latent dtype should be one of {FLOATS}, got int32"))
twin_case("load-latent-cache-rope-key-dtype",
          lambda t: t.lib.load_cache(np_latent(rope_dtype="float64")), ValueError,
          E("cache.rope_key dtype should be float32 (cache.latent's), got float64"))
twin_case("load-latent-cache-lengths-shape",
          lambda t: t.lib.load_cache(np_latent(lengths=(3,))), ValueError,
          E("cache.lengths shape should be (B,) = (2,), got (3,)"))
twin_case("export-latent-cache-rope-key-list",
          lambda t: t.lib.export_cache(np_latent()._replace(rope_key=[1.0])), TypeError,
          E("cache.rope_key should be an array (NumPy, torch or JAX), got list"))

# ---- golden.load ------------------------------------------------------------------------------


def _load_foreign_npz():
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "foreign.npz")
        np.savez(path, a=np.ones(3))
        return golden.load(path)


# golden.specification.fixture.FixtureNotFound is both a FileNotFoundError and a ValueError.
case("golden-load-missing-name", lambda: golden.load("no_such_fixture"), ValueError,
     E("name_or_path should name a shipped fixture"))
case("golden-load-near-name", lambda: golden.load("multi_head_attention_causl"), ValueError,
     E("did you mean multi_head_attention_causal"))
case("golden-load-not-a-path", lambda: golden.load(3), TypeError,
     E("name_or_path should be a fixture name (str) or a path, got int 3"))
case("golden-load-text-file", lambda: golden.load(ROOT / "README.md"), golden.FixtureError,
     E("README.md: not a readable fixture"), says_got=False)
case("golden-load-directory", lambda: golden.load(ROOT / "golden"), golden.FixtureError,
     E("golden: not a readable fixture (IsADirectoryError"), says_got=False)
case("golden-load-foreign-npz", _load_foreign_npz, golden.FixtureError,
     E("no 'meta' member; this is not an attn-parity fixture"), says_got=False)

# ---- converters -------------------------------------------------------------------------------

tconv, jconv = torch_attn.convert, jax_attn.convert
case("from-torch-mha-linear", lambda: tconv.from_torch_mha(torch.nn.Linear(2, 3)), ValueError,
     E("mha should be a torch.nn.MultiheadAttention, got Linear"))
case("from-torch-mha-kdim",
     lambda: tconv.from_torch_mha(torch.nn.MultiheadAttention(8, 2, kdim=4, vdim=4)),
     ValueError, E("kdim and vdim should equal embed_dim = 8") + ".*" +
     E("got kdim = 4, vdim = 4"))
case("from-torch-mha-variant",
     lambda: tconv.from_torch_mha(torch.nn.MultiheadAttention(8, 2), variant="bogus"),
     ValueError, E("variant should be one of multi_head_attention, grouped_query_attention, "
                   "got 'bogus'"))
case("to-torch-mha-int", lambda: tconv.to_torch_mha(42), ValueError,
     E("source should be a MultiHeadAttention, a GroupedQueryAttention or a dict of "
       "neutral-layout params, got int"))
case("from-nnx-mha-linear", lambda: jconv.from_nnx_mha(nnx.Linear(2, 3, rngs=nnx.Rngs(0))),
     ValueError, E("mha should be a flax.nnx.MultiHeadAttention, got Linear"))
twin_case("to-llama-not-gqa", lambda t: t.lib.convert.to_llama(module(t, "self_attention")),
          ValueError, r"module should be a (torch|jax)_attn\.GroupedQueryAttention, "
                      r"got SelfAttention")
LLAMA = {"q_proj.weight": np.ones((8, 8)), "k_proj.weight": np.ones((4, 8)),
         "v_proj.weight": np.ones((4, 8)), "o_proj.weight": np.ones((8, 8))}


def llama(num_heads=4, **changes):
    state = {n: a for n, a in {**LLAMA, **changes}.items() if a is not None}
    return golden_convert.llama_to_neutral(state, num_heads=num_heads)


case("llama-k-width", lambda: llama(**{"k_proj.weight": np.ones((4, 7))}), ValueError,
     E("k_proj.weight shape should be (?, 8), got (4, 7)"))
case("llama-v-rows", lambda: llama(**{"v_proj.weight": np.ones((6, 8))}), ValueError,
     E("v_proj.weight shape should be (4, 8), got (6, 8)"))
case("llama-q-rank-1", lambda: llama(**{"q_proj.weight": np.ones(8)}), ValueError,
     E("q_proj.weight shape should be (?, ?), got (8,)"))
case("llama-missing-o", lambda: llama(**{"o_proj.weight": None}), ValueError,
     E("state_dict should hold 'o_proj.weight', got ['k_proj.weight', 'q_proj.weight', "
       "'v_proj.weight']"))
case("llama-num-heads-zero", lambda: llama(num_heads=0), ValueError,
     E("num_heads should be a positive int, got 0"))
case("llama-num-heads-not-dividing", lambda: llama(num_heads=3), ValueError,
     E("q_proj.weight shape should be (6, 8), got (8, 8)"))
case("rope-permute-odd-head-dim", lambda: golden_convert.rope_permute(np.ones((6, 8)), 2),
     ValueError, E("w first axis should be heads·Dh = 2·Dh with Dh even, got shape (6, 8)"))
case("rope-permute-heads-zero", lambda: golden_convert.rope_permute(np.ones((8, 8)), 0),
     ValueError, E("w first axis should be heads·Dh = 0·Dh with Dh even, got shape (8, 8)"))
case("rope-permute-heads-str", lambda: golden_convert.rope_permute(np.ones((8, 8)), "2"),
     TypeError, E("heads should be a positive int, got str '2'"))
case("llama-state-dict-none", lambda: golden_convert.llama_to_neutral(None, num_heads=2),
     TypeError, E("state_dict should be a mapping of names to arrays (a model's state_dict()), "
                  "got NoneType"))

# ---- golden.runners.adapt ---------------------------------------------------------------------

case("from-function-not-callable", lambda: adapt.from_function(42, "torch"), ValueError,
     E("fn should be a callable, got int"))
case("from-function-framework", lambda: adapt.from_function(print, "tensorflow"), ValueError,
     E("framework should be one of numpy, torch, jax, got 'tensorflow'"))
case("from-function-dtypes", lambda: adapt.from_function(print, "numpy", dtypes=["bfloat16"]),
     ValueError, E("dtypes should be drawn from float32, float64 for numpy, got bfloat16"))
case("from-module-factory", lambda: adapt.from_module(42, "torch", mapping={}), ValueError,
     E("factory should be a callable (variant, config) -> module, got int"))
case("from-module-mapping-int", lambda: adapt.from_module(print, "torch", mapping=42),
     ValueError, E("mapping should be a dict {neutral name: (path, rule)} or a callable "
                   "(variant, config) -> dict, got int"))
case("from-module-mapping-bad-rule",
     lambda: adapt.from_module(print, "torch", mapping={"W_query": ("q.weight", "Q")}),
     ValueError, E("rule step should be 'T', 'transpose(axes)' or 'reshape(shape)', got 'Q'"))
case("adapt-load-bad-spec", lambda: adapt.load("not a spec!"), ValueError,
     E("spec should be 'package.module:name', got 'not a spec!:run_fixture'"))
case("adapt-load-no-module", lambda: adapt.load("no_such_module_xyz:run"), ValueError,
     E("spec 'no_such_module_xyz:run': cannot import 'no_such_module_xyz'"), says_got=False)
case("adapt-load-no-attribute", lambda: adapt.load("golden.cli:nope"), ValueError,
     E("spec 'golden.cli:nope': golden.cli has no attribute 'nope'"), says_got=False)
case("adapt-load-not-callable", lambda: adapt.load("golden.cli:DTYPES"), ValueError,
     E("spec 'golden.cli:DTYPES' should name a runner (fixture, dtype) -> dict, got tuple"))
case("adapt-load-none", lambda: adapt.load(None), ValueError,
     E("spec should be 'package.module:name', got None"))

# ---- golden.specification.mapping
# ---------------------------------------------------------------------------

STEP = "rule step should be 'T', 'transpose(axes)' or 'reshape(shape)'"
case("rule-unknown-step", lambda: mapping.Rule.parse("T;Q"), ValueError,
     E(f"{STEP}, got 'Q' in 'T;Q'"))
case("rule-step-not-str", lambda: mapping.Rule.parse(["T", 3]), ValueError,
     E(f"{STEP}, got 3 in ['T', 3]"))
case("rule-reshape-zero", lambda: mapping.Rule.parse("reshape(0,2)"), ValueError,
     E("reshape should have positive sizes and at most one -1, got 'reshape(0,2)'"))
case("rule-reshape-two-unknowns", lambda: mapping.Rule.parse("reshape(-1,-1)"), ValueError,
     E("reshape should have positive sizes and at most one -1, got 'reshape(-1,-1)'"))
case("rule-transpose-axes", lambda: mapping.Rule.parse("transpose(0,1)").shapes((2, 3, 4)),
     ValueError, E("rule transpose(0,1): transpose(0, 1) does not permute the 3 axes of shape "
                   "(2, 3, 4)"), says_got=False)
case("rule-reshape-size", lambda: mapping.Rule.parse("reshape(5,2)").apply(np.ones((3, 3))),
     ValueError, E("rule reshape(5,2): cannot reshape shape (3, 3) (9 elements) to (5, 2)"),
     says_got=False)
case("rule-inverse-shape", lambda: mapping.Rule.parse("T").inverse(np.ones((2, 3)), (2, 3)),
     ValueError, E("rule T: array shape should be (3, 2) (from source shape (2, 3)), "
                   "got (2, 3)"))
case("mapping-rule-not-a-string", lambda: mapping.Rule.parse(3), TypeError,
     E("rule should be None, a string such as 'T;reshape(8,2,4)' or a list of steps, got int 3"))
case("mapping-empty", lambda: mapping.parse({}), ValueError,
     E("mapping should be a non-empty dict {source: target or (target, rule)}, got dict"))
case("mapping-same-target", lambda: mapping.parse({"a": "x", "b": "x"}), ValueError,
     E("mapping should send each source to a different target, got ['x', 'x'] more than once"))
case("mapping-bad-path", lambda: mapping.parse({"a": "x..y"}), ValueError,
     E("path should be dotted names like 'query.kernel', got 'x..y'"))
case("mapping-missing-file", lambda: mapping.parse("/no/such/mapping.json"), ValueError,
     E("mapping should be a JSON file of {source: [target, rule]}, could not read "
       "'/no/such/mapping.json'"), says_got=False)


# ---- the recurrent mixers (golden.specification.recurrent): built by name, called on x, mask ----
# A mixer whose module the twin lacks yet is skipped, the class named (tests/helpers.py).

GDN, KDA, LIGHTNING = "gated_delta_net", "kimi_delta_attention", "lightning_attention"


def mixer_build(t, variant, **changes):
    """``t.lib.build`` of ``variant`` with its sample configuration updated by ``changes`` and
    ones of the sample's parameter shapes (a bad configuration is refused before they load)."""
    from golden.specification import recurrent

    if missing_mixer(t.name, variant):
        pytest.skip(missing_mixer(t.name, variant))
    sample = recurrent.get(variant).sample
    ones = {n: np.ones(s, np.float32)
            for n, s in recurrent.get(variant).param_shapes(sample).items()}
    return t.lib.build(variant, {**sample, **changes}, ones)


for _mixer, _heads in ((GDN, "num_k_heads"), (KDA, "num_heads"), (LIGHTNING, "num_heads")):
    twin_case(f"mixer-{_mixer}-negative-heads",
              lambda t, m=_mixer, h=_heads: mixer_build(t, m, **{h: -2}), ValueError,
              E(f"{_heads} should be a positive int, got -2"))
    twin_case(f"mixer-{_mixer}-mask-float",  # the sample's d_in is 5: x (2, 7, 5)
              lambda t, m=_mixer: mixer_build(t, m)(arr(t, X), arr(t, (2, 7))), ValueError,
              E("mask dtype should be bool (True = a real token), got float32"))
twin_case("mixer-gated_delta_net-heads-not-dividing",
          lambda t: mixer_build(t, GDN, num_k_heads=3), ValueError,
          E("num_k_heads should divide num_v_heads = 4 (each key head serves num_v_heads // "
            "num_k_heads value heads), got 3"))
twin_case("mixer-gated_delta_net-mask-shape",
          lambda t: mixer_build(t, GDN)(arr(t, X), arr(t, (2, 6), bool)), ValueError,
          E("mask shape should be (2, 7) (one flag per token, True = real, as Hugging Face's "
            "attention_mask), got (2, 6)"))
twin_case("mixer-kimi_delta_attention-lower-bound-positive",
          lambda t: mixer_build(t, KDA, forget_gate="bounded_sigmoid", decay_lower_bound=0.0),
          ValueError, E("decay_lower_bound should be None or a finite number < 0 (the "
                        "log-decay's lower bound), got 0.0"))
twin_case("mixer-kimi_delta_attention-forget-gate-unknown",
          lambda t: mixer_build(t, KDA, forget_gate="relu"), ValueError,
          E("forget_gate should be one of 'softplus', 'bounded_sigmoid', got 'relu'"))
twin_case("mixer-lightning_attention-block-size-zero",
          lambda t: mixer_build(t, LIGHTNING, block_size=0), ValueError,
          E("block_size should be a positive int, got 0"))


@pytest.mark.parametrize("bad", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_input_names_the_argument_expected_and_got(bad):
    with pytest.raises(bad.error, match=bad.match) as info:
        bad.call()
    assert isinstance(info.value, (ValueError, TypeError)), info.value
    message = str(info.value)
    if bad.says_got:
        assert re.search(r"\bgot\b", message), message
    assert "Traceback" not in message


def test_the_table_covers_at_least_sixty_distinct_bad_inputs():
    ids = [c.id for c in CASES]
    assert len(set(ids)) == len(ids), "duplicate ids"
    distinct = {i.removeprefix("torch-").removeprefix("jax-") for i in ids}
    assert len(distinct) >= 60, len(distinct)


# ---- the command line -------------------------------------------------------------------------

ARGPARSE = [  # argparse's standard form: usage lines, then "<prog>: error: …"
    (["check", "--dtype", "float8"], "attn-parity check: error: argument --dtype: invalid "
     "choice: 'float8'"),
    (["check", "--variant", "bogus"], "attn-parity check: error: argument --variant: invalid "
     "choice: 'bogus'"),
    (["check", "--framework", "tf"], "attn-parity check: error: argument --framework: invalid "
     "choice: 'tf'"),
    (["check", "--profile", "fp8"], "attn-parity check: error: argument --profile: invalid "
     "choice: 'fp8'"),
    (["compare", "--seed", "abc"], "attn-parity compare: error: argument --seed: invalid int "
     "value: 'abc'"),
    (["regenerate", "--bogus"], "attn-parity: error: unrecognized arguments: --bogus"),
    (["check", "--bogus"], "attn-parity: error: unrecognized arguments: --bogus"),
    (["bench", "--bogus"], "attn-parity bench: error: unrecognized arguments: --bogus"),
    (["bench", "--repeats", "2"], "attn-parity bench: error: --repeats should be at least 3, "
     "got 2"),
    (["bench", "--budget", "-1"], "attn-parity bench: error: --budget should be a time ≥ 0 s, "
     "got -1.0"),
    (["bench", "--repeats", "many"], "attn-parity bench: error: argument --repeats: invalid "
     "int value: 'many'"),
    ([], "attn-parity: error: the following arguments are required: command"),
    (["bogus"], "attn-parity: error: argument command: invalid choice: 'bogus'"),
]

OWN = [  # the project's own user errors: exactly one line on stderr
    (["check", "no_such_fixture"],
     "attn-parity check: error: name_or_path should name a shipped fixture"),
    (["check", str(ROOT / "README.md")],
     f"attn-parity check: error: {ROOT / 'README.md'}: not a readable fixture"),
    (["check", "--impl", "no_such_module_xyz"],
     "attn-parity check: error: spec 'no_such_module_xyz:run_fixture': cannot import"),
    (["check", "--impl", "golden.cli:DTYPES"], "attn-parity check: error: spec "
     "'golden.cli:DTYPES' should name a runner (fixture, dtype) -> dict, got tuple"),
    (["check", "sdpa_plain", "--framework", "reference", "--html", "{file}"],
     "attn-parity check: error: [Errno 20] Not a directory"),
    (["compare"], "attn-parity compare: error: compare needs --torch, --flax, --mapping, "
     "--input (or --fixture FILE)"),
    (["compare", "--fixture", "/no/such/port.npz"], "attn-parity compare: error: "
     "/no/such/port.npz: no such port fixture"),
    (["compare", "--torch", "golden.examples.port_pair:make_torch",
      "--flax", "golden.examples.port_pair:make_flax",
      "--mapping", "golden.examples.port_pair:MAPPING", "--input", "x=2,0"],
     "attn-parity compare: error: --input should be NAME=D1,D2,... with positive sizes and a "
     "new name, got 'x=2,0'"),
]


def _main(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, err.strip().splitlines()


@pytest.mark.parametrize("argv, error", ARGPARSE, ids=[" ".join(a) or "-" for a, _ in ARGPARSE])
def test_argparse_errors_exit_2_with_usage_and_one_error_line(argv, error, capsys):
    code, lines = _main(argv, capsys)
    assert code == 2
    assert lines[-1].startswith(error), lines
    assert lines[0].startswith("usage: attn-parity") and all(
        not line.startswith(("attn-parity", "Traceback")) for line in lines[:-1]), lines


@pytest.mark.parametrize("argv, error", OWN, ids=[" ".join(a) for a, _ in OWN])
def test_own_user_errors_exit_2_with_one_line(argv, error, capsys, tmp_path):
    file = tmp_path / "a_file"
    file.write_text("")
    code, lines = _main([a.replace("{file}", str(file)) for a in argv], capsys)
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(error), lines


@pytest.mark.parametrize("argv, error", [
    (["check", "--dtype", "float8"], "attn-parity check: error: argument --dtype"),
    (["check", "no_such_fixture"],
     "attn-parity check: error: name_or_path should name a shipped fixture"),
    (["compare", "--fixture", "/no/such/port.npz"], "attn-parity compare: error: "
     "/no/such/port.npz: no such port fixture"),
    (["regenerate", "--bogus"], "attn-parity: error: unrecognized arguments: --bogus"),
], ids=["check-dtype", "check-missing-fixture", "compare-missing-fixture", "regenerate-bogus"])
def test_the_command_as_a_user_runs_it(argv, error):
    done = subprocess.run([sys.executable, "-m", "golden.cli", *argv], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(error), done.stderr
