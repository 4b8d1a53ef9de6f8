"""Stock CUTLASS fp8 GEMMs beside the signaling GEMM and torch's (issue 32).

The question it answers: is the signaling GEMM's row-wise gap to torch._scaled_mm in what
FlashOverlap adds around CUTLASS's sm90 main loop (item table, epilogue slots, store thread,
signals), or in that main loop itself? bench/kernels/cutlass_fp8_ref.cu composes a GEMM from
CUTLASS's own parts only (CollectiveBuilder mainloop and epilogue, epilogue visitor tree for the
scales, GemmUniversal, persistent scheduler); this script builds a few of its configurations,
checks each against float64 on sampled rows, and times them with bench/gemm.py's method
(CUDA-graph replays between events, kernels alternated) beside FlashOverlap's product build and
torch._scaled_mm, on the inputs of bench/gemm.py --fp8 (row-wise scales). --scaling blockwise:
CUTLASS's sm90 FP8Blockwise main loop (1x128 groups of a, 128x128 blocks of b) beside the
block-scaled product and torch's block-wise scaled_mm (bench/gemm.py's blockwise_scaled_mm).

    python3 bench/cutlass_ref.py                    # build (nvcc, CUTLASS headers) and time
    python3 bench/cutlass_ref.py --build-only       # the objects only (no GPU needed)
    python3 bench/cutlass_ref.py --sets facts --configs pp128_c1x2

Writes bench/results/cutlass-ref-<device>-<date>.json. Not a FlashOverlap kernel: nothing in
the package loads these objects.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

# name -> (tile M, tile N, cluster M, cluster N, pingpong, block-wise, epilogue tile N (0:
# CUTLASS's EpilogueTileAuto, 64x32 for pingpong bf16), scalar scales (1: scale_a[0] and
# scale_b[0] only: the row-wise main loop under a tensor-wise epilogue, to price the row-wise one))
CONFIGS = {
    "pp128_c1x2": (128, 128, 1, 2, 1, 0, 0, 0),   # torch's row-wise kernel's shape (nvjet 128x128)
    "pp128_c2x1": (128, 128, 2, 1, 1, 0, 0, 0),   # the product's row-wise build (stock)
    "pp128_c1x1": (128, 128, 1, 1, 1, 0, 0, 0),
    "pp128_c2x1_e64": (128, 128, 2, 1, 1, 0, 64, 0),    # epilogue tiles of 64x64
    "pp128_c2x1_e128": (128, 128, 2, 1, 1, 0, 128, 0),  # and of 64x128
    "pp128_c2x1_scalar": (128, 128, 2, 1, 1, 0, 0, 1),
    "coop128x256_c2x1": (128, 256, 2, 1, 0, 0, 0, 0),
    "coop128_c2x1": (128, 128, 2, 1, 0, 0, 0, 0),
    # block-wise (CUTLASS's FP8Blockwise main loop; torch's block-wise kernel: nvjet 128x128,
    # cooperative, 2x1)
    "blk_coop128_c1x2": (128, 128, 1, 2, 0, 1, 0, 0),  # CUTLASS's example 67 configuration
    "blk_coop128_c2x1": (128, 128, 2, 1, 0, 1, 0, 0),
    "blk_pp128_c1x2": (128, 128, 1, 2, 1, 1, 0, 0),
}
SOURCE = ROOT / "kernels" / "cutlass_fp8_ref.cu"


def out_dir() -> Path:
    """Beside the backend's kernel objects (build.cache_dir: $FLASHOVERLAP_CACHE_DIR/cuda)."""
    from flashoverlap_backends.cuda import build as fob

    return fob.cache_dir().parent / "cutlass_ref"


def build(names, jobs: int) -> dict:
    """{name: path of its shared object}, built with nvcc where missing."""
    from flashoverlap_backends.cuda import build as fob

    nvcc = fob.nvcc_path()
    includes = fob.cutlass_include_dirs()
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)

    def one(name):
        tm, tn, cm, cn, pp, blk, epi_n, scalar = CONFIGS[name]
        flags = ["-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17",
                 "--expt-relaxed-constexpr", "-DNDEBUG", "-Xcompiler", "-fPIC", "-shared",
                 "--cudart=static", f"-DREF_NAME={name}", f"-DREF_TM={tm}", f"-DREF_TN={tn}",
                 f"-DREF_CM={cm}", f"-DREF_CN={cn}", f"-DREF_PINGPONG={pp}",
                 f"-DREF_BLOCKWISE={blk}", f"-DREF_EPI_N={epi_n}", f"-DREF_SCALAR={scalar}"]
        # named by the source and flags, so that a carried object is used wherever it matches
        digest = hashlib.sha256((SOURCE.read_text() + " ".join(flags)).encode()).hexdigest()[:12]
        so = out / f"{name}-{digest}.so"
        if so.is_file():
            return name, so
        cmd = ([nvcc] + flags + [f"-I{d}" for d in includes]
               + [str(SOURCE), "-o", str(so) + ".tmp"])
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"nvcc failed for {name}:\n{r.stderr[-4000:]}")
        os.replace(str(so) + ".tmp", so)
        return name, so

    with cf.ThreadPoolExecutor(max(1, jobs)) as pool:
        return dict(pool.map(one, names))


