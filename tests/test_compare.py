"""``golden.compare``: a user's torch module against their Flax NNX port
(golden/examples/port_pair.py)."""

from __future__ import annotations

import argparse
import io
import json
import zipfile

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import golden
from golden import compare as C
from golden.compare import port_fixture
from golden.specification import mapping as mapping_lib
from golden.examples import port_pair as P

X = {"x": (2, 5, 8)}  # B=2, L=5, E=8
WRONG = {**P.MAPPING, "k_proj.weight": "key.kernel"}  # the transpose left out (8 × 8: fits)


@pytest.fixture(scope="module")
def good():
    return C.compare(P.make_torch, P.make_flax, P.MAPPING, X)


@pytest.fixture(scope="module")
def wrong():
    return C.compare(P.make_torch, P.make_flax, WRONG, X)


@pytest.fixture(scope="module")
def frozen(good, tmp_path_factory):
    path = tmp_path_factory.mktemp("port") / "block.npz"
    return C.freeze(good, path, torch_factory_spec="golden.examples.port_pair:make_torch",
                    flax_factory_spec="golden.examples.port_pair:make_flax")


def _whats(report, prefix):
    return [r["what"] for r in report.rows if r["what"].startswith(prefix)]


def test_faithful_port_passes(good):
    print(good.text())
    assert good.ok and good.first_divergent is None and good.failing_params == []
    assert _whats(good, "output") == ["output"]
    assert _whats(good, "grad ") == [f"grad {k}" for k in P.MAPPING] + ["grad input x"]
    assert _whats(good, "submodule") == [  # torch's execution order
        "submodule q_proj ~ query", "submodule k_proj ~ key", "submodule v_proj ~ value",
        "submodule o_proj ~ out", "submodule mlp.fc ~ mlp.fc", "submodule mlp.out ~ mlp.out"]
    assert all(r["torch_float32"]["ok"] and r["flax_float32"]["ok"] for r in good.rows)
    # the key bias's gradient is zero by structure (softmax ignores a constant per row)
    zero = [r["what"] for r in good.rows if r["flax_float32"]["zero"]]
    assert zero == ["grad k_proj.bias"]
    assert good.text().splitlines()[-1] == "pass"
    assert json.loads(json.dumps(good.to_json(), allow_nan=False))["ok"] is True


def test_json_writes_non_finite_numbers_as_null():
    """One rule for every report: a number that is not finite is null (golden.report.plain)."""
    rows = [{"what": "output", "flax_float32": {"max_abs": float("inf"), "rel_norm": np.nan}}]
    report = C.PortReport(ok=False, rows=rows, first_divergent=None, failing_params=[],
                          data={"seed": 1})
    doc = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert doc["rows"][0]["flax_float32"] == {"max_abs": None, "rel_norm": None}


def test_wrong_transpose_names_parameter_and_submodule(wrong):
    print(wrong.text())
    assert not wrong.ok
    assert "k_proj.weight" in wrong.failing_params
    assert wrong.first_divergent == "k_proj ~ key"
    assert wrong.suspects[0] == "k_proj.weight -> key.kernel (rule =)"
    ok = {r["what"]: r["ok"] for r in wrong.rows}
    assert ok["submodule q_proj ~ query"] and ok["submodule v_proj ~ value"]
    assert not ok["submodule k_proj ~ key"]
    assert all(r["torch_float32"]["ok"] for r in wrong.rows)  # the baseline is unaffected
    text = wrong.text()
    assert "first diverging submodule: k_proj ~ key" in text
    assert "grad k_proj.weight" in text.splitlines()[-1]


