"""MoE all_to_all (expert parallelism): the combine GEMM of an expert layer and its all-to-all.

    python bench/moe.py [--hidden 4096,7168] [--tokens 512,2048,8192,16384] [--world-size W]
                        [--device cuda|cpu] [--shared-devices] [--iters N]

Each step, every rank's T tokens pick 2 experts (top-2 routing) with one hot rank 5x as likely
as the others (the imbalance of the seed's generator), so each rank's rows M_r (tokens its
experts took) and splits change every step, skewed and with zeros at times. Rank r computes
[M_r, K] @ [K, hidden] (K: the experts' FFN width, 14336 at hidden 4096, 2048 at hidden 7168,
as Mixtral's and DeepSeek-V3's experts) and sends each token's row back to its owner.

Per shape (the slowest rank's median over steps): ``fo`` = fo.overlap(..., "all_to_all") with
default arguments and recv_splits given; ``sequential`` = a @ b, then all_to_all_single (at
world size 1 too, on the NCCL group of one: the plain form as a user writes it);
``decomposition`` = the same call on backend="decomposition"; ``host_us``, the host time per fo
call in steady state (rows and splits of a new step every call, every table laid out anew);
at world size 1 also ``matmul`` = a @ b alone. Each row names the backend fo ran on, and fo's error against float64.
Ranks sharing devices (--shared-devices) check the harness only: their times say nothing.

Result: bench/results/moe-<device>-<date>.json (or $FO_RESULTS_DIR); ``summary.max_host_us``
is the worst per-call host time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import flashoverlap_core as fo
from flashoverlap_core import api
from flashoverlap_core.devices import current_device
from flashoverlap_core.tools.args import at_least
from flashoverlap_core.tools.ranks import Ranks
from common import device_tag, table, write_result
from multigpu import MULTICAST_OFF, topology_record

FFN = {4096: 14336, 7168: 2048}
TOP_K, HOT = 2, 5.0
STEPS = 8  # routing steps cycled through while timing


def routing(tokens: int, world: int, seed: int) -> list[list[int]]:
    """counts[src][dst]: token-expert pairs of src's tokens that dst's experts take."""
    g = torch.Generator().manual_seed(seed)
    hot = int(torch.randint(world, (1,), generator=g))
    weights = torch.ones(world)
    weights[hot] = HOT
    counts = []
    for _ in range(world):
        picks = torch.multinomial(weights.expand(tokens, world), min(TOP_K, world),
                                  generator=g)
        per_dst = torch.bincount(picks.flatten(), minlength=world)
        if world == 1:
            per_dst = per_dst * TOP_K  # both picks are this rank's experts
        counts.append(per_dst.tolist())
    return counts


def step_inputs(tokens, hidden, seed, rank, world, device, dtype):
    """This rank's (a, send_splits, recv_splits) of one routing step."""
    counts = routing(tokens, world, seed)
    rows = sum(counts[src][rank] for src in range(world))
    g = torch.Generator().manual_seed(seed * 131 + rank)
    a = torch.randn(rows, FFN.get(hidden, 4 * hidden), generator=g).to(device, dtype)
    send = [counts[dst][rank] for dst in range(world)]  # back to each token's owner
    recv = [counts[rank][src] for src in range(world)]
    return a, send, recv


def sequential(a, b, send, recv, at_one: bool = True):
    """The plain form: a @ b, then all_to_all_single on the group, at world size 1 too (an
    NCCL group of one copies the rows: what the user's own code pays there; ``matmul`` is the
    GEMM alone). ``at_one`` False: no collective at world size 1 (the reference)."""
    c = a @ b
    if dist.is_initialized() and (at_one or dist.get_world_size() > 1):
        out = c.new_empty((sum(recv), c.shape[1]))
        dist.all_to_all_single(out, c, output_split_sizes=recv, input_split_sizes=send)
        return out
    return c


def timed(fn, device_type: str, iters: int) -> float:
    """Median ms of ``fn(step)`` over the steps, each behind a barrier (the slowest rank's is
    taken by the caller)."""
    times = []
    sync = (torch.get_device_module(device_type).synchronize if device_type != "cpu"
            else (lambda: None))
    for i in range(iters + 2):
        if dist.is_initialized():
            dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn(i % STEPS)
        sync()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def host_us(fn, device_type: str, calls: int = 50) -> float:
    """Host µs per call issued back to back (steady state: two untimed calls first)."""
    sync = torch.get_device_module(device_type).synchronize if device_type != "cpu" else None
    if sync:
        sync()
    for i in range(2):
        fn(i % STEPS)
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i % STEPS)
    spent = (time.perf_counter() - t0) / calls * 1e6
    if sync:
        sync()
    return spent


