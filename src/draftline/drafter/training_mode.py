"""What one training call trains: which packs it reads, the state it starts from, where it
leaves its own. Its caller decides this once, from what the run is (the `train` stages: the
params and their inputs), and training only follows it: nothing below looks at the disk to
guess (a stale whole-run index.json beside the shard folders once made the last stage train a
whole run from old packs).

A run is trained whole in one call, or as a chain (`draftline.drafter.step_plan`): link k trains
the first epoch's steps over shard k, from the state link k-1 left (link 0 from a fresh plan of
the planned rows), and the last call trains the steps after the chain over every shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TrainingMode:
    """One call's part of a run. Build it with `whole_run`, `chain_link` or `after_the_chain`."""

    folders: tuple[Path, ...]  # the extraction folders read, in shard order
    link: int | None = None  # a chain link: the first epoch's steps over shard `link`
    after_chain: bool = False  # the steps after the chain, over every shard
    start_from: Path | None = None  # the state the previous link left (None: a fresh plan)
    planned_rows: int | None = None  # a fresh plan's rows (None: the usable sequences)
    save_to: Path | None = None  # where a link leaves its state for the next call

    @classmethod
    def whole_run(
        cls, folders: Path | Sequence[Path], planned_rows: int | None = None
    ) -> TrainingMode:
        """Every step in one call; several folders are the shards, in order."""
        found = (folders,) if isinstance(folders, Path) else tuple(folders)
        return cls(found, planned_rows=planned_rows)

    @classmethod
    def chain_link(
        cls,
        shard: int,
        folder: Path,
        save_to: Path,
        *,
        start_from: Path | None = None,
        planned_rows: int | None = None,
    ) -> TrainingMode:
        """Link `shard`: the first link from a fresh plan of `planned_rows`, the others from
        the state the link before left (`start_from`)."""
        return cls((folder,), shard, False, start_from, planned_rows, save_to)

    @classmethod
    def after_the_chain(cls, shards: Sequence[Path], last_link: Path) -> TrainingMode:
        """The steps after the chain, over every shard, from the last link's state."""
        return cls(tuple(shards), after_chain=True, start_from=last_link)

    def __post_init__(self) -> None:
        if not self.folders:
            raise ValueError("a training call reads at least one extraction folder")
        if self.link is not None and (self.after_chain or len(self.folders) != 1):
            raise ValueError("a chain link reads its own shard's folder alone")
        if self.link is not None and self.save_to is None:
            raise ValueError(f"{self.describe()} leaves its state for the next: save_to")
        if self.start_from is None and (self.link not in (None, 0) or self.after_chain):
            raise ValueError(f"{self.describe()} needs the state the link before it left")
        if self.start_from is not None and self.link is None and not self.after_chain:
            raise ValueError("a whole run starts from a fresh plan")
        if self.start_from is not None and self.planned_rows is not None:
            raise ValueError("a call that starts from a state follows that state's plan")

    def describe(self) -> str:
        """Also part of the working checkpoint's identity: a checkpoint resumes only its part."""
        if self.link is not None:
            return f"link {self.link}"
        return "after the chain" if self.after_chain else "whole run"
