"""The search strategies' tables (``python -m cel_utils strategies``), from their JSON summaries."""
from __future__ import annotations

import math

import pandas as pd

from cel_utils.book.text import md_table, p_text


def strategies_table(payload: dict) -> pd.DataFrame:
    """One row per strategy: its set, discovery and holdout gains (with the paired test), and its cost."""
    rows = payload["strategies"]
    reference = next((r["forward_equivalents"] for r in rows if r["strategy"].startswith("exhaustive")), None)
    return pd.DataFrame({
        "strategy": [r["strategy"] for r in rows],
        "heads": [r["label"] for r in rows],
        "discovery gain": [f"{r['discovery_gain_points']:+.1f}" for r in rows],
        "holdout gain": [f"{r['holdout_gain_points']:+.1f}" for r in rows],
        "holdout 95% CI": [f"[{r['holdout_ci'][0]:+.1f}, {r['holdout_ci'][1]:+.1f}]" for r in rows],
        "McNemar p": [p_text(r["holdout_p_value"]) for r in rows],
        "evaluations": [r["evaluations"] for r in rows],
        "forward-pass equivalents": [round(r["forward_equivalents"]) for r in rows],
        "cost vs exhaustive": [f"{r['forward_equivalents'] / reference:.2f}x" if reference else "n/a" for r in rows],
    }).set_index("strategy")


def screening_text(payload: dict) -> str:
    """Markdown: how well attribution patching predicts exact single-head screening."""
    sc = payload.get("screening")
    if not sc:
        return f"Attribution patching: {payload.get('attribution_skipped') or 'not run'}."
    def rho(value: float) -> str:
        return "n/a (one side constant)" if value is None or math.isnan(value) else f"{value:.2f}"

    return (f"Attribution patching against exact screening of all {len(sc['estimate']) * len(sc['estimate'][0])} heads: "
            f"rank correlation with the exact effect on the margin, Spearman **{rho(sc['spearman_margin'])}** "
            f"(Kendall {rho(sc['kendall_margin'])}); with the exact accuracy gain, Spearman **{rho(sc['spearman_gain'])}** "
            f"(Kendall {rho(sc['kendall_gain'])}); it recovers **{100 * sc['recall_at_p']:.0f}%** of the exact top "
            f"{sc['p']} (the pool). Its margins of the full model differ from the evaluator's by at most "
            f"{sc['full_margin_max_abs_difference']:.1e}.")


def strategies_section(payloads: list[dict], sort_key) -> list[str]:
    if not payloads:
        return []
    out = ["## Search strategies", "",
           "The paper's exhaustive search within a pool of the top *p* single heads, next to greedy forward selection "
           "and beam search over all heads and to attribution patching (a first-order estimate of every head's effect "
           "from one backward pass), on the same items; gains in points, cost in forward passes of the full model over "
           "one discovery item (see [beyond the paper](beyond.md)). Made by `python -m cel_utils strategies`.", ""]
    for payload in sorted(payloads, key=lambda q: (sort_key(q["task"]["name"]), q["model"]["name"], q["config"]["seed"])):
        table = strategies_table(payload).reset_index()
        out += [f"### {payload['model']['name']} on {payload['task']['name']} (seed {payload['config']['seed']}, "
                f"{payload['n_discovery']} discovery / {payload['n_holdout']} holdout items, p={payload['config']['p']}, "
                f"k={payload['config']['k']}, beam width {payload['beam_width']})", "",
                md_table(list(table.columns), [[str(v) for v in row] for row in table.itertuples(index=False)]), "",
                screening_text(payload), ""]
    return out


