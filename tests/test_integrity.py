"""Fixture integrity: the manifest, the loader's limits under fuzzing, regeneration under SIGKILL.

Every malformed file is a ``golden.FixtureError`` naming the file, never another exception; a
shipped fixture that differs by one bit from what ``MANIFEST.json`` records never loads; a
regeneration killed at any moment leaves every file whole (old or new) and the next run mends
the manifest.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

import golden
from golden.specification import fixture as fx
from golden.specification.cases import CASES
from golden.harness.regenerate import build, regenerate
from tests.helpers import WHOLE

ROOT = Path(__file__).resolve().parents[1]
FUZZED = "multi_head_attention_causal"  # the file of the 300 bit flips
GROUPS = ("inputs", "params", "cotangents", "expected", "grads")


def _ignore(line):
    pass


def _bytes(name) -> bytes:
    return (fx.FIXTURE_DIR / f"{name}.npz").read_bytes()


def _arrays(f) -> dict:
    return {f"{g}/{k}": a for g in GROUPS for k, a in getattr(f, g).items()}


def _same(a, b) -> bool:
    x, y = _arrays(a), _arrays(b)
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
                                        and x[k].tobytes() == y[k].tobytes() for k in x)


def _members(name) -> list:
    """[(member name, bytes)] of a shipped fixture, in file order."""
    with zipfile.ZipFile(fx.FIXTURE_DIR / f"{name}.npz") as zf:
        return [(i.filename, zf.read(i)) for i in zf.infolist()]


def _zip(members, compression=zipfile.ZIP_STORED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = compression
            zf.writestr(info, data)
    return buf.getvalue()


def _npy(arr, allow_pickle=False) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, allow_pickle=allow_pickle)
    return buf.getvalue()


def _lying_npy(arr, shape) -> bytes:
    """A .npy whose header claims ``shape`` but which holds ``arr``'s data."""
    header = {**np.lib.format.header_data_from_array_1_0(arr), "shape": shape}
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + arr.tobytes()


_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")  # zipfile.structCentralDir, 46 bytes
_CENTRAL_FIELDS = {"compress_type": 7, "crc": 10, "compress_size": 11, "file_size": 12,
                   "header_offset": 19}


