"""Every run in one figure, for the top of the results page (and a small copy on the intro).

Left, one row per run: the holdout gain (dot) with its family-adjusted interval (thick bar) and its interval alone
(thin bar), the discovery gain of the same set (open diamond: its distance to the dot is the winner's curse), the
random head sets' range on the holdout (grey band), the calibration baseline's gain (cross, multiple choice) and the
mean-ablation control's gain (square). A run whose full model is at its floor says so in its label. Right, on an axis
of its own, the paper's Table 1 gains for the same tasks: other models (3B, full precision) and other sizes, so they
are not drawn on our runs' axis as if they were comparable. Hover shows the numbers; a click on a run opens its page.
Drawn from the artifacts only (the results page's summary), offline like every figure of the book.
"""
from __future__ import annotations

import json
import math

import pandas as pd

from cel_utils.book.interactive import HARMFUL, HELPFUL, OfflineFigure
from cel_utils.book.run_page import significance
from cel_utils.presets import TASK_FAMILIES, task_family
from cel_utils.pipeline.schema import RunArtifact

GREY, DARK = "#bdbdbd", "#424242"
FIGURE_ID = "cel-all-runs"


def _row_label(run) -> str:
    return f"{run.model} · {run.task}" + (" (at floor)" if run.at_floor else "")


