"""The ``ascend`` backend: everything that runs without an NPU runs here for real (probe
reasons, option validation, the CANN symbol lookup, the stream and counter-wait plumbing on
the host's stream shim); tests marked ``npu`` need torch_npu and an NPU and skip with the
probe's reason otherwise (``FLASHOVERLAP_REQUIRE_HW=1`` makes that a failure, as in the
conformance suite).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.machinery
import importlib.util
import os
import sys
import types

import pytest
import torch

import flashoverlap_core as fo
from flashoverlap_core import registry
from flashoverlap_core.backend import OverlapCall
from flashoverlap_core.decomposition import DecompositionBackend, EventSignals, HostStreams
from flashoverlap_core.tools.ranks import RankPool
from flashoverlap_backends.ascend import AscendBackend, environment
from flashoverlap_backends.ascend.acl import (AclUnavailable, AclValueOps, MonotonicCounter,
                                              ValueSignals)
from flashoverlap_backends.ascend.options import (ENV_WAIT, WAIT_MODES, parse_wait_mode,
                                                 wait_mode_from_env)

HAVE_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


# ---- discovery -------------------------------------------------------------------------------
@pytest.mark.skipif(HAVE_TORCH_NPU, reason="torch_npu is installed here")
def test_backends_report_ascend_unavailable_without_torch_npu():
    status = {s.name: s for s in fo.backends()}["ascend"]
    assert (status.device_type, status.available) == ("npu", False)
    assert status.reason == "torch_npu is not installed (pip install flashoverlap[ascend])"
    assert "torch_npu" not in sys.modules  # probing imported nothing
    assert AscendBackend().versions() == {} and AscendBackend().device_count() == 0


class FakeTorchNpu(types.ModuleType):
    """A stand-in torch_npu: how many NPUs it sees, or that importing it fails."""

    def __init__(self, npus: int):
        super().__init__("torch_npu")
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        self.__version__ = "2.5.1.fake"
        self.npu = types.SimpleNamespace(device_count=lambda: npus)


@pytest.fixture
def fake_torch_npu(monkeypatch):
    """Install a FakeTorchNpu (or, with npus=None, a torch_npu that fails to import)."""
    def install(npus: int | None):
        module = FakeTorchNpu(npus or 0)
        monkeypatch.setattr(environment.importlib.util, "find_spec",
                            lambda name, *a: module.__spec__ if name == "torch_npu" else None)
        if npus is None:
            def broken(name, *a):
                raise ImportError("libhccl.so: cannot open shared object file")
            monkeypatch.setattr(environment.importlib, "import_module", broken)
        else:
            monkeypatch.setitem(sys.modules, "torch_npu", module)
        environment.probe_reason.cache_clear()
        return module
    yield install
    environment.probe_reason.cache_clear()


def test_probe_and_device_count_follow_what_torch_npu_sees(fake_torch_npu, monkeypatch):
    fake_torch_npu(2)
    assert AscendBackend().probe() is None and AscendBackend().device_count() == 2

    monkeypatch.setenv(environment.VISIBLE_DEVICES, "")
    fake_torch_npu(0)
    reason = AscendBackend().probe()
    assert reason == ("torch_npu sees no NPU with ASCEND_RT_VISIBLE_DEVICES='' "
                      "(torch_npu.npu.device_count() == 0)")
    assert AscendBackend().device_count() == 0


def test_a_torch_npu_that_does_not_import_says_what_to_check(fake_torch_npu):
    fake_torch_npu(None)
    reason = AscendBackend().probe()
    assert reason.startswith("torch_npu is installed but does not import (ImportError: libhccl")
    assert "set_env.sh" in reason and AscendBackend().device_count() == 0


def test_versions_name_torch_npu_cann_and_hccl(fake_torch_npu, monkeypatch):
    module = fake_torch_npu(1)
    utils = types.ModuleType("torch_npu.utils")
    utils.get_cann_version = lambda module="CANN": {"CANN": "8.2.RC1", "HCCL": "8.2.3"}[module]
    monkeypatch.setitem(sys.modules, "torch_npu.utils", utils)
    assert AscendBackend().versions() == {"torch_npu": module.__version__, "cann": "8.2.RC1",
                                          "hccl": "8.2.3"}
    monkeypatch.delitem(sys.modules, "torch_npu.utils")  # torch_npu < 2.5: no get_cann_version
    monkeypatch.setattr(module, "utils", None, raising=False)
    versions = AscendBackend().versions()
    assert versions["cann"].startswith("unknown (needs torch_npu.utils.get_cann_version")


def test_asking_for_ascend_by_name_lists_every_backend_with_its_reason():
    reason = AscendBackend().probe()
    if reason is None:
        pytest.skip("an NPU is available here")
    with pytest.raises(fo.BackendError, match="unavailable") as e:
        registry.get("ascend")
    assert reason in str(e.value) and "decomposition" in str(e.value)


def test_npu_tensors_prefer_ascend_then_generic_backends():
    order = [b.name for b in registry.candidates("npu")]
    assert order.index("ascend") < order.index("decomposition") < order.index("reference")
    assert "ascend" not in [b.name for b in registry.candidates("cpu")]


# ---- options ---------------------------------------------------------------------------------
@pytest.mark.parametrize("given, mode",
                         [("event", "event"), ("value", "value"), (" Value ", "value")])
def test_wait_modes_parse(given, mode):
    assert parse_wait_mode(given) == mode


def test_bad_wait_modes_say_what_is_accepted():
    with pytest.raises(ValueError, match=r"one of \('event', 'value'\), got 'spin'"):
        parse_wait_mode("spin")
    with pytest.raises(TypeError, match="got int"):
        parse_wait_mode(1)
    with pytest.raises(ValueError, match=ENV_WAIT):
        wait_mode_from_env({ENV_WAIT: "stream_wait_value"})
    with pytest.raises(ValueError, match="got 'later'"):
        AscendBackend(wait="later")


def test_wait_mode_defaults_to_event_and_reads_the_environment(monkeypatch):
    assert wait_mode_from_env({}) == wait_mode_from_env({ENV_WAIT: ""}) == "event"
    assert wait_mode_from_env({ENV_WAIT: "value"}) == "value"
    monkeypatch.delenv(ENV_WAIT, raising=False)
    assert AscendBackend().wait == "event"
    monkeypatch.setenv(ENV_WAIT, "value")
    assert AscendBackend().wait == "value"
    assert AscendBackend(wait="event").wait == "event"  # the argument wins over the environment


# ---- the CANN lookup -------------------------------------------------------------------------
def test_missing_cann_runtime_is_a_clear_error():
    with pytest.raises(AclUnavailable, match="set_env.sh"):
        AclValueOps("libascendcl-not-here.so")


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library found by ctypes")
def test_runtime_without_value_wait_names_the_cann_version_it_needs():
    # A real library that lacks the symbols, as libascendcl.so of CANN < 8.2 does.
    with pytest.raises(AclUnavailable, match=r"aclrtValueWrite or aclrtValueWait.*CANN >= 8\.2"):
        AclValueOps(ctypes.util.find_library("c"))


def test_value_wait_without_cann_is_refused_before_any_device_work():
    backend = AscendBackend(wait="value")
    if backend.value_ops() is not None:
        pytest.skip("this CANN has aclrtValueWait")
    spec = fo.OverlapSpec(64, 64, 64, "allreduce", 1, "bfloat16", "npu")
    [reason] = backend.unsupported_reasons(spec)
    assert "libascendcl.so" in reason
    assert AscendBackend(wait="event").unsupported_reasons(spec) == []
    with pytest.raises(AclUnavailable):
        backend.signals(HostStreams(), None)


# ---- the stream and wait plumbing on the host's stream shim -----------------------------------
class NamedStreams(HostStreams):
    """The host shim with names for its streams, to see which stream each operation targets."""

    compute, comm = "compute", "comm"


class HostCounterOps:
    """aclrtValueWrite/aclrtValueWait's documented semantics on host memory. On the host a
    stream runs as it is issued, so a wait the counter does not satisfy yet would never end."""

    def __init__(self):
        self.log = []

    def write(self, address, value, stream):
        ctypes.c_int64.from_address(address).value = value
        self.log.append(("write", value, stream))

    def wait(self, address, value, stream):
        current = ctypes.c_int64.from_address(address).value
        assert current - value >= 0, f"wait for {value} issued with the counter at {current}"
        self.log.append(("wait", value, stream))


class HostValueBackend(DecompositionBackend):
    """The decomposition strategy with the ascend backend's counter signals, on the host."""

    def __init__(self):
        self.ops = HostCounterOps()
        self.counter = MonotonicCounter(torch.zeros(1, dtype=torch.int64))

    def streams(self, device):
        return NamedStreams()

    def signals(self, streams, call):
        return ValueSignals(streams, self.ops, self.counter, call.plan.num_groups)


