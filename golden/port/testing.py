"""Assertions for your own test suite: ``assert_port`` and ``assert_impl``.

Each runs what the command runs and, when it fails, raises ``AssertionError`` whose message is
the report's table, so that pytest (or unittest) prints what ``attn-parity`` would have printed.
Nothing here imports pytest: the package does not depend on it.

    from golden.port.testing import assert_impl, assert_port

    def test_my_port():
        assert_port(make_torch, make_flax, MAPPING, {"x": (2, 5, 8)})   # golden.compare.compare
        assert_port(fixture="tests/port.npz")                          # golden.compare.check_port

    def test_my_attention():
        assert_impl(from_function(my_sdpa, "numpy"), pattern="sdpa_")  # golden.harness.check.run
"""

from __future__ import annotations


def assert_port(*args, fixture=None, **kwargs):
    """``golden.compare.compare(*args, **kwargs)``, or with ``fixture=PATH``
    ``golden.compare.check_port(PATH, *args, **kwargs)`` (flax_factory, torch_factory); every
    argument is forwarded as given. Returns the ``PortReport``; raises ``AssertionError`` with
    ``report.text()`` as its message when the port fails."""
    from golden import compare as port

    report = (port.check_port(fixture, *args, **kwargs) if fixture is not None
              else port.compare(*args, **kwargs))
    if not report.ok:
        raise AssertionError("the port does not match its reference:\n" + report.text())
    return report


def assert_impl(runner, **kwargs) -> dict:
    """``golden.harness.check.run(impls=[runner], **kwargs)``: returns the report; raises
    ``AssertionError`` whose message is the table of the rows that failed or raised, or says
    that nothing ran (every selected fixture not supported, or none selected)."""
    from golden.harness import check

    if "impls" in kwargs:
        raise ValueError(f"impls: assert_impl checks the one runner it is given, got "
                         f"impls={kwargs['impls']!r} as well")
    report = check.run(impls=[runner], **kwargs)
    bad = [r for r in report["rows"] if r["status"] in ("fail", "error")]
    if bad:
        s = report["summary"]
        raise AssertionError(f"{len(bad)} of {s['rows']} rows failed ({s['passed']} passed, "
                             f"{s['not_supported']} not supported):\n" + check.table(bad))
    if not report["summary"]["passed"]:
        raise AssertionError(f"nothing ran: {report['summary']['rows']} rows selected, none "
                             "supported by the implementation")
    return report
