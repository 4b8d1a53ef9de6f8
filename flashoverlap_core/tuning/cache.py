"""The tuning cache: tuned plans and the measurements behind them, in one JSON file.

Where: ``$FLASHOVERLAP_TUNING_CACHE`` (a file path) if set, else
``$XDG_CACHE_HOME/flashoverlap/tuning.json`` (``~/.cache/...`` without XDG_CACHE_HOME);
``FLASHOVERLAP_TUNING_CACHE=off`` turns tuned plans off (``overlap`` uses its heuristic).
Every rank of a group must see the same file (a shared or copied cache): ranks that chose
different plans would run mismatched collectives.
What: sections of entries ``{"key": {...}, "value": {...}}``; a key always starts with the
:class:`Context` (device name, backend, process-group backend, versions of what the backend
runs on, torch), so a cache copied to another machine or surviving an upgrade of the collective
library is not used there. Writes take a file lock and replace the file atomically, so ranks
and concurrent tuners do not lose each other's entries.

:func:`lookup_plan` is what ``overlap`` asks: the tuned plan of the exact shape, else one
rebuilt for the call's M from the tuned plan of the nearest M (same N, K, op, ...) within a
factor of :data:`M_RATIO`, with its group boundaries at the same fractions of the waves; a plan
that does not validate for the call is never returned.
"""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch
import torch.distributed as dist
from filelock import FileLock

from ..backend import Backend, OverlapSpec
from ..devices import device_name
from ..plan import Plan, block_rows_for, check_scaling, group_unit
from ..tiles import TileGrid

log = logging.getLogger("flashoverlap")

ENV_CACHE = "FLASHOVERLAP_TUNING_CACHE"
FORMAT = "flashoverlap.tuning/1"
SECTIONS = ("plans", "gemm", "curves", "contention", "rates")
M_RATIO = 2.0  # nearest-M fallback: tuned M within this factor of the call's M


def cache_path() -> Path | None:
    """The cache file; ``None`` when ``$FLASHOVERLAP_TUNING_CACHE`` is "off"."""
    if os.environ.get(ENV_CACHE, "").lower() == "off":
        return None
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flashoverlap" / "tuning.json"


# ---- what a measurement is valid for -----------------------------------------------------------
@dataclass(frozen=True)
class Context:
    """Where tuning results hold: device, backend, collective library and versions."""

    device: str
    backend: str
    collective: str  # torch.distributed backend of the group ("none" without one)
    versions: str

    def key(self) -> dict:
        return asdict(self)


def collective_name(group) -> str:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return "none"
    return str(dist.get_backend(group))


@lru_cache(maxsize=64)
def _context(backend: Backend, device_type: str, device: str, collective: str) -> Context:
    versions = dict(backend.versions(), torch=torch.__version__)
    text = "; ".join(f"{k}={v}" for k, v in sorted(versions.items()))
    return Context(device, backend.name, collective, text)


def context_for(backend: Backend, device_type: str, group=None) -> Context:
    return _context(backend, device_type, device_name(device_type), collective_name(group))


def plan_key(ctx: Context, *, dtype: str, m: int, n: int, k: int, op: str, world_size: int,
             transfer: str = "", scaling: str | None = None) -> dict:
    """``op`` is the plan's op ("custom" for a callable); ``transfer`` names the callable's
    type for custom ops ("" for collectives); ``scaling``: an fp8 call's scales, in the key
    as its plans take them (:func:`~flashoverlap_core.plan.check_scaling`: only "blockwise"
    has plans of its own; tensor-wise and row-wise share them)."""
    key = {**ctx.key(), "dtype": dtype, "M": m, "N": n, "K": k, "op": op,
           "world_size": world_size, "transfer": transfer}
    plan_scaling = check_scaling(dtype, scaling)
    if plan_scaling is not None:
        key["scaling"] = plan_scaling
    return key


def kernel_key(ctx: Context, plan: Plan) -> dict:
    """The GEMM as one kernel configuration runs it: shape, tile, wave size, tile order and
    destination blocks."""
    return {**ctx.key(), "dtype": plan.dtype, "M": plan.m, "N": plan.n, "K": plan.k,
            "tile": list(plan.tile), "wave_size": plan.wave_size,
            "schedule": plan.schedule.to_dict(), "block_rows": list(plan.block_rows)}


# How a transfer's cost curve was timed (measure.measure_curve): back to back, as the device runs
# it among other work. Curves of the earlier timing (from an idle device, the launch in it)
# have no "timing" in their key and are measured again.
CURVE_TIMING = "back_to_back"


def transfer_key(ctx: Context, *, transfer: str, world_size: int, dtype: str) -> dict:
    return {**ctx.key(), "transfer": transfer, "world_size": world_size, "dtype": dtype,
            "timing": CURVE_TIMING}


