"""Splits: paper sizes, nesting, disjointness by content, fallbacks and provenance, clear size errors."""
import re

import pytest

from cel_utils.tasks.arithmetic_gen import ARITHMETIC_CONFIGS, generate_arithmetic
from cel_utils.tasks.catalog import get_task
from cel_utils.tasks.specs import Item
from cel_utils.tasks.splits import FEWSHOT_RESERVE, check_disjoint, content_key, load_task_data


def _keys(task, items):
    return {content_key(task, item.doc) for item in items}


def test_arithmetic_pools_all_ten_configs(data_dir):
    data = load_task_data("arithmetic", 300, 200, seed=1, num_fewshot=2, data_dir=data_dir)
    assert len(data.discovery) == 300 and len(data.holdout) == 200 and len(data.fewshot) == 2
    configs = {item.id.split("/")[0] for item in data.discovery + data.holdout}
    assert configs == set(ARITHMETIC_CONFIGS)
    assert not _keys(data.task, data.discovery) & _keys(data.task, data.holdout)
    assert not _keys(data.task, data.fewshot) & (_keys(data.task, data.discovery) | _keys(data.task, data.holdout))
    assert data.provenance["source"] == "mirror"


def test_paper_default_sizes(data_dir):
    data = load_task_data("arithmetic", data_dir=data_dir)
    assert (len(data.discovery), len(data.holdout)) == (2000, 1000)
    mbpp = load_task_data("mbpp", data_dir=data_dir)
    assert (len(mbpp.discovery), len(mbpp.holdout)) == (374, 500)
    assert [item.id for item in mbpp.fewshot] == ["2", "3", "4"]


def test_draws_are_seeded_and_nested(data_dir):
    small = load_task_data("arithmetic_2da", 10, 20, seed=3, data_dir=data_dir)
    large = load_task_data("arithmetic_2da", 50, 20, seed=3, data_dir=data_dir)
    other = load_task_data("arithmetic_2da", 10, 20, seed=4, data_dir=data_dir)
    assert [i.id for i in small.holdout] == [i.id for i in large.holdout]  # holdout ignores discovery size
    assert {i.id for i in small.discovery} <= {i.id for i in large.discovery}
    assert [i.id for i in small.holdout] != [i.id for i in other.holdout]


def test_missing_train_split_falls_back_and_says_so(data_dir):
    data = load_task_data("boolq", 40, 60, seed=0, data_dir=data_dir)
    assert "fallback" in data.provenance and "train" in data.provenance["fallback"]
    assert all(item.id.startswith("validation/") for item in data.discovery)
    assert not _keys(data.task, data.discovery) & _keys(data.task, data.holdout)


def test_mbpp_uses_train_and_test(data_dir):
    data = load_task_data("mbpp", 10, 12, seed=0, data_dir=data_dir)
    assert all(601 <= int(i.id) <= 974 for i in data.discovery)
    assert all(11 <= int(i.id) <= 510 for i in data.holdout)
    assert "fallback" not in data.provenance


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_discovery=0), "positive integer"),
    (dict(n_holdout=-3), "positive integer"),
    (dict(n_discovery=2001), "larger than the 2000 items available"),
    (dict(n_discovery=1500, n_holdout=600), "larger than the 500 items available"),
])
def test_sizes_beyond_the_data_are_clear_errors(data_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_task_data("arithmetic_2da", **{"n_discovery": 10, "n_holdout": 10, **kwargs}, data_dir=data_dir)


def test_missing_data_dir_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_task_data("boolq", 5, 5, data_dir=tmp_path / "does-not-exist")


def test_overlap_by_content_is_an_error():
    task = get_task("arithmetic_2da")
    doc = {"context": "Question: What is 1 plus 1?\nAnswer:", "completion": " 2"}
    with pytest.raises(ValueError, match="also occur in the holdout"):
        check_disjoint(task, [Item("a", dict(doc))], [Item("b", dict(doc))])


def test_generator_matches_the_dataset_format(data_dir):
    import json
    from pathlib import Path

    for config in ARITHMETIC_CONFIGS:
        real = [json.loads(line) for line in (Path(data_dir) / "arithmetic" / f"{config}.jsonl").open()][:50]
        made = generate_arithmetic(config, n=200, seed=0)
        for rows in (real, made):
            for row in rows:
                assert re.fullmatch(r"Question: What is .+\?\nAnswer:", row["context"])
                assert re.fullmatch(r" -?\d+", row["completion"])
        question = made[0]["context"].removeprefix("Question: What is ").removesuffix("?\nAnswer:")
        expression = question.replace("plus", "+").replace("minus", "-").replace("times", "*")
        assert eval(expression) == int(made[0]["completion"])  # the answer is right
        word = {"a": "plus", "s": "minus", "m": "times"}.get(config[-1])
        if word:
            assert all(word in row["context"] for row in real + made)
    assert generate_arithmetic("arithmetic_3ds", 5, seed=1) == generate_arithmetic("arithmetic_3ds", 5, seed=1)


def _mirror_with_train_splits(root, source) -> str:
    """The local mirror, plus synthetic BoolQ and HellaSwag train splits (2,000 rows each, their own content)."""
    import json

    for name in ("arithmetic", "mbpp"):
        (root / name).symlink_to(source / name, target_is_directory=True)
    for name, field in (("boolq", "question"), ("hellaswag", "ctx_a")):
        folder = root / name
        folder.mkdir()
        (folder / "validation.jsonl").symlink_to(source / name / "validation.jsonl")
        card = (source / name / "README.md").read_text()
        (folder / "README.md").write_text(card.replace("  - split: validation\n    path: validation.jsonl\n",
                                                        "  - split: validation\n    path: validation.jsonl\n"
                                                        "  - split: train\n    path: train.jsonl\n", 1))
        rows = [json.loads(line) for line in (source / name / "validation.jsonl").read_text().splitlines()[:2000]]
        (folder / "train.jsonl").write_text("".join(json.dumps({**row, field: f"{row[field]} (train copy {i})"}) + "\n"
                                                    for i, row in enumerate(rows)))
    return str(root)


def test_default_sizes_are_table_3_when_the_train_splits_exist(tmp_path, data_dir):
    from pathlib import Path

    mirror = _mirror_with_train_splits(tmp_path, Path(data_dir))
    table_3 = {"arithmetic": (2000, 1000), "boolq": (2000, 3270), "hellaswag": (2000, 10042), "mbpp": (374, 500)}
    for task, sizes in table_3.items():
        data = load_task_data(task, data_dir=mirror)
        assert (len(data.discovery), len(data.holdout)) == sizes, task
        assert "fallback" not in data.provenance
    # the local mirror has no BoolQ or HellaSwag train split: discovery comes from validation, the rest is holdout
    # (less the exemplar reserve), every item kept, duplicates included
    for task, n_validation in (("boolq", 3270), ("hellaswag", 10042)):
        data = load_task_data(task, data_dir=data_dir)
        assert (len(data.discovery), len(data.holdout)) == (2000, n_validation - 2000 - FEWSHOT_RESERVE)