class RefGemm:
    """One configuration's object, prepared for one problem (its handle holds the arguments)."""

    def __init__(self, path: Path, name: str, a, w, sa, sb, out, swizzle: int, raster: int):
        import torch

        lib = ctypes.CDLL(str(path))
        sym = lambda s: getattr(lib, f"fo_ref_{name}_{s}")  # noqa: E731
        self.prepare, self.run_fn, self.free = sym("prepare"), sym("run"), sym("free")
        self.prepare.restype = ctypes.c_void_p
        self.prepare.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 + [ctypes.c_void_p]
        self.run_fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.free.argtypes = [ctypes.c_void_p]
        sym("error").restype = ctypes.c_char_p
        self.error = sym("error")
        self.stages, self.smem = sym("stages")(), sym("smem_bytes")()
        m, k = a.shape
        n = w.shape[0]
        self.keep = (a, w, sa, sb, out)
        sms = torch.cuda.get_device_properties(a.device).multi_processor_count
        self.handle = self.prepare(a.data_ptr(), w.data_ptr(), sa.data_ptr(), sb.data_ptr(),
                                   out.data_ptr(), m, n, k, swizzle, raster, sms,
                                   torch.cuda.current_stream().cuda_stream)
        if not self.handle:
            raise RuntimeError(f"{name}: {self.error().decode()}")
        self.out = out

    def __call__(self):
        import torch

        rc = self.run_fn(self.handle, torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"run: {self.error().decode()}")
        return self.out