def overview_figure(table: pd.DataFrame, artifacts: dict[str, RunArtifact], paper_rows: list[dict],
                    link_prefix: str = "runs/", small: bool = False) -> OfflineFigure:
    """``table``: :func:`cel_utils.book.results_page.summarize`'s rows; ``artifacts``: each run's artifact by its stem
    (for the discovery gain, the random sets and the baselines)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    runs = list(table.itertuples())[::-1]  # plotly draws the first category at the bottom: keep the table's order
    labels = [_row_label(r) for r in runs]
    urls = [f"{link_prefix}{r.stem}.html" if r.page else "" for r in runs]
    figure = make_subplots(rows=1, cols=2, column_widths=[0.7, 0.3], horizontal_spacing=0.12,
                           subplot_titles=("this book: holdout gain (points)", "paper, 3B: gain"))
    figure.update_annotations(font={"size": 12})  # the subplot titles: each fits over its own panel at 700 px

    def series(name: str, xs: list, **style) -> None:
        hover = [_hover(r, artifacts[r.stem]) for r in runs]
        figure.add_trace(go.Scatter(x=xs, y=labels, name=name, customdata=[[u, h] for u, h in zip(urls, hover)],
                                    hovertemplate="%{customdata[1]}<extra></extra>", **style), row=1, col=1)

    rel = [artifacts[r.stem]["reliability"] or {} for r in runs]
    nulls = [x.get("null") for x in rel]
    for r, null, label in zip(runs, nulls, labels):  # the random sets' range, one band per run
        if null:
            q = null["quantiles"]
            figure.add_trace(go.Scatter(x=[q["min"], q["max"]], y=[label, label], mode="lines", hoverinfo="skip",
                                        line={"color": GREY, "width": 10}, opacity=0.6, showlegend=False),
                             row=1, col=1)
    if any(nulls):
        figure.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line={"color": GREY, "width": 10},
                                    name="random sets (range)"), row=1, col=1)
    adjusted = [r.family or {} for r in runs]
    series("holdout gain, adjusted CI", [r.gain_points for r in runs], mode="markers",
           marker={"size": 11, "color": [HELPFUL if r.gain_points > 0 else HARMFUL for r in runs]},
           error_x={"type": "data", "symmetric": False, "thickness": 3, "width": 0,
                    "array": [a.get("ci_high", r.gain_points) - r.gain_points for r, a in zip(runs, adjusted)],
                    "arrayminus": [r.gain_points - a.get("ci_low", r.gain_points) for r, a in zip(runs, adjusted)]})
    sig = [significance(artifacts[r.stem]) for r in runs]
    series("95% interval alone", [r.gain_points for r in runs], mode="markers", marker={"size": 1, "color": DARK},
           error_x={"type": "data", "symmetric": False, "thickness": 1.2, "width": 6, "color": DARK,
                    "array": [(s or {}).get("ci_high", r.gain_points) - r.gain_points for r, s in zip(runs, sig)],
                    "arrayminus": [r.gain_points - (s or {}).get("ci_low", r.gain_points) for r, s in zip(runs, sig)]})
    curse = [x.get("winners_curse") for x in rel]
    series("discovery gain", [c["discovery_gain_points"] if c else None for c in curse],
           mode="markers", marker={"symbol": "diamond-open", "size": 10, "color": DARK})
    calibration = [x.get("calibration") for x in rel]
    if any(c and c.get("n_groups") != 1 for c in calibration):
        series("calibration baseline", [c["holdout_gain_points"] if c and c.get("n_groups") != 1 else None
                                        for c in calibration],
               mode="markers", marker={"symbol": "x", "size": 9, "color": "#7b3294"})
    if any(r.control_gain is not None for r in runs):
        series("mean-ablated", [r.control_gain for r in runs], mode="markers",
               marker={"symbol": "square-open", "size": 9, "color": "#e66101"})
    figure.add_vline(x=0, line={"color": DARK, "width": 1}, row=1, col=1)
    families = [f for f in TASK_FAMILIES if any(task_family(r.task) == f for r in runs)
                or any(p["task"] == f for p in paper_rows)]
    for model in dict.fromkeys(p["model"] for p in paper_rows):
        rows = [p for p in paper_rows if p["model"] == model and p["task"] in families]
        figure.add_trace(go.Scatter(x=[float(p["gain_points"]) for p in rows], y=[p["task"] for p in rows],
                                    mode="markers", name=f"paper: {model}", marker={"size": 9, "symbol": "circle"},
                                    hovertemplate=f"{model} on %{{y}}: %{{x:+.2f}} points<extra></extra>"),
                         row=1, col=2)
    # Rows in the table's order, top down (a categorical axis otherwise orders by first appearance across traces, and
    # the random-set bands come first, only for runs that have them).
    figure.update_yaxes(categoryorder="array", categoryarray=labels, row=1, col=1)
    figure.update_yaxes(categoryorder="array", categoryarray=families[::-1], row=1, col=2)
    figure.update_xaxes(zeroline=True, row=1, col=2)
    # The plot area gets a fixed height per run; the legend below it, two entries to a line, gets its own pixels.
    entries = sum(trace.showlegend is not False for trace in figure.data)
    legend_px = 0 if small else 22 * math.ceil(entries / 2)
    plot_px = (22 if small else 30) * max(len(runs), 4)
    height = 100 + plot_px + legend_px
    figure.update_layout(height=height, width=None if not small else 760,
                         margin={"l": 10, "r": 10, "t": 60, "b": 40 + legend_px},
                         legend={"orientation": "h", "y": -30 / plot_px if not small else -0.25,
                                 "yanchor": "top", "entrywidth": 0.5, "entrywidthmode": "fraction",
                                 "font": {"size": 11}},
                         title={"text": "Every run at once" + ("" if small else
                                " <sup>(click a run for its page)</sup>"), "font": {"size": 15}},
                         showlegend=not small)
    return OfflineFigure(figure, post_script=_CLICK.replace("ID", FIGURE_ID))


def _hover(run, artifact: RunArtifact) -> str:
    adjusted = run.family or {}
    lines = [f"<b>{run.model} on {run.task}</b>", f"full -> ablated {run.holdout} ({run.heads})",
             f"floor {run.floor_text}" + (": the full model is at its floor" if run.at_floor else ""),
             f"p = {run.p_value:.2g} alone" + (f", Holm p = {adjusted['p_adjusted']:.2g} among {adjusted['m']}"
                                               if adjusted else ""),
             f"family-adjusted CI [{adjusted.get('ci_low', float('nan')):+.1f}, {adjusted.get('ci_high', float('nan')):+.1f}]",
             f"verdict: {run.word}"]
    if run.control_gain is not None:
        lines.append(f"mean-ablated: {run.control_gain:+.1f} points")
    curse = (artifact["reliability"] or {}).get("winners_curse")
    if curse:
        lines.append(f"discovery gain {curse['discovery_gain_points']:+.1f} (winner's curse)")
    return "<br>".join(lines)


# A click on a run's marker opens its page (customdata[0]: the page's address, empty for a run without a page).
_CLICK = """
var plot = document.getElementById('{plot_id}');
plot.setAttribute('data-figure', 'ID');
plot.on('plotly_click', function (event) {
  var url = event.points[0].customdata && event.points[0].customdata[0];
  if (url) { window.location.href = url; }
});
"""


def figure_json(figure: OfflineFigure) -> str:
    """The figure's data as JSON (tests read the numbers back)."""
    return json.dumps(figure.figure.to_plotly_json(), default=str)
