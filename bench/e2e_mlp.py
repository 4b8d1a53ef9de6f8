"""End to end: a Llama-style tensor-parallel MLP block with its collectives overlapped.

    python bench/e2e_mlp.py [--world-size W] [--shapes TxHxI,...] [--dtype bfloat16]
                            [--iters N] [--no-compile] [--backend NAME] [--device cpu]

Per rank of W (one per GPU, a NCCL group even at W = 1), with T tokens split over the ranks:

  fo        ColumnParallelLinear(H, 2I, gather_input=True) -> SiLU(gate) * up ->
            RowParallelLinear(I, H, reduce="reduce_scatter")   (fo.nn)
  torch     the same block from torch.matmul and NCCL: all-gather of the token rows, matmul,
            SiLU * up, matmul, reduce-scatter (torch's differentiable functional collectives)
  *_compiled  each under torch.compile (inductor, default mode)

Forward (under no_grad) and forward + backward times (the median over iterations of the slowest
rank), the speedups of fo over torch and over torch compiled (the paper's end-to-end claim is
1.05-1.13x), the backend fo's calls chose, and fo's output and gradients against torch's.
At W = 1 there is nothing to overlap: the figures are fo's overhead. Writes
bench/results/e2e-mlp-*.json (or $FO_RESULTS_DIR). ``--device cpu`` (gloo ranks, small shapes)
is a dry run of the script itself.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashoverlap_core as fo
from flashoverlap_core import registry
from flashoverlap_core.backend import OverlapSpec
from flashoverlap_core.devices import current_device
from flashoverlap_core.plan import dtype_name
from flashoverlap_core.tools.args import at_least, shapes_arg
from flashoverlap_core.tools.ranks import Ranks
from common import median_ms, table, write_result
from multigpu import MULTICAST_OFF

# (tokens, hidden, intermediate): Llama-3 8B's and 70B's MLP at 8192 tokens.
SHAPES = "8192x4096x14336,8192x8192x28672"
VARIANTS = ("fo", "fo_compiled", "torch", "torch_compiled")


class Blocks:
    """This rank's shards and the two ways of running the block on them."""

    def __init__(self, tokens, hidden, inner, dtype, device, group, backend):
        world = dist.get_world_size(group)
        self.group, self.world = group, world
        kw = {"device": device, "dtype": dtype, "group": group, "backend": backend}
        # Each rank's gate/up rows hold its gate rows, then its up rows: chunk(2) splits them.
        self.gate_up = fo.nn.ColumnParallelLinear(hidden, 2 * inner, bias=False,
                                                  gather_input=True, **kw)
        self.down = fo.nn.RowParallelLinear(inner, hidden, bias=False, reduce="reduce_scatter",
                                            **kw)
        g = torch.Generator(device=device).manual_seed(1234 + dist.get_rank())
        self.x = torch.randn(tokens // world, hidden, device=device, dtype=dtype, generator=g)
        self.grad = torch.randn_like(self.x)
        self.params = [self.gate_up.weight, self.down.weight]

    def fo_block(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)

    def torch_block(self, x):
        rows = _funcol("all_gather_single_autograd", "all_gather_tensor_autograd")(x, 0, self.group)
        gate, up = torch.matmul(rows, self.gate_up.weight.t()).chunk(2, dim=-1)
        out = torch.matmul(F.silu(gate) * up, self.down.weight.t())
        out = _funcol("reduce_scatter_single_autograd", "reduce_scatter_tensor_autograd")(
            out, "sum", 0, self.group)
        # Eager functional collectives wait on first use: wait here, or a timed forward whose
        # output is unused would leave its reduce-scatter out of the time.
        return out.wait() if hasattr(out, "wait") else out

    def step(self, block):
        """Forward and backward, with fresh gradients."""
        x = self.x.detach().requires_grad_()
        for p in self.params:
            p.grad = None
        block(x).backward(self.grad)
        return x

    def grads(self, block) -> list[torch.Tensor]:
        x = self.step(block)
        return [x.grad.clone()] + [p.grad.clone() for p in self.params]


def _funcol(name: str, older: str):
    """A differentiable functional collective by its current name, or its older one."""
    from torch.distributed import _functional_collectives as funcol
    return getattr(funcol, name, None) or getattr(funcol, older)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.float().abs().max().clamp_min(1e-30)
    return float((got.float() - want.float()).abs().max() / scale)


def chosen_backends(tokens, hidden, inner, world, dtype, device_type, backend) -> dict[str, str]:
    """The backend each overlapped forward call of the block runs on (b is weight.t())."""
    name = dtype_name(dtype)
    specs = {"allgather": OverlapSpec(tokens, 2 * inner // world, hidden, "allgather", world,
                                      name, device_type, "col"),
             "reduce_scatter": OverlapSpec(tokens, hidden, inner // world, "reduce_scatter",
                                           world, name, device_type, "col")}
    chosen = {}
    for op, spec in specs.items():
        try:
            chosen[op] = registry.select(spec, backend).name
        except registry.BackendError as e:
            chosen[op] = f"none: {str(e).splitlines()[0]}"
    return chosen


def measure_shape(shape, dtype, device_type, iters, compile_, backend) -> dict:
    tokens, hidden, inner = shape
    device = current_device(device_type)
    blocks = Blocks(tokens, hidden, inner, dtype, device, dist.group.WORLD, backend)
    runs = {"fo": blocks.fo_block, "torch": blocks.torch_block}
    if compile_:
        runs["fo_compiled"] = torch.compile(blocks.fo_block, fullgraph=True)
        runs["torch_compiled"] = torch.compile(blocks.torch_block, fullgraph=True)
    row = {"T": tokens, "H": hidden, "I": inner, "W": blocks.world}
    started = time.perf_counter()
    for name, block in runs.items():
        with torch.no_grad():
            row[f"fwd_{name}"] = median_ms(lambda: block(blocks.x), iters=iters,
                                           device_type=device_type)
        row[f"fwdbwd_{name}"] = median_ms(lambda: blocks.step(block), iters=iters,
                                          device_type=device_type)
    row["seconds"] = round(time.perf_counter() - started, 1)
    with torch.no_grad():
        want = blocks.torch_block(blocks.x)
        row["fwd_rel_err"] = relative_error(blocks.fo_block(blocks.x), want)
    got, ref = blocks.grads(blocks.fo_block), blocks.grads(blocks.torch_block)
    row["grad_rel_err"] = max(relative_error(g, r) for g, r in zip(got, ref))
    return row


def run_rank(shapes, dtype_name_, device_type, iters, compile_, backend) -> list[dict]:
    """Every shape on this rank (run on every rank at once)."""
    dtype = getattr(torch, dtype_name_)
    return [measure_shape(s, dtype, device_type, iters, compile_, backend) for s in shapes]


def combine(per_rank: list[list[dict]], dtype, device_type, backend) -> list[dict]:
    """Each shape's slowest rank per timing, worst error, speedups and backends."""
    rows = []
    for ranks_rows in zip(*per_rank):
        row = dict(ranks_rows[0])
        for key in row:
            if key.startswith(("fwd", "seconds", "grad")):
                row[key] = round(max(r[key] for r in ranks_rows), 4)
        for mode in ("fwd", "fwdbwd"):
            for base in ("torch", "torch_compiled"):
                if f"{mode}_{base}" in row:
                    speedup = row[f"{mode}_{base}"] / row[f"{mode}_fo"]
                    row[f"{mode}_speedup_vs_{base}"] = round(speedup, 3)
        row["backends"] = chosen_backends(row["T"], row["H"], row["I"], row["W"], dtype,
                                          device_type, backend)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=at_least(1), default=1, help="ranks, one per device")
    p.add_argument("--shapes", type=shapes_arg, default=shapes_arg(SHAPES),
                   help=f"tokens x hidden x intermediate, comma-separated (default {SHAPES}: "
                        "Llama-3 8B's and 70B's MLP)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: gloo ranks, a dry run of this script")
    p.add_argument("--iters", type=at_least(1), default=20)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    p.add_argument("--backend", default=None, help="fo's backend (default: chosen per call)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for all ranks' work")
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        p.error(f"--world-size {args.world_size} needs that many GPUs, found "
                f"{torch.cuda.device_count()}")
    for t, h, i in args.shapes:
        if t % args.world_size or i % args.world_size:
            p.error(f"shape {t}x{h}x{i}: T and I must be divisible by the world size")
    with Ranks(args.world_size, args.device, env=MULTICAST_OFF, timeout=args.timeout) as ranks:
        per_rank = ranks.run(run_rank, args.shapes, args.dtype, args.device, args.iters,
                             not args.no_compile, args.backend)
    rows = combine(per_rank, getattr(torch, args.dtype), args.device, args.backend)
    columns = ["T", "H", "I", "W"] + [f"{m}_{v}" for m in ("fwd", "fwdbwd") for v in VARIANTS
                                      if f"{m}_{v}" in rows[0]]
    columns += [c for c in rows[0] if "speedup" in c] + ["fwd_rel_err", "grad_rel_err"]
    print(table(rows, columns))
    for row in rows:
        print(f"{row['T']}x{row['H']}x{row['I']}: backends {row['backends']}")
    write_result(f"e2e-mlp-w{args.world_size}", rows,
                 {"dtype": args.dtype, "iters": args.iters, "times": "ms, median, slowest rank"},
                 device_type=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