def _patch_central(data: bytes, member: str, **fields) -> bytes:
    """``data`` with the central directory entry of ``member`` lying about ``fields``."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        pos = zf.start_dir
    out = bytearray(data)
    while out[pos:pos + 4] == b"PK\x01\x02":
        entry = list(_CENTRAL.unpack_from(out, pos))
        name_len, extra_len, comment_len = entry[12:15]
        name = bytes(out[pos + 46:pos + 46 + name_len]).decode()
        if name == member:
            for field, value in fields.items():
                entry[_CENTRAL_FIELDS[field] - 1] = value
            _CENTRAL.pack_into(out, pos, *entry)
            return bytes(out)
        pos += 46 + name_len + extra_len + comment_len
    raise AssertionError(f"no member {member}")


def _write(tmp_path, data, name="bad.npz") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


@pytest.fixture
def shipped_copy(tmp_path, monkeypatch):
    """A copy of the shipped fixture directory (with its manifest) that golden.load(name) reads."""
    directory = tmp_path / "fixtures"
    shutil.copytree(fx.FIXTURE_DIR, directory)
    monkeypatch.setattr(fx, "FIXTURE_DIR", directory)
    monkeypatch.setattr(golden, "FIXTURE_DIR", directory)
    return directory


# ---- the manifest ------------------------------------------------------------------------------

def test_manifest_records_every_shipped_fixture():
    doc = fx.read_manifest(fx.FIXTURE_DIR / fx.MANIFEST_NAME)
    assert doc["fixture_format_version"] == fx.FORMAT_VERSION
    assert doc["numpy"] == np.__version__, "NumPy is pinned in constraints.txt"
    assert sorted(doc["files"]) == [f"{n}.npz" for n in golden.names()]
    seeds = {c.name: c.seed for c in CASES}
    for file, entry in doc["files"].items():
        assert entry == fx.manifest_entry(_bytes(entry["case"]), entry["case"],
                                          seeds[entry["case"]]), file
        assert file == entry["case"] + ".npz"
    text = (fx.FIXTURE_DIR / fx.MANIFEST_NAME).read_bytes()
    assert text == fx.manifest_bytes(doc["files"]), "not the bytes regenerate writes"


def test_altered_shipped_fixture_is_refused_with_the_way_out(shipped_copy):
    path = shipped_copy / f"{FUZZED}.npz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside an array's data
    path.write_bytes(data)
    with pytest.raises(golden.FixtureError) as e:
        golden.load(FUZZED)
    message = str(e.value)
    assert message.startswith(f"{path}: sha256 ")
    assert "does not match" in message and str(shipped_copy / "MANIFEST.json") in message
    assert "run `attn-parity regenerate` to rebuild it, or restore it from git" in message
    golden.load("sdpa_plain")  # the others still load
    # By path, the same file inside the shipped directory is checked too ...
    with pytest.raises(golden.FixtureError, match="sha256"):
        golden.load(path)
    # ... a copy elsewhere only when a manifest is passed (this flip, CRC-32 catches anyway).
    copy = _write(shipped_copy.parent, bytes(data), f"{FUZZED}.npz")
    with pytest.raises(golden.FixtureError, match="'expected/output.npy' fails its CRC-32"):
        golden.load(copy)
    with pytest.raises(golden.FixtureError, match="does not match"):
        golden.load(copy, manifest=shipped_copy / "MANIFEST.json")


def test_arrays_swapped_between_fixtures_are_detected(shipped_copy):
    # sdpa_plain and sdpa_scale have the same shapes: a file holding one's expected output in
    # the other is a valid fixture, and only the manifest can tell.
    plain, scale = build(CASES[0]), next(build(c) for c in CASES if c.name == "sdpa_scale")
    plain.expected["output"] = scale.expected["output"]
    swapped = fx.to_bytes(plain)
    golden.load(_write(shipped_copy.parent, swapped, "sdpa_plain.npz"))  # by path: valid
    (shipped_copy / "sdpa_plain.npz").write_bytes(swapped)
    with pytest.raises(golden.FixtureError, match="sdpa_plain.npz: sha256 .* does not match"):
        golden.load("sdpa_plain")
    # Whole files swapped between names
    a, b = shipped_copy / "sdpa_scale.npz", shipped_copy / "sdpa_causal_rect.npz"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    for name in ("sdpa_scale", "sdpa_causal_rect"):
        with pytest.raises(golden.FixtureError, match=f"{name}.npz: sha256"):
            golden.load(name)


def test_unlisted_and_unverifiable_shipped_fixtures(shipped_copy):
    shutil.copy(shipped_copy / "sdpa_plain.npz", shipped_copy / "sdpa_extra.npz")
    with pytest.raises(golden.FixtureError,
                       match=r"sdpa_extra.npz: not listed in .*MANIFEST.json; .*regenerate"):
        golden.load("sdpa_extra")
    manifest = shipped_copy / "MANIFEST.json"
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**doc, "fixture_format_version": 1}))
    with pytest.raises(golden.FixtureError, match="written for fixture format 1, this loader"):
        golden.load("sdpa_plain")
    manifest.write_text("{broken")
    with pytest.raises(golden.FixtureError, match=r"sdpa_plain.npz: cannot be verified: .*"
                                                  r"MANIFEST.json: not a readable manifest"):
        golden.load("sdpa_plain")
    manifest.write_text(json.dumps({**doc, "files": {"sdpa_plain.npz": {"sha256": "x"}}}))
    with pytest.raises(golden.FixtureError, match=r"files\['sdpa_plain.npz'\] should hold"):
        golden.load("sdpa_plain")
    manifest.unlink()
    with pytest.raises(golden.FixtureError, match="cannot be verified.*FileNotFoundError.*"
                                                  "run `attn-parity regenerate`"):
        golden.load("sdpa_plain")


def test_manifest_passed_explicitly(tmp_path, cached_builds):
    regenerate(directory=tmp_path, log=_ignore)
    manifest = tmp_path / "MANIFEST.json"
    assert golden.load(tmp_path / "sdpa_plain.npz", manifest=manifest).name == "sdpa_plain"
    other = _write(tmp_path, _bytes("sdpa_plain"), "mine.npz")
    with pytest.raises(golden.FixtureError, match=r"mine.npz: not listed in \S*MANIFEST.json$"):
        golden.load(other, manifest=manifest)
    # The manifest names the case and seed: a file that matches its entry but holds another
    # case (a hand-made manifest) is refused.
    doc = json.loads(manifest.read_text())
    doc["files"]["sdpa_plain.npz"]["case"] = "sdpa_scale"
    manifest.write_text(json.dumps(doc))
    with pytest.raises(golden.FixtureError, match="holds case 'sdpa_plain' seed 101, the "
                                                  "manifest says case 'sdpa_scale'"):
        golden.load(tmp_path / "sdpa_plain.npz", manifest=manifest)


def test_regenerate_check_compares_the_manifest(tmp_path, cached_builds):
    regenerate(directory=tmp_path, log=_ignore)
    manifest = tmp_path / "MANIFEST.json"
    good = manifest.read_bytes()
    for change, reason in [
        (lambda d: d["files"]["sdpa_plain.npz"].update(seed=7), "entries differ: sdpa_plain.npz"),
        (lambda d: d.update(numpy="1.0.0"), f"written by NumPy 1.0.0, this is {np.__version__}"),
    ]:
        doc = json.loads(good)
        change(doc)
        manifest.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        lines = []
        assert regenerate(check=True, directory=tmp_path, log=lines.append) == 1
        assert f"differs: MANIFEST.json ({reason})" in lines
        assert regenerate(directory=tmp_path, log=lines.append) == 1
        assert manifest.read_bytes() == good
    manifest.unlink()
    lines = []
    assert regenerate(check=True, directory=tmp_path, log=lines.append) == 1
    assert lines[0] == "differs: MANIFEST.json (missing)"


def test_check_command_names_the_altered_fixture(shipped_copy, capsys):
    from golden.cli import main

    path = shipped_copy / "sdpa_plain.npz"
    data = bytearray(path.read_bytes())
    data[3000] ^= 1
    path.write_bytes(data)
    assert main(["check", "sdpa_plain", "--framework", "reference"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: sha256" in err and "attn-parity regenerate" in err


def test_regenerate_removes_leftover_temporary_files(tmp_path, cached_builds):
    regenerate(directory=tmp_path, log=_ignore)
    leftovers = [".sdpa_plain.npz.k2j_4x.tmp", ".MANIFEST.json.ab12cd.tmp"]
    for name in leftovers:
        (tmp_path / name).write_bytes(b"half a fil")
    (tmp_path / "notes.tmp").write_bytes(b"not ours")
    assert all(fx.is_temporary(n) for n in leftovers) and not fx.is_temporary("notes.tmp")
    lines = []
    assert regenerate(check=True, directory=tmp_path, log=lines.append) == 0  # only noted
    assert sum("left from an interrupted run" in line for line in lines) == 2
    assert regenerate(directory=tmp_path, log=lines.append) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".npz") == [
        "MANIFEST.json", "notes.tmp"]


# ---- fuzzing the loader ------------------------------------------------------------------------

def _flip(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def test_bit_flips_of_a_shipped_fixture_never_load(shipped_copy):
    """The issue's experiment: 300 random single-bit flips, loaded by the shipped name."""
    data, path = _bytes(FUZZED), shipped_copy / f"{FUZZED}.npz"
    rng = random.Random(300)
    rejected = 0
    for bit in rng.sample(range(len(data) * 8), 300):
        path.write_bytes(_flip(data, bit))
        try:
            golden.load(FUZZED)
        except golden.FixtureError as e:
            assert str(e).startswith(f"{path}: ")
            rejected += 1
    print(f"\nbit flips, shipped with MANIFEST.json: tried 300, rejected {rejected}, "
          f"loaded {300 - rejected}")
    assert rejected == 300


