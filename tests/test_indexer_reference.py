"""The learned indexer of latent attention (issue 44; golden.reference.indexer): its scores
against a loop written out, its one tie rule, the layer with every key kept equal to dense
latent attention, gradients against central differences, bad settings refused by name, the
fixtures' score gaps, and Hugging Face's DeepseekV32Indexer and DeepseekV32Attention at
float64 (their parameters moved by hand: no from_hf for deepseek_v32 yet)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import golden
from golden import reference, runners
from golden.harness.regenerate import draw_params
from golden.reference.block import linear
from golden.reference.core import allowed_positions
from golden.reference.norms import normalize
from golden.reference.rotary import rope_cos_sin
from golden.specification import variants
from golden.specification.tolerances import TOLERANCES
from tests import port_numpy
from tests.helpers import fixture_of, selection_central_differences

MLA = "multi_head_latent_attention"
BASE = dict(d_in=6, num_heads=3, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=4,
            v_head_dim=5, q_lora_rank=7, rope_theta=100.0)
INDEX = dict(index_topk=5, index_heads=4, index_head_dim=6)
KINDS = {  # one of each family's settings
    "deepseek_v32": {},
    "glm5": dict(index_rope="interleaved"),
    "hy_v4": dict(index_rope_dims="last", index_scale="weights", index_norm_eps=1e-5),
    "mistral_large4": dict(q_lora_rank=None, index_query="layer_norm", index_temperature=True,
                           index_rope="interleaved"),
}
FIXTURES = [n for n in golden.names() if fixture_of(n).config.get("index_topk") is not None]
MIN_GAP = 1e-3  # the fixtures' smallest k-th to (k+1)-th score gap, relative to the row's largest


def _setup(kind, seed, lead=(2,), length=11):
    c = variants.get(MLA).config({**BASE, **INDEX, **KINDS[kind]})
    rng = np.random.default_rng(seed)
    p = {n: a.astype(np.float64) for n, a in draw_params(MLA, c, rng).items()}
    x = rng.standard_normal(lead + (length, c["d_in"]))
    return c, p, x, rng


def _q_resid(c, p, x):
    if "W_q_a" not in p:
        return None
    return normalize("rms", linear(x, p["W_q_a"], None), p["q_a_norm"], c["rms_norm_eps"])[0]


def _scores(c, p, x, positions):
    cos, sin = rope_cos_sin(variants.latent_rope(c), c["qk_rope_head_dim"], positions)
    return reference.index_scores(c, x, _q_resid(c, p, x), positions, cos, sin, p)


def _loop_scores(c, p, x, positions):
    """I[t, s] = Σ_h w[t, h] H^−1/2 ReLU(D^−1/2 q[t, h]·k[s]) one number at a time, RoPE by
    θ^(−2i/r) written out."""
    h, d, r, eps = c["index_heads"], c["index_head_dim"], c["qk_rope_head_dim"], c["index_norm_eps"]

    def layer_norm(v, w, b):
        mu = sum(v) / len(v)
        var = sum((e - mu) ** 2 for e in v) / len(v)
        return [(e - mu) / math.sqrt(var + eps) * w[i] + b[i] for i, e in enumerate(v)]

    def turn(v, pos):
        v = list(v)
        if c["index_rope"] is None:
            return v
        start = 0 if c["index_rope_dims"] == "first" else d - r
        out = list(v)
        for i in range(r // 2):
            angle = pos * c["rope_theta"] ** (-2 * i / r)
            a, b = ((start + 2 * i, start + 2 * i + 1) if c["index_rope"] == "interleaved"
                    else (start + i, start + i + r // 2))
            out[a] = v[a] * math.cos(angle) - v[b] * math.sin(angle)
            out[b] = v[b] * math.cos(angle) + v[a] * math.sin(angle)
        return out

    length = x.shape[0]
    if c["index_query"] == "latent":
        source = _q_resid(c, p, x)
    else:
        source = np.array([layer_norm(x[t], p["index_q_norm"], p["index_q_norm_bias"])
                           for t in range(length)])
    out = np.zeros((length, length))
    for t in range(length):
        w = [sum(x[t, i] * p["W_index_weights"][i, j] for i in range(c["d_in"])) for j in range(h)]
        for s in range(length):
            k = [sum(x[s, i] * p["W_index_k"][i, j] for i in range(c["d_in"])) for j in range(d)]
            k = turn(layer_norm(k, p["index_k_norm"], p["index_k_norm_bias"]), positions[s])
            total = 0.0
            for head in range(h):
                q = [sum(source[t, i] * p["W_index_q"][i, head * d + j]
                         for i in range(source.shape[1])) for j in range(d)]
                if c["index_temperature"]:
                    q = [e * (p["index_temperature_scale"][head] * math.log(positions[t] + 1)
                              + p["index_temperature_bias"][head]) for e in q]
                dot = sum(a * b for a, b in zip(turn(q, positions[t]), k)) / math.sqrt(d)
                total += w[head] / math.sqrt(h) * max(dot, 0.0)
            out[t, s] = total
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_scores_equal_a_loop_written_out(kind):
    c, p, x, _ = _setup(kind, 880, lead=(), length=7)
    positions = np.array([3, 4, 5, 6, 7, 8, 9])
    got, want = _scores(c, p, x, positions), _loop_scores(c, p, x, positions)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    assert (want > 0).any() and (want < 0).any()  # both signs of the head weights reached


def test_equal_scores_go_to_the_lowest_key_index():
    scores = np.array([[3.0, 1.0, 3.0, 2.0, 3.0, 0.0],
                       [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                       [1.0, 5.0, 5.0, 5.0, 1.0, 1.0]])
    allowed = np.array([[True] * 6, [True] * 6, [True, False, True, True, True, False]])
    want = [[0, 2, 4], [0, 1, 2], [2, 3, 0]]
    np.testing.assert_array_equal(reference.select_keys(scores, allowed, 3), want)
    with reference.exact_arithmetic():  # the fixtures' arithmetic, the same rule
        exact = reference.select_keys(reference.real(scores), allowed, 3)
    np.testing.assert_array_equal(exact, want)
    few = np.array([[True, False, False, True, False, False]])  # 2 allowed < k = 3
    np.testing.assert_array_equal(reference.select_keys(scores[:1], few, 3), [[0, 3, 1]])
    port = port_numpy.build(MLA, {**BASE, "index_topk": 3, "index_heads": 2,
                                  "index_head_dim": 4})  # the port's own sort, same rule
    port.index_scores = lambda x, q_resid, positions: np.repeat(scores[:, None], 6, axis=1)
    chosen = port.chosen_keys(np.zeros((3, 6, 1)), None, None, None, None)
    causal = np.tril(np.ones((6, 6), bool))
    np.testing.assert_array_equal(chosen[0, 5], reference.selected_mask([[0, 2, 4]], 6)[0])
    np.testing.assert_array_equal(chosen[1, 4], reference.selected_mask([[0, 1, 2]], 6)[0])
    np.testing.assert_array_equal(chosen[2, 1], causal[1] | reference.selected_mask([[2]], 6)[0])


@pytest.mark.parametrize("kind", KINDS)
def test_every_key_kept_when_short_equals_dense_latent_attention(kind):
    c, p, x, _ = _setup(kind, 881, length=5)  # L = 5 ≤ index_topk = 5
    lengths = np.array([5, 3], np.int32)
    forward, backward = reference.pair(MLA)
    y, w, saved = forward(c, {"x": x, "query_seq_lengths": lengths}, p)
    dense = {n: v for n, v in c.items() if not n.startswith("index_")}
    kept = {n: a for n, a in p.items() if "index" not in n}
    y0, w0, _ = forward(dense, {"x": x, "query_seq_lengths": lengths}, kept)
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(w, w0)
    assert saved["key_indices"].shape == (2, 5, 5)


@pytest.mark.parametrize("kind", KINDS)
def test_the_layer_is_dense_attention_under_the_chosen_mask(kind):
    """Forward and backward of the indexed layer equal those of the layer without indexer given
    the chosen keys as its mask, bit for bit: the choice is a constant to the gradient, and the
    indexer's parameters get none."""
    c, p, x, rng = _setup(kind, 882, length=11)
    mask = rng.random((2, 11, 11)) < 0.9
    forward, backward = reference.pair(MLA)
    y, w, saved = forward(c, {"x": x, "mask": mask}, p)
    chosen = reference.selected_mask(saved["key_indices"], 11)
    assert not chosen[:, 6:].all(), "the choice left every key"
    dense = {n: v for n, v in c.items() if not n.startswith("index_")}
    kept = {n: a for n, a in p.items() if "index" not in n}
    y0, w0, saved0 = forward(dense, {"x": x, "mask": mask & chosen}, kept)
    np.testing.assert_array_equal(y, y0)
    dy, dw = rng.standard_normal(y.shape), rng.standard_normal(w.shape)
    g, g0 = backward(saved, dy, dw), backward(saved0, dy, dw)
    assert set(g) == set(g0) == {"x", *kept}
    for n in g0:
        np.testing.assert_array_equal(g[n], g0[n], err_msg=n)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_equal_central_differences(kind):
    c, p, x, rng = _setup(kind, 883, length=9)
    forward, backward = reference.pair(MLA)
    y, w, saved = forward(c, {"x": x}, p)
    dy, dw = rng.standard_normal(y.shape), rng.standard_normal(w.shape)
    grads = backward(saved, dy, dw)

    def loss(xx, pp):
        out, weights, s = forward(c, {"x": xx}, pp)
        return float((out * dy).sum() + (weights * dw).sum()), s["key_indices"]

    checked = selection_central_differences(
        loss, x, p, grads, saved["key_indices"], ("x", "W_q_a" if "W_q_a" in p else "W_query", "W_kv_b", "W_out"), rng, 4)
    assert checked >= 12