# ---- the file ------------------------------------------------------------------------------------
class TuningCache:
    """The JSON file of tuning results (see the module docstring)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else cache_path()

    def load(self) -> dict:
        """Every section (empty ones when the file is missing, unreadable or turned off)."""
        empty = {"format": FORMAT, **{s: [] for s in SECTIONS}}
        if self.path is None:
            return empty
        try:
            stat = self.path.stat()
        except OSError:
            return empty
        return _read(str(self.path), stat.st_mtime_ns, stat.st_size) or empty

    def get(self, section: str, key: dict) -> dict | None:
        for entry in self.load()[section]:
            if entry["key"] == key:
                return entry["value"]
        return None

    def entries(self, section: str) -> list[dict]:
        return list(self.load()[section])

    def put(self, section: str, key: dict, value: dict) -> None:
        """Store ``value`` under ``key``, replacing an entry with the same key."""
        if section not in SECTIONS:
            raise ValueError(f"cache section must be one of {SECTIONS}, got {section!r}")
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.path) + ".lock"):
            doc = self.load()
            doc[section] = [e for e in doc[section] if e["key"] != key]
            doc[section].append({"key": key, "value": value})
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tuning-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1)
            os.replace(tmp, self.path)


@lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int, size: int) -> dict | None:
    """The parsed file (memoised per version of the file)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        log.warning("flashoverlap: ignoring the tuning cache %s: %s", path, e)
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        log.warning("flashoverlap: ignoring the tuning cache %s: not in format %s", path, FORMAT)
        return None
    for section in SECTIONS:
        doc.setdefault(section, [])
    return doc


# ---- plans for calls -----------------------------------------------------------------------------
def carried_groups(tuned: Plan, num_tiles: int, unit: int) -> tuple[int, ...]:
    """``tuned``'s group boundaries moved to a grid of ``num_tiles`` tiles (same wave size):
    each at the same fraction of the waves, on a whole wave, rounded down to a multiple of
    ``unit`` tiles; boundaries that collapse are merged."""
    wave = tuned.wave_size
    waves = -(-num_tiles // wave)
    ends, done = [], 0
    for size in tuned.group_sizes[:-1]:
        done += size
        end = min(num_tiles, round(done / tuned.num_tiles * waves) * wave) // unit * unit
        if 0 < end < num_tiles and (not ends or end > ends[-1]):
            ends.append(end)
    ends.append(num_tiles)
    return tuple(b - a for a, b in zip([0] + ends, ends))


def rebuild_plan(tuned: Plan, spec: OverlapSpec, backend: Backend) -> Plan | None:
    """A plan for ``spec`` with ``tuned``'s kernel configuration and grouping (carried over
    with :func:`carried_groups` when the grid differs); ``None`` when it does not validate."""
    try:
        if tuned.mismatches(m=spec.m, n=spec.n, k=spec.k, op=spec.op,
                            world_size=spec.world_size, dtype=spec.dtype,
                            send_splits=spec.send_splits, out_dtype=spec.out_dtype,
                            scaling=spec.scaling):
            rows = block_rows_for(spec.op, spec.m, spec.world_size, spec.send_splits)
            tiles = TileGrid(rows, spec.n, *tuned.tile, tuned.schedule).num_tiles
            unit = group_unit(spec.op, spec.world_size, spec.n, tuned.tile, tuned.layout,
                              tuned.schedule)
            plan = Plan(spec.m, spec.n, spec.k, spec.op, spec.world_size, spec.dtype,
                        tuned.tile, tuned.wave_size, carried_groups(tuned, tiles, unit),
                        tuned.schedule, spec.send_splits, backend.name,
                        strategy=tuned.strategy,  # a "sequential" plan stays sequential
                        layout=tuned.layout, out_dtype=spec.out_dtype,
                        scaling=spec.scaling if spec.scaling == "blockwise" else None)
        else:
            plan = tuned
    except (ValueError, TypeError) as e:
        log.info("flashoverlap: tuned plan %r does not fit M=%d: %s", tuned, spec.m, e)
        return None
    reasons = backend.plan_reasons(plan)
    if reasons:
        log.info("flashoverlap: backend %s rejects tuned plan %r: %s", backend.name, plan, reasons)
        return None
    return plan


def tuned_plan(spec: OverlapSpec, backend: Backend, entries: list[dict], ctx: Context,
               transfer: str = "") -> Plan | None:
    """The plan for ``spec`` from cache entries: the exact shape's, else the nearest M's
    (within a factor of :data:`M_RATIO`) carried over; ``None`` if none fits."""
    want = plan_key(ctx, dtype=spec.dtype, m=spec.m, n=spec.n, k=spec.k, op=spec.op,
                    world_size=spec.world_size, transfer=transfer, scaling=spec.scaling)
    same_but_m = [e for e in entries
                  if {**e["key"], "M": spec.m} == want
                  and abs(math.log(e["key"]["M"] / spec.m)) <= math.log(M_RATIO)]
    for entry in sorted(same_but_m, key=lambda e: abs(math.log(e["key"]["M"] / spec.m))):
        try:
            tuned = Plan.from_dict(entry["value"]["plan"])
        except (KeyError, ValueError, TypeError) as e:
            log.warning("flashoverlap: skipping a malformed tuned plan: %s", e)
            continue
        plan = rebuild_plan(tuned, spec, backend)
        if plan is not None:
            return plan
    return None


def lookup_plan(spec: OverlapSpec, backend: Backend, group=None, transfer: str = "",
                cache: TuningCache | None = None) -> Plan | None:
    """The tuned plan for a call, or ``None`` (then the caller uses its heuristic).

    ``group``: the call's process group (None: the default group); ``transfer``: for a
    callable op, the name of its type (what ``flashoverlap tune --op offload`` stores as
    "HostOffload"). Never raises: a broken cache only logs a warning.
    """
    cache = cache or TuningCache()
    try:
        entries = cache.entries("plans")
        if not entries:
            return None
        return tuned_plan(spec, backend, entries, context_for(backend, spec.device_type, group),
                          transfer)
    except Exception as e:  # noqa: BLE001 - the heuristic plan is always a safe answer
        log.warning("flashoverlap: tuning cache lookup failed (%s: %s); using the heuristic plan",
                    type(e).__name__, e)
        return None
