"""What the default call costs over the user's own code, at world size 1 (issues 30 and 31).

On an NCCL group of one rank the collective moves nothing, so the difference between
``fo.overlap(a, b, op=...)`` (default arguments, eager: the call a user makes) and the plain
form (``a @ b`` or ``torch._scaled_mm``, then the same collective through torch.distributed) is
what the overlapped call itself adds: its GEMM against cuBLAS, its waits, and any pass over the
output (the post-communication reorder, which "rows" plans do not have).

Rows: tokens x (N, K) x op x dtype. Ops: allreduce, reduce_scatter, all_to_all (equal splits),
allgather, and ``fo.overlap_add_rmsnorm`` against ``a @ b`` + allreduce + a torch.compile'd
add + ``rms_norm``; bf16, and fp8 (e4m3, row-wise scales) for the four collectives (each has a
native fp8 path on cuda; the plain form: ``torch._scaled_mm``, and allgather gathers the e4m3
rows and their scales first). ``--dtypes ...,fp8b`` adds block-wise fp8 rows (1x128 and 128x128
scales, in the layouts torch's block-wise ``scaled_mm`` takes, laid out once; the plain form is
that GEMM, or where this torch lacks it tensor-wise ``_scaled_mm``, and each row's
``plain_gemm`` says which): not in the default run. Each row also records the signaling GEMM alone against
cuBLAS on the same shape (its ``gemm_ratio``; both GEMMs alone, CUDA-graph replays, timed in
the row's own alternation so that they run at the row's clocks): where that is below 0.97 the
row's bound is the GEMM's own ratio minus 0.01 (issue 30). An allreduce row records the call's workspace bytes
(``fo.prepared_calls()``) against its output's. Writes bench/results/overhead-<device>-<date>.json
with a ``summary`` (min and median of plain / fo, and whether the targets are met).

Two kinds of rows (issue 31 added the first):

* **decode** (tokens <= 256): the call exactly as a user makes it, default arguments: its
  strategy is chosen on its first call (at world size 1 the plain path). Target: plain / fo
  >= 0.98 at every row, ``overlap_add_rmsnorm`` >= 1.0.
* **prefill** (tokens >= 1024): the overlapped call (``FLASHOVERLAP_STRATEGY=overlap``, or
  ``--prefill-strategy auto`` for the default call): what overlapping itself costs (issue 30's
  targets above).

Each row records the strategy the call ran (``fo.prepared_calls()``).

Timing (``common.steady_times``): each side is timed as a call in a running program sees it,
eager, back to back, each timed batch queued right behind one more untimed call, so the device
is still busy while the host queues the batch; the two sides' batches alternate (45 each, the
medians kept), so both see the same GPU clocks. The device time per call is the row's ``fo_ms``
/ ``plain_ms``; the host's time to queue one call is its ``fo_host_us`` / ``plain_host_us``.
Until 2026-12-04 the batch started on an idle device, which counted the first call's host time
(launch latency) as device time once per batch (3 or 10 calls): fo's longer host time weighed
on the short rows that way, not through its device time. A host-bound call is still timed at
the host's pace.

    python bench/overhead.py [--tokens 1,16,64,256,1024,4096,16384] [--ops ...] [--dtypes bf16,fp8[,fp8b]]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flashoverlap_core as fo
from flashoverlap_core import api, fp8
from common import (device_tag, graph, nccl_group_of_one, steady_times, table, trace_events,
                    write_result)

SHAPES = ((8192, 1024), (8192, 3584), (4096, 7168), (7168, 2048), (5120, 3456))
OPS = ("allreduce", "reduce_scatter", "all_to_all", "allgather", "add_rmsnorm")
FP8_OPS = ("allreduce", "reduce_scatter", "all_to_all", "allgather")
FP8_KINDS = {"fp8": "rowwise", "fp8b": "blockwise"}  # --dtypes names of fp8 rows: their scales
TARGET_MIN, TARGET_MEDIAN, NORM_TARGET, WORKSPACE_FRACTION = 0.97, 0.99, 1.0, 0.01
DECODE_MAX, DECODE_TARGET = 256, 0.98  # decode rows: tokens <= DECODE_MAX, the default call
STRATEGY_ENV = "FLASHOVERLAP_STRATEGY"
EPS = 1e-6


PAIRS = 45  # pair(): batches of each side, alternating


def pair(fo_call, plain, inner: int, gemms: dict | None = None) -> dict:
    """{name: (ms, host µs) per call}: the medians of PAIRS batches of each side, alternating
    (common.steady_times), so that both sides see the same clocks (the GPU's clock moved runs
    of one side by up to 7% between earlier, separate timings). ``gemms`` (gemm_alone) joins
    the same alternation: the row's GEMMs alone, timed under the row's own clocks."""
    fo_call(), plain()  # first calls: prepare, compile, load
    torch.cuda.synchronize()
    return steady_times({"fo": fo_call, "plain": plain, **(gemms or {})}, iters=PAIRS, inner=inner)


class GemmAlone:
    """The signaling GEMM alone (the default allreduce plan, counters that only grow) and cuBLAS
    on the same operands (``_scaled_mm`` for fp8), each one launch captured in a CUDA graph and
    replayed (bench/gemm.py's device time, without Python's launch cost). ``fns`` join a row's
    alternation (pair), so its gemm_ratio is measured under the clocks its call ran at: timed
    apart, minutes before the row, the same fp8 GEMM's ratio read 0.921 in one run and 0.898 in
    the next while its row read 0.893 and 0.898 (2026-12-04, 4096 x 8192 x 3584), twice the 1%
    a row's bound allows."""

    def __init__(self, a, b, dtype: str, scales):
        backend = fo.registry.get("cuda")
        scaled = dtype in FP8_KINDS
        plan = fo.plan(a.shape[0], b.shape[1], a.shape[1], "allreduce", 1, a.dtype, backend="cuda",
                       **({"out_dtype": torch.bfloat16} if scaled else {}),
                       **({"scaling": "blockwise"} if dtype == "fp8b" else {}))
        self.packed = torch.empty(plan.packed_numel, dtype=plan.result_dtype, device=a.device)
        self.counters = torch.zeros(plan.num_groups, dtype=torch.int32, device=a.device)

        def signaling():
            backend.launch_gemm(plan, a, b, self.packed, counters=self.counters,
                                scales=scales.fo if scales is not None else None)

        self.graphs = {"fo_gemm": graph(signaling, 1),
                       "cublas_gemm": graph(lambda: plain_product(a, b, scales), 1)}
        self.fns = {name: g.replay for name, g in self.graphs.items()}

    @staticmethod
    def ratio(times: dict) -> float:
        return times["cublas_gemm"][0] / times["fo_gemm"][0]