def test_bit_flips_without_a_manifest_change_no_number(tmp_path):
    """By path, without a manifest: a flip is rejected, or it hit zip metadata nothing reads
    (the central directory's attributes, the end record's disk number): the numbers are the
    original's, bit for bit; CRC-32 guards every member's bytes."""
    report = {}
    for name, seed in ((FUZZED, 300), ("sdpa_mqa_decode_ragged", 301),
                       ("sdpa_low_precision", 302)):
        data, reference = _bytes(name), golden.load(name)
        path = tmp_path / f"{name}.npz"
        counts = report[name] = {"tried": 0, "rejected": 0, "loaded": 0}
        for bit in random.Random(seed).sample(range(len(data) * 8), 300):
            path.write_bytes(_flip(data, bit))
            counts["tried"] += 1
            try:
                f = golden.load(path)
            except golden.FixtureError as e:
                assert str(e).startswith(f"{path}: ")
                counts["rejected"] += 1
                continue
            counts["loaded"] += 1
            assert _same(f, reference), f"bit {bit} of {name} changed numbers and loaded"
            assert f.meta() == reference.meta()
        assert counts["rejected"] + counts["loaded"] == counts["tried"]
        assert counts["loaded"] <= 0.05 * counts["tried"]
    print(f"\nbit flips by path, no manifest (every load has the original's numbers): {report}")


