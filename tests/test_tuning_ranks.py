"""The tuner's per-rank model building works for every collective at world size 2 (the
GEMM-only plan must not carry reduce_scatter's output shape or all_to_all's splits)."""
import pytest

from flashoverlap_core.tools.ranks import RankPool
from flashoverlap_core.tuning.tuner import Job, ModelParts, build_model


@pytest.mark.timeout(300)
def test_build_model_for_every_collective_on_two_ranks(tmp_path):
    with RankPool(2, timeout=240) as pool:
        for op in ("reduce_scatter", "all_to_all", "allreduce"):
            job = Job(256, 128, 64, op, "float32", "reference", iters=2, warmup=1, trace_reps=1)
            parts = pool.run(build_model, job, str(tmp_path / "cache.json"), True)
            assert all(isinstance(p, ModelParts) for p in parts), op
            assert parts[0] == parts[1], f"{op}: the ranks built different models"
