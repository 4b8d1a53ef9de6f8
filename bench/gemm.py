"""Signaling GEMM vs torch.matmul (cuBLAS) vs the same kernel without signaling, TFLOP/s.

    python bench/gemm.py [--dtypes bfloat16,float16] [--quick]

Shapes: GPU-FACTS.md's, plus LLM tensor-parallel ones (tokens x hidden x K). B is an
nn.Linear weight [N, K] used as weight.t(). Writes bench/results/gemm-*.json.
"""
from __future__ import annotations

import argparse

import torch

import flashoverlap_core as fo
from flashoverlap_core import registry
from common import median_ms, table, write_result

FACTS_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 1024), (8192, 8192, 2048),
                (4096, 8192, 8192), (2048, 8192, 4096)]
LLM_SHAPES = [(2048, 4096, 4096), (4096, 4096, 1024), (8192, 8192, 1024), (16384, 4096, 4096),
              (16384, 8192, 2048), (8192, 4096, 8192), (2048, 8192, 8192), (4096, 8192, 3584)]


def measure(m, n, k, dtype, iters):
    backend = registry.get("cuda")
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    plan = fo.plan(m, n, k, op="custom", dtype=dtype, backend="cuda")
    packed = torch.empty(m * n, device="cuda", dtype=dtype)
    flops = 2.0 * m * n * k
    # Back-to-back launches (10 between two events), like a model's layers: device time.
    t_cublas = median_ms(lambda: torch.matmul(a, w.t()), iters=iters, inner=10)
    state = backend.launch_gemm(plan, a, w.t(), packed)

    def signaling():
        state.counters.zero_()
        backend.launch_gemm(plan, a, w.t(), packed)

    def plain():
        state.counters.zero_()
        backend.launch_gemm(plan, a, w.t(), packed, signal=False)

    t_sig = median_ms(signaling, iters=iters, inner=10)
    t_plain = median_ms(plain, iters=iters, inner=10)
    t_zero = median_ms(state.counters.zero_, iters=iters, inner=10)  # not part of the GEMM
    t_sig, t_plain = t_sig - t_zero, t_plain - t_zero
    ref = a.double() @ w.double().t()
    out = torch.empty(m, n, device="cuda", dtype=dtype)
    fo.overlap(a, w.t(), lambda r, i: None, plan=plan, out=out)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    return {
        "M": m, "N": n, "K": k, "dtype": str(dtype).removeprefix("torch."),
        "tile": list(plan.tile), "ctas": plan.wave_size,
        "cublas_ms": round(t_cublas, 4), "signaling_ms": round(t_sig, 4), "plain_ms": round(t_plain, 4),
        "cublas_tflops": round(flops / t_cublas / 1e9, 1),
        "signaling_tflops": round(flops / t_sig / 1e9, 1),
        "plain_tflops": round(flops / t_plain / 1e9, 1),
        "vs_cublas": round(t_cublas / t_sig, 3), "signal_overhead": round(t_sig / t_plain - 1, 4),
        "rel_err": rel,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtypes", default="bfloat16,float16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="first 3 shapes only")
    args = p.parse_args()
    shapes = FACTS_SHAPES + LLM_SHAPES
    rows = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for shape in (shapes[:3] if args.quick else shapes if name == "bfloat16" else shapes[:4]):
            rows.append(measure(*shape, dtype, args.iters))
            print(table(rows[-1:], list(rows[-1])), flush=True)
    ratios = sorted(r["vs_cublas"] for r in rows)
    summary = {"min_vs_cublas": ratios[0], "median_vs_cublas": ratios[len(ratios) // 2],
               "max_signal_overhead": max(r["signal_overhead"] for r in rows)}
    print(table(rows, ["M", "N", "K", "dtype", "cublas_tflops", "signaling_tflops",
                       "plain_tflops", "vs_cublas", "signal_overhead", "rel_err"]))
    print(summary)
    write_result("gemm", rows, {"summary": summary})


if __name__ == "__main__":
    main()
