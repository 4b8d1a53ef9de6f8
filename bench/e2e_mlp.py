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
1.05-1.13x). At W = 1 there is nothing to overlap: the figures are fo's overhead.

Correctness, per shape (the worst rank's):
  fwd_rel_err / grad_rel_err       fo's output / gradients (input, both weights) against torch's,
                                   relative to the largest |value|; *_bitwise_equal: exactly equal
  fwd_err_fo / fwd_err_torch, grad_err_fo / grad_err_torch
                                   each block against a float64 run of the same block on the same
                                   inputs and weights: two blocks of equal error that are bitwise
                                   equal computed the same thing, not a wrong thing twice
  calls                            every overlapped call the fo block makes, forward and backward:
                                   its op and shapes, the backend and strategy that ran it (read
                                   from fo's prepared calls, not predicted), and the same call on
                                   fresh inputs against torch.matmul + torch.distributed (bitwise,
                                   and both against float64)
  backends                         the forward calls' backends, per op
  fo_within_bound                  fo's errors against float64 are at most twice torch's plus
                                   4 epsilons of the dtype (forward and gradients); the script
                                   exits 1 when a shape's are not

Writes bench/results/e2e-mlp-*.json (or $FO_RESULTS_DIR). ``--device cpu`` (gloo ranks, small
shapes) is a dry run of the script itself.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashoverlap_core as fo
from flashoverlap_core import api
from flashoverlap_core.devices import current_device
from flashoverlap_core.tools.args import at_least, shapes_arg
from flashoverlap_core.tools.bench import max_abs, plain
from flashoverlap_core.tools.ranks import Ranks
from common import median_ms, table, write_result
from multigpu import MULTICAST_OFF, prepared_calls, topology_record

# (tokens, hidden, intermediate): Llama-3 8B's and 70B's MLP at 8192 tokens.
SHAPES = "8192x4096x14336,8192x8192x28672"
VARIANTS = ("fo", "fo_compiled", "torch", "torch_compiled")
ROUNDING_UNITS = 4  # dtype epsilons (relative) fo's error may exceed twice torch's by


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
        return self.plain_block(x, self.gate_up.weight, self.down.weight)

    def plain_block(self, x, gate_up_weight, down_weight):
        """The block from torch.matmul and torch's differentiable collectives."""
        rows = _funcol("all_gather_single_autograd", "all_gather_tensor_autograd")(x, 0, self.group)
        gate, up = torch.matmul(rows, gate_up_weight.t()).chunk(2, dim=-1)
        out = torch.matmul(F.silu(gate) * up, down_weight.t())
        out = _funcol("reduce_scatter_single_autograd", "reduce_scatter_tensor_autograd")(
            out, "sum", 0, self.group)
        # Eager functional collectives wait on first use: wait here, or a timed forward whose
        # output is unused would leave its reduce-scatter out of the time.
        return out.wait() if hasattr(out, "wait") else out

    def reference(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The block in float64 on the same inputs and weights: its output and the gradients
        of the input and both weights (as :meth:`grads` orders them)."""
        x = self.x.detach().double().requires_grad_()
        weights = [p.detach().double().requires_grad_() for p in self.params]
        out = self.plain_block(x, *weights)
        out.backward(self.grad.double())
        return out.detach(), [x.grad] + [w.grad for w in weights]

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


def op_calls(blocks: Blocks) -> list[dict]:
    """Every overlapped call of the fo block, forward then backward, with the backend and
    strategy that ran it (fo's prepared calls after one forward, then one forward + backward).
    A backward call with the same key as a forward one is listed once, as forward."""
    api.forget_prepared()
    with torch.no_grad():
        blocks.fo_block(blocks.x)
    forward = prepared_calls()
    api.forget_prepared()
    blocks.step(blocks.fo_block)
    both = prepared_calls()
    return ([{"pass": "forward", **c} for c in forward]
            + [{"pass": "backward", **c} for c in both if c not in forward])


def compare_call(call: dict, group, backend, dtype, device, seed: int) -> dict:
    """One of the block's calls on fresh inputs of its shapes and b layout: fo.overlap as the
    block calls it against the same op from torch.matmul and torch.distributed, bitwise, and
    both against float64 (relative to the largest |value|)."""
    gen = torch.Generator(device=device).manual_seed(seed + dist.get_rank())
    scale = call["a"][1] ** -0.5
    a = torch.randn(call["a"], generator=gen, device=device, dtype=dtype)
    if call["b_layout"] == "col":  # weight.t(): the transpose of a contiguous [N, K]
        b = (torch.randn(call["b"][::-1], generator=gen, device=device, dtype=dtype) * scale).t()
    else:
        b = torch.randn(call["b"], generator=gen, device=device, dtype=dtype) * scale
    got = fo.overlap(a, b, call["op"], group, backend=backend)
    want = plain(call["op"], a, b)
    ref = plain(call["op"], a.double(), b.double())
    return {"equal_to_torch": bool(torch.equal(got, want)),
            "max_abs_diff_vs_torch": max_abs(got.double() - want.double()),
            "err_fo": relative_error(got, ref), "err_torch": relative_error(want, ref)}


def check_block(blocks: Blocks, row: dict) -> None:
    """fo's block against torch's, and both against the float64 block (see the docstring)."""
    ref_out, ref_grads = blocks.reference()
    with torch.no_grad():
        want, got = blocks.torch_block(blocks.x), blocks.fo_block(blocks.x)
    row.update(fwd_rel_err=relative_error(got, want), fwd_bitwise_equal=torch.equal(got, want),
               fwd_err_fo=relative_error(got, ref_out), fwd_err_torch=relative_error(want, ref_out))
    got, want = blocks.grads(blocks.fo_block), blocks.grads(blocks.torch_block)
    row.update(grad_rel_err=max(relative_error(g, w) for g, w in zip(got, want)),
               grad_bitwise_equal=all(torch.equal(g, w) for g, w in zip(got, want)),
               grad_err_fo=max(relative_error(g, r) for g, r in zip(got, ref_grads)),
               grad_err_torch=max(relative_error(w, r) for w, r in zip(want, ref_grads)))
    slack = ROUNDING_UNITS * torch.finfo(blocks.x.dtype).eps
    row["fo_within_bound"] = all(row[f"{m}_err_fo"] <= 2 * row[f"{m}_err_torch"] + slack
                                 for m in ("fwd", "grad"))  # False for NaN too


def measure_shape(shape, dtype, device_type, iters, compile_, backend) -> dict:
    tokens, hidden, inner = shape
    device = current_device(device_type)
    blocks = Blocks(tokens, hidden, inner, dtype, device, dist.group.WORLD, backend)
    row = {"T": tokens, "H": hidden, "I": inner, "W": blocks.world}
    calls = op_calls(blocks)
    for i, call in enumerate(calls):
        call.update(compare_call(call, blocks.group, backend, dtype, device, 4321 + 100 * i))
    runs = {"fo": blocks.fo_block, "torch": blocks.torch_block}
    if compile_:
        runs["fo_compiled"] = torch.compile(blocks.fo_block, fullgraph=True)
        runs["torch_compiled"] = torch.compile(blocks.torch_block, fullgraph=True)
    started = time.perf_counter()
    for name, block in runs.items():
        with torch.no_grad():
            row[f"fwd_{name}"] = median_ms(lambda: block(blocks.x), iters=iters,
                                           device_type=device_type)
        row[f"fwdbwd_{name}"] = median_ms(lambda: blocks.step(block), iters=iters,
                                          device_type=device_type)
    row["seconds"] = round(time.perf_counter() - started, 1)
    check_block(blocks, row)
    row["calls"] = calls
    return row


def run_rank(shapes, dtype_name_, device_type, iters, compile_, backend) -> list[dict]:
    """Every shape on this rank (run on every rank at once)."""
    dtype = getattr(torch, dtype_name_)
    return [measure_shape(s, dtype, device_type, iters, compile_, backend) for s in shapes]


def combine(per_rank: list[list[dict]]) -> list[dict]:
    """Each shape's slowest rank per timing, worst error, exact equality only where every rank
    has it, speedups, and the calls (rank 0's backends, every rank's comparisons)."""
    rows = []
    for ranks_rows in zip(*per_rank):
        row = dict(ranks_rows[0])
        for key in row:
            if isinstance(row[key], bool):
                row[key] = all(r[key] for r in ranks_rows)
            elif key.startswith(("fwd", "seconds", "grad")):
                row[key] = max(r[key] for r in ranks_rows)
                row[key] = round(row[key], 4) if "err" not in key else row[key]
        for mode in ("fwd", "fwdbwd"):
            for base in ("torch", "torch_compiled"):
                if f"{mode}_{base}" in row:
                    speedup = row[f"{mode}_{base}"] / row[f"{mode}_fo"]
                    row[f"{mode}_speedup_vs_{base}"] = round(speedup, 3)
        row["calls"] = [merge_call([r["calls"][i] for r in ranks_rows])
                        for i in range(len(row["calls"]))]
        row["backends"] = {c["op"]: ran_by(c) for c in row["calls"] if c["pass"] == "forward"}
        rows.append(row)
    return rows


def merge_call(per_rank: list[dict]) -> dict:
    call = dict(per_rank[0])
    call["equal_to_torch"] = all(c["equal_to_torch"] for c in per_rank)
    for key in ("max_abs_diff_vs_torch", "err_fo", "err_torch"):
        call[key] = max(c[key] for c in per_rank)
    return call


def ran_by(call: dict) -> str:
    """The backend, or what a sequential plan runs instead of it."""
    if call["strategy"] == "overlap":
        return call["backend"]
    return f"{call['strategy']} ({call['runs']}; plan of {call['backend']})"


def explain(row: dict) -> list[str]:
    """Lines saying what ran and how each part compares with torch and with float64."""
    lines = [f"{row['T']}x{row['H']}x{row['I']} W={row['W']}: backends {row['backends']}; fo vs "
             f"torch bitwise equal: forward {row['fwd_bitwise_equal']}, gradients "
             f"{row['grad_bitwise_equal']}; relative error against float64: forward fo "
             f"{row['fwd_err_fo']:.3g} torch {row['fwd_err_torch']:.3g}, gradients fo "
             f"{row['grad_err_fo']:.3g} torch {row['grad_err_torch']:.3g}"]
    for c in row["calls"]:
        lines.append(f"  {c['pass']:8} {c['op']:14} a {c['a']} b {c['b']} ({c['b_layout']}): "
                     f"{c['backend']}/{c['strategy']} ({c['runs']}); fresh inputs: equal to "
                     f"torch {c['equal_to_torch']} (max diff {c['max_abs_diff_vs_torch']:.3g}), "
                     f"error vs float64 fo {c['err_fo']:.3g} torch {c['err_torch']:.3g}")
    return lines


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
    p.add_argument("--shared-devices", action="store_true",
                   help="ranks share GPUs (rank r on GPU r mod count): checks the block against "
                        "float64 at any world size; its times measure nothing")
    args = p.parse_args(argv)
    if (args.device == "cuda" and torch.cuda.device_count() < args.world_size
            and not args.shared_devices):
        p.error(f"--world-size {args.world_size} needs that many GPUs, found "
                f"{torch.cuda.device_count()} (--shared-devices lets ranks share them, for "
                "correctness only)")
    for t, h, i in args.shapes:
        if t % args.world_size or i % args.world_size:
            p.error(f"shape {t}x{h}x{i}: T and I must be divisible by the world size")
    with Ranks(args.world_size, args.device, env=MULTICAST_OFF, timeout=args.timeout,
               shared_devices=args.shared_devices) as ranks:
        per_rank = ranks.run(run_rank, args.shapes, args.dtype, args.device, args.iters,
                             not args.no_compile, args.backend)
        topology = topology_record(ranks)
    rows = combine(per_rank)
    columns = ["T", "H", "I", "W"] + [f"{m}_{v}" for m in ("fwd", "fwdbwd") for v in VARIANTS
                                      if f"{m}_{v}" in rows[0]]
    columns += [c for c in rows[0] if "speedup" in c] + ["fwd_rel_err", "grad_rel_err"]
    print(table(rows, columns))
    for row in rows:
        print("\n".join(explain(row)))
    write_result(f"e2e-mlp-w{args.world_size}", rows,
                 {"dtype": args.dtype, "iters": args.iters, "topology": topology,
                  "times": ("not valid: ranks shared devices" if topology["shared_devices"]
                            else "ms, median, slowest rank")},
                 device_type=args.device)
    wrong = [f"{r['T']}x{r['H']}x{r['I']}" for r in rows if not r["fo_within_bound"]]
    if wrong:
        print(f"FAILED: fo's block is further from float64 than the bound allows: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
