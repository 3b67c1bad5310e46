"""``attn-parity hf DIR``: every attention layer of a local Hugging Face checkpoint, accounted
for, converted (golden.hf.from_hf) and checked.

1. ``DIR/config.json`` is read, and every ``*.safetensors`` file's header
(golden.verifier.checkpoint:
   no pickle, no torch, no tensor data), with ``model.safetensors.index.json`` checked against
   the files.
2. The whole checkpoint is accounted for from the headers alone (golden.verifier.preflight.account):
   every attention layer the config implies, in every stack (golden.verifier.layout), with every
   array its conversion needs, of the implied shape and a float dtype. Any problem ends the
   run here, with exit status 2 and a message naming file, key, expected and actual.
3. The selected layers' arrays are read once and refused if any value is NaN or infinite.
4. Each selected layer becomes an in-memory fixture on drawn inputs long enough to reach every
   setting that acts only past some length (golden.verifier.exercise: sliding windows, chunks, RoPE
   switches, Llama 4's temperature, T5's buckets; a scaled copy of the config where the real
   length is over ``--max-length``), with the float64 reference's output, weights and
   gradients. Each twin runs it at float32 and float64 against the tolerance table, as
   ``attn-parity check`` does; with transformers and torch installed the checkpoint's own HF
   attention module runs it too (golden.verifier.model): at float32, and at float64 too for the
   families with no float32 step in HF (``FLOAT64``).
5. A hybrid model's linear-attention layers (golden.hf.LINEAR) are checked likewise by
   golden.verifier.linear: the twins' modules with each implementation of the recurrence, the
   float64 reference and HF's own module, against the recurrence's bound: outputs, input
   gradients, and decoding through the caches (the twins' RecurrentCache, HF's own).

The text output: a header (what was read and how, what runs, the drawn inputs, which settings
were exercised and how), one row per layer, implementation and dtype with its bound, one line
per reason rows were not supported, and a summary (layers checked of those expected, rows,
time), printed also when a layer fails midway. A progress bar runs on stderr when it is a
terminal. Exit status: 0 when every row passed, 1 when any failed, 2 for a checkpoint that
cannot be read or does not hold what its config implies, or a selection that matches nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import replace

import numpy as np

from golden.harness import check

from golden import reference

from golden.specification import variants
from golden.specification.fixture import Fixture
from golden.specification.validate import rope_axis_count, rope_settings
from golden.hf import GQA, from_hf, kv_source
from golden.verifier import exercise as hf_exercise
from golden.verifier import linear as hf_linear
from golden.verifier.checkpoint import Checkpoint, CheckpointError
from golden.verifier.exercise import BASE_LENGTH, MAX_LENGTH
from golden.verifier.layout import LAYOUTS, read_config
from golden.verifier.preflight import account, check_values, layer_state
from golden.report import worst_bound
from golden.specification.tolerances import compare_to_plain

__all__ = ["CheckpointError", "LAYOUTS", "run", "main", "add_arguments"]

B, LC = 2, 5  # the drawn inputs' batch and (cross-attention) context length
LONG = 64  # inputs longer than this are drawn as a batch of one (the cost is the length's)


def batch(length) -> int:
    """The drawn batch: B rows, or one past ``LONG`` tokens (a window of 512 needs 515)."""
    return B if length <= LONG else 1
TWINS = ("torch", "jax")
FRAMEWORK_CHOICES = (*TWINS, "hf")


def _drawn(rng, shape):
    return rng.standard_normal(shape).astype(np.float32).astype(np.float64)


def layer_fixture(config, layer, exercise, state_dict, rng, index=None) -> Fixture:
    """The layer's converted weights on drawn inputs (x (B, L, D), a cross-attention's
    context (B, LC, D), the exercise's positions and mask), with the float64 reference's results;
    converted as layer ``index`` (default the layer's own: a layer that reuses another's keys
    and values is converted as that one, ``shared_source``)."""
    variant, ours, params = from_hf(config, state_dict,
                                    layer_idx=layer.index if index is None else index,
                                    kind=layer.stack.kind)
    spec = variants.VARIANTS[variant]
    full = spec.config(dict(ours))
    rows = exercise.rows or batch(exercise.length)
    inputs = {i.name: _drawn(rng, (rows, exercise.length if i.side == "query" else LC,
                                   full[i.width]))
              for i in spec.inputs if not i.optional}
    if exercise.positions is not None:  # (L,) -> (B, L); one row per axis (A, L) -> (A, B, L)
        p = np.asarray(exercise.positions)
        if p.ndim == 2 and rope_axis_count(rope_settings(
                full.get("rope_theta"), full.get("rope_parameters"),
                full.get("partial_rotary_factor", 1.0))) is None:
            p = p[0]  # a conversion without the axes: the temporal row, text's positions
        inputs["positions"] = (np.tile(p, (rows, 1)) if p.ndim == 1 else
                               np.repeat(p[:, None], rows, axis=1))
    if exercise.mask is not None:  # (L, L) -> (B, L, L)
        inputs["mask"] = np.repeat(exercise.mask[None], rows, axis=0)
    if full.get("index_select") == "given":  # a "shared" indexer layer: a drawn choice
        inputs["key_indices"] = _drawn_choice(rng, full, inputs)
    params = {n: np.asarray(a, np.float64) for n, a in params.items()}
    forward, backward = reference.VARIANTS[variant]
    with reference.blas_products():  # float64, its sums in BLAS's order (not stored)
        out, weights, saved = forward(dict(ours), inputs, params)
        cot = {"output": _drawn(rng, out.shape), "weights": _drawn(rng, weights.shape)}
        with reference.parameter_term_sizes() as sizes:  # random inputs: compare_terms
            grads = backward(saved, cot["output"], cot["weights"])
    grads = {n: np.ascontiguousarray(g) for n, g in grads.items()}  # BLAS may give F order
    return Fixture(name=layer.name + exercise.suffix, variant=variant, seed=0,
                   config=dict(ours), inputs=inputs, dtypes=["float32", "float64"],
                   params=params, cotangents=cot, expected={"output": out, "weights": weights},
                   grads=grads, zero=reference.zero_grads(dict(ours), grads),
                   term_sizes={n: m for n, m in sizes.items() if n in grads})


def _drawn_choice(rng, config, inputs) -> np.ndarray:
    """key_indices (B, L, k) int32 for a layer that takes the previous layer's choice
    (index_select "given"): each query's k = min(index_topk, L) best of drawn scores among the
    keys it may see (causal, the exercise's mask), as an indexer would choose, so that the
    layer's attention is checked on a choice of its own kind."""
    rows, length = np.shape(inputs["x"])[:2]
    allowed = np.ones((rows, length, length), bool)
    if config.get("causal", True):
        allowed &= np.tril(np.ones((length, length), bool))
    if "mask" in inputs:
        allowed &= np.asarray(inputs["mask"], bool)
    k = min(int(config["index_topk"]), length)
    return reference.select_keys(rng.standard_normal((rows, length, length)), allowed,
                                 k).astype(np.int32)


HF_ANGLES = ("a RoPE layer past the table: within 2x the error of our float32 torch twin using "
             "HF's float32 angles")


def hf_peer(fixture) -> np.ndarray | None:
    """HF's row's peer where the layer has RoPE: the float32 output of our torch twin computing
    its angles as HF does (rope_precision="hf": position x frequency in float32, whose error
    grows with the position: 3e-5 rad at position 500, beyond float32's table). HF's float32
    row passes the table, or stays within twice this peer's error (golden.specification.tolerances.
    compare_to_plain, the rule of FlashAttention's tests); None where the layer has no RoPE."""
    if not hf_peer_applies(fixture):
        return None
    from golden import runners

    peer = replace(fixture, config={**fixture.config, "rope_precision": "hf"})
    core = None if runners.refuses("torch", "fused", peer) else "fused"
    return runners.get("torch", core)(peer, "float32")["output"]


def rotates(variant, fields) -> bool:
    """Whether a layer of ``variant`` whose config or settings have ``fields`` applies RoPE
    (HF computes its angles in float32: judged by the peer rule, ``hf_peer``)."""
    return variant == GQA and bool({"rope_parameters", "rope_theta"} & set(fields))


def hf_peer_applies(fixture) -> bool:
    return rotates(fixture.variant, fixture.config)


def _judge_by_peer(row, output, fixture, peer):
    """Re-judge HF's float32 row that failed the table by the peer rule (``hf_peer``)."""
    if row["status"] != "fail" or row["dtype"] != "float32" or peer is None or output is None:
        return
    c = compare_to_plain(output, fixture.expected["output"], peer, "float32")
    row["arrays"] = [check._array("output", c)]
    row["status"], row["reason"] = ("pass", None) if c.ok else ("fail", "output")


def shared_source(layer, layers):
    """The layer whose keys and values ``layer`` attends with (Gemma 4's num_kv_shared_layers,
    golden.hf.kv_source), among ``layers`` (every one the checkpoint holds), or None. Such a
    layer is checked as the ordinary attention it equals (kv_shared: tests/test_kv_sharing.py):
    the source's key and value weights and its own query and output weights, by the reference
    and the twins; HF's one-layer model cannot run it alone (the report's notes say so)."""
    if not layer.config.get("num_kv_shared_layers") or "num_hidden_layers" not in layer.config:
        return None
    j = kv_source(layer.config, layer.index)
    if j is None:
        return None
    found = [s for s in layers if s.stack is layer.stack and s.index == j]
    if not found:
        raise CheckpointError(f"{layer.name} reuses the keys and values of layer {j}, which the "
                              f"checkpoint does not hold")
    return found[0]


def select(layers, indices=(), span=None, pattern=None) -> list:
    """The layers chosen by ``--layer`` (indices), ``--layers`` (a slice "A:B" of indices) and
    ``-k`` (a substring, or a glob with * ? [, of the layer's name)."""
    chosen = [la for la in layers if not indices or la.index in indices]
    if span is not None:
        chosen = [la for la in chosen if la.index in range(*span.indices(10**9))]
    return check.select(chosen, pattern) if pattern else chosen


def run(directory, *, frameworks=(), with_hf=True, log=print, progress=None, seed=0,
        weights=None, outputs=None, dtypes=(), layers=(), span=None, pattern=None,
        fail_fast=False, max_length=MAX_LENGTH, info=None) -> dict:
    """The report (golden.report's format, with a "checkpoint" entry) of the checkpoint's
    selected attention layers; ``log`` gets each row (a dict) and each header line (a str);
    ``weights`` and ``outputs``, dicts, receive what the HTML page shows."""
    start = time.perf_counter()
    config = read_config(directory)
    ckpt = Checkpoint(directory)
    found = account(config, ckpt)  # headers only: before torch, JAX or transformers load
    chosen = select(found.layers, layers, span, pattern)
    if not chosen:
        raise CheckpointError(f"no layer selected: --layer, --layers and -k match none of the "
                              f"{len(found.layers)} layers")
    values = check_values(ckpt, chosen, config)
    sources = {id(layer): shared_source(layer, found.layers) for layer in chosen}
    found.notes.extend(f"{layer.name} reuses {sources[id(layer)].name}'s keys and values: HF's "
                       f"row not run (checked as the attention with its key and value weights "
                       f"and the layer's own query and output weights)"
                       for layer in chosen if sources[id(layer)] is not None)
    from golden.verifier import model as hf_model

    with_hf = with_hf and hf_model.available()
    if with_hf:
        hf_model.check_config(config, log)
    plans = _plans(chosen, max_length)
    twins = [f for f in (frameworks or TWINS) if f in TWINS]
    if not twins and not with_hf:
        raise CheckpointError("nothing to run: --framework selects no twin and the hf row is "
                              "off (--no-hf, or torch and transformers not installed)")
    info = {} if info is None else info
    info.update(_header(config, ckpt, found, values, chosen, plans, twins, with_hf, dtypes))
    for line in info["lines"]:
        log(line)
    report, models, rng = None, hf_model.Models() if with_hf else None, np.random.default_rng(seed)
    try:
        for layer, plan in _bar(plans, progress):
            state_dict, source = layer_state(ckpt, layer, config), sources[id(layer)]
            if source is not None:  # the source's k and v entries, the layer's own q and o
                state_dict = {**layer_state(ckpt, source, config), **state_dict}
            if layer.stack.linear:  # a hybrid's linear-attention layer (golden.verifier.linear)
                part = hf_linear.check_layer(layer, plan, state_dict, twins, models, dtypes,
                                             rng, outputs)
            else:
                part = _check_layer(layer, plan, state_dict, twins,
                                    models if source is None else None, dtypes, rng, weights,
                                    outputs, index=None if source is None else source.index)
            for row in part["rows"]:
                row["model_type"] = layer.config["model_type"]
                log(row)
            report = part if report is None else hf_linear.merge(report, part)
            info["checked"] = info.get("checked", 0) + 1
            if fail_fast and not part["summary"]["ok"]:
                info["stopped"] = f"stopped after {layer.name} (--fail-fast)"
                break
    finally:
        info["seconds"] = time.perf_counter() - start
    report["command"] = f"attn-parity hf {directory}"
    report["summary"] = check._summary(report, info["seconds"])
    report["checkpoint"] = {k: v for k, v in info.items() if k != "lines"}
    return report


def _plans(chosen, max_length) -> list:
    """[(layer, its exercises)], every layer at the length the longest needs (layers of one
    configuration then share their compiled programs)."""
    from golden.verifier.speech import encoder
    plans = {id(layer): hf_exercise.plan(layer.config, max_length) for layer in chosen}
    length = max(p.length for p in plans.values())
    fixed = {id(layer) for layer in chosen  # an encoder that takes one length only (its own)
             if getattr(encoder(layer.config), "fixed_length", False)}
    return [(layer, hf_exercise.exercises(layer, plans[id(layer)], plans[id(layer)].length
                                          if id(layer) in fixed else length))
            for layer in chosen]


def _check_layer(layer, plan, state_dict, twins, models, dtypes, rng, weights, outputs,
                 index=None):
    """check.run's report of the layer's fixtures (one per exercise), converted as layer
    ``index`` (layer_fixture)."""
    from golden.verifier import model as hf_model

    report = None
    for exercise in plan:
        try:
            fixture = layer_fixture(exercise.config, layer, exercise, state_dict, rng, index)
        except ValueError as e:
            raise CheckpointError(f"{layer.name}: {e}") from None
        part = (check.run([fixture], frameworks=twins, dtypes=dtypes, regeneration=False,
                          weights=weights, outputs=outputs, progress=False) if twins else None)
        if models is not None:
            seen = {}
            runner = hf_model.runner(models, hf_model.layer_only(exercise.config, layer.index),
                                     layer.stack, layer.index, state_dict, seen,
                                     positions=exercise.positions)
            hf_part = check.run([fixture], impls=[runner], dtypes=dtypes, regeneration=False,
                                weights=weights, outputs=outputs, progress=False)
            peer = hf_peer(fixture) if any(r["status"] == "fail" for r in hf_part["rows"]) \
                else None
            for row in hf_part["rows"]:
                _judge_by_peer(row, seen.get(row["dtype"]), fixture, peer)
            hf_part["summary"] = check._summary(hf_part, 0.0)
            part = hf_part if part is None else hf_linear.merge(part, hf_part)
        for row in part["rows"]:
            row["exercised"] = list(exercise.notes)
        report = part if report is None else hf_linear.merge(report, part)
    return report


def _header(config, ckpt, found, values, chosen, plans, twins, with_hf, dtypes) -> dict:
    """What was read and how, what runs, the inputs and the settings exercised: the lines
    printed before the rows, and the same as data for the report."""
    from golden.verifier.checkpoint import FLOATS
    from golden.verifier.layout import FLOAT64
    from golden.verifier.model import FLOAT32_ONLY

    read_as = ", ".join(f"{d} {n}" + ("" if d in ("F32", "F64", "F16") else " (as float32, "
                                      "exactly" + (", times its scale in float64" if
                                                   d.startswith("F8") else "") + ")")
                        for d, n in sorted(found.dtypes.items()) if d in FLOATS)
    files = [p.name for p in ckpt.files]
    mt = config["model_type"]
    layers_line = (f"{len(found.layers)} attention layers of {found.expected} the config "
                   f"implies" + (f" ({len(chosen)} selected)" if len(chosen) < len(found.layers)
                                 else ""))
    run_dtypes = [d for d in ("float32", "float64") if not dtypes or d in dtypes]
    runs = [f"{', '.join(twins)} at {' and '.join(run_dtypes)}"] if twins else []
    softmax = [la for la in chosen if not la.stack.linear]
    if with_hf:
        hf_dtypes = (run_dtypes if all(la.config["model_type"] in FLOAT64 for la in chosen)
                     else [d for d in run_dtypes if d == "float32"])
        why = [FLOAT32_ONLY.split(':')[0]] if softmax else []
        why += [hf_linear.HF_FLOAT32.split(':')[0] + " (its linear-attention layers)"
                ] if len(softmax) < len(chosen) else []
        runs.append(f"hf (the checkpoint's own module) at "
                    f"{' and '.join(hf_dtypes) or 'no dtype selected'}"
                    + ("" if "float64" in hf_dtypes or "float64" not in run_dtypes
                       else f" ({'; '.join(why)})")
                    + (f"; {HF_ANGLES}" if any(rotates(la.variant, la.settings)
                                               for la in chosen) else ""))
    lengths = sorted({e.length for _, plan in plans for e in plan})
    exercised = Counter()
    where = {}
    for layer, plan in plans:
        for note in plan[0].notes:
            where.setdefault(note, []).append(layer.name)
            exercised[note] += 1
    lines = [f"checkpoint: model_type {mt}; {len(files)} file(s)"
             + (" and its index" if ckpt.index else "")
             + f"; {layers_line}",
             f"attention arrays: {read_as}; those of the layers selected read "
             f"({values['arrays']}, {values['bytes'] / 2**20:.1f} MiB): all finite",
             *(f"attention ({_count(n, 'layer')}): {text}" for text, n in
               Counter(describe(la) for la in chosen).items()),
             f"runs: {'; '.join(runs) or 'nothing (--framework)'}",
             f"inputs: drawn N(0, 1) rounded to float32, batch {batch(max(lengths))}"
             + (" (linear-attention layers: 2, the second left-padded)"
                if len(softmax) < len(chosen) else "")
             + f", {'/'.join(map(str, lengths))} tokens (the most a setting below needs, at "
             f"least {BASE_LENGTH})"]
    lines += [f"note: {n}" for n in found.notes]
    lines += [f"exercised: {note} ({_names(names)})" for note, names in where.items()]
    return {"model_type": mt, "files": files, "layers_expected": found.expected,
            "layers_found": len(found.layers), "layers_selected": len(chosen),
            "dtypes": dict(found.dtypes), "values": values, "lengths": lengths,
            "notes": list(found.notes), "exercised": {n: where[n] for n in where},
            "width": max(len(la.name) + len(e.suffix) for la, plan in plans for e in plan),
            "lines": lines}


def _cache(on):
    """JAX's persistent compilation cache (golden.runners.cache) turned on, or back off."""
    try:
        from golden.runners import cache
    except ImportError:
        return
    cache.enable() if on else cache.disable()


def describe(layer) -> str:
    """A layer's attention in a line: the variant, heads, positions and the options it has
    ("grouped-query, 32 heads (8 key-value) of 64; RoPE llama3 θ 500000 x32"); a
    linear-attention layer's as golden.verifier.linear says it."""
    if layer.stack.linear:
        return hf_linear.describe(layer)
    c = layer.settings
    kind = {GQA: "grouped-query", "multi_head_latent_attention": "latent (MLA)",
            "multi_head_cross_attention": "cross"}.get(layer.variant, layer.variant)
    heads = f"{c.get('num_heads')} heads"
    if c.get("num_kv_heads") not in (None, c.get("num_heads")):
        heads += f" ({c['num_kv_heads']} key-value)"
    if c.get("head_dim"):
        heads += f" of {c['head_dim']}"
    parts = [kind, heads, _positions(c)]
    parts += [f"{name} {c[name]}" for name in ("sliding_window", "attention_chunk_size",
                                                "softcap", "qk_norm", "clip_qkv")
              if c.get(name) is not None]
    parts += [name for name in ("sinks", "output_gate", "v_norm", "k_eq_v") if c.get(name)]
    if c.get("relative_positions"):
        parts.append(f"relative positions ({c['relative_positions']})")
    if c.get("query_temperature"):
        parts.append("query temperature")
    return "; ".join(p for p in parts if p)


def _positions(c) -> str:
    rope = c.get("rope_parameters") or {}
    if rope or c.get("rope_theta"):
        theta = rope.get("rope_theta", c.get("rope_theta"))
        text = f"RoPE {rope.get('rope_type', 'default')} θ {theta:g}"
        if rope.get("factor"):
            text += f" x{rope['factor']:g}"
        fraction = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        if fraction not in (None, 1.0):
            text += f" on {fraction:g} of each head"
        if rope.get("mrope_section"):
            text += (f", multimodal sections {list(rope['mrope_section'])}"
                     f"{' interleaved' if rope.get('mrope_interleaved') else ''}")
        return text + (" (interleaved)" if c.get("rope_interleaved") else "")
    if c.get("alibi"):
        return f"ALiBi ({c['alibi']})"
    if c.get("relative_attention_num_buckets"):
        return f"relative buckets ({c['relative_attention_num_buckets']})"
    return "no positions in attention"


def _count(n, what) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _names(names) -> str:
    return names[0] if len(names) == 1 else f"{len(names)} layers: {names[0]}, ..."


def _bar(plans, progress):
    """The layers' plans, with a progress bar on stderr when it is a terminal."""
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return plans
    try:
        from tqdm import tqdm
    except ImportError:
        return plans
    return tqdm(plans, desc="layers", unit="layer", file=sys.stderr, leave=False)


# ---- the text output ----------------------------------------------------------------------------

class _Printer:
    """Header lines as they come, then the rows as a table under labelled columns (rows that
    are not supported counted, not printed), written around a progress bar on stderr."""

    def __init__(self, info, out=print):
        self.info, self.out, self.started, self.unsupported = info, out, False, Counter()

    @property
    def width(self):
        return max(len("layer"), self.info.get("width", 28))

    def __call__(self, item):
        if isinstance(item, str):
            self._write(item)
            return
        if item["status"] == "not supported":
            self.unsupported[(item["implementation"], item["dtype"], item["reason"])] += 1
            return
        if not self.started:
            self.started = True
            self._write(self._header())
        self._write(self._row(item))

    def _header(self):
        return (f"{'layer':{self.width}} {'implementation':15} {'dtype':8} {'max rel err':>11} "
                f"{'worst err/bound':>17}  result")

    def _row(self, row):
        rel = "-" if row["max_rel"] is None else f"{row['max_rel']:.2e}"
        label = row["implementation"] + (f" {row['core']}" if row["core"] else "")
        verdict = {"pass": "pass", "fail": f"FAIL {row['reason']}",
                   "error": f"ERROR {row['reason']}"}[row["status"]]
        return (f"{row['fixture']:{self.width}} {label:15} {row['dtype']:8} {rel:>11} "
                f"{worst_bound(row['arrays']):>17}  {verdict}")

    def _write(self, line):
        try:
            from tqdm import tqdm
        except ImportError:
            self.out(line)
            return
        with tqdm.external_write_mode(file=sys.stderr):
            self.out(line)


def _summary_lines(report, info, printer) -> list[str]:
    s = report["summary"] if report else None
    lines = [f"not supported ({n} rows): {impl} {dtype}: {reason}"
             for (impl, dtype, reason), n in printer.unsupported.items()]
    checked, total = info.get("checked", 0), info.get("layers_expected", 0)
    text = f"{checked} of {total} layers checked"
    if s is not None:
        text += (f"; {s['passed']} passed, {s['failed'] + s['errors']} failed"
                 + (f" ({s['errors']} of them errors)" if s["errors"] else "")
                 + (f", {s['not_supported']} not supported" if s["not_supported"] else ""))
    if "stopped" in info:
        text += f"; {info['stopped']}"
    lines.append(f"summary: {text}; {info.get('seconds', 0):.1f} s")
    return lines


def main(args) -> int:
    if not args.no_cache:
        _cache(True)
    try:
        return _main(args)
    finally:
        if not args.no_cache:
            _cache(False)  # a caller in this process (a test) compiles as before


def _main(args) -> int:
    arrays = ({}, {}) if args.html else (None, None)
    info, report, status = {}, None, 2
    printer = _Printer(info)
    frameworks = args.framework or list(FRAMEWORK_CHOICES)
    try:
        report = run(args.directory, frameworks=frameworks,
                     with_hf="hf" in frameworks and not args.no_hf, log=printer,
                     weights=arrays[0], outputs=arrays[1], dtypes=args.dtype,
                     layers=args.layer, span=args.layers, pattern=args.pattern,
                     fail_fast=args.fail_fast, max_length=args.max_length, info=info)
        status = 0 if report["summary"]["ok"] else 1
    except CheckpointError as e:
        print(f"attn-parity hf: error: {e}", file=sys.stderr)
        if not info.get("checked"):
            return 2
    for line in _summary_lines(report, info, printer):
        print(line)
    if report is not None:
        check._write_reports(report, arrays, args.json, args.junit, args.html, None, print)
    return status


def _length(text) -> int:
    least = hf_exercise.SCALED + 3
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or n < least:
        raise argparse.ArgumentTypeError(f"should be an int >= {least} (a scaled copy's "
                                         f"window and 3 tokens past it), got {text!r}")
    return n


def _span(text) -> slice:
    try:
        a, b = text.split(":")
        return slice(int(a) if a else None, int(b) if b else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"should be A:B (layer indices, B excluded), got "
                                         f"{text!r}") from None


def add_arguments(parser) -> None:
    parser.add_argument("directory", help="a local checkpoint: config.json and *.safetensors")
    parser.add_argument("--framework", action="append", choices=FRAMEWORK_CHOICES, default=[],
                        help="only this implementation: a twin or hf, the checkpoint's own "
                             "transformers module (repeatable; default: all installed)")
    parser.add_argument("--no-hf", action="store_true",
                        help="do not run the checkpoint's own transformers modules")
    parser.add_argument("--dtype", action="append", choices=("float32", "float64"), default=[],
                        help="only this dtype (repeatable; default: both)")
    parser.add_argument("--layer", action="append", type=int, default=[], metavar="N",
                        help="only layer N of each stack (repeatable)")
    parser.add_argument("--layers", type=_span, metavar="A:B",
                        help="only layers A to B - 1 of each stack")
    parser.add_argument("-k", dest="pattern", metavar="PATTERN",
                        help="only layers whose name contains PATTERN (a glob if it has * ? [), "
                             "e.g. -k sliding, -k 'decoder layer 1 *'")
    parser.add_argument("--fail-fast", action="store_true",
                        help="stop after the first layer with a failing row")
    parser.add_argument("--max-length", type=_length, default=MAX_LENGTH, metavar="N",
                        help=f"the longest input drawn (default {MAX_LENGTH}); a window or chunk "
                             f"that needs more is exercised on a scaled copy of the config")
    parser.add_argument("--no-cache", action="store_true",
                        help="do not use JAX's persistent compilation cache")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
    parser.add_argument("--junit", metavar="FILE", help="write the report as JUnit XML")
    parser.add_argument("--html", metavar="DIR", help="write an HTML page")


def _cli(argv=None) -> int:  # python -m golden.verifier.check DIR
    parser = argparse.ArgumentParser(prog="attn-parity hf", description=__doc__)
    add_arguments(parser)
    return main(parser.parse_args(argv))
