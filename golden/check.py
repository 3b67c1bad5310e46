"""``attn-parity check``: every fixture through the reference, PyTorch and JAX, as a table."""

from __future__ import annotations

import fnmatch
import sys

import numpy as np

import golden
from golden import runners
from golden.tolerances import compare

# The implementations' rows: (framework, path). torch runs a fixture twice: forward and backward
# through autograd (the explicit path, weights returned), and the forward alone under no_grad,
# which its core sends to PyTorch's fused kernel. JAX reports the path its core took.
IMPLEMENTATIONS = (("torch", "autograd"), ("torch", "fused"), ("jax", "jit"))


def _pairs(fixture, result):
    """(what, actual, expected) for the output, and unless the result is forward-only (no
    "weights") the weights and every gradient; actual is None where a gradient is missing."""
    pairs = [("output", result["output"], fixture.expected["output"])]
    if "weights" in result:
        pairs.append(("weights", result["weights"], fixture.expected["weights"]))
        pairs += [(f"grad {n}", result["grads"].get(n), g) for n, g in fixture.grads.items()]
    return pairs


def compare_all(fixture, result, dtype):
    """Comparisons of output, weights and every gradient; None where a gradient is missing. A
    forward-only result is compared on its output alone."""
    return {what: None if a is None else compare(
                a, e, dtype, _kind(what), terms=_terms(fixture, what),
                zero=what.removeprefix("grad ") in fixture.zero)
            for what, a, e in _pairs(fixture, result)}


def _kind(what) -> str:
    """The tolerance table's row for a compared array: "value", "weights" or "grad"."""
    return "grad" if what.startswith("grad ") else ("weights" if what == "weights" else "value")


def _terms(fixture, what) -> int:
    """How many partial gradients each element of a gradient sums (see golden.tolerances)."""
    name = what.removeprefix("grad ")
    if name in fixture.params:  # one term per position of the longest input sequence
        return max(a.size // a.shape[-1] for a in fixture.inputs.values() if a.dtype.kind == "f")
    if name == "bias":  # the core's one input that broadcasts against the weights
        return max(1, fixture.expected["weights"].size // fixture.inputs[name].size)
    return 1


def rows(fixture, frameworks, dtypes):
    """(framework, path, dtype) of the fixture's implementation rows, as filtered: each
    implementation at each of the fixture's dtypes; the fused path where torch takes it."""
    return [(fw, path, d) for fw, path in IMPLEMENTATIONS for d in fixture.dtypes
            if (fw in frameworks) and (not dtypes or d in dtypes)
            and (path != "fused" or runners.fused_applies(fixture))]


def select(names, pattern):
    """Names matching ``pattern``: a glob when it has wildcards, else a substring."""
    if not pattern:
        return names
    wild = any(c in pattern for c in "*?[")
    return [n for n in names if (fnmatch.fnmatch(n, pattern) if wild else pattern in n)]


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


def main(names=None, *, frameworks=(), dtypes=(), pattern=None, log=print, progress=None) -> int:
    """Print the implementations' table, then the reference's regeneration check; return 1 if
    any row failed, 2 if nothing was selected."""
    names = select(list(names or golden.names()), pattern)
    use = available(list(frameworks) or list(runners.FRAMEWORKS), log)
    if "jax" in use:
        import jax

        log(f"JAX backend: {jax.default_backend()}; devices: {', '.join(map(str, jax.devices()))}")
    fixtures = [golden.load(n) for n in names]
    work = [(f, fw, path, d) for f in fixtures for fw, path, d in rows(f, use, dtypes)]
    regen = fixtures if "reference" in use and (not dtypes or "float64" in dtypes) else []
    if not work and not regen:
        log("nothing selected: check the names, -k, --framework and --dtype")
        return 2
    width = max(len("fixture"), *(len(f.name) for f in fixtures))
    passed = failed = 0
    if work:
        header = (f"{'fixture':{width}} {'framework':9} {'path':8} {'dtype':8} "
                  f"{'max abs err':>11} {'max rel err':>11}  result")
        log(header)
        log("-" * len(header))
        bar, log = _progress(work, progress, log)
        for fixture, framework, path, dtype in bar:
            result = runners.get(framework, path)(fixture, dtype)
            comps = compare_all(fixture, result, dtype)
            ok = all(c is not None and c.ok for c in comps.values())
            worst_abs = max(c.max_abs if c else np.inf for c in comps.values())
            worst_rel = max((c.max_rel if c else np.inf for c in comps.values()
                             if not (c and c.zero)), default=0.0)
            bad = [w for w, c in comps.items() if c is None or not c.ok]
            verdict = "pass" if ok else "FAIL " + ", ".join(bad)
            log(f"{fixture.name:{width}} {framework:9} {result.get('path', path):8} {dtype:8} "
                f"{worst_abs:11.2e} {worst_rel:11.2e}  {verdict}")
            passed, failed = passed + ok, failed + (not ok)
        log(f"{passed} passed, {failed} failed")
    if regen:
        differ = {f.name: regenerated(f) for f in regen}
        differ = {n: what for n, what in differ.items() if what}
        for name, what in differ.items():
            log(f"regeneration check: {name}: the reference does not reproduce {', '.join(what)}")
        log(f"regeneration check: the reference reproduces {len(regen) - len(differ)} of "
            f"{len(regen)} fixtures bit for bit")
        failed += len(differ)
    return 1 if failed else 0


def _progress(work, progress, log):
    """(work, log): ``work`` wrapped in a tqdm bar on stderr when stderr is a terminal (or
    ``progress`` is True), and ``log`` writing its lines around the bar."""
    show = sys.stderr.isatty() if progress is None else progress
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a convenience of the [all] extra, not a requirement
        show = False
    if not show:
        return work, log

    def write(line):
        with tqdm.external_write_mode(file=sys.stderr):
            log(line)

    return tqdm(work, desc="check", unit="run", file=sys.stderr, leave=False), write
