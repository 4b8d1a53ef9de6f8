"""flashoverlap_core names no vendor (docs/design.md, "Layers"): no cuda, npu, nccl, hccl or torch_npu in any
of its Python files, in code, strings or comments alike, with no exceptions.

cuda, nccl and hccl count anywhere, in any case. npu counts where it starts a word (after anything
but a letter, or as a capitalised part of a camel-case name), so ``torch_npu``, ``device='npu'``
and ``ProcessGroupNPU`` are caught while ``input`` (which holds the letters n-p-u) is not."""
import re
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "flashoverlap_core"
VENDOR = re.compile(r"(?i:cuda|nccl|hccl)|(?<![a-zA-Z])(?i:npu)|(?<=[a-z])NPU")


def test_core_names_no_vendor():
    files = sorted(CORE.rglob("*.py"))
    assert len(files) >= 10, f"expected the core's Python files under {CORE}"
    hits = [f"{path.relative_to(CORE.parent)}:{n}: {line.strip()}"
            for path in files
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if VENDOR.search(line)]
    assert not hits, "vendor names in flashoverlap_core:\n" + "\n".join(hits)


@pytest.mark.parametrize("text", ["torch.cuda.synchronize()", "x.is_cuda", "cudaStream_t s", "import torch_npu",
                                  "device='npu'", "ProcessGroupNPU", "NCCL", "ProcessGroupHCCL",
                                  "backend='nccl'", "Cuda"])
def test_the_check_catches(text):
    assert VENDOR.search(text)


@pytest.mark.parametrize("text", ["inputs", "input_split_sizes", "INPUT_SIZE"])
def test_the_check_ignores_ordinary_words(text):
    assert not VENDOR.search(text)