def test_truncations_are_rejected(tmp_path):
    data = _bytes(FUZZED)
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        edges = {i.header_offset + d for i in zf.infolist() for d in (0, 1, 30, 31)}
    cuts = sorted({*range(0, len(data), 17), *range(len(data) - 64, len(data)), *edges})
    path = tmp_path / "cut.npz"
    for cut in cuts:
        path.write_bytes(data[:cut])
        with pytest.raises(golden.FixtureError, match=f"^{path}: "):
            golden.load(path)
    print(f"\ntruncations: tried {len(cuts)}, rejected {len(cuts)}")


def _mutate(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    kind = rng.randrange(6)
    at = rng.randrange(len(out))
    if kind == 0:  # a run of random bytes
        n = rng.randint(1, 16)
        out[at:at + n] = bytes(rng.randrange(256) for _ in range(n))[:len(out) - at]
    elif kind == 1:  # a 16- or 32-bit field set to an extreme
        width = rng.choice((2, 4))
        value = rng.choice((0, 1, 2**(8 * width) - 1, 2**(8 * width - 1), len(data)))
        out[at:at + width] = value.to_bytes(width, "little")[:len(out) - at]
    elif kind == 2:  # a chunk deleted
        del out[at:at + rng.randint(1, 64)]
    elif kind == 3:  # a chunk duplicated
        out[at:at] = out[at:at + rng.randint(1, 64)]
    elif kind == 4:  # a digit in a .npy header (shapes and dtypes live there)
        spots = [i for i in range(len(out) - 1) if out[i:i + 1].isdigit()]
        i = rng.choice(spots)
        out[i] = ord(rng.choice("0123456789"))
    else:  # several bit flips
        for _ in range(rng.randint(2, 8)):
            bit = rng.randrange(len(out) * 8)
            out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def test_random_corruption_is_only_ever_a_fixture_error(tmp_path):
    names = ("multi_head_attention_causal", "sdpa_mqa_decode_ragged", "sdpa_low_precision",
             "gqa_window_softcap_lengths_mask", "sdpa_unbatched_2d")
    manifest = fx.FIXTURE_DIR / fx.MANIFEST_NAME
    rng = random.Random(2024)
    counts = {"tried": 0, "rejected": 0, "loaded": 0, "bytes unchanged": 0}
    for i in range(1000):
        name = names[i % len(names)]
        data = _bytes(name)
        path = _write(tmp_path, _mutate(data, rng), f"{name}.npz")
        counts["tried"] += 1
        try:
            golden.load(path)
            counts["loaded"] += 1
        except golden.FixtureError as e:
            assert str(e).startswith(f"{path}: ")
            counts["rejected"] += 1
        if path.read_bytes() != data:
            with pytest.raises(golden.FixtureError):
                golden.load(path, manifest=manifest)
        else:
            counts["bytes unchanged"] += 1
    print(f"\nrandom corruption (runs of bytes, extreme fields, deleted and duplicated chunks, "
          f"header digits, bit flips): {counts}")
    assert counts["rejected"] + counts["loaded"] == counts["tried"]


def _edit_members(name, edit) -> bytes:
    members = dict(_members(name))
    edit(members)
    return _zip(list(members.items()))


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("grads/x.npy"), r"members do not match meta: missing \['grads/x'\]"),
    (lambda m: m.__setitem__("inputs/extra.npy", _npy(np.zeros(3, np.float32))),
     r"unexpected \['inputs/extra'\]"),
    (lambda m: m.__setitem__("grads/y.npy", m.pop("grads/x.npy")),
     r"missing \['grads/x'\], unexpected \['grads/y'\]"),
    (lambda m: m.__setitem__("grads/x", m.pop("grads/x.npy")),
     r"not a readable fixture \(member 'grads/x' is not a .npy array\)"),
    (lambda m: m.__setitem__("inputs/x.npy", _npy(np.zeros((2, 7, 5), object), True)),
     r"not a readable fixture \(member 'inputs/x.npy' holds Python objects .*pickle"),
    (lambda m: m.__setitem__("meta.npy", _npy(np.array([{"format": 1}], object), True)),
     "holds Python objects"),
    (lambda m: m.__setitem__("inputs/x.npy", _npy(np.zeros((2, 7, 5), np.int32))),
     "inputs/x should be float32 \\(a float input: it has a gradient\\), got int32"),
    (lambda m: m.__setitem__("params/W_query.npy", _npy(np.ones((5, 12), np.int64))),
     "params/W_query should be float32, got int64"),
    (lambda m: m.__setitem__("cotangents/output.npy", _npy(np.ones((2, 7, 12), np.int16))),
     "cotangents/output should be float32, got int16"),
    (lambda m: m.__setitem__("expected/output.npy", _npy(np.ones((2, 7, 12), np.int64))),
     "expected/output should be finite float64, got int64"),
    (lambda m: m.__setitem__("grads/x.npy", _npy(np.ones((2, 7, 5), np.float32))),
     "grads/x should be finite float64, got float32"),
    (lambda m: m.__setitem__("params/W_key.npy", _npy(np.full((5, 12), np.nan, np.float32))),
     "params/W_key holds non-finite values"),
    (lambda m: m.__setitem__("inputs/x.npy", _npy(np.array(["a"] * 70).reshape(2, 7, 5))),
     "inputs/x should be float32 .*got <U1"),
    (lambda m: m.__setitem__("inputs/x.npy", _npy(np.zeros(2, [("a", "<f4"), ("b", "<i4")]))),
     "dtype .* is not a plain number, bool or string"),
    (lambda m: m.__setitem__("meta.npy", _npy(np.array([1.0]))),
     "'meta' should be a 0-d unicode array holding JSON, got float64 of shape \\(1,\\)"),
    (lambda m: m.__setitem__("meta.npy", _npy(np.array('{"format": "attn-parity-fixture", '
                                                       f'"format_version": {fx.FORMAT_VERSION}, '
                                                       '"dtypes": ["float32"], "name": 5}'))),
     "meta.name should be a str, got 5"),
    (lambda m: m.__setitem__("meta.npy", _npy(np.array("[" * 100000))),
     "'meta' is not valid JSON"),
])
def test_malformed_members_rejected(tmp_path, edit, message):
    path = _write(tmp_path, _edit_members(FUZZED, edit))
    with pytest.raises(golden.FixtureError, match=f"^{path}: .*{message}"):
        golden.load(path)


