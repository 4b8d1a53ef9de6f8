"""Multi-GPU benchmark: FlashOverlap against its baselines at one world size.

    python bench/multigpu.py [--world-size W] [--backend cuda] [--device cuda|cpu]
        [--shapes MxNxK,...] [--ops allreduce,reduce_scatter,all_to_all,allgather] [--quick]
        [--robustness] [--json PATH]

W ranks (flashoverlap_core.tools.ranks.Ranks, one per device). A shape is each rank's GEMM
[M, K] @ [K, N]; for allgather its M rows are the gathered ones (every rank holds M / W rows of
a, as fo.plan counts them). Per (shape, op), every rank measures and the slowest rank counts
(flashoverlap_core.tuning.measure.median_time):

* T_gemm: the matmul alone; T_comm: the collective alone on the output's size (allgather: the
  all-gather of a);
* sequential: the matmul, then torch.distributed's collective (allgather: all_gather_into_tensor,
  then the matmul; flashoverlap_core.tools.bench.plain);
* decomposition: backend 'decomposition' with the same groups as the predicted plan;
* symm_mem: torch's fused ops on symmetric memory, where they run (reduce_scatter:
  fused_matmul_reduce_scatter; allgather: fused_all_gather_matmul; CUDA only, multicast stays
  off); otherwise "unavailable: <reason>";
* fo_default: fo.overlap with default arguments (backend and plan chosen by fo itself);
* fo_predicted / fo_best: FlashOverlap with the grouping the tuner predicts, and the fastest of
  the tuner's measured candidates (the exhaustive search). The tuner has no allgather workload:
  there fo_predicted is the backend's heuristic plan, passed explicitly, and fo_best the fastest
  of up to --candidates chunkings of the gather (1, 2, 4, ... chunks), each measured. When the
  harness's backend declines allgather (cuda today), these rows run on the backend fo picks for
  it and the row's notes say why;
* ideal = max(T_gemm, T_comm), speedups against sequential, efficiency = ideal / T_overlap,
  and the predictor's error (predicted / measured - 1 for the predicted grouping).

Every result is checked against the sequential one with flashoverlap bench's bound (twice the
sequential result's own error against float64, plus a few output-dtype epsilons); rows where
one disagrees have status "mismatch". FlashOverlap's results are written into an output
poisoned with NaN first; each row records every result's error against the float64 reference
(ref_error) and the backend and strategy each fo variant ran on (notes.ran).

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
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import common
from common import table
from flashoverlap_core import api, registry
from flashoverlap_core.api import make_plan, overlap
from flashoverlap_core.backend import Backend, OverlapSpec
from flashoverlap_core.collectives import all_gather_single, resolve_group
from flashoverlap_core.devices import current_device
from flashoverlap_core.grouping import equal_splits
from flashoverlap_core.plan import group_unit
from flashoverlap_core.tools.args import UsageError, at_least, choices_arg, shapes_arg
from flashoverlap_core.tools.bench import agreement_bound, max_abs, plain
from flashoverlap_core.tools.hardware import pick_hardware
from flashoverlap_core.tools.ranks import RankError, Ranks, RankTimeout
from flashoverlap_core.tuning.measure import median_time, slowest, transfer_fn
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
GATHER = "allgather"
OPS = ("allreduce", "reduce_scatter", "all_to_all", GATHER)  # the tuner has no allgather workload
TIMED = ("t_gemm", "t_comm", "sequential", "decomposition", "symm_mem", "fo_default",
         "fo_predicted", "fo_best")
VERSUS_SEQUENTIAL = ("decomposition", "symm_mem", "fo_default", "fo_predicted", "fo_best")
COLUMNS = (tuple(f"{k}_ms" for k in TIMED)
           + ("ideal_ms", "predicted_ms", "predictor_error_pct")
           + tuple(f"speedup_{k}" for k in VERSUS_SEQUENTIAL)
           + ("speedup_ideal", "efficiency_fo_predicted", "efficiency_fo_best"))
# torch's fused ops on symmetric memory (torch.ops.symm_mem), per op they exist for
SYMM_MEM_OPS = {"reduce_scatter": "fused_matmul_reduce_scatter",
                GATHER: "fused_all_gather_matmul"}


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


def llm_gather_shapes(world: int) -> list[tuple[int, int, int]]:
    """Column-parallel TP layers with sequence parallelism, per rank: the gathered [tokens,
    hidden] rows @ [hidden, N / TP] with N the fused gate/up (2 x FFN) or QKV (3 x hidden)
    projection; each rank holds tokens / TP of the rows."""
    shapes = []
    for hidden, ffn in LLM_FFN.items():
        for tokens in LLM_TOKENS:
            for outer in (2 * ffn, 3 * hidden):
                shapes.append((tokens, max(1, outer // world), hidden))
    return shapes


def default_shapes(world: int, quick: bool, on_cpu: bool,
                   op: str = "allreduce") -> list[tuple[int, int, int]]:
    """The shapes ``op`` runs by default: the paper's, and LLM tensor-parallel layers (the
    row-parallel ones for the ops on a GEMM's output, the column-parallel ones for allgather)."""
    if on_cpu:
        return shapes_arg(CPU_SHAPES)
    if quick and op == GATHER:
        return [(8192, 8192, 4096), (16384, 16384, 8192), (8192, max(1, 28672 // world), 4096),
                (4096, max(1, 12288 // world), 4096)]
    if quick:
        return [(8192, 8192, 4096), (16384, 16384, 8192), (8192, 8192, max(1, 28672 // world)),
                (4096, 4096, max(1, 4096 // world))]
    llm = llm_gather_shapes(world) if op == GATHER else llm_shapes(world)
    return paper_shapes() + [s for s in llm if s not in paper_shapes()]


def cases_for(shapes, ops, world: int, quick: bool, on_cpu: bool) -> list[tuple[tuple, str]]:
    """(shape, op) in run order: the given shapes for every op, else each op's defaults (the
    shapes the ops share first, shape by shape)."""
    if shapes:
        return [(s, op) for s in shapes for op in ops]
    per_op = {op: default_shapes(world, quick, on_cpu, op) for op in ops}
    order = list(dict.fromkeys(s for op in ops for s in per_op[op]))
    return [(s, op) for s in order for op in ops if s in per_op[op]]


# ---------------------------------------------------------------------------------------------
# On every rank
# ---------------------------------------------------------------------------------------------
def _call(work, plan, backend: str | None):
    """``work``'s op through fo.overlap into its output (plan and backend None: fo chooses)."""
    return overlap(work.a, work.b, work.job.op, plan=plan, out=work.out, send_splits=work.send,
                   recv_splits=work.recv, backend=backend)


@dataclass(frozen=True)
class GatherJob:
    """One allgather shape: each rank's GEMM is the gathered [m, K] (M / W rows from every
    rank) @ [K, N]; the fields the tuner's :class:`Job` has, for the same helpers."""

    m: int
    n: int
    k: int
    dtype: str
    backend: str
    iters: int = 10
    warmup: int = 3
    seed: int = 1234
    device_type: str | None = None
    op: str = GATHER

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


def job_for(shape, op: str, dtype: str, target: str, iters: int, warmup: int, device_type):
    """The tuner's Job for the ops it tunes, a GatherJob for allgather."""
    kind = GatherJob if op == GATHER else Job
    extra = {} if op == GATHER else {"op": op}
    return kind(*shape, dtype=dtype, backend=target, iters=iters, warmup=warmup,
                device_type=device_type, **extra)


def gather_backend(target: str, spec: OverlapSpec) -> tuple[Backend, str]:
    """The backend the allgather rows run on, and why: the harness's backend when it runs
    allgather, else the one fo.overlap picks for the call by itself."""
    backend = registry.get(target)
    reasons = backend.unsupported_reasons(spec)
    if not reasons:
        return backend, f"backend {backend.name!r}"
    auto = registry.select(spec)
    return auto, (f"backend {backend.name!r} declines allgather ({'; '.join(reasons)}): "
                  f"run on {auto.name!r}, which fo.overlap picks for it")


class GatherWork:
    """An allgather job's inputs, plans and calls on this rank (what :class:`Workload` is to
    the other ops): this rank's [M / W, K] rows of a, b as an nn.Linear weight's transpose."""

    send = recv = None

    def __init__(self, job: GatherJob):
        self.job = job
        self.group, self.rank, self.world = resolve_group(None)
        self.device = current_device(job.device_type or "cpu")
        dtype = getattr(torch, job.dtype)
        gen = torch.Generator(device=self.device).manual_seed(job.seed + self.rank)
        self.a = torch.randn(job.m // self.world, job.k, generator=gen, device=self.device,
                             dtype=dtype)
        self.b = (torch.randn(job.n, job.k, generator=gen, device=self.device, dtype=dtype)
                  / job.k ** 0.5).t()
        spec = OverlapSpec(job.m, job.n, job.k, GATHER, self.world, job.dtype, self.device.type,
                           "col")
        self.backend, self.why_backend = gather_backend(job.backend, spec)
        self.base = make_plan(self.backend, spec)
        self.out = torch.empty(job.m, job.n, dtype=dtype, device=self.device)

    def plan(self, group_sizes):
        return dataclasses.replace(self.base, group_sizes=tuple(group_sizes))

    def run(self, plan):
        return overlap(self.a, self.b, GATHER, plan=plan, out=self.out, backend=self.backend.name)

    def time(self, fn) -> float:
        return median_time(fn, self.device, self.group, self.job.iters, self.job.warmup)


def chunkings(plan, limit: int) -> list[tuple[int, ...]]:
    """Group sizes of an allgather plan cut into 1, 2, 4, ... chunks of nearly equal whole row
    bands (up to one per band), the plan's own grouping first; at most ``limit``."""
    bands = -(-plan.shard_rows // plan.tile[0])
    unit = group_unit(GATHER, plan.world_size, plan.n, plan.tile)
    counts = [1 << i for i in range(bands.bit_length()) if 1 << i <= bands]
    out = [tuple(plan.group_sizes)]
    for count in counts:
        sizes = tuple(unit * bands_ for bands_ in equal_splits(bands, count))
        if sizes not in out:
            out.append(sizes)
    return out[:max(1, limit)]


def decomposition_plan(work, group_sizes):
    """The FlashOverlap plan's tiles and groups, run by the decomposition backend; the
    decomposition's own heuristic plan when it cannot run those tiles."""
    same = dataclasses.replace(work.plan(group_sizes), backend="decomposition")
    reasons = registry.get("decomposition").plan_reasons(same)
    if not reasons:
        return same, "same groups"
    return None, "decomposition heuristic plan (" + "; ".join(reasons) + ")"


def symm_mem_runner(op: str, a, b, device: torch.device, group):
    """(callable, "") for torch's fused matmul + ``op`` on symmetric memory, or (None, why
    not). Never raises: a failure is the reason."""
    fused_name = SYMM_MEM_OPS.get(op)
    if fused_name is None:
        return None, (f"unavailable: torch has no fused matmul + {op} "
                      f"({' and '.join(SYMM_MEM_OPS)} only)")
    if device.type != "cuda":
        return None, f"unavailable: symmetric memory needs CUDA tensors, these are on {device.type}"
    if group is None:
        return None, "unavailable: no process group"
    try:
        # Importing it defines the torch.ops.symm_mem ops (and fails on builds without them).
        from torch.distributed import _symmetric_memory as symm
        fused = getattr(torch.ops.symm_mem, fused_name, None)
        if fused is None:
            return None, f"unavailable: torch {torch.__version__} has no torch.ops.symm_mem.{fused_name}"
        name = group.group_name
        enable = getattr(symm, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by older torch; newer torch deprecates it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(name)
        if op == GATHER:  # -> (gathered a or None, [products]): only the product is wanted
            fn = lambda: fused(a, [b], 0, name, return_A=False)[1][0]  # noqa: E731
        else:
            fn = lambda: fused(a, b, "sum", 0, name)  # noqa: E731
        fn()
        torch.get_device_module(device.type).synchronize()
    except Exception as e:  # record why; every rank tries, so the ranks agree below
        first = str(e).splitlines()[0][:200] if str(e) else ""
        return None, f"unavailable: {type(e).__name__}: {first}"
    return fn, ""


def symm_mem_everywhere(work):
    """:func:`symm_mem_runner` of the work, kept only if it ran on every rank."""
    symm, why = symm_mem_runner(work.job.op, work.a, work.b, work.device, work.group)
    ok_everywhere = int(slowest([0.0 if symm is not None else 1.0], work.device, work.group)[0]) == 0
    if symm is not None and not ok_everywhere:
        symm, why = None, "unavailable: failed on another rank"
    return symm, why or f"torch.ops.symm_mem.{SYMM_MEM_OPS[work.job.op]}"


def prepared_calls() -> list[dict]:
    """What fo.overlap has prepared in this process since ``api.forget_prepared()``
    (:func:`fo.prepared_calls <flashoverlap_core.api.prepared_calls>`: per call key the op,
    shapes, b's layout, M, N, K, backend, strategy, groups and runner), each with ``runs``: the
    runner, or for a sequential plan what it runs whatever backend made the plan."""
    return [{**call, "runs": "torch matmul + torch.distributed" if call["strategy"] == "sequential"
             else call["runner"]} for call in api.prepared_calls()]


def what_ran(calls: list[dict]) -> str:
    """'backend/strategy (how)' of each prepared call, e.g. 'cuda/overlap (CudaCall)'."""
    return "; ".join(f"{c['backend']}/{c['strategy']} ({c['runs']})" for c in calls) or "unknown"


def checked_runs(work, runs: dict) -> tuple[dict, dict]:
    """Each run's result (a copy), each made into work.out poisoned with NaN first and from a
    fresh preparation, and what it ran on (:func:`prepared_calls`)."""
    results, ran = {}, {}
    for name, run in runs.items():
        work.out.fill_(float("nan"))
        api.forget_prepared()
        results[name] = run().clone()
        ran[name] = what_ran(prepared_calls())
    return results, ran


def shared_rows(work, out: dict, fo_plan, best_plan, d_plan) -> None:
    """What every op measures the same way: sequential, decomposition, symmetric memory and
    fo with default arguments; then every result checked against the sequential one (bound
    from the float64 reference) and against float64 itself."""
    timeit, op = work.time, work.job.op
    out["sequential_s"] = timeit(lambda: plain(op, work.a, work.b))
    out["decomposition_s"] = timeit(lambda: _call(work, d_plan, "decomposition"))
    out["fo_default_s"] = timeit(lambda: _call(work, None, None))
    symm, out["notes"]["symm_mem"] = symm_mem_everywhere(work)
    out["symm_mem_s"] = timeit(symm) if symm is not None else None
    runs = {"fo_default": lambda: _call(work, None, None),
            "fo_predicted": lambda: work.run(fo_plan),
            "decomposition": lambda: _call(work, d_plan, "decomposition")}
    if best_plan is not None:
        runs["fo_best"] = lambda: work.run(best_plan)
    results, out["notes"]["ran"] = checked_runs(work, runs)
    if symm is not None:
        results["symm_mem"] = symm()
    expected = plain(op, work.a.double(), work.b.double())
    base = plain(op, work.a, work.b).double()
    bound = agreement_bound(base, expected, work.a.dtype)
    errors, ref_errors = {}, {"sequential": max_abs(base - expected)}
    for name, got in results.items():
        got = got.double()
        same = got.shape == base.shape
        errors[name] = max_abs(got - base) if same else math.inf
        ref_errors[name] = max_abs(got - expected) if same else math.inf
    out.update(errors=errors, ref_errors=ref_errors, bound=bound)


def case_on_rank(job, cache: str, candidates: int, tuned: bool) -> dict:
    """Everything of one (shape, op) on this rank; times are already the slowest rank's."""
    if job.op == GATHER:
        return gather_case_on_rank(job, candidates)
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
    best_plan = plan_of(work, out["groups_best"]) if out["fo_best_s"] is not None else None
    # Baselines.
    out["t_gemm_s"] = timeit(lambda: work.a @ work.b)
    c = work.a @ work.b
    send = transfer_fn(op, group, work.world)
    flat = c.view(-1)[: c.numel() // work.world * work.world]
    out["t_comm_s"] = timeit(lambda: send(flat)) if send is not None else 0.0
    d_plan, out["notes"]["decomposition"] = decomposition_plan(work, predicted_groups)
    shared_rows(work, out, fo_plan, best_plan, d_plan)
    return out


def gather_case_on_rank(job: GatherJob, candidates: int) -> dict:
    """One allgather shape on this rank: the heuristic plan and the fastest measured chunking
    (the tuner has no allgather workload), the GEMM and the all-gather alone, and the rows
    every op has."""
    work = GatherWork(job)
    timeit, group = work.time, work.group
    out = {"notes": {"backend": work.why_backend, "tuner": (
        "no allgather workload in the tuner: fo_predicted is the heuristic plan, fo_best the "
        f"fastest of {candidates} or fewer measured chunkings; no prediction")}}
    groupings = chunkings(work.base, candidates)
    measured = {g: timeit(lambda p=work.plan(g): work.run(p)) for g in groupings}
    best = min(measured, key=measured.get)
    out.update(fo_predicted_s=measured[groupings[0]], fo_best_s=measured[best], predicted_s=None,
               groups_predicted=list(groupings[0]), groups_best=list(best),
               candidates=len(groupings))
    gathered = torch.empty(job.m, job.k, dtype=work.a.dtype, device=work.device)
    gather = lambda: all_gather_single(gathered, work.a, group=group)  # noqa: E731
    if group is not None:
        gather()
    else:
        gathered.copy_(work.a)
    out["t_gemm_s"] = timeit(lambda: gathered @ work.b)
    out["t_comm_s"] = timeit(gather) if group is not None else 0.0
    d_plan, out["notes"]["decomposition"] = decomposition_plan(work, groupings[0])
    shared_rows(work, out, work.base, work.plan(best), d_plan)
    return out


def _groups(grouping):
    return grouping if grouping == SEQUENTIAL else list(grouping)


def plan_of(work: Workload, grouping):
    """The job's plan with ``grouping`` (group sizes, or "sequential": the plain path)."""
    if grouping == SEQUENTIAL:
        return dataclasses.replace(work.base, strategy=SEQUENTIAL)
    return work.plan(grouping)


def workload_of(job):
    return GatherWork(job) if job.op == GATHER else Workload(job)


def drift_on_rank(job, calls: int, group_sizes) -> dict:
    """``calls`` back-to-back calls with one plan, each compared bitwise to the first."""
    work = workload_of(job)
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


def fail_on_rank(job, failing_rank: int, fail_at: int, stamp_dir: str,
                 max_calls: int) -> None:
    """Every rank calls overlap in a loop; ``failing_rank`` raises at call ``fail_at``. The
    others must then fail inside a collective (process-group timeout). Each rank writes when
    it raised or failed to ``stamp_dir``/rank<r>.json, then the exception propagates."""
    work = workload_of(job)
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
    for key in TIMED:
        row[f"{key}_ms"] = _ms(r0[f"{key}_s"])
    ideal = max(r0["t_gemm_s"], r0["t_comm_s"])
    row["ideal_ms"] = _ms(ideal)
    row["predicted_ms"] = _ms(r0["predicted_s"])
    row["predictor_error_pct"] = (None if r0["predicted_s"] is None else
                                  round(100 * (r0["predicted_s"] / r0["fo_predicted_s"] - 1), 2))
    seq = r0["sequential_s"]
    for key in VERSUS_SEQUENTIAL:
        row[f"speedup_{key}"] = _ratio(seq, r0[f"{key}_s"])
    row["speedup_ideal"] = _ratio(seq, ideal)
    for key in ("fo_predicted", "fo_best"):
        row[f"efficiency_{key}"] = _ratio(ideal, r0[f"{key}_s"])
    for key in ("groups_predicted", "groups_best", "candidates", "notes"):
        row[key] = r0.get(key)
    for key in ("errors", "ref_errors"):  # the worst rank's
        names = sorted(set().union(*(r[key] for r in per_rank)))
        row["max_error" if key == "errors" else "ref_error"] = {
            n: max(r[key].get(n, 0.0) for r in per_rank) for n in names}
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
               ref_error={}, bound=None, disagree=[])
    return row


def skip_reason(shape, op, world) -> str:
    if op in ("reduce_scatter", "all_to_all") and shape[0] % world:
        return f"{op} needs M divisible by the world size {world} here"
    if op == GATHER and shape[0] % world:
        return f"allgather needs M (the gathered rows) divisible by the world size {world}"
    return ""


def rank_failure(hw, job, pg_timeout: float, fail_at: int = 3) -> dict:
    """One rank raises at call ``fail_at``; how long the others took to fail (or whether the
    pool had to kill them: a hang)."""
    if hw.world_size < 2:
        return {"status": "skipped", "detail": "needs world size >= 2"}
    stamps = tempfile.mkdtemp(prefix="fo-rank-failure-")
    failing = hw.world_size - 1
    began = time.monotonic()
    ranks = Ranks(hw.world_size, hw.device_type, env=MULTICAST_OFF, timeout=pg_timeout + 120,
                  pg_timeout=pg_timeout, shared_devices=hw.shared_devices)
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


def topology_record(ranks: Ranks) -> dict:
    """Where the ranks ran, and whether their times mean anything."""
    topo = ranks.topology()
    topo["times_valid"] = not topo["shared_devices"]
    if topo["shared_devices"]:
        topo["note"] = ("ranks shared devices: a correctness check of every multi-rank path; "
                        "the times measure nothing (the ranks time-slice one device and the "
                        "collective library joins them over its socket transport)")
    return topo


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
               for k in VERSUS_SEQUENTIAL + ("ideal",)},
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
                   help="comma-separated MxNxK of each rank's GEMM; for allgather M is the "
                   "gathered rows, W x each rank's (default: the paper's and LLM "
                   "tensor-parallel shapes; tiny ones on the CPU)")
    p.add_argument("--ops", type=choices_arg(OPS), default=list(OPS))
    p.add_argument("--quick", action="store_true", help="a few shapes only")
    p.add_argument("--dtype", help="default: float32 on the CPU, bfloat16 on accelerators")
    p.add_argument("--iters", type=int, help="timed iterations (default 3 on the CPU, 10)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--candidates", type=int, default=16,
                   help="groupings of the exhaustive (measured) search per case (allgather: "
                   "chunkings of the gather)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per case on the ranks")
    p.add_argument("--robustness", action="store_true",
                   help="also: back-to-back calls without drift, and a rank failing mid-run")
    p.add_argument("--calls", type=int, default=1000, help="back-to-back calls per shape")
    p.add_argument("--pg-timeout", type=float, default=5.0,
                   help="process-group timeout (s) of the rank-failure check (RankPool kills ranks "
                   "that have not failed 10 s after the first error: keep it below that)")
    p.add_argument("--skip-bench", action="store_true", help="only the robustness checks")
    p.add_argument("--shared-devices", action="store_true",
                   help="ranks share devices (rank r on device r mod count; see "
                   "flashoverlap_core/tools/ranks.py): checks that the harness and every "
                   "multi-rank path run; its times measure nothing (ranks time-slice a device)")
    p.add_argument("--json", metavar="PATH", help="result file (default: bench/results/"
                   "multigpu-w<W>-<date>.json, or $FO_RESULTS_DIR)")
    args = p.parse_args(argv)

    try:
        hw = pick_hardware(args.backend, args.world_size, args.device, args.shared_devices)
    except (UsageError, registry.BackendError) as e:
        p.error(str(e))
    on_cpu = hw.device_type == "cpu"
    world = hw.world_size
    ops = args.ops
    all_cases = cases_for(args.shapes, ops, world, args.quick, on_cpu)
    shapes = list(dict.fromkeys(s for s, _ in all_cases))
    dtype = args.dtype or ("float32" if on_cpu else "bfloat16")
    iters = args.iters or (3 if on_cpu else 10)
    tuned = type(registry.get(hw.target)).trace is not Backend.trace
    cache = str(Path(tempfile.mkdtemp(prefix="fo-multigpu-")) / "tuning.json")
    print(f"multigpu: backend {hw.backend} on {world} {hw.device_type} rank(s), {dtype}, "
          f"{len(all_cases)} case(s) of {len(shapes)} shape(s) x {len(ops)} op(s)", flush=True)

    rows, robustness = [], {}
    ranks = Ranks(hw.world_size, hw.device_type, env=MULTICAST_OFF, timeout=args.timeout,
                  pg_timeout=300.0, shared_devices=hw.shared_devices)
    try:
        cases = [] if args.skip_bench else all_cases
        job_of = lambda shape, op: job_for(shape, op, dtype, hw.target, iters,  # noqa: E731
                                           args.warmup, hw.device_type)
        for i, (shape, op) in enumerate(cases, 1):
            why = skip_reason(shape, op, world)
            if why:
                rows.append(empty_row(shape, op, dtype, world, hw.backend, "skipped", why))
                continue
            job = job_of(shape, op)
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
            runnable = [(s, op) for s, op in all_cases if not skip_reason(s, op, world)]
            for shape, op in runnable:
                job = job_of(shape, op)
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
            job = job_of(*(runnable[0] if runnable else all_cases[0]))
            robustness = {"drift": drift, "rank_failure": rank_failure(hw, job, args.pg_timeout)}
    finally:
        ranks.close()

    if rows:
        print(table(rows, ["shape", "op", "status", "t_gemm_ms", "t_comm_ms", "sequential_ms",
                           "decomposition_ms", "symm_mem_ms", "fo_default_ms",
                           "fo_predicted_ms", "fo_best_ms",
                           "ideal_ms", "speedup_fo_predicted", "efficiency_fo_predicted",
                           "predictor_error_pct"]))
    summary = summarise(rows)
    if robustness:
        print(json.dumps(robustness, indent=1))
        summary["drift_ok"] = all(d["status"] == "ok" for d in robustness["drift"])
        summary["rank_failure_ok"] = robustness["rank_failure"]["status"] in ("ok", "skipped")
    print(json.dumps(summary, indent=1))
    extra = {"format": "flashoverlap.multigpu/1", "world_size": world,
             "hardware": dataclasses.asdict(hw), "topology": topology_record(ranks),
             "columns": list(COLUMNS),
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
