"""Multi-GPU benchmark: FlashOverlap against its baselines at one world size.

    python bench/multigpu.py [--world-size W] [--backend cuda] [--device cuda|cpu]
        [--shapes MxNxK,...] [--ops allreduce,reduce_scatter,all_to_all] [--quick]
        [--robustness] [--json PATH]

W ranks (flashoverlap_core.tools.ranks.Ranks, one per device). Per (shape, op), every rank
measures and the slowest rank counts (flashoverlap_core.tuning.measure.median_time):

* T_gemm: the matmul alone; T_comm: the collective alone on the output's size;
* sequential: the matmul, then torch.distributed's collective (flashoverlap_core.tools.bench.plain);
* decomposition: backend 'decomposition' with the same groups as the predicted plan;
* symm_mem: torch's fused matmul + reduce-scatter on symmetric memory, where it runs
  (reduce_scatter on CUDA; multicast stays off); otherwise "unavailable: <reason>";
* fo_predicted / fo_best: FlashOverlap with the grouping the tuner predicts, and the fastest of
  the tuner's measured candidates (the exhaustive search);
* ideal = max(T_gemm, T_comm), speedups against sequential, efficiency = ideal / T_overlap,
  and the predictor's error (predicted / measured - 1 for the predicted grouping).

Every overlapped result is checked against the sequential one with flashoverlap bench's bound
(twice the sequential result's own error against float64, plus a few output-dtype epsilons);
rows where one disagrees have status "mismatch".

--robustness adds (a) back-to-back calls per shape (1,000 by default), each compared bitwise
to the first, and (b) one rank raising mid-run while the others keep calling: they must fail
within the process group's (short) timeout instead of hanging; the time it took is reported.

On a machine without GPUs this is a dry run: ``--backend reference --device cpu`` with tiny
shapes at W=1 or 2 (gloo), where the symm_mem column says why it is unavailable.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import common
from common import table
from flashoverlap_core import registry
from flashoverlap_core.api import overlap
from flashoverlap_core.backend import Backend
from flashoverlap_core.tools.args import UsageError, at_least, choices_arg, shapes_arg
from flashoverlap_core.tools.bench import agreement_bound, max_abs, plain
from flashoverlap_core.tools.hardware import pick_hardware
from flashoverlap_core.tools.ranks import RankError, Ranks, RankTimeout
from flashoverlap_core.tuning.measure import slowest, transfer_fn
from flashoverlap_core.tuning.search import SEQUENTIAL, measured_candidates, predictive_search
from flashoverlap_core.tuning.tuner import (Job, Workload, build_model, measure_groupings,
                                            tuned_plan)

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
PAPER_MN = (4096, 8192, 16384)
PAPER_K = (2048, 4096, 8192)
LLM_TOKENS = (2048, 4096, 8192, 16384)
LLM_FFN = {4096: 14336, 8192: 28672}  # hidden -> FFN size (Llama-3 8B / 70B)
CPU_SHAPES = "64x64x32,128x64x64"
OPS = ("allreduce", "reduce_scatter", "all_to_all")  # allgather: the tuner has no workload yet
COLUMNS = ("t_gemm_ms", "t_comm_ms", "sequential_ms", "decomposition_ms", "symm_mem_ms",
           "fo_predicted_ms", "fo_best_ms", "ideal_ms", "predicted_ms", "predictor_error_pct",
           "speedup_decomposition", "speedup_symm_mem", "speedup_fo_predicted",
           "speedup_fo_best", "speedup_ideal", "efficiency_fo_predicted", "efficiency_fo_best")


def paper_shapes() -> list[tuple[int, int, int]]:
    return [(m, n, k) for m in PAPER_MN for n in PAPER_MN for k in PAPER_K]


def llm_shapes(world: int) -> list[tuple[int, int, int]]:
    """Row-parallel TP layers per rank: [tokens, K] @ [K, hidden] with K = FFN / TP (MLP down
    projection) or hidden / TP (attention output projection)."""
    shapes = []
    for hidden, ffn in LLM_FFN.items():
        for tokens in LLM_TOKENS:
            for inner in (ffn, hidden):
                shapes.append((tokens, hidden, max(1, inner // world)))
    return shapes


def default_shapes(world: int, quick: bool, on_cpu: bool) -> list[tuple[int, int, int]]:
    if on_cpu:
        return shapes_arg(CPU_SHAPES)
    if quick:
        return [(8192, 8192, 4096), (16384, 16384, 8192), (8192, 8192, max(1, 28672 // world)),
                (4096, 4096, max(1, 4096 // world))]
    return paper_shapes() + [s for s in llm_shapes(world) if s not in paper_shapes()]


# ---------------------------------------------------------------------------------------------
# On every rank
# ---------------------------------------------------------------------------------------------
def _call(work: Workload, plan, backend: str):
    return overlap(work.a, work.b, work.job.op, plan=plan, send_splits=work.send,
                   recv_splits=work.recv, backend=backend)


def decomposition_plan(work: Workload, group_sizes):
    """The FlashOverlap plan's tiles and groups, run by the decomposition backend; the
    decomposition's own heuristic plan when it cannot run those tiles."""
    same = dataclasses.replace(work.plan(group_sizes), backend="decomposition")
    reasons = registry.get("decomposition").plan_reasons(same)
    if not reasons:
        return same, "same groups"
    return None, "decomposition heuristic plan (" + "; ".join(reasons) + ")"


