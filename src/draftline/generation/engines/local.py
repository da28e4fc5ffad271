"""The local engine: transformers `generate` in this process, batched, on CPU or GPU.

Submitted prompts wait in a queue; each `results` call runs one batch, the `batch_size`
shortest queued prompts (by length, then id, so left padding stays small), and returns its
results. `max_in_flight` is the batch size: the scheduler keeps one batch's worth submitted, so
a conversation's next turn rides in the next batch. Generation stops at the end-of-turn token
or the model's EOS (`stop_ids`, the rule of every engine), stored with the stop token; a turn
capped by the context length (`Request.max_new_tokens`) is cut at its own cap, so it holds the
same tokens as a server engine that stopped there.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from draftline.core.continuation import continue_batch
from draftline.core.loss_mask import cut_at_stop
from draftline.generation.engines.base import (
    OnResult,
    Request,
    Result,
    Sampling,
    generate_all,
    stop_ids,
)
from draftline.runtime.hardware import Execution


class LocalEngine:
    name = "local"

    def __init__(
        self,
        model: Any,
        sampling: Sampling,
        end_of_turn: int,
        pad_token_id: int | None = None,
        batch_size: int = 16,
        eos: int | None = None,
    ) -> None:
        self.model = model
        self.sampling = sampling
        self.end_of_turn = end_of_turn
        self.stop_ids = stop_ids(end_of_turn, eos)
        self.pad_token_id = end_of_turn if pad_token_id is None else pad_token_id
        self.batch_size = max(1, int(batch_size))
        self.calls = 0  # batches run, for tests and metrics
        self.queue: list[Request] = []

    @property
    def max_in_flight(self) -> int:
        return self.batch_size

    @classmethod
    def from_config(
        cls,
        model_cfg: dict[str, Any],
        sampling: Sampling,
        tokenizer: Any,
        end_of_turn: int,
        hardware: dict[str, Any],
    ) -> LocalEngine:
        import torch

        from draftline.core.target import load_model

        execution = Execution.of(hardware)
        execution.set_threads()
        device = execution.device
        if execution.on_gpu and not torch.cuda.is_available():
            raise SystemExit(
                f"hardware profile {hardware.get('name')!r} wants {device} but no GPU is visible: "
                "use hardware=cpu (or hardware=auto)"
            )
        lm = load_model(model_cfg, device=device, dtype=execution.precision)
        return cls(
            lm,
            sampling,
            end_of_turn,
            tokenizer.pad_token_id,
            execution.local_batch_size,
            eos=model_cfg.get("eos_token_id"),
        )

    def identity(self) -> str:
        import transformers

        return f"local:transformers-{transformers.__version__}"

    def submit(self, requests: Sequence[Request]) -> None:
        self.queue.extend(requests)

    def results(self) -> list[Result]:
        """Run the next batch: the shortest queued prompts (the order of submission, priority
        included, does not change which prompts share a batch once all are queued)."""
        if not self.queue:
            return []
        self.queue.sort(key=lambda r: (len(r.prompt_ids), r.id))
        batch, self.queue = self.queue[: self.batch_size], self.queue[self.batch_size :]
        return self._generate_batch(batch)

    def generate(self, requests: Sequence[Request], on_result: OnResult) -> None:
        generate_all(self, requests, on_result)

    def close(self) -> None:
        self.model = None
        self.queue = []

    def _generate_batch(self, batch: Sequence[Request]) -> list[Result]:
        import torch

        self.calls += 1
        s = self.sampling
        sampling = None
        if s.temperature > 0:
            sampling = {"temperature": s.temperature, "top_p": s.top_p, "top_k": max(s.top_k, 0)}
            # Seeded by the batch's first id so a resumed shard samples the same way.
            torch.manual_seed(s.seed ^ zlib.crc32(batch[0].id.encode()))
        prompts = [r.prompt_ids for r in batch]
        caps = [s.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens for r in batch]
        try:
            new_tokens = continue_batch(
                self.model, prompts, max(caps), self.stop_ids, self.pad_token_id, sampling
            )
        except (RuntimeError, ValueError) as exc:  # e.g. out of memory: record, never drop
            return [Result(id=r.id, error=f"local generate failed: {exc}") for r in batch]
        results = []
        for request, ids, cap in zip(batch, new_tokens, caps, strict=True):
            completion, stopped = cut_at_stop(ids[:cap], self.stop_ids)
            results.append(
                Result(
                    id=request.id,
                    completion_ids=completion,
                    finish_reason="stop" if stopped else "length",
                )
            )
        return results
