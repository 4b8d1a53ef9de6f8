"""One all_to_all call at world size 1 (forced to overlap) between cudaProfilerStart and Stop,
for Nsight Compute: what the per-call table kernel (``a2a_tables``) and the unequal-blocks
signaling GEMM cost on the device (issue 30: the 1024-token all_to_all rows).

    ncu --profile-from-start off --set full -o OUT/a2a python bench/a2a_ncu.py [--shape MxNxK]

Times nothing itself; ``ci/round.sh ncu-a2a`` runs it under ncu and brings the report and a
CSV of its details back.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import flashoverlap_core as fo  # noqa: E402
from common import nccl_group_of_one  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1024x5120x3456", help="MxNxK")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/a2a_ncu.py needs a CUDA device")
    m, n, k = (int(x) for x in args.shape.lower().split("x"))
    os.environ["FLASHOVERLAP_STRATEGY"] = "overlap"
    nccl_group_of_one("a2a-ncu")
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
    for _ in range(3):  # prepare, load every kernel, replay
        fo.overlap(a, b, "all_to_all", send_splits=[m], recv_splits=[m])
    torch.cuda.synchronize()
    print(fo.prepared_calls()[-1])
    torch.cuda.profiler.start()
    fo.overlap(a, b, "all_to_all", send_splits=[m], recv_splits=[m])
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
