"""What each rank runs in tests/gpu/test_multirank.py (spawned ranks import this module).

Every rank draws its own inputs from (seed, rank, call) and recomputes every other rank's, so
each checks its result against a float64 reference by itself. Outputs are NaN-poisoned row
slices of a larger buffer, so an unwritten element or a write outside ``out`` is seen.
"""
from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist

import flashoverlap_core as fo
from flashoverlap_core import api

DTYPE = torch.bfloat16
OPS = ("allreduce", "reduce_scatter", "allgather", "all_to_all")


def rank_world():
    return dist.get_rank(), dist.get_world_size()


def operands(seed: int, rank: int, m: int, n: int, k: int, layout: str, call: int = 0):
    """Rank ``rank``'s (a, b) on its own device: b is ``w.t()`` ("col") or contiguous ("row")."""
    g = torch.Generator().manual_seed((((seed * 131 + rank) * 131 + call) * 131 + m * 7 + n * 3 + k)
                                      & 0x7FFFFFFF)
    a = torch.randn(m, k, generator=g).to(DTYPE)
    w = torch.randn(n, k, generator=g).to(DTYPE)
    device = torch.device("cuda", torch.cuda.current_device())
    b = w.to(device).t() if layout == "col" else w.t().contiguous().to(device)
    return a.to(device), b


def reference(op: str, seed: int, m: int, n: int, k: int, layout: str, call: int, splits=None):
    """This rank's float64 result of ``op`` (splits: every rank's send_splits, all_to_all)."""
    rank, world = rank_world()
    rows = splits is not None
    prods = []
    for r in range(world):
        mr = sum(splits[r]) if rows else m
        a, b = operands(seed, r, mr, n, k, layout, call)
        prods.append(a.double() @ b.double())
    if op == "allreduce":
        return sum(prods)
    if op == "reduce_scatter":
        part = m // world
        return sum(prods)[rank * part:(rank + 1) * part]
    if op == "allgather":  # rank r's a rows, in rank order, times this rank's b
        a_all = torch.cat([operands(seed, r, m, n, k, layout, call)[0] for r in range(world)])
        return a_all.double() @ operands(seed, rank, m, n, k, layout, call)[1].double()
    offsets = [[sum(s[:d]) for d in range(world + 1)] for s in splits]
    return torch.cat([prods[src][offsets[src][rank]:offsets[src][rank + 1]]
                      for src in range(world)])


def poisoned(rows: int, n: int):
    guard = torch.full((rows + 2, n), float("nan"), dtype=DTYPE, device="cuda")
    return guard, guard[1:rows + 1]