class Scales:
    """An fp8 row's scales: ``fo`` = (scale_a, scale_b) as the call takes them; block-wise
    ones in the layouts torch's block-wise ``scaled_mm`` takes (laid out once, here), which fo
    reads in place; ``plain_gemm``: what the plain form's GEMM is."""

    def __init__(self, kind: str, m: int, n: int, k: int):
        self.kind = kind
        if kind == "rowwise":
            self.fo = (torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5)
            self.torch_b, self.blockwise = None, False
            self.plain_gemm = "torch._scaled_mm row-wise"
            return
        kb, nb = fp8.blocks(k), fp8.blocks(n)
        sa, sb = torch.rand(m, kb, device="cuda") + 0.5, torch.rand(kb, nb, device="cuda") + 0.5
        tsa, tsb = fp8.torch_blockwise_scales(sa, sb, k)
        self.fo = (tsa, tsb[:kb])  # views of torch's layouts: fo takes any strides
        self.torch_b = tsb
        self.blockwise = fp8.blockwise_available(torch.device("cuda"))
        self.plain_gemm = ("torch.nn.functional.scaled_mm block-wise" if self.blockwise else
                           "torch._scaled_mm tensor-wise (this torch has no block-wise scaled_mm)")

    def product(self, a, b, scale_a=None):
        """The plain form's GEMM of ``a`` (``scale_a``: its own rows' scales, e.g. gathered;
        block-wise in torch's layout)."""
        sa = self.fo[0] if scale_a is None else scale_a
        if self.kind == "rowwise":
            return torch._scaled_mm(a, b, sa, self.fo[1], out_dtype=torch.bfloat16,
                                    use_fast_accum=True)
        if not self.blockwise:
            one = torch.ones((), device=a.device)
            return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)
        # the scales are in torch's layouts already: fp8.blockwise_mm copies nothing
        return fp8.blockwise_mm(a, b, sa, self.torch_b, torch.bfloat16)


