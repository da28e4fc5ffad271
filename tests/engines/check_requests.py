"""Run request bodies through the pinned engines' own request validation (executed by the
engines' Python: tests/engines/test_engine_requests.py feeds it JSON on stdin).

Input: `{"sglang": [bodies], "vllm": [bodies], "vocab_size": n}`. Output: one JSON object with
a list of errors (None when accepted) per engine.

SGLang `POST /generate`, in the order its server applies them:
- FastAPI turns the JSON into `GenerateReqInput` (pydantic validation of the dataclass);
- `generate_contract_error(body)`, the `/generate` schema gate (sglang/api/v1), which refuses
  unknown keys, sampling keys included, with HTTP 400;
- `GenerateReqInput.normalize_batch_and_arguments()`, as the tokenizer manager does;
- `SamplingParams(**sampling_params)`, `.normalize(None)` (no tokenizer: the server runs with
  `--skip-tokenizer-init`) and `.verify(vocab_size)`, as `_create_tokenized_object` does.
vLLM `POST /v1/completions`:
- `CompletionRequest.model_validate(body)` (pydantic with vLLM's validators); a key it does
  not know is only logged and ignored there, so any is an error here;
- `request.to_sampling_params(max_tokens)`, building vLLM's `SamplingParams` (its checks run
  in `__post_init__`, on CPU).
"""

from __future__ import annotations

import json
import sys
import traceback


def _error(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def check_sglang(body: dict, vocab_size: int) -> str | None:
    from pydantic import TypeAdapter
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    try:
        request = TypeAdapter(GenerateReqInput).validate_python(body)
    except Exception as exc:
        return f"GenerateReqInput: {_error(exc)}"
    contract = generate_contract_error(body)
    if contract is not None:
        return f"/generate contract: {contract}"
    try:
        request.normalize_batch_and_arguments()
        params = SamplingParams(**request.sampling_params)
        params.normalize(None)
        params.verify(vocab_size)
    except Exception as exc:
        return f"SamplingParams: {_error(exc)}"
    return None


def check_vllm(body: dict) -> str | None:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    known = set(CompletionRequest.model_fields)
    known |= {f.alias for f in CompletionRequest.model_fields.values() if f.alias}
    ignored = sorted(set(body) - known)
    if ignored:
        return f"CompletionRequest ignores {ignored}"
    try:
        request = CompletionRequest.model_validate(body)
    except Exception as exc:
        return f"CompletionRequest: {_error(exc)}"
    try:
        request.to_sampling_params(max_tokens=int(body["max_tokens"]))
    except Exception as exc:
        return f"SamplingParams: {_error(exc)}"
    return None


def main() -> int:
    data = json.load(sys.stdin)
    out = {
        "sglang": [check_sglang(b, int(data["vocab_size"])) for b in data.get("sglang", [])],
        "vllm": [check_vllm(b) for b in data.get("vllm", [])],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
