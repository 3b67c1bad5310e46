"""The ``attn-parity`` command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

from golden.cli import main
from golden.runners import jax_runner
from tests.helpers import matrix


def _rows(out, prefix="sdpa_"):
    return [line for line in out.splitlines() if line.startswith(prefix)]


def test_check_prints_table_backend_and_summary(capsys):
    assert main(["check", "sdpa_plain", "sdpa_masked_row"]) == 0
    out = capsys.readouterr().out
    assert "JAX backend: cpu" in out
    rows = [line.split()[1:4] for line in _rows(out)]
    # Per fixture: torch with gradients (explicit) and forward-only (fused), JAX, at float32 and
    # float64, each row naming the core implementation that ran
    assert rows == 2 * [["torch", "explicit", "float32"], ["torch", "explicit", "float64"],
                        ["torch", "fused", "float32"], ["torch", "fused", "float64"],
                        ["jax", "explicit", "float32"], ["jax", "explicit", "float64"]]
    assert all(line.endswith("pass") for line in _rows(out))
    last = out.strip().splitlines()[-2:]  # implementations first, the reference apart
    assert last == ["12 passed, 0 failed", "regeneration check: the reference reproduces 2 of 2 "
                    "fixtures bit for bit"]


def test_check_has_no_fused_row_for_dropout(capsys):
    assert main(["check", "sdpa_dropout", "--framework", "torch", "--dtype", "float32"]) == 0
    assert [line.split()[1:3] for line in _rows(capsys.readouterr().out)] == [
        ["torch", "explicit"]]


def test_check_filters_by_pattern_framework_and_dtype(capsys):
    assert main(["check", "-k", "sdpa_masked_*", "--framework", "jax",
                 "--dtype", "float64"]) == 0
    rows = [line.split()[:4] for line in _rows(capsys.readouterr().out)]
    assert rows == [["sdpa_masked_row", "jax", "explicit", "float64"],
                    ["sdpa_masked_row_causal", "jax", "explicit", "float64"]]
    assert main(["check", "-k", "masked_row_c", "--framework", "reference"]) == 0
    out = capsys.readouterr().out
    assert _rows(out) == [] and "reproduces 1 of 1 fixtures" in out


def test_check_with_nothing_selected(capsys):
    assert main(["check", "-k", "no_such_fixture"]) == 2
    assert "nothing selected" in capsys.readouterr().out


def test_check_fails_on_a_wrong_fixture(capsys, monkeypatch):
    real = jax_runner.run_fixture

    def off(fixture, dtype):  # a JAX whose output is off by 1e-3
        result = real(fixture, dtype)
        return {**result, "output": result["output"] + 1e-3}

    monkeypatch.setattr(jax_runner, "run_fixture", off)
    assert main(["check", "sdpa_plain", "--framework", "jax", "--dtype", "float64"]) == 1
    out = capsys.readouterr().out
    assert "FAIL output" in out and out.strip().endswith("0 passed, 1 failed")


def test_check_fails_when_the_reference_no_longer_reproduces_a_fixture(capsys, monkeypatch):
    from golden import reference

    forward, backward = reference.VARIANTS["scaled_dot_product_attention"]

    def drifted(config, inputs, params):
        out, weights, saved = forward(config, inputs, params)
        return out * (1 + 2**-52), weights, saved

    monkeypatch.setitem(reference.VARIANTS, "scaled_dot_product_attention", (drifted, backward))
    assert main(["check", "sdpa_plain", "--framework", "reference"]) == 1
    out = capsys.readouterr().out
    assert "sdpa_plain: the reference does not reproduce output" in out
    assert "reproduces 0 of 1 fixtures" in out


@matrix  # the whole check again in a fresh interpreter: the quick suite checks it in-process
def test_regenerate_check_via_python_m():
    done = subprocess.run([sys.executable, "-m", "golden", "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 differ" in done.stdout


# --- attn-parity fixtures -----------------------------------------------------------------------

def test_fixtures_lists_a_module_fixture_with_its_configuration_and_shapes(capsys):
    assert main(["fixtures", "multi_head_attention_unbatched_qkv_bias_mask", "--json"]) == 0
    [entry] = json.loads(capsys.readouterr().out)
    # golden/specification/cases.py: x (7, 5), a (7, 7) mask, d_in 5, d_out 6, 3 heads, qkv_bias, no
    # out_bias;
    # every projection is (d_in, d_out) in the neutral layout, W_out (d_out, d_out)
    assert entry == {
        "name": "multi_head_attention_unbatched_qkv_bias_mask",
        "variant": "multi_head_attention", "dtypes": ["float32", "float64"],
        "config": {"d_in": 5, "d_out": 6, "num_heads": 3, "out_bias": False, "qkv_bias": True},
        "inputs": {"mask": [7, 7], "x": [7, 5]},
        "params": {"W_key": [5, 6], "W_out": [6, 6], "W_query": [5, 6], "W_value": [5, 6],
                   "b_key": [6], "b_query": [6], "b_value": [6]}}


def test_fixtures_text_filters_by_pattern_and_variant(capsys):
    assert main(["fixtures", "-k", "sdpa_plain"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "sdpa_plain  scaled_dot_product_attention  float32, float64",
        "  config: (defaults)",
        "  inputs: key (2, 3, 7, 4), query (2, 3, 5, 4), value (2, 3, 7, 6)",
        "  params: none",
        "1 fixture"]
    assert main(["fixtures", "-k", "sdpa_causal_*", "--variant", "multi_head_attention"]) == 2
    assert capsys.readouterr().out.strip() == "0 fixtures"
    assert main(["fixtures", "sdpa_causal_square"]) == 0
    assert "config: is_causal=True" in capsys.readouterr().out


def test_fixtures_lists_every_shipped_fixture_from_a_path_too(capsys, tmp_path):
    import golden

    assert main(["fixtures", "--json"]) == 0
    assert [e["name"] for e in json.loads(capsys.readouterr().out)] == golden.names()
    copy = tmp_path / "mine.npz"
    copy.write_bytes((golden.FIXTURE_DIR / "sdpa_plain.npz").read_bytes())
    assert main(["fixtures", str(copy)]) == 0
    assert capsys.readouterr().out.startswith("sdpa_plain  scaled_dot_product_attention")


def test_fixtures_answers_a_missing_name_with_one_line(capsys):
    assert main(["fixtures", "no_such_fixture"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attn-parity fixtures: error: ")
    assert "'no_such_fixture': no such file or fixture" in err[0]


# --- attn-parity compare --fixture FILE --no-torch ---------------------------------------------

def test_compare_fixture_without_torch(tmp_path, capsys):
    from golden import compare as C
    from golden.examples import port_pair as P

    path = C.freeze(C.compare(P.make_torch, P.make_flax, P.MAPPING, {"x": (2, 5, 8)}),
                    tmp_path / "port.npz",
                    torch_factory_spec="golden.examples.port_pair:make_torch",
                    flax_factory_spec="golden.examples.port_pair:make_flax")
    assert main(["compare", "--fixture", str(path)]) == 0
    with_torch = capsys.readouterr().out
    assert main(["compare", "--fixture", str(path), "--no-torch"]) == 0
    without = capsys.readouterr().out
    row = [line.split() for line in with_torch.splitlines() if line.startswith("output")][0]
    bare = [line.split() for line in without.splitlines() if line.startswith("output")][0]
    # output, flax path, rule, torch's three cells, then Flax's; without torch one "-"
    assert row[3:6] != ["-"] and bare[3] == "-" and bare[4:] == row[6:]
    assert main(["compare", "--fixture", str(path), "--no-torch", "--torch",
                 "golden.examples.port_pair:make_torch"]) == 2
    assert "--no-torch leaves torch out" in capsys.readouterr().err
    assert main(["compare", "--no-torch", "--torch", "golden.examples.port_pair:make_torch"]) == 2
    assert "--no-torch goes with --fixture FILE" in capsys.readouterr().err
