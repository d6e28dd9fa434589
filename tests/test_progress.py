"""Progress in its three modes: tqdm bars, plain log lines (grid cells, Slurm logs), nothing."""
import io

import pytest

from cel_utils.progress import LogProgress, _Off, progress_bar


def test_log_lines_name_the_stage_count_and_an_eta():
    out = io.StringIO()
    bar = LogProgress(total=4, desc="boolq: stage 1: full + 30 heads", unit="eval", every_s=0.0, stream=out)
    for _ in range(4):
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[cel] boolq: stage 1: full + 30 heads: started"
    assert lines[1].startswith("[cel] boolq: stage 1: full + 30 heads: 1/4 evals,") and "ETA" in lines[1]
    assert len(lines) == 1 + 3 + 1 and lines[-1].startswith("[cel] boolq: stage 1: full + 30 heads: 4/4 evals in")


def test_modes():
    assert isinstance(progress_bar(10, "x", "off"), _Off) and isinstance(progress_bar(10, "x", False), _Off)
    assert isinstance(progress_bar(1, "x", "log"), _Off)  # a single step is not worth a line
    assert isinstance(progress_bar(10, "x", "log"), LogProgress)
    with pytest.raises(ValueError, match="unknown progress mode 'loud'"):
        progress_bar(10, "x", "loud")


def test_a_callable_sink_receives_every_step():
    seen = []
    bar = progress_bar(3, "x", lambda done, total: seen.append((done, total)))
    for _ in range(3):
        bar.update(1)
    bar.close()
    assert seen == [(0, 3), (1, 3), (2, 3), (3, 3), (3, 3)]
    seen.clear()
    progress_bar(1, "x", lambda done, total: seen.append((done, total))).update(1)  # even a single step is shown
    assert seen == [(0, 1), (1, 1)]
