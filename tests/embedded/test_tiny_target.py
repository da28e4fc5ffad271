"""The embedded tiny target: loads with the Auto classes, renders Qwen3's chat format, answers the
bundled prompts in thinking format, and is what `draftline build-tiny-target` builds (bit for bit
on the same machine, within a float tolerance on another: `fixture_checks`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from helpers.fixture_checks import assert_rebuild_matches, assert_same_files

from draftline.core.target import prompt_ids
from draftline.embedded import sample_prompts, tiny_target

pytestmark = pytest.mark.float_kernels
torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="module")
def model(tiny_target_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()


@pytest.fixture(scope="module")
def tiny_conf(repo_root: Path) -> dict:
    return yaml.safe_load((repo_root / "conf/model/tiny.yaml").read_text(encoding="utf-8"))


def test_fixture_loads_and_matches_the_model_profile(model, tokenizer, tiny_conf: dict) -> None:
    from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

    assert isinstance(model, Qwen3ForCausalLM)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    cfg = model.config
    assert cfg.num_hidden_layers == tiny_conf["num_hidden_layers"] >= 8
    assert cfg.hidden_size == tiny_conf["hidden_size"]
    assert cfg.vocab_size == tiny_conf["vocab_size"] == len(tokenizer)
    assert sum(p.numel() for p in model.parameters()) == tiny_conf["num_parameters"]
    L, K = cfg.num_hidden_layers, 5
    assert tiny_conf["target_layer_ids"] == [round(1 + i * (L - 4) / (K - 1)) for i in range(K)]
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert tokenizer.convert_tokens_to_ids(tiny_conf["mask_token"]) == 5


def test_special_tokens_are_single_ids(tokenizer) -> None:
    for i, token in enumerate(tiny_target.SPECIAL_TOKENS):
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [i]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    # <think> survives skip_special_tokens, as in Qwen3; the turn markers do not.
    ids = tokenizer("<|im_start|><think>x</think><|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_any_unicode_text_round_trips(tokenizer) -> None:
    text = "Zoë's café: 猫, Мы, 🚀, \u200b, tab\there, é vs e\u0301"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids


def test_chat_template_thinking_on_and_off(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nsay hi\n</think>\n\nHello!"},
        {"role": "user", "content": "What is the opposite of hot?"},
    ]
    head = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"  # history loses its think block
        "<|im_start|>user\nWhat is the opposite of hot?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    render = tokenizer.apply_chat_template
    assert render(messages, tokenize=False, add_generation_prompt=True) == head
    assert (
        render(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True) == head
    )
    off = render(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == head + "<think>\n\n</think>\n\n"
    # The reply after the last user turn keeps its think block (training text).
    full = messages + [{"role": "assistant", "content": "<think>\nhot/cold\n</think>\n\ncold"}]
    assert render(full, tokenize=False) == head + "<think>\nhot/cold\n</think>\n\ncold<|im_end|>\n"
    with pytest.raises(Exception, match="unknown role"):
        render([{"role": "robot", "content": "x"}], tokenize=False)


def test_reply_format_check(tokenizer) -> None:
    def ok(text: str) -> bool:
        return tiny_target.reply_is_thinking_format(
            tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer
        )

    assert ok("<think>\nr\n</think>\n\nanswer<|im_end|>")
    assert not ok("<think>\n\n</think>\n\nanswer<|im_end|>")  # empty think block
    assert not ok("<think>\nr\n</think>\n\n<|im_end|>")  # empty answer
    assert not ok("<think>\nr\n</think>\n\nanswer")  # no end of turn
    assert not ok("answer<|im_end|>")  # no think block
    assert not ok("<think>\nr\nanswer<|im_end|>")  # think block never closed


def test_thinking_format_rate_on_the_bundled_prompts(model, tokenizer, tiny_conf: dict) -> None:
    prompts = sample_prompts.valid_prompts()
    rate = tiny_target.thinking_format_rate(model, tokenizer, prompts, tiny_conf["max_new_tokens"])
    assert rate >= 0.9, f"only {rate:.1%} of {len(prompts)} prompts answered in thinking format"


def test_a_random_weight_model_fails_the_rate(tokenizer, tiny_conf: dict) -> None:
    random_model = tiny_target.build_model(tiny_target.BuildConfig(seed=1), tokenizer).eval()
    prompts = sample_prompts.valid_prompts()[:32]
    assert tiny_target.thinking_format_rate(random_model, tokenizer, prompts, 48) < 0.5


def test_batched_generation_matches_one_by_one(model, tokenizer) -> None:
    prompts = sample_prompts.valid_prompts()[:6]
    ids = [prompt_ids(tokenizer, p, {"enable_thinking": True}) for p in prompts]
    batched = tiny_target.greedy_completions(model, tokenizer, ids, 96)
    single = [tiny_target.greedy_completions(model, tokenizer, [i], 96)[0] for i in ids]
    assert batched == single


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Slow (minutes): the embedded target rebuilt from code with its whole training run, the
    only way to show the committed fixture is what the code makes. Built once per module."""
    out = tmp_path_factory.mktemp("rebuild") / "tiny-target"
    tiny_target.build(out, progress=False)
    return out


@pytest.mark.rebuild
def test_rebuild_reproduces_the_committed_fixture(rebuilt: Path, tiny_target_dir: Path) -> None:
    """On any CPU: configs, tokenizer and template byte-identical, weights within tolerance (the
    float rounding of training differs between processors' kernels)."""
    assert_rebuild_matches(rebuilt, tiny_target_dir)


@pytest.mark.rebuild
def test_the_rebuilt_model_answers_in_thinking_format(rebuilt: Path, tiny_conf: dict) -> None:
    """Slow (~1.5 min): greedy answers to every bundled prompt, the rate the embedded default
    relies on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(rebuilt).eval()
    tokenizer = AutoTokenizer.from_pretrained(rebuilt)
    prompts = sample_prompts.valid_prompts()
    rate = tiny_target.thinking_format_rate(model, tokenizer, prompts, tiny_conf["max_new_tokens"])
    assert rate >= 0.9, f"the rebuilt model answers only {rate:.1%} in thinking format"


def test_a_rebuild_on_the_same_machine_is_byte_identical(tmp_path: Path) -> None:
    """Same software, same processor: every file, weights included, is bit for bit the same
    (a short build: determinism does not need the full training run; two builds, ~1.5 min)."""
    config = replace(tiny_target.BuildConfig(), steps=12, num_conversations=600)
    for name in ("a", "b"):
        tiny_target.build(tmp_path / name, config, progress=False)
    assert_same_files(tmp_path / "a", tmp_path / "b")
