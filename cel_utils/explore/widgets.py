"""The explorer's controls (ipywidgets), wired to an :class:`~cel_utils.explore.session.ExploreSession`.

Left to right and top to bottom: where the prompt comes from (an item of a split by index or by searching its text,
or a typed prompt), which heads are off (a layer x head grid of toggles, a text field, or a set read from a run's
artifact), the item under the full and the ablated model, and a button that scores the head set on N items. Every
control is an attribute, so a test drives it as a user would: set a value or ``click()`` a button, then read the
``HTML`` outputs.
"""
from __future__ import annotations

from contextlib import contextmanager

import ipywidgets as w

import cel_utils.explore.render as render
from cel_utils.explore.runs import RunSets, load_run
from cel_utils.explore.session import SPLITS, ExploreSession
from cel_utils.models.heads import HeadId, format_heads, head_set, parse_head

DEFAULT_SCORE_ITEMS = 100
ITEM_TAB, OWN_TAB = 0, 1


class Explorer:
    def __init__(self, session: ExploreSession, artifact: str | None = None):
        self.session = session
        self._quiet = False  # set while several controls change together, so the item is computed once
        self.run: RunSets | None = None
        geometry = session.lm.geometry

        # Where the prompt comes from
        self.split = w.Dropdown(options=SPLITS, value="holdout", description="split")
        self.index = w.BoundedIntText(value=0, min=0, max=len(session.items("holdout")) - 1, description="item #").add_class("cel-index")
        self.query = w.Text(placeholder="words in the item's text or answers", description="search",
                            continuous_update=False)
        self.found = w.Select(options=[], rows=3, description="found", layout=w.Layout(width="95%"))
        self.own_text = w.Textarea(placeholder="your prompt (it follows the task's few-shot exemplars)",
                                   description="prompt", layout=w.Layout(width="95%", height="6em"))
        typed = session.kind.typed_prompt  # what a typed prompt of the task's kind takes
        self.own_answers = w.Textarea(placeholder=typed.hint, description=typed.box,
                                      layout=w.Layout(width="95%", height="5em"))
        self.own_gold = w.BoundedIntText(value=0, min=0, max=99, description="right option",
                                         layout=w.Layout(display="" if session.kind.compares_answers else "none"))
        self.own_show = w.Button(description="show my prompt", button_style="primary")
        self.source = w.Tab(children=[w.VBox([w.HBox([self.split, self.index]), self.query, self.found]),
                                      w.VBox([self.own_text, self.own_answers, self.own_gold, self.own_show])])
        self.source.set_title(ITEM_TAB, "task item")
        self.source.set_title(OWN_TAB, "own prompt")

        # Which heads are off
        self.toggles: dict[HeadId, w.ToggleButton] = {
            head: w.ToggleButton(value=False, description=str(head.head), tooltip=str(head),
                                 layout=w.Layout(width="32px", height="22px", padding="0"))
            for head in geometry.all_heads()}
        cells = []
        for layer in range(geometry.n_layers):
            cells += [w.Label(f"L{layer}"), *[self.toggles[HeadId(layer, h)] for h in range(geometry.n_heads)]]
        # a CSS grid with fixed rows: the real model's 30 layers scroll instead of squeezing
        self.grid = w.GridBox(cells, layout=w.Layout(grid_template_columns=f"40px repeat({geometry.n_heads}, 34px)",
                                                     grid_auto_rows="24px", grid_gap="2px", max_height="520px",
                                                     overflow="auto"))
        self.heads_text = w.Text(value="", placeholder="e.g. L3.H1+L12.H0", description="heads off",
                                 continuous_update=False).add_class("cel-heads")
        self.clear = w.Button(description="all on")
        self.artifact = w.Text(value=str(artifact or ""), placeholder="results/<model>__<task>__seed<n>.json",
                               description="run", layout=w.Layout(width="60%"))
        self.read_run = w.Button(description="read run")
        self.run_sets = w.Dropdown(options=[], description="its sets", layout=w.Layout(width="60%"))
        self.apply_set = w.Button(description="switch these off")

        # What they do
        self.item_out = w.HTML()
        self.n_items = w.BoundedIntText(value=min(DEFAULT_SCORE_ITEMS, len(session.items("holdout"))), min=1,
                                        max=len(session.items("holdout")), description="N items")
        self.score_button = w.Button(description="score on N items", button_style="primary")
        self.bar = w.IntProgress(value=0, min=0, max=1, description="scoring")
        self.score_out = w.HTML()
        self.status = w.HTML()

        self.split.observe(self._split_changed, "value")
        self.index.observe(lambda _: self.refresh(own=False), "value")
        self.query.observe(lambda _: self.search(), "value")
        self.found.observe(self._found_picked, "value")
        self.own_show.on_click(lambda _: self.refresh(own=True))
        for toggle in self.toggles.values():
            toggle.observe(self._toggled, "value")
        self.heads_text.observe(self._heads_typed, "value")
        self.clear.on_click(lambda _: self.set_heads(()))
        self.read_run.on_click(lambda _: self.load_run())
        self.apply_set.on_click(lambda _: self._apply_run_set())
        self.score_button.on_click(lambda _: self.score())

        title = (f"<b>{session.lm.name}</b> on <b>{session.task.name}</b> (seed {session.config.seed}, preset "
                 f"{session.config.preset}, engine {session.config.engine}; {len(session.data.discovery)} discovery "
                 f"and {len(session.data.holdout)} holdout items)")
        self.widget = w.VBox([
            w.HTML(title), self.source,
            w.HBox([w.VBox([w.HTML("<b>Heads</b>: a pressed toggle is switched off (zero-ablated)"), self.grid],
                           layout=w.Layout(width="42%")),
                    w.VBox([w.HBox([self.heads_text, self.clear]), w.HBox([self.artifact, self.read_run]),
                            w.HBox([self.run_sets, self.apply_set]), self.status,
                            w.HBox([self.n_items, self.score_button]), self.bar, self.score_out],
                           layout=w.Layout(width="58%"))]),
            self.item_out])
        if artifact:
            self.load_run()
        self.refresh()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    # The head set ---------------------------------------------------------------------------------------------

    @property
    def heads(self) -> tuple[HeadId, ...]:
        return head_set(head for head, toggle in self.toggles.items() if toggle.value)

    @contextmanager
    def _batch(self):
        quiet, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = quiet

    def set_heads(self, heads) -> None:
        """Switch exactly ``heads`` off (ids, ``"L3.H1"`` strings or pairs) and show the item once."""
        heads = set(head_set(heads))
        for head in heads:
            self.session.lm.geometry.check(head)
        with self._batch():
            for head, toggle in self.toggles.items():
                toggle.value = head in heads
            self.heads_text.value = format_heads(heads) if heads else ""
        self.refresh()

    def _toggled(self, change) -> None:
        owner = change["owner"]
        owner.button_style = "danger" if change["new"] else ""
        if self._quiet:
            return
        with self._batch():
            self.heads_text.value = format_heads(self.heads) if self.heads else ""
        self.refresh()

    def _heads_typed(self, change) -> None:
        if self._quiet:
            return
        text = change["new"].strip()
        try:
            heads = [parse_head(part) for part in text.replace(",", "+").split("+") if part.strip()] if text else []
            self.set_heads(heads)
        except ValueError as error:
            self.status.value = render.error_html(error)

    # A run's sets -----------------------------------------------------------------------------------------------

    def load_run(self) -> None:
        """Read the artifact named in the ``run`` field and offer its frozen set, pool and stage-2 sets."""
        try:
            run = load_run(self.artifact.value.strip())
            run.check_geometry(self.session.lm.geometry)
            mine, theirs = self.session.config, run.config
            if (theirs.model, theirs.task) != (mine.model, mine.task):
                raise ValueError(f"{run.path} is a run of {theirs.model} on {theirs.task}; this explorer shows "
                                 f"{mine.model} on {mine.task}: open it with explore(artifact=...)")
        except (OSError, ValueError) as error:
            self.status.value = render.error_html(error)
            return
        self.run = run
        self.run_sets.options = list(run.choices().items())
        self.run_sets.index = 0  # the frozen set, ready to switch off
        self.status.value = f"read {run.path.name}: frozen set {format_heads(run.frozen)}"

    def _apply_run_set(self) -> None:
        if self.run_sets.value is not None:
            self.set_heads(self.run_sets.value)

    # The prompt -------------------------------------------------------------------------------------------------

    def _split_changed(self, change) -> None:
        n = len(self.session.items(change["new"]))
        with self._batch():
            self.index.max = n - 1
            self.index.value = min(self.index.value, n - 1)
            self.n_items.max = n
            self.n_items.value = min(self.n_items.value, n)
            self.found.options = []
        self.refresh()

    def search(self) -> None:
        """List the split's items whose text contains the query; picking one shows it."""
        indices = self.session.find(self.query.value, self.split.value)
        items = self.session.items(self.split.value)
        with self._batch():
            self.found.options = [(f"#{i}: {self.session.task.doc_to_text(items[i].doc)[:90]}", i) for i in indices]
            self.found.value = None
        self.status.value = f"{len(indices)} item(s) found" + (" (the first ones)" if len(indices) == 50 else "")

    def _found_picked(self, change) -> None:
        if change["new"] is not None and not self._quiet:
            self.index.value = change["new"]  # shows it (through the index's observer)

    def refresh(self, own: bool | None = None) -> None:
        """Compute and show the current prompt under the full model and the current head set."""
        if self._quiet:
            return
        own = self.source.selected_index == OWN_TAB if own is None else own
        self.status.value = "computing ..."
        try:
            if own:
                self.source.selected_index = OWN_TAB
                lines = [line for line in self.own_answers.value.splitlines()]
                # the task's kind takes what it needs: options or tests (lines), or a target (the text as typed)
                view = self.session.view_prompt(self.own_text.value, self.heads, options=lines,
                                                gold=self.own_gold.value, target=self.own_answers.value, tests=lines)
            else:
                self.source.selected_index = ITEM_TAB
                view = self.session.view(self.split.value, self.index.value, self.heads)
        except ValueError as error:
            self.item_out.value = render.error_html(error)
            self.status.value = ""
            return
        self.status.value = ""
        self.view = view
        self.item_out.value = render.item_html(view)

    # Many items ---------------------------------------------------------------------------------------------------

    def score(self) -> None:
        """Score the head set on the first N items of the split, with the progress bar following the evaluation."""
        def sink(done: int, total: int) -> None:
            self.bar.max, self.bar.value = max(total, 1), done

        self.bar.bar_style = ""
        try:
            self.last_score = self.session.score(self.heads, self.split.value, self.n_items.value, progress=sink)
        except ValueError as error:
            self.score_out.value = render.error_html(error)
            return
        self.bar.bar_style = "success"
        self.score_out.value = render.score_html(self.last_score)
