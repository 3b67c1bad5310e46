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

Each row holds the output and, but for decoding, dL/dx of Σ y ⊙ dy (dy drawn), against the
reference's analytic backward: the twins' by torch's autograd or jax.vjp (RECURRENT_TOLERANCES'
gradient rows), HF's by torch's autograd through its one-layer model (HF's float32 floor,
golden.specification.tolerances.hf_recurrence_floor, times HF_GRADIENT_FACTOR). Decoding rows
(core "decode"): the first L − DECODED tokens in one call, then one token per call, joined and
held to the full forward's bound: the twins' module through its RecurrentCache, and HF's own
cached decoding (its model's cache, use_cache=True: golden.verifier.model.Models.decoded), whose
float32 row failing the recurrence's bound is held to HF's float32 floor.

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
from golden.specification.tolerances import (RECURRENT_TOLERANCES, compare, compare_recurrence,
                                             mixer_input_terms,
                                             compare_to_floor, compare_to_plain,
                                             hf_recurrence_floor, profile)
from golden.verifier.checkpoint import CheckpointError

IMPLEMENTATIONS = ("recurrent", "chunked")  # the twins' recurrence, each a row
HF_FLOAT32 = ("HF computes the recurrence in float32 even in a float64 model: compared at "
              "float32")
PEER = ("torch", "chunked")  # HF's float32 row's peer (the form HF computes)
DECODED = 5  # the tokens decoded one at a time after the prefill


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
        dy = rng.standard_normal(x.shape[:2] + (ours.get("d_out") or width,))
        dy = dy.astype(np.float32).astype(np.float64)  # the gradients' cotangent
        mask = np.asarray(exercise.mask, bool)
        params = {n: np.asarray(a, np.float64) for n, a in params.items()}
        forward, backward = REFERENCE[variant]
        expected, _, saved = forward(dict(ours), {"x": x, "mask": mask}, params)
        dx = backward(saved, dy)["x"]
        name = layer.name + exercise.suffix
        run = _Layer(name, variant, ours, params, x, mask, expected, exercise.length)
        run.dy, run.dx = dy, dx
        kept = [d for d in ("float32", "float64") if not dtypes or d in dtypes]
        rows = [run.twin(fw, impl, dtype) for fw in twins for impl in IMPLEMENTATIONS
                for dtype in kept]
        rows += [run.twin_decode(fw, dtype) for fw in twins for dtype in kept]
        if models is not None:
            rows += [run.hf(models, layer, exercise, state_dict, dtype) for dtype in kept]
            rows += [run.hf_decode(models, layer, exercise, state_dict, dtype)
                     for dtype in kept]
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
    x, mask and cotangent dy, the reference's output and dL/dx of Σ y ⊙ dy; ``twin``,
    ``twin_decode``, ``hf`` and ``hf_decode`` make its rows."""

    def __init__(self, name, variant, ours, params, x, mask, expected, length):
        self.name, self.variant, self.ours, self.params = name, variant, ours, params
        self.x, self.mask, self.expected, self.length = x, mask, expected, length
        self.kept, self.peer, self.dy, self.dx = {}, None, None, None

    @property
    def prefill(self) -> int:
        """Decoding's first call: every token but the last DECODED (the padding among them)."""
        return max(1, self.length - DECODED)

    def _row(self, label, core, dtype):
        return {"fixture": self.name, "variant": self.variant, "implementation": label,
                "core": core, "dtype": dtype, "status": "pass", "reason": None,
                "seconds": 0.0, "max_abs": None, "max_rel": None, "arrays": []}

    def _judged(self, row, output, comparisons, start):
        """``row`` with ``comparisons`` ({what: Comparison}) as its arrays, failing where one
        fails (its reason the failing arrays' names)."""
        row["seconds"] = time.perf_counter() - start
        row["arrays"] = [check._array(what, c) for what, c in comparisons.items()]
        row["max_abs"] = max(c.max_abs for c in comparisons.values())
        row["max_rel"] = max(c.max_rel for c in comparisons.values())
        bad = [what for what, c in comparisons.items() if not c.ok]
        if bad:
            row["status"], row["reason"] = "fail", ", ".join(bad)
        self.kept[" ".join(filter(None, (row["implementation"], row["core"], row["dtype"])))
                  ] = output
        return row

    def _grad_comparison(self, grad, dtype):
        """dL/dx against the reference's: RECURRENT_TOLERANCES' gradient row, each element a
        sum of mixer_input_terms summands."""
        terms = mixer_input_terms(self.params, self.dx.shape[-1], self.dx.shape[-2])
        return compare(grad, self.dx, dtype, "grad", terms=terms, table=RECURRENT_TOLERANCES)

    def twin(self, framework, implementation, dtype):
        row, start = self._row(framework, implementation, dtype), time.perf_counter()
        try:
            output, grad = self._twin_output(framework, implementation, dtype, self.dy)
        except NotSupported as e:
            return {**row, "status": "not supported", "reason": str(e)}
        except Exception as e:  # the module under test raised: a failure, in its words
            return {**row, "status": "error", "reason": f"{type(e).__name__}: {e}",
                    "seconds": time.perf_counter() - start}
        if (framework, implementation, dtype) == (*PEER, "float32"):
            from torch_attn.recurrent import hf_decay_arithmetic
            with hf_decay_arithmetic():  # HF's float32 steps in the decays, for HF's peer
                self.peer = self._twin_output(framework, implementation, dtype)[0]
        return self._judged(row, output, {
            "output": compare_recurrence(output, self.expected, dtype, self.length),
            "grad x": self._grad_comparison(grad, dtype)}, start)

    def twin_decode(self, framework, dtype):
        """The twin's module through its RecurrentCache (``init_cache``): the first
        ``prefill`` tokens in one call, then one token per call, each with the module's own
        choice of implementation, joined against the reference's full forward."""
        row, start = self._row(framework, "decode", dtype), time.perf_counter()
        try:
            output = self._twin_decoded(framework, dtype)
        except NotSupported as e:
            return {**row, "status": "not supported", "reason": str(e)}
        except Exception as e:  # the module under test raised: a failure, in its words
            return {**row, "status": "error", "reason": f"{type(e).__name__}: {e}",
                    "seconds": time.perf_counter() - start}
        return self._judged(row, output, {"output": compare_recurrence(
            output, self.expected, dtype, self.length)}, start)

    def _module(self, framework, dtype):
        """(the twin's module of the layer at ``dtype``, the framework's adapter)."""
        import importlib

        room = importlib.import_module(f"{framework}_attn.recurrent")
        class_name = recurrent.get(self.variant).class_name
        if not hasattr(room, class_name):
            raise NotSupported(f"{framework}_attn has no {class_name} module (the "
                               f"{self.variant} mixer) yet")
        twin = importlib.import_module(f"{framework}_attn")
        np_dtype = np.dtype(dtype)
        return twin.build(self.variant, dict(self.ours),
                          {n: a.astype(np_dtype) for n, a in self.params.items()})

    def _twin_output(self, framework, implementation, dtype, dy=None):
        """(y, dL/dx of Σ y ⊙ dy, None without ``dy``) of the twin's module."""
        adapter = ADAPTERS[framework]
        with adapter.float64(dtype == "float64"):
            module = self._module(framework, dtype)
            x, mask = adapter.array(self.x, dtype), adapter.array(self.mask)
            if framework == "torch":
                import torch
                x.requires_grad_(dy is not None)
                with torch.set_grad_enabled(dy is not None):
                    y = module(x, mask, implementation=implementation)
                grad = None if dy is None else adapter.numpy(torch.autograd.grad(
                    y, x, adapter.array(dy, dtype))[0])
                return adapter.numpy(y.detach()), grad
            import jax
            y, pullback = jax.vjp(lambda a: module(a, mask, implementation=implementation), x)
            grad = None if dy is None else adapter.numpy(pullback(adapter.array(dy, dtype))[0])
            return adapter.numpy(y), grad

    def _twin_decoded(self, framework, dtype):
        adapter = ADAPTERS[framework]
        with adapter.float64(dtype == "float64"):
            module = self._module(framework, dtype)
            cache, pieces = module.init_cache(self.x.shape[0], self.length), []
            for start, stop in [(0, self.prefill),
                                *((t, t + 1) for t in range(self.prefill, self.length))]:
                x = adapter.array(self.x[:, start:stop], dtype)
                mask = adapter.array(self.mask[:, start:stop])
                if framework == "torch":
                    import torch
                    with torch.no_grad():
                        y, cache = module(x, mask, cache=cache)
                else:
                    y, cache = module(x, mask, cache=cache)
                pieces.append(adapter.numpy(y))
        return np.concatenate(pieces, axis=1)

    def _hf_rows(self, dtype, core):
        row = self._row("hf", core, dtype)
        if dtype != "float32":
            return row, {**row, "status": "not supported", "reason": HF_FLOAT32}
        return row, None

    def hf(self, models, layer, exercise, state_dict, dtype):
        """HF's module in its one-layer model: its output (the recurrence's bound, or the
        peer rule) and its dL/dx by torch's autograd (HF's float32 floor for a gradient)."""
        row, refused = self._hf_rows(dtype, "")
        if refused is not None:
            return refused
        start = time.perf_counter()
        try:
            output, grad = models.gradient(hf_model().layer_only(exercise.config, layer.index),
                                           layer.stack, state_dict,
                                           {"x": self.x, "attention_mask": self.mask},
                                           self.dy, dtype, layer.index)
        except Exception as e:  # HF's own module raised: the row says so
            return {**row, "status": "error", "reason": f"{type(e).__name__}: {e}",
                    "seconds": time.perf_counter() - start}
        c = compare_recurrence(output, self.expected, dtype, self.length)
        if not c.ok and self.peer is not None:  # the verifier's peer rule (see the docstring)
            c = compare_to_plain(output, self.expected, self.peer, dtype)
        return self._judged(row, output, {"output": c, "grad x": compare_to_floor(
            grad, self.dx, hf_recurrence_floor(self.variant, self.length, "grad"))}, start)

    def hf_decode(self, models, layer, exercise, state_dict, dtype):
        """HF's own cached decoding (golden.verifier.model.Models.decoded) of the one-layer
        model (decoding_config), as ``twin_decode``'s calls: the recurrence's bound, or HF's
        float32 floor."""
        row, refused = self._hf_rows(dtype, "decode")
        if refused is not None:
            return refused
        start = time.perf_counter()
        try:
            output = models.decoded(decoding_config(exercise.config, layer.index), layer.stack,
                                    state_dict, {"x": self.x, "attention_mask": self.mask},
                                    self.prefill, dtype, layer.index)
        except Exception as e:  # HF's own module raised: the row says so
            return {**row, "status": "error", "reason": f"{type(e).__name__}: {e}",
                    "seconds": time.perf_counter() - start}
        c = compare_recurrence(output, self.expected, dtype, self.length)
        if not c.ok:
            c = compare_to_floor(output, self.expected,
                                 hf_recurrence_floor(self.variant, self.length))
        return self._judged(row, output, {"output": c}, start)


def hf_model():
    """golden.verifier.model (torch and transformers), imported when HF's rows run."""
    from golden.verifier import model
    return model


def decoding_config(config, index) -> dict:
    """The config of the one-layer model that decodes layer ``index`` (golden.verifier.model.
    Models.decoded): the layer's own (model.layer_only), given after it a layer of the
    checkpoint's other kind (its entries of the per-layer lists, mlp_layer_types, ...), never
    run: HF's model makes its softmax layers' masks whatever its layers are, from the cache's
    length, which a cache of linear layers alone does not have (get_seq_length raises)."""
    c = hf_model().layer_only(config, index)
    kinds = config.get("layer_types") or []
    other = next((j for j, k in enumerate(kinds) if k != "linear_attention"), None)
    if other is None or len(c.get("layer_types") or ()) != 1:
        return c
    for key, value in config.items():  # each per-layer list: the layer's entry, the other's
        if isinstance(value, list) and len(value) == len(kinds) and c.get(key) == [
                value[index]]:
            c[key] = [value[index], value[other]]
    return c