@pytest.mark.parametrize("given, match", [
    (dict(index_rope="full"), "index_rope should be one of 'half', 'interleaved', None, got"),
    (dict(index_select="blocks"), "index_select should be 'tokens'.*MiniMax M3"),
    (dict(index_heads=None), "index_heads should be a positive int with index_topk = 5, "
                             "got None"),
    (dict(index_head_dim=3), "index_head_dim should be at least qk_rope_head_dim = 4"),
    (dict(q_lora_rank=None), "index_query should be 'layer_norm' without q_lora_rank"),
    (dict(index_topk=0), "index_topk should be a positive int, got 0"),
    (dict(index_topk=None), "index_heads should be None without index_topk"),
    (dict(rope=False, rope_theta=None), "index_rope should be None with rope=False"),
    (dict(index_scale="heads"), "index_scale should be one of 'scores', 'weights', got"),
    (dict(index_norm_eps=0), "index_norm_eps should be a positive number, got 0"),
])
def test_bad_settings_are_refused_by_name(given, match):
    with pytest.raises(ValueError, match=match):
        variants.get(MLA).config({**BASE, **INDEX, **given})


def test_bad_calls_are_refused_by_name():
    c, p, x, _ = _setup("deepseek_v32", 884, length=8)
    forward, _ = reference.pair(MLA)
    with pytest.raises(ValueError, match=r"key_indices shape should be \(B, Lq, k\) = "
                                         r"\(2, 8, 5\), got \(2, 8, 4\)"):
        forward(c, {"x": x, "key_indices": np.zeros((2, 8, 4), np.int32)}, p)
    with pytest.raises(ValueError, match=r"key_indices should lie in \[0, Lk\) = \[0, 8\)"):
        forward(c, {"x": x, "key_indices": np.full((2, 8, 5), 8, np.int32)}, p)
    with pytest.raises(ValueError, match="mask should have no head axis, or one of size 1, "
                                         "with index_topk"):
        variants.get(MLA).check_inputs(c, {"x": x, "mask": np.ones((2, 3, 8, 8), bool)}, 0.0)


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_gaps_and_given_selection(name):
    """Every row that sees more than k keys separates its k-th and (k+1)-th float64 scores by
    at least MIN_GAP of its largest (far above float32's error), so the choice is the same in
    any arithmetic; the stored key_indices are float64's choice; the layer given that choice
    (no indexer run) reproduces the fixture's output."""
    f = golden.load(name)
    c = variants.get(MLA).config(f.config)
    x = f.inputs["x"].astype(np.float64)
    p = {n: a.astype(np.float64) for n, a in f.params.items()}
    length, lead = x.shape[-2], x.shape[:-2]
    positions = f.inputs.get("positions", np.arange(length))
    scores = _scores(c, p, x, positions)
    lengths = f.inputs.get("query_seq_lengths")
    allowed = allowed_positions(lead + (length, length), f.inputs.get("mask"), c["causal"],
                                query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    k, gaps = min(c["index_topk"], length), []
    for row in np.ndindex(scores.shape[:-1]):
        v = np.sort(scores[row][allowed[row]])[::-1]
        if len(v) > k:
            gaps.append((v[k - 1] - v[k]) / np.abs(v).max())
    assert len(gaps) >= 5 and min(gaps) >= MIN_GAP, (len(gaps), min(gaps))
    fast = runners.run_reference(f, exact=False)
    np.testing.assert_array_equal(fast["key_indices"], f.expected["key_indices"])
    forward, _ = reference.pair(MLA)
    with reference.exact_arithmetic():
        y, _, _ = forward(f.config, {**f.inputs, "key_indices": f.expected["key_indices"]},
                          f.params)
    np.testing.assert_array_equal(reference.stored(f.config, y, None, {})[0],
                                  f.expected["output"])
    other = f.expected["key_indices"][..., ::-1].copy()
    other[..., 0] = (other[..., 0] + 1) % length  # one key changed in every row
    y2, _, _ = forward(f.config, {**f.inputs, "key_indices": other}, f.params)
    assert not np.allclose(y2, f.expected["output"])  # the given choice is what is used


# ---- Hugging Face's DeepSeek-V3.2 at float64 --------------------------------------------------

@pytest.mark.parametrize("length", [12, 4])  # above and below index_topk = 5
def test_hugging_face_deepseek_v32_at_float64(length):
    """HF's indexer (its scores in float32, as it computes them even in a float64 model) picks
    the same keys as ours wherever a row's k-th and (k+1)-th scores are clearly apart; HF's
    attention (its RMSNorms' float32 step replaced by the same formula in float64, RoPE's cos
    and sin ours) equals the reference layer given HF's own choice to float64's floor, and
    our own choice where every row agrees."""
    torch = pytest.importorskip("torch")
    harness = pytest.importorskip("tests.hf_harness")
    layer, config, params = harness.indexer_hf_case(44, topk=5)
    assert config == {**BASE, "v_head_dim": 5, **INDEX}
    c = variants.get(MLA).config(config)
    rng = np.random.default_rng(length)
    x = rng.standard_normal((2, length, 6))
    positions = np.arange(length)
    emb = harness.indexer_hf_rope(config, length, 2)  # ours, exact, in HF's layout
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))[None, None].repeat(2, 1, 1, 1)
    xt = torch.tensor(x)
    with torch.no_grad():
        q_resid = layer.q_a_layernorm(layer.q_a_proj(xt))
        hf_keys = layer.indexer(xt, q_resid, emb, causal[:, 0], None).numpy()
        hf_out = layer(xt, emb, causal)[0].numpy()
    assert hf_keys.shape == (2, length, min(5, length))
    forward, _ = reference.pair(MLA)
    ours, _, saved = forward(config, {"x": x}, params)
    scores = _scores(c, params, x, positions)
    allowed = np.broadcast_to(np.tril(np.ones((length, length), bool)), scores.shape)
    k, clear, agree = min(5, length), 0, 0
    for row in np.ndindex(scores.shape[:-1]):
        v = np.sort(scores[row][allowed[row]])[::-1]
        if len(v) > k and (v[k - 1] - v[k]) < 1e-4 * np.abs(v).max():
            continue  # a near-tie: float32 may choose otherwise
        clear += 1
        ok = allowed[row]
        mine, theirs = set(saved["key_indices"][row]), set(hf_keys[row].tolist())
        assert {j for j in mine if ok[j]} == {j for j in theirs if ok[j]}, row
        agree += 1
    assert clear >= 0.9 * np.prod(scores.shape[:-1])
    given, _, _ = forward(config, {"x": x, "key_indices": hf_keys.astype(np.int64)}, params)
    bound = TOLERANCES[("float64", "value")].rel_norm
    assert np.linalg.norm(given - hf_out) <= bound * np.linalg.norm(hf_out)
    if clear == np.prod(scores.shape[:-1]):
        assert np.linalg.norm(ours - hf_out) <= bound * np.linalg.norm(hf_out)
    if length > k:  # the setting undone moves far: without the indexer, another output
        dense = {n: v for n, v in config.items() if not n.startswith("index_")}
        kept = {n: a for n, a in params.items() if "index" not in n}
        far, _, _ = forward(dense, {"x": x}, kept)
        assert np.linalg.norm(far - hf_out) > 1e-3 * np.linalg.norm(hf_out)
