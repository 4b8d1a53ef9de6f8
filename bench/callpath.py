"""Host cost of the call a user makes: ``fo.overlap(a, w.t(), op="allreduce")``.

On one GPU with an NCCL process group of one rank (bf16), per shape:
- host µs per call: wall time to issue N calls (no sync inside) / N, in steady state (the first
  two calls after the device went idle are not timed: ``host_times``), for the call with default
  arguments, with an explicit 4-group plan, with a new ``a`` every call, and for ``a @ b``;
- device-bound time per call: N back-to-back eager calls (default arguments) / N, against the
  same call replayed from a CUDA graph, and ``a @ b``.
On the CPU (reference backend, 16x16x16): µs per call with default arguments, with a callable
op, and with an explicit plan (the same plan), over ``a @ b``.

Summary: ``max_host_us`` (the 4-group allreduce over the shapes), ``max_host_us_default``,
``min_eager_vs_graph`` (graph time / eager time over shapes whose graph time is >= 0.1 ms),
``max_default_minus_plan_us`` (default arguments over an explicit plan, GPU), and the CPU
figures. Result: bench/results/callpath-<device>-<date>.json (or $FO_RESULTS_DIR).

    python bench/callpath.py [--shapes 1x4096x4096,...] [--cpu-only]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import flashoverlap_core as fo
from common import device_tag, table, write_result
from flashoverlap_core.tools.args import shape_arg, shapes_arg

SHAPES = "1x4096x4096,8x4096x4096,128x8192x4096,3072x6144x5120,4096x4096x4096,12288x4096x1536,8192x8192x8192,16384x8192x1024"
ISSUE = 20  # calls of the from-idle figure (the older method)


SETTLE = 2  # calls issued untimed after the device went idle (see host_times)
STEADY = 50  # calls timed after them


def host_times(fn, samples: int = 30) -> dict:
    """Host µs per call of ``fn``, from the wall time of each call issued back to back.

    On the H200 VM the first launches after the device went idle cost 30-350 µs, for cuBLAS
    as much as for fo (``first_calls``: the median µs of the first three calls after a
    synchronize). So ``steady`` (the figure the targets use) times ``STEADY`` calls after
    ``SETTLE`` untimed ones, as a model's layers issue them; ``from_idle`` is the mean of the
    first ``ISSUE`` calls right after a synchronize, the older method, kept for comparison.
    The launch queue never fills: at most 52 calls are in flight."""
    steady, idle, first = [], [], []
    for _ in range(samples):
        torch.cuda.synchronize()
        stamps = [time.perf_counter()]
        for _ in range(SETTLE + STEADY):
            fn()
            stamps.append(time.perf_counter())
        each = [(y - x) * 1e6 for x, y in zip(stamps, stamps[1:])]
        steady.append(statistics.fmean(each[SETTLE:]))
        idle.append(statistics.fmean(each[:ISSUE]))
        first.append(each[:3])
    torch.cuda.synchronize()
    return {"steady": statistics.median(steady), "from_idle": statistics.median(idle),
            "first_calls": [round(statistics.median(f[i] for f in first), 1) for i in range(3)]}


def host_us(fn, samples: int = 30) -> float:
    """Steady-state host µs per call (host_times)."""
    return host_times(fn, samples)["steady"]


def device_ms(fn, calls: int = 50, samples: int = 7) -> float:
    """Median time per call of ``calls`` back-to-back calls (events around the batch)."""
    fn()
    out = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / calls)
    return statistics.median(out)


def graph_ms(fn, calls: int = 50, samples: int = 7) -> float:
    """Median time per call of one graph holding ``calls`` calls, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    return device_ms(graph.replay, calls=1, samples=samples) / calls


def alternate(pair: list):
    """The other one of two tensors, each time it is called."""
    pair.reverse()
    return pair[0]


