"""The conformance suite's allgather cases fail against backends with the faults a consumer-side
(allgather) GEMM can have. Each backend below is the reference with one fault; the suite loads
it as ``test_allgather_broken:NAME`` (this directory is on PYTHONPATH in the child pytest)."""
import pytest
import torch

from flashoverlap_core.gather import GatherExchange, execute_tiles
from flashoverlap_core.reference import ReferenceBackend, accumulation_dtype
from flashoverlap_core.tile_trace import NoRecorder

from suite_runner import describe, run_suite, summary
from test_conformance_suite import CONFORMANCE_MESSAGE

pytestmark = pytest.mark.full  # faults: the full matrix (tests/conftest.py)


class FaultyGather(ReferenceBackend):
    """The reference's allgather execution with a faulty transport (``exchange``)."""

    exchange = GatherExchange

    def run(self, call):
        return execute_tiles(call, NoRecorder(), accumulation_dtype(call.a.dtype), self.exchange(call))


class LateExchange(GatherExchange):
    def start(self, g):
        pass  # launched late, in wait(g + 1)

    def wait(self, g):
        if g > 0:
            super().start(g - 1)
            super().wait(g - 1)


class ReadsBeforeArrival(FaultyGather):
    """Chunk g is gathered only after its tiles were computed, and waits do not wait: the GEMM
    reads each chunk before it lands (a load warp that ignores its arrival counter)."""

    name = "broken-gather-reads-before-arrival"
    exchange = LateExchange


class RotatedExchange(GatherExchange):
    def rows(self, source, start, end):
        w = self.call.world_size
        return super().rows(source if source == self.call.rank else (source + 1) % w, start, end)


class ShardsOutOfOrder(FaultyGather):
    """Another rank's rows are taken from the next rank's shard (blocks in the wrong order)."""

    name = "broken-gather-shards-out-of-order"
    exchange = RotatedExchange


class UnwrittenArrivingTile(ReferenceBackend):
    """The last tile that depends on the last chunk is never written."""

    name = "broken-gather-unwritten-tile"

    def run(self, call):
        out, call.out = call.out, torch.empty_like(call.out)
        done = super().run(call)
        skip = call.plan.arriving_tiles(call.rank, call.plan.num_groups - 1)[-1:]
        keep = torch.ones(done.shape, dtype=torch.bool)
        for t in skip:
            keep[t.row0:t.row0 + t.rows, t.col0:t.col0 + t.cols] = False
        out[keep.to(out.device)] = done[keep.to(done.device)]
        call.out = out
        return out


BROKEN = [("test_allgather_broken", "ReadsBeforeArrival"), ("test_allgather_broken", "ShardsOutOfOrder"),
          ("test_allgather_broken", "UnwrittenArrivingTile"), ("broken_backends", "StaleRepeat")]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("module, broken", BROKEN, ids=[b for _, b in BROKEN])
def test_broken_allgather_fails_the_suite(module, broken):
    result = run_suite(f"{module}:{broken}", "--fo-world-sizes", "1,2", "-k", "allgather",
                       "--maxfail", "2", timeout=540, fail_fast=True)
    assert result.returncode == 1, f"the suite did not fail as it must: {describe(result)}"
    assert summary(result).get("failed", 0) >= 1, describe(result)
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
    assert failed and all("allgather" in line for line in failed), describe(result)
    assert CONFORMANCE_MESSAGE.search(result.stdout), (
        f"the failures are not the suite's result checks: {describe(result)}")
