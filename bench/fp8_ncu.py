"""The kernels of one fp8 comparison, launched once each between cudaProfilerStart and Stop,
for Nsight Compute (issue 32: why the row-wise signaling GEMM trails torch's row-wise kernel at
small K).

    ncu --profile-from-start off --nvtx --set full -o OUT/fp8 python bench/fp8_ncu.py
    python bench/fp8_ncu.py --shapes 16384x8192x1024 --variants pp-tma   # extra builds

For each shape and scaling: the product (what a default plan launches), the given variants
(bench/gemm.py's names) and torch._scaled_mm with the same e4m3 inputs, scales, bf16 output and
fast accumulation, each warmed up with the profiler stopped, then launched once while it runs,
in an NVTX range named ``fp8 <MxNxK> <scaling> <kernel>`` (printed in launch order too), so a
profile holds exactly one launch of each. Times nothing itself (ncu's metrics are the
result); ``ci/round.sh ncu-fp8`` runs it under ncu and brings the report and a CSV of its
details back.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm import (Gemm, blockwise_scaled_mm, for_scaling, fp8_inputs,  # noqa: E402
                  parse_variant, scaled_mm)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16384x8192x1024,8192x8192x2048,4096x8192x8192",
                        help="MxNxK, comma-separated (default: two row-wise misses, one at par)")
    parser.add_argument("--scalings", default="rowwise,tensorwise",
                        help="tensorwise, rowwise, blockwise (the block-scaled build against "
                             "torch's block-wise scaled_mm)")
    parser.add_argument("--variants", default="", help="extra builds (bench/gemm.py's names)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/fp8_ncu.py needs a CUDA device (sm_90 for the e4m3 kernels)")
    from flashoverlap_backends.cuda import kernels

    names = ["product"] + [v for v in args.variants.split(",") if v]
    variants = [parse_variant(n, 90) for n in names]
    for text in args.shapes.split(","):
        shape = tuple(int(x) for x in text.lower().split("x"))
        if len(shape) != 3:
            raise SystemExit(f"--shapes: {text!r} is not MxNxK")
        for scaling in args.scalings.split(","):
            a, w, sa, sb = fp8_inputs(shape, scaling)
            blockwise = scaling == "blockwise"  # block-scaled builds; torch's block-wise GEMM
            # (bench/gemm.py's split: blk... variants on block-wise rows only, others elsewhere)
            fns = {v.name: Gemm(kernels, v, a, w, "float8_e4m3fn", (sa, sb), scaling)
                   for v in for_scaling(variants, scaling)}
            fns["scaled_mm"] = (blockwise_scaled_mm(a, w, sa, sb)[0] if blockwise
                                else scaled_mm(a, w, sa, sb, True))
            for fn in fns.values():  # loads every kernel, the profiler stopped
                fn()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            for name, fn in fns.items():
                torch.cuda.nvtx.range_push(f"fp8 {text} {scaling} {name}")
                fn()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
            torch.cuda.profiler.stop()
            print(f"{text} {scaling}: launched {', '.join(fns)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