def test_meta_fields_of_the_wrong_type_rejected(tmp_path):
    with np.load(fx.FIXTURE_DIR / f"{FUZZED}.npz") as z:
        meta = json.loads(str(z["meta"][()]))
    for key, value, message in [("inputs", "x", "meta.inputs should be a list of distinct names"),
                                ("grads", ["x", "x"], "meta.grads should be a list of distinct"),
                                ("seed", "251", "meta.seed should be an integer"),
                                ("config", [1], "meta.config should be a dict"),
                                ("zero", [3], "meta.zero should list gradients"),
                                ("dtypes", {"float32": 1}, "meta.dtypes should be a non-empty")]:
        data = _edit_members(FUZZED, lambda m: m.__setitem__(
            "meta.npy", _npy(np.array(json.dumps({**meta, key: value})))))
        path = _write(tmp_path, data)
        with pytest.raises(golden.FixtureError, match=f"^{path}: {message}"):
            golden.load(path)


def test_lying_npy_header_is_refused_before_allocating(tmp_path):
    # The file: a member whose header claims 1e11 elements (745 GiB of float64).
    x = golden.load(FUZZED).grads["x"]
    for shape, member in [((100000000000,), "grads/x.npy"), ((2**62, 2**62), "grads/x.npy"),
                          ((71,), "grads/x.npy"), ((-1,), "grads/x.npy"),
                          ((10**9,), "meta.npy")]:
        arr = x if member != "meta.npy" else np.array("{}")
        path = _write(tmp_path, _edit_members(
            FUZZED, lambda m, arr=arr, shape=shape, member=member: m.__setitem__(
                member, _lying_npy(arr, shape))))
        with pytest.raises(golden.FixtureError, match=f"^{path}: not a readable fixture "
                                                      f"\\(member '{member}'"):
            golden.load(path)
    with pytest.raises(golden.FixtureError, match=r"header claims shape \(100000000000,\) of "
                                                  r"float64 \(800000000000 bytes\) but it holds "
                                                  r"560 bytes"):
        golden.load(_write(tmp_path, _edit_members(FUZZED, lambda m: m.__setitem__(
            "grads/x.npy", _lying_npy(x, (100000000000,))))))


