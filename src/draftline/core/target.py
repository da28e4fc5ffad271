"""The target model: loading its tokenizer and weights, and rendering prompts to token ids.

Prompts are rendered once, by the target tokenizer's own chat template with the generation
prompt and the model profile's template kwargs (e.g. enable_thinking); every stage uses this.
"""

from __future__ import annotations

import hashlib
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any


def model_ref(model: dict[str, Any]) -> str:
    """Identity of the target as recorded with outputs: path plus revision when pinned."""
    rev = model.get("revision")
    return f"{model['path']}@{rev}" if rev else str(model["path"])


def weights_id(model: dict[str, Any]) -> str | None:
    """The weights the engine loads, as generation journals are keyed on, computed now.

    A local folder: its `target_id` (a hash of its files), so a changed tensor is another
    target even in the same folder. A hub id pinned to a commit: the id and commit. A hub id
    unpinned (or at a branch or tag): the commit the local Hugging Face cache resolves it to
    (what an offline load reads), None when the cache has no such ref: then nothing can tell
    today's weights from yesterday's.
    """
    import re

    path, revision = str(model["path"]), model.get("revision")
    if is_local(path):
        return target_id(path)
    if revision and re.fullmatch(r"[0-9a-f]{40}", str(revision)):
        return f"hub:{path}@{revision}"
    commit = cached_commit(path, str(revision or "main"))
    return f"hub:{path}@{commit}" if commit else None