def test_rule_that_does_not_fit_names_key_and_shapes():
    table = {**P.MAPPING, "mlp.fc.weight": "mlp.fc.kernel"}
    with pytest.raises(ValueError, match=r"mlp\.fc\.weight -> mlp\.fc\.kernel: rule = gives "
                       r"shape \(6, 8\) from \(6, 8\), the Flax parameter has shape \(8, 6\)"):
        C.compare(P.make_torch, P.make_flax, table, X)
    table = {**P.MAPPING, "mlp.fc.weight": ("mlp.fc.kernel", "reshape(7,-1)")}
    with pytest.raises(ValueError, match=r"mlp\.fc\.weight -> mlp\.fc\.kernel: .*cannot "
                       r"reshape shape \(6, 8\)"):
        C.compare(P.make_torch, P.make_flax, table, X)


def test_unmapped_parameters_are_named():
    table = {k: v for k, v in P.MAPPING.items() if k != "v_proj.bias"}
    with pytest.raises(ValueError, match=r"torch parameters not mapped: \['v_proj\.bias'\]"):
        C.compare(P.make_torch, P.make_flax, table, X)

    def flax_with_extra():
        model = P.make_flax()
        model.gain = nnx.Param(jnp.ones(3))
        return model

    with pytest.raises(ValueError, match=r"Flax parameters no key maps to: \['gain'\]"):
        C.compare(P.make_torch, flax_with_extra, P.MAPPING, X)
    with pytest.raises(ValueError, match=r"^mapping: Flax parameters no key maps to: "
                       r"\['query\.bias'\]; targets that are not Flax nnx.Param paths: "
                       r"\['query\.bais'\]$"):
        C.compare(P.make_torch, P.make_flax, {**P.MAPPING, "q_proj.bias": "query.bais"}, X)
    with pytest.raises(ValueError, match="flax_factory should return a flax.nnx.Module, got "
                       "TorchBlock"):
        C.compare(P.make_torch, P.make_torch, P.MAPPING, X)


def test_neutral_tables_compose_to_the_declared_mapping(good, wrong):
    table = C.neutral(P.TORCH_NEUTRAL, P.FLAX_NEUTRAL)
    assert table == mapping_lib.parse(P.MAPPING)
    flax_wrong = {**P.FLAX_NEUTRAL, "W_key": ("key.kernel", "T")}
    assert C.neutral(P.TORCH_NEUTRAL, flax_wrong) == mapping_lib.parse(WRONG)
    for declared, flax_table in ((good, P.FLAX_NEUTRAL), (wrong, flax_wrong)):
        report = C.compare(P.make_torch, P.make_flax, C.neutral(P.TORCH_NEUTRAL, flax_table), X)
        assert (report.ok, report.failing_params, report.first_divergent) == (
            declared.ok, declared.failing_params, declared.first_divergent)


def test_neutral_composition_inverts_transposes_and_reshapes():
    w = np.random.default_rng(1).standard_normal((8, 6))  # neutral (in, out)
    torch_rule, flax_rule = "T;reshape(2,3,8)", "reshape(8,3,2);transpose(2,0,1)"
    table = C.neutral({"W": ("a.w", torch_rule)}, {"W": ("b.k", flax_rule)}, shapes={"W": (8, 6)})
    path, rule = table["a.w"]
    torch_w = mapping_lib.Rule.parse(torch_rule).apply(w)
    assert path == "b.k"
    np.testing.assert_array_equal(rule.apply(torch_w), mapping_lib.Rule.parse(flax_rule).apply(w))
    with pytest.raises(ValueError, match=r"torch rule T;reshape\(2,3,8\) of 'W' reshapes"):
        C.neutral({"W": ("a.w", torch_rule)}, {"W": ("b.k", flax_rule)})
    with pytest.raises(ValueError, match=r"only torch has \['V'\]"):
        C.neutral({"W": "a.w", "V": "a.v"}, {"W": "b.k"})


