"""The README's "In a model" example as a script (the block between the markers is the
README's, as it is written there: tests/test_readme.py checks it), then its MLP against the
unsharded layers.

    python examples/in_a_model.py                          # one process: world size 1
    torchrun --nproc_per_node 2 examples/in_a_model.py     # two ranks (gloo on the CPU)
"""
from launch import start

start()
# ---- README.md, "In a model" -----------------------------------------------------------------
import torch
import torch.distributed as dist
import torch.nn.functional as F
import flashoverlap_core as fo

W = dist.get_world_size() if dist.is_initialized() else 1   # the default group, as above
hidden, inner, tokens = 256, 512, 64 * W
torch.manual_seed(0)                    # the full layers are identical on every rank
# A Llama-style MLP. gate_up's rows go rank by rank (gate_0, up_0, gate_1, up_1, ...), so
# that each rank's slice is its gate rows then its up rows.
gate_up = torch.nn.Linear(hidden, 2 * inner, bias=False)
down = torch.nn.Linear(inner, hidden, bias=False)
column = fo.nn.ColumnParallelLinear.from_linear(gate_up, gather_input=True)  # weight [2*inner/W, hidden]
row = fo.nn.RowParallelLinear.from_linear(down, reduce="reduce_scatter")     # weight [hidden, inner/W]

norm = torch.nn.RMSNorm(hidden)         # the next block's input norm

def mlp(x):                                # x: this rank's [tokens/W, hidden] token rows
    gate, up = column(x).chunk(2, dim=-1)  # every rank's rows gathered: [tokens, 2*inner/W]
    return row(F.silu(gate) * up)          # this rank's rows of the sum: [tokens/W, hidden]

def block(x):                              # residual add + RMSNorm in one op after the reduction:
    gate, up = column(x).chunk(2, dim=-1)  # (norm(x + mlp(x)), x + mlp(x))
    return row.add_rmsnorm(F.silu(gate) * up, x, norm)

x = torch.randn(tokens // W, hidden, requires_grad=True)
mlp(x).sum().backward()                    # the backward passes use overlapped ops too
torch.compile(mlp, fullgraph=True)(x).sum().backward()   # no graph break
normed, h = torch.compile(block, fullgraph=True)(x)
(normed.sum() + h.sum()).backward()
# ---- end of the README's example -------------------------------------------------------------

# Every rank's token rows through the unsharded layers: gate_up's rows go rank by rank, so its
# output is [tokens, W, (gate, up), inner/W], and down's columns are the ranks' inner/W in order.
rank = dist.get_rank() if W > 1 else 0
rows = [torch.empty_like(x) for _ in range(W)]
if W > 1:
    dist.all_gather(rows, x.detach())
else:
    rows = [x.detach()]
with torch.no_grad():
    h = gate_up(torch.cat(rows)).view(tokens, W, 2, inner // W)
    want = down((F.silu(h[:, :, 0]) * h[:, :, 1]).reshape(tokens, inner))
    want = want[rank * (tokens // W):(rank + 1) * (tokens // W)]
    error = ((mlp(x) - want).abs().max() / want.abs().max()).item()
print(f"in-a-model example: rank {rank} of {W}: the MLP, compiled and as a block with the "
      f"norm, forward and backward; relative error against the unsharded MLP {error:.1e}")
if error > 1e-4:
    raise SystemExit(f"rank {rank}: the sharded MLP differs from the unsharded one ({error:.2e})")