def operands(m, n, k, dtype: str):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    if dtype not in FP8_KINDS:
        return a, w.t(), None
    a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    scales = Scales(FP8_KINDS[dtype], m, n, k)
    if scales.blockwise:
        try:  # torch's block-wise GEMM may refuse a shape: then the tensor-wise one, recorded
            scales.product(a8, w8.t())
        except (RuntimeError, NotImplementedError, ValueError) as e:
            scales.blockwise = False
            scales.plain_gemm = (f"torch._scaled_mm tensor-wise (torch's block-wise scaled_mm "
                                 f"refused it: {str(e).splitlines()[0][:120]})")
    return a8, w8.t(), scales


def plain_product(a, b, scales, scale_a=None):
    """The GEMM a user would write: ``a @ b``, or for fp8 torch's scaled GEMM (bf16 out)."""
    if scales is None:
        return a @ b
    return scales.product(a, b, scale_a)


def gathered_scale_a(scale_a: torch.Tensor, group) -> torch.Tensor:
    """Every rank's scale_a rows, in its layout: row-wise [W m, 1]; block-wise [W m, kb] with
    strides (1, W m), torch's (each rank's [m, kb] is outer-dim-major: gathered as [kb, m])."""
    world = dist.get_world_size(group)
    m, kb = scale_a.shape
    if kb == 1:
        out = scale_a.new_empty(world * m, 1)
        dist.all_gather_into_tensor(out, scale_a.contiguous(), group=group)
        return out
    parts = scale_a.new_empty(world * kb, m)
    dist.all_gather_into_tensor(parts, scale_a.t().contiguous(), group=group)
    return rows_of_ranks(parts, world)


def rows_of_ranks(parts: torch.Tensor, world: int) -> torch.Tensor:
    """Each rank's [kb, m] (its scale_a transposed), stacked [W kb, m] as all_gather puts
    them, as the [W m, kb] scale_a of all their rows, rank by rank, strides (1, W m)."""
    kb, m = parts.shape[0] // world, parts.shape[1]
    return parts.view(world, kb, m).permute(1, 0, 2).reshape(kb, world * m).t()


def inner_calls(m: int, n: int, k: int) -> int:
    """Calls per timed batch: 10, or 3 for the largest rows."""
    return 10 if m * n * k < 1 << 36 else 3


