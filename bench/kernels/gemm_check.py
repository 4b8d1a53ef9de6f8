"""Check and time FlashOverlap's CUDA kernel libraries on one GPU, through their C ABI.

For every prebuilt GEMM configuration it runs the signaling GEMM on work items from a real
plan (flashoverlap_core.plan.Plan.item_table) and checks, against a float64 reference:
the packed output (poisoned with NaN first; K padding of a poisoned too, so a read past K shows),
the counters (each equals its group's size), the CTA of each item in monitor mode, and the
alignment errors. Then it checks the post-reorder and the device-side waits (a consumer stream
copies each group's region the moment its counter fires; the copies must equal the result), and
times the GEMM against torch.matmul and the post-reorder against a device copy.

Usage (GPU machine, objects prebuilt into $FLASHOVERLAP_CACHE_DIR by `flashoverlap build`):
    FLASHOVERLAP_NO_JIT=1 python3 bench/kernels/gemm_check.py --out results.json
The plans, the tile order's cluster rule and the packed layout are the backend's own
(flashoverlap_core.plan, backends/cuda/kernels.py), not copies.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from pathlib import Path

import torch

from flashoverlap_backends.cuda import build, kernels
from flashoverlap_backends.cuda import runtime as bind
from flashoverlap_core.plan import Plan
from flashoverlap_core.tiles import Schedule

GemmConfig = build.GemmConfig

# What this script checks and times (all must be prebuilt; a missing one is reported).
PINGPONG = GemmConfig(tile_n=128, schedule="pingpong")  # pingpong 128x128x64, cluster 2x1
CONFIGS = [
    GemmConfig(),                                                  # cooperative 128x256, 2x1
    PINGPONG,
    GemmConfig(tile_n=128, schedule="pingpong", cluster_m=1, cluster_n=2),
    GemmConfig(tile_n=128, schedule="pingpong", cluster_m=1),
    GemmConfig(tile_n=128, schedule="pingpong", b_col_major=False),  # row-major b
    GemmConfig(tile_n=128, schedule="pingpong", dtype="fp16"),
    build.default_config(80),                                      # sm80 128x128x32 on sm90
    build.default_config(80, dtype="fp16", b_col_major=False),
]
SWEEP = {build.config_name(GemmConfig()), build.config_name(PINGPONG)}  # swizzle/CTA sweeps
PERF_SHAPES = [(4096, 4096, 4096), (8192, 8192, 2048), (8192, 8192, 8192), (16384, 8192, 1024),
               (4096, 8192, 8192), (2048, 8192, 4096)]
TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@functools.lru_cache(maxsize=None)
def item_table(plan):
    """The plan's item and group tables, on the host and on the device (made once per plan)."""
    items, groups = plan.item_table()
    return items, groups, items.cuda(), groups.cuda()


@functools.lru_cache(maxsize=None)
def packed_index(plan):
    """plan.packed_index() on the device (made once per plan)."""
    return plan.packed_index().cuda()