def test_zip_bomb_and_lying_zip_sizes_rejected(tmp_path):
    bomb = _bomb(tmp_path)  # refused before inflating anything
    assert bomb.stat().st_size < 2**20
    with pytest.raises(golden.FixtureError, match=r"bomb.npz: not a readable fixture \(member "
                                                  r"'inputs/x.npy' is compressed \(method 8: "
                                                  r"\d+ bytes claiming to expand to 104857728, "
                                                  r"\d+:1, a zip bomb\)"):
        golden.load(bomb)
    # Any compression: the format stores members uncompressed.
    data = _zip(_members(FUZZED), zipfile.ZIP_DEFLATED)
    with pytest.raises(golden.FixtureError, match="is compressed .*stored uncompressed"):
        golden.load(_write(tmp_path, data))
    with pytest.warns(UserWarning, match="Duplicate name"):
        twice = _zip(_members(FUZZED) + _members(FUZZED)[-1:])
    with pytest.raises(golden.FixtureError, match="member 'grads/x.npy' appears twice"):
        golden.load(_write(tmp_path, twice))
    stored = _zip(_members(FUZZED))
    for fields, message in [
        ({"file_size": 2**32 - 2}, "stored member 'grads/x.npy' claims 4294967294 bytes"),
        ({"file_size": 2**32 - 1, "compress_size": 2**32 - 1}, "disagrees"),
        ({"header_offset": 1}, "no local header at offset 1"),
        ({"header_offset": 10**9}, "local header at 1000000000 lies outside the file"),
        ({"compress_type": 8}, "is compressed"),
        ({"compress_type": 99}, "is compressed"),
        ({"crc": 12345}, "local header disagrees with the central directory"),
    ]:
        path = _write(tmp_path, _patch_central(stored, "grads/x.npy", **fields))
        with pytest.raises(golden.FixtureError, match=f"^{path}: not a readable fixture .*"
                                                      f"{message}"):
            golden.load(path)
    # Sizes that agree in both headers but run past the file's end
    with zipfile.ZipFile(io.BytesIO(stored)) as zf:
        at = zf.getinfo("grads/x.npy").header_offset
    data = bytearray(_patch_central(stored, "grads/x.npy", file_size=10**6, compress_size=10**6))
    struct.pack_into("<2L", data, at + 18, 10**6, 10**6)
    path = _write(tmp_path, bytes(data))
    with pytest.raises(golden.FixtureError, match=r"'grads/x.npy' runs past the end of the file "
                                                  r"\(1\d{6} > 1\d{4} bytes\): truncated\?"):
        golden.load(path)


