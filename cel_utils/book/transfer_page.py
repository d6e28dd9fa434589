"""The transfer matrices on the results page: per model a heat map a reader can hover, a table, and sentences generated
from the numbers on which frozen sets help one task while hurting another (cel_utils.pipeline.transfer computes them).

The words follow the cells' paired tests (:func:`cel_utils.stats.power.verdict`): a set "helps" or "hurts" a task only
where its McNemar test is significant at the verdicts' level; elsewhere the sentence gives the interval, which is all
such a cell supports. With twelve off-diagonal tests per model, a few significant cells are expected by chance even
if no set did anything off its own task, and the section says how many.
"""
from __future__ import annotations

import numpy as np

from cel_utils.book.interactive import HARMFUL, HARMFUL_LIGHT, HELPFUL, HELPFUL_LIGHT, NEUTRAL, OfflineFigure
from cel_utils.book.text import md_table, p_is, pct
from cel_utils.stats.power import ALPHA

ANCHOR = "transfer-matrix"  # the section's label: book/theory.md links to it


def _significant(cell: dict) -> bool:
    return cell["verdict"]["kind"] in ("gain", "loss")


def _items_text(cell: dict) -> str:
    n, total = cell["n_items"], cell["n_holdout"]
    return f"{n} items" if n == total else f"{n} of {total} items (seeded subset)"


def cell_text(cell: dict) -> str:
    """A table cell: ``full -> ablated (gain), [low, high], p``; a marker for a significant change."""
    sig = cell["significance"]
    mark = " **\\***" if _significant(cell) else ""
    return (f"{pct(cell['full_accuracy'])} -> {pct(cell['ablated_accuracy'])} ({cell['gain_points']:+.1f}), "
            f"[{sig['ci_low']:+.1f}, {sig['ci_high']:+.1f}], {p_is(sig['p_value'])}{mark}")


def hover_text(cell: dict, metric: str) -> str:
    sig, power = cell["significance"], cell["power"]
    mdg = power["min_detectable_gain_points"]
    design = ("no change detectable at this discordance" if mdg is None
              else f"detects {mdg:.1f} points with {100 * power['power']:.0f}% power")
    role = "its own holdout (the run's result)" if cell["diagonal"] else "another task's holdout"
    return (f"<b>set from {cell['source']} ({cell['heads_label']}) on {cell['target']}</b><br>{role}, {metric}<br>"
            f"{pct(cell['full_accuracy'])} -> {pct(cell['ablated_accuracy'])} ({cell['gain_points']:+.1f} points)<br>"
            f"95% CI [{sig['ci_low']:+.1f}, {sig['ci_high']:+.1f}], McNemar {p_is(sig['p_value'])}<br>"
            f"helped {cell['help']}, harmed {cell['harm']} of {_items_text(cell)}<br>{cell['verdict']['kind']}; {design}")


def transfer_heatmap_figure(transfer: dict) -> OfflineFigure:
    """Rows: the task a set was found on; columns: the task it is scored on; colour: the gain in points (blue helps,
    red hurts, white none, one scale symmetric about zero); the diagonal (each run's own result) is outlined, and a
    cell's text carries * where its paired test is significant."""
    import plotly.graph_objects as go

    from cel_utils.pipeline.transfer import matrix

    tasks = transfer["tasks"]
    gains = matrix(transfer)
    cells = {(c["source"], c["target"]): c for c in transfer["cells"]}
    hover = [[hover_text(cells[s, t], transfer["metrics"][t]) for t in tasks] for s in tasks]
    text = [[f"{cells[s, t]['gain_points']:+.1f}{'*' if _significant(cells[s, t]) else ''}" for t in tasks]
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
                       "<br><sup>row = found on, column = tested on; * = significant (exact McNemar, p ≤ "
                       f"{ALPHA:g}); outlined = the run's own result</sup>", "font": {"size": 14}},
        xaxis={"title": "tested on (holdout)", "side": "bottom"}, yaxis={"title": "found on", "autorange": "reversed"},
        height=140 + 70 * len(tasks), width=260 + 120 * len(tasks), margin={"l": 120, "r": 20, "t": 90, "b": 70})
    return OfflineFigure(figure)


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _effect(cell: dict) -> str:
    sig = cell["significance"]
    return (f"{cell['target']} ({cell['gain_points']:+.1f} points, 95% CI [{sig['ci_low']:+.1f}, {sig['ci_high']:+.1f}], "
            f"{p_is(sig['p_value'])})")


