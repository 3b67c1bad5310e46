"""The fixture file: deterministic bytes, atomic writes, and rejection of bad files."""

from __future__ import annotations

import io
import json
import os
import zipfile

import numpy as np
import pytest

import golden
from golden.specification import fixture as fx
from golden.specification.cases import CASES
from golden.harness.regenerate import build, regenerate

SOME = CASES[0]


def _rewrite(src, dst, edit):
    """Copy a fixture's members through ``edit(members)`` into a new plain zip."""
    with np.load(src, allow_pickle=False) as z:
        members = {k: z[k] for k in z.files}
    edit(members)
    with zipfile.ZipFile(dst, "w") as zf:
        for k, a in members.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, a, allow_pickle=True)
            zf.writestr(k + ".npy", buf.getvalue())
    return dst


def test_build_is_deterministic_and_per_case():
    assert fx.to_bytes(build(SOME)) == fx.to_bytes(build(SOME))
    assert fx.to_bytes(build(SOME)) == (fx.FIXTURE_DIR / f"{SOME.name}.npz").read_bytes()


INTEGER_INPUTS = ("query_offset", "query_seq_lengths", "key_value_seq_lengths", "positions",
                  "context_lengths")


def test_inputs_are_float32_bool_or_int32_and_expectations_float64(fixture_name):
    f = golden.load(fixture_name)
    for name, a in f.inputs.items():
        want = (np.int32,) if name in INTEGER_INPUTS else (np.float32, np.bool_)
        assert a.dtype in want, f"inputs/{name} is {a.dtype}"
    assert not set(INTEGER_INPUTS) & set(f.grads), "an integer input has a gradient"
    assert all(a.dtype == np.float64 for n, a in {**f.expected, **f.grads}.items()
               if n != "key_indices")
    selects = (f.config.get("index_topk") is not None
               or f.config.get("index_blocks") is not None)  # a learned selection
    assert ("key_indices" in f.expected) == selects
    if "key_indices" in f.expected:  # an indexer's choice: keys, not values
        assert f.expected["key_indices"].dtype == np.int32


def test_integer_inputs_are_stored_exactly():
    # ("values", ...) specs give exactly the written numbers, as int32 in inputs/.
    f = golden.load("sdpa_mqa_decode_ragged")
    np.testing.assert_array_equal(f.inputs["query_offset"], [8, 5])
    np.testing.assert_array_equal(f.inputs["key_value_seq_lengths"], [9, 6])
    assert golden.load("sdpa_gqa_unbatched").inputs["query_offset"].shape == ()
    assert golden.load("sdpa_window_softcap_mask").config["local_window_size"] == [2, 1]


def test_load_by_path_and_name_agree(tmp_path):
    by_name = golden.load(SOME.name)
    by_path = golden.load(str(fx.FIXTURE_DIR / f"{SOME.name}.npz"))
    assert by_name.config == by_path.config
    np.testing.assert_array_equal(by_name.expected["output"], by_path.expected["output"])


def test_missing_fixture_is_named():
    # FixtureNotFound: caught as a missing file or as a bad argument alike
    for error in (FileNotFoundError, ValueError):
        with pytest.raises(error, match="no_such_case"):
            golden.load("no_such_case")


def test_corrupt_file_rejected(tmp_path):
    p = tmp_path / "garbage.npz"
    p.write_bytes(b"this is not a zip file at all")
    with pytest.raises(golden.FixtureError, match="garbage.npz: not a readable fixture"):
        golden.load(p)


def test_truncated_file_rejected(tmp_path):
    data = (fx.FIXTURE_DIR / f"{SOME.name}.npz").read_bytes()
    p = tmp_path / "truncated.npz"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(golden.FixtureError, match="truncated.npz: not a readable fixture"):
        golden.load(p)


def test_foreign_npz_rejected(tmp_path):
    p = tmp_path / "foreign.npz"
    np.savez(p, x=np.arange(3))
    with pytest.raises(golden.FixtureError, match="foreign.npz: no 'meta' member"):
        golden.load(p)