def rank_rows(shapes, dtype_name: str, device_type: str, iters: int) -> list[dict]:
    """Every shape on this rank; run on every rank at once."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = current_device(device_type)
    dtype = getattr(torch, dtype_name)
    rows = []
    for tokens, hidden in shapes:
        api.forget_prepared()  # every rank alike: the first call below is this shape's own key
        k = FFN.get(hidden, 4 * hidden)
        w = torch.randn(hidden, k, generator=torch.Generator().manual_seed(7)).to(device, dtype)
        b = w.t()  # an expert's down projection, as nn.Linear keeps it
        steps = [step_inputs(tokens, hidden, 1000 * s + 17, rank, world, device, dtype)
                 for s in range(STEPS)]

        def fo_call(i, backend=None):
            a, send, recv = steps[i]
            return fo.overlap(a, b, "all_to_all", send_splits=send, recv_splits=recv,
                              backend=backend)

        a0, send0, recv0 = steps[0]
        got = fo_call(0)
        want = sequential(a0.double(), b.double(), send0, recv0, at_one=False)
        scale = float(want.abs().max()) if want.numel() else 1.0
        row = {"tokens": tokens, "hidden": hidden, "K": k, "W": world,
               "rows_min": min(s[0].shape[0] for s in steps),
               "rows_max": max(s[0].shape[0] for s in steps),
               "fo_backend": fo.prepared_calls()[-1]["backend"],
               "fo_rel_err": float((got.double() - want).abs().max()) / scale if want.numel() else 0.0,
               "fo_ms": timed(fo_call, device_type, iters),
               "sequential_ms": timed(lambda i: sequential(steps[i][0], b, *steps[i][1:]),
                                      device_type, iters),
               "decomposition_ms": timed(lambda i: fo_call(i, "decomposition"), device_type, iters)}
        if world == 1:
            row["matmul_ms"] = timed(lambda i: steps[i][0] @ b, device_type, iters)
            row["host_us_matmul"] = host_us(lambda i: steps[i][0] @ b, device_type)
        row["host_us"] = host_us(fo_call, device_type)
        rows.append(row)
    return rows


def combine(per_rank: list[list[dict]]) -> list[dict]:
    """Per shape, the slowest rank's times and the worst error; the ratios."""
    out = []
    for rows in zip(*per_rank):
        row = dict(rows[0])
        for key in row:
            if key.endswith("_ms") or key.endswith("_us") or key == "fo_rel_err":
                row[key] = max(r[key] for r in rows)
        row["fo_backend"] = sorted({r["fo_backend"] for r in rows})
        row["vs_sequential"] = row["sequential_ms"] / row["fo_ms"]
        row["vs_decomposition"] = row["decomposition_ms"] / row["fo_ms"]
        if "matmul_ms" in row:
            row["vs_matmul"] = row["matmul_ms"] / row["fo_ms"]
        out.append(row)
    return out


def on_one_process(shapes, dtype, device, iters):
    """World size 1: an NCCL group of one rank on a GPU (the collective really runs)."""
    if device == "cuda":
        store = tempfile.mktemp(prefix="fo-moe-")
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    try:
        return [rank_rows(shapes, dtype, device, iters)]
    finally:
        if device == "cuda":
            dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", default="4096,7168")
    p.add_argument("--tokens", default="512,2048,8192,16384", help="tokens per rank")
    p.add_argument("--world-size", type=at_least(1), default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cuda", "cpu"])
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--iters", type=at_least(1), default=10)
    p.add_argument("--shared-devices", action="store_true",
                   help="ranks share GPUs: checks the harness; its times measure nothing")
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    try:
        shapes = [(int(t), int(h)) for h in args.hidden.split(",") for t in args.tokens.split(",")]
    except ValueError:
        p.error("--hidden and --tokens are comma-separated ints")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    topology = None
    if args.world_size == 1:
        per_rank = on_one_process(shapes, dtype, args.device, args.iters)
    else:
        with Ranks(args.world_size, args.device, env=MULTICAST_OFF, timeout=args.timeout,
                   shared_devices=args.shared_devices) as ranks:
            per_rank = ranks.run(rank_rows, shapes, dtype, args.device, args.iters)
            topology = topology_record(ranks)
    rows = combine(per_rank)
    columns = ["tokens", "hidden", "K", "W", "rows_min", "rows_max", "fo_backend", "fo_ms",
               "sequential_ms", "decomposition_ms", "matmul_ms", "vs_matmul", "vs_sequential",
               "vs_decomposition", "host_us", "host_us_matmul", "fo_rel_err"]
    print(table(rows, [c for c in columns if c in rows[0]]))
    hosts = [r["host_us"] for r in rows if "host_us" in r]
    bad = [f"{r['tokens']}x{r['hidden']}" for r in rows if not r["fo_rel_err"] <= 2e-2]
    summary = {"max_host_us": max(hosts) if hosts else None,
               "host_us_world_size": args.world_size,
               "min_vs_sequential": min(r["vs_sequential"] for r in rows),
               "min_vs_decomposition": min(r["vs_decomposition"] for r in rows),
               "backends": sorted({b for r in rows for b in r["fo_backend"]}),
               "errors_over_bound": bad,
               "times_valid": not (topology or {}).get("shared_devices", False)}
    print(summary)
    device = args.device
    if device == "cuda":
        device = device_tag()
    write_result(f"moe-{device}", rows, {"summary": summary, "dtype": dtype,
                                         "world_size": args.world_size, "topology": topology,
                                         "routing": f"top-{TOP_K}, one hot rank x{HOT}"},
                 device_type=args.device)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
