"""bench/common.py's device_tag: result file names carry the GPU's model, not a memory type."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def common():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("fo_bench_common", ROOT / "bench" / "common.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.mark.parametrize("name, tag", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA GeForce RTX 4090", "4090"),
])
def test_device_tag_is_the_model(common, name, tag):
    assert common.device_tag(name) == tag
