"""What ``attn-parity device-check`` does, decided before JAX or torch is imported: the phases
and their time caps (``PHASES``, ``CAPS_S``), the files (``FILES``), the timing grid
(``TimingGrid``, ``FULL``, ``QUICK``) and its cells, the FLOP count of a cell (``flops``), the
memory a cell needs (``memory_bytes``) and the rule that skips it (``memory_skip``), the
dry-run listing (``dry_run``) and the command's options (``add_arguments``).

Shape legend: B batch, H heads (query and key-value alike), L sequence length (Lq = Lk), D head
width (Dk = Dv).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["PHASES", "FILES", "TEST_FILES", "DEFAULT_BUDGET_S", "CAPS_S", "SLOW_COMPILE",
           "MEMORY_FRACTION",
           "FLOPS_CONVENTION", "Impl", "IMPLS", "Cell", "TimingGrid", "FULL", "QUICK", "flops",
           "memory_kind", "memory_bytes", "memory_skip", "gib", "check_command", "tests_command",
           "dry_run", "add_arguments"]

PHASES = ("check", "tests", "timing")
# Every file a run writes, none in a subfolder: {name: the phase that writes it (None: every run)}
FILES = {"env.json": None, "progress.log": None,
         "check_jax.json": "check", "check_jax.txt": "check",
         "tests.xml": "tests", "tests.log": "tests",
         "timing.json": "timing", "timing.md": "timing"}
# The tests that need a GPU or are about one: tests/test_accelerators.py holds the accelerator
# implementations' tests and the only test skipped off a GPU (tests/test_device_check.py checks
# that no other file of tests/ skips on the backend).
TEST_FILES = ("tests/test_accelerators.py",)
# --budget: the whole run's wall time. "check" and "tests" run side by side (separate
# processes, each mostly compiling on the CPU), each stopped at its cap; "timing" takes what is
# left of the budget, its cells past the end skipped (recorded). Measured on an H200
# (bench/results/h200-2026-11-27): the check over every fixture about 250 s (120 s reached 93
# of 168 fixtures), the tests 49 s, the timing grid about 215 s without explicit's slow
# backward compiles (SLOW_COMPILE): 7.5 minutes in all, within the 8 a loan allows.
DEFAULT_BUDGET_S = 460.0
CAPS_S = {"check": 270.0, "tests": 90.0}
# (implementation, with backward) -> the shortest L whose cell is skipped for its compile time:
# explicit's forward+backward compiled for 102 s at L = 4096 causal (11 s full) on an H200, a
# quarter of the budget for one cell whose speed the L = 1024 row already shows.
SLOW_COMPILE = {("explicit", True): 4096}
# A cell is skipped when its memory estimate is above this share of the free memory.
MEMORY_FRACTION = 0.9
FLOPS_CONVENTION = ("4·B·H·L²·D for the forward (two (L, L, D) products of 2 FLOPs a "
                    "multiply-add), halved when causal; forward+backward 3.5× the forward (the "
                    "backward's five such products against the forward's two: 1 + 2.5)")


class Impl(NamedTuple):
    """One timed implementation: ``framework`` "jax" (our core, ``name`` its implementation,
    None for the automatic choice), "jax.nn" (``jax.nn.dot_product_attention``'s own
    ``implementation``) or "torch" (``scaled_dot_product_attention`` under ``sdpa_kernel`` of
    the back end ``name``)."""

    framework: str
    name: str | None

    @property
    def label(self) -> str:
        return f"{self.framework} {self.name}"


# The JAX core's named implementations are jax_attn.IMPLEMENTATIONS.names (a test checks they
# are all here); None first, the baseline of every group.
IMPLS = (Impl("jax", None), Impl("jax", "explicit"), Impl("jax", "blockwise"),
         Impl("jax", "cudnn"), Impl("jax", "pallas"), Impl("jax", "splash"),
         Impl("jax.nn", "cudnn"),
         Impl("torch", "flash"), Impl("torch", "cudnn"))


class Cell(NamedTuple):
    """One timing: length, causal or not, forward or forward+backward, implementation."""

    length: int
    causal: bool
    backward: bool
    impl: Impl

    @property
    def pass_name(self) -> str:
        return "fwd+bwd" if self.backward else "fwd"

    @property
    def label(self) -> str:
        return (f"L={self.length} {'causal' if self.causal else 'full'} {self.pass_name} "
                f"{self.impl.label}")


@dataclass(frozen=True)
class TimingGrid:
    """The timing phase's sizes: (B, H, L, D) inputs of ``dtype``, each length, forward and
    forward+backward, full and causal, each implementation; ``steady_s``: about this much
    time of steady calls per cell (less when the budget runs short)."""

    batch: int
    heads: int
    width: int
    lengths: tuple[int, ...]
    dtype: str = "bfloat16"
    impls: tuple[Impl, ...] = IMPLS
    steady_s: float = 0.5

    def cells(self) -> list[Cell]:
        """Lengths shortest first; per length forward then forward+backward, full then causal,
        and the implementations in order (None first: the baseline of its group)."""
        return [Cell(length, causal, backward, impl) for length in self.lengths
                for backward in (False, True) for causal in (False, True) for impl in self.impls]

    @property
    def shape(self) -> str:
        return f"B={self.batch},H={self.heads},D={self.width},{self.dtype}"


FULL = TimingGrid(batch=4, heads=16, width=128, lengths=(1024, 4096, 16384))
QUICK = TimingGrid(batch=4, heads=16, width=128, lengths=(1024,), steady_s=0.25)


def flops(batch, heads, length, width, *, causal: bool, backward: bool) -> float:
    """FLOPs of one call (FLOPS_CONVENTION, the convention of golden.bench.grid.Shape.flops):
    4·B·H·L²·D forward, halved when causal, 3.5× for forward+backward."""
    forward = 4 * batch * heads * length * length * width / (2 if causal else 1)
    return forward * (3.5 if backward else 1.0)


def memory_kind(name: str | None) -> str:
    """How an implementation's memory grows: "quadratic" (explicit forms the (L, L) scores),
    "blocks" (blockwise: (L, D) arrays and a few (Bq, Bk) blocks), "linear" (the fused
    kernels: cuDNN, Pallas, jax.nn's cuDNN, torch's flash and cuDNN back ends)."""
    return {"explicit": "quadratic", "blockwise": "blocks"}.get(name, "linear")


def memory_bytes(name, batch, heads, length, width, *, backward: bool, itemsize: int = 2,
                 block: int = 1024) -> int:
    """An upper estimate of the device memory a call of implementation ``name`` needs: q, k, v
    and the output (and for forward+backward their gradients and the output's cotangent) at
    ``itemsize`` bytes; for "explicit" two float32 (B, H, L, L) arrays forward (scores and
    weights), four forward+backward (their derivatives), causal or not (its tiles save a part
    only); for "blockwise" three float32 (B, H, Bq, Bk) blocks of at most ``block``."""
    rows = batch * heads * length * width  # elements of one (B, H, L, D) array
    total = rows * itemsize * (8 if backward else 4)
    kind = memory_kind(name)
    if kind == "quadratic":
        total += batch * heads * length * length * 4 * (4 if backward else 2)
    elif kind == "blocks":
        total += batch * heads * min(length, block) ** 2 * 4 * 3
    return total


def gib(n: float) -> float:
    return n / 2**30


def memory_skip(needed: int, free: int | None, fraction: float = MEMORY_FRACTION) -> str | None:
    """Why a cell needing ``needed`` bytes is skipped with ``free`` bytes free (None: run it;
    ``free`` None, unknown: run it)."""
    if free is None or needed <= fraction * free:
        return None
    return (f"needs about {gib(needed):.1f} GiB (estimate), more than {fraction:.0%} of the "
            f"{gib(free):.1f} GiB free")


def check_command(python: str, out) -> list[str]:
    """Phase "check": the JAX twin over every golden fixture, as ``attn-parity check`` runs it
    (precision HIGHEST, the exact tolerance profile, the regeneration check), its JSON report in
    ``out``; the table goes to check_jax.txt."""
    return [python, "-m", "golden.cli", "check", "--framework", "jax", "--json",
            str(out / "check_jax.json")]


def tests_command(python: str, out) -> list[str]:
    """Phase "tests": TEST_FILES under pytest, JUnit XML into ``out``; the output goes to
    tests.log."""
    return [python, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "--junitxml",
            str(out / "tests.xml"), *TEST_FILES]


def dry_run(phases, grid: TimingGrid, out, budget_s: float, python: str = "python3") -> list[str]:
    """The lines ``--dry-run`` prints: each phase with its command or cells, the files, the
    budget."""
    lines = [f"attn-parity device-check: dry run (nothing runs); budget {budget_s:.0f} s, "
             f"output in {out}/"]
    for phase in phases:
        if phase in ("check", "tests"):
            command = (check_command if phase == "check" else tests_command)(python, out)
            redirect = "check_jax.txt" if phase == "check" else "tests.log"
            lines.append(f"phase {phase} (a subprocess beside the other, stopped at "
                         f"{CAPS_S[phase]:.0f} s): {' '.join(command)} > {out}/{redirect}")
        else:
            cells = grid.cells()
            lines.append(f"phase timing (this process, what is left of the budget): {grid.shape}"
                         f", L in {', '.join(map(str, grid.lengths))}: {len(cells)} cells")
            lines.append(f"  (a cell is skipped, with its reason, when its memory estimate is "
                         f"above {MEMORY_FRACTION:.0%} of the free device memory or the budget "
                         f"is spent; refused by the registry: its reason)")
            lines += [f"  {cell.label:40} {_memory_note(cell, grid)}" for cell in cells]
    names = [name for name, phase in FILES.items() if phase is None or phase in phases]
    lines.append(f"files: {', '.join(names)}")
    return lines


def _memory_note(cell: Cell, grid: TimingGrid) -> str:
    if cell.impl.framework == "jax" and cell.impl.name is None:
        return "memory: its choice's"
    needed = memory_bytes(cell.impl.name, grid.batch, grid.heads, cell.length, grid.width,
                          backward=cell.backward)
    return f"memory ≤ {gib(needed):.1f} GiB"


def _budget(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"should be a number of seconds, got {text!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"should be a time > 0 s, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``attn-parity device-check``."""
    parser.add_argument("--out", default="bench/results/device", metavar="DIR",
                        help="where the files go, made if missing (default: "
                             "bench/results/device; bench/device_check.sh: $OUT)")
    parser.add_argument("--dry-run", action="store_true",
                        help="list every phase, command and timing cell, and exit 0 (on any "
                             "machine: no GPU needed, nothing imported or written)")
    parser.add_argument("--only", action="append", choices=PHASES, default=[],
                        help="run only this phase (repeatable; default: all three)")
    parser.add_argument("--quick", action="store_true",
                        help=f"the smallest timing grid (L = {QUICK.lengths[0]} only), for a "
                             "rerun")
    parser.add_argument("--budget", type=_budget, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                        help=f"the run's wall time (default {DEFAULT_BUDGET_S:.0f}): check and "
                             f"tests side by side, each stopped at "
                             f"{CAPS_S['check']:.0f} s or the budget, then timing in what is "
                             "left, cells past it skipped")
