"""A Llama decoder from Hugging Face ``transformers`` made tensor parallel with ``fo.nn`` layers,
checked against the unsharded model: the logits and every parameter's gradient.

A small ``LlamaConfig`` with random weights (nothing is downloaded), identical on every rank.
Each decoder layer's projections are swapped for this rank's shards (``from_linear``), as in
Megatron-LM: q, k, v and the MLP's gate and up become ``ColumnParallelLinear`` (this rank's
heads and intermediate features), o_proj and down_proj ``RowParallelLinear`` whose allreduce
overlaps their GEMM. The attention and MLP modules are Hugging Face's own.

    pip install -e '.[examples]'
    python examples/llama.py                          # one process: world size 1
    torchrun --nproc_per_node 2 examples/llama.py     # two ranks (gloo on the CPU)
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import flashoverlap_core as fo
from launch import start

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features sharded
ROW = ("o_proj", "down_proj")  # input features sharded, outputs allreduced


class SumGradOverRanks(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the ranks. The input of a
    tensor-parallel block is the same on every rank, and each rank's column-parallel layers
    give only their shards' part of its gradient (Megatron's copy to the model-parallel
    region)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


def enter_parallel_region(module, args, kwargs):
    """Forward pre-hook of an attention or MLP module: its hidden states through
    :class:`SumGradOverRanks` (passed by keyword to the attention, by position to the MLP)."""
    if "hidden_states" in kwargs:
        kwargs = {**kwargs, "hidden_states": SumGradOverRanks.apply(kwargs["hidden_states"])}
    else:
        args = (SumGradOverRanks.apply(args[0]), *args[1:])
    return args, kwargs


def shard(model: LlamaForCausalLM) -> None:
    """Swap every decoder layer's projections for this rank's fo.nn shards."""
    for layer in model.model.layers:
        for block in (layer.self_attn, layer.mlp):
            for name in COLUMN + ROW:
                linear = getattr(block, name, None)
                if linear is None:
                    continue
                parallel = (fo.nn.ColumnParallelLinear.from_linear(linear) if name in COLUMN else
                            fo.nn.RowParallelLinear.from_linear(linear, reduce="allreduce"))
                setattr(block, name, parallel)
            if dist.is_initialized() and dist.get_world_size() > 1:
                block.register_forward_pre_hook(enter_parallel_region, with_kwargs=True)


def shard_of(full_grad: torch.Tensor, sharded: torch.nn.Parameter, name: str) -> torch.Tensor:
    """The slice of an unsharded parameter's gradient that this rank's parameter holds."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if full_grad.shape == sharded.shape:
        return full_grad
    dim = 0 if name.split(".")[-2] in COLUMN else 1
    size = sharded.shape[dim]
    return full_grad.narrow(dim, rank * size, size)


def main() -> None:
    world = start()
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)  # the same model and tokens on every rank
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=64, attn_implementation="eager")
    full = LlamaForCausalLM(config).float()
    model = copy.deepcopy(full)
    shard(model)
    tokens = torch.randint(0, config.vocab_size, (2, 24))

    full_out = full(tokens, labels=tokens)
    full_out.loss.backward()
    out = model(tokens, labels=tokens)
    out.loss.backward()

    scale = full_out.logits.abs().max()
    logits_error = ((out.logits - full_out.logits).abs().max() / scale).item()
    grads = dict(full.named_parameters())
    grad_error = max(((p.grad - shard_of(grads[name].grad, p, name)).abs().max()
                      / grads[name].grad.abs().max().clamp_min(1e-12)).item()
                     for name, p in model.named_parameters())
    swapped = sum(isinstance(m, (fo.nn.ColumnParallelLinear, fo.nn.RowParallelLinear))
                  for m in model.modules())
    backends = sorted({f"{c['op']} on {c['backend']}" for c in fo.prepared_calls()})
    match = logits_error < 1e-4 and grad_error < 1e-3
    print(f"llama example: rank {rank} of {world}: {swapped} fo.nn layers ({', '.join(backends)}); "
          f"against the unsharded model: logits {logits_error:.1e}, gradients {grad_error:.1e} "
          f"(relative): {'match' if match else 'MISMATCH'}")
    if not match:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
