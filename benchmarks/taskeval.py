"""Task accuracy with known answers: lm-eval (PyPI `lm-eval`) on the local capitals tasks of
benchmarks/evalset/capitals (20 countries, nothing downloaded) against an OpenAI endpoint on 127.0.0.1.
`local-completions` scores a multiple-choice task by loglikelihood (echo + logprobs), `local-chat-completions`
a generation task through the chat template (greedy, exact match of the capital).

    python -m benchmarks.taskeval --base-url http://127.0.0.1:8000 --model NAME --tokenizer MODEL_DIR

prints {task/metric: score} as one JSON line; `run_taskeval` runs it in a child process (bounded).

NOTE: lm-eval's own Python API, not its CLI: the CLI indexes every task lm-eval ships (~17 s of one core per
run) before it reads --include_path; TaskManager(include_defaults=False) reads ours only. The models, the
evaluator and the metrics are lm-eval's, unchanged."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DATA = Path(__file__).resolve().parent / "evalset" / "capitals"
REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600
RUNS = {  # task: (lm-eval model, route, apply the chat template)
    "saaf_capitals_mc": ("local-completions", "/v1/completions", False),
    "saaf_capitals_gen": ("local-chat-completions", "/v1/chat/completions", True),
}


def write_tasks(out: Path) -> Path:
    """The task YAMLs with the data file's absolute path filled in, under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for f in DATA.glob("*.yaml"):
        (out / f.name).write_text(f.read_text().replace("__DATA__", str(DATA / "capitals.jsonl")))
    return out


def evaluate(base_url: str, model: str, tokenizer: str, tasks_dir: str) -> dict[str, float]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=tasks_dir, include_defaults=False)
    scores: dict[str, float] = {}
    for task, (kind, route, chat) in RUNS.items():
        model_args = {"model": model, "base_url": base_url + route, "tokenizer_backend": "huggingface",
                      "tokenizer": tokenizer, "num_concurrent": 2, "max_retries": 1, "timeout": 120}
        # NOTE: bootstrap_iters=0: no stderr estimates (never compared; 100,000 resamples cost seconds)
        out = lm_eval.simple_evaluate(model=kind, model_args=model_args, tasks=[task], task_manager=manager,
                                      batch_size=1, apply_chat_template=chat, bootstrap_iters=0, log_samples=False)
        for k, v in out["results"][task].items():
            if isinstance(v, float | int) and "stderr" not in k and k not in ("alias", "sample_len"):
                scores[f"{task}/{k}"] = float(v)
    return scores


def run_taskeval(base_url: str, model: str, tokenizer_dir: str | Path, tmp: Path | None = None) -> dict[str, float]:
    """{task/metric: score} for both tasks, from a child process (its imports and memory freed after)."""
    with contextlib.nullcontext(tmp) if tmp else tempfile.TemporaryDirectory(prefix="taskeval-") as scratch:
        work = Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                            "NO_PROXY": "127.0.0.1,localhost"}
        cmd = [sys.executable, "-m", "benchmarks.taskeval", "--base-url", base_url, "--model", model,
               "--tokenizer", str(tokenizer_dir), "--tasks-dir", str(write_tasks(work / "tasks"))]
        with open(work / "taskeval.log", "w+") as log:  # NOTE: a file never fills up like a pipe
            try:  # NOTE: subprocess.run kills its child (ours, by PID) when the timeout expires
                proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True,
                                      timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.seek(0)
                raise RuntimeError(f"lm-eval ran past {TIMEOUT_S} s:\n{log.read()[-3000:]}") from None
            log.seek(0)
            if proc.returncode != 0:
                raise RuntimeError(f"lm-eval failed ({proc.returncode}):\n{log.read()[-3000:]}")
            lines = proc.stdout.strip().splitlines()
            if not lines:
                raise RuntimeError(f"lm-eval printed no scores:\n{log.read()[-3000:]}")
        return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.taskeval", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="the endpoint, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--tokenizer", required=True, help="a local model directory with the tokenizer")
    p.add_argument("--tasks-dir", help="task YAMLs (default: written to a temporary folder)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="taskeval-") as tmp:
        tasks = args.tasks_dir or str(write_tasks(Path(tmp) / "tasks"))
        print(json.dumps(evaluate(args.base_url.rstrip("/"), args.model, args.tokenizer, tasks)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