def _bomb(tmp_path) -> Path:
    """A fixture whose inputs/x is 100 MB of zeros deflated to about 100 KB."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in _members(FUZZED):
            if name != "inputs/x.npy":
                zf.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
        info = zipfile.ZipInfo("inputs/x.npy", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_DEFLATED
        zeros = np.zeros(100 * 2**20 // 4, np.float32)
        with zf.open(info, "w", force_zip64=True) as w:
            np.lib.format.write_array_header_1_0(
                w, np.lib.format.header_data_from_array_1_0(zeros))
            chunk = bytes(2**20)
            for _ in range(100):
                w.write(chunk)
    return _write(tmp_path, buf.getvalue(), "bomb.npz")


def test_limits_on_members_and_size(tmp_path, monkeypatch):
    many = _zip([(f"inputs/m{i}.npy", _npy(np.zeros(1, np.float32))) for i in range(300)])
    with pytest.raises(golden.FixtureError, match="300 members, more than the 256"):
        golden.load(_write(tmp_path, many))
    monkeypatch.setattr(fx, "MAX_FILE_BYTES", 1000)
    with pytest.raises(golden.FixtureError, match=r"^.*bad.npz: \d+ bytes, more than a fixture "
                                                  r"may have \(1000\)"):
        golden.load(_write(tmp_path, _bytes(FUZZED)))


def test_unreadable_paths_are_fixture_errors(tmp_path):
    with pytest.raises(golden.FixtureError, match=f"{tmp_path}: not a readable fixture "
                                                  f"\\(IsADirectoryError"):
        golden.load(tmp_path)
    with pytest.raises(golden.FixtureError, match="empty.npz: not a readable fixture"):
        golden.load(_write(tmp_path, b"", "empty.npz"))
    with pytest.raises(golden.FixtureError, match="no 'meta' member"):
        golden.load(_write(tmp_path, _zip([])))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is Linux's")
def test_hostile_files_under_a_memory_limit(tmp_path):
    """The issue's 745 GiB header and a 100 MB zip bomb, loaded by a process limited to 1 GiB
    of address space beyond what it has at start: each is a FixtureError, not a kill."""
    x = golden.load(FUZZED).grads["x"]
    lying = _write(tmp_path, _edit_members(FUZZED, lambda m: m.__setitem__(
        "grads/x.npy", _lying_npy(x, (100000000000,)))), "lying.npz")
    bomb = _bomb(tmp_path)
    code = textwrap.dedent("""
        import resource, sys
        import golden
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + 2**30, hard))
        for path in sys.argv[1:]:
            try:
                golden.load(path)
            except golden.FixtureError as e:
                print("FixtureError", e)
    """)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code, str(lying), str(bomb)], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("FixtureError") for line in lines), lines
    assert "header claims shape (100000000000,)" in lines[0] and "zip bomb" in lines[1]


# ---- regeneration killed with SIGKILL ----------------------------------------------------------

# The child's build returns the fixtures the parent built, read back from its directory (the
# test checks that an uninterrupted run writes exactly those bytes), so that the kills land in
# the writing, not in the exact arithmetic (about 1 s). It slows every fsync by 3 ms (a slow
# disk) so that they land inside the atomic writes as well as between them; the code path of
# the writing is regenerate's own.
CHILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    fsync = os.fsync
    def slow_fsync(fd):
        time.sleep(0.003)
        fsync(fd)
    os.fsync = slow_fsync
    import golden
    from golden.harness import regenerate as module
    from golden.specification.cases import CASES
    built = {case.name: golden.load(Path(sys.argv[2]) / f"{case.name}.npz") for case in CASES}
    module.build = lambda case: built[case.name]
    print("start", flush=True)
    module.regenerate(directory=Path(sys.argv[1]), log=lambda line: print(line, flush=True))
""")
KILLS = 8 if WHOLE else 3  # runs killed at random moments: the quick suite's few


