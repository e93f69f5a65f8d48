"""Run vLLM's offline ``LLM.generate`` in a subprocess and return greedy token ids per prompt.

Usage from tests: ``offline_greedy(model_spec, prompts_token_ids, max_tokens)``. The subprocess keeps the
test process free of a second engine's memory and threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def offline_greedy(model: str, prompts: list[list[int]], max_tokens: int, max_model_len: int = 1024,
                   timeout_s: float = 300) -> list[list[int]]:
    with tempfile.TemporaryDirectory() as d:
        inp, out = os.path.join(d, "in.json"), os.path.join(d, "out.json")
        with open(inp, "w") as f:
            json.dump({"model": model, "prompts": prompts, "max_tokens": max_tokens,
                       "max_model_len": max_model_len}, f)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1")
        subprocess.run([sys.executable, "-m", "tests.helpers.offline", inp, out], env=env, check=True,
                       timeout=timeout_s, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def _main(inp: str, out: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from engine.models import resolve_model

    with open(inp) as f:
        job = json.load(f)
    llm = LLM(model=str(resolve_model(job["model"])), dtype="float32", enforce_eager=True,
              distributed_executor_backend="uni", kv_cache_memory_bytes=128 << 20,
              max_model_len=job["max_model_len"], seed=0)
    sp = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], sp, use_tqdm=False)
    with open(out, "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in outs], f)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
