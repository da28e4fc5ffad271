"""The drafter checkpoint in the DFlash format that SGLang, vLLM and the reference load.

A folder with `config.json` (`architectures: ["DFlashDraftModel"]`, `model_type: "qwen3"`,
`block_size`, `dflash_config: {mask_token_id, target_layer_ids}`, shapes, rope fields) and
`model.safetensors` with the drafter's own weights only (`fc`, `hidden_norm`, `layers.*`,
`norm`): no embedding and no lm_head, the serving engine takes those from the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftline.drafter.dflash import DFlashConfig, DFlashDrafter, TargetHead
from draftline.runtime.atomic import atomic_path, write_safetensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def export_drafter(
    drafter: DFlashDrafter, folder: str | Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write the checkpoint folder atomically (a reader sees the old folder or the new one)."""
    weights = {
        name: tensor.detach().to("cpu", dtype).contiguous()
        for name, tensor in drafter.state_dict().items()
    }
    leaked = [n for n in weights if "embed" in n or "lm_head" in n]
    if leaked:
        raise RuntimeError(f"the drafter must not own target weights, found {leaked}")
    config = {**drafter.config.to_json_dict(), "dtype": DTYPE_NAMES[dtype]}
    with atomic_path(folder) as tmp:
        tmp.mkdir()
        (tmp / CONFIG_FILE).write_text(
            json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )
        write_safetensors(tmp / WEIGHTS_FILE, weights, metadata={"format": "pt"})
    return Path(folder)


def load_drafter(folder: str | Path, target: TargetHead) -> DFlashDrafter:
    """The exported drafter, back as a `DFlashDrafter` in fp32 and eval mode."""
    folder = Path(folder)
    config = DFlashConfig.from_json_dict(
        json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    )
    drafter = DFlashDrafter(config, target)
    weights = {k: v.float() for k, v in load_file(str(folder / WEIGHTS_FILE)).items()}
    drafter.load_state_dict(weights, strict=True)
    return drafter.eval()
