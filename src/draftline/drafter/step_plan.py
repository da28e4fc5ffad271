"""Which sequences each optimizer step reads, so training can follow generation shard by shard.

Training runs as a chain of stages (docs/pipeline.md): link k (`train_shard@k`) trains the
first epoch's steps over shard k as soon as shard k is generated, resuming from link k-1; the
last stage (`train`) trains the remaining epochs over every shard. Every figure a step depends
on is known before the shard it reads arrives, so the drafter is the same whether the shards
came one by one on another node or all at once:

- the number of steps (hence the learning-rate schedule) is fixed from the planned rows
  (curate's train rows): `epochs x (planned_rows // global_batch_size)`;
- the first epoch takes `n_k // global_batch_size` full batches from shard k (its n_k usable
  sequences, shuffled with a seed of their own); the few left over are read in later epochs;
- the steps after the chain cycle over every shard's sequences, epoch e shuffled with seed
  (seed, e), until the planned step count is reached.

`CallSteps` is the plan as one training call sees it (`draftline.drafter.training_mode`): the
steps it trains and the sequences each one reads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from draftline.drafter.training_mode import TrainingMode


def shuffled(n: int, *keys: object) -> list[int]:
    """A permutation of range(n) fixed by `keys` (the same on every machine and torch build)."""
    seed = int.from_bytes(hashlib.sha256(repr(keys).encode()).digest()[:8], "little")
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed >> 1)).tolist()


@dataclass
class StepPlan:
    """The steps of a whole run and the batch each one reads."""

    global_batch_size: int
    seed: int
    total_steps: int
    # Usable sequences of each shard the chain has trained on so far, in shard order.
    shard_sizes: list[int] = field(default_factory=list)

    @classmethod
    def planned(cls, planned_rows: int, epochs: int, global_batch_size: int, seed: int):
        steps_per_epoch = planned_rows // global_batch_size
        if steps_per_epoch == 0:
            raise SystemExit(
                f"{planned_rows} planned train rows are fewer than drafter.global_batch_size="
                f"{global_batch_size}: lower it or add data"
            )
        return cls(global_batch_size, seed, epochs * steps_per_epoch)

    def link_steps(self, shard: int) -> int:
        """First-epoch steps of shard `shard` (known once the chain has reached it)."""
        return self.shard_sizes[shard] // self.global_batch_size

    @property
    def chain_steps(self) -> int:
        return sum(self.link_steps(k) for k in range(len(self.shard_sizes)))

    def add_shard(self, shard: int, usable: int) -> range:
        """Record shard `shard`'s usable sequences; the steps its link trains."""
        if shard != len(self.shard_sizes):
            raise ValueError(
                f"shard {shard} follows {len(self.shard_sizes)} shards: links run in shard order"
            )
        start = self.chain_steps
        self.shard_sizes.append(usable)
        return range(start, min(self.chain_steps, self.total_steps))

    def shard_of(self, step: int) -> int:
        """The shard whose first-epoch steps include `step` (a step of the chain)."""
        end = 0
        for shard in range(len(self.shard_sizes)):
            end += self.link_steps(shard)
            if step < end:
                return shard
        raise ValueError(f"step {step} is after the chain's {end} steps")

    def link_batch(self, shard: int, step: int) -> list[int]:
        """Indices into shard `shard`'s sequences that first-epoch step `step` reads."""
        before = sum(self.link_steps(k) for k in range(shard))
        i = step - before
        if not 0 <= i < self.link_steps(shard):
            raise ValueError(f"step {step} is not one of shard {shard}'s first-epoch steps")
        order = shuffled(self.shard_sizes[shard], "first epoch", self.seed, shard)
        return order[i * self.global_batch_size : (i + 1) * self.global_batch_size]

    def rest_steps(self) -> range:
        """The steps after the chain: the remaining epochs over every shard."""
        return range(min(self.chain_steps, self.total_steps), self.total_steps)

    def rest_batch(self, step: int) -> tuple[int, list[int]]:
        """(epoch, indices into every shard's sequences in shard order) of a step after the
        chain."""
        usable = sum(self.shard_sizes)
        per_epoch = usable // self.global_batch_size
        if per_epoch == 0:
            raise SystemExit(
                f"{usable} usable sequences are fewer than drafter.global_batch_size="
                f"{self.global_batch_size}: lower it or add data"
            )
        epoch, i = divmod(step - self.chain_steps, per_epoch)
        order = shuffled(usable, "epoch", self.seed, epoch + 1)
        batch = order[i * self.global_batch_size : (i + 1) * self.global_batch_size]
        return epoch + 1, batch

    def state(self) -> dict[str, object]:
        return {
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "total_steps": self.total_steps,
            "shard_sizes": list(self.shard_sizes),
        }

    @classmethod
    def from_state(cls, state: dict[str, object]) -> StepPlan:
        return cls(
            int(state["global_batch_size"]),  # type: ignore[arg-type]
            int(state["seed"]),  # type: ignore[arg-type]
            int(state["total_steps"]),  # type: ignore[arg-type]
            [int(n) for n in state["shard_sizes"]],  # type: ignore[union-attr]
        )


@dataclass
class CallSteps:
    """The run's plan as one call sees it: the steps it trains, and where each shard it reads
    begins among the loaded sequences (`ExtractedData.offsets`)."""

    run_plan: StepPlan
    steps: range
    first_sequence: dict[int, int]  # shard -> index of its first loaded sequence

    @classmethod
    def of(
        cls, mode: TrainingMode, start: StepPlan, sizes: list[int], offsets: list[int]
    ) -> CallSteps:
        """`mode`'s steps, from the plan it starts from (the previous link's, or a fresh one;
        extended in place) and the usable sequences of each folder it reads (`sizes`)."""
        if mode.link is not None:
            (usable,), (offset,) = sizes, offsets
            return cls(start, start.add_shard(mode.link, usable), {mode.link: offset})
        every_shard = dict(enumerate(offsets))  # the folders are every shard, in order
        if mode.after_chain:
            if start.shard_sizes != sizes:
                raise SystemExit(
                    f"the packs hold {sizes} usable sequences per shard, the chain trained on "
                    f"{start.shard_sizes}: a shard changed after its link trained on it; rerun "
                    "its extraction and the chain from there"
                )
            return cls(start, start.rest_steps(), every_shard)
        for shard, usable in enumerate(sizes):
            start.add_shard(shard, usable)
        return cls(start, range(0, start.total_steps), every_shard)

    def batch(self, step: int) -> tuple[int, list[int]]:
        """(epoch, indices into the loaded sequences) of `step`."""
        plan = self.run_plan
        if step < plan.chain_steps:
            shard = plan.shard_of(step)
            base = self.first_sequence[shard]
            return 0, [base + i for i in plan.link_batch(shard, step)]
        return plan.rest_batch(step)  # the loaded data is every shard, in order