def transfer_sentences(transfer: dict) -> list[str]:
    """One sentence per frozen set, generated from its row's tests, then the trade-offs and the multiplicity."""
    tasks, cells = transfer["tasks"], {(c["source"], c["target"]): c for c in transfer["cells"]}
    out, trades = [], []
    for source in tasks:
        row = [cells[source, t] for t in tasks]
        own = cells[source, source]
        helped = [c for c in row if c["verdict"]["kind"] == "gain"]
        hurt = [c for c in row if c["verdict"]["kind"] == "loss"]
        others = [c for c in row if not c["diagonal"]]
        flat = [c for c in others if c["verdict"]["kind"] == "not significant"]
        under = [c for c in others if c["verdict"]["kind"] == "underpowered"]
        intro = f"The set found on {source} (`{own['heads_label']}`)"
        if own["verdict"]["kind"] == "gain":
            own_text = f"significantly helps its own task ({own['gain_points']:+.1f} points)"
        elif own["verdict"]["kind"] == "loss":
            own_text = f"significantly hurts its own task on the holdout ({own['gain_points']:+.1f} points)"
        else:
            own_text = f"shows no significant change on its own holdout ({own['gain_points']:+.1f} points)"
        parts = [own_text]
        off_help = [c for c in helped if not c["diagonal"]]
        off_hurt = [c for c in hurt if not c["diagonal"]]
        if off_help:
            parts.append("significantly helps " + _join([_effect(c) for c in off_help]))
        if off_hurt:
            parts.append("significantly hurts " + _join([_effect(c) for c in off_hurt]))
        sentence = intro + " " + "; it ".join(parts) + "."
        if flat:
            sentence += (" Not significant on " + _join([f"{c['target']} ({c['gain_points']:+.1f} points, "
                                                          f"[{c['significance']['ci_low']:+.1f}, "
                                                          f"{c['significance']['ci_high']:+.1f}])" for c in flat])
                         + ": effects outside each interval are ruled out, effects inside it are not.")
        if under:
            sentence += (" On " + _join([f"{c['target']} ({c['power']['n_discordant']} of {c['n_items']} answers "
                                         "changed)" for c in under])
                         + " it changed too few answers for the test to detect any effect.")
        out.append(sentence)
        if helped and hurt:
            trades.append(f"{source}'s set helps {_join([c['target'] for c in helped])} while hurting "
                          f"{_join([c['target'] for c in hurt])}")
    n_tests = sum(1 for c in transfer["cells"] if not c["diagonal"])
    n_sig = sum(1 for c in transfer["cells"] if not c["diagonal"] and _significant(c))
    if trades:
        out.append("**Help here, harm there:** " + "; ".join(trades) + ". This is the pattern of the toy model's "
                   "Theorem 4.3 ([theory](theory.md)): deleting a head that serves a task's shortcut helps it and costs "
                   "a task that needs the head; these numbers show the trade, not its mechanism.")
    else:
        out.append("**No set both significantly helps one task and significantly hurts another** on these items. That is "
                   "not evidence that the deletions are free: a cell that is not significant rules out only the effects "
                   "outside its interval.")
    expected = ALPHA * n_tests
    out.append(f"Of the {n_tests} off-diagonal tests, {n_sig} {'is' if n_sig == 1 else 'are'} significant at "
               f"p ≤ {ALPHA:g}; if no set changed any other task, about {expected:.1f} would be by chance, so a single "
               "significant off-diagonal cell is weak evidence on its own.")
    return out


def transfer_table(transfer: dict) -> str:
    tasks, cells = transfer["tasks"], {(c["source"], c["target"]): c for c in transfer["cells"]}
    rows = [[f"{s} (`{cells[s, s]['heads_label']}`)"] + [cell_text(cells[s, t]) for t in tasks] for s in tasks]
    sizes = [f"{t}: {_items_text(next(c for c in transfer['cells'] if c['target'] == t and not c['diagonal']))}"
             for t in tasks if any(c["target"] == t and not c["diagonal"] for c in transfer["cells"])]
    note = ("Off the diagonal, each column scores the other tasks' sets on " + "; ".join(sizes) + ". ") if sizes else ""
    return note + "\n\n" + md_table(["found on \\ tested on"] + tasks, rows)


def raw_html(html_text: str) -> list[str]:
    """A MyST block that puts HTML into a Markdown page as it is (an interactive figure)."""
    return ["```{raw} html", html_text, "```", ""]


def transfer_section(transfers: list[dict]) -> list[str]:
    """The results page's transfer section (always present: the theory page links to it)."""
    out = [f"({ANCHOR})=", "## Beyond the task: the transfer matrix", "",
           "A frozen set that enhances one task by breaking another is no capability gain. Each model's frozen sets are "
           "therefore also scored, with the ablation, on the holdout items of the model's other tasks, against the full "
           "model's outcomes on the same items (`cel transfer`, which `cel main` runs after the grid). Row = the task "
           "the set was found on, column = the task it is tested on; a cell is the gain in points with its 95% paired "
           "bootstrap interval and exact McNemar p, and the diagonal is each run's own holdout result. Off the diagonal "
           "a column may use a seeded subset of its task's holdout (`transfer_items`); its power is that of the subset, "
           "given on hover. This is the real-model counterpart of the toy model's Theorem 4.3 ([theory](theory.md)), "
           "where one deletion helps task A and hurts task B.", ""]
    if not transfers:
        return out + ["```{note}", "No transfer matrix yet: it needs a model's runs on at least two tasks "
                      "(`python -m cel_utils main`, or `python -m cel_utils transfer` after a grid).", "```", ""]
    for transfer in transfers:
        out += [f"### {transfer['model']['name']} (seed {transfer['seed']})", ""]
        out += raw_html(transfer_heatmap_figure(transfer).to_html())
        out += [transfer_table(transfer), "", f"\\* significant at p ≤ {ALPHA:g} (exact McNemar).", ""]
        out += [" ".join(transfer_sentences(transfer)), ""]
    return out
