"""bench/ncu_source.py: the per-instruction stall extract of Nsight Compute's source page, on
a CSV written here in that page's form (two kernels, a column ncu names per stall reason)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("ncu_source", ROOT / "bench" / "ncu_source.py")
ncu_source = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_source)

HEADER = ('"# Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed",'
          '"stall_barrier","stall_long_sb"')


def test_two_kernels(tmp_path):
    csv = tmp_path / "source.csv"
    csv.write_text("\n".join([
        '"signaling_gemm"', HEADER,
        '"0x0010","FMUL R1, R2, R3","10","8","1,024","2","6"',
        '"0x0020","QGMMA.64x128x32.F32.E4M3.E4M3 R24","30","20","512","25","0"',
        '"nvjet_sm90"', HEADER,
        '"0x0010","LDS R1, [R2]","5","4","100","0","4"']) + "\n")
    out = tmp_path / "extract.json"
    assert ncu_source.main([str(csv), "--json", str(out), "--top", "5"]) == 0
    kernels = json.loads(out.read_text())["kernels"]
    assert [k["kernel"] for k in kernels] == ["signaling_gemm", "nvjet_sm90"]
    ours = kernels[0]
    assert ours["samples"] == 40 and ours["instructions"] == 2
    assert ours["stall_share_pct"] == {"barrier": round(100 * 27 / 33, 2),
                                       "long_sb": round(100 * 6 / 33, 2)}
    top = ours["top_instructions"][0]
    assert top["offset"] == "0x0020" and top["samples_pct"] == 75.0
    assert top["stalls"] == {"barrier": 25.0}
    assert ours["top_instructions"][1]["executed"] == "1,024"
    assert kernels[1]["stall_share_pct"] == {"long_sb": 100.0}


def test_no_table(tmp_path):
    csv = tmp_path / "empty.csv"
    csv.write_text("==ERROR== no kernels\n")
    assert ncu_source.main([str(csv)]) == 1
