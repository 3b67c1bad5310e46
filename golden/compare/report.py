"""The report of ``golden.compare``: ``PortReport`` (the verdict, the rows, where the port
diverges and the suspects), its text table and its JSON (schema ``SCHEMA``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from golden.report import plain


# 2: a number that is not finite is null, as in every report of this project (golden.report.plain)
# 3: each comparison (a row's "torch_float32", "flax_float32") also states the bounds it was held
#    to: "abs_err", "bound_abs", "bound_rel_norm", "rule"
# (golden.specification.tolerances.Comparison); the
#    report gains "diagnosis", "interval" (where the port parts from the reference), "reference"
#    (the float32 steps inside the torch float64 reference and how far they move it) and "dtype";
#    rows "input of A ~ B" compare a paired submodule's input
SCHEMA = {"schema": "attn-parity-compare", "schema_version": 3}


@dataclass
class PortReport:
    """Rows of comparisons with torch float64; the verdict is the Flax float32 column's on the
    output and every gradient (submodule rows locate a divergence, they do not decide).
    ``suspects`` are the mapped parameters the divergence may come from: a gradient depends on
    every activation after its parameter, so one wrong weight fails most gradients, while the
    submodules' inputs and outputs, compared in execution order, say where the runs part
    (``diagnosis``): inside a submodule (its parameters are suspects), or in the code between
    two (no parameter is, unless the port bypasses a paired submodule's ``__call__``).
    ``first_divergent`` is the first paired submodule whose output diverges."""

    ok: bool
    rows: list
    first_divergent: str | None
    failing_params: list
    suspects: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    data: dict = field(default_factory=dict, repr=False)  # what freeze() writes
    # where the Flax run first parts from the reference (golden.compare.localise): a sentence,
    # and [A, B] when that is the code between two paired submodules (None: the module's
    # inputs or output), None otherwise
    diagnosis: str | None = None
    interval: list | None = None
    # float32 steps inside the torch float64 reference and their effect
    # (golden.compare.reference_steps)
    reference: dict = field(default_factory=dict)

    def text(self) -> str:
        """A readable table: max |Δ| and the relative error norm per column, the Flax column's
        each beside the bound it was held to (the elementwise check's at its deciding element,
        golden.specification.tolerances.Comparison), then the verdict."""
        width = max(len(r["what"]) for r in self.rows) + 2
        dtype = self.data.get("dtype", "float32")
        lines = [f"{'':{width}}{'flax path':16}{'rule':8}{'torch ' + dtype:28}flax {dtype}",
                 f"{'':{width + 24}}{'max|Δ|   rel‖Δ‖':28}"
                 f"{'max|Δ|':9}{'rel‖Δ‖/bound':17}|Δᵢ|/boundᵢ"]
        for r in self.rows:
            lines.append(f"{r['what']:{width}}{r['flax_path'] or '-':16}{r['rule'] or '-':8}"
                         f"{_cell(r['torch_float32']):28}"
                         f"{_cell(r['flax_float32'], r, bounds=True)}")
        lines += [f"note: {n}" for n in self.notes]
        lines.append(f"first diverging submodule: {self.first_divergent or 'none'}")
        if self.suspects:
            lines.append("  suspect parameters: " + ", ".join(self.suspects))
        lines.append(f"diagnosis: {self.diagnosis or 'no divergence'}")
        if self.ok:
            lines.append("pass")
        else:
            failing = [r["what"] for r in self.rows[:1] if not r["ok"]]
            failing += [f"grad {k}" for k in self.failing_params]
            failing += [r["what"] for r in self.rows if r["what"].startswith("grad input")
                        and not r["ok"]]
            lines.append(f"FAIL: {', '.join(failing)}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """JSON-ready (schema ``SCHEMA``, version 3): the verdict, the rows and the notes; each
        row's "torch_float32" and "flax_float32" are ``golden.specification.tolerances.Comparison``
        fields, the errors and the bounds they were held to; a number that is not finite is None
        (null in JSON), NumPy values are Python values (golden.report.plain)."""
        return plain({"ok": self.ok, "first_divergent": self.first_divergent,
                      "failing_params": self.failing_params, "suspects": self.suspects,
                      "diagnosis": self.diagnosis, "interval": self.interval,
                      "reference": self.reference,
                      "rows": self.rows, "notes": self.notes, "seed": self.data.get("seed"),
                      "dtype": self.data.get("dtype", "float32"),
                      "mapping": self.data.get("mapping")})


def _cell(c, row=None, bounds=False) -> str:
    """A column's cell: max |Δ|, the relative error norm ("(zero)": not applied) and the
    verdict; with ``bounds``, rel‖Δ‖ / its bound and |Δᵢ| / boundᵢ at the elementwise check's
    deciding element (golden.specification.tolerances.Comparison: it passes exactly when |Δᵢ| ≤
    boundᵢ)."""
    if c is None:
        return (row or {}).get("note") or "-"
    verdict = "pass" if c["ok"] else "FAIL"
    if not bounds or c.get("bound_abs") is None:
        rel = "(zero)" if c["zero"] else f"{c['rel_norm']:.1e}"
        return f"{c['max_abs']:.1e}  {rel:7}  {verdict}"
    rel = ("(zero)" if c["bound_rel_norm"] is None
           else f"{c['rel_norm']:.1e}/{c['bound_rel_norm']:.1e}")
    return (f"{c['max_abs']:.1e}  {rel:15}  {c['abs_err']:.1e}/{c['bound_abs']:.1e}  "
            f"{verdict}")
