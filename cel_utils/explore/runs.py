"""A finished run's head sets, read from its artifact: the frozen set, the pool and every stage-2 set it scored."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cel_utils.config import RunConfig
from cel_utils.models.heads import HeadGeometry, HeadId, format_heads, head_set
from cel_utils.pipeline.artifacts import read_artifact
from cel_utils.tasks.splits import TaskData


@dataclass
class RunSets:
    path: Path
    config: RunConfig
    frozen: tuple[HeadId, ...]
    pool: tuple[HeadId, ...]
    stage2: list[tuple[HeadId, ...]]  # in the artifact's order
    item_ids: dict[str, list[str]]  # split -> the run's item ids

    def choices(self) -> dict[str, tuple[HeadId, ...]]:
        """What a user can load, by label: the frozen set, the pool, then each stage-2 set."""
        out = {f"frozen set: {format_heads(self.frozen)}": self.frozen, f"pool: {format_heads(self.pool)}": self.pool}
        out.update({f"stage 2: {format_heads(heads)}": heads for heads in self.stage2 if heads != self.frozen})
        return out

    def check_geometry(self, geometry: HeadGeometry) -> None:
        for head in (*self.frozen, *self.pool):
            geometry.check(head)

    def check_items(self, data: TaskData) -> None:
        """The session's items must be the run's, or a number shown would belong to other items."""
        for split, ids in self.item_ids.items():
            mine = [item.id for item in getattr(data, split)]
            if mine != ids:
                raise ValueError(f"{self.path}: the run's {split} items are not the ones these settings draw (the "
                                 "data changed, or another data folder is read): open the run where its data is, "
                                 "e.g. with the same CEL_DATA_DIR")


def load_run(path: str | Path) -> RunSets:
    """The sets and settings of the run whose artifact is at ``path``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no artifact at {path}: give the path of a run's JSON artifact (results/*.json)")
    artifact = read_artifact(path)
    if artifact.get("kind") != "cel-run":
        raise ValueError(f"{path} is a {artifact.get('kind')!r} file, not a run's artifact (kind 'cel-run')")
    return RunSets(path=path, config=RunConfig.from_dict(artifact["config"]),
                   frozen=head_set(artifact["frozen"]["heads"]), pool=head_set(artifact["pool"]),
                   stage2=[head_set(s["heads"]) for s in artifact["stage2"]],
                   item_ids={"discovery": artifact["discovery"]["item_ids"], "holdout": artifact["holdout"]["item_ids"]})
