"""The README's API example as a script (the block between the markers is the README's, as it
is written there: tests/test_readme.py checks it).

    python examples/api.py                          # one process: world size 1
    torchrun --nproc_per_node 2 examples/api.py     # two ranks (gloo on the CPU)
"""
from launch import start

start()
# ---- README.md, "API" ----------------------------------------------------------------------
import torch
import torch.distributed as dist
import flashoverlap_core as fo

# On every rank of an initialised torch.distributed group, or in one process (world size 1).
W = dist.get_world_size() if dist.is_initialized() else 1
accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
device = accelerator or torch.device("cpu")
dtype = torch.bfloat16 if accelerator else torch.float32
a = torch.randn(512 * W, 256, dtype=dtype, device=device)   # this rank's activations [M, K]
weight = torch.randn(1024, 256, dtype=dtype, device=device)  # an nn.Linear weight [N, K]
out = fo.overlap(a, weight.t(), op="allreduce")          # sum over ranks of a @ weight.t()
out = fo.overlap(a, weight.t(), op="reduce_scatter")     # this rank's M/W rows of that sum
out = fo.overlap(a, weight.t(), op="all_to_all",         # 512 rows of a @ weight.t() to each
                 send_splits=[512] * W, recv_splits=[512] * W)  # rank, 512 from each
out = fo.overlap(a, weight.t(), op=lambda region, index: None)  # a custom transfer per group

# Plans are inspectable and round-trip through JSON; a plan is made for one call's shape,
# op, dtype and world size (here this one's; fo.plan(..., world_size=8) plans for 8 ranks).
plan = fo.plan(512 * W, 1024, 256, op="allreduce", world_size=W, dtype=dtype)
print(plan.describe())
plan = fo.Plan.from_json(plan.to_json())
out = fo.overlap(a, weight.t(), op="allreduce", plan=plan)

for status in fo.backends():     # every known backend, available or not, and why
    print(status.line())
for call in fo.prepared_calls():  # what each call above ran on: backend, plan strategy, ...
    print(call["op"], call["a"], call["b"], call["backend"], call["strategy"])
# ---- end of the README's example -------------------------------------------------------------

# The last call's result against a @ weight.t() summed over the ranks, and what each call ran on.
want = (a @ weight.t()).float()
if W > 1:
    dist.all_reduce(want)
error = ((out.float() - want).abs().max() / want.abs().max()).item()
ran = sorted({f"{call['op']} on {call['backend']}" for call in fo.prepared_calls()})
rank = dist.get_rank() if W > 1 else 0
print(f"api example: rank {rank} of {W}: {', '.join(ran)}; allreduce relative error {error:.1e}")
if error > 2e-2:
    raise SystemExit(f"rank {rank}: the allreduce is wrong (relative error {error:.2e})")
