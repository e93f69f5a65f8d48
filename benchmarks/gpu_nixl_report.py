"""Markdown summary of a `benchmarks.gpu_nixl` result (the shape of benchmarks/results/gpu-h200-nixl.md).

Pure function of the JSON document, so it also renders a cut or partial run (missing parts say so).
"""

from __future__ import annotations

from typing import Any


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 1 or value == 0 else f"{value:.3g}"
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_f(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return lines


def render_markdown(doc: dict[str, Any]) -> str:
    env = doc.get("env", {})
    cat = doc.get("catalog", {})
    nixl = doc.get("nixl", {})
    memory_kind = env.get("memory_kind", "?")
    out = [
        f"# NIXL {memory_kind} transfers and the hardware catalog on one {env.get('device_name', '?')}",
        "",
        f"Run {doc.get('started', '?')}, {_f(doc.get('elapsed_s'), 1)} s, status **{doc.get('status', '?')}**. "
        f"Host `{env.get('host', '?')}`, {env.get('cpus', '?')} CPUs; Python {env.get('python', '?')}, "
        f"torch {env.get('torch', '?')} (CUDA {env.get('torch_cuda')}), numpy {env.get('numpy')}; "
        f"nixl wheels {', '.join(env.get('nixl_wheels', [])) or 'none'}. "
        f"Method: `benchmarks/gpu_nixl.py` (one run, `scripts/gpu_nixl.sh`); raw JSON beside this file.",
        "",
        f"## Memory and compute vs the catalog entry `{cat.get('hardware', '?')}` (placement/catalog.py)",
        "",
    ]
    mem, mm = doc.get("memory"), doc.get("matmul")
    rows: list[list[Any]] = []
    if mem:
        hbm = cat.get("hbm_tbps")
        rows += [
            [f"memory copy, read + write, TB/s ({mem['buffer_bytes'] / 2**30:.2f} GiB)", mem["copy_rw_tbps"], hbm,
             mem["copy_rw_tbps"] / hbm],
            ["memory read (sum), TB/s", mem["read_tbps"], hbm, mem["read_tbps"] / hbm],
            ["memory write (fill), TB/s", mem["write_tbps"], hbm, mem["write_tbps"] / hbm],
        ]
    if mm:
        rows.append([f"bf16 matmul {mm['n']}^3, TFLOP/s", mm["tflops"], mm["catalog_tflops"], mm["vs_catalog"]])
    out += _table(["", "measured", "catalog", "measured / catalog"], rows) if rows else ["(not measured)"]

    chain = doc.get("decode_chain")
    out += ["", "## One decode step: the roofline vs a measured torch matmul chain", ""]
    if chain:
        out.append(
            f"Model `{chain['model']}` ({chain['layers_run']} of {chain['layers_model']} layers run), bf16; chain = "
            f"per layer qkv, o, gate_up, down + lm_head, {chain['chain_weight_bytes'] / 1e9:.2f} GB of weights "
            f"(the roofline counts {chain['roofline_weight_bytes'] / 1e9:.2f} GB, embedding included, plus the "
            f"KV of {chain['context']} tokens). Roofline: `placement.roofline.decode_roofline` on "
            f"`{chain['hardware']}`."
        )
        out.append("")
        out += _table(
            ["batch", "roofline TPOT ms", "roofline, chain bytes, ms", "chain eager ms", "chain CUDA graph ms",
             "chain TB/s (best)"],
            [[r["batch"], r["roofline_tpot_ms"], r["roofline_chain_ms"], r["measured_eager_ms"],
              r.get("measured_graph_ms"), max(r["eager_tbps"], r.get("graph_tbps") or 0.0)] for r in chain["rows"]],
        )
    else:
        out.append("(not measured)")

    out += ["", f"## NIXL READ {memory_kind} -> {memory_kind} vs a torch copy of the same bytes", ""]
    attempts = "; ".join(
        f"{a['mode']}: {a.get('rows', 0)} rows{', error: ' + a['error'] if a.get('error') else ''}"
        for a in nixl.get("attempts", [])
    )
    out.append(f"Mode that ran: **{nixl.get('mode_ran')}** (attempts: {attempts or 'none'}).")
    rows_ = nixl.get("rows", [])
    if rows_:
        ready = next((a.get("ready", {}) for a in nixl.get("attempts", []) if a.get("ready")), {})
        out.append(
            f"nixl module `{ready.get('nixl_module')}`, progress-thread delay {ready.get('pthr_delay_us')} us. "
            f"Per row one NIXL READ request of one descriptor per layer x K|V x block (scattered block ids), "
            f"then a contiguous torch copy and a torch index gather of the same bytes, alternating; medians "
            f"of {rows_[0]['repeats']} after a warm-up; GB/s = 1e9 B/s of KV moved; the NIXL clock includes "
            f"building the request. Every NIXL transfer and every copy is checked byte for byte (last column)."
        )
        out.append("")
        out += _table(
            ["model", "slab KiB", "block tokens", "descriptors", "MiB", "NIXL GB/s", "request ms", "copy GB/s",
             "NIXL / copy", "gather GB/s", "NIXL / gather", "verified"],
            [[r["model"], r["slab_kib"], r["block_tokens"], r["descriptors"], r["total_bytes"] / 2**20,
              r["nixl_gbps"], r["nixl_prep_ms"], r["copy_gbps"], r["ratio"], r["gather_gbps"], r["ratio_gather"],
              "yes" if r["verified"] else "**NO**"] for r in rows_],
        )
    out += ["", "## Steps", ""]
    out += _table(["step", "status", "seconds", "error"],
                  [[k, v.get("status"), v.get("seconds"), v.get("error", "")] for k, v in doc.get("steps", {}).items()])
    return "\n".join(out) + "\n"
