"""The one check of an integer argument, with the one wording of its error, for settings and plain arguments alike."""
from __future__ import annotations

from typing import Any


def check_int(name: str, value: Any, minimum: int | None = 1, *, optional: bool = False, why: str = "") -> Any:
    """``value`` if it is an integer (not a bool) of at least ``minimum`` (or None when ``optional``), else a
    ValueError that names the argument, what it must be and what it got; ``why`` is appended, e.g. what None means."""
    if value is None and optional:
        return value
    import numbers

    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and (minimum is None or value >= minimum):
        return value
    word = ("a positive integer" if minimum == 1 else "a non-negative integer" if minimum == 0
            else "an integer" if minimum is None else f"an integer >= {minimum}")
    raise ValueError(f"{name} must be {word}{' or None' if optional else ''}, got {value!r}{why}")
