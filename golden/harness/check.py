"""``attn-parity check``: every fixture through the reference, PyTorch, JAX, and any other
implementation (``--impl``), as a table and optionally as JSON, JUnit XML and an HTML page.

``run`` computes the report (a dict, schema in ``golden.report``); ``main`` prints it as a
table, writes the files asked for and returns the exit status.
"""

from __future__ import annotations

import datetime
import fnmatch
import sys
import time
from collections import Counter

import numpy as np

import golden
from golden import reference, runners
from golden.specification.fixture import Fixture
from golden.report import SCHEMA, SCHEMA_VERSION, STATUSES, worst_bound
from golden.runners.adapt import NotSupported, as_runner
from golden.specification.recurrent import MIXERS
from golden.specification.tolerances import (RECURRENT_TOLERANCES, compare_profile,
                                              compare_terms, profile)

# The runs check makes of each fixture: (framework, the core implementation asked for, None for
# the framework's own choice). torch runs a fixture twice: forward and backward through autograd
# (weights returned: its core takes "explicit"), and the forward alone with PyTorch's kernel
# ("fused") where that implementation takes the fixture. Each row reports the implementations
# that ran, as the runner recorded them (golden.specification.implementations.record).
FRAMEWORK_RUNS = (("torch", None), ("torch", "fused"), ("jax", None))


def _pairs(fixture, result, expected_grads=None):
    """(what, actual, expected): the output; the weights when the result has them; every
    gradient when it has gradients (None where one is missing)."""
    pairs = [("output", result["output"], fixture.expected["output"])]
    if "weights" in result:
        pairs.append(("weights", result["weights"], fixture.expected["weights"]))
    if "grads" in result:
        grads = fixture.grads if expected_grads is None else expected_grads
        pairs += [(f"grad {n}", result["grads"].get(n), g) for n, g in grads.items()]
    return pairs


def compare_all(fixture, result, dtype, *, profile_name="exact", baseline=None,
                expected=None):
    """Comparisons of what the result holds (see ``_pairs``); None where a gradient is
    missing. A result of gradients of the output alone (``"loss": "output"``, an
    implementation that returns no weights) is compared with the reference's gradients of
    Σ output ⊙ dO. ``baseline``: the plain low-precision implementation's result, for the
    tf32/bf16 profiles; ``expected``: ``expected_grads(fixture, loss)`` when the caller has
    it. A recurrent mixer's fixture is held to RECURRENT_TOLERANCES (their reason there). A
    fixture made in memory with ``term_sizes`` (random inputs: attn-parity hf) has those
    parameters' gradients held to compare_terms (the table, or failing it the same bounds
    relative to the terms' size)."""
    if expected is None:
        expected = expected_grads(fixture, result.get("loss", "both"))
    plain = {w: a for w, a, _ in _pairs(fixture, baseline, expected)} if baseline else {}
    table = RECURRENT_TOLERANCES if fixture.variant in MIXERS else None
    sizes = fixture.term_sizes if profile_name == "exact" and table is None else {}

    def judged(what, a, e):
        name, zero = what.removeprefix("grad "), what.removeprefix("grad ") in fixture.zero
        if what.startswith("grad ") and name in sizes and not zero:
            return compare_terms(a, e, sizes[name], dtype, "grad", terms=_terms(fixture, what))
        return compare_profile(a, e, plain.get(what), dtype, _kind(what),
                               terms=_terms(fixture, what), zero=zero,
                               profile_name=profile_name, table=table)
    return {what: None if a is None else judged(what, a, e)
            for what, a, e in _pairs(fixture, result, expected)}


def expected_grads(fixture, loss="both"):
    """The fixture's gradients, or for ``loss="output"`` the reference's of Σ output ⊙ dO."""
    if loss == "both":
        return fixture.grads
    return runners.run_reference(fixture, weights_cotangent=False)["grads"]


def _kind(what) -> str:
    """The tolerance table's row for a compared array: "value", "weights" or "grad"."""
    return "grad" if what.startswith("grad ") else ("weights" if what == "weights" else "value")