def calls(op: str, a, b, scales, compiled_norm):
    """(fo call, plain call, output rows) of one row."""
    m, n = a.shape[0], b.shape[1]
    kw = {} if scales is None else {"scale_a": scales.fo[0], "scale_b": scales.fo[1],
                                    "out_dtype": torch.bfloat16}

    def product(x=a):
        return plain_product(x, b, scales)

    if op == "allreduce":
        def plain():
            c = product()
            dist.all_reduce(c)
            return c
        return (lambda: fo.overlap(a, b, op="allreduce", **kw)), plain
    if op == "reduce_scatter":
        def plain():
            out = torch.empty(m, n, device=a.device, dtype=torch.bfloat16)
            dist.reduce_scatter_tensor(out, product())
            return out
        return (lambda: fo.overlap(a, b, op="reduce_scatter", **kw)), plain
    if op == "all_to_all":
        def plain():
            out = torch.empty(m, n, device=a.device, dtype=torch.bfloat16)
            dist.all_to_all_single(out, product(), [m], [m])
            return out
        return (lambda: fo.overlap(a, b, op="all_to_all", send_splits=[m], recv_splits=[m],
                                   **kw)), plain
    if op == "allgather":
        def plain():
            gathered = torch.empty_like(a)
            if scales is None:
                dist.all_gather_into_tensor(gathered, a)
                return gathered @ b
            # e4m3 rows move as bytes, with their scales
            dist.all_gather_into_tensor(gathered.view(torch.uint8), a.view(torch.uint8))
            return plain_product(gathered, b, scales, gathered_scale_a(scales.fo[0], None))
        return (lambda: fo.overlap(a, b, op="allgather", **kw)), plain
    residual = torch.randn(m, n, device=a.device, dtype=torch.bfloat16)
    weight = torch.randn(n, device=a.device, dtype=torch.bfloat16)

    def plain():
        c = product()
        dist.all_reduce(c)
        return compiled_norm(c, residual, weight)
    return (lambda: fo.overlap_add_rmsnorm(a, b, residual, weight, eps=EPS, op="allreduce")), plain


def add_norm(x, residual, weight):
    resid = residual + x
    return F.rms_norm(resid, (resid.shape[-1],), weight, EPS), resid


def strategy_of(op: str, m: int, n: int) -> str | None:
    """The strategy the prepared call of this row ran (fo.prepared_calls)."""
    for call in reversed(fo.prepared_calls()):
        if call["op"] == ("allreduce" if op == "add_rmsnorm" else op) and call["N"] == n:
            return call["strategy"]
    return None


def workspace_fraction(m: int, n: int) -> float | None:
    """The allreduce call's buffers (fo.prepared_calls) over its output's bytes."""
    for call in fo.prepared_calls():
        if call["op"] == "allreduce" and call["a"][0] == m and call["N"] == n:
            return call["workspace_bytes"] / (m * n * 2)
    return None


def summarize(rows: list[dict], decode: bool) -> dict:
    """min / median of plain / fo over the calls (the fused norm's rows apart), and met."""
    calls_rows = [r for r in rows if r["op"] != "add_rmsnorm"]
    ratios = [r["ratio"] for r in calls_rows]
    spaces = [r["workspace_fraction"] for r in rows if r.get("workspace_fraction") is not None]
    out = {
        "rows": len(rows), "rows_met": sum(r["met"] for r in rows),
        "min_ratio": min(ratios, default=None),
        "median_ratio": statistics.median(ratios) if ratios else None,
        "norm_min_ratio": min((r["ratio"] for r in rows if r["op"] == "add_rmsnorm"),
                              default=None),
    }
    met = all(r["met"] for r in rows)
    if not decode:
        out["max_workspace_fraction"] = max(spaces, default=None)
        met = (met and (not ratios or statistics.median(ratios) >= TARGET_MEDIAN)
               and all(f <= WORKSPACE_FRACTION for f in spaces))
    out["met"] = met
    return out


def measure_row(kind: str, op: str, dtype: str, a, b, scales, compiled_norm,
                gemms: GemmAlone | None) -> dict:
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    fo_call, plain = calls(op, a, b, scales, compiled_norm)
    inner = inner_calls(m, n, k)
    t = pair(fo_call, plain, inner, gemms.fns if gemms is not None else None)
    (fo_ms, fo_host), (plain_ms, plain_host) = t["fo"], t["plain"]
    ratio = GemmAlone.ratio(t) if gemms is not None else None
    if op == "add_rmsnorm":
        bound = NORM_TARGET
    elif kind == "decode":
        bound = DECODE_TARGET
    else:
        bound = min(TARGET_MIN, ratio - 0.01)
    row = {"kind": kind, "op": op, "dtype": dtype, "M": m, "N": n, "K": k,
           "strategy": strategy_of(op, m, n), "fo_ms": round(fo_ms, 4),
           "plain_ms": round(plain_ms, 4), "ratio": round(plain_ms / fo_ms, 4),
           "gemm_ratio": None if ratio is None else round(ratio, 4), "bound": round(bound, 4),
           "met": plain_ms / fo_ms >= bound,
           "fo_host_us": round(fo_host, 1), "plain_host_us": round(plain_host, 1)}
    if scales is not None:
        row["plain_gemm"] = scales.plain_gemm
    if op == "allreduce" and kind == "prefill":
        row["workspace_fraction"] = workspace_fraction(m, n)
    return row


