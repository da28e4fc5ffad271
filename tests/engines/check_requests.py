"""Run request bodies through the pinned engines' own request validation (executed by the
engines' Python: tests/engines/test_engine_requests.py feeds it JSON on stdin).

Input: `{"sglang": [bodies], "vllm": [bodies], "vocab_size": n}`. Output: one JSON object with
a list of errors (None when accepted) per engine.

SGLang `POST /generate`, as its server checks a body before the scheduler sees it:
- `generate_contract_error(body)` (sglang.api.v1's generated decoder), the `/generate` schema
  gate, which refuses unknown keys (sampling keys included) with HTTP 400;
- `SamplingParams(**sampling_params)`, `.normalize(None)` (no tokenizer: the server runs with
  `--skip-tokenizer-init`) and `.verify(vocab_size)`, as `_create_tokenized_object` does.
Not run: FastAPI's conversion of the JSON into `GenerateReqInput` (sglang.srt.managers.io_struct).
Importing io_struct reaches `torchvision.transforms` (through sglang.srt.configs), and PyPI's
torchvision links CUDA (libtorch_cuda.so), so it does not import on a CPU machine; a stub of it
would make transformers believe torchvision is there and break transformers' own imports.
The contract gate above checks the same body against the schema both of SGLang's servers use.
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
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.sampling.sampling_params import SamplingParams

    contract = generate_contract_error(body)
    if contract is not None:
        return f"/generate contract: {contract}"
    try:
        params = SamplingParams(**body.get("sampling_params") or {})
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