def rel_err_rows(out, a, w, sa, sb, rows, scaling) -> float:
    """Relative error (max |d| / max |ref|) of the sampled rows against float64 of the
    dequantized inputs (bench/gemm.py's fp8_reference of those rows)."""
    from gemm import fp8_reference

    ref = fp8_reference(a[rows], w, sa[rows], sb, scaling)
    got = out[rows].double()
    return float((got - ref).abs().max() / ref.abs().max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="", help="default: every configuration of --scaling")
    p.add_argument("--scaling", default="rowwise", choices=("rowwise", "blockwise"))
    p.add_argument("--sets", default="facts,llm,ragged", help="bench/gemm.py's shape sets")
    p.add_argument("--shapes", default="", help="MxNxK,... instead of --sets")
    p.add_argument("--swizzle", type=int, default=1, help="CUTLASS max_swizzle_size")
    p.add_argument("--raster", type=int, default=0, help="0 heuristic, 1 along M, 2 along N")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--inner", type=int, default=10)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--no-product", action="store_true", help="skip FlashOverlap's product build")
    p.add_argument("--no-json", action="store_true")
    args = p.parse_args(argv)
    blockwise = args.scaling == "blockwise"
    names = [n for n in args.configs.split(",") if n] or [
        n for n, c in CONFIGS.items() if c[5] == blockwise]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    wrong = [n for n in names if CONFIGS[n][5] != blockwise]
    if wrong:
        raise SystemExit(f"--configs: {wrong} are not {args.scaling} configurations")
    objs = build(names, args.jobs)
    print("built:", ", ".join(str(v) for v in objs.values()), flush=True)
    if args.build_only:
        return 0

    import torch

    from common import stats, table, time_alternating, write_result
    from gemm import SETS, Gemm, Variant, blockwise_scaled_mm, fp8_inputs, scaled_mm

    if not torch.cuda.is_available():
        raise SystemExit("bench/cutlass_ref.py needs an sm_90 GPU to time (--build-only builds)")
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = [s for name in args.sets.split(",") for s in SETS[name]]
        shapes = list(dict.fromkeys(shapes))
    kernels = None
    if not args.no_product:
        from flashoverlap_backends.cuda import kernels
    rows, info = [], {}
    for shape in shapes:
        m, n, k = shape
        a, w, sa, sb = fp8_inputs(shape, args.scaling)
        if blockwise:
            baseline, baseline_name = blockwise_scaled_mm(a, w, sa, sb)
            # CUTLASS's layouts: scale_a M-contiguous (as fp8_inputs makes it), scale_b
            # [N/128, K/128] K-contiguous (sb is its transpose view)
            ref_sa, ref_sb = sa, sb.t()
        else:
            baseline, baseline_name = scaled_mm(a, w, sa, sb, True), "torch._scaled_mm"
            ref_sa, ref_sb = sa.reshape(-1).contiguous(), sb.reshape(-1).contiguous()
        fns = {"scaled_mm": baseline}
        errs = {}
        rows_idx = torch.randint(0, m, (64,), device="cuda")
        if kernels is not None:
            fns["product"] = Gemm(kernels, Variant("product", 90, None), a, w,
                                  "float8_e4m3fn", (sa, sb), args.scaling)
        for name in names:
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            try:
                g = RefGemm(objs[name], name, a, w, ref_sa, ref_sb, out, args.swizzle, args.raster)
            except RuntimeError as e:  # CUTLASS refused the problem: recorded, not timed
                errs[name] = f"refused: {e}"
                continue
            info[name] = {"stages": g.stages, "smem_bytes": g.smem, "tile": CONFIGS[name][:2],
                          "cluster": CONFIGS[name][2:4],
                          "schedule": "pingpong" if CONFIGS[name][4] else "cooperative",
                          "epilogue_tile_n": CONFIGS[name][6] or "auto",
                          "scalar_scales": bool(CONFIGS[name][7]),
                          "scaling": args.scaling}
            g()
            torch.cuda.synchronize()
            # a scalar build scales by scale_a[0] * scale_b[0]: its reference does the same
            esa, esb = ((ref_sa[0].expand_as(sa), ref_sb[0].expand_as(sb)) if CONFIGS[name][7]
                        else (sa, sb))
            errs[name] = round(rel_err_rows(out, a, w, esa, esb, rows_idx, args.scaling), 6)
            fns[name] = g
        base = fns["scaled_mm"]()
        errs["scaled_mm"] = round(rel_err_rows(base, a, w, sa, sb, rows_idx, args.scaling), 6)
        times = time_alternating(fns, args.reps, args.inner)
        row = {"M": m, "N": n, "K": k, "scaling": args.scaling, "baseline": baseline_name,
               "rel_err": errs}
        for fname, samples in times.items():
            st = stats(samples)
            row[f"{fname}_ms"] = round(st["median"], 5)
            row[f"{fname}_spread"] = [round(st["p10"], 5), round(st["p90"], 5)]
        for fname in fns:
            if fname != "scaled_mm":
                row[f"{fname}_vs_scaled_mm"] = round(row["scaled_mm_ms"] / row[f"{fname}_ms"], 3)
        rows.append(row)
        print(f"{m}x{n}x{k}: " + ", ".join(f"{f} {row[f'{f}_vs_scaled_mm']}" for f in fns
                                            if f != "scaled_mm") + f"; errors {errs}", flush=True)
        del fns, a, w, sa, sb
        torch.cuda.empty_cache()
    compared = (["product"] if kernels is not None else []) + names

    def ratios(f):
        return [r[f"{f}_vs_scaled_mm"] for r in rows if f"{f}_vs_scaled_mm" in r]

    summary = {f: {"min": min(ratios(f)), "median": round(statistics.median(ratios(f)), 3),
                   "rows": len(ratios(f))} for f in compared if ratios(f)}
    best = [max(r[f"{f}_vs_scaled_mm"] for f in names if f"{f}_vs_scaled_mm" in r)
            for r in rows if any(f"{f}_vs_scaled_mm" in r for f in names)]
    if best:
        summary["best_stock"] = {"min": min(best), "median": round(statistics.median(best), 3)}
    bad = {(r["M"], r["N"], r["K"], f): e for r in rows for f, e in r["rel_err"].items()
           if isinstance(e, float) and not e < 1e-2}
    if bad:
        print(f"WARNING: sampled rows' relative error >= 1e-2: {bad}")
    summary["max_rel_err"] = max((e for r in rows for e in r["rel_err"].values()
                                  if isinstance(e, float)), default=None)
    print(table(rows, ["M", "N", "K"] + [f"{f}_vs_scaled_mm" for f in compared]))
    print("summary:", json.dumps(summary))
    if not args.no_json:
        from common import device_tag

        write_result(f"cutlass-ref-{device_tag()}", rows, {"scaling": args.scaling,
            "summary": summary, "configs": info, "swizzle": args.swizzle, "raster": args.raster,
            "method": "CUDA-graph replays between events, kernels alternated, "
                      f"{args.reps} reps x{args.inner}; e4m3 inputs of bench/gemm.py --fp8 "
                      f"({args.scaling} scales), bf16 out, vs torch._scaled_mm fast accumulation "
                      "(block-wise: each row's baseline)"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
