"""`python -m tests.helpers.lmeval_run`: both local capitals tasks through lm-eval's own Python API in one
process, scores as one JSON line on stdout.

NOTE: not the `lm_eval` CLI: it indexes every task lm-eval ships (~17 s of one core per run, most of a run
on this box) before it reads --include_path; TaskManager(include_defaults=False) reads ours only. The models
(`local-completions`, `local-chat-completions`), the evaluator and the metrics are lm-eval's, unchanged."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--tasks-dir", required=True)
    args = p.parse_args(argv)

    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=args.tasks_dir, include_defaults=False)
    runs = {  # task: (lm-eval model, route, apply the chat template)
        "saaf_capitals_mc": ("local-completions", "/v1/completions", False),
        "saaf_capitals_gen": ("local-chat-completions", "/v1/chat/completions", True),
    }
    scores: dict[str, float] = {}
    for task, (kind, route, chat) in runs.items():
        model_args = {"model": args.model, "base_url": args.base_url + route, "tokenizer_backend": "huggingface",
                      "tokenizer": args.tokenizer, "num_concurrent": 2, "max_retries": 1, "timeout": 120}
        # NOTE: bootstrap_iters=0: no stderr estimates (never compared; 100,000 resamples cost seconds)
        out = lm_eval.simple_evaluate(model=kind, model_args=model_args, tasks=[task], task_manager=tasks,
                                      batch_size=1, apply_chat_template=chat, bootstrap_iters=0,
                                      log_samples=False)
        for k, v in out["results"][task].items():
            if isinstance(v, float | int) and "stderr" not in k and k != "alias":
                scores[f"{task}/{k}"] = float(v)
    print(json.dumps(scores), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
