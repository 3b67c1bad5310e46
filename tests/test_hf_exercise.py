"""``attn-parity hf`` exercises each setting that acts only past some length: a converter that
gets a sliding window, a chunk size or a RoPE scaling's long-context switch wrong fails the
run on a checkpoint where that setting is larger than the 8 tokens drawn by default. Each
test plants the wrong conversion (as tests/test_hf_command.py does) and sees HF's own module
disagree on those layers only; and the same checkpoint with the right conversion passes.
The reports the command writes (--json, --junit, --html) and its text output are checked end
to end here too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import numpy as np
import pytest

from golden import hf
from golden.cli import main
from golden.verifier import check as hf_check
from golden.verifier import exercise as hf_exercise

transformers = pytest.importorskip("transformers")

from tests.hf_harness import BASE  # noqa: E402
from tests.test_hf_command import FAMILIES, _save  # noqa: E402
from tests.test_hf_import_fused import LONGROPE  # noqa: E402


def _saved(name, directory, **changes):
    """A tiny checkpoint of the family (tests/test_hf_import*.py's config) with ``changes``."""
    family = FAMILIES[name]
    base = BASE if name not in ("phi3",) else {k: v for k, v in BASE.items()
                                               if k not in ("head_dim", "num_key_value_heads")}
    config = getattr(transformers, family.config)(**{**base, **family.kw, **changes})
    return _save(transformers.AutoModelForCausalLM.from_config(config), directory, 0)


def _planted(monkeypatch, name, change):
    """Plant ``change(settings)`` into the family's conversion."""
    family = hf.FAMILIES[name]

    def wrong(c, layer_idx, sd):
        return change(family.settings(c, layer_idx, sd))

    monkeypatch.setitem(hf.FAMILIES, name, family.__class__(
        family.variant, wrong, family.to_neutral, family.from_neutral, family.unsupported))


def _failing(report):
    return {(r["fixture"], r["implementation"]) for r in report["rows"]
            if r["status"] in ("fail", "error")}


def _without(key):
    return lambda ours: {k: v for k, v in ours.items() if k != key}


def _run(directory, **kw):
    return hf_check.run(directory, frameworks=["torch"], log=lambda item: None,
                        progress=False, **kw)


@pytest.mark.parametrize("window", [20, 4096])
def test_a_wrong_window_fails_past_eight_tokens(window, tmp_path, monkeypatch):
    # A window of 20 is drawn on 23 tokens; one of 4096 (over --max-length) on a scaled copy
    # of the config with window 6, on 9 tokens. Dropped, or one key short, HF disagrees on the
    # sliding layer only.
    directory = _saved("qwen2", tmp_path / "qwen2", sliding_window=window)
    report = _run(directory)
    assert report["summary"]["ok"] and _failing(report) == set()
    notes = report["checkpoint"]["exercised"]
    scaled = window > hf_exercise.MAX_LENGTH
    assert report["checkpoint"]["lengths"] == [hf_exercise.SCALED + 3 if scaled else window + 3]
    assert any(f"sliding_window {window}: exercised" in n for n in notes)
    assert any(f"as {hf_exercise.SCALED}" in n for n in notes) == scaled
    for change in (_without("sliding_window"),
                   lambda ours: {**ours, "sliding_window": ours["sliding_window"] - 1}
                   if "sliding_window" in ours else ours):
        with monkeypatch.context() as m:
            _planted(m, "qwen2", change)
            assert _failing(_run(directory)) == {("layer 1 (sliding_attention)", "hf")}


def test_a_wrong_chunk_size_fails_past_eight_tokens(tmp_path, monkeypatch):
    directory = _saved("llama4_text", tmp_path / "llama4", attention_chunk_size=12)
    assert _failing(_run(directory)) == set()
    _planted(monkeypatch, "llama4_text", _without("attention_chunk_size"))
    report = _run(directory)
    assert report["checkpoint"]["lengths"] == [15]
    assert _failing(report) == {("layer 0 (chunked_attention)", "hf")}


def test_a_wrong_long_context_switch_fails_past_the_switch(tmp_path, monkeypatch):
    # Phi-3's longrope uses its long factors past original_max_position_embeddings = 32: a
    # second input at positions around 32 reaches them. Planted: the short factors past the
    # switch too (as if it never switched).
    directory = _saved("phi3", tmp_path / "phi3", original_max_position_embeddings=32,
                       max_position_embeddings=128, rope_parameters=LONGROPE)
    report = _run(directory)
    assert _failing(report) == set()
    names = {r["fixture"] for r in report["rows"]}
    assert names == {"layer 0 (attention)", "layer 0 (attention) @ positions 28-35"}

    def never(ours):
        rope = ours["rope_parameters"]
        return {**ours, "rope_parameters": dict(rope, long_factor=rope["short_factor"])}

    _planted(monkeypatch, "phi3", never)
    assert _failing(_run(directory)) == {("layer 0 (attention) @ positions 28-35", "hf")}


def test_the_text_output_and_every_report_end_to_end(tmp_path, capsys):
    directory = _saved("qwen2", tmp_path / "qwen2", sliding_window=20)
    json_path, junit_path, html = tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "html"
    status = main(["hf", str(directory), "--framework", "torch", "--framework", "hf",
                   "--no-cache", "--json", str(json_path), "--junit", str(junit_path),
                   "--html", str(html)])
    out = capsys.readouterr().out
    assert status == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("checkpoint: model_type qwen2; 1 file(s); 2 attention layers "
                               "of 2 the config implies")
    assert "inputs: drawn N(0, 1) rounded to float32, batch 2, 23 tokens" in out
    assert ("attention (1 layer): grouped-query; 4 heads (2 key-value) of 6; RoPE yarn θ 500 x4; "
            "sliding_window 20\n") in out  # the other layer: the same but full attention
    assert ("attention (1 layer): grouped-query; 4 heads (2 key-value) of 6; RoPE yarn θ 500 "
            "x4\n") in out
    assert ("exercised: sliding_window 20: exercised (on 23 tokens or more) "
            "(layer 1 (sliding_attention))") in out
    header = next(line for line in lines if line.startswith("layer "))
    assert header.split() == ["layer", "implementation", "dtype", "max", "rel", "err", "worst",
                              "err/bound", "result"]
    end = lines.index(next(line for line in lines if line.startswith("summary: ")))
    assert lines[end - 1].startswith("not supported (2 rows): hf float64: HF computes RoPE's "
                                     "angles")
    assert lines[end].startswith("summary: 2 of 2 layers checked; 10 passed, 0 failed, 2 not "
                                 "supported;")
    rows = lines[lines.index(header) + 1:end - 1]
    assert len(rows) == 10 and all(row.endswith("pass") for row in rows)  # not: unsupported
    assert lines[end + 1:] == [f"wrote {json_path}", f"wrote {junit_path}",
                               f"wrote {html}/index.html"]
    report = json.loads(json_path.read_text())
    assert report["summary"]["passed"] == 10 and report["checkpoint"]["lengths"] == [23]
    cases = ET.parse(junit_path).getroot().iter("testcase")
    assert {c.get("name") for c in cases} == {"torch explicit float32", "torch explicit float64",
                                              "torch fused float32", "torch fused float64",
                                              "hf float32", "hf float64"}
    assert "layer 1 (sliding_attention)" in (html / "index.html").read_text()


def test_selection_and_fail_fast(tmp_path, capsys, monkeypatch):
    directory = _saved("qwen2", tmp_path / "qwen2", sliding_window=20)
    assert {r["fixture"] for r in _run(directory, layers=[1])["rows"]} == {
        "layer 1 (sliding_attention)"}
    assert {r["fixture"] for r in _run(directory, pattern="full")["rows"]} == {
        "layer 0 (full_attention)"}
    assert {r["fixture"] for r in _run(directory, span=slice(1, None))["rows"]} == {
        "layer 1 (sliding_attention)"}
    assert {(r["implementation"], r["dtype"]) for r in _run(directory, dtypes=["float32"],
                                                            layers=[0])["rows"]} == {
        ("torch", "float32"), ("hf", "float32")}
    assert main(["hf", str(directory), "--layer", "7", "--no-cache"]) == 2
    assert "no layer selected: --layer, --layers and -k match none of the 2 layers" in (
        capsys.readouterr().err)
    assert main(["hf", str(directory), "--framework", "hf", "--no-hf", "--no-cache"]) == 2
    assert "nothing to run: --framework selects no twin and the hf row is off" in (
        capsys.readouterr().err)
    with pytest.raises(SystemExit) as stop:
        main(["hf", str(directory), "--max-length", "3"])
    assert stop.value.code == 2 and "--max-length: should be an int >= 9" in (
        capsys.readouterr().err)
    _planted(monkeypatch, "qwen2", lambda ours: {**ours, "scale": 0.5})
    report = _run(directory, fail_fast=True)
    assert {r["fixture"] for r in report["rows"]} == {"layer 0 (full_attention)"}
    assert report["checkpoint"]["stopped"] == "stopped after layer 0 (full_attention) " \
        "(--fail-fast)"


def test_warnings_about_the_checkpoint_are_kept_and_the_tools_own_silenced(tmp_path):
    # In a fresh process (transformers says some things once per process): the checkpoint's
    # config (a yarn factor that disagrees with its context lengths, an eos_token_id outside the
    # vocabulary) is warned about once, prefixed; nothing of transformers' own reaches stderr
    # (the one-layer models the command builds have their own vocabulary and token ids).
    directory = _saved("qwen2", tmp_path / "qwen2", eos_token_id=32000)
    done = subprocess.run([sys.executable, "-m", "golden.cli", "hf", str(directory),
                           "--framework", "hf", "--no-cache"], capture_output=True, text=True,
                          env={**os.environ, "TQDM_DISABLE": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stdout.splitlines() if line.startswith("warning: ")]
    assert any("eos_token_id" in w for w in warned) and any("YaRN" in w for w in warned)
    assert all(w.startswith("warning: config.json (transformers says): ") for w in warned)
    assert "[transformers]" not in done.stderr and "Traceback" not in done.stderr


def test_hfs_float32_row_past_the_table_is_held_to_twice_its_peers_error():
    # The rule for HF's float32 RoPE angles: a row that failed the table passes within twice
    # the peer's error (plus the table's atol), and fails beyond it.
    e = np.linspace(-1.0, 1.0, 50).reshape(5, 10)
    fixture = SimpleNamespace(expected={"output": e})
    peer = e + 1e-5  # the peer's error: 1e-5 everywhere
    for error, verdict in ((1.9e-5, "pass"), (2.2e-5, "fail")):
        row = {"status": "fail", "dtype": "float32", "reason": "output", "arrays": []}
        hf_check._judge_by_peer(row, e + error, fixture, peer)
        assert row["status"] == verdict
        assert row["arrays"][0]["rule"] == "profile"
        assert row["arrays"][0]["bound_abs"] == pytest.approx(2e-5 + 1e-6)
