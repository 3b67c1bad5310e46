"""Float32 inside the float64 reference, for ``golden.compare``: which ops of the torch float64
run ran in float32 or lower (a dispatch mode records them, by module), and how far running
them in float64 instead moves the output, the gradients and the verdict (a note on the report;
the verdict stays with the reference as run).
"""

from __future__ import annotations

from golden.specification import tolerances
from golden.compare.calls import _Call
from golden.compare.report import PortReport
from golden.compare.running import _run_torch
from golden.compare.verdict import _report, _zero


_LOW = ("float32", "float16", "bfloat16")
_NO_ARITHMETIC = {"detach", "alias", "view", "_unsafe_view", "expand", "t", "transpose",
                  "permute", "clone", "lift_fresh"}  # not listed as float32 steps


def _with_reference_steps(report, module, flax, torch32, table, pairs, terms) -> PortReport:
    """``report`` with ``reference`` (and a note) saying which ops of the torch float64
    reference ran in float32 or lower, in which module, and how far keeping them in float64
    moves the output and gradients. The verdict stays with the reference as run (the user's
    torch code is the specification, float32 steps included); the note says whether the
    verdict would be the same against the promoted one."""
    d = report.data
    call = _Call(d.get("keywords", {}), tuple(d.get("keyword_grads", ())), d.get("output"))
    run = (module, "float64", d["weights"], d["inputs"], pairs, d["cotangent"], call)
    import torch

    try:
        steps = _float32_steps(*run)
        report.reference = {"float32_steps": steps}
        if not steps:
            return report
        with _KeepFloat64(torch):
            kept = _run_torch(*run)
    except Exception as e:  # a module a dispatch mode cannot run: the comparison stands
        report.reference = {"error": f"{type(e).__name__}: {str(e).strip()[:200]}"}
        report.notes.append(f"float32 steps in the torch float64 reference not measured: "
                            f"{report.reference['error']}")
        return report
    e = d["expected"]
    moves = {"output": tolerances.compare(kept["output"], e["output"], "float64").rel_norm}
    moves.update({f"grad {k}": tolerances.compare(kept["grads"][k], g, "float64").rel_norm
                  for k, g in e["grads"].items() if not _zero(g, terms)})
    dtype = d.get("dtype", "float32")
    again = _report(kept, flax, torch32, table, pairs, terms, [], {"dtype": dtype})
    changed = [r["what"] for r, a in zip(report.rows, again.rows) if r["ok"] != a["ok"]]
    report.reference.update(moves=moves, verdict_changes=changed)
    worst = max((k for k in moves if k != "output"), key=moves.get, default=None)
    where = ", ".join(f"{path or 'the top-level module'} ({', '.join(ops)})"
                      for path, ops in steps.items())
    value, grad = (tolerances.TOLERANCES[dtype, k].rel_norm for k in ("value", "grad"))
    report.notes.append(
        f"float32 steps in the torch float64 reference: {where}; kept in float64, the output "
        f"moves by {moves['output']:.1e} (relative error norm; the {dtype} table's bound is "
        f"{value:.0e})"
        + (f", the gradients by up to {moves[worst]:.1e} ({worst}; bound {grad:.0e})"
           if worst else "")
        + (f": the verdict on {', '.join(changed)} differs against the promoted reference "
           f"(judged here: the reference as run)" if changed else
           ": no effect on the verdict (judged against the reference as run)"))
    return report


def _float32_steps(*run) -> dict:
    """{torch module path: names of the ops that ran in float32 or lower inside it, in order}
    from one ``_run_torch`` of ``run`` (float64), recorded by a dispatch mode; a module stack
    kept by global forward hooks names the innermost module running."""
    import torch
    from torch.nn.modules import module as torch_module
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    stack, names, steps = [], {}, {}

    def push(m, _args):
        if not stack:  # the root: the copy _run_torch made
            names.update({id(sub): path for path, sub in m.named_modules()})
        stack.append(names.get(id(m), "?"))

    def pop(_m, _args, _out):
        stack.pop()

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            low = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)
                   and str(t.dtype).removeprefix("torch.") in _LOW]
            op = func.overloadpacket.__name__
            if stack and low and op not in _NO_ARITHMETIC:
                if op == "_to_copy":
                    op = f"to {str(out.dtype).removeprefix('torch.')}"
                ops = steps.setdefault(stack[-1], [])
                ops += [op] if op not in ops else []
            return out

    handles = [torch_module.register_module_forward_pre_hook(push),
               torch_module.register_module_forward_hook(pop)]
    try:
        with Recording():
            _run_torch(*run)
    finally:
        for h in handles:
            h.remove()
    return steps


def _KeepFloat64(torch):
    """A dispatch mode that runs every op in float64: a conversion or a factory asking for
    float32 or lower gets float64, and low-precision operands are promoted (not those an
    in-place op writes to)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    low = tuple(getattr(torch, n) for n in _LOW)

    def up(t):
        return t.to(torch.float64) if isinstance(t, torch.Tensor) and t.dtype in low else t

    class KeepFloat64(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if kwargs.get("dtype") in low:
                kwargs["dtype"] = torch.float64
            if not func._schema.is_mutable:
                args, kwargs = tree_map(up, (args, kwargs))
            return func(*args, **kwargs)

    return KeepFloat64()