def test_pickled_member_rejected_without_unpickling(tmp_path):
    src = fx.FIXTURE_DIR / f"{SOME.name}.npz"

    def add_object(m):
        m["inputs/query"] = np.array([{"evil": 1}], dtype=object)

    p = _rewrite(src, tmp_path / "pickled.npz", add_object)
    with pytest.raises(golden.FixtureError, match="pickled.npz: not a readable fixture.*pickle"):
        golden.load(p)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.__setitem__("meta", np.array(json.dumps({**json.loads(str(m["meta"][()])),
                                                           "format_version": 99}))),
     f"format_version should be {golden.FORMAT_VERSION}, got 99"),
    (lambda m: _edit_meta(m, zero=["grads/no_such_array"]),
     r"meta.zero should list gradients among \['key', 'query', 'value'\]"),
    (lambda m: _edit_meta(m, zero=None), "meta.zero should list gradients"),
    (lambda m: m.__setitem__("meta", np.array(json.dumps({**json.loads(str(m["meta"][()])),
                                                           "format": "other"}))),
     "'meta.format' should be 'attn-parity-fixture'"),
    (lambda m: m.__setitem__("meta", np.array("{not json")), "'meta' is not valid JSON"),
    (lambda m: m.__setitem__("meta", np.array(json.dumps({**json.loads(str(m["meta"][()])),
                                                           "dtypes": ["float8"]}))),
     r"meta.dtypes should be a non-empty list drawn from .*got \['float8'\]"),
    (lambda m: m.pop("grads/key"), r"members do not match meta: missing \['grads/key'\]"),
    (lambda m: m.__setitem__("grads/key", m["grads/key"][..., :-1]),
     "grads/key shape .* does not match"),
    (lambda m: m.update({n: m[n][..., :-1, :] for n in ("inputs/value", "grads/value")}),
     r"inputs inconsistent with config: value shape should be \(B, Hkv, Lk, Dv\)"),
    (lambda m: m.__setitem__("expected/output", m["expected/output"].astype(np.float32)),
     "expected/output should be finite float64"),
])
def test_inconsistent_fixture_rejected(tmp_path, edit, message):
    p = _rewrite(fx.FIXTURE_DIR / f"{SOME.name}.npz", tmp_path / "bad.npz", edit)
    with pytest.raises(golden.FixtureError, match="bad.npz: " + message):
        golden.load(p)


def _edit_meta(members, **changes):
    members["meta"] = np.array(json.dumps({**json.loads(str(members["meta"][()])), **changes}))


