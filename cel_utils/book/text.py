"""Numbers and tables as text, the same on every page and in the terminal.

Accuracies are printed in percent with one decimal; a holdout cell reads ``full -> ablated (gain)``, e.g.
``50.0 -> 75.0 (+25.0)``, and the relative error reduction is gain / (100 - full), e.g. ``50.0%``.
"""
from __future__ import annotations

import math

import pandas as pd


def pct(fraction: float) -> str:
    """0.5 -> '50.0'."""
    return "n/a" if fraction is None or math.isnan(fraction) else f"{tidy(100 * fraction):.1f}"


def tidy(value: float) -> float:
    """Drop float noise before rounding for display, so 40.0 - 43.75 computed as -3.7499999... prints as -3.8,
    like the difference of the printed accuracies."""
    return round(value, 9)


def transition_text(full: float, ablated: float, gain_points: float | None = None) -> str:
    """Accuracies as fractions -> ``'50.0 -> 75.0 (+25.0)'`` (gain in points)."""
    if gain_points is None:
        gain_points = 100 * (ablated - full)
    return f"{pct(full)} -> {pct(ablated)} ({tidy(gain_points):+.1f})"


def rer_text(value: float | None) -> str:
    """Relative error reduction in percent -> ``'50.0%'``; NaN (full model already at 100%) -> ``'n/a'``."""
    return "n/a" if value is None or math.isnan(value) else f"{value:.1f}%"


def p_text(p: float | None) -> str:
    """0.0312 -> '0.031'; tiny values -> '<0.001'; missing -> 'n/a'."""
    if p is None or math.isnan(p):
        return "n/a"
    return "<0.001" if p < 0.001 else f"{p:.3f}" if p < 0.1 else f"{p:.2f}"


def p_is(p: float | None) -> str:
    """``'p = 0.031'``, ``'p < 0.001'`` (not ``'p = <0.001'``)."""
    text = p_text(p)
    return f"p < {text[1:]}" if text.startswith("<") else f"p = {text}"


def ordinal(x: float) -> str:
    """62.5 -> '62nd', 1 -> '1st', 11 -> '11th', 100 -> '100th' (rounded to a whole number)."""
    n = round(x)
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def ci_text(sig: dict | None) -> str:
    """``'95% CI [-3.1, +8.0], p = 0.031'`` (McNemar); empty when there is no test."""
    if not sig:
        return ""
    level = round(100 * sig["confidence"])
    return f"{level}% CI [{sig['ci_low']:+.1f}, {sig['ci_high']:+.1f}], {p_is(sig['p_value'])}"


def provenance_text(data: dict) -> str:
    """Where a run's items came from, in a few words: hub, mirror or generated, and any fallback."""
    text = data.get("source", "unknown")
    if "fallback" in data:
        text += " (no train split: discovery drawn from validation)"
    return text


def clip(text: str, limit: int, tail: bool = False) -> str:
    text = str(text)
    if len(text) <= limit:
        return text
    return "..." + text[-limit:] if tail else text[:limit] + "..."


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; ``|`` inside a cell is escaped. A row as wide as the header or an error: Markdown would
    silently drop the extra cells or shift them under the wrong heading."""
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a table row has {len(row)} cells for {len(header)} columns {header}: {row}")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def styled(table: pd.DataFrame, monospace: bool = False, index: bool = True):
    """A table for display without pandas' truncation of long text: left-aligned, line breaks kept, escaped."""
    style = {"white-space": "pre-wrap", "text-align": "left", "vertical-align": "top"}
    if monospace:
        style.update({"font-family": "monospace", "font-size": "0.8em"})
    styler = table.style.format(escape="html").set_properties(**style)
    return styler if index else styler.hide(axis="index")