def one_rank_call(plan, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(plan.m, plan.k, generator=gen).to(dtype)
    b = torch.randn(plan.n, plan.k, generator=gen).to(dtype).t()
    out = torch.empty(plan.m, plan.n, dtype=dtype)
    return OverlapCall(a, b, plan, plan.op, None, 0, 1, out), a.double() @ b.double()


def test_counter_signals_go_compute_then_comm_and_grow_across_calls():
    backend = HostValueBackend()
    plans = [fo.Plan(40, 24, 8, "allreduce", 1, "float32", (8, 8), 2, (5, 4, 6)),
             fo.Plan(33, 17, 5, "allreduce", 1, "float32", (16, 8), 1, (4, 5))]
    for i, plan in enumerate(plans * 2):
        call, want = one_rank_call(plan, seed=i)
        torch.testing.assert_close(backend.run(call).double(), want, rtol=1e-5, atol=1e-5)
    values = [v for kind, v, _ in backend.ops.log if kind == "write"]
    assert values == list(range(1, 3 + 2 + 3 + 2 + 1))  # one value per group, never reused
    expected = []
    for v in values:
        expected += [("write", v, "compute"), ("wait", v, "comm")]
    assert backend.ops.log == expected


def test_ascend_backend_runs_its_event_path_on_the_host_shim():
    backend = AscendBackend(wait="event")
    call, want = one_rank_call(fo.Plan(50, 30, 7, "custom", 1, "bfloat16", (16, 16), 2, (3, 5)),
                               torch.bfloat16)
    assert isinstance(backend.signals(HostStreams(), call), EventSignals)
    regions = []
    call.op = lambda region, g: regions.append(g)
    torch.testing.assert_close(backend.run(call).double(), want, rtol=2e-2, atol=2e-2)
    assert regions == [0, 1]


# ---- on an NPU -------------------------------------------------------------------------------
@pytest.fixture
def npu():
    reason = AscendBackend().probe()
    if reason is not None:
        if os.environ.get("FLASHOVERLAP_REQUIRE_HW", "") not in ("", "0"):
            pytest.fail(f"FLASHOVERLAP_REQUIRE_HW=1, but the ascend backend is unavailable: "
                        f"{reason}")
        pytest.skip(reason)
    return torch.device("npu", 0)


def npu_allreduce_check(wait: str, op: str = "allreduce", m=1000, n=768, k=512):
    """On one rank of an HCCL group (or alone): overlap() on the NPU against float64."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = torch.device("npu", rank)
    cs, mine = [], None
    for r in range(world):
        gen = torch.Generator().manual_seed(1000 + r)
        a = torch.randn(m, k, generator=gen, dtype=torch.float64)
        b = torch.randn(n, k, generator=gen, dtype=torch.float64).t() / k ** 0.5
        cs.append(a @ b)
        if r == rank:
            mine = (a.to(device, torch.bfloat16), b.to(device, torch.bfloat16))
    fo.register(AscendBackend(wait=wait))
    try:
        for _ in range(3):  # back to back: counters and events must not leak between calls
            got = fo.overlap(*mine, op, backend="ascend").double().cpu()
    finally:
        fo.register(AscendBackend())
    want = sum(cs) if op == "allreduce" else sum(cs)[rank * m // world:(rank + 1) * m // world]
    error = (got - want).abs().max().item() / (want.abs().max().item() + 1)
    assert error < 3e-2, f"{op} wait={wait}: relative error {error}"
    return error


@pytest.mark.npu
@pytest.mark.parametrize("wait", WAIT_MODES)
def test_npu_one_device(npu, wait):
    if wait == "value" and AscendBackend(wait="value").value_ops() is None:
        pytest.skip("this CANN has no aclrtValueWait (needs CANN >= 8.2)")
    npu_allreduce_check(wait)


@pytest.mark.npu
@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter"])
def test_npu_two_devices_hccl(npu, op):
    if environment.device_count() < 2:
        pytest.skip("needs 2 NPUs")
    with RankPool(2, "npu", timeout=300) as pool:
        pool.run(npu_allreduce_check, "event", op)
