"""Ranks that share devices (flashoverlap_core/tools/ranks.py): placement and the environment
each rank gets, read without a device; and a compiled graph is not reused across world sizes."""
from __future__ import annotations

import os
import re

import pytest
import torch

from flashoverlap_core.tools import ranks
from flashoverlap_core.tools.ranks import RankPool


def test_host_ranks_have_no_devices():
    topo = ranks.topology(3, "cpu", shared_devices=False)
    assert topo["devices"] == [None] * 3 and topo["env"] == [{}, {}, {}]


def test_more_ranks_than_devices_need_shared_devices(monkeypatch):
    monkeypatch.setattr(ranks, "device_count", lambda device_type: 1)
    with pytest.raises(ValueError, match="share devices"):
        ranks.topology(2, "cuda", shared_devices=False)
    topo = ranks.topology(3, "cuda", shared_devices=True)
    assert topo["devices"] == [0, 0, 0] and topo["shared_devices"]
    hosts = [env["NCCL_HOSTID"] for env in topo["env"]]
    assert len(set(hosts)) == 3, hosts  # NCCL's duplicate-GPU check compares host hashes
    for env in topo["env"]:
        assert env["NCCL_SOCKET_IFNAME"] == "lo" and env["NCCL_IB_DISABLE"] == "1"
        assert env["NCCL_NVLS_ENABLE"] == "0"
    monkeypatch.setattr(ranks, "device_count", lambda device_type: 2)
    assert ranks.topology(4, "cuda", shared_devices=True)["devices"] == [0, 1, 0, 1]
    assert ranks.topology(2, "cuda", shared_devices=False)["env"] == [{}, {}]


def test_the_environment_variable_sets_the_default(monkeypatch):
    monkeypatch.setenv(ranks.ENV_SHARED_DEVICES, "1")
    assert ranks.shared_devices_default() is True
    monkeypatch.setenv(ranks.ENV_SHARED_DEVICES, "0")
    assert ranks.shared_devices_default() is False
    monkeypatch.setenv(ranks.ENV_SHARED_DEVICES, "maybe")
    with pytest.raises(ValueError, match="must be 1 or 0"):
        ranks.shared_devices_default()


def _env_of(name):
    return os.environ.get(name)


def test_a_none_value_unsets_the_parents_variable(monkeypatch):
    monkeypatch.setenv("FO_TEST_SET_BY_PARENT", "parent")
    with RankPool(1, env={"FO_TEST_SET_BY_PARENT": None, "FO_TEST_SET_HERE": "pool"},
                  timeout=120) as pool:
        assert pool.run(_env_of, "FO_TEST_SET_BY_PARENT") == [None]
        assert pool.run(_env_of, "FO_TEST_SET_HERE") == ["pool"]


def _compiled_reduce_scatter(cache_dir, seed):
    """A compiled reduce_scatter under a compile cache shared with another world size."""
    import torch.distributed as dist

    import flashoverlap_core as fo
    from flashoverlap_core import api

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    api.forget_prepared()
    rank, world = dist.get_rank(), dist.get_world_size()
    m = 12  # divisible by 2 and 3
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(8, 5, generator=g)
    a_all = [torch.randn(m, 8, generator=torch.Generator().manual_seed(seed + r))
             for r in range(world)]
    graphs = []

    def capture(gm, inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    fn = lambda a, b: fo.overlap(a, b, "reduce_scatter", backend="reference")  # noqa: E731
    traced = torch.compile(fn, fullgraph=True, backend=capture)(a_all[rank], b)
    out = torch.compile(fn, fullgraph=True)(a_all[rank], b)  # inductor, with its disk caches
    rows = m // world
    want = (sum(x.double() for x in a_all) @ b.double())[rank * rows:(rank + 1) * rows]
    return {"shape": tuple(out.shape), "error": float((out.double() - want).abs().max()),
            "traced_error": float((traced.double() - want).abs().max()),
            "size_in_graph": re.search(r"reduce_scatter\.default\]\(args = \([^)]*, (\d+)\)",
                                       graphs[0]).group(1) == str(world),
            "graph": graphs[0]}


@pytest.mark.full
def test_a_graph_compiled_at_one_world_size_is_not_reused_at_another(tmp_path):
    """Two world sizes one after the other, sharing one compile cache directory: the op's
    group size is an argument of the graph (torch's functional collectives do the same)."""
    for world in (3, 2):
        with RankPool(world, timeout=300) as pool:
            results = pool.run(_compiled_reduce_scatter, str(tmp_path / "inductor"), 5)
        for r in results:
            assert r["size_in_graph"], r["graph"]
            assert r["shape"] == (12 // world, 5), (world, r)
            assert r["error"] < 1e-4 and r["traced_error"] < 1e-4, (world, r)
