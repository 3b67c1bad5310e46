"""``attn-parity hf`` on damaged checkpoints: each is refused with exit status 2 and a message
naming the problem (file, key, expected and actual), without a traceback, and the ones whose
headers already show the damage are refused without reading any tensor's data. Every
safetensors dtype is either read exactly (float64/32/16, bfloat16, FP8 with its scales) or
refused by name.

Each case starts from one tiny Qwen2 checkpoint written by transformers' ``save_pretrained``
(two layers, a full and a sliding one; q_proj (24, 16), k_proj and v_proj (12, 16)) and
damages a copy; the safetensors files are rewritten by ``write`` below (the format: 8 bytes of
header length, a JSON header, the data).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from golden.verifier import checkpoint as ck
from golden.cli import main

transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

from tests.test_hf_command import _checkpoint  # noqa: E402

K1 = "model.layers.1.self_attn.k_proj.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"


def write(path, tensors, sparse=None):
    """A safetensors file of {key: (dtype, shape, raw bytes)} (or {key: float32 array});
    ``sparse`` {key: (dtype, shape)} placed last, their data zeros the file holds without the
    test writing them (a sparse file)."""
    header, blobs, offset = {}, [], 0
    for key, value in tensors.items():
        if isinstance(value, np.ndarray):
            value = ("F32", value.shape, value.astype("<f4").tobytes())
        dtype, shape, raw = value
        header[key] = {"dtype": dtype, "shape": list(shape),
                       "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    tail = 0
    for key, (dtype, shape) in (sparse or {}).items():
        n = math.prod(shape) * ck.FLOATS[dtype][0] // 8
        header[key] = {"dtype": dtype, "shape": list(shape),
                       "data_offsets": [offset + tail, offset + tail + n]}
        tail += n
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + b"".join(blobs))
        f.truncate(f.tell() + tail)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    return _checkpoint("qwen2", tmp_path_factory.mktemp("qwen2") / "qwen2")


@pytest.fixture
def copy(original, tmp_path):
    """A copy of the checkpoint and its tensors ({key: float32 array}) to damage."""
    target = tmp_path / "ckpt"
    shutil.copytree(original, target)
    return target, safetensors_numpy.load_file(target / "model.safetensors")


def run_hf(directory, capsys, *more, reads=True, monkeypatch=None):
    """(exit status, stderr) of ``attn-parity hf``, the twins left out (the refusals come
    before them); with ``reads=False`` any read of tensor data fails the test."""
    if not reads:
        monkeypatch.setattr(ck.Checkpoint, "read", lambda *a: pytest.fail("data was read"))
    status = main(["hf", str(directory), "--framework", "torch", "--no-cache", *more])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return status, err


def _config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


# ---- refused from the headers alone ------------------------------------------------------------

def test_an_empty_directory(tmp_path, capsys):
    status, err = run_hf(tmp_path, capsys)
    assert status == 2 and "config.json: cannot be read" in err


def test_a_pickle_only_checkpoint(copy, capsys):
    directory, _ = copy
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04")
    status, err = run_hf(directory, capsys)
    assert status == 2 and "no *.safetensors file (pickled checkpoints are not read)" in err


def test_a_config_that_is_not_json(copy, capsys):
    directory, _ = copy
    (directory / "config.json").write_text("{model_type: qwen2")
    status, err = run_hf(directory, capsys)
    assert status == 2 and "config.json: not JSON" in err


def test_a_truncated_file(copy, capsys, monkeypatch):
    directory, _ = copy
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    status, err = run_hf(directory, capsys, reads=False, monkeypatch=monkeypatch)
    assert status == 2 and "model.safetensors: not a readable safetensors file" in err
    assert "go past the file's" in err and "(the file is truncated)" in err


def test_a_header_that_is_not_json(copy, capsys):
    directory, _ = copy
    (directory / "model.safetensors").write_bytes((20).to_bytes(8, "little") + b"not json" * 3)
    status, err = run_hf(directory, capsys)
    assert status == 2 and "its header is not JSON" in err


def test_an_absurd_header_length(copy, capsys):
    directory, _ = copy
    (directory / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
    status, err = run_hf(directory, capsys)
    assert status == 2 and "header length of at most 2 bytes, got 1099511627776" in err


def test_a_missing_layer(copy, capsys, monkeypatch):
    # config.json says 3 layers, the weights hold 2: refused, naming the count and the layer.
    directory, _ = copy
    _config(directory, num_hidden_layers=3, layer_types=["full_attention",
                                                         "sliding_attention", "full_attention"])
    status, err = run_hf(directory, capsys, reads=False, monkeypatch=monkeypatch)
    assert status == 2
    assert ("num_hidden_layers = 3 implies layers 0 to 2, the checkpoint has no "
            "'...layers.N.self_attn.*' for layer(s) 2") in err


def test_a_missing_key(copy, capsys, monkeypatch):
    directory, tensors = copy
    del tensors[K1]
    write(directory / "model.safetensors", tensors)
    status, err = run_hf(directory, capsys, reads=False, monkeypatch=monkeypatch)
    assert status == 2
    assert f"layer 1 (sliding_attention): the checkpoint has no {K1} (expected shape (12, 16))" \
        in err


def test_a_wrong_shape(copy, capsys, monkeypatch):
    directory, tensors = copy
    tensors[K1] = np.zeros((13, 16), np.float32)
    write(directory / "model.safetensors", tensors)
    status, err = run_hf(directory, capsys, reads=False, monkeypatch=monkeypatch)
    assert status == 2
    assert f"model.safetensors: {K1} has shape (13, 16), the config implies (12, 16)" in err


def test_a_huge_consistent_header_is_refused_unread(copy, capsys, monkeypatch):
    # A header claiming a 36000 x 36000 float32 q_proj, its 5.2 GB of data present (a sparse
    # file, so the test writes none of it): refused from its header, nothing read.
    directory, tensors = copy
    del tensors[Q0]
    write(directory / "model.safetensors", tensors, sparse={Q0: ("F32", (36000, 36000))})
    assert (directory / "model.safetensors").stat().st_size > 36000 * 36000 * 4
    status, err = run_hf(directory, capsys, reads=False, monkeypatch=monkeypatch)
    assert status == 2
    assert f"{Q0} has shape (36000, 36000), the config implies (24, 16)" in err


def test_a_missing_shard_is_named_from_the_index(copy, capsys, tmp_path, monkeypatch):
    directory, _ = copy
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="4KB")
    index = json.loads((sharded / ck.INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    assert main(["hf", str(sharded), "--framework", "torch", "--no-cache"]) == 0  # intact
    assert f"{len(files)} file(s) and its index" in capsys.readouterr().out
    (sharded / files[1]).unlink()
    status, err = run_hf(sharded, capsys, reads=False, monkeypatch=monkeypatch)
    assert status == 2
    assert f"{ck.INDEX} lists 1 file(s) that are not in {sharded}: {files[1]}" in err


def test_an_index_that_disagrees_with_the_files(copy, capsys, tmp_path):
    directory, _ = copy
    index = {"metadata": {}, "weight_map": {K1: "model.safetensors",
                                            "model.elsewhere.weight": "model.safetensors"}}
    (directory / ck.INDEX).write_text(json.dumps(index))
    status, err = run_hf(directory, capsys)
    assert status == 2
    assert (f"{ck.INDEX}: 1 key(s) are not where it says, e.g. model.elsewhere.weight should be "
            f"in model.safetensors, not in any file") in err


def test_a_key_in_two_files(copy, capsys):
    directory, tensors = copy
    write(directory / "extra.safetensors", {K1: tensors[K1]})
    status, err = run_hf(directory, capsys)
    assert status == 2 and f"{K1}: in two files, extra.safetensors and model.safetensors" in err


def test_an_fp8_scale_of_the_wrong_shape(copy, capsys):
    directory, tensors = copy
    tensors[K1] = ("F8_E4M3", (12, 16), np.zeros((12, 16), ml_dtypes.float8_e4m3fn).tobytes())
    tensors[K1 + "_scale_inv"] = np.ones((5, 5), np.float32)
    write(directory / "model.safetensors", tensors)
    status, err = run_hf(directory, capsys)
    assert status == 2
    assert f"{K1}_scale_inv: shape (5, 5) is not a scale of a weight of shape (12, 16)" in err


def test_an_unsupported_model_type_and_setting(copy, capsys):
    directory, _ = copy
    _config(directory, model_type="mamba")
    status, err = run_hf(directory, capsys)
    assert status == 2 and "model_type 'mamba' is not supported" in err
    _config(directory, model_type="qwen2", rope_parameters={"rope_type": "mrope",
                                                            "rope_theta": 10.0})
    status, err = run_hf(directory, capsys)
    assert status == 2 and "rope_parameters['rope_type'] = 'mrope' is not supported" in err


# ---- refused once the arrays are read, before anything is computed -----------------------------

@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_weights_that_are_not_finite(copy, capsys, bad, monkeypatch):
    directory, tensors = copy
    tensors[K1][3, 4] = float(bad)
    tensors[K1][5, 6] = -float(bad)
    write(directory / "model.safetensors", tensors)
    computed = []
    monkeypatch.setattr("golden.verifier.check.layer_fixture", lambda *a: computed.append(a))
    status, err = run_hf(directory, capsys)
    assert status == 2 and not computed
    counts = "2 NaN and 0 infinite" if bad == "nan" else "0 NaN and 2 infinite"
    assert f"model.safetensors: {K1}: {counts} of 192 values" in err


# ---- every safetensors dtype: read exactly, or refused by name ---------------------------------

VALUES = np.array([[0.0, -0.5, 1.5, 3.0], [-2.0, 0.25, 448.0, -0.0625]])  # exact in each format


@pytest.mark.parametrize("dtype", sorted(ck.FLOATS))
def test_each_float_dtype_is_read_exactly(dtype, tmp_path):
    name = ck.FLOATS[dtype][1]
    stored = VALUES.astype(getattr(ml_dtypes, name, None) or np.dtype(name))
    write(tmp_path / "one.safetensors", {"w": (dtype, stored.shape, stored.tobytes())})
    read = ck.Checkpoint(tmp_path).read("w")
    assert read.dtype in (np.float16, np.float32, np.float64)
    np.testing.assert_array_equal(read, VALUES)


@pytest.mark.parametrize("dtype", sorted(ck.REFUSED))
def test_each_other_dtype_is_refused_by_name(dtype, copy, capsys, monkeypatch):
    directory, tensors = copy
    bits = ck.REFUSED[dtype][0]
    tensors[K1] = (dtype, (12, 16), bytes(math.ceil(12 * 16 * bits / 8)))
    write(directory / "model.safetensors", tensors)
    status, err = run_hf(directory, capsys, reads=False, monkeypatch=monkeypatch)
    assert status == 2
    assert f"model.safetensors: {K1} is {dtype}, {ck.REFUSED[dtype][1]}" in err


def test_an_unknown_dtype_is_refused_by_name(copy, capsys):
    directory, tensors = copy
    tensors[K1] = ("F7", (12, 16), bytes(192))
    write(directory / "model.safetensors", tensors)
    status, err = run_hf(directory, capsys)
    assert status == 2 and f"{K1}: dtype should be one of F64, F32" in err and "got 'F7'" in err


# ---- FP8 checkpoints are read and checked -------------------------------------------------------

def _fp8(w, block):
    """(e4m3 values, scale_inv per block) with w ≈ values · scale, as fine-grained FP8."""
    rows, cols = (math.ceil(s / b) for s, b in zip(w.shape, block))
    scale = np.empty((rows, cols), np.float32)
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            s = np.float32(np.abs(part).max() / 448.0 or 1.0)
            scale[i, j] = s
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = part / s
    return q, scale


def test_an_fp8_checkpoint_with_block_scales_is_read_exactly_and_passes(copy, capsys):
    # Every attention projection stored as F8_E4M3 with a weight_scale_inv per 8 x 8 block
    # (transformers' fine-grained FP8 layout, quantization_config giving the block): read as
    # values x scale in float64 (exact), and every row passes.
    directory, tensors = copy
    block = (8, 8)
    expected = {}
    for key in [k for k in tensors if "_proj.weight" in k and "self_attn" in k]:
        q, scale = _fp8(tensors[key], block)
        tensors[key] = ("F8_E4M3", q.shape, q.tobytes())
        tensors[key.replace(".weight", ".weight_scale_inv")] = scale
        full = np.repeat(np.repeat(scale.astype(np.float64), 8, 0), 8, 1)[:q.shape[0], :q.shape[1]]
        expected[key] = q.astype(np.float64) * full
    write(directory / "model.safetensors", tensors)
    _config(directory, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                            "weight_block_size": list(block),
                                            "activation_scheme": "dynamic"})
    read = ck.Checkpoint(directory)
    for key, value in expected.items():
        np.testing.assert_array_equal(read.read_weight(key, block), value)
    status = main(["hf", str(directory), "--framework", "torch", "--framework", "hf",
                   "--no-cache"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "F8_E4M3 8 (as float32, exactly, times its scale in float64)" in out


def test_a_layer_beyond_the_count_is_named_and_not_checked(copy, capsys):
    # As DeepSeek-V3's checkpoints hold a multi-token-prediction layer past num_hidden_layers,
    # which transformers does not load: said in the header, not computed.
    directory, _ = copy
    _config(directory, num_hidden_layers=1, layer_types=["full_attention"])
    status = main(["hf", str(directory), "--framework", "torch", "--no-cache"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert ("note: layer(s) 1: beyond num_hidden_layers = 1 (transformers does not load them); "
            "not checked") in out
    assert "layer 1" not in out.split("note:")[-1].split("\n", 1)[1]
    assert "summary: 1 of 1 layers checked" in out


def test_a_damaged_checkpoint_is_refused_before_any_framework_loads(copy):
    # docs/hf.md: refused before torch, JAX or transformers are imported (a fresh process).
    directory, _ = copy
    _config(directory, num_hidden_layers=3, layer_types=["full_attention"] * 3)
    code = ("import sys; from golden.cli import main; status = main(['hf', sys.argv[1], "
            "'--no-cache']); print(status, sorted(m for m in ('torch', 'jax', 'transformers') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.split("\n")[-2] == "2 []", done.stdout + done.stderr
    assert "num_hidden_layers = 3 implies layers 0 to 2" in done.stderr


def test_a_missing_key_is_named_as_the_file_names_it(tmp_path, capsys):
    # ViT's file names its arrays "attention.query", its module "q_proj": the message names
    # the key as the file would hold it.
    from tests.test_hf_command import _encoder_checkpoint

    directory = _encoder_checkpoint("vit", tmp_path / "vit")
    tensors = safetensors_numpy.load_file(directory / "model.safetensors")
    key = next(k for k in tensors if k.endswith("layer.1.attention.attention.key.weight"))
    del tensors[key]
    write(directory / "model.safetensors", tensors)
    status, err = run_hf(directory, capsys)
    assert status == 2
    assert f"layer 1 (attention): the checkpoint has no {key} (expected shape" in err
