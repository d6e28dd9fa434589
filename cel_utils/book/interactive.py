"""Interactive (plotly) figures for the book, written so that the built site needs no network.

:class:`OfflineFigure` is what a notebook cell returns: its HTML holds the figure's data and one inline
``Plotly.newPlot`` call, but no ``<script src>``; the book serves plotly.js itself (:mod:`cel_utils.book.offline`).
The stage-1 heat map of a run (:func:`stage1_heatmap_figure`) is drawn from the run's JSON artifact only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cel_utils.book.plots import stage1_gains
from cel_utils.models.heads import parse_head
from cel_utils.pipeline.schema import RunArtifact

PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}
CLIP_QUANTILE = 0.05  # the heat map's most harmful 5% of heads share the darkest colour (their values stay in the hover)
# Diverging colours (ColorBrewer RdBu): red = the model is worse without the head, blue = better, white = no change.
HARMFUL, HARMFUL_LIGHT, NEUTRAL, HELPFUL_LIGHT, HELPFUL = "#b2182b", "#ef8a62", "#f7f7f7", "#67a9cf", "#2166ac"


@dataclass
class OfflineFigure:
    """A plotly figure as a notebook output: HTML for the book, with no plotly.js inside and nothing fetched. The book
    page loads plotly.js from the site; in a live Jupyter session, ``.figure.show()`` draws it with plotly's own
    renderer. (Plotly's JSON mime type is left out: myst-nb would warn about it, and warnings fail the build.)"""

    figure: object  # plotly.graph_objects.Figure
    post_script: str | None = None  # JavaScript run once the figure is drawn ({plot_id}: its div's id)

    def to_html(self) -> str:
        return self.figure.to_html(include_plotlyjs=False, include_mathjax=False, full_html=False, config=PLOTLY_CONFIG,
                                   post_script=self.post_script)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        return {"text/html": self.to_html(), "text/plain": repr(self)}

    def __repr__(self) -> str:  # the plain-text output; the figure's own repr would dump all of its data
        title = self.figure.layout.title.text or "figure"
        return f"<interactive figure: {title.split('<br>')[0]}>"


@dataclass(frozen=True)
class ColourLimits:
    """A diverging scale with white at zero and unequal ends: ``high`` is the largest gain (no positive value is ever
    clipped), ``low`` a robust lower end; ``clipped`` heads lie below it and are drawn in its colour."""

    low: float
    high: float
    clipped: int

    @property
    def zero_at(self) -> float:
        """Where zero (white) sits on the colour axis, as a fraction from ``low`` to ``high``."""
        return -self.low / (self.high - self.low)

    def colourscale(self) -> list:
        z = self.zero_at
        return [[0.0, HARMFUL], [z / 2, HARMFUL_LIGHT], [z, NEUTRAL], [z + (1 - z) / 2, HELPFUL_LIGHT], [1.0, HELPFUL]]


def colour_limits(gains: np.ndarray, step: float, quantile: float = CLIP_QUANTILE) -> ColourLimits:
    """Colour limits for stage-1 gains (points), where ``step`` is one discovery item in points.

    A scale symmetric around the largest absolute gain lets one head that breaks the model (-40 points) turn a
    +1-point head nearly white. Here each side has its own range: the positive side ends at the largest gain, so the
    best head is the deepest blue whatever the negative side does; the negative side ends at the ``quantile`` of all
    gains, so a few catastrophic heads do not wash out the rest either. Each side spans at least one item.
    """
    finite = np.asarray(gains, dtype=float)
    finite = finite[np.isfinite(finite)]
    if finite.size == 0:
        return ColourLimits(-step, step, 0)
    high = max(float(finite.max()), step)
    low = min(float(np.quantile(finite, quantile)), -step)
    return ColourLimits(low, high, int((finite < low).sum()))


def _stage1_fields(artifact: RunArtifact) -> tuple[np.ndarray, np.ndarray]:
    """Per head: (harm, help, accuracy in %) and a status text (pool rank, frozen, or not scored)."""
    geometry = artifact["model"]["geometry"]
    shape = (geometry["n_layers"], geometry["n_heads"])
    numbers = np.full(shape + (3,), np.nan)
    status = np.full(shape, "not scored exactly (screened out)", dtype=object)
    for score in artifact["stage1"]:
        if len(score["heads"]) == 1:
            head = parse_head(score["heads"][0])
            numbers[head.layer, head.head] = (score["harm"], score["help"], 100 * score["accuracy"])
            status[head.layer, head.head] = "not in the pool"
    for rank, name in enumerate(artifact["pool"], start=1):
        head = parse_head(name)
        status[head.layer, head.head] = f"pool rank {rank} of {len(artifact['pool'])}"
    for name in artifact["frozen"]["heads"]:
        head = parse_head(name)
        status[head.layer, head.head] += "; FROZEN"
    return numbers, status


def stage1_heatmap_figure(artifact: RunArtifact, quantile: float = CLIP_QUANTILE) -> OfflineFigure:
    """Every head's discovery gain when ablated alone (layers x query heads), interactive.

    Hover: head id, discovery gain, harm, help, accuracy and the head's place in the search. Pool heads carry their
    pool rank; the frozen set is outlined in black. Colours: :func:`colour_limits` (the clipping is stated on the
    colour bar).
    """
    import plotly.graph_objects as go

    gains = stage1_gains(artifact)
    n_layers, n_heads = gains.shape
    n_items = artifact["data"]["n_discovery"]
    limits = colour_limits(gains, 100.0 / n_items if n_items else 1.0, quantile)
    numbers, status = _stage1_fields(artifact)
    ids = np.array([[f"L{layer}.H{head}" for head in range(n_heads)] for layer in range(n_layers)], dtype=object)
    # The hover's numbers as text, so a head the screen passed over reads "not scored", not "+NaN points".
    detail = np.array([[f"discovery gain {gains[layer, head]:+.2f} points<br>harm {numbers[layer, head, 0]:.0f}, help "
                        f"{numbers[layer, head, 1]:.0f}<br>accuracy {numbers[layer, head, 2]:.1f}%"
                        if np.isfinite(gains[layer, head]) else "discovery gain: not scored"
                        for head in range(n_heads)] for layer in range(n_layers)], dtype=object)
    custom = np.dstack([ids, detail, status])
    ranks = {parse_head(name): str(rank) for rank, name in enumerate(artifact["pool"], start=1)}
    text = [[ranks.get(parse_head(f"L{layer}.H{head}"), "") for head in range(n_heads)] for layer in range(n_layers)]
    low_text = f"≤ {limits.low:+.1f}" if limits.clipped else f"{limits.low:+.1f}"
    figure = go.Figure(go.Heatmap(
        z=gains, x=list(range(n_heads)), y=list(range(n_layers)), customdata=custom, text=text,
        texttemplate="%{text}", textfont={"size": 10, "color": "black"},
        zmin=limits.low, zmax=limits.high, colorscale=limits.colourscale(), xgap=1, ygap=1,
        hovertemplate="<b>%{customdata[0]}</b><br>%{customdata[1]}<br>%{customdata[2]}<extra></extra>",
        colorbar={"title": {"text": "discovery gain<br>(points)"},
                  "tickvals": [limits.low, 0.0, limits.high], "ticktext": [low_text, "0", f"{limits.high:+.1f}"]},
    ))
    for name in artifact["frozen"]["heads"]:
        head = parse_head(name)
        figure.add_shape(type="rect", x0=head.head - 0.5, x1=head.head + 0.5, y0=head.layer - 0.5, y1=head.layer + 0.5,
                         line={"color": "black", "width": 3})
    clip_note = (f"{limits.clipped} head(s) below {limits.low:+.1f} drawn at that colour (exact values on hover)"
                 if limits.clipped else "no head clipped")
    figure.update_layout(
        title={"text": f"{artifact['model']['name']} on {artifact['task']['name']}: one head ablated at a time<br>"
                       f"<sup>numbers = pool rank, black box = frozen set {artifact['frozen']['label']}<br>"
                       f"{clip_note}</sup>", "font": {"size": 14}},
        xaxis={"title": "query head", "dtick": 1 if n_heads <= 16 else 2, "showgrid": False},
        yaxis={"title": "layer", "autorange": "reversed", "dtick": 1 if n_layers <= 16 else 2, "showgrid": False},
        plot_bgcolor="#d9d9d9",  # cells not scored (a screened stage 1) show as grey gaps
        height=max(340, 18 * n_layers + 180), width=max(560, 34 * n_heads + 260),
        margin={"l": 60, "r": 20, "t": 100, "b": 50},
    )
    return OfflineFigure(figure)
