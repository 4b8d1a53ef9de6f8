"""The strategy decision itself (issue 31): for each row, the model's predicted choice between the
overlapped call and the plain path, against both measured.

On one GPU a collective at world size 1 moves nothing, so the default call's choice is a fixed
rule there (plain). The one second resource a single GPU has is the host link: a callable op
that offloads each finished group to pinned host memory (``transfers.HostOffload``) overlaps
the GEMM with a device-to-host copy whose bandwidth is real. ``fo.overlap`` always overlaps a
callable op (the caller asked for its transfer); this benchmark lets the model decide it
explicitly, with the same pieces the default call uses for a collective
(``flashoverlap_core.tuning.strategy``):

* the device's GEMM rates (``measure_rates``), measured once;
* the op's cost curve: the offload itself timed at the default choice's four sizes
  (``measure_curve`` on a device-to-host copy into pinned memory);
* ``predict(plan, rates, curve)`` on the default plan of each shape.

Then both strategies run on the same inputs (the default plan, and the same plan with
``strategy="sequential"``: ``a @ b`` on the device's own GEMM, then one offload of the whole
result), shuffled in rounds; each row says which was faster, whether the prediction picked
it, and what it lost when it did not. Every time is a call's device time with the host ahead
(about a millisecond of calls queued back to back while the device is held busy, as in a
model's forward or a captured graph; runs before 2026-12-04 18:00 timed from an idle device,
so decode rows measured the host's launch time): each row also records each strategy's host
time to issue one call (``host_us_*``) and the share of samples whose calls the host had
queued ahead (``ahead_*``). Target: the predicted choice is never more than 3% slower
than the better of the two. Rows at world size 1 with a collective op (an NCCL group of one)
check the fixed rule the same way.

    python bench/strategy.py [--shapes MxNxK,...] [--rounds 5]

Writes bench/results/strategy-<device>-<date>.json (summary: worst loss, rows met).

``--world-size W`` (W >= 2, one GPU per rank: never ranks sharing a GPU, whose times mean
nothing) is the decision on a real collective: W ranks in one NCCL group, each on its own GPU.
Per row (tokens x (N, K) x op, bf16; each rank's operands its own) every rank makes the default
call (``fo.overlap`` with default arguments: its strategy predicted on the call's first use,
read back from ``fo.prepared_calls()`` with both predicted durations), then the same default
plan forced to overlap and forced plain are timed in alternating rounds, the slowest rank's
time counting. The row says which was faster, whether the default call picked it, what it lost
when it did not, and the model's error on each strategy. allgather's tokens are the gathered
rows (each rank holds tokens / W); all_to_all sends tokens / W rows to every rank (its default
is predicted on the plan of the ranks' mean rows, here the row's tokens, split evenly; runs
before 2026-12-04 15:30, tree 94e0b49, had a fixed rule at W > 1: overlapped).

    python bench/strategy.py --world-size 2 [--tokens 16,...] [--nk 8192x1024,...] [--ops ...]

Writes bench/results/strategy-w<W>-<device>-<date>.json: per row also every rank's agreement on
the choice (``ranks_agree``) and the facts the model predicted from (GEMM rates, the
collective's curve, the contention) and, on cuda, the same collective timed on the overlapped
calls' bounded communicator (``bounded_curve``), to refit it offline; the FLASHOVERLAP_/NCCL_
settings.
``--backend reference`` is a dry run of the harness on CPU ranks (gloo; its times mean
nothing); a forcing ``FLASHOVERLAP_STRATEGY`` is refused.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

import flashoverlap_core as fo
from flashoverlap_core import api
from flashoverlap_core.transfers import HostOffload
from flashoverlap_core.tuning import strategy
from flashoverlap_core.tuning.measure import measure_curve, median_time, sample_times
from common import device_tag, nccl_group_of_one, table, write_result
from multigpu import MULTICAST_OFF

# (M, N, K): the host link (~50 GB/s) against the GEMM: from transfer-bound (small K, where the
# overlap can hide only the GEMM's short time) to GEMM-bound (large K), and decode rows.
OFFLOAD_SHAPES = ((16, 8192, 4096), (256, 8192, 4096), (1024, 8192, 1024), (1024, 8192, 8192),
                  (4096, 8192, 1024), (4096, 8192, 4096), (4096, 8192, 16384),
                  (8192, 8192, 8192), (16384, 4096, 16384), (16384, 8192, 2048))
COLLECTIVE_SHAPES = ((16, 8192, 1024), (4096, 8192, 1024), (16384, 8192, 3584))
TARGET_LOSS = 0.03
DTYPE = torch.bfloat16
# --world-size: the overhead benchmark's (N, K) and ops, decode to prefill tokens
MULTI_NK = ((8192, 1024), (8192, 3584), (4096, 7168), (7168, 2048), (5120, 3456))
MULTI_TOKENS = (16, 64, 256, 1024, 4096, 16384)
MULTI_OPS = ("allreduce", "reduce_scatter", "all_to_all", "allgather")


def offload_curve(device: torch.device):
    """The device-to-host copy into pinned memory at the model's curve sizes."""
    host = torch.empty(max(strategy.CURVE_SIZES) // 2, dtype=DTYPE, pin_memory=True)
    return measure_curve(lambda region: host[:region.numel()].copy_(region, non_blocking=True),
                         list(strategy.CURVE_SIZES), DTYPE, device, None, iters=5, warmup=2)


def both(fns: dict, device, group, rounds: int, inner: int) -> tuple[dict, dict]:
    """({name: median ms per call}, {name: the host's facts}) of each function: ``rounds``
    samples of ``inner`` calls queued back to back while the device is held busy
    (:func:`~flashoverlap_core.tuning.measure.sample_times`: the device time of a call when the
    host keeps ahead, as in a model's forward or a captured graph; the functions shuffled in
    every round; the slowest rank's). The host's facts: ``host_us``, its median time to issue
    one call, and ``ahead``, the share of samples whose calls were all queued before the device
    reached them (below 1: the call waits for the device on the host, or could not be held)."""
    report: dict = {}
    samples = sample_times(list(fns.values()), device, group, rounds=rounds, calls=inner,
                           warmup=2, report=report)
    times = {name: float(statistics.median(s)) * 1e3 for name, s in zip(fns, samples)}
    host = {name: {"host_us": round(float(statistics.median(h)) * 1e6, 2),
                   "ahead": round(float(sum(a) / len(a)), 2)}
            for name, h, a in zip(fns, report["host_s"], report["ahead"])}
    return times, host


def inner_calls(fn, device, group) -> int:
    """Calls per sample: about a millisecond of them (3 to 20), from one call timed alone."""
    once = median_time(fn, device, group, iters=3, warmup=2) * 1e3
    return int(min(20, max(3, round(1.0 / max(once, 1e-3)))))


def host_facts(host: dict) -> dict:
    """A row's columns on the host: each strategy's issue time per call and its share of
    samples timed with the host ahead."""
    out = {}
    for name, key in ((strategy.OVERLAP, "overlap"), (strategy.PLAIN, "plain")):
        out[f"host_us_{key}"], out[f"ahead_{key}"] = host[name]["host_us"], host[name]["ahead"]
    return out


def row(kind, m, n, k, predicted, times, plan) -> dict:
    faster = min(times, key=times.get)
    loss = times[predicted] / times[faster] - 1.0
    return {"kind": kind, "M": m, "N": n, "K": k, "groups": plan.num_groups,
            "layout": plan.layout, "predicted": predicted,
            "T_overlap_ms": round(times[strategy.OVERLAP], 4),
            "T_plain_ms": round(times[strategy.PLAIN], 4), "faster": faster,
            "right": predicted == faster, "loss": round(loss, 4), "met": loss <= TARGET_LOSS}


def offload_row(m, n, k, rates, curve, rounds) -> dict:
    a = torch.randn(m, k, device="cuda", dtype=DTYPE)
    w = torch.randn(n, k, device="cuda", dtype=DTYPE)
    overlap = fo.plan(m, n, k, op="custom", dtype=DTYPE, backend="cuda")
    plain = replace(overlap, strategy=strategy.PLAIN)
    began = time.perf_counter()
    prediction = strategy.predict(overlap, rates, curve)
    predict_ms = (time.perf_counter() - began) * 1e3
    offload = HostOffload.for_plan(overlap)
    out = torch.empty(m, n, device="cuda", dtype=DTYPE)
    fns = {strategy.OVERLAP: lambda: fo.overlap(a, w.t(), offload, plan=overlap, out=out),
           strategy.PLAIN: lambda: fo.overlap(a, w.t(), offload, plan=plain, out=out)}
    device = a.device
    times, host = both(fns, device, None, rounds, inner_calls(fns[strategy.PLAIN], device, None))
    torch.cuda.synchronize()
    r = row("offload", m, n, k, prediction.strategy, times, overlap)
    r.update(host_facts(host))
    r.update(predicted_overlap_ms=round(prediction.overlap_s * 1e3, 4),
             predicted_plain_ms=round(prediction.plain_s * 1e3, 4),
             predict_ms=round(predict_ms, 3))
    return r


def collective_row(m, n, k, rounds) -> dict:
    """World size 1, allreduce: the default call's fixed rule (plain) against forced overlap."""
    a = torch.randn(m, k, device="cuda", dtype=DTYPE)
    w = torch.randn(n, k, device="cuda", dtype=DTYPE)
    api.forget_prepared()
    fo.overlap(a, w.t(), "allreduce")  # the default call: its choice, from fo.prepared_calls()
    entry = fo.prepared_calls()[-1]
    predicted = entry["strategy"]
    overlap = fo.plan(m, n, k, op="allreduce", dtype=DTYPE, backend="cuda", world_size=1)
    overlap = replace(overlap, strategy=strategy.OVERLAP)
    plain = replace(overlap, strategy=strategy.PLAIN)
    fns = {strategy.OVERLAP: lambda: fo.overlap(a, w.t(), "allreduce", plan=overlap),
           strategy.PLAIN: lambda: fo.overlap(a, w.t(), "allreduce", plan=plain)}
    device = a.device
    times, host = both(fns, device, None, rounds, inner_calls(fns[strategy.PLAIN], device, None))
    r = row("allreduce W=1", m, n, k, predicted, times, overlap)
    r.update(host_facts(host), reason=entry.get("strategy_reason"))
    return r


def multi_case_on_rank(m: int, n: int, k: int, op: str, rounds: int, backend: str) -> dict:
    """One row on every rank (W >= 2): the default call's choice, then both strategies timed
    (the slowest rank's time). Rank 0's answer is the row."""
    world, rank = dist.get_world_size(), dist.get_rank()
    device = (torch.device("cuda", torch.cuda.current_device()) if backend == "cuda"
              else torch.device("cpu"))
    gen = torch.Generator(device=device).manual_seed(7919 * rank + 31 * m + n + k)
    rows = m // world if op == "allgather" else m
    a = torch.randn(rows, k, device=device, dtype=DTYPE, generator=gen)
    w = torch.randn(n, k, device=device, dtype=DTYPE, generator=gen) / k ** 0.5
    splits = [m // world] * world if op == "all_to_all" else None
    kw = {"send_splits": splits, "recv_splits": splits} if splits else {}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    api.forget_prepared()
    sync()
    dist.barrier()
    began = time.perf_counter()
    fo.overlap(a, w.t(), op, **kw)  # the default call: its choice, from fo.prepared_calls()
    sync()
    first_ms = (time.perf_counter() - began) * 1e3
    entry = fo.prepared_calls()[-1]
    overlap = fo.plan(m, n, k, op=op, world_size=world, dtype=DTYPE, backend=backend,
                      send_splits=splits)
    overlap = replace(overlap, strategy=strategy.OVERLAP)
    # what the model predicted from (this process's memo, else measured here, on every rank
    # alike), to refit it offline
    chosen, group = fo.registry.get(backend), dist.group.WORLD
    rates, curve = strategy.group_facts(overlap, chosen, group, device)
    contention = strategy.fitted_contention(chosen, device, group, strategy.TuningCache(), op)
    bounded = bounded_curve(op, backend, group, device, world)
    plain = replace(overlap, strategy=strategy.PLAIN)
    fns = {strategy.OVERLAP: lambda: fo.overlap(a, w.t(), op, plan=overlap, **kw),
           strategy.PLAIN: lambda: fo.overlap(a, w.t(), op, plan=plain, **kw)}
    # calls per sample: about a millisecond of them (3 to 20), so that a decode-sized call's
    # device time, not the host's launch and the ranks' line-up, is what is timed; the samples
    # are the tuner's (every strategy once per round, the slowest rank's time)
    inner = inner_calls(fns[strategy.PLAIN], device, group)
    times, host = both(fns, device, group, rounds, inner)
    out = row(f"{op} W={world}", m, n, k, entry["strategy"], times, overlap)
    out.update(host_facts(host))
    pred = {strategy.OVERLAP: entry.get("predicted_overlap_s"),
            strategy.PLAIN: entry.get("predicted_plain_s")}
    out.update(op=op, world_size=world, first_call_ms=round(first_ms, 2), inner=inner,
               wave_size=overlap.wave_size, tile=list(overlap.tile),
               group_sizes=list(overlap.group_sizes),
               facts={"gemm_rates": rates.to_dict(), "curve": curve.to_dict(),
                      "contention": contention.to_dict(), "bounded_curve": bounded},
               reason=entry.get("strategy_reason"),
               speedup_overlap=round(times[strategy.PLAIN] / times[strategy.OVERLAP], 4))
    for name, key in ((strategy.OVERLAP, "overlap"), (strategy.PLAIN, "plain")):
        if pred[name] is not None:
            out[f"predicted_{key}_ms"] = round(pred[name] * 1e3, 4)
            out[f"model_error_{key}"] = round(pred[name] * 1e3 / times[name] - 1.0, 4)
    return out


_BOUNDED: dict = {}


def bounded_curve(op: str, backend: str, group, device, world: int) -> dict | None:
    """The op's collective timed at the model's curve sizes on the communicator the overlapped
    calls use (cuda: NCCL kernels of at most FLASHOVERLAP_CUDA_NCCL_CTAS CTAs), where the model
    times torch's: {"max_ctas", "sizes", "seconds"}, or {"error"}; None off cuda and for
    all_to_all. Once per op in this process; on every rank alike (collective)."""
    if backend != "cuda" or op == "all_to_all":
        return None
    if op not in _BOUNDED:
        try:
            from flashoverlap_backends.cuda import nccl
            from flashoverlap_backends.cuda.device_state import overlap_nccl_ctas

            ctas = overlap_nccl_ctas(world)
            coll = nccl.PlainCollectives(group, device, max_ctas=ctas)
            rank = dist.get_rank(group)

            def send(region):
                if op == "allreduce":
                    coll.all_reduce(region)
                elif op == "reduce_scatter":
                    coll.reduce_scatter(region.new_empty(region.numel() // world), region)
                else:  # allgather, in place: this rank's slot of the gathered region
                    part = region.numel() // world
                    coll.all_gather(region, region[rank * part:(rank + 1) * part])

            found = measure_curve(send, strategy.curve_sizes(device, world), DTYPE, device,
                                  group, iters=3, warmup=2)
            _BOUNDED[op] = {"max_ctas": ctas, **found.to_dict()}
        except Exception as e:  # noqa: BLE001 - a fact for the refit, never the row's failure
            _BOUNDED[op] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return _BOUNDED[op]


def multi_gpu(args) -> None:
    """--world-size W: the rows on W ranks, one GPU each."""
    from flashoverlap_core.tools.ranks import RankError, Ranks, RankTimeout

    world, backend = args.world_size, args.backend
    device_type = "cuda" if backend == "cuda" else "cpu"
    if os.environ.get(strategy.ENV_STRATEGY, "auto").strip().lower() not in ("", "auto"):
        raise SystemExit(f"{strategy.ENV_STRATEGY}={os.environ[strategy.ENV_STRATEGY]} forces "
                         "every default call: unset it, this benchmark measures their own choice")
    if backend == "cuda" and torch.cuda.device_count() < world:
        raise SystemExit(f"--world-size {world} needs {world} GPUs, {torch.cuda.device_count()} "
                         "visible (ranks sharing a GPU measure no speed)")
    nks = parse_shapes(args.nk, MULTI_NK)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(MULTI_TOKENS)
    ops = args.ops.split(",") if args.ops else list(MULTI_OPS)
    for op in ops:
        if op not in MULTI_OPS:
            raise SystemExit(f"--ops: {op!r} is not one of {', '.join(MULTI_OPS)}")
    rows, began = [], time.perf_counter()
    name = f"strategy-w{world}-{device_tag() if backend == 'cuda' else 'dryrun-' + backend}"
    ranks = Ranks(world, device_type, env=MULTICAST_OFF, timeout=args.timeout,
                  shared_devices=False)
    try:
        for n, k in nks:
            for m in tokens:
                for op in ops:
                    if m % world:
                        continue  # every op here splits or gathers rows by rank
                    try:
                        per_rank = ranks.run(multi_case_on_rank, m, n, k, op, args.rounds,
                                             backend)
                        rows.append(dict(per_rank[0], ranks_agree=all(
                            r["predicted"] == per_rank[0]["predicted"] for r in per_rank)))
                    except (RankError, RankTimeout) as e:
                        rows.append({"kind": f"{op} W={world}", "M": m, "N": n, "K": k,
                                     "op": op, "error": str(e)[-2000:], "met": False,
                                     "right": False, "loss": None})
                    r = rows[-1]
                    print(f"{m}x{n}x{k} {op}: predicted {r.get('predicted')} overlap "
                          f"{r.get('T_overlap_ms')} plain {r.get('T_plain_ms')} ms "
                          f"loss {r.get('loss')}", flush=True)
    finally:
        ranks.close()
    measured = [r for r in rows if r.get("loss") is not None]
    print(table(measured, ["kind", "M", "N", "K", "predicted", "T_overlap_ms", "T_plain_ms",
                           "faster", "loss", "met", "predicted_overlap_ms",
                           "predicted_plain_ms"]))
    errors = [abs(r[f"model_error_{s}"]) for r in measured for s in ("overlap", "plain")
              if f"model_error_{s}" in r]
    summary = {"rows": len(rows), "errors": len(rows) - len(measured),
               "rows_met": sum(bool(r["met"]) for r in rows),
               "ranks_agree": all(r.get("ranks_agree", False) for r in rows),
               "right": sum(bool(r["right"]) for r in rows),
               "max_loss": max((r["loss"] for r in measured), default=None),
               "overlap_chosen": sum(r.get("predicted") == strategy.OVERLAP for r in measured),
               "overlap_faster": sum(r.get("faster") == strategy.OVERLAP for r in measured),
               "best_speedup_overlap": max((r["speedup_overlap"] for r in measured),
                                           default=None),
               "model_abs_error_median": (round(statistics.median(errors), 4) if errors
                                          else None),
               "target": f"the predicted choice at most {TARGET_LOSS:.0%} slower than the better",
               "met": bool(rows) and all(r["met"] for r in rows),
               "host_ahead_rows": sum(min(r.get("ahead_overlap", 0), r.get("ahead_plain", 0))
                                      >= 0.8 for r in measured),
               "default_run": not (args.nk or args.tokens or args.ops) and args.rounds == 5,
               "seconds": round(time.perf_counter() - began, 1)}
    print(summary)
    settings = {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("FLASHOVERLAP_", "NCCL_"))}
    write_result(name, rows, {"summary": summary, "world_size": world, "backend": backend,
                              "environment": settings,
                              "topology": ranks.topology(), "multicast_off": MULTICAST_OFF},
                 device_type=device_type)


def parse_shapes(text: str | None, default):
    if not text:
        return default
    return tuple(tuple(int(x) for x in s.split("x")) for s in text.split(","))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", help="offload rows, MxNxK comma-separated (default: the table)")
    p.add_argument("--collective-shapes", help="world-size-1 allreduce rows, MxNxK")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--world-size", type=int, default=1,
                   help="W >= 2: the collective rows on W ranks, one GPU each")
    p.add_argument("--nk", help="--world-size rows: (N, K) pairs, NxK comma-separated")
    p.add_argument("--tokens", help="--world-size rows: tokens (M), comma-separated")
    p.add_argument("--ops", help=f"--world-size rows: ops (default {','.join(MULTI_OPS)})")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="--world-size rows: seconds per row on the ranks")
    p.add_argument("--backend", default="cuda",
                   help="--world-size rows: 'cuda', or a CPU backend (reference, decomposition) "
                        "for a dry run of the harness on gloo, whose times mean nothing")
    args = p.parse_args()
    if args.world_size > 1:
        return multi_gpu(args)
    if not torch.cuda.is_available():
        raise SystemExit("bench/strategy.py needs a CUDA device (the host link is its subject)")
    device = torch.device("cuda", torch.cuda.current_device())
    nccl_group_of_one("strategy")
    try:
        began = time.perf_counter()
        rates = strategy.measure_rates(DTYPE, device, None)
        curve = offload_curve(device)
        facts_s = time.perf_counter() - began
        rows = [offload_row(m, n, k, rates, curve, args.rounds)
                for m, n, k in parse_shapes(args.shapes, OFFLOAD_SHAPES)]
        rows += [collective_row(m, n, k, args.rounds)
                 for m, n, k in parse_shapes(args.collective_shapes, COLLECTIVE_SHAPES)]
    finally:
        dist.destroy_process_group()
    print(table(rows, ["kind", "M", "N", "K", "groups", "predicted", "T_overlap_ms",
                       "T_plain_ms", "faster", "loss", "met"]))
    default_run = not (args.shapes or args.collective_shapes) and args.rounds == 5
    summary = {"rows": len(rows), "rows_met": sum(r["met"] for r in rows),
               "right": sum(r["right"] for r in rows),
               "max_loss": max(r["loss"] for r in rows),
               "target": f"the predicted choice at most {TARGET_LOSS:.0%} slower than the better",
               "met": all(r["met"] for r in rows), "default_run": default_run,
               "facts_measured_s": round(facts_s, 3),
               "offload_curve": {"bytes": list(curve.sizes),
                                 "seconds": [float(s) for s in curve.seconds]},
               "gemm_rates": rates.to_dict()}
    write_result(f"strategy-{device_tag()}", rows, {"summary": summary})


if __name__ == "__main__":
    main()
