"""`python -m qarl.export.vllm_probe REQUEST.json`: load an export in vLLM, write prompt log-probs.

Run by the verifier in a subprocess (vLLM changes process-wide state: threads, signal handlers).
REQUEST holds {"model": dir, "prompts": [[token ids]], "dtype": ...} and, optionally, the engine's
"gpu_memory_utilization" (vLLM's default otherwise) and "kv_cache_dtype" ("fp8": the export's FP8 KV cache); the
answer, next to it in answer.json, holds for each prompt and each position i >= 1 the full log-prob distribution of
token i, the KV cache's dtype as vLLM started it ("auto": the model's dtype) and the kernels of its quantized layers
(qarl/generation/served_export.py: a W4A4 export in its trained format, or refused).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(request_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from qarl.export.targets import config_scheme
    from qarl.generation import served_export
    from qarl.generation.vllm_compat import in_process_worker, kv_cache_dtype, runner_model, worker_runner

    request = json.loads(Path(request_path).read_text())
    config = json.loads((Path(request["model"]) / "config.json").read_text())
    vocab = int(config["vocab_size"])
    scheme = config_scheme(config)
    llm = LLM(model=request["model"], dtype=request["dtype"], enforce_eager=True, max_model_len=128,
              max_logprobs=vocab, seed=0, **{key: request[key] for key in ("gpu_memory_utilization", "kv_cache_dtype")
                                             if key in request}, **served_export.engine_options(scheme))
    model = runner_model(worker_runner(in_process_worker(llm)))
    kernels = served_export.served_kernels(scheme, model, request["model"])
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in request["prompts"]],
                           SamplingParams(max_tokens=1, prompt_logprobs=vocab), use_tqdm=False)
    logprobs = [[{str(t): lp.logprob for t, lp in position.items()} for position in out.prompt_logprobs[1:]]
                for out in outputs]
    (Path(request_path).parent / "answer.json").write_text(json.dumps({"logprobs": logprobs,
                                                                       "kv_cache_dtype": kv_cache_dtype(llm),
                                                                       "layer_kernels": kernels}))


if __name__ == "__main__":
    main(sys.argv[1])