def warm_calls(rows: list[tuple[str, str, int, int, int]]):
    """Per given row, fo's call then the plain form, each after five warm-up calls and a
    synchronize: yields ((op, dtype, m, n, k), "fo" or "plain", the call); the prepared calls
    are dropped after each row."""
    for row in rows:
        op, dtype, m, n, k = row
        a, b, scales = operands(m, n, k, dtype)
        fo_call, plain = calls(op, a, b, scales, torch.compile(add_norm))
        for name, fn in (("fo", fo_call), ("plain", plain)):
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            yield row, name, fn
        api.forget_prepared()


def device_rows(events: list[dict], t0: float, name_chars: int) -> list[dict]:
    """Trace events as table rows: name (cut), stream, start from ``t0`` and duration (µs)."""
    return [{"name": e["name"][:name_chars], "stream": e.get("args", {}).get("stream"),
             "start_us": round(e["ts"] - t0, 2), "dur_us": round(e["dur"], 2)} for e in events]


def profile_back_to_back(rows: list[tuple[str, str, int, int, int]], calls_each: int = 8):
    """--back-to-back: each given row's calls as the benchmark times them (no synchronize
    between them): the host time to issue one call, the device time per call (first kernel's
    start to last kernel's end, over ``calls_each`` calls) and each call's kernels, memcpys and
    memsets with their streams, so that the gaps between calls show. Writes
    overhead-b2b-<device>-<date>.json; no targets."""
    import time

    from torch.profiler import ProfilerActivity, profile

    found = []
    for (op, dtype, m, n, k), name, fn in warm_calls(rows):
        began = time.perf_counter()
        for _ in range(50):
            fn()
        host_us = (time.perf_counter() - began) / 50 * 1e6
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(calls_each):
                fn()
            torch.cuda.synchronize()
        events = sorted(trace_events(prof, ("kernel", "gpu_memcpy", "gpu_memset")),
                        key=lambda e: e["ts"])
        t0 = events[0]["ts"] if events else 0
        per_call = ((max(e["ts"] + e["dur"] for e in events) - t0) / calls_each
                    if events else None)
        timeline = device_rows(events, t0, 60)
        found.append({"op": op, "dtype": dtype, "M": m, "N": n, "K": k, "path": name,
                      "host_us_per_call": round(host_us, 2),
                      "device_us_per_call": per_call and round(per_call, 2),
                      "timeline": timeline})
        print(f"{op} {dtype} {m}x{n}x{k} {name}: host {host_us:.1f} us/call, device "
              f"{per_call:.1f} us/call over {calls_each} back-to-back calls", flush=True)
        print(table(timeline[:16], ["stream", "start_us", "dur_us", "name"]), flush=True)
    write_result(f"overhead-b2b-{device_tag()}", found, {
        "note": "torch.profiler device timelines of back-to-back calls (no synchronize between "
                "them), NCCL group of one rank; host_us_per_call: wall time to issue one of 50 "
                "calls"})


