"""One GPU run (issue 17): NIXL VRAM->VRAM through kvtransfer's agent vs a torch copy, and the catalog checked.

    python -m benchmarks.gpu_nixl [--out DIR] [--device auto|cuda|cpu] [--budget-s S] [--mode auto|...]
    python -m benchmarks.gpu_nixl --report RESULT.json     # the Markdown summary of a finished run

Steps, each recorded (status, seconds, error) in DIR/gpu_nixl.json, rewritten atomically after every step
and every NIXL row, so a run cut by its time limit still returns what it measured:
1. env: Python, torch, device, nixl wheel, UCX settings.
2. memory: copy / read / write bandwidth, next to the catalog's H200 entry (placement/catalog.py).
3. matmul: bf16 matrix product TFLOP/s, next to the catalog's.
4. decode_chain: the roofline's decode step for Llama-3.1-8B (placement.roofline) next to a measured
   torch chain of the step's linear layers (benchmarks.gpu_probe).
5. nixl: KV-shaped paged buffers of Llama-3.1-8B and -70B, slabs of 16 KiB to 2 MiB, READ between two
   processes through kvtransfer.nixl_agent (benchmarks.gpu_nixl_xfer), every transfer verified, with a
   torch copy of the same bytes in the same rounds; if two processes cannot (CUDA IPC refused), two
   agents in one process. `nixl.mode_ran` says which ran.
Without CUDA the same code runs on DRAM and the CPU (the test suite does that). Imports nothing that
needs pydantic, Ray, vLLM or PyYAML: the GPU box has torch, numpy and the carried nixl wheel only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks import gpu_nixl_xfer as xfer
from benchmarks.gpu_nixl_report import render_markdown
from placement.catalog import get_hardware, get_model

SCHEMA = "saaf-gpu-nixl/1"
CATALOG_HARDWARE = "h200"
DEFAULT_MODELS = ("llama-3.1-8b", "llama-3.1-70b")
DEFAULT_SLAB_KIB = (16, 32, 64, 128, 256, 512, 1024, 2048)
RESULT_NAME = "gpu_nixl.json"
# Per device: bytes per NIXL transfer, memory-test buffer, matmul n, chain model, repeats.
DEFAULTS = {
    "cuda": {"target_mib": 1024, "memory_mib": 4096, "matmul_n": 8192, "chain_model": "llama-3.1-8b",
             "repeats": 7, "first_row_timeout_s": 120.0},
    "cpu": {"target_mib": 64, "memory_mib": 256, "matmul_n": 512, "chain_model": "smollm2-135m",
            "repeats": 3, "first_row_timeout_s": 60.0},
}


class Recorder:
    """The run's JSON document, rewritten atomically (tmp + rename) whenever it changes."""

    def __init__(self, path: Path, doc: dict[str, Any]) -> None:
        self.path = path
        self.doc = doc
        self.t0 = time.monotonic()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def write(self) -> None:
        self.doc["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.doc["elapsed_s"] = round(time.monotonic() - self.t0, 3)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Record a step's status and time; an exception is recorded, not raised (later steps still run)."""
        entry: dict[str, Any] = {"status": "running"}
        self.doc["steps"][name] = entry
        self.write()
        t0 = time.monotonic()
        try:
            yield
            entry["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - one failed step must not lose the others
            entry["status"] = "error"
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-2000:]
            print(f"[gpu_nixl] step {name} failed: {entry['error']}", file=sys.stderr)
        except BaseException:  # SIGTERM from the time limit, Ctrl-C
            entry["status"] = "cut"
            raise
        finally:
            entry["seconds"] = round(time.monotonic() - t0, 3)
            self.write()
            print(f"[gpu_nixl] step {name}: {entry['status']} in {entry['seconds']:.1f} s", file=sys.stderr)


# ---- NIXL attempts ----------------------------------------------------------------------------------


class AttemptFailed(Exception):
    pass


def _recv(conn: Any, until: float, what: str, proc: Any) -> Any:
    left = until - time.time()
    if left <= 0 or not conn.poll(left):
        raise AttemptFailed(f"no answer from the {what} in time (process alive: {proc.is_alive()})")
    try:
        return conn.recv()
    except EOFError:
        proc.join(timeout=5)
        raise AttemptFailed(f"the {what} process exited (code {proc.exitcode})") from None


def run_attempt(spec: xfer.XferSpec, attempt: dict[str, Any], first_row_timeout_s: float,
                on_row: Callable[[dict[str, Any]], None]) -> None:
    """One try at the NIXL rows in child processes, recorded into `attempt` as it goes; raises nothing
    but BaseException (a cut run)."""
    ctx = mp.get_context("spawn")
    mode = attempt["mode"]
    one_process = mode == "one_process"
    attempt.update(rows=0, error=None)
    procs: list[Any] = []
    src_conn = dst_conn = None
    t0 = time.time()
    first_until = min(spec.deadline + 30, t0 + first_row_timeout_s)
    try:
        dst_conn, child = ctx.Pipe()
        dst = ctx.Process(target=xfer.dest_main, args=(child, spec, one_process), daemon=True)
        if not one_process:
            src_conn, src_child = ctx.Pipe()
            src = ctx.Process(target=xfer.source_main, args=(src_child, spec), daemon=True)
            src.start()
            procs.append(src)
        dst.start()
        procs.append(dst)
        if src_conn is not None:
            published = _recv(src_conn, first_until, "source (prefill side)", src)
            if published[0] == "error":
                raise AttemptFailed(f"source: {published[1]}")
        ready = _recv(dst_conn, first_until, "destination (decode side)", dst)
        if ready[0] == "error":
            raise AttemptFailed(f"destination: {ready[1]}")
        attempt["ready"] = ready[1]
        attempt["ready_s"] = round(time.time() - t0, 3)
        if src_conn is not None:
            dst_conn.send(("peer", published[1], published[2]))
        until = first_until
        while True:
            msg = _recv(dst_conn, until, "destination (decode side)", dst)
            if msg[0] == "row":
                attempt["rows"] += 1
                attempt.setdefault("first_row_s", round(time.time() - t0, 3))
                on_row({**msg[1], "mode": mode})
                # NOTE: a row only has to start before the deadline, but a stalled one must not eat the run.
                until = min(spec.deadline + 30, time.time() + first_row_timeout_s)
            elif msg[0] == "skip":
                attempt["skipped"] = msg[1]
            elif msg[0] == "error":
                raise AttemptFailed(f"destination: {msg[1]}")
            elif msg[0] == "done":
                break
    except AttemptFailed as exc:
        attempt["error"] = str(exc)
    finally:
        for conn in (src_conn, dst_conn):
            try:
                if conn is not None:
                    conn.send(("stop",))
            except OSError:  # that child is gone already
                pass
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        attempt["exitcodes"] = [p.exitcode for p in procs]
        attempt["seconds"] = round(time.time() - t0, 3)


def run_nixl(rec: Recorder, spec: xfer.XferSpec, mode: str, first_row_timeout_s: float) -> None:
    section: dict[str, Any] = {
        "memory": spec.memory, "region_bytes": spec.region_bytes, "target_bytes": spec.target_bytes,
        "mode_requested": mode, "mode_ran": None, "attempts": [], "rows": [],
    }
    rec.doc["nixl"] = section

    def on_row(row: dict[str, Any]) -> None:
        section["rows"].append(row)
        rec.write()
        print(f"[gpu_nixl] {row['model']:>14} {row['slab_kib']:>5} KiB x {row['descriptors']:>6}: NIXL "
              f"{row['nixl_gbps']:8.2f} GB/s  copy {row['copy_gbps']:8.2f}  ratio {row['ratio']:.3f}  "
              f"verified={row['verified']}", file=sys.stderr)

    modes = ["two_process", "one_process"] if mode == "auto" else [mode.replace("-", "_")]
    for i, m in enumerate(modes):
        if i and time.time() > spec.deadline - 20:
            section["attempts"].append({"mode": m, "error": "no time left for the fallback"})
            break
        attempt: dict[str, Any] = {"mode": m}
        section["attempts"].append(attempt)
        run_attempt(spec, attempt, first_row_timeout_s, on_row)
        rec.write()
        if any(r["verified"] and r["mode"] == m for r in section["rows"]):
            section["mode_ran"] = m
            break
    if section["mode_ran"] is None:
        raise RuntimeError("no verified NIXL transfer: " + "; ".join(str(a.get("error")) for a in section["attempts"]))


# ---- the run ----------------------------------------------------------------------------------------


def _env(device: Any) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(), "host": platform.node(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "device": device.type,
        "memory_kind": "VRAM" if device.type == "cuda" else "DRAM",
    }
    try:
        import numpy

        env["numpy"] = numpy.__version__
    except ImportError:
        env["numpy"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, device_memory_gib=round(props.total_memory / 2**30, 1),
                   sms=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    else:
        env["device_name"] = _cpu_model()
    import importlib.util

    env["nixl_wheels"] = [n for n in ("nixl", "nixl_cu13", "nixl_cu12") if importlib.util.find_spec(n)]
    env["ucx"] = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_", "SAAF_"))}
    return env


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU ({line.split(':', 1)[1].strip()})"
    except OSError:
        pass
    return f"CPU ({platform.machine()})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_nixl", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/out/gpu_nixl", help="result folder")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--budget-s", type=float, default=240.0, help="no NIXL layout starts after this")
    p.add_argument("--mode", choices=["auto", "two-process", "one-process"], default="auto")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="catalog models for the KV layouts")
    p.add_argument("--slab-kib", default=",".join(map(str, DEFAULT_SLAB_KIB)),
                   help="descriptor sizes: one layer's K or V of one block")
    p.add_argument("--target-mib", type=float, default=None, help="bytes per NIXL transfer")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--memory-mib", type=float, default=None, help="buffer for the bandwidth test")
    p.add_argument("--matmul-n", type=int, default=None)
    p.add_argument("--chain-model", default=None)
    p.add_argument("--chain-layers", type=int, default=None, help="run only this many layers of the chain")
    p.add_argument("--chain-batches", default="1,32")
    p.add_argument("--context", type=int, default=1024, help="tokens per sequence for the roofline")
    p.add_argument("--transfer-timeout-s", type=float, default=30.0)
    p.add_argument("--first-row-timeout-s", type=float, default=None)
    p.add_argument("--skip", default="", help="comma-separated steps to skip: memory,matmul,decode_chain,nixl")
    p.add_argument("--fault", choices=xfer.FAULTS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--report", default=None, help="print the Markdown summary of this result JSON and exit")
    return p


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise SystemExit(f"{flag} {text!r}: give positive integers separated by commas")
    return values


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        print(render_markdown(json.loads(Path(args.report).read_text())))
        return 0
    import torch

    from benchmarks import gpu_probe as probe

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False; use --device cpu or auto")
    device = torch.device("cuda:0" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    d = DEFAULTS[device.type]
    opt = {k: getattr(args, k) if getattr(args, k, None) is not None else v for k, v in d.items()}
    skip = {s for s in args.skip.split(",") if s}
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # NOTE: inherited by the NIXL children; loopback only
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    catalog = get_hardware(CATALOG_HARDWARE)
    out = Path(args.out)
    rec = Recorder(out / RESULT_NAME, {
        "schema": SCHEMA, "status": "running", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": {**vars(args), **opt}, "steps": {},
        "catalog": {"hardware": catalog.name, "hbm_tbps": catalog.hbm_tbps,
                    "bf16_tflops": catalog.peak_tflops["bf16"], "hbm_gib": round(catalog.hbm_gib, 1)},
    })
    deadline = time.time() + args.budget_s

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        with rec.step("env"):
            rec.doc["env"] = _env(device)
        if "memory" not in skip:
            with rec.step("memory"):
                rec.doc["memory"] = probe.measure_memory(device, int(opt["memory_mib"] * 2**20), 10, catalog)
            probe.free_memory(device)
        if "matmul" not in skip:
            with rec.step("matmul"):
                rec.doc["matmul"] = probe.measure_matmul(device, opt["matmul_n"], 10, catalog)
            probe.free_memory(device)
        if "decode_chain" not in skip:
            with rec.step("decode_chain"):
                measured = rec.doc.get("memory", {}).get("copy_rw_tbps")
                rec.doc["decode_chain"] = probe.measure_decode_chain(
                    device, get_model(opt["chain_model"]), catalog, _ints(args.chain_batches, "--chain-batches"),
                    args.context, 10, args.chain_layers, measured)
            probe.free_memory(device)
        if "nixl" not in skip:
            with rec.step("nixl"):
                layouts = tuple(xfer.layout_for(get_model(m), kib * 1024)
                                for kib in _ints(args.slab_kib, "--slab-kib") for m in args.models.split(","))
                target = int(opt["target_mib"] * 2**20)
                spec = xfer.XferSpec(
                    memory="VRAM" if device.type == "cuda" else "DRAM",
                    region_bytes=xfer.region_bytes_for(layouts, target), layouts=layouts, target_bytes=target,
                    repeats=opt["repeats"], transfer_timeout_s=args.transfer_timeout_s, deadline=deadline,
                    fault=args.fault)
                run_nixl(rec, spec, args.mode, opt["first_row_timeout_s"])
        rec.doc["summary"] = summarize(rec.doc)
        rec.doc["status"] = "complete"
    except BaseException:
        rec.doc["status"] = "cut"
        raise
    finally:
        rec.write()
        (out / "gpu_nixl.md").write_text(render_markdown(rec.doc))
    failed = [k for k, v in rec.doc["steps"].items() if v["status"] != "ok"]
    print(f"[gpu_nixl] {rec.path}: steps failed: {failed or 'none'}", file=sys.stderr)
    return 1 if failed else 0


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    rows = doc.get("nixl", {}).get("rows", [])
    s: dict[str, Any] = {
        "nixl_mode_ran": doc.get("nixl", {}).get("mode_ran"),
        "nixl_rows": len(rows),
        "all_verified": bool(rows) and all(r["verified"] for r in rows),
    }
    if rows:
        s["nixl_gbps_range"] = [min(r["nixl_gbps"] for r in rows), max(r["nixl_gbps"] for r in rows)]
        s["ratio_range"] = [min(r["ratio"] for r in rows), max(r["ratio"] for r in rows)]
    if "memory" in doc:
        s["copy_vs_catalog_hbm"] = doc["memory"]["copy_vs_catalog"]
    if "matmul" in doc:
        s["matmul_vs_catalog"] = doc["matmul"]["vs_catalog"]
    return s


if __name__ == "__main__":
    sys.exit(main())