def _terms(fixture, what) -> int:
    """How many partial gradients each element of a gradient sums (see
    golden.specification.tolerances)."""
    name = what.removeprefix("grad ")
    if name in fixture.params:  # one term per position of the longest input sequence
        return max(a.size // a.shape[-1] for a in fixture.inputs.values() if a.dtype.kind == "f")
    if name in ("bias", "sinks"):  # core inputs summed over the weights (sinks: per head)
        return max(1, fixture.expected["weights"].size // fixture.inputs[name].size)
    return 1


def rows(fixture, frameworks, dtypes):
    """(framework, core, dtype) of the fixture's implementation rows, as filtered: each
    framework at each of the fixture's dtypes; torch's "fused" where it takes the fixture."""
    return [(fw, core, d) for fw, core in FRAMEWORK_RUNS for d in fixture.dtypes
            if (fw in frameworks) and (not dtypes or d in dtypes)
            and (core is None or not runners.refuses(fw, core, fixture))]


def select(names, pattern):
    """Names matching ``pattern``: a glob when it has wildcards, else a substring."""
    if not pattern:
        return names
    wild = any(c in pattern for c in "*?[")
    name = lambda n: getattr(n, "name", n)  # noqa: E731  (a Fixture made in memory)
    return [n for n in names if (fnmatch.fnmatch(name(n), pattern) if wild
                                 else pattern in name(n))]


def available(frameworks, log) -> list[str]:
    """The frameworks whose runner imports; each one that does not is reported on ``log``."""
    found = []
    for fw in frameworks:
        try:
            runners.get(fw)
            found.append(fw)
        except ImportError as e:
            log(f"skipped {fw}: {e}")
    return found


def regenerated(fixture) -> list[str]:
    """What the reference, recomputing the fixture from its stored inputs, does not reproduce
    bit for bit (empty: the fixture is what the reference writes)."""
    pairs = _pairs(fixture, runners.run_reference(fixture))
    return [what for what, a, e in pairs if a is None or not np.array_equal(a, e)]


def _regenerated_all(fixtures) -> dict:
    """{fixture name: what the reference does not reproduce} for those that differ;
    ``fixtures`` as Fixture objects, or names and paths (loaded here)."""
    loaded = (f if isinstance(f, Fixture) else golden.load(f) for f in fixtures)
    return {f.name: what for f in loaded if (what := regenerated(f))}


class _Regeneration:
    """The regeneration check, in a second process when ``background`` (it is exact decimal
    arithmetic in Python, seconds of one core, while the rows' runners wait mostly on
    compiled code): started at once, its answer taken after the rows. The process is
    ``python -c`` reading the names on stdin and writing the answer as JSON, so it ends with
    its task even if this one is killed first. Fixture objects made in memory have no name to
    send, so they are checked here."""

    def __init__(self, fixtures, names, background):
        self.fixtures, self.process = fixtures, None
        if background and all(not isinstance(n, Fixture) for n in names):
            import json
            import os
            import subprocess
            import sys

            root = os.path.dirname(os.path.dirname(os.path.abspath(golden.__file__)))
            path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
            self.process = subprocess.Popen(
                [sys.executable, "-c",
                 "from golden.harness.check import _regeneration_process as r; r()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                env={**os.environ, "PYTHONPATH": path})
            self.process.stdin.write(json.dumps([str(n) for n in names]))
            self.process.stdin.close()

    def result(self) -> dict:
        if self.process is None:
            return _regenerated_all(self.fixtures)
        import json

        out = self.process.stdout.read()
        self.process.stdout.close()
        if self.process.wait() != 0:  # its traceback went to stderr; check here, in full
            return _regenerated_all(self.fixtures)
        return json.loads(out)


def _regeneration_process() -> None:
    """The second process of ``_Regeneration``: names (JSON) on stdin, the answer on stdout."""
    import json
    import sys

    json.dump(_regenerated_all(json.loads(sys.stdin.read())), sys.stdout)


# ---- the work: (fixture, runner, label, core, dtype) ------------------------------------------

def _work(fixtures, frameworks, impls, dtypes):
    work = [(f, runners.get(fw, core), fw, core, d) for f in fixtures
            for fw, core, d in rows(f, frameworks, dtypes)]
    work += [(f, impl, impl.name, None, d) for f in fixtures for impl in impls
             for d in f.dtypes if not dtypes or d in dtypes]
    return work


def _baseline(fixture, loss, prof, memo):
    """The plain low-precision implementation's result on the fixture (cached)."""
    key = (fixture.name, loss)
    if key not in memo:
        with reference.rounded_products(prof.bits):
            memo[key] = runners.run_reference(fixture, weights_cotangent=(loss == "both"),
                                               exact=False)
    return memo[key]


def _expected(fixture, loss, memo):
    """``expected_grads(fixture, loss)``, computed once per fixture and loss in a run: for
    ``"output"`` the exact reference again, the same for every dtype and implementation."""
    key = ("expected", id(fixture), loss)
    if key not in memo:
        memo[key] = expected_grads(fixture, loss)
    return memo[key]


def _row(fixture, runner, label, core, dtype, prof, memo):
    """(the report's row, the result or None)."""
    row = {"fixture": fixture.name, "variant": fixture.variant, "implementation": label,
           "core": core or "", "dtype": dtype, "status": "pass", "reason": None, "seconds": 0.0,
           "max_abs": None, "max_rel": None, "arrays": []}
    start = time.perf_counter()
    try:
        result = runner(fixture, dtype)
        loss = result.get("loss", "both")
        base = (_baseline(fixture, loss, prof, memo)
                if prof.bits and dtype == "float32" else None)
        comps = compare_all(fixture, result, dtype, profile_name=prof.name, baseline=base,
                            expected=_expected(fixture, loss, memo))
    except NotSupported as e:
        return {**row, "status": "not supported", "reason": str(e)}, None
    except Exception as e:  # the implementation under test raised: a failure, with its words
        return {**row, "status": "error", "reason": f"{type(e).__name__}: {e}",
                "seconds": time.perf_counter() - start}, None
    row["seconds"] = time.perf_counter() - start
    row["core"] = result.get("core", row["core"])
    row["arrays"] = [_array(what, c) for what, c in comps.items()]
    bad = [a["name"] for a in row["arrays"] if not a["ok"]]
    if bad:
        row["status"], row["reason"] = "fail", ", ".join(bad)
    compared = [c for c in comps.values() if c is not None]
    row["max_abs"] = max((c.max_abs for c in compared), default=None)
    row["max_rel"] = max((c.max_rel for c in compared if not c.zero), default=None)
    if len(compared) < len(comps):
        row["max_abs"] = row["max_rel"] = float("inf")
    return row, result


def _array(what, c) -> dict:
    """A row's entry for one compared array: its errors and the bounds they were held to
    (golden.specification.tolerances.Comparison); None throughout where the implementation returned
    none."""
    kind = _kind(what)
    if c is None:
        return {"name": what, "kind": kind, "max_abs": None, "max_rel": None, "rel_norm": None,
                "abs_err": None, "bound_abs": None, "bound_rel_norm": None, "rule": None,
                "ok": False, "zero": False, "missing": True}
    return {"name": what, "kind": kind, "max_abs": c.max_abs, "max_rel": c.max_rel,
            "rel_norm": c.rel_norm, "abs_err": c.abs_err, "bound_abs": c.bound_abs,
            "bound_rel_norm": c.bound_rel_norm, "rule": c.rule, "ok": c.ok, "zero": c.zero,
            "missing": False}


# ---- run and main -----------------------------------------------------------------------------

def run(names=None, *, frameworks=(), impls=(), dtypes=(), pattern=None, variants=(),
        profile_name="exact", log=None, progress=None, weights=None, command="",
        regeneration=True, outputs=None, background=False) -> dict:
    """The report (see ``golden.report``) of the selected fixtures (names, paths, or Fixture
    objects made in memory) through the frameworks (default: all installed, unless ``impls``
    are given, then only those) and the runners in ``impls``. ``log`` gets one line per row as
    it finishes; ``weights``, a dict, is filled with {fixture: {label: attention weights}} for
    the HTML page, and ``outputs`` likewise with the outputs (the page shows their difference
    where an implementation returns no weights); ``regeneration``: also check that the
    reference rewrites each fixture bit for bit (False for fixtures that are not from
    golden/specification/cases.py), in a second process while the rows run when ``background``."""
    log = log or (lambda line: None)
    prof = profile(profile_name)
    impls = [as_runner(i) for i in impls]
    start = time.perf_counter()
    names = select(list(names or golden.names()), pattern)
    pairs = [(n, n if isinstance(n, Fixture) else golden.load(n)) for n in names]
    pairs = [(n, f) for n, f in pairs if not variants or f.variant in variants]
    fixtures = [f for _, f in pairs]
    wanted = list(frameworks) or ([] if impls else list(runners.FRAMEWORKS))
    use = available(wanted, log)
    work = _work(fixtures, use, impls, dtypes)
    report = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "created": _now(),
              "command": command, "environment": _environment(),
              "profile": {"name": prof.name, "k": prof.k, "description": prof.description},
              "implementations": [*(fw for fw in use if fw != "reference"),
                                  *(i.name for i in impls)],
              "rows": [], "regeneration": None}
    # A second process takes about a second to start: worth it beside many fixtures' rows.
    background = background and len(fixtures) >= 16 and any(w[2] != "reference" for w in work)
    regen = (_Regeneration(fixtures, [n for n, _ in pairs], background)
             if regeneration and fixtures and "reference" in use
             and (not dtypes or "float64" in dtypes) else None)
    bar, log = _progress(work, progress, log)
    memo = {}
    for fixture, runner, label, core, dtype in bar:
        row, result = _row(fixture, runner, label, core, dtype, prof, memo)
        report["rows"].append(row)
        log(row)
        if weights is not None:
            _keep(weights, fixture, row, result, "weights")
        if outputs is not None:
            _keep(outputs, fixture, row, result, "output")
    if regen is not None:
        differ = regen.result()
        report["regeneration"] = {"checked": len(fixtures), "reproduced":
                                  len(fixtures) - len(differ), "differ": differ}
    report["summary"] = _summary(report, time.perf_counter() - start)
    return report


def _keep(store, fixture, row, result, what):
    """store[fixture]["reference"] = the expected ``what`` ("weights" or "output"), and
    store[fixture][row label] = the implementation's, when its result has one."""
    kept = store.setdefault(fixture.name, {"reference": fixture.expected[what]})
    if result is not None and what in result:
        kept[f"{row['implementation']} {row['core']} {row['dtype']}"] = result[what]


def _summary(report, seconds) -> dict:
    count = {s: sum(r["status"] == s for r in report["rows"]) for s in STATUSES}
    regen = report["regeneration"]
    regen_failed = len(regen["differ"]) if regen else 0
    ran = count["pass"] + count["fail"] + count["error"] + (regen["checked"] if regen else 0)
    return {"rows": len(report["rows"]), "passed": count["pass"], "failed": count["fail"],
            "errors": count["error"], "not_supported": count["not supported"],
            "regeneration_failed": regen_failed, "seconds": round(seconds, 3),
            "ok": bool(ran) and not (count["fail"] or count["error"] or regen_failed)}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _environment() -> dict:
    try:
        from golden.report import environment
    except ImportError:  # pragma: no cover - the report module ships with the package
        return {}
    return environment()


def main(names=None, *, frameworks=(), impls=(), dtypes=(), pattern=None, variants=(),
         profile_name="exact", json_path=None, junit_path=None, html_dir=None, log=print,
         progress=None, command="", hide_unsupported=False, background=False) -> int:
    """Print the table (and the regeneration check), write the reports asked for; return 0
    when everything that ran passed, 1 on any failure or error, 2 when nothing ran. After the
    table, the not-supported rows' reasons with their counts; ``hide_unsupported`` leaves
    those rows out of the table itself; ``background`` as in ``run``."""
    if "jax" in (list(frameworks) or ([] if impls else runners.FRAMEWORKS)):
        _log_backend(log)
    table = _Table(log, [getattr(i, "name", "") for i in impls], hide_unsupported)
    weights, outputs = ({}, {}) if html_dir else (None, None)
    report = run(names, frameworks=frameworks, impls=impls, dtypes=dtypes, pattern=pattern,
                 variants=variants, profile_name=profile_name, log=table, progress=progress,
                 weights=weights, command=command, outputs=outputs, background=background)
    s = report["summary"]
    _log_not_supported(report["rows"], log)
    if s["rows"]:
        line = f"{s['passed']} passed, {s['failed'] + s['errors']} failed"
        extra = [f"{s['errors']} of them errors"] if s["errors"] else []
        if s["not_supported"]:
            extra.append(f"{s['not_supported']} not supported")
        log(line + (f" ({'; '.join(extra)})" if extra else ""))
    _log_regeneration(report["regeneration"], log)
    _write_reports(report, (weights, outputs), json_path, junit_path, html_dir, progress, log)
    if not s["rows"] and not report["regeneration"]:
        log("nothing selected: check the names, -k, --variant, --framework and --dtype")
        return 2
    if not s["ok"] and not (s["passed"] or s["failed"] or s["errors"] or report["regeneration"]):
        log("nothing ran: every selected row is not supported by the implementation")
        return 2
    return 0 if s["ok"] else 1


def table(rows) -> str:
    """Rows of a report as the text table ``attn-parity check`` prints (header included)."""
    lines = []
    printer = _Table(lines.append, [r["implementation"] for r in rows])
    printer.width = max([len("fixture"), *(len(r["fixture"]) for r in rows)])
    for row in rows:
        printer(row)
    return "\n".join(lines)


def _log_backend(log):
    try:
        import jax
    except ImportError:
        return
    log(f"JAX backend: {jax.default_backend()}; devices: {', '.join(map(str, jax.devices()))}")


class _Table:
    """Prints rows as they come (a string is passed through), header first; ``hide_unsupported``:
    not the "not supported" rows (``_log_not_supported`` sums them up after the table)."""

    def __init__(self, log, labels=(), hide_unsupported=False):
        self.log, self.printed, self.width = log, False, None
        self.label = max([9, *(len(x) for x in labels)])
        self.hide_unsupported = hide_unsupported

    def __call__(self, item):
        if isinstance(item, str):
            self.log(item)
            return
        if self.hide_unsupported and item["status"] == "not supported":
            return
        if not self.printed:
            self.printed = True
            self.log(self._header())
            self.log("-" * len(self._header()))
        self.log(_format_row(item, self.width, self.label))

    def _header(self):
        self.width = self.width or max(len("fixture"), *(len(n) for n in golden.names()))
        return (f"{'fixture':{self.width}} {'framework':{self.label}} {'core':10} {'dtype':8} "
                f"{'max abs err':>11} {'max rel err':>11} {'worst err/bound':>17}  result")


def _format_row(row, width, label=9) -> str:
    def num(x):
        return f"{'-':>11}" if x is None else f"{x:11.2e}"

    status = row["status"]
    verdict = {"pass": "pass", "fail": f"FAIL {row['reason']}",
               "error": f"ERROR {row['reason']}",
               "not supported": f"not supported: {row['reason']}"}[status]
    return (f"{row['fixture']:{width}} {row['implementation']:{label}} {row['core'] or '-':10} "
            f"{row['dtype']:8} {num(row['max_abs'])} {num(row['max_rel'])} "
            f"{worst_bound(row['arrays']):>17}  {verdict}")


def _log_not_supported(rows, log):
    """One line per distinct reason of the not-supported rows, with its count, most frequent
    first, under a line giving their total: a digest of what the implementations could not
    run (nothing when every row ran)."""
    reasons = Counter(" ".join((r["reason"] or "").split()) for r in rows
                      if r["status"] == "not supported")
    if not reasons:
        return
    log(f"not supported ({sum(reasons.values())} rows), by reason:")
    width = len(str(max(reasons.values())))
    for reason, count in reasons.most_common():
        log(f"  {count:{width}} × \"{reason}\"")


def _log_regeneration(regen, log):
    if not regen:
        return
    for name, what in regen["differ"].items():
        log(f"regeneration check: {name}: the reference does not reproduce {', '.join(what)}")
    log(f"regeneration check: the reference reproduces {regen['reproduced']} of "
        f"{regen['checked']} fixtures bit for bit")


def _write_reports(report, arrays, json_path, junit_path, html_dir, progress, log):
    if not (json_path or junit_path or html_dir):
        return
    from golden import report as writers

    if json_path:
        writers.write_json(report, json_path)
        log(f"wrote {json_path}")
    if junit_path:
        writers.write_junit(report, junit_path)
        log(f"wrote {junit_path}")
    if html_dir:
        writers.write_html(report, html_dir, arrays[0], progress=progress, outputs=arrays[1])
        log(f"wrote {html_dir}/index.html")


def _progress(work, progress, log):
    """(work, log): ``work`` wrapped in a tqdm bar on stderr when stderr is a terminal (or
    ``progress`` is True), and ``log`` writing its lines around the bar."""
    show = sys.stderr.isatty() if progress is None else progress
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a convenience of the [report] extra, not a requirement
        show = False
    if not show:
        return work, log

    def write(line):
        with tqdm.external_write_mode(file=sys.stderr):
            log(line)

    return tqdm(work, desc="check", unit="run", file=sys.stderr, leave=False), write
