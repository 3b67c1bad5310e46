"""How the benchmark's tables write a number: ``_f`` (formatted, or — where there is none) and
``_ms`` (milliseconds to three significant figures). Every section's Markdown uses them."""

from __future__ import annotations


def _f(x, fmt="{:.2f}"):
    return "—" if x is None else fmt.format(x)


def _ms(x: float) -> str:
    """Milliseconds to three significant figures or more (12.3, 1.23, 0.123; 1234)."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"
