"""Attention benchmark on CPU: the twins (``jax_core``, ``torch_core``) against each framework's own
attention (``*_peer``) and a plain matmul-softmax-matmul (``*_naive``), forward and
forward+backward (gradient of sum(output) w.r.t. q, k, v), causal and not; eager calls of
small attention modules (ours against Flax's and torch's own, ``*_module``); grouped-query
attention; and KV-cache decoding with the twin ``GroupedQueryAttention`` modules (a prefill and
one decode step, JAX against torch).

    attn-parity bench [--quick] [--out DIR] [--repeats N] [--budget S] [--only SECTION]
    (or python -m golden.bench ...)

Run it from the repository root: DIR defaults to bench/results under the current directory.
Writes DIR/latest.md (Markdown tables) and DIR/latest.json (every raw number), each atomically,
and prints the Markdown to stdout; progress goes to stderr. Nothing here sets environment
variables or thread counts: the run measures the machine as configured. To measure an older
instruction set on a newer CPU, set XLA_FLAGS=--xla_cpu_max_isa=AVX2, ATEN_CPU_CAPABILITY=avx2,
MKL_ENABLE_INSTRUCTIONS=AVX2, ONEDNN_MAX_CPU_ISA=AVX2 and NPY_DISABLE_CPU_FEATURES before the
run (ATEN_CPU_CAPABILITY caps only ATen's own kernels: torch's matrix products run in MKL and
oneDNN, which the other two cap; the run refuses the first without them: ``emulation_gap``);
every report (and --only section) opens with the CPU, its instruction set and the one XLA,
torch and NumPy each used.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from golden.bench.choice import choice_markdown, run_choice
from golden.bench.grid import FULL, QUICK
from golden.bench.host import cpu_flags, emulation_gap, machine, machine_markdown
from golden.bench.linear import linear_markdown, run_linear
from golden.bench.sparse import run_sparse, sparse_markdown
from golden.bench.modern import modern_markdown, run_modern
from golden.bench.positions import positions_markdown, run_positions
from golden.bench.modules import (
    decode_features_markdown,
    latent_decode_markdown,
    run_decode_features,
    run_latent_decode,
)
from golden.bench.report import markdown, run
from golden.bench.timing import MIN_REPEATS, _cpu_seconds, other_cpu
from golden.specification.fixture import write_atomic

__all__ = ["SECTIONS", "main"]


SECTIONS = {"modern": (run_modern, modern_markdown),  # --only: (run, markdown)
            "choice": (run_choice, choice_markdown),
            "decode_features": (run_decode_features, decode_features_markdown),
            "latent_decode": (run_latent_decode, latent_decode_markdown),
            "positions": (run_positions, positions_markdown),
            "linear": (run_linear, linear_markdown),
            "sparse": (run_sparse, sparse_markdown)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attn-parity bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny grid (for tests), seconds")
    parser.add_argument("--out", type=Path, default=Path("bench", "results"),
                        help="output directory (default: bench/results under the current "
                             "directory; run from the repository root)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="most steady calls per measurement (default 10, quick 3, at "
                             "least 3); slow cases use fewer, down to 3 (2 for a call of a "
                             "second or more)")
    parser.add_argument("--budget", type=float, default=None, metavar="S",
                        help="the attention grid's budget in seconds (default 300, quick 60): "
                             "a forward+backward block predicted to end the grid past it runs "
                             "at the least steady calls per row (never skipped)")
    parser.add_argument("--only", choices=tuple(SECTIONS), default=None,
                        help="run one section alone and print it, writing DIR/SECTION.json "
                             "(latest.* untouched): modern = attention sinks and chunked "
                             "attention; choice = implementation=None against each named "
                             "implementation at every float32 grid row; decode_features "
                             "= the decode step with each option of GroupedQueryAttention; "
                             "latent_decode = MultiHeadLatentAttention's decode step (plain, "
                             "absorbed) against GroupedQueryAttention's; positions = a "
                             "vision tower's layer with axial RoPE and a text tower's prefill "
                             "with MRoPE, each against 1-D RoPE, both twins; linear = the "
                             "gated delta rule's chunked cores against transformers' "
                             "torch_chunk_gated_delta_rule, forward, forward+backward, the "
                             "decode step and peak memory; sparse = the cores' sparse "
                             "implementation with a given selection (k = 2048 keys per row) "
                             "against dense causal attention at L = 8k to 64k, forward, "
                             "forward+backward, the decode step, the crossover length and "
                             "memory against L (positions, linear and sparse are not part of "
                             "the whole run)")
    args = parser.parse_args(argv)
    gap = emulation_gap(cpu_flags(), os.environ)
    if gap is not None:
        parser.error(gap)
    grid = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < MIN_REPEATS:
            parser.error(f"--repeats should be at least {MIN_REPEATS}, got {args.repeats}")
        grid = replace(grid, repeats=args.repeats)
    if args.budget is not None:
        if not args.budget >= 0:
            parser.error(f"--budget should be a time ≥ 0 s, got {args.budget}")
        grid = replace(grid, budget_s=args.budget)
    if args.only is not None:
        run_section, section_markdown = SECTIONS[args.only]
        info, cpu_start, start = machine(), _cpu_seconds(), time.perf_counter()
        rows = run_section(grid, np.random.default_rng())
        section = {"machine": info, "grid": asdict(grid), args.only: rows,
                   "other_cpu_pct": other_cpu(cpu_start, time.perf_counter() - start)}
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / f"{args.only}.json",
                     (json.dumps(section, indent=1) + "\n").encode())
        print("\n".join([machine_markdown(info)] + section_markdown(rows)))
        return 0
    report = run(grid)
    text = markdown(report)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "latest.json", (json.dumps(report, indent=1) + "\n").encode())
    write_atomic(args.out / "latest.md", text.encode())
    print(text, end="")
    return 0
