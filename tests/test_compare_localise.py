"""``golden.compare`` locates a divergence by the paired submodules' inputs and outputs, and
says which steps of the torch float64 reference ran in float32 (the Qwen3-like block of
golden/examples/port_bugs.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flax import nnx

import golden
from golden import compare as C
from golden.compare import calls, localise, port_fixture, reference_steps, running
from golden.examples import port_bugs as P

X = {"x": (2, 5, 12)}  # B=2, L=5, E=12


def _compare(bug=None, torch_factory=P.make_torch):
    return C.compare(torch_factory, lambda: P.make_flax(bug), P.MAPPING, X)


@pytest.fixture(scope="module")
def faithful():
    return _compare()


def test_faithful_port_passes_without_a_diagnosis(faithful):
    print(faithful.text())
    assert faithful.ok and faithful.first_divergent is None and faithful.suspects == []
    assert faithful.diagnosis is None and faithful.interval is None
    inputs = [r["what"] for r in faithful.rows if r["what"].startswith("input of")]
    assert inputs == [f"input of {t} ~ {t}" for t in (  # torch's execution order
        "q_proj", "q_norm", "k_proj", "k_norm", "v_proj", "o_proj", "ln_2", "mlp.gate",
        "mlp.up", "mlp.down")]
    assert all(r["ok"] for r in faithful.rows)
    assert faithful.notes == [] and faithful.reference == {"float32_steps": {}}
    assert "diagnosis: no divergence" in faithful.text()
    doc = json.loads(json.dumps(faithful.to_json(), allow_nan=False))
    assert (doc["diagnosis"], doc["interval"]) == (None, None)


# bug -> (interval, first diverging submodule): every bug but the two in ln_2 lies in code
# between two paired submodules, so the one after it is the first whose output diverges
BETWEEN = {
    "rope_interleaved": (["v_proj ~ v_proj", "o_proj ~ o_proj"], "o_proj ~ o_proj"),
    "kv_tile": (["v_proj ~ v_proj", "o_proj ~ o_proj"], "o_proj ~ o_proj"),
    "no_causal_mask": (["v_proj ~ v_proj", "o_proj ~ o_proj"], "o_proj ~ o_proj"),
    "gelu": (["mlp.up ~ mlp.up", "mlp.down ~ mlp.down"], "mlp.down ~ mlp.down"),
    "input_bfloat16": ([None, "q_proj ~ q_proj"], "q_proj ~ q_proj"),
    "no_final_residual": (["mlp.down ~ mlp.down", None], None),
}


@pytest.mark.parametrize("bug", sorted(BETWEEN))
def test_a_bug_in_code_between_submodules_is_located_between_them(bug):
    report = _compare(bug)
    print(bug, report.text(), sep="\n")
    interval, first = BETWEEN[bug]
    assert not report.ok
    assert report.interval == interval and report.first_divergent == first
    assert report.suspects == []  # the next projection's correct weights are not blamed
    after, before = interval
    expected = (f"diverges after `{after}`, before `{before}`: in the code between them" if
                after and before else f"diverges before `{before}`: in the code between the "
                "module inputs and it" if before else f"diverges after `{after}`, in the code "
                "that follows it")
    assert report.diagnosis.startswith(expected)
    assert f"diagnosis: {report.diagnosis}" in report.text().splitlines()
    doc = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert doc["interval"] == interval and doc["diagnosis"] == report.diagnosis
    if before:  # the input of the pair after the bug differs, its predecessor's output agrees
        ok = {r["what"]: r["ok"] for r in report.rows}
        assert ok[f"input of {before}"] is False
        assert after is None or ok[f"submodule {after}"] is True


def test_a_bug_in_a_bypassed_call_is_located_over_it():
    """ln_2 written out by hand with eps 1e-2: the port never calls ln_2's __call__, so the
    interval spans it, and its parameters (used by the hand-written code) are the suspects."""
    report = _compare("ln_2_by_hand_eps")
    print(report.text())
    assert not report.ok
    assert report.interval == ["o_proj ~ o_proj", "mlp.gate ~ mlp.gate"]
    assert report.first_divergent == "mlp.gate ~ mlp.gate"
    assert report.suspects == ["ln_2.weight -> ln_2.scale (rule =)",
                               "ln_2.bias -> ln_2.bias (rule =)"]
    assert "the port does not call `ln_2`'s `__call__` (ln_2 ~ ln_2, which torch runs there)" \
        in report.diagnosis
    assert report.notes == ["submodule ln_2 ~ ln_2: not called in Flax: the port does not call "
                            "`ln_2`'s `__call__`, so its output is compared nowhere"]
    assert not any(r["what"].endswith("ln_2 ~ ln_2") for r in report.rows)


def test_a_correct_bypassed_call_passes_with_a_note():
    report = _compare("ln_2_by_hand")
    assert report.ok and report.diagnosis is None and report.interval is None
    assert report.notes == ["submodule ln_2 ~ ln_2: not called in Flax: the port does not call "
                            "`ln_2`'s `__call__`, so its output is compared nowhere"]


def test_a_bug_inside_a_submodule_is_located_inside_it():
    """q_norm built with the wrong epsilon: its input agrees, its output does not."""
    report = _compare("q_norm_eps")
    assert not report.ok and report.interval is None
    assert report.first_divergent == "q_norm ~ q_norm"
    assert report.diagnosis == ("diverges inside `q_norm ~ q_norm`: its input agrees, its "
                                "output does not (its parameters or its code)")
    assert report.suspects == ["q_norm.weight -> q_norm.scale (rule =)"]


def test_locate_walks_pairs_in_order():
    """_locate on hand-made findings: absorbed input differences, an input not compared, a
    failing backward pass."""
    def step(name, inp, out, missing=None):
        return {"pair": (name, name), "missing": missing, "input": inp, "output": out}

    absorbed = [step("a", True, True), step("n", False, True), step("b", True, False)]
    assert localise._locate(absorbed, False, [])["diagnosis"].startswith("diverges inside `b ~ b`")
    unknown = [step("a", True, True), step("e", None, False)]
    found = localise._locate(unknown, False, [])
    assert found["diagnosis"].startswith("diverges by the output of `e ~ e`, whose input "
                                         "could not be compared") and found["owners"] == [
        ("e", "e")]
    backward = localise._locate([step("a", True, True)], True, ["grad a.weight"])
    assert backward["interval"] is None and "the backward pass differs" in backward[
        "diagnosis"]
    assert localise._locate([step("a", True, True)], True, [])["diagnosis"] is None
    torch_only = localise._locate([step("t", None, None, "torch"), step("b", False, False)], False, [])
    assert torch_only["interval"] == [None, "b ~ b"] and torch_only["owners"] == []


def test_port_fixture_stores_submodule_inputs_and_reads_version_1(faithful, tmp_path):
    path = C.freeze(faithful, tmp_path / "block.npz")
    port = C.load_port(path)
    assert port["meta"]["format_version"] == 3  # 3: dtype and keywords besides
    assert list(port["expected"]["submodule_inputs"]) == [
        "q_proj", "q_norm", "k_proj", "k_norm", "v_proj", "o_proj", "ln_2", "mlp.gate",
        "mlp.up", "mlp.down"]
    np.testing.assert_array_equal(port["expected"]["submodule_inputs"]["q_proj"],
                                  faithful.data["inputs"]["x"])
    report = C.check_port(path, flax_factory=lambda: P.make_flax("kv_tile"),
                          torch_factory=False)
    assert report.interval == ["v_proj ~ v_proj", "o_proj ~ o_proj"]
    assert report.suspects == []

    with np.load(path, allow_pickle=False) as z:  # the same file as version 1 wrote it
        members = {k: z[k] for k in z.files if not k.startswith("submodule_inputs/")}
    meta = json.loads(str(members.pop("meta")[()]))
    del meta["submodule_inputs"]
    old = tmp_path / "version1.npz"
    fixture = golden.specification.fixture
    fixture.write_atomic(old, fixture.to_bytes(port_fixture._PortFile(
        {**meta, "format_version": 1}, members)))
    assert "submodule_inputs" not in C.load_port(old)["expected"]
    report = C.check_port(old, flax_factory=lambda: P.make_flax("kv_tile"), torch_factory=False)
    assert report.interval is None and report.first_divergent == "o_proj ~ o_proj"
    assert report.suspects == ["o_proj.weight -> o_proj.kernel (rule T)"]  # outputs alone
    assert any("format version 1" in n for n in report.notes)

    for version, message in ((4, r"meta.format_version should be one of \[1, 2, 3\] \(this "
                                 r"attn-parity reads those\), got 4"),):
        bad = tmp_path / f"version{version}.npz"
        fixture.write_atomic(bad, fixture.to_bytes(port_fixture._PortFile(
            {**meta, "format_version": version}, members)))
        with pytest.raises(golden.FixtureError, match=message):
            C.load_port(bad)
    stray = tmp_path / "stray.npz"
    fixture.write_atomic(stray, fixture.to_bytes(port_fixture._PortFile(
        {**meta, "submodule_inputs": ["nowhere"]}, members)))
    with pytest.raises(golden.FixtureError, match=r"meta.submodule_inputs should name torch "
                       r"paths of meta.submodules, got \['nowhere'\]"):
        C.load_port(stray)


def test_flax_call_is_restored_after_capturing_inputs():
    call = nnx.Linear.__call__
    _compare("gelu")
    assert nnx.Linear.__call__ is call and nnx.RMSNorm.__call__ is nnx.RMSNorm.__dict__[
        "__call__"]
    assert not hasattr(nnx.Linear.__call__, "_does_capturing")


# ---------------------------------------------------------------- float32 inside float64

NORM_OPS = ["to float32", "pow", "mean", "add", "rsqrt", "mul", "to float64"]


def test_float32_steps_of_an_hf_style_rmsnorm_are_found_and_measured():
    report = _compare(torch_factory=P.make_torch_hf_norm)
    print(report.text())
    assert report.ok  # no effect on the verdict here
    steps = report.reference["float32_steps"]
    assert steps == {"q_norm": NORM_OPS, "k_norm": NORM_OPS}
    moves = report.reference["moves"]
    assert 1e-10 < moves["output"] < 1e-6  # float32 rounding, carried through the block
    assert 1e-9 < max(moves.values()) < 4e-6
    assert report.reference["verdict_changes"] == []
    note = [n for n in report.notes if n.startswith("float32 steps")]
    assert len(note) == 1 and note[0].startswith(
        "float32 steps in the torch float64 reference: q_norm (to float32, pow, mean, add, "
        "rsqrt, mul, to float64), k_norm (")
    assert note[0].endswith(": no effect on the verdict (judged against the reference as run)")
    doc = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert doc["reference"]["float32_steps"] == steps


def test_promoted_reference_is_the_float64_maths():
    """Kept in float64, the HF-style norm computes what torch.nn.RMSNorm computes in float64
    (the faithful block's q_norm and k_norm): the float64 table's agreement, where the run as
    written is float32-close only."""
    rng = np.random.default_rng(4)
    weights = calls._draw_weights(rng, {k: tuple(p.shape) for k, p in
                                    P.make_torch().named_parameters()})
    x = {"x": calls._draw(rng, (2, 5, 12))}
    d_out = calls._draw(rng, (2, 5, 12))
    run = ("float64", weights, x, [], d_out)
    plain = running._run_torch(P.make_torch(), *run)
    as_run = running._run_torch(P.make_torch_hf_norm(), *run)
    with reference_steps._KeepFloat64(torch):
        kept = running._run_torch(P.make_torch_hf_norm(), *run)
    for key in ("output", "q_norm.weight"):
        e, a, k = (r["output"] if key == "output" else r["grads"][key]
                   for r in (plain, as_run, kept))
        assert golden.specification.tolerances.compare(k, e, "float64", "grad").ok, key
        assert not golden.specification.tolerances.compare(a, e, "float64", "grad").ok, key
    assert reference_steps._float32_steps(P.make_torch(), *run) == {}


def test_float32_steps_of_transformers_qwen3_rmsnorm_at_the_top_level():
    """Qwen3's own RMSNorm as the whole torch module, nnx.RMSNorm as the port."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    report = C.compare(lambda: Qwen3RMSNorm(6, eps=1e-6),
                       lambda: nnx.RMSNorm(6, epsilon=1e-6, rngs=nnx.Rngs(0)),
                       {"weight": "scale"}, {"x": (2, 5, 6)})
    assert report.ok
    assert report.reference["float32_steps"] == {"": NORM_OPS}
    assert 1e-10 < report.reference["moves"]["output"] < 1e-6
    assert report.notes[0].startswith("float32 steps in the torch float64 reference: the "
                                      "top-level module (to float32")


def test_a_mapping_that_pairs_different_submodules_reads_as_code_between():
    """docs/validating.md's caveat: q_norm paired with k_norm compares q with k."""
    table = {**P.MAPPING, "q_norm.weight": "k_norm.scale", "k_norm.weight": "q_norm.scale"}
    report = C.compare(P.make_torch, P.make_flax, table, X)
    assert not report.ok and report.interval == ["q_proj ~ q_proj", "q_norm ~ k_norm"]


def test_a_reference_that_cannot_be_recorded_leaves_the_comparison_standing(monkeypatch):
    def refuse(*run):
        raise RuntimeError("no dispatch modes here")

    monkeypatch.setattr(reference_steps, "_float32_steps", refuse)
    report = _compare(torch_factory=P.make_torch_hf_norm)
    assert report.ok and report.reference == {"error": "RuntimeError: no dispatch modes here"}
    assert report.notes == ["float32 steps in the torch float64 reference not measured: "
                            "RuntimeError: no dispatch modes here"]