def served_checkpoint(model: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint the inference servers load: `model.serving.checkpoint` (`path` and
    `revision`, e.g. a pre-quantized copy of the target such as Qwen/Qwen3.6-27B-FP8) when
    the profile names one, else the target itself. Training and extraction always load the
    target's own weights (`model.path`)."""
    checkpoint = (model.get("serving") or {}).get("checkpoint")
    if checkpoint:
        return {"path": str(checkpoint["path"]), "revision": checkpoint.get("revision")}
    return {"path": str(model["path"]), "revision": model.get("revision")}


def served_weights_id(model: dict[str, Any]) -> str:
    """The served checkpoint as the samples' engine identity records it: `weights_id` of it,
    so the identity says which weights wrote the tokens. One that cannot be identified (a hub
    id at a branch the local cache does not hold) gets an id of its own each run, so nothing
    it wrote is ever resumed as another's, and a line says how to fix it."""
    served = served_checkpoint(model)
    weights = weights_id(served)
    if weights is None:
        print(
            f"model.serving.checkpoint {model_ref(served)} is a hub id at no fixed commit and "
            "not in the local Hugging Face cache: its tokens resume no journal. Pin its "
            "revision to a commit"
        )
        weights = f"unidentified:{uuid.uuid4().hex}"
    return weights


CHUNK = 1 << 20


def target_id(path: str, revision: str | None = None) -> str:
    """Identity of the target's weights, independent of where they are stored.

    A local folder: sha256 over the relative names and bytes of its files (config, tokenizer,
    chat template, weights), so a copy elsewhere has the same id and one changed byte a new one.
    A hub id: the id and its revision (a pinned revision names fixed weights).
    """
    folder = Path(str(path))
    if not folder.is_dir():
        return f"hub:{path}@{revision or 'unpinned'}"
    digest = hashlib.sha256()
    files = sorted(
        p for p in folder.rglob("*") if p.is_file() and not _hidden(p.relative_to(folder))
    )
    for file in files:
        digest.update(file.relative_to(folder).as_posix().encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        digest.update(b"\0")
    return f"sha256:{digest.hexdigest()[:16]}"


def _hidden(rel: Path) -> bool:
    # .cache/ and .git/ hold download state, not the model.
    return any(part.startswith(".") for part in rel.parts)


def cached_commit(repo_id: str, ref: str) -> str | None:
    """The commit the local Hugging Face cache resolves `ref` of model `repo_id` to."""
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.file_download import repo_folder_name

    refs = Path(HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "refs"
    try:
        commit = (refs / ref).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return commit or None


def is_local(path: str) -> bool:
    """Whether model.path names a folder here rather than a hub id (`org/name`): absolute or
    ./~ paths, paths that exist, more than two parts, or a first part that is a folder here
    (`models/tiny-target`)."""
    p = Path(path).expanduser()
    return (
        path.startswith((".", "~", "/"))
        or p.exists()
        or len(p.parts) > 2
        or Path(p.parts[0]).is_dir()
    )


def missing_model(model: dict[str, Any]) -> str | None:
    """Why model.path cannot be loaded from this machine, with the fix; None when it can
    (a hub id is left to the hub and its cache)."""
    path = str(model["path"])
    if not is_local(path):
        return None
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        return _broken_file(folder)
    what = "does not exist" if not folder.exists() else "has no config.json"
    return (
        f"model.path {path} {what}: point it at a Hugging Face model folder or hub id "
        f"(`draftline compose model={model.get('name')} model.path=/path/to/model` "
        f"or path in conf/model/{model.get('name')}.yaml)"
    )


# The JSON files of a model folder: one cut short by an interrupted copy fails here in one line,
# not as a JSONDecodeError deep inside transformers.
MODEL_JSON_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "model.safetensors.index.json",
)


def _broken_file(folder: Path) -> str | None:
    import json

    for name in MODEL_JSON_FILES:
        file = folder / name
        if not file.is_file():
            continue
        try:
            json.loads(file.read_bytes())
        except (ValueError, UnicodeDecodeError) as err:
            return (
                f"model.path {folder}: {name} is not valid JSON ({err}), so the folder is cut "
                f"short or corrupt: copy it again, or download it again (`hf download ORG/NAME "
                f"--local-dir {folder}`)"
            )
    return None


def require_model(model: dict[str, Any]) -> None:
    """Exit with one line naming the fix when model.path is a missing local folder."""
    if message := missing_model(model):
        raise SystemExit(message)


@lru_cache(maxsize=4)
def _load_tokenizer(path: str, revision: str | None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, revision=revision)


def load_tokenizer(model: dict[str, Any]) -> Any:
    require_model(model)
    return _load_tokenizer(str(model["path"]), model.get("revision"))


def load_model(model: dict[str, Any], device: str = "cpu", dtype: str = "fp32") -> Any:
    """The target as a frozen text-only causal LM, in `dtype`, on `device`.

    `AutoModelForCausalLM` resolves a vision-language checkpoint such as Qwen3.6
    (`Qwen3_5ForConditionalGeneration` on disk) to its text class (`Qwen3_5ForCausalLM`), which
    skips the vision tower and the MTP head (`model.visual.*`, `mtp.*`) when loading. Weights are
    read in `dtype` (never materialised in fp32 first) and, on an accelerator, placed on the
    device directly instead of through a host copy.
    """
    import torch
    from transformers import AutoModelForCausalLM

    require_model(model)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"precision {dtype!r}: use one of {sorted(dtypes)}")
    placement = {} if str(device) == "cpu" else {"device_map": str(device)}
    lm = AutoModelForCausalLM.from_pretrained(
        str(model["path"]), revision=model.get("revision"), dtype=dtypes[dtype], **placement
    )
    lm.requires_grad_(False)
    return lm.to(device).eval()


def render_prompt(tokenizer: Any, messages: list[dict[str, str]], template_kwargs: dict) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
    )


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]], template_kwargs: dict) -> list[int]:
    """Token ids of the rendered prompt (chat template + generation prompt), no extra specials."""
    text = render_prompt(tokenizer, messages, template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def thinking_mode(sample_id: str, share: float) -> bool:
    """Whether this sample is generated with thinking on when a `share` of them are
    (`data.thinking_share`): a function of the id alone, so every node and rerun agrees."""
    if share >= 1.0:
        return True
    if share <= 0.0:
        return False
    digest = hashlib.sha256(f"thinking:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def sample_template_kwargs(template_kwargs: dict, sample_id: str, share: float) -> dict:
    """The template kwargs of one sample: the model's, with thinking turned off for the ids
    `thinking_mode` leaves out. A template without `enable_thinking` is left as it is."""
    if not template_kwargs.get("enable_thinking") or share >= 1.0:
        return dict(template_kwargs)
    return {**template_kwargs, "enable_thinking": thinking_mode(sample_id, share)}


def special_token_id(tokenizer: Any, token: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ValueError(f"token {token!r} is not in the target tokenizer's vocabulary")
    return int(tid)


def hybrid_kernels_missing() -> list[str]:
    """The fast kernels of hybrid (Gated DeltaNet) layers that are not installed: without them
    transformers runs those layers on a slow torch fallback (`pip install -e '.[hybrid]'`)."""
    from transformers.utils import import_utils

    wanted = {
        "flash-linear-attention": import_utils.is_flash_linear_attention_available,
        "causal-conv1d": import_utils.is_causal_conv1d_available,
    }
    return [name for name, available in wanted.items() if not available()]
