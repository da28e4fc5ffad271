"""The extraction tests' settings for the tiny random Qwen3 (helpers/tiny_qwen3.py): shared by
the tests and the killed extraction they run in a subprocess."""

from __future__ import annotations

from draftline.drafter.extraction import ExtractSettings

LAYER_IDS = [1, 2, 4]
MAX_LENGTH = 100


def settings(features: str = "offline", max_length: int = MAX_LENGTH) -> ExtractSettings:
    return ExtractSettings(
        features=features, max_length=max_length, target_layer_ids=LAYER_IDS,
        model_ref="tiny-test", hidden_size=32, pack_tokens=300, tokens_per_batch=256,
    )  # fmt: skip
