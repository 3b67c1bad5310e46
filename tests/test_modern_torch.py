"""The torch core's issue-9 arguments: grouped-query heads, softcap, query offsets, sliding
windows and sequence lengths, with the explicit and the fused implementations, against
PyTorch's own kernel, a boolean mask built here by hand, and the float64 reference; chunked
attention and attention sinks, against the reference and against transformers' own GPT-OSS
attention and Llama 4 chunked mask (float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from golden import reference
from golden.specification.implementations import record
from golden.specification.tolerances import compare
from golden.specification.validate import window
from tests.helpers import fresh_rng
from torch_attn import scaled_dot_product_attention as sdpa
from torch_attn.explicit import Where

B, H, LQ, LK, DK, DV = 2, 6, 5, 7, 4, 3
TORCH_SDPA = F.scaled_dot_product_attention  # before any monkeypatch

# Allowed-set arguments, each with at least one empty row somewhere (or none), by name.
ALLOWED_CASES = {
    "window": dict(local_window_size=1),
    "window_left_causal": dict(local_window_size=(2, None), is_causal=True),
    "window_right_only": dict(local_window_size=(None, 0)),
    "offset_causal": dict(query_offset=2, is_causal=True),
    "offset_tensor_window": dict(query_offset=np.array([0, 3]), local_window_size=(1, 2)),
    "kv_lengths": dict(key_value_seq_lengths=np.array([7, 3])),
    "q_lengths_causal": dict(query_seq_lengths=np.array([5, 2]), is_causal=True),
    "all": dict(query_offset=np.array([1, 4]), local_window_size=(3, 0), is_causal=True,
                key_value_seq_lengths=np.array([6, 4]), query_seq_lengths=np.array([4, 5])),
    "empty_rows": dict(query_offset=9, local_window_size=(0, 0)),  # every row empty
    "chunks": dict(attention_chunk_size=3),
    "chunks_causal_offset_lengths": dict(attention_chunk_size=2, is_causal=True,
                                         query_offset=np.array([0, 3]),
                                         key_value_seq_lengths=np.array([7, 5])),
}


def tensors(rng, hkv=H, dtype=torch.float64, batch=(B,), grad=False):
    """Fresh q (…, H, Lq, Dk), k (…, Hkv, Lk, Dk), v (…, Hkv, Lk, Dv)."""
    shapes = [(H, LQ, DK), (hkv, LK, DK), (hkv, LK, DV)]
    return [torch.tensor(rng.standard_normal(batch + s), dtype=dtype, requires_grad=grad)
            for s in shapes]


def torch_kwargs(kw):
    """NumPy offsets and lengths as int64 tensors."""
    return {n: torch.from_numpy(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}


def allowed_by_hand(kw):
    """(B, 1, Lq, Lk) bool, straight from the definitions: query i at i + offset, key j at j."""
    offset = np.broadcast_to(kw.get("query_offset", 0), (B,))[:, None, None, None]
    i, j = np.arange(LQ)[:, None], np.arange(LK)[None, :]
    pos = i + offset
    left, right = window(kw.get("local_window_size"))
    ok = np.ones((B, 1, LQ, LK), dtype=bool)
    if kw.get("is_causal"):
        ok &= j <= pos
    if left is not None:
        ok &= j >= pos - left
    if right is not None:
        ok &= j <= pos + right
    if kw.get("attention_chunk_size"):
        ok &= j // kw["attention_chunk_size"] == pos // kw["attention_chunk_size"]
    if "key_value_seq_lengths" in kw:
        ok &= j < kw["key_value_seq_lengths"][:, None, None, None]
    if "query_seq_lengths" in kw:
        ok &= i < kw["query_seq_lengths"][:, None, None, None]
    return ok


@pytest.fixture
def fused_calls(monkeypatch):
    """The calls torch_attn makes to PyTorch's fused kernel, recorded."""
    calls = []
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k) or TORCH_SDPA(*a, **k))
    return calls


def run_implementation(implementation, q, k, v, **kw):
    """The output of "explicit" (weights asked for) or of "fused" (no_grad: the automatic
    choice), each checked to be the one recorded."""
    with record() as ran:
        if implementation == "explicit":
            out = sdpa(q, k, v, return_weights=True, **kw)[0]
        else:
            with torch.no_grad():
                out = sdpa(q, k, v, **kw)
    assert ran == [("torch", implementation)]
    return out


