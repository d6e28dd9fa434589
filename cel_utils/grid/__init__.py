"""Run a notebook over a grid of (model, task, seed) cells with papermill: planning and one cell
(:mod:`cel_utils.grid.cells`), and the executors that run them all (:mod:`cel_utils.grid.executors`)."""
from cel_utils.grid.cells import (
                                  DEFAULT_NOTEBOOK,
                                  KERNEL_START_ATTEMPTS,
                                  REPO_DIR,
                                  STRATEGIES_NOTEBOOK,
                                  Cell,
                                  CellResult,
                                  plan,
                                  result_line,
                                  run_cell,
                                  summary_text,
                                  up_to_date,
                                  with_settings,
)
from cel_utils.grid.executors import EXECUTORS, SlurmOptions, run_grid

__all__ = ["DEFAULT_NOTEBOOK", "EXECUTORS", "KERNEL_START_ATTEMPTS", "REPO_DIR", "STRATEGIES_NOTEBOOK", "Cell",
           "CellResult", "SlurmOptions", "plan", "result_line", "run_cell", "run_grid", "summary_text", "up_to_date",
           "with_settings"]
