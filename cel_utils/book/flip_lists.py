"""Clickable flips on a run page, with no kernel: a click on a head of the stage-1 heat map, or on a set of the stage-2
table, lists the discovery items that set helped (wrong -> right) and harmed (right -> wrong), with each item's text,
the right answer and what the full and the ablated model answered.

Everything comes from the artifact's ``discovery_flips`` section (:mod:`cel_utils.pipeline.discovery_flips`): each
output carries the part it needs as inline JSON and a small inline script, so the page works offline and on the
published site, where nothing runs but the reader's browser. The list is built with text nodes only (an item's text
is never parsed as HTML). An artifact written before the section existed gets the figure and the table alone.
"""
from __future__ import annotations

import html
import json
from dataclasses import dataclass

import pandas as pd

from cel_utils.book.interactive import OfflineFigure, stage1_heatmap_figure
from cel_utils.book.run_page import stage2_table
from cel_utils.pipeline.schema import RunArtifact

# Builds the list for one set. `root` is the output's container; its JSON holds {sets, items, n_items, teacher_forced}.
SCRIPT = r"""
(function (root) {
  const data = JSON.parse(root.querySelector('script.cel-flips-data').textContent);
  const list = root.querySelector('.cel-flips-list');
  const el = (tag, text, cls) => { const e = document.createElement(tag); if (text !== undefined) e.textContent = text;
                                   if (cls) e.className = cls; return e; };
  function answer(item, index, right) {
    if (item.answers === null) return right ? 'right' : 'wrong';  // teacher forced: nothing generated to show
    return item.answers[index];
  }
  function show(name) {
    list.replaceChildren();
    const set = data.sets[name];
    if (!set) {
      list.append(el('p', name + ': not scored exactly (screened out), so no items are stored for it.'));
      return;
    }
    const help = Object.keys(set.help), harm = Object.keys(set.harm);
    const title = el('p', undefined, 'cel-flips-title');
    title.append(el('strong', name), ': helped ' + help.length + ', harmed ' + harm.length + ' of the ' +
                 data.n_items + ' discovery items (' + (name.includes('+') ? 'ablated together' : 'ablated alone') + ').');
    list.append(title);
    if (!help.length && !harm.length) return;
    const table = el('table', undefined, 'cel-flips-table'), head = el('tr');
    for (const column of ['flip', 'item', 'prompt (end)', 'gold', 'full model', 'ablated model']) head.append(el('th', column));
    table.append(el('thead'), el('tbody'));
    table.tHead.append(head);
    for (const [direction, indices] of [['wrong -> right', help], ['right -> wrong', harm]]) {
      for (const i of indices) {
        const item = data.items[i], row = el('tr');
        const index = direction === 'wrong -> right' ? set.help[i] : set.harm[i];
        row.dataset.item = item.item;
        row.append(el('td', direction), el('td', item.item), el('td', item.prompt_end, 'cel-flips-text'),
                   el('td', item.gold, 'cel-flips-text'),
                   el('td', answer(item, item.full, direction !== 'wrong -> right'), 'cel-flips-text'),
                   el('td', answer(item, index, direction === 'wrong -> right'), 'cel-flips-text'));
        table.tBodies[0].append(row);
      }
    }
    list.append(table);
    if (data.teacher_forced) list.append(el('p', 'Scored by teacher forcing: right means every token of the gold ' +
                                              'answer was the model\'s top choice; no answer was generated.'));
  }
  const figure = root.querySelector('.plotly-graph-div');
  if (figure) {
    (function attach() {  // plotly adds .on when it draws the figure
      if (!figure.on) return setTimeout(attach, 50);
      figure.on('plotly_click', event => show(event.points[0].customdata[0]));
    })();
  }
  for (const row of root.querySelectorAll('table.dataframe tbody tr')) {
    const cell = Array.from(row.cells).find(c => Object.hasOwn(data.sets, c.textContent.trim()));
    if (!cell) continue;
    const name = cell.textContent.trim();
    row.classList.add('cel-flips-clickable');
    row.tabIndex = 0;
    row.addEventListener('click', () => show(name));
    row.addEventListener('keydown', event => { if (event.key === 'Enter' || event.key === ' ') show(name); });
  }
})(document.currentScript.parentElement);
"""
STYLE = """<style>
.cel-flips-list table { font-size: 0.85em; margin-top: 0.5em; }
.cel-flips-list td, .cel-flips-list th { vertical-align: top; padding: 0.2em 0.5em; }
.cel-flips-text { white-space: pre-wrap; max-width: 28em; }
tr.cel-flips-clickable { cursor: pointer; }
tr.cel-flips-clickable:hover, tr.cel-flips-clickable:focus { background: #eef4fa; }
</style>"""


def flips_payload(artifact: RunArtifact, sets: list[str]) -> dict | None:
    """The part of ``discovery_flips`` that ``sets`` need (their flips and the items they flipped), or None when the
    artifact stores no flips."""
    stored = artifact["discovery_flips"]
    if not stored:
        return None
    chosen = {name: stored["sets"][name] for name in sets if name in stored["sets"]}
    used = sorted({i for flips in chosen.values() for direction in flips.values() for i in direction}, key=int)
    return {"sets": chosen, "items": {i: stored["items"][i] for i in used},
            "n_items": artifact["data"]["n_discovery"] or len(artifact["discovery"]["item_ids"]),
            "teacher_forced": any(item["answers"] is None for item in stored["items"].values())}


@dataclass
class ClickableFlips:
    """An output (a figure's or a table's HTML) followed by the list a click fills, with the data and script for it."""

    body: str
    payload: dict
    hint: str

    def to_html(self) -> str:
        data = json.dumps(self.payload, ensure_ascii=False).replace("</", "<\\/")  # never ends the script early
        return (f'<div class="cel-flips">{STYLE}{self.body}'
                f'<script type="application/json" class="cel-flips-data">{data}</script>'
                f'<div class="cel-flips-list" aria-live="polite"><p><em>{html.escape(self.hint)}</em></p></div>'
                f"<script>{SCRIPT}</script></div>")

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        return {"text/html": self.to_html(), "text/plain": f"<{self.hint}>"}


def heatmap_with_flips(artifact: RunArtifact) -> ClickableFlips | OfflineFigure:
    """The stage-1 heat map; a click on a head lists the discovery items it flipped when ablated alone."""
    figure = stage1_heatmap_figure(artifact)
    payload = flips_payload(artifact, ["+".join(s["heads"]) for s in artifact["stage1"] if len(s["heads"]) == 1])
    if payload is None:
        return figure
    return ClickableFlips(figure.to_html(), payload,
                          "Click a head to list the discovery items it helped and harmed when ablated alone.")


def stage2_with_flips(artifact: RunArtifact, top: int = 10) -> ClickableFlips | pd.DataFrame:
    """:func:`cel_utils.book.run_page.stage2_table`; a click on a row lists the discovery items that set flipped."""
    table = stage2_table(artifact, top)
    payload = flips_payload(artifact, list(table["heads"]))
    if payload is None:
        return table
    return ClickableFlips(table.to_html(), payload,
                          "Click a row to list the discovery items that set of heads helped and harmed.")
