"""The transfer matrices on the results page: per model a heat map a reader can hover, a table, and sentences generated
from the numbers on which frozen sets help one task while hurting another (cel_utils.pipeline.transfer computes them).

The words follow the cells' paired tests, adjusted for the matrix's off-diagonal cells as one family
(:func:`cel_utils.book.claims.transfer_family`, Holm): a set "helps" or "hurts" another task only where its adjusted
p is below the verdicts' level. "Not shown to hurt" is not a finding; instead each off-diagonal cell says what harm it
rules out against a margin fixed before the data (:data:`cel_utils.stats.multiplicity.MARGIN_POINTS`): harm larger
than the margin is ruled out where the family-adjusted one-sided lower bound of the gain clears minus the margin, and
otherwise the cell says up to how much harm it leaves open. The diagonal is each run's own result, which the verdicts
above adjust among the runs.
"""
from __future__ import annotations

import numpy as np

from cel_utils.book.interactive import HARMFUL, HARMFUL_LIGHT, HELPFUL, HELPFUL_LIGHT, NEUTRAL, OfflineFigure
from cel_utils.book.text import md_table, p_is, pct
from cel_utils.pipeline.schema import TransferArtifact
from cel_utils.stats.multiplicity import MARGIN_POINTS
from cel_utils.stats.power import ALPHA

ANCHOR = "transfer-matrix"  # the section's label: book/theory.md links to it


def _family(transfer: TransferArtifact) -> dict:
    from cel_utils.book.claims import transfer_family

    return transfer_family(transfer)


def _significant(cell: dict, family: dict) -> bool:
    """Off the diagonal: significant after Holm's adjustment within the matrix; on it: the run's own test alone (the
    verdicts adjust it among the runs)."""
    if cell["diagonal"]:
        return cell["verdict"]["kind"] in ("gain", "loss")
    return family[cell["source"], cell["target"]]["adjusted"]["p_adjusted"] <= ALPHA


def _items_text(cell: dict) -> str:
    n, total = cell["n_items"], cell["n_holdout"]
    return f"{n} items" if n == total else f"{n} of {total} items (seeded subset)"


def harm_text(cell: dict, family: dict) -> str:
    """Non-inferiority in words: ``harm > m ruled out`` or ``harm up to X not ruled out``."""
    found = family[cell["source"], cell["target"]]["noninferiority"]
    if found["harm_ruled_out"]:
        return f"harm > {found['margin_points']:g} ruled out"
    return f"harm up to {found['harm_not_ruled_out_points']:.1f} not ruled out"


def cell_text(cell: dict, family: dict) -> str:
    """A table cell: ``full -> ablated (gain), [low, high], p`` (off the diagonal: the family-adjusted interval, Holm's
    p and what harm it rules out); a marker for a significant change."""
    sig = cell["significance"]
    mark = " **\\***" if _significant(cell, family) else ""
    head = f"{pct(cell['full_accuracy'])} -> {pct(cell['ablated_accuracy'])} ({cell['gain_points']:+.1f})"
    if cell["diagonal"]:
        return f"{head}, [{sig['ci_low']:+.1f}, {sig['ci_high']:+.1f}], {p_is(sig['p_value'])} (the run){mark}"
    adjusted = family[cell["source"], cell["target"]]["adjusted"]
    return (f"{head}, [{adjusted['ci_low']:+.1f}, {adjusted['ci_high']:+.1f}], Holm {p_is(adjusted['p_adjusted'])}; "
            f"{harm_text(cell, family)}{mark}")


def hover_text(cell: dict, metric: str, family: dict) -> str:
    sig, power = cell["significance"], cell["power"]
    mdg = power["min_detectable_gain_points"]
    design = ("no change detectable at this discordance" if mdg is None
              else f"detects {mdg:.1f} points with {100 * power['power']:.0f}% power")
    role = "its own holdout (the run's result)" if cell["diagonal"] else "another task's holdout"
    text = (f"<b>set from {cell['source']} ({cell['heads_label']}) on {cell['target']}</b><br>{role}, {metric}<br>"
            f"{pct(cell['full_accuracy'])} -> {pct(cell['ablated_accuracy'])} ({cell['gain_points']:+.1f} points)<br>"
            f"95% CI [{sig['ci_low']:+.1f}, {sig['ci_high']:+.1f}], McNemar {p_is(sig['p_value'])} alone<br>")
    if not cell["diagonal"]:
        adjusted = family[cell["source"], cell["target"]]["adjusted"]
        text += (f"among the matrix's {adjusted['m']} cells: Holm {p_is(adjusted['p_adjusted'])}, "
                 f"{100 * adjusted['confidence']:.1f}% CI [{adjusted['ci_low']:+.1f}, {adjusted['ci_high']:+.1f}]"
                 f"<br>{harm_text(cell, family)} points<br>")
    return text + f"helped {cell['help']}, harmed {cell['harm']} of {_items_text(cell)}<br>{design}"