def symm_mem_runner(work: Workload):
    """(callable, "") for torch's fused matmul + reduce-scatter, or (None, why not)."""
    if work.job.op != "reduce_scatter":
        return None, f"unavailable: torch has no fused matmul + {work.job.op} (reduce_scatter only)"
    if work.device.type != "cuda":
        return None, f"unavailable: symmetric memory needs CUDA tensors, these are on {work.device.type}"
    if work.group is None:
        return None, "unavailable: no process group"
    fused = getattr(getattr(torch.ops, "symm_mem", None), "fused_matmul_reduce_scatter", None)
    if fused is None:
        return None, f"unavailable: torch {torch.__version__} has no torch.ops.symm_mem.fused_matmul_reduce_scatter"
    try:
        from torch.distributed import _symmetric_memory as symm
        name = work.group.group_name
        if hasattr(symm, "enable_symm_mem_for_group"):
            symm.enable_symm_mem_for_group(name)
        fn = lambda: fused(work.a, work.b, "sum", 0, name)  # noqa: E731
        fn()
        torch.get_device_module(work.device.type).synchronize()
    except Exception as e:  # record why; every rank tries, so the ranks agree below
        return None, f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return fn, ""


def case_on_rank(job: Job, cache: str, candidates: int, tuned: bool) -> dict:
    """Everything of one (shape, op) on this rank; times are already the slowest rank's."""
    work = Workload(job)
    op, device, group = job.op, work.device, work.group
    timeit = work.time
    out = {"notes": {}}
    # The tuner (needs Backend.trace) or the heuristic plan.
    if tuned:
        try:
            parts = build_model(job, cache)
        except Exception as e:  # the same on every rank: the model is built collectively
            tuned = False
            out["notes"]["tuner_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    if tuned:
        model = parts.model()
        choice = predictive_search(model, plain_s=parts.plain_s)  # never slower than plain
        groupings = measured_candidates(model, candidates, extra=[choice.group_sizes])
        measured = dict(zip(groupings + [SEQUENTIAL],
                            measure_groupings(job, groupings + [SEQUENTIAL])))
        stored = tuned_plan(parts, choice, measured)  # what the tuner would store
        best = SEQUENTIAL if stored.strategy == SEQUENTIAL else stored.group_sizes
        chosen = SEQUENTIAL if choice.strategy == SEQUENTIAL else choice.group_sizes
        predicted_groups = choice.group_sizes
        out.update(fo_predicted_s=measured[chosen], fo_best_s=measured[best],
                   predicted_s=choice.predicted_s, groups_predicted=_groups(chosen),
                   groups_best=_groups(best), candidates=len(groupings),
                   fell_back=choice.fell_back, search_ms=choice.search_s * 1e3)
    else:
        predicted_groups = work.base.group_sizes
        out.update(fo_predicted_s=timeit(lambda: work.run(work.base)), fo_best_s=None,
                   predicted_s=None, groups_predicted=list(predicted_groups), groups_best=None,
                   candidates=0)
        out["notes"]["tuner"] = ("tuner failed (see tuner_error)" if "tuner_error" in out["notes"]
                                 else f"backend {job.backend!r} does not implement Backend.trace()")
        out["notes"]["tuner"] += ": heuristic plan, no exhaustive search, no prediction"
    fo_plan = plan_of(work, out["groups_predicted"])
    # Baselines.
    out["t_gemm_s"] = timeit(lambda: work.a @ work.b)
    c = work.a @ work.b
    send = transfer_fn(op, group, work.world)
    flat = c.view(-1)[: c.numel() // work.world * work.world]
    out["t_comm_s"] = timeit(lambda: send(flat)) if send is not None else 0.0
    out["sequential_s"] = timeit(lambda: plain(op, work.a, work.b))
    d_plan, out["notes"]["decomposition"] = decomposition_plan(work, predicted_groups)
    out["decomposition_s"] = timeit(lambda: _call(work, d_plan, "decomposition"))
    symm, why = symm_mem_runner(work)
    ok_everywhere = int(slowest([0.0 if symm is not None else 1.0], device, group)[0]) == 0
    if symm is not None and not ok_everywhere:
        symm, why = None, "unavailable: failed on another rank"
    out["symm_mem_s"] = timeit(symm) if symm is not None else None
    out["notes"]["symm_mem"] = why or "torch.ops.symm_mem.fused_matmul_reduce_scatter"
    # Agreement with the sequential result, on this rank.
    expected = plain(op, work.a.double(), work.b.double())
    base = plain(op, work.a, work.b).double()
    bound = agreement_bound(base, expected, work.a.dtype)
    results = {"fo_predicted": work.run(fo_plan),
               "decomposition": _call(work, d_plan, "decomposition")}
    if out["fo_best_s"] is not None:
        results["fo_best"] = work.run(plan_of(work, out["groups_best"]))
    if symm is not None:
        results["symm_mem"] = symm()
    errors = {}
    for name, got in results.items():
        got = got.double()
        errors[name] = (max_abs(got - base) if got.shape == base.shape else math.inf)
    out.update(errors=errors, bound=bound)
    return out


def _groups(grouping):
    return grouping if grouping == SEQUENTIAL else list(grouping)


def plan_of(work: Workload, grouping):
    """The job's plan with ``grouping`` (group sizes, or "sequential": the plain path)."""
    if grouping == SEQUENTIAL:
        return dataclasses.replace(work.base, strategy=SEQUENTIAL)
    return work.plan(grouping)


def drift_on_rank(job: Job, calls: int, group_sizes) -> dict:
    """``calls`` back-to-back calls with one plan, each compared bitwise to the first."""
    work = Workload(job)
    plan = plan_of(work, group_sizes) if group_sizes is not None else work.base
    first = work.run(plan).clone()
    drifted, first_drift = 0, None
    began = time.perf_counter()
    for i in range(1, calls):
        got = work.run(plan)
        if not torch.equal(got, first):
            drifted += 1
            first_drift = i if first_drift is None else first_drift
    return {"calls": calls, "drifted": drifted, "first_drift": first_drift,
            "seconds": time.perf_counter() - began}


def fail_on_rank(job: Job, failing_rank: int, fail_at: int, stamp_dir: str,
                 max_calls: int) -> None:
    """Every rank calls overlap in a loop; ``failing_rank`` raises at call ``fail_at``. The
    others must then fail inside a collective (process-group timeout). Each rank writes when
    it raised or failed to ``stamp_dir``/rank<r>.json, then the exception propagates."""
    work = Workload(job)
    rank = dist.get_rank()
    stamp = Path(stamp_dir) / f"rank{rank}.json"
    sync = (torch.get_device_module(work.device.type).synchronize
            if work.device.type != "cpu" else (lambda: None))
    for i in range(max_calls):
        if rank == failing_rank and i == fail_at:
            stamp.write_text(json.dumps({"event": "raised", "time": time.time(), "call": i}))
            raise RuntimeError(f"injected failure on rank {rank} at call {i}")
        try:
            work.run(work.base)
            sync()
        except BaseException as e:
            stamp.write_text(json.dumps({"event": "failed", "time": time.time(), "call": i,
                                         "error": f"{type(e).__name__}: {str(e)[:300]}"}))
            raise
    stamp.write_text(json.dumps({"event": "finished", "time": time.time(), "call": max_calls}))


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------
def _ms(seconds):
    return None if seconds is None else round(seconds * 1e3, 4)


def _ratio(a, b):
    return None if a is None or b is None or b <= 0 else round(a / b, 4)


def make_row(shape, op, dtype, world, backend, per_rank: list[dict]) -> dict:
    r0 = per_rank[0]  # times are the slowest rank's on every rank
    row = {"shape": "x".join(map(str, shape)), "op": op, "dtype": dtype, "world_size": world,
           "backend": backend, "status": "ok"}
    for key in ("t_gemm", "t_comm", "sequential", "decomposition", "symm_mem", "fo_predicted",
                "fo_best"):
        row[f"{key}_ms"] = _ms(r0[f"{key}_s"])
    ideal = max(r0["t_gemm_s"], r0["t_comm_s"])
    row["ideal_ms"] = _ms(ideal)
    row["predicted_ms"] = _ms(r0["predicted_s"])
    row["predictor_error_pct"] = (None if r0["predicted_s"] is None else
                                  round(100 * (r0["predicted_s"] / r0["fo_predicted_s"] - 1), 2))
    seq = r0["sequential_s"]
    for key in ("decomposition", "symm_mem", "fo_predicted", "fo_best"):
        row[f"speedup_{key}"] = _ratio(seq, r0[f"{key}_s"])
    row["speedup_ideal"] = _ratio(seq, ideal)
    for key in ("fo_predicted", "fo_best"):
        row[f"efficiency_{key}"] = _ratio(ideal, r0[f"{key}_s"])
    for key in ("groups_predicted", "groups_best", "candidates", "notes"):
        row[key] = r0.get(key)
    names = sorted(set().union(*(r["errors"] for r in per_rank)))
    row["max_error"] = {n: max(r["errors"].get(n, 0.0) for r in per_rank) for n in names}
    row["bound"] = min(r["bound"] for r in per_rank)
    disagree = sorted({n for r in per_rank for n, e in r["errors"].items()
                       if not e <= r["bound"]})  # NaN too
    row["disagree"] = disagree
    if disagree:
        row["status"] = "mismatch"
    return row


def empty_row(shape, op, dtype, world, backend, status, detail) -> dict:
    row = {"shape": "x".join(map(str, shape)), "op": op, "dtype": dtype, "world_size": world,
           "backend": backend, "status": status, "detail": detail}
    row.update({c: None for c in COLUMNS})
    row.update(groups_predicted=None, groups_best=None, candidates=0, notes={}, max_error={},
               bound=None, disagree=[])
    return row


def skip_reason(shape, op, world) -> str:
    if op in ("reduce_scatter", "all_to_all") and shape[0] % world:
        return f"{op} needs M divisible by the world size {world} here"
    return ""


def rank_failure(hw, job: Job, pg_timeout: float, fail_at: int = 3) -> dict:
    """One rank raises at call ``fail_at``; how long the others took to fail (or whether the
    pool had to kill them: a hang)."""
    if hw.world_size < 2:
        return {"status": "skipped", "detail": "needs world size >= 2"}
    stamps = tempfile.mkdtemp(prefix="fo-rank-failure-")
    failing = hw.world_size - 1
    began = time.monotonic()
    ranks = Ranks(hw.world_size, hw.device_type, env=MULTICAST_OFF, timeout=pg_timeout + 120,
                  pg_timeout=pg_timeout)
    outcome = "no error"
    try:
        ranks.run(fail_on_rank, job, failing, fail_at, stamps, 100000)
    except RankError as e:
        outcome = "RankError" + (" (pool killed ranks that did not answer)"
                                 if "did not answer" in str(e) else "")
    except RankTimeout as e:
        outcome = f"RankTimeout: {e}"
    finally:
        ranks.close()
    elapsed = time.monotonic() - began
    found = {}
    for r in range(hw.world_size):
        p = Path(stamps) / f"rank{r}.json"
        found[r] = json.loads(p.read_text()) if p.exists() else None
    shutil.rmtree(stamps, ignore_errors=True)
    raised = (found.get(failing) or {}).get("time")
    others = {}
    for r in range(hw.world_size):
        if r == failing:
            continue
        s = found[r]
        if s is None:
            others[r] = {"event": "ended without a record (process aborted or killed)"}
        else:
            others[r] = {**s, "after_s": None if raised is None else round(s["time"] - raised, 3)}
            others[r].pop("time", None)
    waits = [o.get("after_s") for o in others.values()]
    all_failed = all(o.get("event") == "failed" for o in others.values())
    slack = 15.0  # watchdog polling and teardown
    within = (all_failed and raised is not None
              and all(w is not None and w <= pg_timeout + slack for w in waits))
    return {"status": "ok" if within else "FAILED", "failing_rank": failing, "fail_at": fail_at,
            "pg_timeout_s": pg_timeout, "allowed_s": pg_timeout + slack, "outcome": outcome,
            "others": {str(r): o for r, o in others.items()},
            "max_wait_s": max((w for w in waits if w is not None), default=None),
            "total_s": round(elapsed, 3)}


def geomean(values):
    values = [v for v in values if v]
    return round(math.exp(statistics.fmean(math.log(v) for v in values)), 4) if values else None


def summarise(rows: list[dict]) -> dict:
    done = [r for r in rows if r["status"] in ("ok", "mismatch")]
    out = {"cases": len(rows), "measured": len(done),
           "mismatches": [f"{r['shape']} {r['op']}: {r['disagree']}" for r in rows
                          if r["status"] == "mismatch"],
           "errors": [f"{r['shape']} {r['op']}: {r.get('detail', '')[:200]}" for r in rows
                      if r["status"] == "error"]}
    for op in OPS:
        mine = [r for r in done if r["op"] == op]
        if not mine:
            continue
        errs = [abs(r["predictor_error_pct"]) for r in mine if r["predictor_error_pct"] is not None]
        out[op] = {
            "cases": len(mine),
            **{f"geomean_speedup_{k}": geomean(r[f"speedup_{k}"] for r in mine)
               for k in ("decomposition", "symm_mem", "fo_predicted", "fo_best", "ideal")},
            "geomean_efficiency_fo_predicted": geomean(r["efficiency_fo_predicted"] for r in mine),
            "max_abs_predictor_error_pct": max(errs) if errs else None,
            "median_abs_predictor_error_pct": statistics.median(errs) if errs else None,
            "predicted_vs_best_max": max((_ratio(r["fo_predicted_ms"], r["fo_best_ms"]) or 0)
                                         for r in mine) or None}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-size", type=at_least(1),
                   help="ranks (default: every device; 2 on the CPU)")
    p.add_argument("--backend", help="FlashOverlap backend (default: the best accelerator one, "
                   "else reference)")
    p.add_argument("--device", help="device type for a backend of any device (reference)")
    p.add_argument("--shapes", type=shapes_arg,
                   help="comma-separated per-rank MxNxK (default: the paper's and LLM "
                   "tensor-parallel shapes; tiny ones on the CPU)")
    p.add_argument("--ops", type=choices_arg(OPS), default=list(OPS))
    p.add_argument("--quick", action="store_true", help="a few shapes only")
    p.add_argument("--dtype", help="default: float32 on the CPU, bfloat16 on accelerators")
    p.add_argument("--iters", type=int, help="timed iterations (default 3 on the CPU, 10)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--candidates", type=int, default=16,
                   help="groupings of the exhaustive (measured) search per case")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per case on the ranks")
    p.add_argument("--robustness", action="store_true",
                   help="also: back-to-back calls without drift, and a rank failing mid-run")
    p.add_argument("--calls", type=int, default=1000, help="back-to-back calls per shape")
    p.add_argument("--pg-timeout", type=float, default=5.0,
                   help="process-group timeout (s) of the rank-failure check (RankPool kills ranks "
                   "that have not failed 10 s after the first error: keep it below that)")
    p.add_argument("--skip-bench", action="store_true", help="only the robustness checks")
    p.add_argument("--json", metavar="PATH", help="result file (default: bench/results/"
                   "multigpu-w<W>-<date>.json, or $FO_RESULTS_DIR)")
    args = p.parse_args(argv)

    try:
        hw = pick_hardware(args.backend, args.world_size, args.device)
    except (UsageError, registry.BackendError) as e:
        p.error(str(e))
    on_cpu = hw.device_type == "cpu"
    world = hw.world_size
    shapes = args.shapes or default_shapes(world, args.quick, on_cpu)
    ops = args.ops
    dtype = args.dtype or ("float32" if on_cpu else "bfloat16")
    iters = args.iters or (3 if on_cpu else 10)
    tuned = type(registry.get(hw.target)).trace is not Backend.trace
    cache = str(Path(tempfile.mkdtemp(prefix="fo-multigpu-")) / "tuning.json")
    print(f"multigpu: backend {hw.backend} on {world} {hw.device_type} rank(s), {dtype}, "
          f"{len(shapes)} shape(s) x {len(ops)} op(s)", flush=True)

    rows, robustness = [], {}
    ranks = Ranks(hw.world_size, hw.device_type, env=MULTICAST_OFF, timeout=args.timeout,
                  pg_timeout=300.0)
    try:
        cases = [] if args.skip_bench else [(s, op) for s in shapes for op in ops]
        for i, (shape, op) in enumerate(cases, 1):
            why = skip_reason(shape, op, world)
            if why:
                rows.append(empty_row(shape, op, dtype, world, hw.backend, "skipped", why))
                continue
            job = Job(*shape, op, dtype, hw.target, iters, args.warmup, device_type=hw.device_type)
            try:
                per_rank = ranks.run(case_on_rank, job, cache, args.candidates, tuned)
                rows.append(make_row(shape, op, dtype, world, hw.backend, per_rank))
            except (RankError, RankTimeout) as e:
                rows.append(empty_row(shape, op, dtype, world, hw.backend, "error", str(e)))
            r = rows[-1]
            print(f"[{i}/{len(cases)}] {r['shape']} {op}: {r['status']} seq {r['sequential_ms']} "
                  f"fo {r['fo_predicted_ms']} best {r['fo_best_ms']} ms", file=sys.stderr,
                  flush=True)
        if args.robustness:
            drift = []
            for shape in shapes:
                for op in ops:
                    if skip_reason(shape, op, world):
                        continue
                    job = Job(*shape, op, dtype, hw.target, iters, args.warmup,
                              device_type=hw.device_type)
                    groups = next((r["groups_predicted"] for r in rows if r["op"] == op and
                                   r["shape"] == "x".join(map(str, shape))), None)
                    try:
                        per_rank = ranks.run(drift_on_rank, job, args.calls, groups)
                        bad = sum(r["drifted"] for r in per_rank)
                        drift.append({"shape": job.shape, "op": op, "calls": args.calls,
                                      "drifted_calls": bad, "status": "ok" if bad == 0 else "DRIFT",
                                      "seconds": round(max(r["seconds"] for r in per_rank), 3)})
                    except (RankError, RankTimeout) as e:
                        drift.append({"shape": job.shape, "op": op, "calls": args.calls,
                                      "status": "error", "detail": str(e)[:2000]})
            ranks.close()
            shape, op = shapes[0], next((o for o in ops if not skip_reason(shapes[0], o, world)),
                                        ops[0])
            job = Job(*shape, op, dtype, hw.target, iters, args.warmup, device_type=hw.device_type)
            robustness = {"drift": drift, "rank_failure": rank_failure(hw, job, args.pg_timeout)}
    finally:
        ranks.close()

    if rows:
        print(table(rows, ["shape", "op", "status", "t_gemm_ms", "t_comm_ms", "sequential_ms",
                           "decomposition_ms", "symm_mem_ms", "fo_predicted_ms", "fo_best_ms",
                           "ideal_ms", "speedup_fo_predicted", "efficiency_fo_predicted",
                           "predictor_error_pct"]))
    summary = summarise(rows)
    if robustness:
        print(json.dumps(robustness, indent=1))
        summary["drift_ok"] = all(d["status"] == "ok" for d in robustness["drift"])
        summary["rank_failure_ok"] = robustness["rank_failure"]["status"] in ("ok", "skipped")
    print(json.dumps(summary, indent=1))
    extra = {"format": "flashoverlap.multigpu/1", "world_size": world,
             "hardware": dataclasses.asdict(hw), "columns": list(COLUMNS),
             "settings": {"shapes": ["x".join(map(str, s)) for s in shapes], "ops": ops,
                          "dtype": dtype, "iters": iters, "warmup": args.warmup,
                          "candidates": args.candidates, "quick": args.quick,
                          "multicast_off": MULTICAST_OFF},
             "summary": summary, "robustness": robustness}
    if args.json:
        common.RESULTS = Path(args.json).resolve().parent
    written = common.write_result(f"multigpu-w{world}", rows, extra, device_type=hw.device_type)
    if args.json and written != Path(args.json).resolve():
        os.replace(written, args.json)
        print(f"moved to {args.json}")
    failed = (summary["mismatches"] or summary["errors"]
              or (robustness and not (summary["drift_ok"] and summary["rank_failure_ok"])))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
