"""A hybrid model's linear-attention layers in ``attn-parity hf``: Gated DeltaNet, Kimi Delta
Attention and lightning attention (golden.hf.LINEAR), beside its softmax attention layers.

Each layer is converted by ``golden.convert.from_hf`` (the module's own state dict) and run on
drawn inputs x (2, L, D) whose second row is left-padded (golden.verifier.exercise: HF's
``attention_mask``; L past a chunk of HF's chunked form) by
- the float64 reference (golden.reference.delta_rule.MIXERS), the expected output;
- each twin's module (``build(variant, config, params)``, ``module(x, mask,
  implementation=...)``) with each implementation of the recurrence ("recurrent", "chunked"),
  at float32 and float64, where the twin has the mixer's module (a row "not supported"
  naming the class where it has not);
- HF's own module in its one-layer model (golden.verifier.model), given x in place of its
  input and the mask as the model's attention_mask, at float32 (HF computes the recurrence
  in float32 even in a float64 model: its float64 row would be judged at float32 anyway).

The bound: the recurrence's, which grows with L (golden.specification.tolerances.
compare_recurrence, rule "recurrence") at float32, the table at float64. HF's float32 row that
misses it is judged as the verifier judges HF's RoPE rows (golden.verifier.check.hf_peer):
within twice the error of our float32 torch twin ("chunked", the form HF computes, run with
HF's float32 decay arithmetic: torch_attn.recurrent.hf_decay_arithmetic, where ours forms the
cumulative log-decays in float64) plus the table's float32 bound (compare_to_plain). The rows are those of golden.harness.check's
report, one per implementation, core (the recurrence's implementation) and dtype.

Shape legend: B batch rows (2), L tokens, D the model's width.
"""

from __future__ import annotations

import time

import numpy as np

from golden.harness import check
from golden.hf import from_hf
from golden.reference.delta_rule import MIXERS as REFERENCE
from golden.runners.adapt import NotSupported
from golden.runners.frameworks import ADAPTERS
from golden.specification import recurrent
from golden.specification.tolerances import compare_recurrence, compare_to_plain, profile
from golden.verifier.checkpoint import CheckpointError

IMPLEMENTATIONS = ("recurrent", "chunked")  # the twins' recurrence, each a row
HF_FLOAT32 = ("HF computes the recurrence in float32 even in a float64 model: compared at "
              "float32")
PEER = ("torch", "chunked")  # HF's float32 row's peer (the form HF computes)


def describe(layer) -> str:
    """A linear-attention layer in a line: "Gated DeltaNet, 2 key heads of 4, 4 value heads of
    6, convolution 3; β = 2σ (negative eigenvalues)"."""
    c = recurrent.get(layer.variant).config(dict(layer.settings))
    hk, hv, dk, dv = recurrent.sizes(c)
    name = {"gated_delta_net": "Gated DeltaNet", "kimi_delta_attention": "Kimi Delta Attention",
            "lightning_attention": "lightning attention"}.get(layer.variant, layer.variant)
    heads = (f"{hk} key heads of {dk}, {hv} value heads of {dv}" if (hk, dk) != (hv, dv)
             else f"{hv} heads of {dv}")
    parts = [f"{name}, {heads}"]
    if c.get("conv_kernel"):
        parts.append(f"convolution {c['conv_kernel']}")
    if c.get("allow_neg_eigval"):
        parts.append("β = 2σ (negative eigenvalues)")
    if c.get("forget_gate"):
        parts.append(f"forget gate {c['forget_gate']}" + (
            f" ≥ {c['decay_lower_bound']:g}" if c.get("decay_lower_bound") is not None else ""))
    if c.get("block_size"):
        parts.append(f"blocks of {c['block_size']}")
    return "; ".join(parts)


def check_layer(layer, plan, state_dict, twins, models, dtypes, rng, outputs=None) -> dict:
    """The report (golden.harness.check's) of one linear-attention layer: its rows for each
    exercise of ``plan`` (golden.verifier.exercise)."""
    report = None
    for exercise in plan:
        try:
            variant, ours, params = from_hf(exercise.config, state_dict, layer_idx=layer.index,
                                            kind=layer.stack.kind)
        except ValueError as e:
            raise CheckpointError(f"{layer.name}: {e}") from None
        ours = dict(ours)
        width = ours["d_in"]
        x = rng.standard_normal((exercise.rows, exercise.length, width))
        x = x.astype(np.float32).astype(np.float64)  # exact in float32
        mask = np.asarray(exercise.mask, bool)
        params = {n: np.asarray(a, np.float64) for n, a in params.items()}
        expected = REFERENCE[variant][0](dict(ours), {"x": x, "mask": mask}, params)[0]
        name = layer.name + exercise.suffix
        run = _Layer(name, variant, ours, params, x, mask, expected, exercise.length)
        rows = [run.twin(fw, impl, dtype) for fw in twins for impl in IMPLEMENTATIONS
                for dtype in ("float32", "float64") if not dtypes or dtype in dtypes]
        if models is not None:
            rows += [run.hf(models, layer, exercise, state_dict, dtype)
                     for dtype in ("float32", "float64") if not dtypes or dtype in dtypes]
        for row in rows:
            row["exercised"] = list(exercise.notes)
        if outputs is not None:
            kept = outputs.setdefault(name, {"reference": expected})
            kept.update(run.kept)
        labels = list(twins) + (["hf"] if models is not None else [])
        part = _report(rows, labels)
        if report is not None:
            part = merge(report, part)
        report = part
    return report