def test_freeze_then_check_port_round_trip(good, frozen):
    port = C.load_port(frozen)
    assert port["meta"]["format"] == "attn-parity-port"
    assert port["meta"]["submodules"][:2] == [["q_proj", "query"], ["k_proj", "key"]]
    np.testing.assert_array_equal(port["params"]["q_proj.weight"],
                                  good.data["weights"]["q_proj.weight"])
    report = C.check_port(frozen)  # the factories from the file's specs
    assert report.ok and report.first_divergent is None
    assert [r["what"] for r in report.rows] == [r["what"] for r in good.rows]
    assert [r["flax_float32"] for r in report.rows] == [r["flax_float32"] for r in good.rows]
    assert all(r["torch_float32"] is not None for r in report.rows)
    assert C.freeze(report, frozen.with_name("again.npz")).read_bytes() == frozen.read_bytes()


def test_given_arrays_masks_and_a_port_fixture_without_torch(tmp_path):
    x = np.random.default_rng(2).standard_normal((2, 5, 8))  # float64: rounded to float32
    mask = np.array([[1, 1, 0, 1, 0], [1, 0, 1, 1, 1]], dtype=bool)
    report = C.compare(P.make_torch, P.make_flax, P.MAPPING, {"x": x, "mask": mask}, seed=3)
    assert report.ok, report.text()
    assert _whats(report, "grad input") == ["grad input x"]  # the mask has no gradient
    np.testing.assert_array_equal(report.data["inputs"]["x"], x.astype(np.float32))
    assert report.data["inputs"]["mask"] is mask
    path = C.freeze(report, tmp_path / "masked.npz",
                    flax_factory_spec="golden.examples.port_pair:make_flax")
    again = C.check_port(path)  # no torch spec in the file: no baseline column
    assert again.ok and all(r["torch_float32"] is None for r in again.rows)
    assert C.load_port(path)["inputs"]["mask"].dtype == bool
    assert all(r["torch_float32"] is None for r in C.check_port(path, torch_factory=False).rows)


def test_check_port_catches_a_buggy_port(frozen):
    report = C.check_port(frozen, flax_factory=P.make_flax_wrong_key)
    print(report.text())
    assert not report.ok and "k_proj.weight" in report.failing_params
    assert all(r["torch_float32"]["ok"] for r in report.rows)  # torch from the file's spec
    # the buggy port never calls self.key, so the first pair with output is o_proj ~ out
    assert report.first_divergent == "o_proj ~ out"
    assert any("k_proj ~ key: not called in Flax" in n for n in report.notes)


def _rewrite(path, out, change):
    """A copy of a port fixture with ``change(members)`` applied, in the same container."""
    with np.load(path, allow_pickle=False) as z:
        members = {k: z[k] for k in z.files}
    meta = json.loads(str(members.pop("meta")[()]))
    change(meta, members)
    fixture = golden.specification.fixture
    fixture.write_atomic(out, fixture.to_bytes(port_fixture._PortFile(meta, members)))
    return out


def test_load_port_rejects_corrupt_and_foreign_files(frozen, tmp_path):
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(frozen.read_bytes()[:-200])
    with pytest.raises(golden.FixtureError, match="truncated.npz: not a readable fixture"):
        C.load_port(truncated)
    cases = {
        "format": (lambda m, a: m.update(format="attn-parity-fixture"),
                   r"meta.format should be 'attn-parity-port'"),
        "missing": (lambda m, a: a.pop("grads/k_proj.bias"),
                    r"members do not match meta: missing \['grads/k_proj.bias'\]"),
        "shape": (lambda m, a: a.update({"params/q_proj.bias": np.zeros(7),
                                         "grads/q_proj.bias": np.zeros(7)}),
                  r"params/q_proj.bias has shape \(7,\), meta.shapes says \(8,\)"),
        "nan": (lambda m, a: a["expected/output"].__setitem__((0, 0, 0), np.nan),
                r"expected/output should be finite float64"),
    }
    for name, (change, message) in cases.items():
        with pytest.raises(golden.FixtureError, match=f"{name}.npz: {message}"):
            C.load_port(_rewrite(frozen, tmp_path / f"{name}.npz", change))