def four_groups(plan) -> list[int]:
    """The plan's tiles cut into 4 groups of whole waves where possible (else equal parts)."""
    tiles, wave = plan.num_tiles, plan.wave_size
    unit = wave if tiles >= 4 * wave else 1
    units = -(-tiles // unit)
    cuts = [round(units * i / 4) * unit for i in range(1, 4)]
    bounds = [0] + [min(c, tiles) for c in cuts] + [tiles]
    sizes = [y - x for x, y in zip(bounds, bounds[1:]) if y > x]
    return sizes


def gpu_rows(shapes) -> list[dict]:
    rows = []
    for m, n, k in shapes:
        shape = f"{m}x{n}x{k}"
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        b = w.t()
        base = fo.plan(m, n, k, dtype=torch.bfloat16, backend="cuda")
        plan4 = fo.plan(m, n, k, dtype=torch.bfloat16, backend="cuda",
                        group_sizes=four_groups(base))
        default = lambda: fo.overlap(a, b, op="allreduce")  # noqa: E731 - what users call
        # A new a every call (two tensors in turn), as layers of a model pass: the replayed
        # graph's GEMM node is re-pointed each time.
        a2 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        turn = [a, a2]
        moving = lambda: fo.overlap(alternate(turn), b, op="allreduce")  # noqa: E731
        planned = lambda: fo.overlap(a, b, op="allreduce", plan=plan4)  # noqa: E731
        matmul = lambda: a @ b  # noqa: E731
        ref = (a.float() @ b.float())
        got = default()
        torch.cuda.synchronize()
        err = ((got.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
        times = {name: host_times(fn) for name, fn in
                 (("default", default), ("plan4", planned), ("default_moving_a", moving),
                  ("matmul", matmul))}
        row = {"shape": shape, "groups_default": None, "groups_plan4": list(plan4.group_sizes)}
        for name, t in times.items():
            row[f"host_us_{name}"] = t["steady"]
            row[f"host_us_{name}_from_idle"] = t["from_idle"]
            row[f"first_calls_us_{name}"] = t["first_calls"]
        row.update({
            "eager_ms_default": device_ms(default), "graph_ms_default": graph_ms(default),
            "eager_ms_plan4": device_ms(planned), "graph_ms_plan4": graph_ms(planned),
            "matmul_ms": device_ms(matmul), "max_rel_err": err,
        })
        row["eager_vs_graph"] = row["graph_ms_default"] / row["eager_ms_default"]
        row["eager_vs_graph_plan4"] = row["graph_ms_plan4"] / row["eager_ms_plan4"]
        row["vs_matmul"] = row["matmul_ms"] / row["eager_ms_default"]
        rows.append(row)
        print(table([row], ["shape", "host_us_default", "host_us_plan4", "host_us_matmul",
                            "eager_ms_default", "graph_ms_default", "matmul_ms", "max_rel_err"]),
              flush=True)
    return rows


def breakdown(shape: str = "4096x4096x4096") -> dict:
    """Host µs of the pieces of one 4-group allreduce call: the whole call (and without the
    torch-integration layer above the API), the backend's
    prepared run without the API (out given), the native call alone, the same native call
    without a communicator (no waits, no NCCL), the GEMM launch alone, and torch.empty."""
    from flashoverlap_core import api, registry
    from flashoverlap_core.backend import OverlapCall

    m, n, k = shape_arg(shape)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    base = fo.plan(m, n, k, dtype=torch.bfloat16, backend="cuda")
    plan = fo.plan(m, n, k, dtype=torch.bfloat16, backend="cuda", group_sizes=four_groups(base))
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    fo.overlap(a, b, plan=plan, out=out)
    prepared = api.prepared_call(a, b, "allreduce", plan=plan)  # the key fo.overlap prepared
    # a "rows" plan's GEMM writes out itself (no packed buffer of its own)
    state = prepared.state()
    packed = state.packed if state.packed is not None else out
    stream = torch.cuda.current_stream().cuda_stream
    backend = registry.get("cuda")
    alone = backend.prepare(OverlapCall(a, b, plan, "allreduce", None, 0, 1, out))
    alone.run(a, b, out, "allreduce")
    alone_state = alone.state()
    lda, ldb = a.stride(0), b.stride(1)
    turn = [a, torch.randn_like(a)]
    outs = [out, torch.empty_like(out)]
    os.environ["FLASHOVERLAP_CUDA_GRAPH"] = "0"  # the same call, each launch issued by itself
    launches = backend.prepare(OverlapCall(a, b, plan, "allreduce", prepared.template.group, 0, 1, out))
    os.environ.pop("FLASHOVERLAP_CUDA_GRAPH")
    launches.run(a, b, out, "allreduce")
    launches_state = launches.state()
    for _ in range(3):
        prepared.run(a, b, out, "allreduce")
    graph_state = prepared.graph_state()
    tables = prepared.tables
    gemm = prepared.gemm
    pieces = {
        "call": lambda: fo.overlap(a, b, plan=plan, out=out),
        "api_call": lambda: api.overlap(a, b, plan=plan, out=out),  # without the torch-op layer
        "prepared_run": lambda: prepared.run(a, b, out, "allreduce"),
        "native_call": lambda: prepared.runtime.call_run(state.handle, a.data_ptr(), lda,
                                                         b.data_ptr(), ldb, out.data_ptr(), stream, 0),
        "native_call_moving_operands": lambda: prepared.runtime.call_run(
            state.handle, alternate(turn).data_ptr(), lda, b.data_ptr(), ldb,
            alternate(outs).data_ptr(), stream, 0),
        "native_call_launch_by_launch": lambda: launches.runtime.call_run(
            launches_state.handle, a.data_ptr(), lda, b.data_ptr(), ldb, out.data_ptr(), stream, 0),
        "native_call_no_collective": lambda: alone.runtime.call_run(
            alone_state.handle, a.data_ptr(), lda, b.data_ptr(), ldb, out.data_ptr(), stream, 0),
        "gemm_launch": lambda: gemm.run(a.data_ptr(), b.data_ptr(), packed.data_ptr(), 1, m, n,
                                        k, lda, ldb, tables.items.data_ptr(),
                                        tables.item_group.data_ptr(), plan.num_tiles,
                                        tables.counters.data_ptr(), plan.wave_size, None, None,
                                        stream),
        "torch_empty": lambda: torch.empty(m, n, device="cuda", dtype=torch.bfloat16),
        "matmul_out": lambda: torch.matmul(a, b, out=out),  # cuBLAS under the same conditions
    }
    result = {name: host_us(fn) for name, fn in pieces.items()}
    torch.cuda.synchronize()
    tables.counters.zero_()
    result["shape"], result["groups"] = shape, list(plan.group_sizes)
    result["graph_state"] = graph_state  # 1: the prepared call replays its captured graph
    return result


def cpu_figures() -> dict:
    """µs per call on the CPU, reference backend, 16x16x16, float32, over ``a @ b``."""
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    plan = fo.plan(16, 16, 16, dtype=torch.float32, backend="reference", b_layout="row")
    op = lambda region, index: None  # noqa: E731
    custom_plan = fo.plan(16, 16, 16, op="custom", dtype=torch.float32, backend="reference",
                          b_layout="row")
    cases = {
        "default": lambda: fo.overlap(a, b, backend="reference"),
        "plan": lambda: fo.overlap(a, b, plan=plan),
        "callable": lambda: fo.overlap(a, b, op, backend="reference"),
        "callable_plan": lambda: fo.overlap(a, b, op, plan=custom_plan),
        "matmul": lambda: a @ b,
    }
    for fn in cases.values():
        for _ in range(200):
            fn()
    samples = {name: [] for name in cases}
    for _ in range(15):  # interleaved rounds, the fastest of each: robust to a busy machine
        for name, fn in cases.items():
            t = time.perf_counter()
            for _ in range(200):
                fn()
            samples[name].append((time.perf_counter() - t) / 200 * 1e6)
    out = {f"cpu_us_{name}": min(values) for name, values in samples.items()}
    out["cpu_default_minus_plan_us"] = out["cpu_us_default"] - out["cpu_us_plan"]
    out["cpu_callable_minus_plan_us"] = out["cpu_us_callable"] - out["cpu_us_callable_plan"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=shapes_arg, default=shapes_arg(SHAPES),
                        help=f"MxNxK list (default: {SHAPES})")
    parser.add_argument("--cpu-only", action="store_true", help="only the CPU figures")
    args = parser.parse_args()
    os.environ.setdefault("FLASHOVERLAP_TUNING_CACHE", "off")  # the heuristic plan, everywhere
    summary = cpu_figures()
    print({k: round(v, 2) for k, v in summary.items()}, flush=True)
    rows = []
    if not args.cpu_only and torch.cuda.is_available():
        store = tempfile.mktemp(prefix="fo-callpath-")
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        rows = gpu_rows(args.shapes)
        summary["breakdown_us"] = breakdown()
        print("host us per piece:", {k: v if isinstance(v, (str, list)) else round(v, 2)
                                     for k, v in summary["breakdown_us"].items()}, flush=True)
        long = [r for r in rows if r["graph_ms_default"] >= 0.1]
        summary.update({
            "max_host_us": max(r["host_us_plan4"] for r in rows),
            "max_host_us_default": max(r["host_us_default"] for r in rows),
            "max_host_us_default_moving_a": max(r["host_us_default_moving_a"] for r in rows),
            "max_host_us_from_idle": max(r["host_us_plan4_from_idle"] for r in rows),
            "max_host_us_matmul": max(r["host_us_matmul"] for r in rows),
            "host_method": f"steady state: {STEADY} calls timed after {SETTLE} untimed ones, "
                           "the device idle before them (host_times)",
            "max_default_minus_plan_us": max(r["host_us_default"] - r["host_us_plan4"] for r in rows),
            "min_eager_vs_graph": min(r["eager_vs_graph"] for r in long) if long else None,
            "max_rel_err": max(r["max_rel_err"] for r in rows),
        })
        summary["met"] = bool(summary["max_host_us"] <= 30 and summary["max_host_us_default"] <= 30
                              and (summary["min_eager_vs_graph"] or 0) >= 0.95
                              and summary["cpu_default_minus_plan_us"] <= 15
                              and summary["cpu_callable_minus_plan_us"] <= 15)
        dist.destroy_process_group()
    print(summary, flush=True)
    device = device_tag() if rows else "cpu"
    write_result(f"callpath-{device}", rows, {"summary": summary, "collective": "nccl, 1 rank",
                                              "dtype": "bfloat16"},
                 device_type="cuda" if rows else "cpu")


if __name__ == "__main__":
    main()
