"""pytest plugin of the conformance suite (registered through the ``pytest11`` entry point).

It adds the ``--fo-*`` options, prints the backend and the seed in the header, and provides the
fixtures the suite's tests use: the backend under test and the spawned rank pools. It is loaded
by every pytest run in an environment where flashoverlap is installed, so loading it must stay
cheap and harmless: nothing is resolved until a test of the suite asks for it.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from functools import cached_property

import pytest

ENV_REQUIRE_HW = "FLASHOVERLAP_REQUIRE_HW"
DEFAULT_TIMEOUT = 120.0  # seconds one rank call may take before it counts as a hang
HOST_WORLD_SIZES = (1, 2, 3, 4)
MAX_DEVICE_WORLD_SIZE = 4


def pytest_addoption(parser):
    group = parser.getgroup("flashoverlap", "FlashOverlap conformance suite")
    group.addoption("--fo-backend", default=None, metavar="NAME",
                    help="backend under test: a registered name or module:attr "
                         "(default: $FLASHOVERLAP_BACKEND, else reference)")
    group.addoption("--fo-world-sizes", default=None, metavar="LIST",
                    help="comma-separated world sizes for spawned ranks (default: 1,2,3,4 on the "
                         f"host; 1..min({MAX_DEVICE_WORLD_SIZE}, device count) on an accelerator)")
    group.addoption("--fo-seed", type=int, default=None, metavar="INT",
                    help="base seed of every random input (default: fresh each run, printed in "
                         "the header)")
    group.addoption("--fo-shared-devices", action="store_true", default=None,
                    help="ranks share devices (rank r on device r mod count, so world sizes may "
                         "exceed the device count; each rank gets the environment its backend "
                         "says such ranks need): a correctness-only test topology (default: "
                         "$FLASHOVERLAP_SHARED_DEVICES)")
    group.addoption("--fo-timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                    help="seconds a spawned rank may take for one call before it counts as a hang "
                         f"(default {DEFAULT_TIMEOUT:.0f})")


STRATEGY_ENV = "FLASHOVERLAP_STRATEGY"


def pytest_configure(config):
    # The suite holds a backend's overlapped path to the semantics, so its calls overlap
    # whatever the default strategy choice would do (at world size 1 it runs the plain path);
    # a run may still ask for another strategy. The choice itself has tests of its own.
    os.environ.setdefault(STRATEGY_ENV, "overlap")
    config.stash[_SETTINGS] = Settings(config)
    config.addinivalue_line("markers", "fo_ranks: a conformance test that runs on spawned ranks")
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): per-test timeout (pytest-timeout)")


def pytest_report_header(config):
    """The backend and the seed, when the run names the suite or a backend to test."""
    if config.getoption("fo_backend") or any("flashoverlap_core" in str(a) for a in config.args):
        return settings(config).banner()
    return None


def pytest_terminal_summary(terminalreporter, config):
    """The banner again at the end (the header is not shown under -q)."""
    s = settings(config)
    if s.in_use:
        terminalreporter.write_line(s.banner())


def pytest_collection_modifyitems(config, items):
    """Every test that runs the backend gets a pytest-timeout deadline; on spawned ranks it is
    above the ranks' own, so that RankTimeout (the pool killed) normally fires first."""
    s = settings(config)
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        s.in_use = s.in_use or "fo_settings" in fixtures
        if "_fo_pool_set" in fixtures:
            item.add_marker(pytest.mark.fo_ranks)
        if item.get_closest_marker("timeout") is None and {"_fo_pool_set", "fo_backend"} & set(fixtures):
            item.add_marker(pytest.mark.timeout(3 * s.timeout + 60))


_SETTINGS = pytest.StashKey["Settings"]()


def settings(config) -> "Settings":
    """The suite's settings for this pytest run."""
    try:
        return config.stash[_SETTINGS]
    except KeyError:
        raise pytest.UsageError(
            "the flashoverlap pytest plugin is not loaded: install the package (pip install -e .) "
            "or run pytest with -p flashoverlap_core.testing.plugin") from None


def require_hw() -> bool:
    return os.environ.get(ENV_REQUIRE_HW, "") not in ("", "0")


def skip_unavailable(reason: str):
    """Skip because the backend or its hardware is missing; a failure under FLASHOVERLAP_REQUIRE_HW=1."""
    if require_hw():
        pytest.fail(f"{ENV_REQUIRE_HW}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@dataclass(frozen=True)
class Target:
    """Where the ranks' tensors live for the backend under test."""

    backend_name: str | None  # None: the automatic choice (no backend=)
    device_type: str  # torch device type of the tensors ("cpu" for a device-generic backend)

    def device(self, rank: int):
        """This rank's device: the one its pool placed it on (rank r on device r, or r mod
        the device count when ranks share devices), which is the current device there."""
        import torch

        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type,
                            torch.get_device_module(self.device_type).current_device())


