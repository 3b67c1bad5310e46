"""Reports of ``attn-parity check``: ``--json FILE``, ``--junit FILE`` and ``--html DIR``.

``golden.harness.check`` builds one *report dict* and hands it to the writers here. Its JSON form
(``write_json``) is the public schema, ``"schema": "attn-parity-check"``, ``"schema_version": 3``;
keys appear in this order, and a float that is not finite (inf, NaN) is stored as ``null``::

    {
      "schema": "attn-parity-check", "schema_version": 3,
      "created": "2026-11-22T08:00:00Z",        # UTC, ISO-8601
      "command": "attn-parity check -k sdpa",   # as typed; "" from the Python API
      "environment": {...},                     # environment(), below
      "profile": {"name": "exact", "k": null, "description": "..."},  # "tf32"/"bf16": k a number
      "implementations": ["torch", "jax", "mypkg.port:runner"],
      "rows": [                                 # one per fixture x run x dtype
        {"fixture": "sdpa_plain", "variant": "scaled_dot_product_attention",
         "implementation": "torch",             # the implementation under test (a runner)
         "core": "explicit",                    # the core implementation(s) it ran, as
                                                # recorded (golden.specification.implementations);
                                                # "" unknown
         "dtype": "float32",
         "status": "pass",                      # "pass", "fail", "error" or "not supported"
         "reason": null,                        # the failing arrays, the exception, why not run
         "seconds": 0.012,
         "max_abs": 1.2e-07, "max_rel": 3.0e-07,   # worst over the arrays; null when nothing
                                                   # was compared or the worst is not finite
         "arrays": [                            # one per compared array; [] for error and
                                                # not supported
           {"name": "output", "kind": "value",  # kind: "value", "weights" or "grad"
            "max_abs": 1.2e-07, "max_rel": 3e-07, "rel_norm": 1e-07,
            "abs_err": 1.2e-07,                 # |a - e| at the deciding element, held to
            "bound_abs": 1.3e-06,               # its bound atol' + rtol |e| (see below)
            "bound_rel_norm": 1e-06,            # rel_norm's bound; null: not applied (zero)
            "rule": "table",                    # "table", "terms", "profile", "recurrence"
            "ok": true, "zero": false,          # zero: the array is zero by structure
            "missing": false}                   # missing: the implementation returned none
        ]}
      ],
      "regeneration": {"checked": 57, "reproduced": 56,       # null when not run
                       "differ": {"sdpa_plain": ["output"]}},
      "summary": {"rows": 366, "passed": 360, "failed": 3, "errors": 1, "not_supported": 2,
                  "regeneration_failed": 1, "seconds": 40.2, "ok": false}
    }

Every array states the bounds it was judged against
(``golden.specification.tolerances.Comparison``). The
elementwise check holds each |aᵢ − eᵢ| to its own bound atol' + rtol·|eᵢ| (atol' the table's atol
times max(1, max|e|)·√terms), so no single number bounds ``max_abs``: ``abs_err`` and
``bound_abs`` are the error and the bound of the element nearest to (or furthest over) its
bound, and that check passes exactly when ``abs_err <= bound_abs``; the relative error norm
passes when ``rel_norm <= bound_rel_norm``. ``rule`` says which bounds decided: "table" (the
tolerance table), "profile" (``--profile tf32/bf16`` at float32, tried when the table fails:
``bound_abs`` = k × the plain implementation's max|b − e| + atol', ``bound_rel_norm`` = k × its
relative error norm + the table's, both flat, so ``abs_err`` = ``max_abs``) or "terms" (bounds
relative to the terms' size, golden.specification.tolerances.compare_terms) or "recurrence" (a
recurrent mixer's output, whose float32 error grows with its length: ``bound_rel_norm`` =
delta_rule_bound(dtype, L), ``bound_abs`` = 4 × that × max|e|, compare_recurrence). For a missing array all
four are null.

Versions: 2, a row's "path" became "core"; 3, arrays gained ``abs_err``, ``bound_abs``,
``bound_rel_norm`` and ``rule`` (the text table's "worst err/bound" column, JUnit failure
texts and the HTML rows show them too).

``environment`` holds (each a string, or null where the package is not installed) ``python``,
``platform``, ``machine``, ``numpy``, ``torch``, ``jax``, ``jaxlib``, ``flax``, ``optax``,
``matplotlib``, ``attn_parity``, and when JAX was imported by the run ``jax_backend`` and
``devices`` (a list of strings), else null.

``write_junit`` writes JUnit XML for CI test reporters (one testsuite per implementation, one
testcase per row, plus a "reference regeneration" suite); ``write_html`` writes ``DIR/index.html``
and one heatmap image per fixture, ``DIR/fixtures/<fixture>.png`` (matplotlib, from the
``[report]`` extra). Every file is written whole or not at all
(``golden.specification.fixture.write_atomic``).

Weights arrays have the shape legend of the cores: (B, H, Lq, Lk), B batch, H heads, Lq query
length, Lk key length; the images show the first (B, H) slice.

The rooms, each importing only those above it (matplotlib only inside ``figures``, when
drawing):
    environment     the environment block (``environment``, ``PACKAGES``)
    schema          the keys and statuses above, ``check_report``, ``plain``
    files           how every file is written (whole or not at all)
    json_file       ``write_json``
    bounds          errors beside their bounds as text (``worst_bound``), numbers for tables
    junit           ``write_junit``
    figures         the fixtures' heatmaps (matplotlib)
    page            ``write_html``: index.html and its images
"""

from __future__ import annotations

from golden.report.environment import PACKAGES, environment
from golden.report.schema import (ARRAY_KEYS, KEYS, ROW_KEYS, SCHEMA, SCHEMA_VERSION, STATUSES,
                                  SUMMARY_KEYS, check_report, plain)
from golden.report.json_file import write_json
from golden.report.bounds import worst_bound
from golden.report.junit import write_junit
from golden.report.figures import NEEDS_MATPLOTLIB
from golden.report.page import MAX_COLUMNS, write_html

__all__ = ["ARRAY_KEYS", "KEYS", "MAX_COLUMNS", "NEEDS_MATPLOTLIB", "PACKAGES", "ROW_KEYS",
           "SCHEMA", "SCHEMA_VERSION", "STATUSES", "SUMMARY_KEYS", "check_report", "environment",
           "plain", "worst_bound", "write_html", "write_json", "write_junit"]