def check(got, want, what: str, guard=None) -> list[str]:
    problems = []
    if guard is not None and not guard[[0, -1]].isnan().all():
        problems.append(f"{what}: rows outside out were written")
    if got.shape != want.shape:
        return problems + [f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"]
    if got.isnan().any():
        problems.append(f"{what}: {int(got.isnan().sum())} elements not written (NaN)")
        return problems
    err = float((got.double() - want).abs().max()) if want.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 1.0
    if err > 2e-2 * max(scale, 1.0):
        problems.append(f"{what}: max error {err:.3g} against float64 (scale {scale:.3g})")
    return problems


def call_shape(op: str, world: int, m: int):
    return (m // world * world) if op == "reduce_scatter" else m


def splits_for(seed: int, world: int, call: int, equal: bool, m: int):
    """Every rank's send_splits for one all_to_all call: equal, or skewed with zeros."""
    if equal:
        share = max(1, m // world)
        return [[share] * world for _ in range(world)]
    rng = random.Random(seed * 100003 + call)  # the same on every rank (no str hashing)
    out = []
    for r in range(world):
        rows = 0 if rng.random() < 0.15 else rng.randint(1, m)  # a rank may have no rows
        cuts = sorted(rng.choices(range(rows + 1), k=world - 1))
        out.append([b - a for a, b in zip([0] + cuts, cuts + [rows])])
    return out


def one_call(op, seed, call, m, n, k, layout, backend, poison=True, equal_splits=True):
    """One overlapped call of ``op`` on this rank, checked; (problems, backend that ran it)."""
    rank, world = rank_world()
    m = call_shape(op, world, m)
    splits = splits_for(seed, world, call, equal_splits, m) if op == "all_to_all" else None
    a, b = operands(seed, rank, sum(splits[rank]) if splits else m, n, k, layout, call)
    want = reference(op, seed, m, n, k, layout, call, splits)
    kwargs = {}
    if splits is not None:
        kwargs = {"send_splits": splits[rank], "recv_splits": [s[rank] for s in splits]}
    guard, out = poisoned(*want.shape) if poison else (None, None)
    got = fo.overlap(a, b, op, out=out, backend=backend, **kwargs)
    problems = check(got, want.to(got.device), f"{op} call {call} ({m}x{n}x{k}, b {layout})", guard)
    return problems, fo.prepared_calls()[-1]["backend"]


def every_op(seed: int, backend) -> dict:
    """Each op on ragged shapes, both layouts of b, with this rank's own inputs; which backend
    ran each (all_to_all: equal splits with cuda named, skewed ones with the automatic choice)."""
    api.forget_prepared()
    problems, ran = [], {}
    for i, (m, n, k) in enumerate(((1000, 776, 520), (257, 384, 4096), (8, 1032, 72))):
        for op in OPS:
            layout = "col" if (i + OPS.index(op)) % 2 == 0 else "row"
            p, b = one_call(op, seed, i, m, n, k, layout, backend, poison=i != 1)
            problems += p
            ran.setdefault(op, set()).add(b)
        p, b = one_call("all_to_all", seed, 10 + i, m, n, k, "col", None, equal_splits=False)
        problems += p
        ran.setdefault("all_to_all-skewed-default", set()).add(b)
    return {"problems": problems, "ran": {k: sorted(v) for k, v in ran.items()}}


def narrow_tiles(seed: int) -> dict:
    """allreduce, reduce_scatter and allgather with explicit plans of the cuda backend's
    128x224 and 128x160 tiles (their tma epilogue stores 32-column blocks), "rows" plans and,
    for allreduce, a "tiles" plan (group sizes that cut bands); ragged shapes (partial last band
    and column tile), both layouts of b, this rank's own inputs, poisoned outputs."""
    api.forget_prepared()
    rank, world = rank_world()
    problems, layouts = [], set()
    for i, (m, n, k, tile) in enumerate(((700, 3584, 264, (128, 224)),
                                         (1000, 1234, 520, (128, 160)))):
        for op in ("allreduce", "reduce_scatter", "allgather"):
            layout = "col" if (i + len(op)) % 2 == 0 else "row"
            rows = call_shape(op, world, m)
            # an allgather plan's M is the gathered output's: every rank's rows
            plan_m = rows * world if op == "allgather" else rows
            plan = fo.plan(plan_m, n, k, op=op, world_size=world, dtype=DTYPE, backend="cuda",
                           tile=tile)
            plans = [plan]
            if op == "allreduce":
                plans.append(fo.plan(plan_m, n, k, op=op, world_size=world, dtype=DTYPE,
                                     backend="cuda", tile=tile,
                                     group_sizes=[3, plan.num_tiles - 3]))
            for j, p in enumerate(plans):
                call = 100 * i + 10 * j
                a, b = operands(seed, rank, rows, n, k, layout, call)
                want = reference(op, seed, rows, n, k, layout, call)
                guard, out = poisoned(*want.shape)
                got = fo.overlap(a, b, op, out=out, plan=p)
                problems += check(got, want.to(got.device),
                                  f"{op} {rows}x{n}x{k} tile {tile} {p.layout} (b {layout})", guard)
                layouts.add(p.layout)
    return {"problems": problems, "layouts": sorted(layouts)}


def moe_sequence(seed: int, calls: int, backend) -> dict:
    """Expert parallelism: every call, each rank's rows and splits are new (skewed, zeros, a
    rank without rows at times), recv_splits given on every other call only, fresh inputs,
    poisoned outputs on some calls; each call against float64. One prepared key."""
    api.forget_prepared()
    rank, world = rank_world()
    n, k = 1000, 264
    problems = []
    for call in range(calls):
        splits = splits_for(seed, world, call, False, 1 + 97 * (call % 7) + 13 * call)
        a, b = operands(seed, rank, sum(splits[rank]), n, k, "col", call)
        want = reference("all_to_all", seed, 0, n, k, "col", call, splits)
        given = call % 2 == 0
        guard, out = poisoned(*want.shape) if given and call % 4 == 0 else (None, None)
        got = fo.overlap(a, b, "all_to_all", out=out, backend=backend,
                         send_splits=splits[rank],
                         recv_splits=[s[rank] for s in splits] if given else None)
        problems += check(got, want.to(got.device), f"MoE call {call} (splits {splits})", guard)
    calls_seen = fo.prepared_calls()
    return {"problems": problems, "keys": len(calls_seen),
            "backends": sorted({c["backend"] for c in calls_seen})}


def moe_sequence_plain(seed: int, calls: int) -> dict:
    """:func:`moe_sequence` with the plain path forced (FLASHOVERLAP_STRATEGY=plain): the device's
    GEMM, then the all_to_all on the backend's own communicator (its grouped send/receive),
    each call against float64; what the key ran."""
    saved = os.environ.get("FLASHOVERLAP_STRATEGY")
    os.environ["FLASHOVERLAP_STRATEGY"] = "plain"
    try:
        result = moe_sequence(seed, calls, None)
        (entry,) = api._prepared.values()
        result.update(strategy=fo.prepared_calls()[0]["strategy"],
                      native_all_to_all=type(entry.prepared.plain).__name__)
        return result
    finally:
        api.forget_prepared()
        if saved is None:
            os.environ.pop("FLASHOVERLAP_STRATEGY", None)
        else:
            os.environ["FLASHOVERLAP_STRATEGY"] = saved


def fp8_moe_sequence(seed: int, calls: int, scaling: str) -> dict:
    """fp8 all_to_all (issue 32) as expert parallelism runs it: e4m3 a and b with float32 scales
    of ``scaling`` ("tensorwise", "rowwise": [rows, 1] and [1, N], "blockwise": [rows,
    ceil(K/128)] outer-dim-major and [ceil(K/128), ceil(N/128)]), every call each rank's rows
    and splits new (skewed, zeros, a rank without rows at times) and its scale_a of its own
    rows, recv_splits given on every other call; each result (bf16) against float64 of every
    source's dequantized rows. One prepared key, which cuda runs (the scaled GEMM over unequal
    destination blocks)."""
    api.forget_prepared()
    rank, world = rank_world()
    n, k = 1000, 264
    kb, nb = -(-k // 128), -(-n // 128)
    f8 = torch.float8_e4m3fn
    device = torch.device("cuda", torch.cuda.current_device())

    def inputs(r: int, rows: int, call: int):  # rank r's a, b and scales, on the host
        g = torch.Generator().manual_seed((seed * 7919 + r * 131 + call) & 0x7FFFFFFF)
        a = (torch.randn(rows, k, generator=g) * 2).to(f8)
        b = (torch.randn(n, k, generator=g) * 2).to(f8).t()
        if scaling == "tensorwise":
            return a, b, torch.rand((), generator=g) + 0.25, torch.rand((), generator=g) + 0.25
        if scaling == "rowwise":
            return (a, b, torch.rand(rows, 1, generator=g) + 0.25,
                    torch.rand(1, n, generator=g) + 0.25)
        return (a, b, (torch.rand(kb, rows, generator=g) + 0.25).t(),
                torch.rand(kb, nb, generator=g) + 0.25)

    def dequantized(a, b, sa, sb):
        if scaling == "blockwise":
            sa = sa.repeat_interleave(128, 1)[:, :k]
            sb = sb.repeat_interleave(128, 0)[:k].repeat_interleave(128, 1)[:, :n]
        return (a.double() * sa.double()) @ (b.double() * sb.double())

    problems = []
    for call in range(calls):
        splits = splits_for(seed, world, call, False, 1 + 97 * (call % 7) + 13 * call)
        offsets = [[sum(s[:d]) for d in range(world + 1)] for s in splits]
        want = torch.cat([dequantized(*inputs(src, sum(splits[src]), call))[
            offsets[src][rank]:offsets[src][rank + 1]] for src in range(world)])
        a, b, sa, sb = (t.to(device) for t in inputs(rank, sum(splits[rank]), call))
        given = call % 2 == 0
        out = None
        if given and call % 4 == 0:  # poisoned, in the result dtype
            out = torch.full(tuple(want.shape), float("nan"), dtype=DTYPE, device=device)
        got = fo.overlap(a, b, "all_to_all", scale_a=sa, scale_b=sb, out_dtype=DTYPE,
                         out=out, send_splits=splits[rank],
                         recv_splits=[s[rank] for s in splits] if given else None)
        if got.dtype != DTYPE:
            problems.append(f"fp8 MoE call {call}: result is {got.dtype}")
        problems += check(got, want.to(got.device), f"fp8 {scaling} MoE call {call} "
                          f"(splits {splits})")
    calls_seen = fo.prepared_calls()
    return {"problems": problems, "keys": len(calls_seen),
            "backends": sorted({c["backend"] for c in calls_seen}),
            "runners": sorted({c["runner"] for c in calls_seen})}


def fp8_allgather_sequence(seed: int, calls: int, scaling: str, rows: int = 200) -> dict:
    """fp8 allgather (issue 32): every rank's e4m3 shard with its own scale_a ("tensorwise":
    a 0-dim one that differs by rank; "rowwise": [m, 1] of its own rows and a [1, N] scale_b;
    "rowwise-a": [m, 1] with a 0-dim scale_b; "blockwise": [m, ceil(K/128)] outer-dim-major
    and [ceil(K/128), ceil(N/128)]), fresh inputs and scales every call (new tensors, or new
    values in the same ones), out poisoned on some calls, one plan of a chunk per band (a flag
    per band: tiles wait); each result (bf16) against float64 of every rank's dequantized rows,
    each by its own rank's scale_a, times this rank's dequantized b. One prepared key, which
    cuda runs (CudaGatherCall: the e4m3 rows and the scales gathered, the waiting GEMM with
    scales). ``rows``: each shard's (200: ragged against the tiles, so gemm_sm90.cu's kernel;
    a multiple of 128: tensor- and row-wise run CUTLASS's, kernels.stock_fits)."""
    api.forget_prepared()
    rank, world = rank_world()
    m, n, k = rows, 1000, 264  # N and K ragged against the tiles and the 128 blocks
    kb, nb = -(-k // 128), -(-n // 128)
    f8 = torch.float8_e4m3fn
    device = torch.device("cuda", torch.cuda.current_device())
    blockwise = scaling == "blockwise"

    def inputs(r: int, call: int):  # rank r's a, b and scales, on the host
        g = torch.Generator().manual_seed((seed * 7919 + r * 131 + call) & 0x7FFFFFFF)
        a = (torch.randn(m, k, generator=g) * 2).to(f8)
        b = (torch.randn(n, k, generator=g) * 2).to(f8).t()
        if scaling == "tensorwise":  # far apart on each rank: a rank's scale on another's rows
            return a, b, torch.rand((), generator=g) + 0.25 + 2.0 * r, torch.rand((), generator=g) + 0.25
        if scaling in ("rowwise", "rowwise-a"):
            sb = (torch.rand(1, n, generator=g) + 0.25 if scaling == "rowwise"
                  else torch.rand((), generator=g) + 0.25)
            return a, b, torch.rand(m, 1, generator=g) + 0.25 + 2.0 * r, sb
        return (a, b, (torch.rand(kb, m, generator=g) + 0.25 + 2.0 * r).t(),
                torch.rand(kb, nb, generator=g) + 0.25)

    def dequantized_a(a, sa):
        if blockwise:
            sa = sa.repeat_interleave(128, 1)[:, :k]
        return a.double() * sa.double()

    def dequantized_b(b, sb):
        if blockwise:
            sb = sb.repeat_interleave(128, 0)[:k].repeat_interleave(128, 1)[:, :n]
        return b.double() * sb.double()

    base = fo.plan(m * world, n, k, op="allgather", world_size=world, dtype=f8, out_dtype=DTYPE,
                   backend="cuda", scaling="blockwise" if blockwise else None)
    unit = world * -(-n // base.tile[1])  # a band of every shard: one chunk, a flag per shard
    plan = fo.plan(m * world, n, k, op="allgather", world_size=world, dtype=f8, out_dtype=DTYPE,
                   backend="cuda", scaling="blockwise" if blockwise else None, tile=base.tile,
                   group_sizes=[unit] * (base.num_tiles // unit))
    problems = []
    held = None
    for call in range(calls):
        mine = [t.to(device) for t in inputs(rank, call)]
        if held is not None and call % 2:  # the same tensors, new values
            for t, new in zip(held, mine):
                t.copy_(new)
            mine = held
        held = mine
        a, b, sa, sb = mine
        every = [inputs(r, call) for r in range(world)]  # (a, b, scale_a, scale_b) each
        want = (torch.cat([dequantized_a(x[0], x[2]) for x in every])
                @ dequantized_b(every[rank][1], every[rank][3]))
        guard, out = poisoned(m * world, n) if call % 3 == 0 else (None, None)
        got = fo.overlap(a, b, "allgather", scale_a=sa, scale_b=sb, out_dtype=DTYPE,
                         out=out, plan=plan)
        if got.dtype != DTYPE:
            problems.append(f"fp8 allgather call {call}: result is {got.dtype}")
        problems += check(got, want.to(got.device), f"fp8 {scaling} allgather call {call}",
                          guard)
    from flashoverlap_backends.cuda import kernels

    calls_seen = fo.prepared_calls()
    return {"problems": problems, "keys": len(calls_seen), "chunks": plan.num_groups,
            "backends": sorted({c["backend"] for c in calls_seen}),
            "runners": sorted({c["runner"] for c in calls_seen}),
            "stock": sorted({kernels.is_stock(e.prepared.gemm)
                             for e in api._prepared.values() if hasattr(e.prepared, "gemm")})}


def back_to_back(seed: int, calls: int, backend) -> dict:
    """``calls`` mixed calls in a row (op, shape and layout change every call; fresh inputs),
    each checked against float64."""
    api.forget_prepared()
    shapes = ((384, 256, 128), (130, 520, 256), (1024, 128, 64))
    problems = []
    for call in range(calls):
        op = OPS[call % 4]
        m, n, k = shapes[(call // 4) % 3]
        p, _ = one_call(op, seed, call, m, n, k, ("col", "row")[(call // 12) % 2], backend,
                        poison=call % 3 != 0)
        problems += p
    return {"problems": problems[:20], "failed_calls": len(problems)}


def two_streams(seed: int, rounds: int, backend) -> dict:
    """Two streams issue allreduce and reduce_scatter calls in turn; each result is checked
    after both streams are done."""
    api.forget_prepared()
    rank, world = rank_world()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    problems = []
    m, n, k = 512, 384, 256
    for r in range(rounds):
        results = []
        for s, stream in enumerate(streams):
            op = ("allreduce", "reduce_scatter")[s]
            a, b = operands(seed, rank, m, n, k, "col", 2 * r + s)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                results.append((op, 2 * r + s, fo.overlap(a, b, op, backend=backend)))
                a.record_stream(stream)
                b.record_stream(stream)
        torch.cuda.synchronize()
        for op, call, got in results:
            problems += check(got, reference(op, seed, m, n, k, "col", call).to(got.device),
                              f"stream call {op} {call}")
    return {"problems": problems[:20]}


def graph_capture(seed: int, replays: int, backend) -> dict:
    """A key's first call inside graph capture is refused with a clear error; after one call
    outside capture, the calls are captured in one graph and replayed on new inputs."""
    api.forget_prepared()
    rank, world = rank_world()
    m, n, k = 256, 512, 128
    problems, first_call_error = [], None
    a0, b0 = operands(seed, rank, m, n, k, "col", 0)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fo.overlap(a0, b0, "allreduce", backend=backend)
    except ValueError as e:
        first_call_error = str(e)
    except Exception as e:  # noqa: BLE001 - reported below
        first_call_error = f"unexpected {type(e).__name__}: {e}"
    torch.cuda.synchronize()
    a, b = a0.clone(), b0.clone()
    for op in ("allreduce", "reduce_scatter", "allgather"):  # warm-up calls outside capture
        fo.overlap(a, b, op, backend=backend)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = {op: fo.overlap(a, b, op, backend=backend)
                for op in ("allreduce", "reduce_scatter", "allgather")}
    for replay in range(replays):
        na, nb = operands(seed, rank, m, n, k, "col", replay + 1)
        a.copy_(na)
        b.copy_(nb)
        graph.replay()
        torch.cuda.synchronize()
        for op, got in outs.items():
            problems += check(got, reference(op, seed, m, n, k, "col", replay + 1).to(got.device),
                              f"replay {replay} {op}")
    return {"problems": problems[:20], "first_call_error": first_call_error,
            "backends": sorted({c["backend"] for c in fo.prepared_calls()})}


def rank_own_outputs(seed: int, calls: int) -> dict:
    """Each rank passes its own pattern of ``out`` buffers to one replayed "rows" allreduce key
    (whose collectives work on ``out`` itself): rank 0 the same buffer every call, rank r > 0 a
    rotation of 3 + r buffers and now and then a new one; between them all_to_all calls whose
    rows and splits are each rank's own (recv_splits given on every other call) and
    reduce_scatter calls. No rank may launch a collective outside a graph while another
    replays it (NCCL's rule): every result exact, nothing hangs, and each rank holds a graph
    per out it used (of its last 8)."""
    api.forget_prepared()
    rank, world = rank_world()
    m, n, k = 520, 776, 264
    plan = fo.plan(m, n, k, op="allreduce", world_size=world, dtype=DTYPE, backend="cuda")
    fixed = poisoned(m, n)
    rotation = [poisoned(m, n) for _ in range(3 + rank)]
    problems, outs_used = [], set()
    for call in range(calls):
        if rank == 0:
            guard, out = fixed
        elif call % 5 == 4:
            guard, out = poisoned(m, n)  # new (or a block the allocator hands back)
        else:
            guard, out = rotation[call % len(rotation)]
        out.fill_(float("nan"))
        outs_used.add(out.data_ptr())
        a, b = operands(seed, rank, m, n, k, "col", call)
        got = fo.overlap(a, b, "allreduce", plan=plan, out=out)
        problems += check(got, reference("allreduce", seed, m, n, k, "col", call).to(got.device),
                          f"allreduce call {call}", guard)
        splits = splits_for(seed, world, call, False, 1 + 37 * (call % 5))
        a, b = operands(seed, rank, sum(splits[rank]), n, k, "col", 100 + call)
        want = reference("all_to_all", seed, 0, n, k, "col", 100 + call, splits)
        guard, out = poisoned(*want.shape) if call % 4 == 0 else (None, None)
        got = fo.overlap(a, b, "all_to_all", out=out, send_splits=splits[rank],
                         recv_splits=[s[rank] for s in splits] if call % 2 == 0 else None)
        problems += check(got, want.to(got.device), f"all_to_all call {call} ({splits})", guard)
        if call % 3 == 0:
            p, _ = one_call("reduce_scatter", seed, 200 + call, m, n, k, "row", "cuda")
            problems += p
    entry = next(e for key, e in api._prepared.items() if e.plan.op == "allreduce")
    layout = entry.plan.layout
    return {"problems": problems[:20], "held": entry.prepared.graphs_held(),
            "outs": len(outs_used), "layout": layout}


def compiled_block(seed: int, calls: int, backend) -> dict:
    """torch.compile(mode="reduce-overhead") of a block of overlapped calls (reduce_scatter,
    the allgather of its rows into the next GEMM, then an allreduce), run on new inputs each
    call, against eager and float64. The ranks of every world size share one compile cache
    (TORCHINDUCTOR_CACHE_DIR, set by the test): a graph traced at another world size must not
    be reused."""
    api.forget_prepared()
    torch._dynamo.reset()
    rank, world = rank_world()
    m, n, k = 512, 256, 256

    def block(a, b, c):
        x = fo.overlap(a, b, "reduce_scatter", backend=backend)
        y = fo.overlap(x, c, "allgather", backend=backend)
        return fo.overlap(y, c.t(), "allreduce", backend=backend)

    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    problems = []
    for call in range(calls):
        a, b = operands(seed, rank, m, n, k, "col", call)
        c = operands(seed, 99, n, n, n, "row", call)[1]  # the same on every rank
        got = compiled(a, b, c).clone()  # a cudagraph output is overwritten by the next replay
        want = block(a, b, c)
        torch.cuda.synchronize()
        problems += check(got, want.double(), f"compiled call {call} against eager")
        # float64: the gathered rows are the whole sum S; every rank's y = S @ c is the same,
        # so the allreduce of y @ c^T is W times it
        s64 = reference("allreduce", seed, m, n, k, "col", call).to(c.device)
        problems += check(want, world * (s64 @ c.double() @ c.double().t()), f"eager call {call}")
    return {"problems": problems[:20], "world_size": world}


def nn_layers(seed: int, backend) -> dict:
    """fo.nn's row- and column-parallel layers (from one nn.Linear on every rank) forward and
    backward against the unsharded layers in float64."""
    api.forget_prepared()
    rank, world = rank_world()
    torch.manual_seed(seed)
    t, h, i = 64 * world, 256, 128 * world
    up = torch.nn.Linear(h, i, bias=True).to("cuda", DTYPE)
    down = torch.nn.Linear(i, h, bias=True).to("cuda", DTYPE)
    x_full = torch.randn(t, h, device="cuda", dtype=DTYPE)
    col = fo.nn.ColumnParallelLinear.from_linear(up, gather_input=True, backend=backend)
    row = fo.nn.RowParallelLinear.from_linear(down, reduce="reduce_scatter", backend=backend)
    rows = t // world
    x = x_full[rank * rows:(rank + 1) * rows].clone().requires_grad_(True)
    y = row(torch.nn.functional.silu(col(x)))  # smooth: no mask that rounding can flip
    grad_out = torch.randn(t, h, device="cuda", dtype=DTYPE, generator=torch.Generator(
        device="cuda").manual_seed(seed + 1))
    y.backward(grad_out[rank * rows:(rank + 1) * rows])
    # float64, unsharded
    up64 = torch.nn.Linear(h, i).to("cuda", torch.float64)
    down64 = torch.nn.Linear(i, h).to("cuda", torch.float64)
    with torch.no_grad():
        for dst, src in ((up64, up), (down64, down)):
            dst.weight.copy_(src.weight.double())
            dst.bias.copy_(src.bias.double())
    x64 = x_full.double().requires_grad_(True)
    y64 = down64(torch.nn.functional.silu(up64(x64)))
    y64.backward(grad_out.double())
    problems = check(y.detach(), y64.detach()[rank * rows:(rank + 1) * rows], "forward")
    problems += check(x.grad, x64.grad[rank * rows:(rank + 1) * rows], "input gradient")
    shard = i // world
    problems += check(col.weight.grad, up64.weight.grad[rank * shard:(rank + 1) * shard],
                      "column-parallel weight gradient")
    problems += check(row.weight.grad, down64.weight.grad[:, rank * shard:(rank + 1) * shard],
                      "row-parallel weight gradient")
    return {"problems": problems,
            "backends": sorted({c["backend"] for c in fo.prepared_calls()})}


def raise_mid_run(seed: int, failing: int, fail_at: int, calls: int, backend) -> None:
    """Every rank calls fo.overlap in a loop; rank ``failing`` raises before call ``fail_at``."""
    api.forget_prepared()
    rank, _ = rank_world()
    for call in range(calls):
        if rank == failing and call == fail_at:
            raise RuntimeError(f"injected failure on rank {rank} before call {call}")
        a, b = operands(seed, rank, 256, 256, 128, "col", call)
        fo.overlap(a, b, "allreduce", backend=backend)
        torch.cuda.synchronize()


def first_call_error_on_one_rank(seed: int, backend) -> str:
    """Rank 1 passes a plan that another tile makes: every rank must raise, naming why."""
    api.forget_prepared()
    rank, world = rank_world()
    m, n, k = 512, 512, 256
    tile = (128, 256) if rank != 1 else (128, 128)
    plan = fo.plan(m, n, k, "allreduce", world_size=world, dtype=DTYPE, backend="cuda", tile=tile)
    a, b = operands(seed, rank, m, n, k, "col")
    try:
        fo.overlap(a, b, "allreduce", plan=plan, backend=backend)
        torch.cuda.synchronize()
    except ValueError as e:
        return str(e)
    return "no error"


def tuned_on_rank0(cache_dir: str) -> str:
    """Rank 0's tuning cache has a plan for the shape, rank 1's is off: a clear error on both."""
    from flashoverlap_core import registry
    from flashoverlap_core.tuning import cache as tc

    rank, world = rank_world()
    os.environ["FLASHOVERLAP_TUNING_CACHE"] = f"{cache_dir}/tuning.json" if rank == 0 else "off"
    m, n, k = 1024, 768, 256
    if rank == 0:
        backend = registry.get("cuda")
        heuristic = fo.plan(m, n, k, dtype=DTYPE, backend="cuda", world_size=world)
        tuned = fo.plan(m, n, k, dtype=DTYPE, backend="cuda", world_size=world,
                        group_sizes=[1, heuristic.num_tiles - 1])
        assert tuned.to_json() != heuristic.to_json()
        ctx = tc.context_for(backend, "cuda", dist.group.WORLD)
        key = tc.plan_key(ctx, dtype="bfloat16", m=m, n=n, k=k, op="allreduce", world_size=world)
        tc.TuningCache().put("plans", key, {"plan": tuned.to_dict()})
    api.forget_prepared()
    a, b = operands(0, rank, m, n, k, "col")
    try:
        fo.overlap(a, b, "allreduce")
        torch.cuda.synchronize()
    except ValueError as e:
        return str(e)
    return "no error"


def strategies_with_own_caches(seed: int, cache_dir: str, backend) -> dict:
    """The default strategy choice ("auto") on every op, each rank with a tuning cache of its
    own: first every cache empty (every rank measures), then only rank 0's holding the
    measured numbers (rank 1's is off); decode and prefill rows, all_to_all with skewed splits
    that differ by rank. Every call is checked; returns the strategy of each call in order."""
    from flashoverlap_core.tuning import strategy

    rank, world = rank_world()
    saved = {k: os.environ.get(k) for k in ("FLASHOVERLAP_STRATEGY", "FLASHOVERLAP_TUNING_CACHE")}
    os.environ["FLASHOVERLAP_STRATEGY"] = "auto"
    problems, chosen = [], []
    try:
        for round_, cache in enumerate((f"{cache_dir}/rank{rank}.json",
                                        "off" if rank == 1 else f"{cache_dir}/rank{rank}.json")):
            os.environ["FLASHOVERLAP_TUNING_CACHE"] = cache
            strategy.forget()
            api.forget_prepared()
            for m in (16, 2048):
                for op in OPS:
                    p, _ = one_call(op, seed, 20 + round_, m, 1024, 512, "col", backend,
                                    equal_splits=op != "all_to_all")
                    problems += p
                    # the op's newest entry (all_to_all's key holds no rows: one entry)
                    ran = [c for c in fo.prepared_calls() if c["op"] == op][-1]
                    if ran["strategy"] == "sequential" and op != "all_to_all":
                        # the plain path's collective on FlashOverlap's own communicator
                        native = getattr(list(api._prepared.values())[-1].prepared, "native",
                                         None)
                        if type(native).__name__ != "PlainCollectives":
                            problems.append(f"{op} m={m}: the plain path ran its collective "
                                            f"through {type(native).__name__}")
                    chosen.append((round_, op, m, ran["strategy"], ran.get("strategy_reason")))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        strategy.forget()
    return {"problems": problems, "chosen": chosen}


def twins_follow_rank0(seed: int, calls: int) -> dict:
    """Two new groups of every rank, made while the ranks' FLASHOVERLAP_NCCL_CAPTURE_COMM
    differ: rank 0's setting decides whether each communicator of a group gets a capture twin
    (first 1, then 0), so every rank makes the same communicators. On each, overlapped
    allreduce calls (launches, then graph replays), checked."""
    from flashoverlap_backends.cuda import nccl

    rank, world = rank_world()
    m, n, k = 384, 512, 256
    before = os.environ.get(nccl.ENV_CAPTURE_COMM)
    problems, twins = [], []
    try:
        for step, rank0 in enumerate(("1", "0")):
            mine = rank0 if rank == 0 else ("0" if rank0 == "1" else "1")
            os.environ[nccl.ENV_CAPTURE_COMM] = mine
            group = dist.new_group(list(range(world)))
            plan = fo.plan(m, n, k, op="allreduce", dtype=DTYPE, backend="cuda",
                           world_size=world)
            for call in range(calls):
                a, b = operands(seed, rank, m, n, k, "col", 100 * step + call)
                got = fo.overlap(a, b, "allreduce", group, plan=plan)
                want = reference("allreduce", seed, m, n, k, "col", 100 * step + call)
                problems += check(got, want.to(got.device), f"group {step} call {call}")
            keys = [key for comm, (g, key, _) in nccl._watches.items() if g is group]
            twins.append(sum(1 for key in keys if key[-1] == "capture"))
            if not keys:  # the watchdog off: no watches to count the communicators by
                twins[-1] = None
    finally:
        if before is None:
            os.environ.pop(nccl.ENV_CAPTURE_COMM, None)
        else:
            os.environ[nccl.ENV_CAPTURE_COMM] = before
    return {"problems": problems[:20], "twins": twins}
