"""A drafter for a target: its hyperparameters, its config derived from the target's, the
target's embedding and lm_head (which the drafter shares, frozen), and the mask token id.

Used by training and by evaluation (the untrained baseline), so neither imports the other.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from draftline.drafter.dflash import DFlashConfig, DFlashDrafter, TargetHead
from draftline.drafter.dflash2 import FAMILIES, DFlash2Layout
from draftline.drafter.selector_objective import SelectorObjective
from draftline.runtime.config_schema import DRAFTER_LAYOUT_KEYS, DRAFTER_SHAPE_KEYS


@dataclass(frozen=True)
class Hyperparameters:
    """What is trained: the `drafter` params (never hardware)."""

    num_hidden_layers: int
    block_size: int
    gamma: float
    max_anchors: int
    global_batch_size: int
    lr: float
    weight_decay: float
    warmup_ratio: float
    epochs: int
    grad_clip: float
    seed: int
    # Attention/MLP shape; None derives it from the target (DFlashConfig.from_target).
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    # Attention per layer ("full_attention" / "sliding_attention"; None: all full), the sliding
    # layers' window and whether they attend causally inside the block: the layout of the
    # target's public drafters (model.dflash).
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    sliding_causal: bool | None = None
    # `drafter.family`: dflash, or dflash2 with its layout and selector objective (the
    # `conv_*`, `selector_*` params of its profiles).
    family: str = "dflash"
    dflash2: DFlash2Layout | None = None
    selector: SelectorObjective | None = None

    @classmethod
    def from_params(cls, drafter: dict[str, Any]) -> Hyperparameters:
        optional = (*DRAFTER_SHAPE_KEYS, *DRAFTER_LAYOUT_KEYS, "family", "dflash2", "selector")
        names = [n for n in cls.__dataclass_fields__ if n not in optional]
        missing = [n for n in names if n not in drafter]
        if missing:
            raise SystemExit(f"params drafter.* lacks {missing}: add them to conf/drafter/")
        values = {n: type(getattr(_DEFAULTS, n))(drafter[n]) for n in names}
        shape = {n: None if drafter.get(n) is None else int(drafter[n]) for n in DRAFTER_SHAPE_KEYS}
        layer_types = drafter.get("layer_types")
        window, causal = drafter.get("sliding_window"), drafter.get("sliding_causal")
        return cls(
            **values,
            **shape,
            layer_types=None if layer_types is None else tuple(str(t) for t in layer_types),
            sliding_window=None if window is None else int(window),
            sliding_causal=None if causal is None else bool(causal),
            **_family(drafter),
        )

    def identity(self) -> dict[str, Any]:
        """What a checkpoint is of (`training_setup.run_fingerprint`): a DFlash run's is what it was
        before there were families, so its checkpoints still resume."""
        values = asdict(self)
        if self.family == "dflash":
            for name in ("family", "dflash2", "selector"):
                values.pop(name)
        return values

    def shape(self) -> dict[str, Any]:
        """The shape and layout fields that are set (the rest derive from the target)."""
        set_fields = {n: getattr(self, n) for n in (*DRAFTER_SHAPE_KEYS, *DRAFTER_LAYOUT_KEYS)}
        if self.layer_types is not None:
            set_fields["layer_types"] = list(self.layer_types)
        return {n: v for n, v in set_fields.items() if v is not None}


def _family(drafter: dict[str, Any]) -> dict[str, Any]:
    family = str(drafter.get("family") or "dflash")
    if family not in FAMILIES:
        raise SystemExit(f"drafter.family={family!r}: one of {', '.join(FAMILIES)}")
    if family == "dflash":
        return {}
    missing = [n for n in (*DFLASH2_FIELDS, *SELECTOR_FIELDS) if drafter.get(n) is None]
    if missing:
        raise SystemExit(f"drafter.family=dflash2 needs drafter.{missing}: see conf/drafter/")
    defaults = SelectorObjective()
    selector = {f: type(getattr(defaults, f))(drafter[n]) for n, f in SELECTOR_FIELDS.items()}
    return {
        "family": family,
        "dflash2": DFlash2Layout(**{n: int(drafter[n]) for n in DFLASH2_FIELDS}),
        "selector": SelectorObjective(**selector),
    }


DFLASH2_FIELDS = tuple(DFlash2Layout.__dataclass_fields__)
SELECTOR_FIELDS = {f"selector_{f}": f for f in SelectorObjective.__dataclass_fields__}
_DEFAULTS = Hyperparameters(2, 8, 4.0, 64, 16, 3e-3, 0.0, 0.04, 1, 1.0, 0)


def target_config(model: dict[str, Any]) -> dict[str, Any]:
    """The target's (text) config as a dict, from a local folder or the hub cache."""
    path = Path(str(model["path"]))
    if (path / "config.json").exists():
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model["path"]), revision=model.get("revision"))
        config = config.to_dict()
    return config.get("text_config") or config


# Where the target's embedding sits: a causal LM's base model or a VL wrapper's language model.
# Never `mtp.*` (the MTP head has its own) or `model.visual.*`.
EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
HEAD_KEYS = ("lm_head.weight",)


def load_target_head(model: dict[str, Any]) -> TargetHead:
    """The target's embedding and lm_head only, read from its safetensors (tied if no head).

    Only the shards that hold them are opened (`model.safetensors.index.json` names them), and
    only those two tensors are read.
    """
    path = Path(str(model["path"]))
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = sorted({path / weight_map[k] for k in (*EMBED_KEYS, *HEAD_KEYS) if k in weight_map})
    embed = head = None
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            for key in EMBED_KEYS:
                if key in keys:
                    embed = f.get_tensor(key)
            for key in HEAD_KEYS:
                if key in keys:
                    head = f.get_tensor(key)
    if embed is None:
        from draftline.core.target import load_model

        return TargetHead.from_model(load_model(model))
    return TargetHead(embed_weight=embed, lm_head_weight=embed if head is None else head)


def mask_token_id(model: dict[str, Any]) -> int:
    if model.get("mask_token_id") is not None:
        return int(model["mask_token_id"])
    from draftline.core.target import load_tokenizer, special_token_id

    return special_token_id(load_tokenizer(model), str(model["mask_token"]))


def drafter_config(model: dict[str, Any], hp: Hyperparameters) -> DFlashConfig:
    """The drafter's shape for the target under `drafter` params."""
    return DFlashConfig.from_target(
        target_config(model),
        num_hidden_layers=hp.num_hidden_layers,
        block_size=hp.block_size,
        mask_token_id=mask_token_id(model),
        target_layer_ids=[int(i) for i in model["target_layer_ids"]],
        dflash2=hp.dflash2,
        **hp.shape(),
    )


def build_drafter(
    model: dict[str, Any], hp: Hyperparameters, head: TargetHead | None = None
) -> DFlashDrafter:
    """A freshly initialised drafter for the target, seeded by `drafter.seed`."""
    config = drafter_config(model, hp)
    torch.manual_seed(hp.seed)
    return DFlashDrafter(config, head if head is not None else load_target_head(model))
