"""Checks of one setting's value that the variants' descriptions share (each an ``Arg``'s
check: ``check(name, value)``, a ValueError naming the argument and the value)."""

from __future__ import annotations

from golden.specification.validate import check_positive_or_none


def positive(name, n) -> None:
    """An int > 0."""
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"{name} should be a positive int, got {n!r}")


def positive_or_none(name, n) -> None:
    if n is not None:
        positive(name, n)


def epsilon(name, eps) -> None:
    """A finite number > 0 (None is not one)."""
    try:
        check_positive_or_none(name, float("nan") if eps is None else eps)
    except ValueError:
        raise ValueError(f"{name} should be a positive number, got {eps!r}") from None