@functools.lru_cache(maxsize=None)
def make_plan(cfg, m, n, k, blocks, max_ctas, group_waves=1.0, swizzle=2):
    """A plan whose order suits the config's cluster: pairs of consecutive items must share
    their column tile (cluster 2x1) or rows (1x2), so the swizzle along the cluster's mode is
    even; `swizzle` bands (raster n) or column tiles (raster m) are visited together."""
    raster = "m" if cfg.cluster_n > 1 else "n"
    op, world = ("reduce_scatter", blocks) if blocks > 1 else ("allreduce", 1)
    tiles = blocks * math.ceil(m // blocks / cfg.tile_m) * math.ceil(n / cfg.tile_n)
    per_group = max(blocks, int(max_ctas * group_waves) // blocks * blocks)
    sizes = [per_group] * (tiles // per_group)
    if tiles % per_group:
        sizes.append(tiles % per_group)
    return Plan(m=m, n=n, k=k, op=op, world_size=world, dtype="bfloat16", tile=cfg.tile,
                wave_size=max_ctas, group_sizes=tuple(sizes), schedule=Schedule(raster, swizzle))


def cluster_ok(cfg, items: torch.Tensor) -> bool:
    """The backend's rule: items of one cluster round can share operand tiles."""
    return kernels.cluster_fits(items, (cfg.cluster_m, cfg.cluster_n))


class Operands:
    """a [M, K] (row stride lda, padding poisoned), b as the config's layout, reference c."""

    def __init__(self, cfg, m, n, k, reference=True):
        dt = TORCH_DTYPE[cfg.dtype]
        self.lda = round_up(k, 8)
        a_store = torch.full((m, self.lda), float("nan"), dtype=dt, device="cuda")
        a_store[:, :k] = torch.randn(m, k, device="cuda").to(dt)
        self.a = a_store
        if cfg.b_col_major:  # b stored [N, K]
            self.ldb = round_up(k, 8)
            w = torch.full((n, self.ldb), float("nan"), dtype=dt, device="cuda")
            w[:, :k] = torch.randn(n, k, device="cuda").to(dt)
            self.b = w
            self.b_mat = w[:, :k].t()
        else:  # b stored [K, N]
            self.ldb = round_up(n, 8)
            bb = torch.full((k, self.ldb), float("nan"), dtype=dt, device="cuda")
            bb[:, :n] = torch.randn(k, n, device="cuda").to(dt)
            self.b = bb
            self.b_mat = bb[:, :n]
        self.a_mat = a_store[:, :k]
        self.c_ref = (self.a_mat.double() @ self.b_mat.double()) if reference else None


def run_gemm(lib, ops, plan, items, groups, counters, packed, ctas, monitor=None):
    blocks = len(plan.block_rows)
    lib.run(ptr(ops.a), ptr(ops.b), ptr(packed), blocks, plan.block_rows[0], plan.n, plan.k,
            ops.lda, ops.ldb, ptr(items), ptr(groups), len(items), ptr(counters), ctas,
            ptr(monitor), None, stream())


def check_case(lib, cfg, m, n, k, blocks, ctas, monitor=False, signal=True):
    """Correctness of one shape: packed vs reference, counters, monitor CTAs."""
    plan = make_plan(cfg, m, n, k, blocks, ctas)
    items_cpu, _, items, groups = item_table(plan)
    if not cluster_ok(cfg, items_cpu):
        return {"shape": [m, n, k, blocks], "skipped": "plan order does not suit the cluster"}
    ops = Operands(cfg, m, n, k)
    dt = TORCH_DTYPE[cfg.dtype]
    packed = torch.full((m * n,), float("nan"), dtype=dt, device="cuda")
    counters = torch.zeros(plan.num_groups, dtype=torch.int32, device="cuda")
    mon = torch.zeros(2 * len(items), dtype=torch.int64, device="cuda") if monitor else None
    run_gemm(lib, ops, plan, items, groups, counters if signal else None, packed, ctas, mon)
    torch.cuda.synchronize()
    ref = ops.c_ref.flatten()[packed_index(plan)]
    out = packed.double()
    err = ((out - ref).norm() / ref.norm()).item()
    max_err = ((out - ref).abs().max() / ref.abs().max()).item()
    result = {"shape": [m, n, k, blocks], "ctas": ctas, "tiles": len(items), "rel_err": err,
              "max_err": max_err, "nan": int(torch.isnan(out).sum().item()),
              "counters_ok": counters.cpu().tolist() == (list(plan.group_sizes) if signal
                                                         else [0] * plan.num_groups)}
    if monitor:
        mon = mon.view(-1, 2).cpu()
        cta = (mon[:, 1] & 0xFFFFFFFF).tolist()
        result["monitor_cta_ok"] = all(c == i % ctas for i, c in enumerate(cta))
        t = mon[:, 0].double()
        result["monitor_span_us"] = (t.max() - t.min()).item() / 1e3
    tol = 2e-2 if cfg.dtype == "bf16" else 5e-3
    result["ok"] = (err < tol and result["nan"] == 0 and result["counters_ok"]
                    and result.get("monitor_cta_ok", True))
    return result


def check_alignment_error(lib, cfg):
    """A misaligned lda must be refused with a message, before any launch."""
    dt = TORCH_DTYPE[cfg.dtype]
    a = torch.zeros(16, 16, dtype=dt, device="cuda")
    try:
        lib.run(ptr(a), ptr(a), ptr(a), 1, 16, 16, 12, 12, 16, ptr(a), ptr(a), 1, ptr(a),
                cfg.cta_multiple, None, None, stream())
    except bind.KernelError as e:
        return {"ok": "multiple of 8" in str(e), "message": str(e)[:200]}
    return {"ok": False, "message": "accepted lda=12"}


def bench(fn, warmup=5, reps=20):
    """Median device time of fn in ms. Every repetition is queued before one synchronize, so
    the device never waits for the host between them (host overhead stays out)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def perf_case(lib, cfg, m, n, k, ctas, swizzle, signal=True):
    plan = make_plan(cfg, m, n, k, 1, ctas, swizzle=swizzle)
    items_cpu, _, items, groups = item_table(plan)
    if not cluster_ok(cfg, items_cpu):
        return None
    ops = Operands(cfg, m, n, k, reference=False)
    packed = torch.empty(m * n, dtype=TORCH_DTYPE[cfg.dtype], device="cuda")
    # Null counters: the same kernel without signaling.
    counters = torch.zeros(plan.num_groups, dtype=torch.int32, device="cuda") if signal else None
    ms = bench(lambda: run_gemm(lib, ops, plan, items, groups, counters, packed, ctas))
    return 2.0 * m * n * k / ms / 1e9


def torch_tflops(m, n, k, col_major=True, dtype=torch.bfloat16):
    a = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(n, k, device="cuda").to(dtype).t() if col_major else torch.randn(k, n, device="cuda").to(dtype)
    ms = bench(lambda: torch.matmul(a, b))
    return 2.0 * m * n * k / ms / 1e9


def check_unpack(rt, lib, cfg, m, n, k, ctas):
    """Post-reorder of a full plan: exact, and its bandwidth against a device copy."""
    plan = make_plan(cfg, m, n, k, 1, ctas)
    _, _, items, groups = item_table(plan)
    ops = Operands(cfg, m, n, k, reference=False)
    dt = TORCH_DTYPE[cfg.dtype]
    packed = torch.empty(m * n, dtype=dt, device="cuda")
    counters = torch.zeros(plan.num_groups, dtype=torch.int32, device="cuda")
    run_gemm(lib, ops, plan, items, groups, counters, packed, ctas)
    tiles = torch.tensor([[t.row0, t.rows, t.col0, t.cols] for t, _, _ in plan.packed_tiles],
                         dtype=torch.int32, device="cuda")
    offsets = torch.tensor([off for _, _, off in plan.packed_tiles], dtype=torch.int64, device="cuda")
    dst = torch.full((m, n), float("nan"), dtype=dt, device="cuda")
    unpack = lambda: rt.unpack_tiles(ptr(packed), ptr(dst), n, ptr(tiles), ptr(offsets),  # noqa: E731
                                     len(tiles), 2, stream())
    unpack()
    torch.cuda.synchronize()
    exact = torch.equal(dst.flatten()[packed_index(plan)], packed)
    ms = bench(unpack, reps=30)
    flat = torch.empty_like(packed)
    copy_ms = bench(lambda: flat.copy_(packed), reps=30)
    gbs = 2 * packed.numel() * 2 / ms / 1e6
    copy_gbs = 2 * packed.numel() * 2 / copy_ms / 1e6
    return {"shape": [m, n], "tile": list(cfg.tile), "exact": exact, "unpack_GBps": gbs,
            "copy_GBps": copy_gbs, "ratio": gbs / copy_gbs, "ok": exact}


def check_waits(rt, lib, cfg, m, n, k, ctas, mode, runs):
    """A consumer stream waits on each group's counter and copies its region at once: every
    copy must equal the final packed output (no counter visible before its data)."""
    plan = make_plan(cfg, m, n, k, 1, ctas, group_waves=0.5)
    _, _, items, groups = item_table(plan)
    ops = Operands(cfg, m, n, k, reference=False)
    dt = TORCH_DTYPE[cfg.dtype]
    packed = torch.empty(m * n, dtype=dt, device="cuda")
    snap = torch.empty_like(packed)
    counters = torch.zeros(plan.num_groups, dtype=torch.int32, device="cuda")
    comm = torch.cuda.Stream(priority=-1)
    # Warm every kernel used below (lazy loading would serialize or deadlock the overlap).
    snap.copy_(packed)
    packed.fill_(float("nan"))
    rt.reset_counters(ptr(counters), plan.num_groups, stream())
    torch.cuda.synchronize()
    bad = 0
    for _ in range(runs):
        packed.fill_(float("nan"))
        snap.fill_(0)
        rt.reset_counters(ptr(counters), plan.num_groups, stream())
        comm.wait_stream(torch.cuda.current_stream())  # the reset before any wait
        run_gemm(lib, ops, plan, items, groups, counters, packed, ctas)  # GEMM before the waits
        with torch.cuda.stream(comm):
            for r in plan.regions:
                rt.wait_counter(ptr(counters) + 4 * r.index, plan.group_sizes[r.index],
                                bind.WAIT_MODES[mode], comm.cuda_stream)
                snap[r.offset:r.offset + r.numel].copy_(packed[r.offset:r.offset + r.numel])
        torch.cuda.synchronize()
        if not torch.equal(snap, packed) or torch.isnan(snap).any():
            bad += 1
    return {"mode": mode, "runs": runs, "groups": plan.num_groups, "bad_runs": bad, "ok": bad == 0}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="kernel_results.json")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--wait-runs", type=int, default=50)
    parser.add_argument("--configs", default="", help="comma-separated substrings of config names")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: "
                        "correctness,reorder,perf")
    args = parser.parse_args()
    wanted = [w for w in args.configs.split(",") if w]
    skip = set(filter(None, args.skip.split(",")))
    save = lambda: Path(args.out).write_text(json.dumps(report, indent=1))  # noqa: E731
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "configs": {}}
    rt = kernels.runtime_library()  # its kernels loaded
    libs = {}
    for cfg in CONFIGS:
        name = build.config_name(cfg)
        if wanted and not any(w in name for w in wanted):
            continue
        try:
            lib = rt.GemmLibrary(str(build.build_gemm(cfg)))
            lib.load_kernels()
        except Exception as e:  # noqa: BLE001 (report and go on)
            report["configs"][name] = {"error": str(e)[:300]}
            print(f"{name}: {e}", flush=True)
            continue
        libs[name] = (cfg, lib)
        report["configs"][name] = {"max_ctas": lib.max_ctas(0)}

    # Correctness: ragged shapes, K tails (padding poisoned), several destination blocks.
    shapes = [(4096, 4096, 4096, 1), (1, 1, 1, 1), (1000, 1000, 1000, 1), (777, 1234, 999, 1),
              (1200, 1000, 512, 4), (2048, 384, 72, 2), (3000, 2500, 320, 1), (256, 8192, 64, 2)]
    if args.quick:
        shapes = shapes[:4]
    for name, (cfg, lib) in libs.items() if "correctness" not in skip else ():
        entry = report["configs"][name]
        ctas = entry["max_ctas"]
        entry["alignment_error"] = check_alignment_error(lib, cfg)
        cases = []
        for m, n, k, blocks in shapes:
            if cfg.arch == 80 and (k % 8 or (not cfg.b_col_major and n % 8)):
                continue  # sm80 needs K (and N for row-major b) % 8 == 0: refused, see above
            monitor = (m, n, k) == (4096, 4096, 4096)
            cases.append(check_case(lib, cfg, m, n, k, blocks, ctas, monitor))
            if cfg.cta_multiple == 1 and (m, n, k) == (1000, 1000, 1000):
                cases.append(check_case(lib, cfg, m, n, k, blocks, max(1, ctas - 2)))
        if cfg.cta_multiple > 1:
            cases.append(check_case(lib, cfg, 4096, 4096, 4096, 1, ctas - 2 * cfg.cta_multiple))
        cases.append(dict(check_case(lib, cfg, 1000, 1000, 1000, 1, ctas, signal=False), counters=None))
        entry["cases"] = cases
        status = all(c.get("ok", True) for c in cases)
        print(f"{name}: correctness {'ok' if status else 'FAILED'}; worst rel err "
              f"{max((c.get('rel_err', 0) for c in cases), default=0):.2e}", flush=True)
        for c in cases:
            if not c.get("ok", True):
                print("   ", c, flush=True)
        save()

    # Post-reorder (tiles of the cooperative config) and device-side waits (both sweep configs).
    sweep = [name for name in libs if name in SWEEP]
    if sweep and "reorder" not in skip:
        report["unpack"], report["waits"] = [], []
        for name in sweep:
            cfg, lib = libs[name]
            ctas = report["configs"][name]["max_ctas"]
            if not report["unpack"]:
                report["unpack"] = [check_unpack(rt, lib, cfg, 8192, 8192, 256, ctas),
                                    check_unpack(rt, lib, cfg, 4096, 4096, 256, ctas)]
            for mode in ("stream_wait_value", "spin_kernel"):
                result = check_waits(rt, lib, cfg, 4096, 4096, 4096, ctas, mode, args.wait_runs)
                report["waits"].append(dict(result, config=name))
        print("unpack:", report["unpack"], flush=True)
        print("waits:", report["waits"], flush=True)
        save()

    # Speed: bf16, b column-major, against torch.matmul.
    perf_shapes = PERF_SHAPES[:2] if args.quick else PERF_SHAPES
    report["torch_tflops"] = {f"{m}x{n}x{k}": torch_tflops(m, n, k) for m, n, k in perf_shapes}
    for name, (cfg, lib) in libs.items():
        if cfg.dtype != "bf16" or not cfg.b_col_major or "perf" in skip:
            continue
        ctas = report["configs"][name]["max_ctas"]
        main = name in SWEEP
        perf = {}
        for m, n, k in perf_shapes:
            key = f"{m}x{n}x{k}"
            runs = {}
            for swizzle in ((2, 4, 8, 16) if main else (2, 8)):
                runs[f"swizzle{swizzle}"] = perf_case(lib, cfg, m, n, k, ctas, swizzle)
            if main:
                for fewer in (4, 8, 16):
                    runs[f"swizzle8_ctas{ctas - fewer}"] = perf_case(lib, cfg, m, n, k, ctas - fewer, 8)
                nosignal = perf_case(lib, cfg, m, n, k, ctas - 4, 8, signal=False)
            runs = {key_: tf for key_, tf in runs.items() if tf is not None}
            if runs:
                best = max(runs, key=runs.get)
                perf[key] = {"tflops": runs[best], "best": best, "runs": runs,
                             "vs_torch": runs[best] / report["torch_tflops"][key]}
                if main and nosignal is not None:
                    perf[key]["no_signal_swizzle8_ctas" + str(ctas - 4)] = nosignal
        report["configs"][name]["perf"] = perf
        save()

    print("\nTFLOP/s (bf16, b = weight.t()), ratio to torch.matmul")
    print(f"{'config':52s}" + "".join(f"{m}x{n}x{k:<6}"[:18].rjust(18) for m, n, k in perf_shapes))
    print(f"{'torch.matmul':52s}" + "".join(f"{report['torch_tflops'][f'{m}x{n}x{k}']:18.1f}" for m, n, k in perf_shapes))
    for name, entry in report["configs"].items():
        perf = entry.get("perf")
        if perf:
            cells = [perf.get(f"{m}x{n}x{k}") for m, n, k in perf_shapes]
            print(f"{name:52s}" + "".join(
                f"{c['tflops']:10.1f} ({c['vs_torch']:.2f})" if c else " " * 18 for c in cells))


if __name__ == "__main__":
    main()