def transfer_heatmap_figure(transfer: TransferArtifact) -> OfflineFigure:
    """Rows: the task a set was found on; columns: the task it is scored on; colour: the gain in points (blue helps,
    red hurts, white none, one scale symmetric about zero); the diagonal (each run's own result) is outlined, and a
    cell's text carries * where its paired test is significant."""
    import plotly.graph_objects as go

    from cel_utils.pipeline.transfer import matrix

    tasks = transfer["tasks"]
    gains = matrix(transfer)
    cells = {(c["source"], c["target"]): c for c in transfer["cells"]}
    family = _family(transfer)
    hover = [[hover_text(cells[s, t], transfer["metrics"][t], family) for t in tasks] for s in tasks]
    text = [[f"{cells[s, t]['gain_points']:+.1f}{'*' if _significant(cells[s, t], family) else ''}" for t in tasks]
            for s in tasks]
    reach = max(float(np.nanmax(np.abs(gains))), 1.0)
    figure = go.Figure(go.Heatmap(
        z=gains, x=tasks, y=tasks, customdata=hover, text=text, texttemplate="%{text}",
        textfont={"size": 13, "color": "black"}, zmin=-reach, zmax=reach, xgap=2, ygap=2,
        colorscale=[[0.0, HARMFUL], [0.25, HARMFUL_LIGHT], [0.5, NEUTRAL], [0.75, HELPFUL_LIGHT], [1.0, HELPFUL]],
        hovertemplate="%{customdata}<extra></extra>", colorbar={"title": {"text": "gain<br>(points)"}}))
    for i in range(len(tasks)):
        figure.add_shape(type="rect", x0=i - 0.5, x1=i + 0.5, y0=i - 0.5, y1=i + 0.5, line={"color": "black", "width": 2})
    figure.update_layout(
        title={"text": f"{transfer['model']['name']}: each frozen set on every task's holdout (seed {transfer['seed']})"
                       "<br><sup>row = found on, column = tested on; * = significant (exact McNemar, Holm-adjusted "
                       f"p ≤ {ALPHA:g} off the diagonal); outlined = the run's own result</sup>", "font": {"size": 14}},
        xaxis={"title": "tested on (holdout)", "side": "bottom"}, yaxis={"title": "found on", "autorange": "reversed"},
        height=140 + 70 * len(tasks), width=260 + 120 * len(tasks), margin={"l": 120, "r": 20, "t": 90, "b": 70})
    return OfflineFigure(figure)


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _effect(cell: dict, family: dict) -> str:
    adjusted = family[cell["source"], cell["target"]]["adjusted"]
    return (f"{cell['target']} ({cell['gain_points']:+.1f} points, family-adjusted CI [{adjusted['ci_low']:+.1f}, "
            f"{adjusted['ci_high']:+.1f}], Holm {p_is(adjusted['p_adjusted'])})")


