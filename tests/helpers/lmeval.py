"""lm-eval (PyPI `lm-eval`) against an OpenAI endpoint on 127.0.0.1, on the local capitals tasks in
tests/data/lmeval (nothing downloaded): `local-completions` scores a multiple-choice task by loglikelihood
(echo + logprobs), `local-chat-completions` a generation task through the chat template. One process
(tests/helpers/lmeval_run.py) runs both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data" / "lmeval"
REPO = Path(__file__).resolve().parents[2]
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
    tmp.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                        "NO_PROXY": "127.0.0.1,localhost"}
    cmd = [sys.executable, "-m", "tests.helpers.lmeval_run", "--base-url", base_url, "--model", model,
           "--tokenizer", str(tokenizer_dir), "--tasks-dir", str(_tasks(tmp))]
    with open(tmp / "lmeval.log", "w+") as log:  # NOTE: a file never fills up like a pipe
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
    assert lines, f"lm-eval printed no scores:\n{log.name}"
    return json.loads(lines[-1])