def profile_rows(rows: list[tuple[str, str, int, int, int]], calls_each: int = 4):
    """--profile: the device timeline of a few back-to-back calls of each given row (fo, then
    the plain form), from a torch.profiler trace: per call, its GPU span and every kernel,
    memcpy and memset with its stream, start (from the call's first) and duration. Prints a
    table per row and writes overhead-profile-<device>-<date>.json; no targets."""
    from torch.profiler import ProfilerActivity, profile

    found = []
    for (op, dtype, m, n, k), name, fn in warm_calls(rows):
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(calls_each):
                fn()
                torch.cuda.synchronize()  # calls apart, so each call's span is its own
        events = trace_events(prof, ("kernel", "gpu_memcpy", "gpu_memset"))
        events.sort(key=lambda e: e["ts"])
        # split into calls at gaps longer than 20 us (each call ends with a synchronize)
        groups, last_end = [], None
        for e in events:
            if last_end is None or e["ts"] - last_end > 20:
                groups.append([])
            groups[-1].append(e)
            last_end = max(last_end or 0, e["ts"] + e.get("dur", 0))
        spans = [max(e["ts"] + e["dur"] for e in g) - g[0]["ts"] for g in groups]
        one = groups[-1] if groups else []
        t0 = one[0]["ts"] if one else 0
        kernels = device_rows(one, t0, 90)
        found.append({"op": op, "dtype": dtype, "M": m, "N": n, "K": k, "path": name,
                      "span_us": [round(x, 2) for x in spans], "last_call": kernels})
        print(f"{op} {dtype} {m}x{n}x{k} {name}: spans {[round(x, 1) for x in spans]} us")
        print(table(kernels, ["stream", "start_us", "dur_us", "name"]), flush=True)
    write_result(f"overhead-profile-{device_tag()}", found, {"note": "torch.profiler device "
                 "timelines of single calls (synchronised apart), NCCL group of one rank"})


def split_rows(rows: list[tuple[str, str, int, int, int]]):
    """--split: where each given row's time goes. Four functions timed together, alternating
    (pair): the fo call, the plain form, and the two GEMMs alone (GemmAlone: the signaling GEMM
    of the default allreduce plan and cuBLAS / ``_scaled_mm``, graph replays). fo - fo_gemm is
    what the call adds to its GEMM on the device, plain - cublas_gemm what the plain form adds
    to cuBLAS's. Writes overhead-split-<device>-<date>.json; no targets."""
    found = []
    for op, dtype, m, n, k in rows:
        a, b, scales = operands(m, n, k, dtype)
        fo_call, plain = calls(op, a, b, scales, torch.compile(add_norm))
        gemms = GemmAlone(a, b, dtype, scales)
        t = pair(fo_call, plain, inner_calls(m, n, k), gemms.fns)
        row = {"op": op, "dtype": dtype, "M": m, "N": n, "K": k,
               **{f"{name}_us": round(v[0] * 1000, 2) for name, v in t.items()},
               **{f"{name}_host_us": round(v[1], 1) for name, v in t.items()}}
        row["fo_adds_us"] = round(row["fo_us"] - row["fo_gemm_us"], 2)
        row["plain_adds_us"] = round(row["plain_us"] - row["cublas_gemm_us"], 2)
        row["gemm_ratio"] = round(GemmAlone.ratio(t), 4)
        row["ratio"] = round(row["plain_us"] / row["fo_us"], 4)
        found.append(row)
        print(table([row], list(row)), flush=True)
        del gemms
        api.forget_prepared()
    write_result(f"overhead-split-{device_tag()}", found, {
        "note": "the fo call, the plain form and both GEMMs alone (graph replays), timed in one "
                "alternation (common.steady_times); NCCL group of one rank"})


