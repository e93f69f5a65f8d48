"""lm-eval (PyPI `lm-eval`) against an OpenAI endpoint on 127.0.0.1, on the local capitals tasks in
tests/data/lmeval (nothing downloaded): `local-completions` scores a multiple-choice task by loglikelihood
(echo + logprobs), `local-chat-completions` a generation task through the chat template."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data" / "lmeval"
TIMEOUT_S = 600


def _tasks(tmp: Path) -> Path:
    """The task YAMLs with the data file's absolute path filled in."""
    out = tmp / "tasks"
    out.mkdir(parents=True, exist_ok=True)
    for f in DATA.glob("*.yaml"):
        (out / f.name).write_text(f.read_text().replace("__DATA__", str(DATA / "capitals.jsonl")))
    return out


def run_lmeval(base_url: str, model: str, tokenizer_dir: str | Path, tmp: Path) -> dict[str, float]:
    """{task/metric: score} for both tasks."""
    tasks = _tasks(tmp)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                        "NO_PROXY": "127.0.0.1,localhost"}
    runs = {
        "saaf_capitals_mc": ("local-completions", f"{base_url}/v1/completions", []),
        "saaf_capitals_gen": ("local-chat-completions", f"{base_url}/v1/chat/completions", ["--apply_chat_template"]),
    }
    # NOTE: both tasks at once: most of an lm-eval run is its own start-up (imports), one core each, while
    # the server idles; the two then share the server (num_concurrent=2 each). Scores do not depend on it.
    procs = {}
    for task, (kind, url, extra) in runs.items():
        out = tmp / f"out-{task}"
        args = (f"model={model},base_url={url},tokenizer_backend=huggingface,tokenizer={tokenizer_dir},"
                "num_concurrent=2,max_retries=1,timeout=120")
        cmd = [sys.executable, "-m", "lm_eval", "--model", kind, "--model_args", args, "--tasks", task,
               "--include_path", str(tasks), "--output_path", str(out), "--batch_size", "1", *extra]
        log = open(tmp / f"lmeval-{task}.log", "w+")  # NOTE: closed below; a file never fills up like a pipe
        procs[task] = (out, log, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True))
    scores: dict[str, float] = {}
    try:
        deadline = time.monotonic() + TIMEOUT_S
        for task, (out, log, proc) in procs.items():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            log.seek(0)
            text = log.read()
            if proc.returncode != 0:
                raise RuntimeError(f"lm-eval {task} failed ({proc.returncode}):\n{text[-3000:]}")
            files = sorted(out.rglob("results_*.json"))
            assert files, f"lm-eval wrote no results under {out}:\n{text[-2000:]}"
            results = json.loads(files[-1].read_text())["results"][task]
            for k, v in results.items():
                if isinstance(v, float | int) and "stderr" not in k and k != "alias":
                    scores[f"{task}/{k}"] = float(v)
    finally:
        for _, log, proc in procs.values():  # NOTE: ours, by PID: a failed or timed-out run leaves nothing behind
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
            log.close()
    return scores
