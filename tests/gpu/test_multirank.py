"""The cuda backend at world size > 1 on the GPUs there are, ranks sharing them (the test
topology of flashoverlap_core/tools/ranks.py: each rank its own NCCL host id, NCCL's socket
transport on loopback). It checks correctness only; nothing here is timed.

World sizes: ``FO_MULTIRANK_WORLD_SIZES`` (default 2,4). Every rank call runs under the pool's
timeout and every test under pytest-timeout: a hang is a failure. The ranks of every world
size share one torch.compile cache directory, so a graph compiled at one world size and reused
at another fails the compile test. Skips without the cuda backend (fails under
FLASHOVERLAP_REQUIRE_HW=1).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import multirank_work as work
from flashoverlap_core.tools.ranks import RankError, RankTimeout, Ranks
from test_cuda import needs_cuda

pytestmark = [pytest.mark.timeout(900), needs_cuda]
WORLD_SIZES = [int(w) for w in os.environ.get("FO_MULTIRANK_WORLD_SIZES", "2,4").split(",")]
CALL_TIMEOUT = 300.0
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compile_cache():
    with tempfile.TemporaryDirectory(prefix="fo-multirank-inductor-") as d:
        yield d


@pytest.fixture(scope="module")
def pools(compile_cache):
    made: dict = {}

    def get(world: int) -> Ranks:
        if world not in made:
            env = {**MULTICAST_OFF, "TORCHINDUCTOR_CACHE_DIR": compile_cache,
                   "FLASHOVERLAP_BACKEND": None, "FLASHOVERLAP_TUNING_CACHE": "off",
                   "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent)] + sys.path)}
            made[world] = Ranks(world, "cuda", env=env, timeout=CALL_TIMEOUT, pg_timeout=120.0,
                                shared_devices=True)
        return made[world]

    yield get
    for ranks in made.values():
        ranks.close(kill=True)


def run(pools, world: int, fn, *args, timeout: float = CALL_TIMEOUT):
    try:
        return pools(world).run(fn, *args, timeout=timeout)
    except (RankError, RankTimeout) as e:
        pytest.fail(f"{type(e).__name__}: {e}", pytrace=False)


def no_problems(results, what: str):
    bad = {r: res["problems"] for r, res in enumerate(results) if res["problems"]}
    assert not bad, f"{what}: " + "; ".join(f"rank {r}: {p}" for r, p in bad.items())


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_op_with_per_rank_inputs(pools, world):
    results = run(pools, world, work.every_op, 11 + world, "cuda")
    no_problems(results, "every op")
    ran = [r["ran"] for r in results]
    assert all(r == ran[0] for r in ran), f"the ranks ran different backends: {ran}"
    for op in work.OPS:
        assert ran[0][op] == ["cuda"], ran[0]
    # skewed splits (a rank without rows at times), automatic choice: the signaling GEMM
    assert ran[0]["all_to_all-skewed-default"] == ["cuda"], ran[0]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_narrow_tiles_with_per_rank_inputs(pools, world):
    """The 128x224 and 128x160 kernels at W > 1: explicit plans (overlapped, whatever the
    strategy model would say), "rows" and "tiles" layouts, every rank's own inputs."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("sm_90a kernels need Hopper")
    results = run(pools, world, work.narrow_tiles, 17 + world)
    no_problems(results, "narrow tiles")
    assert all(r["layouts"] == ["rows", "tiles"] for r in results), results


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_moe_sequence_on_the_signaling_gemm(pools, world):
    results = run(pools, world, work.moe_sequence, 41 + world, 24, None)
    no_problems(results, "MoE sequence")
    for r in results:
        assert r["backends"] == ["cuda"] and r["keys"] == 1, results


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_moe_sequence_on_the_plain_path(pools, world):
    """The plain path's all_to_all on the backend's own communicator (fo_nccl_all_to_all):
    skewed splits with zeros, a rank without rows at times, recv_splits given or exchanged."""
    results = run(pools, world, work.moe_sequence_plain, 47 + world, 16)
    no_problems(results, "plain-path MoE sequence")
    for r in results:
        assert (r["strategy"], r["native_all_to_all"], r["keys"]) == (
            "sequential", "PlainCollectives", 1), results


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_moe_sequence_on_the_scaled_gemm(pools, world, scaling):
    """fp8 all_to_all (issue 32): skewed splits with zeros, each rank's scales of its own rows,
    on cuda's scaled GEMM over unequal destination blocks (multirank_work.fp8_moe_sequence)."""
    results = run(pools, world, work.fp8_moe_sequence, 43 + world, 16, scaling)
    no_problems(results, f"fp8 {scaling} MoE sequence")
    for r in results:
        assert (r["backends"], r["runners"], r["keys"]) == (["cuda"], ["AllToAllCall"], 1), results


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "rowwise-a", "blockwise"])
def test_fp8_allgather_with_each_ranks_scales(pools, world, scaling):
    """fp8 allgather (issue 32): every rank's shard with its own scale_a (tensor-wise ones that
    differ by rank), a flag per band, on cuda's waiting GEMM with scales: the e4m3 rows and the
    scales gathered (multirank_work.fp8_allgather_sequence)."""
    results = run(pools, world, work.fp8_allgather_sequence, 47 + world, 12, scaling)
    no_problems(results, f"fp8 {scaling} allgather")
    for r in results:
        assert (r["backends"], r["runners"], r["keys"]) == (["cuda"], ["CudaGatherCall"], 1), results
        assert r["chunks"] > 1 and r["stock"] == [False], results


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_allgather_on_cutlass_kernel_waits_for_each_ranks_rows(pools, world, scaling):
    """The same sequence with shards of whole row tiles (256 rows): CUTLASS's kernel, whose
    producer warp waits for each band's flag (gemm_sm90_stock_ex_scaled.cu), on every rank."""
    results = run(pools, world, work.fp8_allgather_sequence, 53 + world, 12, scaling, 256)
    no_problems(results, f"fp8 {scaling} allgather, 256-row shards")
    for r in results:
        assert (r["runners"], r["keys"], r["stock"]) == (["CudaGatherCall"], 1, [True]), results
        assert r["chunks"] > 1, results


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_200_back_to_back_mixed_calls(pools, world):
    results = run(pools, world, work.back_to_back, 5, 200, "cuda")
    no_problems(results, "back-to-back")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_two_streams(pools, world):
    no_problems(run(pools, world, work.two_streams, 3, 20, "cuda"), "two streams")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_first_call_in_capture_then_graph_replays(pools, world):
    results = run(pools, world, work.graph_capture, 17, 5, "cuda")
    no_problems(results, "graph replays")
    for r in results:
        assert r["first_call_error"] and "captured" in r["first_call_error"], r
        assert r["backends"] == ["cuda"], r


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ranks_with_their_own_outputs_launch_collectives_alike(pools, world):
    results = run(pools, world, work.rank_own_outputs, 23 + world, 24)
    no_problems(results, "outputs of each rank's own")
    assert all(r["layout"] == "rows" for r in results), results
    assert results[0]["held"] == 1, results  # rank 0: one out, one graph
    for r in results[1:]:  # a graph per out used, of the last 8
        assert r["held"] == min(r["outs"], 8), results


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_rank0_decides_the_capture_twin_for_its_group(pools, world):
    """Ranks whose FLASHOVERLAP_NCCL_CAPTURE_COMM differ make the same communicators for a new
    group (rank 0's choice travels with the ids): with rank 0 at 1 every rank has a twin, at 0
    none, and the group's calls (launches, then graph replays) are right either way."""
    results = run(pools, world, work.twins_follow_rank0, 29 + world, 4)
    no_problems(results, "a group whose ranks' twin settings differ")
    for r in results:
        if r["twins"][0] is not None:
            assert r["twins"] == [1, 0], results


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_compile_reduce_overhead_sharing_one_cache(pools, world):
    no_problems(run(pools, world, work.compiled_block, 23, 4, "cuda", timeout=600.0),
                "torch.compile reduce-overhead")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_nn_layers_forward_backward(pools, world):
    results = run(pools, world, work.nn_layers, 29, "cuda")
    no_problems(results, "fo.nn layers")
    assert all(r["backends"] == ["cuda"] for r in results), results


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_e2e_mlp_block_against_float64(world, tmp_path):
    env = {**os.environ, **MULTICAST_OFF, "FO_RESULTS_DIR": str(tmp_path),
           "FLASHOVERLAP_TUNING_CACHE": "off"}
    cmd = [sys.executable, str(ROOT / "bench" / "e2e_mlp.py"), "--world-size", str(world),
           "--shared-devices", "--shapes", f"{256 * world}x512x{512 * world}", "--iters", "2",
           "--timeout", "400"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, f"{' '.join(cmd)}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert list(tmp_path.glob("e2e-mlp-*.json")), done.stdout[-2000:]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ranks_with_different_tuning_caches_get_a_clear_error(pools, world, tmp_path):
    messages = run(pools, world, work.tuned_on_rank0, str(tmp_path))
    for m in messages:
        assert "do not run the same plan" in m, messages


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_rank_chooses_the_same_strategy(pools, world, tmp_path):
    """FLASHOVERLAP_STRATEGY=auto, each rank its own tuning cache (then one rank without), rows
    of decode and prefill size, all_to_all splits that differ by rank: every rank makes the
    same choice on every call, and every result is right."""
    results = run(pools, world, work.strategies_with_own_caches, 41, str(tmp_path), "cuda")
    no_problems(results, "strategy auto")
    chosen = [[c[:4] for c in r["chosen"]] for r in results]
    assert all(c == chosen[0] for c in chosen), (
        "the ranks chose differently:\n" + "\n".join(f"rank {r}: {c}" for r, c in enumerate(chosen)))
    assert {c[3] for c in chosen[0]} <= {"overlap", "sequential"}, chosen[0]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_an_error_in_one_ranks_first_call_is_raised_on_every_rank(pools, world):
    messages = run(pools, world, work.first_call_error_on_one_rank, 31, "cuda")
    for m in messages:
        assert "do not run the same plan" in m, messages


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_rank_raising_mid_run_fails_the_others_within_the_timeout(pools, world):
    """Rank W-1 raises between calls while the others go on calling: the others are stuck in a
    collective that rank W-1 never joins. The pool reports rank W-1's error and ends the
    others within its grace period (10 s), not at the call timeout."""
    began = time.monotonic()
    with pytest.raises(RankError) as info:
        pools(world).run(work.raise_mid_run, 37, world - 1, 3, 50, "cuda", timeout=CALL_TIMEOUT)
    elapsed = time.monotonic() - began
    assert "injected failure on rank" in str(info.value), str(info.value)[-2000:]
    assert elapsed < 60, f"the failure took {elapsed:.0f} s to surface"