def transfer_sentences(transfer: TransferArtifact) -> list[str]:
    """One sentence per frozen set, generated from its row's adjusted tests and non-inferiority, then the
    trade-offs and the matrix's summary."""
    tasks, cells = transfer["tasks"], {(c["source"], c["target"]): c for c in transfer["cells"]}
    family = _family(transfer)
    out, trades = [], []
    for source in tasks:
        own = cells[source, source]
        others = [cells[source, t] for t in tasks if t != source]
        helped = [c for c in others if _significant(c, family) and c["gain_points"] > 0]
        hurt = [c for c in others if _significant(c, family) and c["gain_points"] < 0]
        intro = f"The set found on {source} (`{own['heads_label']}`)"
        if own["verdict"]["kind"] == "gain":
            own_text = f"helps its own task on the holdout ({own['gain_points']:+.1f} points, significant alone)"
        elif own["verdict"]["kind"] == "loss":
            own_text = f"hurts its own task on the holdout ({own['gain_points']:+.1f} points, significant alone)"
        else:
            own_text = f"shows no significant change on its own holdout ({own['gain_points']:+.1f} points)"
        parts = [own_text]
        if helped:
            parts.append("significantly helps " + _join([_effect(c, family) for c in helped]))
        if hurt:
            parts.append("significantly hurts " + _join([_effect(c, family) for c in hurt]))
        sentence = intro + " " + "; it ".join(parts) + "."
        safe = [c for c in others if family[source, c["target"]]["noninferiority"]["harm_ruled_out"]]
        open_ = [c for c in others if c not in safe]
        if safe:
            sentence += (f" On {_join([c['target'] for c in safe])} harm larger than {MARGIN_POINTS:g} points is ruled "
                         "out (family-adjusted one-sided bound).")
        if open_:
            sentence += (" On " + _join([f"{c['target']} harm up to "
                                         f"{family[source, c['target']]['noninferiority']['harm_not_ruled_out_points']:.1f}"
                                         " points" for c in open_]) + " is not ruled out.")
        out.append(sentence)
        if hurt and own["verdict"]["kind"] == "gain":
            trades.append(f"{source}'s set helps {source} while hurting {_join([c['target'] for c in hurt])}")
    n_tests = sum(1 for c in transfer["cells"] if not c["diagonal"])
    n_sig = sum(1 for c in transfer["cells"] if not c["diagonal"] and _significant(c, family))
    n_safe = sum(1 for key, found in family.items() if found["noninferiority"]["harm_ruled_out"])
    open_bounds = [found["noninferiority"]["harm_not_ruled_out_points"] for found in family.values()
                   if not found["noninferiority"]["harm_ruled_out"]]
    if trades:
        out.append("**Help here, harm there:** " + "; ".join(trades) + ". This is the pattern of the toy model's "
                   "Theorem 4.3 ([theory](theory.md)): deleting a head that serves a task's shortcut helps it and costs "
                   "a task that needs the head; these numbers show the trade, not its mechanism.")
    summary = (f"**The matrix as a whole:** of the {n_tests} off-diagonal cells, {n_sig} "
               f"{'is' if n_sig == 1 else 'are'} significant after Holm's adjustment for the {n_tests}, and {n_safe} "
               f"rule{'s' if n_safe == 1 else ''} out harm larger than {MARGIN_POINTS:g} points (the margin fixed before "
               "the data: the smallest gain the paper reports).")
    if open_bounds:
        summary += (f" In the other {len(open_bounds)}, harm of up to {min(open_bounds):.1f} to {max(open_bounds):.1f} "
                    "points is not ruled out: on these items the matrix cannot show that the deletions are free.")
    else:
        summary += " Every deletion is shown to cost the other tasks less than the margin."
    out.append(summary)
    return out


def transfer_table(transfer: TransferArtifact) -> str:
    tasks, cells = transfer["tasks"], {(c["source"], c["target"]): c for c in transfer["cells"]}
    family = _family(transfer)
    rows = [[f"{s} (`{cells[s, s]['heads_label']}`)"] + [cell_text(cells[s, t], family) for t in tasks] for s in tasks]
    sizes = [f"{t}: {_items_text(next(c for c in transfer['cells'] if c['target'] == t and not c['diagonal']))}"
             for t in tasks if any(c["target"] == t and not c["diagonal"] for c in transfer["cells"])]
    note = ("Off the diagonal, each column scores the other tasks' sets on " + "; ".join(sizes) + ". ") if sizes else ""
    return note + "\n\n" + md_table(["found on \\ tested on"] + tasks, rows)


def raw_html(html_text: str) -> list[str]:
    """A MyST block that puts HTML into a Markdown page as it is (an interactive figure)."""
    return ["```{raw} html", html_text, "```", ""]


def transfer_section(transfers: list[TransferArtifact]) -> list[str]:
    """The results page's transfer section (always present: the theory page links to it)."""
    out = [f"({ANCHOR})=", "## Beyond the task: the transfer matrix", "",
           "A frozen set that enhances one task by breaking another is no capability gain. Each model's frozen sets are "
           "therefore also scored on the holdout items of the model's other tasks (`cel transfer`, run by `cel main`). "
           "Row = the task the set was found on, column = the task it is tested on; the outlined diagonal is each run's "
           "own result. Off the diagonal, tests are adjusted for the matrix's cells (Holm), and each cell says whether "
           f"harm larger than {MARGIN_POINTS:g} points (the smallest gain the paper reports, fixed before the data) is "
           "ruled out. This is the real-model counterpart of the toy model's Theorem 4.3 ([theory](theory.md)). Hover "
           "a cell for its numbers.", ""]
    if not transfers:
        return out + ["```{note}", "No transfer matrix yet: it needs a model's runs on at least two tasks "
                      "(`python -m cel_utils main`, or `python -m cel_utils transfer` after a grid).", "```", ""]
    for transfer in transfers:
        out += [f"### {transfer['model']['name']} (seed {transfer['seed']})", ""]
        out += raw_html(transfer_heatmap_figure(transfer).to_html())
        sentences = transfer_sentences(transfer)
        # In view: the trade-offs and the matrix as a whole (the bold sentences); each set's row in the dropdown.
        whole = [t for t in sentences if t.startswith("**")]
        out += [" ".join(whole), ""]
        out += [f"```{{admonition}} {transfer['model']['name']}'s matrix in numbers, and each set in words",
                ":class: dropdown", transfer_table(transfer), "", f"\\* significant at p ≤ {ALPHA:g} (exact McNemar; "
                "Holm-adjusted off the diagonal).", "", " ".join(t for t in sentences if t not in whole), "```", ""]
    return out