class Settings:
    """Options of one pytest run, resolved lazily (only when a test of the suite needs them)."""

    def __init__(self, config):
        self.backend_name = (config.getoption("fo_backend") or os.environ.get("FLASHOVERLAP_BACKEND")
                             or "reference")
        seed = config.getoption("fo_seed")
        self.seed = seed if seed is not None else secrets.randbits(31)
        self.timeout = config.getoption("fo_timeout")
        self._world_sizes = config.getoption("fo_world_sizes")
        shared = config.getoption("fo_shared_devices")
        if shared is None:
            from flashoverlap_core.tools.ranks import shared_devices_default

            try:
                shared = shared_devices_default()
            except ValueError as e:
                raise pytest.UsageError(str(e)) from None
        self.shared_devices = shared
        self.in_use = False  # whether this run collected tests of the suite

    def banner(self) -> str:
        shared = ", ranks sharing devices" if self.shared_devices else ""
        return (f"flashoverlap conformance: backend {self.backend_name}{shared}, seed {self.seed} "
                f"(reproduce with --fo-seed {self.seed})")

    @cached_property
    def _resolved(self):
        """(backend, None) when usable, (None, why not) when known but unavailable here; an
        unknown name is a usage error (a typo must not turn the whole suite into skips)."""
        from flashoverlap_core import registry

        try:
            return registry.get(self.backend_name), None
        except registry.BackendError as e:
            known = {s.name for s in registry.backends()}
            if self.backend_name not in known:
                raise pytest.UsageError(f"--fo-backend: {e}") from None
            return None, str(e)

    def backend(self):
        """The backend under test; skips (fails under FLASHOVERLAP_REQUIRE_HW=1) when unavailable."""
        backend, why = self._resolved
        if backend is None:
            skip_unavailable(why)
        return backend

    @property
    def target(self) -> Target:
        backend = self.backend()
        return Target(self.backend_name, backend.device_type or "cpu")

    @cached_property
    def world_sizes(self) -> tuple[int, ...]:
        """World sizes to parametrize with (known without touching any device)."""
        if self._world_sizes:
            try:
                sizes = tuple(int(w) for w in self._world_sizes.split(","))
            except ValueError:
                sizes = ()
            if not sizes or min(sizes) < 1:
                raise pytest.UsageError(f"--fo-world-sizes must be comma-separated ints >= 1, "
                                        f"got {self._world_sizes!r}")
            return tuple(sorted(set(sizes)))
        backend, _ = self._resolved
        if backend is None or backend.device_type in (None, "cpu"):
            return HOST_WORLD_SIZES
        most = MAX_DEVICE_WORLD_SIZE if self.shared_devices else backend.device_count()
        return tuple(range(1, max(1, min(MAX_DEVICE_WORLD_SIZE, most)) + 1))

    def check_world_size(self, world_size: int) -> None:
        """Skip (a hardware skip) when the backend has fewer devices than ranks."""
        backend = self.backend()
        if backend.device_type in (None, "cpu"):
            return
        count = backend.device_count()
        if count < 1 or (world_size > count and not self.shared_devices):
            skip_unavailable(f"world size {world_size} needs {world_size} {backend.device_type} "
                             f"devices; backend {backend.name!r} sees {count} (ranks may share "
                             "devices with --fo-shared-devices: a correctness-only topology)")


class RankPools:
    """One :class:`~flashoverlap_core.tools.ranks.Ranks` per world size: a pool of spawned
    ranks made on first use and made again when a test killed it (a hang, a dead rank, or
    pytest-timeout cutting a call short)."""

    def __init__(self, s: Settings):
        self.settings = s
        self._ranks: dict = {}

    def run(self, world_size: int, fn, *args, default_choice: bool = False, **kwargs) -> list:
        """``fn(target, *args, **kwargs)`` on every rank of the pool of ``world_size``. With
        ``default_choice`` the ranks have no FLASHOVERLAP_BACKEND (the automatic choice that
        users get) and ``target.backend_name`` is None."""
        from flashoverlap_core.tools.ranks import Ranks

        s = self.settings
        target = s.target
        s.check_world_size(world_size)
        if default_choice:
            target = Target(None, target.device_type)
        key = (world_size, default_choice)
        if key not in self._ranks:
            env = {"FLASHOVERLAP_BACKEND": None if default_choice else s.backend_name}
            self._ranks[key] = Ranks(world_size, target.device_type, timeout=s.timeout, env=env,
                                     shared_devices=s.shared_devices)
        return self._ranks[key].run(fn, target, *args, **kwargs)

    def close(self) -> None:
        for ranks in self._ranks.values():
            ranks.close(kill=True)  # nothing left to run: no need to wait for a clean exit
        self._ranks.clear()


@pytest.fixture(scope="session")
def fo_settings(request) -> Settings:
    return settings(request.config)


@pytest.fixture
def fo_backend(fo_settings):
    """The backend under test (the test is skipped, with the reason, when it is unavailable)."""
    return fo_settings.backend()


@pytest.fixture
def fo_target(fo_settings) -> Target:
    return fo_settings.target


@pytest.fixture(scope="session")
def _fo_pool_set(fo_settings):
    pools = RankPools(fo_settings)
    yield pools
    pools.close()


@pytest.fixture
def fo_pools(_fo_pool_set, fo_backend) -> RankPools:
    """Spawned rank pools: ``fo_pools.run(world_size, fn, *args)`` runs
    ``fn(target, *args)`` on every rank and returns the per-rank results."""
    return _fo_pool_set
