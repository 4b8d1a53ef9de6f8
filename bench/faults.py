"""How ranks end when a peer dies or stalls (issue 33): FlashOverlap's communicators against
torch's own, with the same timeout.

For each world size, fault (one rank raises before its call and lives on, exits, or sleeps past
the timeout) and way of running the calls (launched one by one, the call path's own graph
replays, a graph the caller captured), fresh ranks sharing the GPUs run a sequence of
``fo.overlap`` allreduce calls, synchronising after each; the last rank faults at the 4th. Each
survivor's time from the fault to its ``fo.CommunicationError`` is recorded, and every hang
(a rank that answered nothing within the hard timeout: must be 0). The same faults on torch's
own path (``a @ b`` + ``dist.all_reduce`` on the process group's NCCL communicator, torch's
default TORCH_NCCL_ASYNC_ERROR_HANDLING) record when torch's watchdog ended each survivor; a
scenario there still running after ``--torch-limit`` seconds counts its survivors as hung on
torch's path (``torch_hangs``; ``hangs``, FlashOverlap's, must be 0). The JSON is rewritten as
each scenario ends, ``summary.complete`` false until the last.

Both paths use the process group's timeout (``--timeout``, default 20 s, as in the issue):
FlashOverlap's deadline is the group's unless told otherwise.

    python bench/faults.py [--worlds 2,4] [--timeout 20] [--runs launches,replays,capture]
                           [--parallel 12] [--torch-limit SECONDS]

writes bench/results/faults-<device>-<date>.json (device, date, commit, command, every row).
"""
from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import device_tag, table, write_result  # noqa: E402
from flashoverlap_core.tools import faults  # noqa: E402

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
RUNS = {"launches": ("eager", {"FLASHOVERLAP_CUDA_GRAPH": "0"}),
        "replays": ("eager", {}),
        "capture": ("capture", {})}


def rows_of(result: dict, path: str, run: str) -> list[dict]:
    spec = result["scenario"]
    found = faults.problems(result) if path == "fo" else []
    out = []
    for r in result["ranks"]:
        out.append({"path": path, "run": run, "world_size": spec["world_size"],
                    "fault": spec["fault"], "rank": r["rank"], "role": r["role"],
                    "status": r["status"], "error_type": r["error_type"],
                    "after_fault_s": None if r["after_fault_s"] is None else round(r["after_fault_s"], 2),
                    "hung": r["status"] == "hung", "exitcode": r["exitcode"],
                    "error": (r["error"] or "")[:300], "problems": found})
    return out


def main(argv=None) -> int:
    os.environ.setdefault("FLASHOVERLAP_WATCHDOG", "1")  # what it measures (the default)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--timeout", type=float, default=20.0,
                        help="the process group's timeout (both paths' deadline), seconds")
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--faults", default=",".join(faults.FAULTS))
    parser.add_argument("--no-torch", action="store_true", help="skip torch's own path")
    parser.add_argument("--parallel", type=int, default=12,
                        help="scenarios run at once (each in its own processes)")
    parser.add_argument("--torch-limit", type=float, default=None,
                        help="seconds a scenario on torch's own path may run before its "
                             "survivors count as hung there (default 5 x timeout + 40)")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    torch_limit = args.torch_limit or 5 * args.timeout + 40
    jobs = []  # (path, run, spec, env): every scenario, each in fresh processes
    for world in worlds:
        for fault in args.faults.split(","):
            for run in args.runs.split(","):
                mode, env = RUNS[run]
                jobs.append(("fo", run, faults.scenario(
                    fault, world, timeout_s=args.timeout, faulty=world - 1, shape=(512, 384, 64),
                    dtype="bfloat16", backend="cuda", mode=mode, calls=8),
                    {**MULTICAST_OFF, **env}))
            if not args.no_torch:
                jobs.append(("torch", "eager", faults.scenario(
                    fault, world, timeout_s=args.timeout, faulty=world - 1, shape=(512, 384, 64),
                    dtype="bfloat16", calls=8), MULTICAST_OFF))

    def one(job):
        path, run, spec, env = job
        limit = torch_limit if path == "torch" else 6 * args.timeout + 240
        result = faults.run(spec, "cuda", env=env, shared_devices=True, hard_timeout=limit,
                            **({"path": "torch"} if path == "torch" else {}))
        return rows_of(result, path, run)

    # Scenarios are independent (their own processes, ports and communicators): --parallel of
    # them at once, torch's (ended by its watchdog a minute or more after the fault, or never:
    # bounded by --torch-limit) first, so that they do not serialise the run. Times are from
    # each scenario's own fault. The JSON is rewritten as each scenario ends ("complete":
    # false until the last), so a run cut short still leaves what it measured.
    order = sorted(range(len(jobs)), key=lambda i: jobs[i][0] != "torch")
    done: dict[int, list] = {}
    rows, path = [], None

    def summary_of(rows: list[dict], complete: bool) -> dict:
        survivors = [r for r in rows if r["role"] == "survivor"]
        return {
            "complete": complete, "scenarios": len(jobs), "scenarios_done": len(done),
            "faults_tried": len({(r["path"], r["run"], r["world_size"], r["fault"]) for r in rows}),
            "hangs": sum(r["hung"] for r in rows if r["path"] == "fo"),
            "torch_hangs": sum(r["hung"] for r in rows if r["path"] == "torch"),
            "fo_max_after_fault_s": max((r["after_fault_s"] or 0 for r in survivors
                                         if r["path"] == "fo"), default=None),
            "torch_max_after_fault_s": max((r["after_fault_s"] or 0 for r in survivors
                                            if r["path"] == "torch" and not r["hung"]), default=None),
            "fo_problems": sorted({p for r in rows for p in r["problems"]}),
            "timeout_s": args.timeout, "torch_limit_s": torch_limit,
            "topology": "ranks sharing the GPUs (NCCL's socket transport on loopback)",
            "parallel": args.parallel}

    summary = summary_of(rows, not jobs)
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        futures = {pool.submit(one, jobs[i]): i for i in order}
        for future in as_completed(futures):
            got = future.result()
            done[futures[future]] = got
            print(table(got, ["path", "run", "world_size", "fault", "rank", "role", "status",
                              "error_type", "exitcode", "after_fault_s"]), flush=True)
            rows = [r for i in sorted(done) for r in done[i]]
            summary = summary_of(rows, len(done) == len(jobs))
            path = write_result(f"faults-{device_tag()}", rows, {"summary": summary}, path=path)
    print(summary)
    return 0 if summary["hangs"] == 0 and not summary["fo_problems"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