@pytest.mark.parametrize("implementation", ["explicit", "fused"])
@pytest.mark.parametrize("hkv", [1, 2, 3], ids=["mqa", "gqa2", "gqa3"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("batch", [(B,), ()], ids=["batched", "unbatched"])
def test_grouped_heads_match_torch_kernel(implementation, hkv, is_causal, batch, fused_calls):
    rng, seed = fresh_rng()
    q, k, v = tensors(rng, hkv, torch.float32, batch)
    out = run_implementation(implementation, q, k, v, is_causal=is_causal, scale=0.7)
    expected = TORCH_SDPA(q, k, v, is_causal=is_causal, enable_gqa=True, scale=0.7)
    assert bool(fused_calls) == (implementation == "fused")
    if implementation == "fused":
        assert fused_calls[0].get("enable_gqa") is True
    assert compare(out.numpy(), expected.numpy(), "float32").ok, f"seed {seed}"


@pytest.mark.parametrize("implementation", ["explicit", "fused"])
@pytest.mark.parametrize("case", ALLOWED_CASES)
def test_allowed_set_matches_hand_built_mask(implementation, case, fused_calls):
    """On rows with an allowed key, PyTorch's kernel with the mask built by hand; the other
    rows are zeros."""
    rng, seed = fresh_rng()
    q, k, v = tensors(rng, hkv=3)
    kw = ALLOWED_CASES[case]
    out = run_implementation(implementation, q, k, v, **torch_kwargs(kw)).numpy()
    ok = allowed_by_hand(kw)
    live = np.broadcast_to(ok.any(-1), (B, H, LQ))
    expected = TORCH_SDPA(q, k, v, attn_mask=torch.from_numpy(ok), enable_gqa=True).numpy()
    assert bool(fused_calls) == (implementation == "fused")
    assert compare(out[live], expected[live], "float64").ok, f"seed {seed}"
    assert (out[~live] == 0).all()


def test_grouped_heads_equal_repeated_kv_with_group_sum_gradients():
    rng, seed = fresh_rng()
    g = 3
    q, k, v = tensors(rng, hkv=H // g, grad=True)
    k_rep, v_rep = (x.detach().repeat_interleave(g, dim=-3).requires_grad_() for x in (k, v))
    out, w = sdpa(q, k, v, is_causal=True, return_weights=True, softcap=2.0)
    out_rep, w_rep = sdpa(q, k_rep, v_rep, is_causal=True, return_weights=True, softcap=2.0)
    cot = torch.tensor(rng.standard_normal(out.shape))
    out.backward(cot)
    out_rep.backward(cot)
    for a, e in [(out, out_rep), (w, w_rep)]:
        assert compare(a.detach().numpy(), e.detach().numpy(), "float64").ok, f"seed {seed}"
    for x, x_rep in [(k, k_rep), (v, v_rep)]:
        group_sum = x_rep.grad.unflatten(-3, (H // g, g)).sum(-3)  # (B, Hkv, Lk, D)
        assert compare(x.grad.numpy(), group_sum.numpy(), "float64", "grad", terms=g).ok


@pytest.mark.parametrize("implementation", ["explicit", "fused"])
def test_int_and_tensor_offsets_agree(implementation):
    rng, _ = fresh_rng()
    q, k, v = tensors(rng, hkv=2)
    kw = dict(is_causal=True, local_window_size=(2, 1))
    as_int = run_implementation(implementation, q, k, v, query_offset=3, **kw)
    as_tensor = run_implementation(implementation, q, k, v, query_offset=torch.tensor([3, 3]),
                                   **kw)
    torch.testing.assert_close(as_int, as_tensor, rtol=0, atol=0)
    unbatched = run_implementation(implementation, q[1], k[1], v[1],
                                   query_offset=torch.tensor(3), **kw)
    torch.testing.assert_close(unbatched, as_int[1], rtol=0, atol=0)


def test_softcap_by_hand():
    rng, seed = fresh_rng()
    q, k, v = tensors(rng)
    out, w = sdpa(q, k, v, softcap=1.5, return_weights=True)
    s = q @ k.transpose(-2, -1) / DK**0.5
    expected = torch.softmax(1.5 * torch.tanh(s / 1.5), dim=-1)
    assert compare(w.numpy(), expected.numpy(), "float64", "weights").ok, f"seed {seed}"
    assert compare(out.numpy(), (expected @ v).numpy(), "float64").ok, f"seed {seed}"


def test_softcap_forces_the_explicit_path(fused_calls):
    rng, _ = fresh_rng()
    with torch.no_grad():
        sdpa(*tensors(rng), softcap=3.0)
    assert not fused_calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_with_an_empty_row_gives_zeros_and_finite_gradients(dtype):
    rng, _ = fresh_rng()
    q, k, v = tensors(rng, hkv=2, dtype=dtype, grad=True)
    mask = torch.ones(LQ, LK, dtype=torch.bool)
    mask[1] = False  # row 1 empty
    bias = torch.tensor(rng.standard_normal((LQ, LK)), dtype=dtype, requires_grad=True)
    out, w = sdpa(q, k, v, mask, bias, softcap=0.5, scale=100.0, return_weights=True,
                  local_window_size=(None, 4), query_offset=torch.tensor([0, 1]))
    (out.sum() + w.sum()).backward()
    assert (out[..., 1, :] == 0).all() and (w[..., 1, :] == 0).all()
    for x in (out, w, q.grad, k.grad, v.grad, bias.grad):
        assert torch.isfinite(x).all()
    assert (q.grad[..., 1, :] == 0).all() and (bias.grad[1] == 0).all()


def test_query_lengths_give_zero_rows_and_zero_gradients():
    rng, _ = fresh_rng()
    q, k, v = tensors(rng, hkv=3, grad=True)
    lengths = torch.tensor([5, 2])
    out, w = sdpa(q, k, v, query_seq_lengths=lengths, return_weights=True)
    out.backward(torch.tensor(rng.standard_normal(out.shape)))
    assert (out[1, :, 2:] == 0).all() and (w[1, :, 2:] == 0).all()
    assert (q.grad[1, :, 2:] == 0).all() and (q.grad[1, :, :2] != 0).all()
    assert (q.grad[0] != 0).all()


# Softcap runs the explicit implementation only.
REFERENCE_CASES = {**ALLOWED_CASES, "softcap_gqa": dict(softcap=1.0, scale=3.0, is_causal=True),
                   "softcap_all": dict(ALLOWED_CASES["all"], softcap=0.3, scale=2.0),
                   "sinks_softcap_chunks": dict(ALLOWED_CASES["chunks_causal_offset_lengths"],
                                                softcap=0.8, scale=2.0, sinks=True)}


def _reference_takes_new_arguments() -> bool:
    try:
        reference.scaled_dot_product_attention(
            np.zeros((2, 1, 3)), np.zeros((1, 1, 3)), np.zeros((1, 1, 2)), softcap=1.0,
            local_window_size=1, query_offset=1, key_value_seq_lengths=np.array(1),
            query_seq_lengths=np.array(1))
    except TypeError:
        return False
    return True


@pytest.mark.skipif(not _reference_takes_new_arguments(),
                    reason="golden.reference does not take the issue-9 arguments yet")
@pytest.mark.parametrize("implementation, case", [(p, c) for c in REFERENCE_CASES
                                                   for p in ("explicit", "fused")
                                                   if p == "explicit" or "softcap" not in c])
def test_matches_float64_reference(implementation, case):
    rng, seed = fresh_rng()
    q, k, v = tensors(rng, hkv=2)
    kw = dict(REFERENCE_CASES[case])
    if kw.get("sinks"):
        kw["sinks"] = rng.standard_normal(H)
    out = run_implementation(implementation, q, k, v, **torch_kwargs(kw))
    expected, expected_w = reference.scaled_dot_product_attention(
        q.numpy(), k.numpy(), v.numpy(), **kw)
    assert compare(out.numpy(), expected, "float64").ok, f"seed {seed}"
    if implementation == "explicit":
        _, w = sdpa(q, k, v, return_weights=True, **torch_kwargs(kw))
        assert compare(w.numpy(), expected_w, "float64", "weights").ok, f"seed {seed}"


# ---- attention sinks and chunks: by hand, and against transformers ---------------------------

def test_sinks_row_sums_and_empty_rows():
    # A row's weights sum to 1 − p_sink < 1; a row with no allowed key gives zeros everywhere
    # (the sink takes it all), gradients included, dL/dsinks too.
    rng, seed = fresh_rng()
    q, k, v = tensors(rng, hkv=3, grad=True)
    sinks = torch.tensor(rng.standard_normal(H), requires_grad=True)
    mask = torch.ones(B, 1, LQ, LK, dtype=torch.bool)
    mask[1, 0, 2] = False
    out, w = sdpa(q, k, v, mask, sinks=sinks, return_weights=True)
    out.backward(torch.tensor(rng.standard_normal(out.shape)))
    sums = w.detach().sum(-1)
    assert (sums[0] < 1).all() and (sums[1, :, [0, 1, 3, 4]] < 1).all(), f"seed {seed}"
    assert (out[1, :, 2] == 0).all() and (w[1, :, 2] == 0).all() and (q.grad[1, :, 2] == 0).all()
    only = torch.zeros(B, 1, LQ, LK, dtype=torch.bool)  # every row empty: dL/dsinks = 0
    sinks.grad = None
    sdpa(q, k, v, only, sinks=sinks).sum().backward()
    assert (sinks.grad == 0).all()


def test_fused_refuses_sinks_and_takes_chunks(fused_calls):
    rng, seed = fresh_rng()
    q, k, v = tensors(rng, hkv=3)
    with pytest.raises(ValueError, match="implementation='fused' cannot run this call: it has "
                                         "no sink logit"):
        sdpa(q, k, v, sinks=torch.zeros(H, dtype=torch.float64), implementation="fused")
    with torch.no_grad(), record() as ran:
        sdpa(q, k, v, sinks=torch.zeros(H, dtype=torch.float64))
    assert ran == [("torch", "explicit")] and not fused_calls
    with torch.no_grad(), record() as ran:
        sdpa(q, k, v, attention_chunk_size=2, is_causal=True)
    assert ran == [("torch", "fused")] and fused_calls


class _SinkModule(torch.nn.Module):
    """What transformers' GPT-OSS eager_attention_forward reads of its module."""

    def __init__(self, sinks, groups):
        super().__init__()
        self.sinks = torch.nn.Parameter(sinks)
        self.num_key_value_groups = groups
        self.training = False


@pytest.mark.parametrize("hkv", [2, 6], ids=["gqa", "mha"])
def test_sinks_match_transformers_gpt_oss(hkv):
    # transformers' GPT-OSS eager attention (float64, its additive mask 0 / −inf from a causal
    # sliding window, one query row with every key masked) against the core with sinks: the
    # output, the weights and every gradient, sinks included.
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    rng, seed = fresh_rng()
    q, k, v = tensors(rng, hkv=hkv, grad=True)
    hf_q, hf_k, hf_v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    sinks = torch.tensor(rng.standard_normal(H), requires_grad=True)
    module = _SinkModule(sinks.detach().clone(), H // hkv)
    kw = dict(is_causal=True, local_window_size=(3, None), query_offset=2)
    allowed = torch.from_numpy(reference.allowed_positions((B, 1, LQ, LK), **kw))
    allowed[1, 0, 3] = False  # a row with no key: the sink takes it all
    additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, -torch.inf)
    hf_out, hf_w = gpt_oss.eager_attention_forward(module, hf_q, hf_k, hf_v, additive,
                                                   scaling=DK ** -0.5)
    out, w = sdpa(q, k, v, allowed, sinks=sinks, return_weights=True)
    d_out = torch.tensor(rng.standard_normal(out.shape))
    (hf_out * d_out.transpose(1, 2)).sum().backward()  # HF's output is (B, Lq, H, Dv)
    (out * d_out).sum().backward()
    pairs = {"output": (out, hf_out.transpose(1, 2)), "weights": (w, hf_w),
             "query": (q.grad, hf_q.grad), "key": (k.grad, hf_k.grad),
             "value": (v.grad, hf_v.grad), "sinks": (sinks.grad, module.sinks.grad)}
    for name, (ours, theirs) in pairs.items():
        kind = {"output": "value", "weights": "weights"}.get(name, "grad")
        assert compare(ours.detach().numpy(), theirs.detach().numpy(), "float64", kind).ok, (
            f"{name}, seed {seed}")
    assert (w[1, :, 3] == 0).all() and (hf_w[1, :, 3] == 0).all()


@pytest.mark.parametrize("cached", [0, 4])
def test_chunks_match_transformers_llama4_mask(cached):
    # Llama 4's chunked causal mask (transformers' masking_utils, no left padding): the query
    # at position cached + i against keys 0 … cached + Lq − 1, in chunks of 3; and the mask
    # create_chunked_causal_mask gives a Llama 4 layer with a cache of `cached` tokens (its
    # chunked cache keeps the last keys only: they are compared, the earlier ones are ours to
    # exclude).
    masking = pytest.importorskip("transformers.masking_utils")
    transformers = pytest.importorskip("transformers")
    chunk, lk = 3, cached + LQ
    ours = reference.allowed_positions((B, 1, LQ, lk), is_causal=True,
                                       attention_chunk_size=chunk, query_offset=cached)
    where = Where(True, (None, None), cached, None, None, chunk)
    twin, _ = where.allowed((B, 1, LQ, lk), None, "cpu")
    np.testing.assert_array_equal(np.broadcast_to(twin.numpy(), ours.shape), ours)
    theirs = masking.sdpa_mask(
        batch_size=B, q_length=LQ, kv_length=lk, q_offset=cached, kv_offset=0,
        mask_function=masking.chunked_causal_mask_function(chunk, torch.zeros(B, dtype=int)),
        allow_is_causal_skip=False)
    np.testing.assert_array_equal(theirs.numpy(), ours)
    config = transformers.Llama4TextConfig(
        hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
        attention_chunk_size=chunk, num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    cache = transformers.DynamicCache(config=config)
    if cached:
        cache.update(torch.zeros(B, 1, cached, 4), torch.zeros(B, 1, cached, 4), 0)
    layer = masking.create_chunked_causal_mask(
        config=config, inputs_embeds=torch.zeros(B, LQ, 8), attention_mask=None,
        past_key_values=cache, position_ids=torch.arange(cached, lk)[None].expand(B, -1),
        allow_is_causal_skip=False).numpy()
    kept = layer.shape[-1]
    np.testing.assert_array_equal(layer, ours[..., lk - kept:])
    assert not ours[..., :lk - kept].any()
