"""The explorer's views as HTML: one item under the full and the ablated model side by side, and a head set's score
on many items in the words and rows of a run page (:func:`cel_utils.book.run_page.reliability_table`).

Plain HTML and CSS (the per-option chart is a row of bars), so the same string shows in a notebook, in Voila and in
a test that reads it; every number a test compares also sits in a ``data-value`` attribute at full precision.
"""
from __future__ import annotations

from html import escape

import numpy as np

from cel_utils.book.baselines import floor_rows_of
from cel_utils.book.run_page import interval_name
from cel_utils.book.text import clip, p_text, pct, transition_text
from cel_utils.explore.session import ItemView, Score, option_scores
from cel_utils.models.heads import format_heads
from cel_utils.tasks.scoring import Outcome

PROMPT_CHARS = 600  # the end of a long prompt is what decides the answer; the start is elided
STYLE = """<style>
.cel-x {font-family: system-ui, sans-serif; font-size: 13px}
.cel-x .cols {display: flex; gap: 16px}
.cel-x .col {flex: 1; min-width: 0; border: 1px solid #ddd; border-radius: 6px; padding: 8px}
.cel-x .prompt {white-space: pre-wrap; background: #f7f7f7; padding: 6px; border-radius: 4px; max-height: 12em;
  overflow: auto}
.cel-x pre {white-space: pre-wrap; background: #f7f7f7; padding: 6px; margin: 4px 0}
.cel-x .ok {color: #1a7f37; font-weight: 600} .cel-x .bad {color: #c62828; font-weight: 600}
.cel-x table {border-collapse: collapse} .cel-x td {padding: 2px 6px; vertical-align: middle}
.cel-x .bar {height: 10px; background: #7aa6d8; border-radius: 2px} .cel-x .chosen .bar {background: #1f5fa8}
.cel-x .gold td:first-child {font-weight: 600}
.cel-x .flip {background: #fff3cd; padding: 4px 8px; border-radius: 4px; display: inline-block}
</style>"""


def _verdict(correct: bool) -> str:
    return '<span class="ok">right</span>' if correct else '<span class="bad">wrong</span>'


def option_chart(view: ItemView, outcome: Outcome, which: str) -> str:
    """Each option's score (the primary metric's: log-likelihood, or per character for acc_norm) as a bar; the chosen
    option is dark, the right one bold. Bars are scaled within the item so both columns read alike."""
    scores = option_scores(outcome)
    both = np.concatenate([option_scores(view.full), option_scores(view.ablated)])
    low, high = float(both.min()), float(both.max())
    chosen, gold = int(np.argmax(scores)), view.gold_index
    rows = []
    for i, (option, score) in enumerate(zip(view.options, scores)):
        width = 10 + 90 * (score - low) / (high - low) if high > low else 100
        classes = " ".join(c for c, on in (("chosen", i == chosen), ("gold", i == gold)) if on)
        rows.append(f'<tr class="{classes}"><td>[{i}]</td><td style="width:120px"><div class="bar" '
                    f'style="width:{width:.0f}%"></div></td><td class="cel-score" data-which="{which}" data-option="{i}" '
                    f'data-value="{float(score)!r}">{score:.4f}</td><td>{escape(_short(option))}</td></tr>')
    unit = "log-likelihood per character" if view.metric == "acc_norm" else "log-likelihood"
    return f'<div>{unit} of each option (dark: chosen; bold: right)</div><table>{"".join(rows)}</table>'


def _short(text: str, limit: int = 70) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."


def _column(view: ItemView, which: str) -> str:
    outcome = view.full if which == "full" else view.ablated
    answer = view.full_answer if which == "full" else view.ablated_answer
    title = "Full model" if which == "full" else f"Ablated: {escape(format_heads(view.heads))}"
    parts = [f"<h4>{title}</h4>",
             f'<div class="cel-answer" data-which="{which}" data-correct="{int(outcome.correct[0])}">'
             f'{_verdict(bool(outcome.correct[0]))}: ']
    if not view.kind.loglikelihood:  # generated: the completion and its verdict
        generated = outcome.predictions[0]  # the whole completion (the run pages clip theirs)
        parts.append(f'tests: <span class="cel-status">{escape(generated["status"])}</span></div>'
                     f'<pre>{escape(generated["completion"])}</pre>')
    elif view.kind.compares_answers:  # multiple choice: each option's score
        parts.append(f"chose {escape(answer)}</div>{option_chart(view, outcome, which)}")
    else:
        parts.append(f'answers {escape(answer)} (greedy); gold tokens scored teacher forced, margin '
                     f'<span class="cel-score" data-which="{which}" data-value="{float(outcome.margin[0])!r}">'
                     f'{float(outcome.margin[0]):+.4f}</span></div>')
    return f'<div class="col">{"".join(parts)}</div>'


def item_html(view: ItemView) -> str:
    """One item: its prompt, the right answer, and the full and the ablated model's answers and scores side by side."""
    if not view.heads:
        flip = "no head is switched off: both columns are the full model"
    elif view.flipped:
        flip = (f"switching off {escape(format_heads(view.heads))} flips this item: "
                f"{'right -> wrong' if view.full.correct[0] else 'wrong -> right'}")
    else:
        flip = f"switching off {escape(format_heads(view.heads))} does not flip this item"
    return (f'{STYLE}<div class="cel-x cel-item"><b>{escape(view.label)}</b>'
            f'<div class="prompt">{escape(clip(view.prompt, PROMPT_CHARS, tail=True))}</div>'
            f'<div>right answer: <b class="cel-gold">{escape(_short(view.gold, 400))}</b></div>'
            f'<div class="flip">{flip}</div>'
            f'<div class="cols">{_column(view, "full")}{_column(view, "ablated")}</div></div>')


def score_html(score: Score) -> str:
    """A head set on N items: accuracy before and after, the gain with its interval and test, helped and harmed."""
    t = score.test
    rows = {f"{score.split} items": f"the first {score.n}",
            "accuracy, full -> ablated (points)": transition_text(score.full.accuracy, score.ablated.accuracy,
                                                                  t.gain_points),
            "gain (points)": f"{t.gain_points:+.2f}",
            f"{round(100 * t.confidence)}% CI, {interval_name(t.to_json())}": f"[{t.ci_low:+.2f}, {t.ci_high:+.2f}]",
            "exact McNemar p (two-sided)": p_text(t.p_value),
            "helped / harmed items": f"{t.help} / {t.harm} of {t.n_items}"}
    if score.floors:  # the trivial answers on the same items, beside the accuracies
        rows.update({f"floor: {name}": f"{pct(value)}%" for name, value, _ in floor_rows_of(score.floors)})
    body = "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in rows.items())
    return (f'{STYLE}<div class="cel-x cel-score-table" data-gain="{t.gain_points!r}" data-help="{t.help}" '
            f'data-harm="{t.harm}" data-p="{t.p_value!r}" data-full="{pct(score.full.accuracy)}">'
            f'<b>{escape(format_heads(score.heads))} on {score.n} {score.split} items</b><table>{body}</table></div>')


def error_html(error: Exception) -> str:
    return f'<div class="cel-x cel-error" style="color:#c62828">{escape(str(error))}</div>'
