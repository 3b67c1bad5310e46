"""The Speed tables of docs/performance.md from `attn-parity bench` reports: two of the same
commit (one native, one with the other instruction set emulated: bench/README.md says how),
or one alone (a host's own run).

    python bench/isa_table.py bench/results/latest.json bench/results/avx2/latest.json
    python bench/isa_table.py bench/results/avx2_host/latest.json

Prints the Markdown table: every grid row and the grouped-query rows, each report's
`jax_core` and `torch_peer` medians, torch ÷ core and naive ÷ core (> 1: ours is faster), and
causal ÷ non-causal for `jax_core`'s forward. Nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _ms(x: float) -> str:
    return f"{x:.1f}" if x >= 100 else f"{x:.3g}"


def medians(report: dict) -> dict:
    """{(shape, dtype, causal, pass): {impl: median ms}} of the grid and the GQA rows."""
    out = {}
    for r in report["results"]:
        out.setdefault((r["shape"], r["dtype"], r["causal"], r["pass"]), {})[r["impl"]] = (
            r["median_ms"])
    for r in report.get("gqa", []):
        out.setdefault((r["shape"], "float32", r["causal"], "fwd"), {})[r["impl"]] = (
            r["median_ms"])
    return out


def label(machine: dict) -> str:
    return machine.get("xla_isa") or machine.get("cpu_isa") or "?"


def table(*reports: dict) -> str:
    found = [medians(r) for r in reports]
    a, names = found[0], [label(r["machine"]) for r in reports]
    head = ["shape", "dtype", "causal", "pass"]
    for n in names:
        head += [f"{n}: jax_core ms", "torch_peer ms", "torch ÷ core", "naive ÷ core",
                 "causal ÷ non-causal"]
    lines = ["| " + " | ".join(head) + " |",
             "| " + " | ".join(["---"] * 4 + ["---:"] * (len(head) - 4)) + " |"]
    for key in a:
        shape, dtype, causal, phase = key
        cells = [shape, dtype, "yes" if causal else "no", phase]
        for m in found:
            row = m.get(key, {})
            core, peer, naive = (row.get(i) for i in ("jax_core", "torch_peer", "jax_naive"))
            plain = m.get((shape, dtype, False, phase), {}).get("jax_core")
            cells += [_ms(core) if core else "—", _ms(peer) if peer else "—",
                      f"{peer / core:.2f}×" if core and peer else "—",
                      f"{naive / core:.2f}×" if core and naive else "—",
                      f"{core / plain:.2f}" if causal and core and plain else "—"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", type=Path, nargs="+", help="latest.json of each run")
    args = parser.parse_args(argv)
    print(table(*(json.loads(p.read_text()) for p in args.reports)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
