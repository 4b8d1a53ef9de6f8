"""Backend discovery and selection: entry points and module:attr names, FLASHOVERLAP_BACKEND
and backend= overrides, auto-detection, the log line saying which backend and why, and errors
that list every backend with its reason."""
import logging
from importlib.metadata import EntryPoint

import pytest
import torch

import fake_backends
import flashoverlap_core as fo
from flashoverlap_core import api, registry


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch, caplog):
    """Backends registered by a test vanish after it; no backend choice comes from outside,
    and no call prepared by another test (a prepared key keeps the backend chosen for it)."""
    for name in ("_loaded", "_load_errors", "_probed"):
        monkeypatch.setattr(registry, name, dict(getattr(registry, name)))
    monkeypatch.delenv(registry.ENV_BACKEND, raising=False)
    caplog.set_level(logging.INFO, logger="flashoverlap")
    api.forget_prepared()
    yield
    api.forget_prepared()


def inputs():
    return torch.randn(5, 3), torch.randn(3, 4)


def chosen(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "chosen" in r.getMessage()]


def assert_lists_every_backend(message: str) -> None:
    statuses = fo.backends()
    assert any(not s.available for s in statuses), "the listing should include an unavailable backend"
    for s in statuses:
        assert s.name in message, f"{s.name} missing from: {message}"
        assert s.available or s.reason in message, f"{s.name}'s reason missing from: {message}"


@pytest.mark.parametrize("how", ["get", "overlap", "plan"])
def test_unknown_backend_lists_every_backend_with_its_reason(how):
    registry.register(fake_backends.Unavailable())
    with pytest.raises(registry.BackendError) as info:
        if how == "get":
            registry.get("no-such-backend")
        elif how == "overlap":
            fo.overlap(*inputs(), backend="no-such-backend")
        else:
            fo.plan(5, 4, 3, backend="no-such-backend")
    assert "no-such-backend" in str(info.value)
    assert_lists_every_backend(str(info.value))


def test_unavailable_backend_says_why():
    registry.register(fake_backends.Unavailable())
    with pytest.raises(registry.BackendError, match="fake-unavailable.*no frobnicator device found") as info:
        fo.overlap(*inputs(), backend="fake-unavailable")
    assert_lists_every_backend(str(info.value))


def test_environment_override_is_used_and_logged(monkeypatch, caplog):
    registry.register(fake_backends.Recording())
    monkeypatch.setenv(registry.ENV_BACKEND, "fake-recording")
    runs = fake_backends.Recording.runs
    a, b = inputs()
    torch.testing.assert_close(fo.overlap(a, b), a @ b)
    assert fake_backends.Recording.runs == runs + 1
    assert chosen(caplog) == [f"flashoverlap: backend fake-recording chosen (override from {registry.ENV_BACKEND})"]


def test_argument_beats_the_environment(monkeypatch, caplog):
    registry.register(fake_backends.Recording())
    monkeypatch.setenv(registry.ENV_BACKEND, "fake-recording")
    runs = fake_backends.Recording.runs
    fo.overlap(*inputs(), backend="reference")
    assert fake_backends.Recording.runs == runs
    assert chosen(caplog) == ["flashoverlap: backend reference chosen (backend= argument)"]


def test_unknown_environment_override_is_an_error(monkeypatch):
    monkeypatch.setenv(registry.ENV_BACKEND, "no-such-backend")
    with pytest.raises(registry.BackendError, match=f"no-such-backend") as info:
        fo.overlap(*inputs())
    assert_lists_every_backend(str(info.value))


def test_auto_detection_logs_the_device_and_what_it_passed_over(caplog):
    registry.register(fake_backends.Unavailable())  # preferred for cpu, but unavailable
    a, b = inputs()
    torch.testing.assert_close(fo.overlap(a, b), a @ b)
    [line] = chosen(caplog)
    assert "auto detect for device cpu" in line
    assert "passed over fake-unavailable: no frobnicator device found" in line


def test_entry_points_are_discovered_and_a_broken_one_is_listed_not_fatal(monkeypatch):
    eps = [EntryPoint("fake-ep", "fake_backends:Recording", registry.ENTRY_POINT_GROUP),
           EntryPoint("fake-broken", "no_such_module_here:Backend", registry.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry, "entry_points",
                        lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
    status = {s.name: s for s in fo.backends()}
    assert status["fake-ep"].available
    assert not status["fake-broken"].available and "no_such_module_here" in status["fake-broken"].reason
    runs = fake_backends.Recording.runs
    a, b = inputs()
    torch.testing.assert_close(fo.overlap(a, b, backend="fake-ep"), a @ b)
    assert fake_backends.Recording.runs == runs + 1


def test_module_attr_name_loads_a_backend_that_is_not_installed():
    runs = fake_backends.Recording.runs
    a, b = inputs()
    torch.testing.assert_close(fo.overlap(a, b, backend="fake_backends:Recording"), a @ b)
    assert fake_backends.Recording.runs == runs + 1