UNPICKLED = []


class _Trap:
    def __reduce__(self):
        return (UNPICKLED.append, ("unpickled",))


def test_load_port_never_unpickles(frozen, tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(frozen) as src, zipfile.ZipFile(buf, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info))
        member = io.BytesIO()
        np.lib.format.write_array(member, np.array([_Trap()], dtype=object), allow_pickle=True)
        dst.writestr("submodules/extra.npy", member.getvalue())
    path = tmp_path / "pickled.npz"
    path.write_bytes(buf.getvalue())
    with pytest.raises(golden.FixtureError, match="pickled.npz: not a readable fixture"):
        C.load_port(path)
    assert UNPICKLED == []


def _cli(*argv, log=None):
    parser = argparse.ArgumentParser(prog="attn-parity compare")
    C.add_arguments(parser)
    lines = []
    code = C.run_cli(parser.parse_args(argv), log=lines.append)
    return code, "\n".join(lines)


PORT = "golden.examples.port_pair"
PAIR = ("--torch", f"{PORT}:make_torch", "--flax", f"{PORT}:make_flax")


def test_cli_compares_freezes_and_checks(tmp_path):
    fixture, report = tmp_path / "port.npz", tmp_path / "report.json"
    code, out = _cli(*PAIR, "--mapping", f"{PORT}:MAPPING", "--input", "x=2,5,8",
                     "--freeze", str(fixture), "--json", str(report))
    assert code == 0, out
    assert "first diverging submodule: none" in out and fixture.exists()
    written = json.loads(report.read_text())
    assert written["schema"] == "attn-parity-compare" and written["ok"] is True
    assert C.load_port(fixture)["meta"]["flax_factory"] == f"{PORT}:make_flax"
    code, out = _cli("--fixture", str(fixture))
    assert code == 0, out
    code, out = _cli("--fixture", str(fixture), "--flax", f"{PORT}:make_flax_wrong_key")
    assert code == 1 and out.splitlines()[-1].startswith("FAIL: output")


def test_cli_mapping_from_json_file_and_failure_exit(tmp_path):
    path = tmp_path / "mapping.json"
    path.write_text(json.dumps(mapping_lib.to_json(WRONG)))
    code, out = _cli(*PAIR, "--mapping", str(path), "--input", "x=2,5,8")
    assert code == 1 and "first diverging submodule: k_proj ~ key" in out


@pytest.mark.parametrize("argv, message", [
    (("--torch", f"{PORT}.make_torch", "--flax", f"{PORT}:make_flax",
      "--mapping", f"{PORT}:MAPPING", "--input", "x=2,5,8"),
     f"spec should be 'package.module:name', got '{PORT}.make_torch'"),
    (("--torch", "tests.no_such:make", "--flax", f"{PORT}:make_flax",
      "--mapping", f"{PORT}:MAPPING", "--input", "x=2,5,8"),
     "spec 'tests.no_such:make': cannot import 'tests.no_such'"),
    ((*PAIR, "--mapping", f"{PORT}:make_torch", "--input", "x=2,5,8"),
     f"--mapping '{PORT}:make_torch' should name a dict, got function"),
    ((*PAIR, "--mapping", f"{PORT}:MAPPING", "--input", "x=2,five,8"),
     "--input should be NAME=D1,D2,... with positive sizes and a new name, got 'x=2,five,8'"),
    ((*PAIR, "--mapping", f"{PORT}:MAPPING"), "compare needs --input (or --fixture FILE)"),
    ((*PAIR, "--mapping", f"{PORT}:MAPPING", "--input", "x=2,5,7"),
     "inputs: the torch module failed on inputs {'x': (2, 5, 7)}: RuntimeError"),
])
def test_cli_usage_errors_are_one_line(argv, message):
    code, out = _cli(*argv)
    assert code == 2
    assert out.startswith(f"attn-parity compare: error: {message}") and "\n" not in out
