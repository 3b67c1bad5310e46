"""MultiHeadLatentAttention (MLA, DeepSeek-V2/V3, Kimi K2): keys and values made per head from one
small latent per token, which is all its cache holds; the latent cache is appended to as
GroupedQueryAttention's KV cache is (its ``_cache_positions`` and ``_append``, on the latent
seen as one key-value head). Shape legend as in torch_attn.modules; the class docstring gives
the maths and its own letters.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from golden.specification import variants
from golden.specification.decoder import qk_normalize
from golden.specification.decoder import sliding_window as sliding_window_pair
from golden.specification.indexer import (INDEX_PARAMS, check_index_cache, check_index_mask,
                                          check_key_indices, refuse_selection, require_given)
from golden.specification.outputs import gate_kind, gated_output
from golden.specification.positions import KVCache, LatentCache, allowed_terms
from golden.specification.temperature import learned_temperature
from golden.specification.validate import (
    cache_shape, check_flags, check_latent_inputs, rope_arguments,
)
from torch_attn.explicit import LOW_PRECISION
from torch_attn.functional import scaled_dot_product_attention, takes_sparse
from torch_attn.modules.base import _config, _head_mask, _query_temperature
from torch_attn.modules.grouped_query import _append, _cache_positions
from torch_attn.rotary import rotary_embedding
from torch_attn.sparse import selected_mask


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (MLA) as DeepSeek-V2/V3 and Kimi K2 write it (transformers'
    DeepseekV3Attention): keys and values made per head from one small latent per token, which
    is all a cache holds.

    Shapes: x (B, L, d_in) or (L, d_in); r = kv_lora_rank, Dn = qk_nope_head_dim, Dr =
    qk_rope_head_dim, Dk = Dn + Dr, Dv = v_head_dim. q = x W_query, or with ``q_lora_rank`` R
    RMSNorm(x W_q_a + b_q_a) W_q_b (q_a_norm), (B, N, L, Dk), each head [q_nope | q_pe];
    x W_kv_a + b_kv_a = [c | k_pe] (B, L, r + Dr); the latent c RMS-normalised (kv_a_norm) and
    W_kv_b (no bias) make each head's [k_nope (Dn) | v (Dv)]; q_pe and the one rotary key head
    k_pe turned by RoPE (``rope_interleaved``: pairs (2i, 2i + 1), DeepSeek's layout; else
    "rotate half"), k_pe shared by every head; causal attention of [q_nope | q_pe] on
    [k_nope | k_pe], scale Dk^−1/2 times yarn's mscale(s, mscale_all_dim)²
    (golden.specification.variants.latent_scale) unless ``scale`` is given; out_proj (N·Dv ->
    d_out). ``sinks`` (HY-V4): a learned logit per head (N,) joins every softmax row, taking no
    value; ``output_gate`` (golden.specification.outputs: HY-V4's "sigmoid" per feature, W_gate
    (d_in, N·Dv), Ling 3.0's "sigmoid_per_head", W_gate (d_in, N), or the softplus kinds, no
    bias): the heads' output times act(x W_gate), from x, before out_proj. ``rope_key_norm``
    (dots.3-note's): k_pe RMS-normalised (times k_pe_norm (Dr,), ε rms_norm_eps) before RoPE.
    ``query_latent`` "normed_and_raw" (A.X-K2's, with a q LoRA): W_q_b (2R, N·Dk) and W_gate
    (2R, ·) read [RMSNorm(c_q) | c_q], c_q = x W_q_a + b_q_a; the indexer's query still reads
    RMSNorm(c_q). ``sliding_window`` W (dots.3-note's windowed layers; not with the indexer):
    each query sees W keys, its own included, as GroupedQueryAttention's. ``attention_bias``
    puts biases on W_q_a, W_kv_a and out_proj, as Hugging Face's. Output (B, L, d_out), weights
    (B, N, L, Lk), Lk = L or the cache's max_length M. ``query_seq_lengths`` and ``positions``
    as GroupedQueryAttention's.

    With ``cache`` (from ``init_cache``, golden.specification.positions.LatentCache) the call
    appends each token's normalised latent c and rotated k_pe at position cache.lengths[b] + i and
    returns (output, new cache); what does not fit in max_length is dropped, as
    GroupedQueryAttention drops it. ``absorb=True`` computes the same attention without making
    per-head keys and values (vLLM's and SGLang's decode): W_kv_b's key half folded into the query,
    q_lat = q_nope W_kb per head (B, N, L, r), scores [q_lat | q_pe] · [c | k_pe] on the one latent
    "head" (the core's multi-query attention), weights · c (B, N, L, r) then W_kv_b's value half per
    head.

    With ``index_topk`` k (DeepSeek-V3.2's learned indexer and its relatives; the options and
    the maths are golden.specification.indexer's and golden.reference.indexer's) each query
    attends only the k keys (of those it may see) that a small scorer ranks highest, equal
    scores won by the lowest key index (two stable sorts, ``select_keys``): q^I from q_resid or
    LayerNorm(x) through W_index_q (B, H_I, L, D_I), k^I = LayerNorm(x W_index_k) (B, L, D_I),
    RoPE on qk_rope_head_dim of their features, w = x W_index_weights (B, L, H_I), scores
    Σ_h w · H_I^−1/2 · ReLU(D_I^−1/2 q^I · k^I) in at least float32, all under no_grad (the
    indexer's parameters get no gradient). The choice reaches the core as its key_indices
    (``implementation=None`` then runs "sparse") when it keeps k ≤ Lk / SPARSE_UP_TO keys a row
    and no weights are asked (torch_attn.functional.takes_sparse), else as a mask ANDed into
    the call's (``_selection_mask``). ``key_indices`` (B, Lq, k) gives the choice instead;
    ``return_key_indices=True`` returns it, int32, after the output (and weights). The cache
    keeps k^I after RoPE as ``index_key`` (B, M, D_I).
    """

    variant = "multi_head_latent_attention"

    def __init__(self, d_in, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                 v_head_dim, q_lora_rank=None, d_out=None, attention_bias=False,
                 rms_norm_eps=1e-6, rope_theta=None, rope_parameters=None, rope_interleaved=True,
                 causal=True, scale=None, query_temperature=None, rope=True, sinks=False,
                 output_gate=False, rope_key_norm=False, query_latent="normed",
                 sliding_window=None, index_topk=None, index_heads=None, index_head_dim=None,
                 index_rope="half", index_rope_dims="first", index_query="latent",
                 index_temperature=False, index_scale="scores", index_norm_eps=1e-6,
                 index_select="tokens"):
        super().__init__()
        self.config = _config(self.variant, d_in=d_in, num_heads=num_heads,
                              kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                              qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
                              q_lora_rank=q_lora_rank, d_out=d_out, attention_bias=attention_bias,
                              rms_norm_eps=rms_norm_eps, rope_theta=rope_theta,
                              rope_parameters=rope_parameters, rope_interleaved=rope_interleaved,
                              causal=causal, scale=scale, query_temperature=query_temperature,
                              rope=rope, sinks=sinks, output_gate=output_gate,
                              rope_key_norm=rope_key_norm, query_latent=query_latent,
                              sliding_window=sliding_window,
                              index_topk=index_topk, index_heads=index_heads,
                              index_head_dim=index_head_dim, index_rope=index_rope,
                              index_rope_dims=index_rope_dims, index_query=index_query,
                              index_temperature=index_temperature, index_scale=index_scale,
                              index_norm_eps=index_norm_eps, index_select=index_select)
        sizes = variants.latent_sizes(self.config)
        self.rotary = variants.latent_rope(self.config)
        self.scale = variants.latent_scale(self.config)
        self.d_in, self.num_heads, self.kv_lora_rank = d_in, num_heads, kv_lora_rank
        self.nope, self.rope, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rms_norm_eps, self.rope_interleaved, self.causal = (rms_norm_eps, rope_interleaved,
                                                                 causal)
        qk, bias = sizes["qk_head_dim"], attention_bias
        lora = q_lora_rank is not None
        self.W_query = None if lora else nn.Linear(d_in, num_heads * qk, bias=False)
        self.W_q_a = nn.Linear(d_in, q_lora_rank, bias=bias) if lora else None
        self.q_a_norm = nn.Parameter(torch.ones(q_lora_rank)) if lora else None
        shapes = variants.get(self.variant).shapes(self.config)  # W_q_b's, W_gate's inputs
        self.both = query_latent == "normed_and_raw"  # AXK2's [RMSNorm(c_q) | c_q]
        self.window = sliding_window_pair(sliding_window, causal)  # the core's (left, right)
        self.W_q_b = nn.Linear(*shapes["W_q_b"], bias=False) if lora else None
        self.W_kv_a = nn.Linear(d_in, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_norm = nn.Parameter(torch.ones(kv_lora_rank))
        self.W_kv_b = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim),
                                bias=False)
        self.out_proj = nn.Linear(num_heads * v_head_dim, sizes["d_out"], bias=bias)
        self.use_rope = rope  # False: q_pe and k_pe not turned (Kimi Linear)
        self.query_temperature = query_temperature  # Mistral Small 4's, after RoPE
        starts = variants.vector_starts(self.variant, self.config)  # the learned kind's
        for n in ("temperature_scale", "temperature_bias", "sinks",  # sinks: HY-V4's
                  "k_pe_norm",  # dots3's RMSNorm of the shared rotary key
                  *(n for n in INDEX_PARAMS if not n.startswith("W_"))):  # the indexer's
            setattr(self, n, nn.Parameter(torch.full(*starts[n])) if n in starts else None)
        for n in ("W_index_q", "W_index_k", "W_index_weights"):
            setattr(self, n, nn.Linear(*shapes[n], bias=False) if n in shapes else None)
        self.gate = gate_kind(output_gate)  # (activation, per head) or None
        self.W_gate = None if self.gate is None else nn.Linear(*shapes["W_gate"], bias=False)

    def init_cache(self, batch_size, max_length, dtype=None) -> LatentCache:
        """An empty cache: latent zeros (B, max_length, kv_lora_rank), rope_key zeros (B,
        max_length, qk_rope_head_dim) in ``dtype`` (default the parameters'), lengths zeros
        (B,) int32, on the parameters' device; with the learned indexer (``index_topk``) also
        index_key zeros (B, max_length, index_head_dim), its keys k^I after RoPE (Hugging
        Face's DynamicIndexedLayer), else index_key None."""
        cache_shape(batch_size, max_length, 1, 1)  # checks the sizes
        dtype = self.W_kv_a.weight.dtype if dtype is None else dtype
        device = self.W_kv_a.weight.device

        def zeros(width):
            return torch.zeros(batch_size, max_length, width, dtype=dtype, device=device)
        return LatentCache(
            zeros(self.kv_lora_rank), zeros(self.rope),
            torch.zeros(batch_size, dtype=torch.int32, device=device),
            None if self.W_index_k is None else zeros(self.W_index_k.out_features))

    def cache_bytes_per_token(self, dtype=None) -> int:
        """Bytes the cache holds per token and layer: (kv_lora_rank + qk_rope_head_dim
        [+ index_head_dim with the indexer]) · itemsize of ``dtype`` (default the parameters'),
        whatever num_heads."""
        dtype = self.W_kv_a.weight.dtype if dtype is None else dtype
        index = 0 if self.W_index_k is None else self.W_index_k.out_features
        return (self.kv_lora_rank + self.rope + index) * torch.empty(
            (), dtype=dtype).element_size()

    def forward(self, x, mask=None, *, cache=None, query_seq_lengths=None, positions=None,
                return_weights=False, absorb=False, key_indices=None, return_key_indices=False):
        """The layer (see the class docstring). With the learned indexer (``index_topk``):
        ``key_indices`` (B, Lq, k) integers in [0, Lk), k = min(index_topk, Lk), gives the
        keys each query attends (the indexer is not run: the given-selection mode);
        ``return_key_indices=True`` appends the keys used, int32 (B, Lq, k) best first, to what
        is returned: (y, key_indices) or (y, weights, key_indices), then (that, cache) with a
        cache."""
        check_latent_inputs(x, self.d_in, mask, query_seq_lengths, heads=self.num_heads,
                            positions=positions, cache=cache, kv_lora_rank=self.kv_lora_rank,
                            rope_dim=self.rope)
        check_flags(absorb=absorb, return_key_indices=return_key_indices)
        self._check_index_call(x, mask, cache, key_indices, return_key_indices)
        c_q = None if self.W_q_a is None else self.W_q_a(x)
        q_resid = None if c_q is None else self._norm(c_q, self.q_a_norm)
        q_in = torch.cat([q_resid, c_q], -1) if self.both else q_resid  # AXK2's: both
        q = self._split(self._query(x, q_in), self.nope + self.rope)  # (B, N, L, Dk)
        kv_a = self.W_kv_a(x)                                    # (B, L, r + Dr)
        latent = self._norm(kv_a[..., :self.kv_lora_rank], self.kv_a_norm)  # (B, L, r)
        k_pe = kv_a[..., None, :, self.kv_lora_rank:]            # (B, 1, L, Dr)
        if self.k_pe_norm is not None:  # dots3's: RMS-normalised before RoPE
            k_pe = self._norm(k_pe, self.k_pe_norm)
        offset, q_lengths, kv_lengths = None, query_seq_lengths, query_seq_lengths
        if cache is not None:
            held = _as_kv(cache)
            offset, q_lengths, kv_lengths = _cache_positions(held, x.shape[1], query_seq_lengths)
        bound = x.shape[-2] if cache is None else cache.latent.shape[1] + x.shape[1]
        turn = self._turner(offset, positions, bound)
        q_pe, k_pe = (turn(q[..., self.nope:]), turn(k_pe)) if self.use_rope else (
            q[..., self.nope:], k_pe)
        q_nope = q[..., :self.nope]
        if self.query_temperature is not None:  # both parts of q, at the tokens' positions
            q_nope, q_pe = (_query_temperature(self, t, offset, positions)
                            for t in (q_nope, q_pe))
        latent = latent.unsqueeze(-3)                            # (B, 1, L, r)
        index_key = None
        if self.W_index_k is not None:
            with torch.no_grad():  # the indexer has no gradient (Hugging Face's no_grad)
                index_key = self._index_key(x, turn)             # (B, 1, L, D_I)
        if cache is not None:
            held = _append(held, latent, k_pe if index_key is None else torch.cat(
                [k_pe, index_key.to(k_pe.dtype)], -1), q_lengths)
            latent, k_pe = held.key, held.value[..., :self.rope]  # (B, 1, M, r), (B, 1, M, Dr)
            index_key = None if index_key is None else held.value[..., self.rope:]
            cache = LatentCache(latent[:, 0], k_pe[:, 0], held.lengths,
                                None if index_key is None else index_key[:, 0])
        head_mask = _head_mask(mask, x)  # (B, 1 or N, L, Lk)
        chosen = None  # the selection as the core's key_indices (B, 1, L, k), when sparse pays
        if self.config["index_topk"] is not None:
            if key_indices is None:
                with torch.no_grad():
                    key_indices = self._index_select(
                        x, q_resid, index_key, head_mask, offset, positions, turn,
                        q_lengths, kv_lengths)
            if takes_sparse(key_indices.shape[-1], latent.shape[-2], return_weights):
                chosen = key_indices.unsqueeze(-3)
            else:
                head_mask = self._selection_mask(head_mask, key_indices, latent.shape[-2])
        attend = self._absorbed if absorb else self._expanded
        o = attend(q_nope, q_pe, latent, k_pe, head_mask, offset, q_lengths,
                   kv_lengths, return_weights, chosen)           # (B, N, L, Dv)
        o, w = o if return_weights else (o, None)
        y = self.out_proj(self._gated(o.transpose(-2, -3).flatten(-2),  # (B, L, d_out)
                                      q_in if self.both else x))
        out = (y, w) if return_weights else y
        if return_key_indices:
            out = (*(out if return_weights else (out,)), key_indices.to(torch.int32))
        return out if cache is None else (out, cache)

    def _turner(self, offset, positions, bound):
        """t (..., L, width) -> t turned by the layer's RoPE at the tokens' positions; ``pairs``
        "interleaved" (2i, 2i + 1), "half" (i, i + width/2), or None: the layer's own."""
        def turn(t, pairs=None):
            interleaved = self.rope_interleaved if pairs is None else pairs == "interleaved"
            return rotary_embedding(t, interleaved=interleaved, offset=offset,
                                    positions=positions, max_position=bound,
                                    **rope_arguments(self.rotary))
        return turn

    # ---- the learned indexer (golden.reference.indexer; no gradient through any of it) ----

    def _check_index_call(self, x, mask, cache, key_indices, return_key_indices):
        """ValueError for an indexer argument without the indexer, a mask with several heads,
        a cache without index_key, or given key_indices of another shape, dtype or range."""
        if self.config["index_topk"] is None:
            refuse_selection("index_topk", key_indices, return_key_indices)
            return
        require_given(self.config, key_indices)  # a "shared" layer chooses nothing itself
        lead = tuple(x.shape[:-2])
        check_index_mask(mask, lead)
        lk = x.shape[-2] if cache is None else cache.latent.shape[1]
        if cache is not None and self.W_index_k is not None:
            check_index_cache(cache, self.W_index_k.out_features, x.dtype)
        if key_indices is not None:
            if not isinstance(key_indices, torch.Tensor):
                raise ValueError(f"key_indices should be a torch.Tensor, got "
                                 f"{type(key_indices).__name__}")
            check_key_indices(key_indices.detach().cpu(), lead, x.shape[-2], lk,
                              min(self.config["index_topk"], lk))

    def _index_key(self, x, turn):
        """k^I = LayerNorm(x W_index_k) · w + b, its RoPE features turned: (B, 1, L, D_I), in
        x's dtype (what the cache keeps)."""
        k = self._layer_norm(self.W_index_k(x), self.index_k_norm, self.index_k_norm_bias)
        return self._index_rope(k.unsqueeze(-3), turn)

    def _index_rope(self, t, turn):
        """t (..., L, D_I) with its first or last qk_rope_head_dim features turned
        (index_rope_dims), rotate-half or interleaved pairs (index_rope); t without index_rope."""
        c, r = self.config, self.rope
        if c["index_rope"] is None:
            return t
        if c["index_rope_dims"] == "first":
            return torch.cat([turn(t[..., :r], c["index_rope"]), t[..., r:]], -1)
        d = t.shape[-1]
        return torch.cat([t[..., :d - r], turn(t[..., d - r:], c["index_rope"])], -1)

    def _index_scores(self, x, q_resid, index_key, offset, positions, turn):
        """I (B, Lq, Lk) = Σ_h w[t, h] · H_I^−1/2 · ReLU(D_I^−1/2 · q^I[t, h] · k^I[s]) in the
        reference's order (index_scale "weights": D_I^−1/2 on w instead), the projections and
        RoPE in x's dtype, the products and sums in at least float32 (Hugging Face's .float()).
        ``index_key`` (B, 1, Lk, D_I)."""
        c = self.config
        h, d = c["index_heads"], c["index_head_dim"]
        source = q_resid if c["index_query"] == "latent" else self._layer_norm(
            x, self.index_q_norm, self.index_q_norm_bias)
        q = self._split(self.W_index_q(source), d, h)                 # (B, H_I, L, D_I)
        if c["index_temperature"]:  # Mistral Large 4's, before RoPE
            q = self._index_temperature(q, offset, positions)
        compute = torch.float32 if x.dtype in LOW_PRECISION else x.dtype
        q = self._index_rope(q, turn).to(compute)
        dot = torch.einsum("...hld,...md->...lhm", q, index_key[..., 0, :, :].to(compute))
        w = self.W_index_weights(x).to(compute) * (1.0 / math.sqrt(h))  # (B, L, H_I)
        if c["index_scale"] == "scores":  # DeepSeek-V3.2: on q·k, before the ReLU
            dot = dot * (1.0 / math.sqrt(d))
        else:  # HY-V4: on the head weights
            w = w * (1.0 / math.sqrt(d))
        return torch.einsum("...lh,...lhm->...lm", w, dot.clamp(min=0))  # (B, Lq, Lk)

    def _index_temperature(self, q, offset, positions):
        """q^I (B, H_I, L, D_I) times s_h · ln(p + 1) + b_h at each token's position p
        (``positions``, or index + offset), in at least float32, rounded once."""
        compute = torch.float32 if q.dtype in LOW_PRECISION else q.dtype
        if positions is None:
            positions = torch.arange(q.shape[-2], device=q.device)       # (L,)
            positions = positions if offset is None else positions + offset[:, None]  # (B, L)
        factors = learned_temperature(
            positions.to(q.device), self.index_temperature_scale.to(compute),
            self.index_temperature_bias.to(compute), real=lambda n: n.to(compute),
            log1p=torch.log1p)                                        # (H_I, L) or (B, H_I, L)
        return (q.to(compute) * factors[..., None]).to(q.dtype)

    def _index_select(self, x, q_resid, index_key, head_mask, offset, positions, turn,
                      q_lengths, kv_lengths):
        """The indexer's choice key_indices (B, Lq, k), k = min(index_topk, Lk), among the keys
        each query may see (``head_mask`` (B, 1, Lq, Lk) or None, causal, lengths)."""
        scores = self._index_scores(x, q_resid, index_key, offset, positions, turn)
        lq, lk = scores.shape[-2:]
        row = torch.arange(lq, device=x.device)[:, None]                  # (Lq, 1)
        key = torch.arange(lk, device=x.device)                           # (Lk,)
        pos = row if offset is None else row + offset[:, None, None]      # (B, Lq, 1)
        terms = allowed_terms(row, key, pos, is_causal=self.causal, window=(None, None),
                              q_lengths=_lengths(q_lengths), kv_lengths=_lengths(kv_lengths))
        allowed = torch.ones(scores.shape, dtype=torch.bool, device=x.device)
        for t in terms + ([] if head_mask is None else [head_mask[..., 0, :, :]]):
            allowed = allowed & t
        return select_keys(scores, allowed, min(self.config["index_topk"], lk))

    def _selection_mask(self, head_mask, key_indices, lk):
        """The core's mask with the selection: ``head_mask`` (B, 1 or N, Lq, Lk) or None AND
        the chosen keys ``key_indices`` (B, Lq, k) on every head (where the core's sparse
        implementation would not pay: forward)."""
        return selected_mask(key_indices.unsqueeze(-3), head_mask, lk)  # (B, 1 or N, Lq, Lk)

    def _layer_norm(self, t, weight, bias):
        """LayerNorm of t (..., width) with weight and bias (index_norm_eps), in at least
        float32, rounded once to t's dtype."""
        compute = torch.float32 if t.dtype in LOW_PRECISION else t.dtype
        return qk_normalize(t.to(compute), "layer_with_bias", weight.to(compute),
                            self.config["index_norm_eps"], bias=bias.to(compute),
                            mean=lambda a: a.mean(-1, keepdim=True),
                            rsqrt=torch.rsqrt).to(t.dtype)

    def _expanded(self, q_nope, q_pe, latent, k_pe, mask, offset, q_lengths, kv_lengths,
                  return_weights, chosen=None):
        """Per-head keys [k_nope | k_pe] (B, N, Lk, Dk) and values (B, N, Lk, Dv) from the
        latent (B, 1, Lk, r) through W_kv_b, then the core."""
        kv = self._split(self.W_kv_b(latent[..., 0, :, :]), self.nope + self.v_head_dim)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        k = torch.cat([k_nope, k_pe.expand(k_nope.shape[:-1] + (self.rope,))], -1)
        q = torch.cat([q_nope, q_pe], -1)
        return scaled_dot_product_attention(
            q, k, v, mask, is_causal=self.causal, scale=self.scale,
            local_window_size=self.window, query_offset=offset, query_seq_lengths=q_lengths,
            key_value_seq_lengths=kv_lengths, return_weights=return_weights, key_indices=chosen,
            **self._sinks())

    def _absorbed(self, q_nope, q_pe, latent, k_pe, mask, offset, q_lengths, kv_lengths,
                  return_weights, chosen=None):
        """W_kv_b's key half W_kb (r, N, Dn) folded into the query, q_lat (B, N, L, r); the
        core on one key-value head, keys [c | k_pe] (B, 1, Lk, r + Dr), values c; the result
        (B, N, L, r) through W_kv_b's value half W_vb (r, N, Dv)."""
        w = self.W_kv_b.weight.T.unflatten(-1, (self.num_heads, -1))  # (r, N, Dn + Dv)
        w_kb, w_vb = w[..., :self.nope], w[..., self.nope:]
        q_lat = torch.einsum("...nld,rnd->...nlr", q_nope, w_kb)
        o = scaled_dot_product_attention(
            torch.cat([q_lat, q_pe], -1), torch.cat([latent, k_pe], -1), latent, mask,
            is_causal=self.causal, scale=self.scale, local_window_size=self.window,
            query_offset=offset, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
            return_weights=return_weights, key_indices=chosen, **self._sinks())
        o, w_ = o if return_weights else (o, None)
        o = torch.einsum("...nlr,rnv->...nlv", o, w_vb)
        return (o, w_) if return_weights else o

    def _sinks(self) -> dict:
        """The core's ``sinks`` (N,) when the module has them (one per query head, on the
        absorbed path's one latent "head" too)."""
        return {} if self.sinks is None else {"sinks": self.sinks}

    def _gated(self, merged, x):
        """The heads' output merged (B, L, N·Dv) times act(x W_gate) (golden.specification
        .outputs.gated_output; σ in merged's dtype, softplus in at least float32, as
        GroupedQueryAttention's), or as it is without a gate."""
        if self.W_gate is None:
            return merged
        compute = torch.float32 if merged.dtype in LOW_PRECISION else merged.dtype
        return gated_output(merged, self.W_gate(x), self.gate, self.num_heads,
                            sigmoid=torch.sigmoid, softplus=lambda z: (
                                z.to(compute).clamp(min=0) + torch.log1p(
                                    torch.exp(-z.to(compute).abs()))).to(z.dtype))

    def _query(self, x, q_in):
        """(B, L, N·Dk): x W_query, or q_in W_q_b, q_in = RMSNorm(c_q) with c_q = x W_q_a +
        b_q_a (``query_latent`` "normed_and_raw": [RMSNorm(c_q) | c_q])."""
        if self.W_query is not None:
            return self.W_query(x)
        return self.W_q_b(q_in)

    def _split(self, y, width, heads=None):
        """(B, L, heads·width) -> (B, heads, L, width); heads default num_heads."""
        heads = self.num_heads if heads is None else heads
        return y.unflatten(-1, (heads, width)).transpose(-2, -3)

    def _norm(self, t, weight):
        """RMSNorm of t times ``weight``, computed in at least float32, rounded once to t's
        dtype."""
        compute = torch.float32 if t.dtype in LOW_PRECISION else t.dtype
        return qk_normalize(t.to(compute), "rms", weight.to(compute), self.rms_norm_eps,
                            mean=lambda a: a.mean(-1, keepdim=True),
                            rsqrt=torch.rsqrt).to(t.dtype)