def _watchdog_on() -> bool:
    """Whether the cuda backend's NCCL watchdog watched this run's communicators."""
    try:
        from flashoverlap_backends.cuda import nccl
    except ImportError:
        return False
    return nccl.watchdog_enabled()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,64,256,1024,4096,16384")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                        help="N x K pairs")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--prefill-strategy", default="overlap", choices=("overlap", "auto"),
                        help="the prefill rows' FLASHOVERLAP_STRATEGY (decode rows: auto)")
    parser.add_argument("--profile", default="",
                        help="op:dtype:MxNxK,... : only the device timelines of these rows")
    parser.add_argument("--split", default="",
                        help="op:dtype:MxNxK,... : only where these rows' time goes (split_rows)")
    parser.add_argument("--back-to-back", action="store_true",
                        help="with --profile: the calls back to back, as timed, with host time")
    args = parser.parse_args(argv)
    if args.split or args.profile:  # op:dtype:MxNxK,... : only these rows
        nccl_group_of_one("overhead")
        os.environ[STRATEGY_ENV] = args.prefill_strategy
        wanted = [(op, dtype, *(int(x) for x in mnk.split("x")))
                  for op, dtype, mnk in (item.split(":")
                                         for item in (args.split or args.profile).split(","))]
        if args.split:
            split_rows(wanted)
        else:
            (profile_back_to_back if args.back_to_back else profile_rows)(wanted)
        dist.destroy_process_group()
        return 0
    unknown = set(args.dtypes.split(",")) - {"bf16", *FP8_KINDS}
    if unknown:
        parser.error(f"--dtypes: unknown {sorted(unknown)}; known: bf16, {', '.join(FP8_KINDS)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    nccl_group_of_one("overhead")
    compiled_norm = torch.compile(add_norm)
    saved = os.environ.get(STRATEGY_ENV)
    rows = []
    cut_short = False

    def stop(signum, frame):  # a stage timeout: keep the rows measured so far
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        for dtype in args.dtypes.split(","):
            for m in tokens:
                kind = "decode" if m <= DECODE_MAX else "prefill"
                os.environ[STRATEGY_ENV] = "auto" if kind == "decode" else args.prefill_strategy
                for n, k in shapes:
                    a, b, scales = operands(m, n, k, dtype)
                    # the signaling GEMM's own ratio bounds a prefill row (timed within the
                    # row's alternation); a decode row runs the plain path (world size 1), where
                    # it says nothing
                    gemms = GemmAlone(a, b, dtype, scales) if kind == "prefill" else None
                    for op in args.ops.split(","):
                        if dtype in FP8_KINDS and op not in FP8_OPS:
                            continue
                        row = measure_row(kind, op, dtype, a, b, scales, compiled_norm, gemms)
                        rows.append(row)
                        print(table([row], list(row)), flush=True)
                    api.forget_prepared()
                    torch.cuda.empty_cache()
    except KeyboardInterrupt:
        cut_short = True
        print(f"stopped after {len(rows)} rows: the summary covers those rows only", flush=True)
    finally:
        if saved is None:
            os.environ.pop(STRATEGY_ENV, None)
        else:
            os.environ[STRATEGY_ENV] = saved
    prefill = summarize([r for r in rows if r["kind"] == "prefill"], decode=False)
    decode = summarize([r for r in rows if r["kind"] == "decode"], decode=True)
    summary = {
        **prefill, "decode": decode, "met": prefill["met"] and decode["met"],
        "targets": {"min": "plain / fo >= 0.97 per row (the GEMM's own ratio - 0.01 where lower)",
                    "median": TARGET_MEDIAN, "add_rmsnorm": NORM_TARGET,
                    "allreduce workspace / output": WORKSPACE_FRACTION,
                    "decode": f"plain / fo >= {DECODE_TARGET} per row, the default call"},
        "prefill_strategy": args.prefill_strategy, "cut_short": cut_short,
        # FlashOverlap's NCCL watchdog (on by default, FLASHOVERLAP_WATCHDOG=0 turns it off:
        # its cost per call is the difference between two runs)
        "watchdog": _watchdog_on(),
        "default_run": not cut_short and args.tokens == parser.get_default("tokens")
        and args.shapes == parser.get_default("shapes") and args.ops == parser.get_default("ops")
        and args.dtypes == parser.get_default("dtypes")
        and args.prefill_strategy == parser.get_default("prefill_strategy"),
    }
    print(table(rows, ["kind", "op", "dtype", "M", "N", "K", "strategy", "fo_ms", "plain_ms",
                       "ratio", "gemm_ratio", "met", "fo_host_us", "plain_host_us"]))
    print(summary)
    write_result(f"overhead-{device_tag()}", rows, {"summary": summary, "world_size": 1,
                                                     "note": "NCCL group of one rank"})
    dist.destroy_process_group()
    return 0 if summary["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