def merge(report, part) -> dict:
    """``report`` with ``part``'s rows and implementations added and its summary made again
    (golden.verifier.check merges its stacks' reports with it too)."""
    report["rows"] += part["rows"]
    report["implementations"] = list(dict.fromkeys(report["implementations"]
                                                   + part["implementations"]))
    report["summary"] = check._summary(report, 0.0)
    return report


def _report(rows, labels) -> dict:
    """check.run's report shape around ``rows``."""
    from golden.report import SCHEMA, SCHEMA_VERSION

    prof = profile("exact")
    report = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "created": check._now(),
              "command": "", "environment": check._environment(),
              "profile": {"name": prof.name, "k": prof.k, "description": prof.description},
              "implementations": labels, "rows": rows, "regeneration": None}
    report["summary"] = check._summary(report, 0.0)
    return report


class _Layer:
    """One exercise of a layer: its converted module's settings and parameters, the drawn
    x and mask, the reference's output; ``twin`` and ``hf`` make its rows."""

    def __init__(self, name, variant, ours, params, x, mask, expected, length):
        self.name, self.variant, self.ours, self.params = name, variant, ours, params
        self.x, self.mask, self.expected, self.length = x, mask, expected, length
        self.kept, self.peer = {}, None

    def _row(self, label, core, dtype):
        return {"fixture": self.name, "variant": self.variant, "implementation": label,
                "core": core, "dtype": dtype, "status": "pass", "reason": None,
                "seconds": 0.0, "max_abs": None, "max_rel": None, "arrays": []}

    def _judged(self, row, output, comparison, start):
        row["seconds"] = time.perf_counter() - start
        row["arrays"] = [check._array("output", comparison)]
        row["max_abs"], row["max_rel"] = comparison.max_abs, comparison.max_rel
        if not comparison.ok:
            row["status"], row["reason"] = "fail", "output"
        self.kept[f"{row['implementation']} {row['core']} {row['dtype']}"] = output
        return row

    def twin(self, framework, implementation, dtype):
        row, start = self._row(framework, implementation, dtype), time.perf_counter()
        try:
            output = self._twin_output(framework, implementation, dtype)
        except NotSupported as e:
            return {**row, "status": "not supported", "reason": str(e)}
        except Exception as e:  # the module under test raised: a failure, in its words
            return {**row, "status": "error", "reason": f"{type(e).__name__}: {e}",
                    "seconds": time.perf_counter() - start}
        if (framework, implementation, dtype) == (*PEER, "float32"):
            from torch_attn.recurrent import hf_decay_arithmetic
            with hf_decay_arithmetic():  # HF's float32 steps in the decays, for HF's peer
                self.peer = self._twin_output(framework, implementation, dtype)
        return self._judged(row, output, compare_recurrence(output, self.expected, dtype,
                                                            self.length), start)

    def _twin_output(self, framework, implementation, dtype):
        import importlib

        room = importlib.import_module(f"{framework}_attn.recurrent")
        class_name = recurrent.get(self.variant).class_name
        if not hasattr(room, class_name):
            raise NotSupported(f"{framework}_attn has no {class_name} module (the "
                               f"{self.variant} mixer) yet")
        twin = importlib.import_module(f"{framework}_attn")
        adapter = ADAPTERS[framework]
        with adapter.float64(dtype == "float64"):
            np_dtype = np.dtype(dtype)
            module = twin.build(self.variant, dict(self.ours),
                                {n: a.astype(np_dtype) for n, a in self.params.items()})
            x, mask = adapter.array(self.x, dtype), adapter.array(self.mask)
            if framework == "torch":
                import torch
                with torch.no_grad():
                    y = module(x, mask, implementation=implementation)
            else:
                y = module(x, mask, implementation=implementation)
            return adapter.numpy(y)

    def hf(self, models, layer, exercise, state_dict, dtype):
        from golden.verifier import model as hf_model

        row, start = self._row("hf", "", dtype), time.perf_counter()
        if dtype != "float32":
            return {**row, "status": "not supported", "reason": HF_FLOAT32}
        try:
            output = models.output(hf_model.layer_only(exercise.config, layer.index),
                                   layer.stack, state_dict,
                                   {"x": self.x, "attention_mask": self.mask}, dtype,
                                   layer.index)
        except Exception as e:  # HF's own module raised: the row says so
            return {**row, "status": "error", "reason": f"{type(e).__name__}: {e}",
                    "seconds": time.perf_counter() - start}
        c = compare_recurrence(output, self.expected, dtype, self.length)
        if not c.ok and self.peer is not None:  # the verifier's peer rule (see the docstring)
            c = compare_to_plain(output, self.expected, self.peer, dtype)
        return self._judged(row, output, c, start)