def _as_kv(cache) -> KVCache:
    """A LatentCache seen as a KVCache of one head (B, 1, M, ·), for _cache_positions and
    _append (shared with GroupedQueryAttention): key the latent, value the rope key, and the
    indexer's keys after it when the cache has them ([rope_key | index_key])."""
    value = cache.rope_key if cache.index_key is None else torch.cat(
        [cache.rope_key, cache.index_key], -1)
    return KVCache(cache.latent.unsqueeze(1), value.unsqueeze(1), cache.lengths)


def _lengths(lengths):
    """Query or key lengths (B,) as (B, 1, 1) against (B, Lq, Lk), or None."""
    return None if lengths is None else lengths[:, None, None]


def select_keys(scores, allowed, k):
    """key_indices (..., Lq, k) int64: each row's k highest ``scores`` (..., Lq, Lk) among its
    ``allowed`` keys, best first, equal scores won by the lowest key index, then (a row that
    allows fewer than k) its other keys by index: golden.reference.indexer.select_keys's two
    stable sorts (torch.topk does not promise which of equal scores it keeps)."""
    by_score = torch.argsort(torch.where(allowed, -scores, torch.zeros_like(scores)), dim=-1,
                             stable=True)
    refused = torch.gather(~allowed, -1, by_score).to(torch.uint8)
    order = torch.gather(by_score, -1, torch.argsort(refused, dim=-1, stable=True))
    return order[..., :k]
