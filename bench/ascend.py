"""Ascend NPUs: FlashOverlap against torch_npu's fused matmul + collective ops (the vendor
baseline) and against the plain sequence, on one process per NPU.

UNVERIFIED: written without access to an NPU; it has never run. Check its rows (and this
script) on an NPU host before quoting anything from it.

    torchrun --nproc-per-node 8 bench/ascend.py [--shapes 4096x8192x3584,...] [--dtype bfloat16]

Per shape and op (allreduce, reduce_scatter), the median time of
- ``sequential``: ``a @ b`` then the HCCL collective (``flashoverlap_core.tools.bench.plain``);
- ``vendor``: ``torch_npu.npu_mm_all_reduce_base`` / ``npu_mm_reduce_scatter_base``;
- ``flashoverlap``: ``fo.overlap(a, b, op, backend="ascend")``;
each result's largest deviation from the sequential one, relative to its largest value.
Rank 0 writes bench/results/ascend-<date>.json (bench/common.py).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import flashoverlap_core as fo
from common import median_ms, table, write_result
from flashoverlap_core import registry
from flashoverlap_core.tools.args import shapes_arg
from flashoverlap_core.tools.bench import plain

SHAPES = "4096x8192x3584,8192x8192x3584,8192x8192x8192"
VENDOR_WORLD_SIZES = (2, 4, 8, 16, 32)  # 16 and 32 on Atlas A3 only
VENDOR_K = (256, 65535)  # documented: 256 <= K < 65535


def vendor_reason(op: str, m: int, k: int, world: int, dtype: torch.dtype) -> str | None:
    """Why torch_npu's fused op cannot take this case (its documented limits), or None."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"fused ops take float16/bfloat16, not {dtype}"
    if world not in VENDOR_WORLD_SIZES:
        return f"fused ops need a world size in {VENDOR_WORLD_SIZES}, not {world}"
    if not VENDOR_K[0] <= k < VENDOR_K[1]:
        return f"fused ops need {VENDOR_K[0]} <= K < {VENDOR_K[1]}, not {k}"
    if op == "reduce_scatter" and m % world:
        return f"reduce_scatter needs M divisible by {world}"
    return None


def vendor(op: str, a, b, hcom: str, world: int):
    import torch_npu

    if op == "allreduce":
        return torch_npu.npu_mm_all_reduce_base(a, b, hcom, reduce_op="sum")
    return torch_npu.npu_mm_reduce_scatter_base(a, b, hcom, world, reduce_op="sum")


def deviation(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / (want.float().abs().max() + 1e-30)).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=shapes_arg, default=shapes_arg(SHAPES),
                        help="per-rank MxNxK of a [M,K] @ [K,N]")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    import torch_npu  # noqa: F401 - registers torch.npu and the hccl process group backend

    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    torch.npu.set_device(local)
    dist.init_process_group("hccl")
    world, device = dist.get_world_size(), torch.device("npu", local)
    dtype = getattr(torch, args.dtype)
    hcom = dist.group.WORLD._get_backend(device).get_hccl_comm_name(rank)
    rows = []
    for m, n, k in args.shapes:
        shape = f"{m}x{n}x{k}"
        gen = torch.Generator().manual_seed(rank)
        a = torch.randn(m, k, generator=gen).to(device, dtype)
        b = (torch.randn(n, k, generator=gen) / k ** 0.5).to(device, dtype).t()  # weight.t()
        for op in ("allreduce", "reduce_scatter"):
            if op == "reduce_scatter" and m % world:
                continue
            row = {"shape": shape, "op": op, "world": world, "dtype": args.dtype}
            want = plain(op, a, b)
            runs = {"sequential": lambda: plain(op, a, b),
                    "flashoverlap": lambda: fo.overlap(a, b, op, backend="ascend")}
            reason = vendor_reason(op, m, k, world, dtype)
            if reason is None:
                runs["vendor"] = lambda: vendor(op, a, b, hcom, world)
            else:
                row["vendor ms"] = f"skipped: {reason}"
            for name, fn in runs.items():
                row[f"{name} ms"] = round(median_ms(fn, args.warmup, args.iters, "npu"), 3)
                row[f"{name} dev"] = f"{deviation(fn(), want):.1e}"
            rows.append(row)
    if rank == 0:
        columns = ["shape", "op", "sequential ms", "vendor ms", "flashoverlap ms",
                   "vendor dev", "flashoverlap dev"]
        print(table(rows, columns))
        write_result("ascend", rows, {"versions": registry.get("ascend").versions()},
                     device_type="npu")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