def _run_child(directory, built, kill_after=None):
    """Run regenerate on ``directory`` in a subprocess, its fixtures those in ``built``; SIGKILL
    it ``kill_after`` seconds after it starts writing (None: let it finish). The seconds it
    ran."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(directory), str(built)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line == "start\n", line + proc.stderr.read()
        start = time.perf_counter()
        if kill_after is None:
            assert proc.wait(timeout=60) == 0, proc.stderr.read()
        else:
            time.sleep(kill_after)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        return time.perf_counter() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_regenerate_killed_at_random_moments_leaves_whole_files(tmp_path, cached_builds):
    fresh = tmp_path / "fresh"
    regenerate(directory=fresh, log=_ignore)
    new = {p.name: p.read_bytes() for p in fresh.iterdir()}
    cases = [n for n in new if n.endswith(".npz")]
    # The old versions: every fixture one byte off (so all are rewritten), a retired case the
    # run removes, and the manifest of those old files.
    old = {n: _flip(new[n], 8 * (len(new[n]) // 2) + i % 8) for i, n in enumerate(cases)}
    old["retired_case.npz"] = _bytes("sdpa_plain")
    seeds = {c.name + ".npz": c.seed for c in CASES}
    old["MANIFEST.json"] = fx.manifest_bytes({n: fx.manifest_entry(d, n[:-4], seeds.get(n, 0))
                                              for n, d in old.items() if n.endswith(".npz")})
    work = tmp_path / "work"

    def reset():
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        for n, d in old.items():
            (work / n).write_bytes(d)

    reset()
    window = _run_child(work, fresh)  # an uninterrupted run: how long the writing takes
    assert {p.name: p.read_bytes() for p in work.iterdir()} == new
    rng = random.Random(99)
    seen = []
    for _ in range(KILLS):
        reset()
        _run_child(work, fresh, kill_after=rng.uniform(0, window))
        names = {p.name for p in work.iterdir()}
        temporary = {n for n in names if fx.is_temporary(n)}
        assert len(temporary) <= 1, temporary  # one write in flight at a time
        assert names - temporary <= set(old) | set(new), names
        state = {n: (work / n).read_bytes() for n in names - temporary}
        for n in cases + ["MANIFEST.json"]:
            assert state[n] in (old[n], new[n]), f"{n} is neither its old nor its new version"
        assert state.get("retired_case.npz", old["retired_case.npz"]) == old["retired_case.npz"]
        rewritten = sum(state[n] == new[n] for n in cases)
        if state["MANIFEST.json"] == new["MANIFEST.json"]:  # written last
            assert rewritten == len(cases) and "retired_case.npz" not in state
        else:
            manifest = work / "MANIFEST.json"
            for n in cases[:3]:
                if state[n] == new[n]:  # newer than the manifest: refused, with the way out
                    with pytest.raises(golden.FixtureError, match="regeneration was "
                                                                  "interrupted"):
                        golden.load(work / n, manifest=manifest)
        seen.append((rewritten, len(temporary), state["MANIFEST.json"] == new["MANIFEST.json"]))
    # The next run mends whatever the last kill left.
    _run_child(work, fresh)
    assert {p.name: p.read_bytes() for p in work.iterdir()} == new
    assert regenerate(check=True, directory=work, log=_ignore) == 0
    for n in cases:
        golden.load(work / n, manifest=work / "MANIFEST.json")
    print(f"\nkills after up to {window:.2f} s of writing: (fixtures rewritten of {len(cases)}, "
          f"temporary files left, manifest new) = {seen}")