@pytest.mark.parametrize("name, edit, message", [
    ("sdpa_lengths",
     lambda m: m.__setitem__("inputs/query_seq_lengths", np.array([3.0, 5.0], np.float32)),
     "inputs inconsistent with config: query_seq_lengths dtype should be an integer type"),
    ("sdpa_mqa_decode_ragged",
     lambda m: m.__setitem__("inputs/query_offset", np.array([8, 5, 1], np.int32)),
     r"inputs inconsistent with config: query_offset shape should be \(B,\) = \(2,\)"),
    ("sdpa_window_softcap_mask", lambda m: _edit_meta(m, config={"softcap": -1.0}),
     "variant, config and params disagree: softcap should be a positive number"),
    ("sdpa_window_softcap_mask", lambda m: _edit_meta(m, config={"local_window_size": [2]}),
     "variant, config and params disagree: local_window_size should be None"),
    ("sdpa_gqa_causal_offset",  # key with 4 heads, query with 6
     lambda m: m.update({n: np.concatenate([m[n], m[n][:, :1]], axis=1)
                         for n in ("inputs/key", "grads/key", "inputs/value", "grads/value")}),
     "inputs inconsistent with config: key and value heads Hkv should divide the query's H = 6"),
    ("self_attention_unbatched", lambda m: _edit_meta(m, variant="flash_attention"),
     "variant, config and params disagree: variant should be one of"),
    ("self_attention_unbatched", lambda m: _edit_meta(m, config={"d_in": 5, "d_k": 4}),
     r"variant, config and params disagree: parameter W_value shape should be \(5, 4\)"),
    ("self_attention_unbatched",
     lambda m: _edit_meta(m, config={"d_in": 5, "d_k": 4, "d_v": 6, "d_model": 8}),
     "variant, config and params disagree: d_model is not an argument of SelfAttention"),
    ("multi_head_attention_causal",
     lambda m: _edit_meta(m, config={"d_in": 5, "d_out": 12, "num_heads": 5}),
     "variant, config and params disagree: d_out should be divisible by num_heads = 5"),
    ("multi_head_attention_causal", lambda m: _edit_meta(m, config={"d_in": 5, "d_out": 12}),
     "variant, config and params disagree: num_heads is required by MultiHeadAttention"),
    ("multi_head_attention_causal",  # x shorter than the stored weights (B, N, L, L) imply
     lambda m: m.update({n: m[n][:, :-1] for n in ("inputs/x", "grads/x")}),
     r"expected/weights shape \(2, 3, 7, 7\) should be \(2, 3, 6, 6\)"),
    ("multi_head_attention_causal",  # an attention module's weights dropped
     lambda m: [m.pop(n) for n in ("expected/weights", "cotangents/weights")],
     r"members do not match meta: missing \['cotangents/weights', 'expected/weights'\] of "
     r"shape \(2, 3, 7, 7\)"),
    ("lightning_left_padding",  # a recurrent mixer given attention weights
     lambda m: m.update({n: np.zeros((2, 9, 9), dt) for n, dt in
                         (("expected/weights", np.float64), ("cotangents/weights", np.float32))}),
     "expected/weights should be absent: lightning_attention returns no attention weights"),
    ("lightning_left_padding",  # one of the two weights members alone
     lambda m: m.__setitem__("expected/weights", np.zeros((2, 9, 9))),
     r"members do not match meta: missing \['cotangents/weights'\]"),
    ("gated_delta_net_neg_eigval_left_padding",
     lambda m: m.__setitem__("inputs/mask", m["inputs/mask"].astype(np.int32)),
     "inputs inconsistent with config: mask dtype should be bool"),
    ("kimi_delta_bounded_sigmoid_full_rank",
     lambda m: _edit_meta(m, config={**json.loads(str(m["meta"][()]))["config"],
                                     "decay_lower_bound": None}),
     "variant, config and params disagree: decay_lower_bound should be a number < 0 with "
     "forget_gate 'bounded_sigmoid'"),
])
def test_module_fixture_params_checked(tmp_path, name, edit, message):
    p = _rewrite(fx.FIXTURE_DIR / f"{name}.npz", tmp_path / "bad.npz", edit)
    with pytest.raises(golden.FixtureError, match="bad.npz: " + message):
        golden.load(p)


def test_write_is_atomic(tmp_path, monkeypatch):
    p = tmp_path / "f.npz"
    p.write_bytes(b"old")

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        fx.write_atomic(p, b"new contents")
    assert p.read_bytes() == b"old"
    assert [q.name for q in tmp_path.iterdir()] == ["f.npz"], "a temporary file was left behind"


def test_regenerate_writes_then_check_passes(tmp_path, cached_builds):
    lines = []
    assert regenerate(directory=tmp_path, log=lines.append) == len(CASES) + 1  # + MANIFEST.json
    manifest = (tmp_path / "MANIFEST.json").read_bytes()
    assert manifest == (fx.FIXTURE_DIR / "MANIFEST.json").read_bytes()
    (tmp_path / "stale.npz").write_bytes(b"x")
    assert regenerate(check=True, directory=tmp_path, log=lines.append) == 1
    assert any("stale.npz (no such case)" in line for line in lines)
    assert regenerate(directory=tmp_path, log=lines.append) == 1  # removes the stale file
    assert regenerate(check=True, directory=tmp_path, log=lines.append) == 0


def test_fixtures_list_exactly_the_gradients_zero_by_structure(fixture_name):
    # The key bias's gradient is zero in exact arithmetic (golden.reference.ZERO_GRADS), except
    # under rotary embeddings, which turn the bias by each key's position, or a norm of the
    # keys, which rescales it by each key's own RMS; the float64 reference leaves rounding
    # noise far below every other gradient's scale.
    f = golden.load(fixture_name)
    real = f.config.get("rope_theta") is not None or "rope_theta" in (
        f.config.get("rope_parameters") or {}) or f.config.get("qk_norm") is not None
    assert f.zero == ([] if real else sorted(set(f.grads) & {"b_key"}))
    scale = max(np.abs(g).max() for n, g in f.grads.items() if n not in f.zero)
    for name in f.zero:
        assert np.abs(f.grads[name]).max() <= 1e-14 * scale, name
    if real and "b_key" in f.grads:  # not zero: a real gradient, checked relatively
        assert np.abs(f.grads["b_key"]).max() > 1e-3 * scale
