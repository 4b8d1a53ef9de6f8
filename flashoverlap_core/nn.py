"""Tensor-parallel linear layers whose collectives overlap their GEMMs (``fo.nn``).

Both keep this rank's shard of a full ``nn.Linear(in_features, out_features)`` as parameters
named ``weight`` and ``bias``, like ``nn.Linear``'s, and their forward and backward equal the
full layer's on the matching slices (see docs/design.md, "In a model"). ``from_linear`` shards an
``nn.Linear`` that is identical on every rank. They run through :func:`fo.overlap
<flashoverlap_core.torch_ops.overlap>`, so they compile with ``torch.compile(fullgraph=True)``.

- :class:`RowParallelLinear`: weight ``[out_features, in_features / W]``, input
  ``[..., in_features / W]``; ``reduce="allreduce"`` gives ``[..., out_features]`` on every
  rank, ``reduce="reduce_scatter"`` (sequence parallel) gives this rank's ``[tokens / W,
  out_features]`` rows of the sum over the flattened leading dimensions.
- :class:`ColumnParallelLinear`: weight ``[out_features / W, in_features]``, output
  ``[..., out_features / W]``. With ``gather_input=True`` the input is this rank's token rows
  (leading dimensions flattened) and the output has the rows of every rank in rank order,
  ``[W * tokens, out_features / W]``.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .collectives import resolve_group
from .ops import REDUCE_OPS
from .torch_ops import group_name, overlap, overlap_add_rmsnorm


class _ParallelLinear(nn.Module):
    """What both layers share: the group, the shard's parameters and the input checks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group, backend,
                 device, dtype):
        super().__init__()
        self.group, self.rank, self.world_size = resolve_group(group)
        self.in_features, self.out_features, self.backend = in_features, out_features, backend
        for what in ("in_features", "out_features"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what} must be a positive int, got {value!r}")
        weight_shape, bias_size = self._shard_shapes()
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(weight_shape, **factory))
        self.bias = nn.Parameter(torch.empty(bias_size, **factory)) if bias else None
        self.reset_parameters()

    def __deepcopy__(self, memo):
        # A process group cannot be copied (nor pickled): a copy of the layer (an EMA model,
        # say) keeps communicating on the same group.
        memo[id(self.group)] = self.group
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__dict__, memo))
        return copied

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation (uniform in ±1/sqrt(in_features)), per shard: ranks draw
        different numbers unless seeded alike. ``from_linear`` gives exact shards."""
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            for p in (self.weight, self.bias):
                if p is not None:
                    p.uniform_(-bound, bound)

    def _check_group(self) -> None:
        # A layer built before init_process_group holds full weights for one rank: using it in a
        # bigger default group would silently sum W full products.
        if (self.group is None and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1):
            raise ValueError(
                f"{type(self).__name__} was built without torch.distributed (world size 1), "
                f"but the default group now has {dist.get_world_size()} rank(s): build the layer "
                "after init_process_group (or pass group=)")

    def _rows(self, x: torch.Tensor, features: int, what: str) -> torch.Tensor:
        """``x`` as 2-D rows, after checking its last dimension."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != features:
            raise ValueError(f"{type(self).__name__} expects input [..., {features}] ({what}), "
                             f"got shape {tuple(x.shape)}")
        self._check_group()
        return x.reshape(-1, features)

    def _shard_shapes(self) -> tuple[tuple[int, int], int]:
        """(weight shape, bias size) of this rank's shard."""
        raise NotImplementedError

    def _shard(self, what: str) -> int:
        full = getattr(self, what)
        if full % self.world_size:
            raise ValueError(f"{type(self).__name__}: {what}={full} is not divisible by the "
                             f"group's world size {self.world_size}")
        return full // self.world_size

    def _slices(self, weight: torch.Tensor, bias: torch.Tensor | None):
        """This rank's shard of a full layer's weight and bias."""
        raise NotImplementedError

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kwargs):
        """This rank's shard of ``linear`` (which must be identical on every rank), as new
        parameters ``weight`` and ``bias`` with ``linear``'s dtype, device and requires_grad.
        ``kwargs`` go to the constructor (``reduce=``, ``gather_input=``, ``backend=``)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear takes an nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    device="meta", dtype=linear.weight.dtype, **kwargs)
        weight, bias = layer._slices(linear.weight, linear.bias)
        layer.weight = nn.Parameter(weight.detach().clone(), linear.weight.requires_grad)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), linear.bias.requires_grad)
        return layer


class RowParallelLinear(_ParallelLinear):
    """The second linear layer of a tensor-parallel pair: weight ``[out_features, in_features /
    W]`` (this rank's column slice), input ``[..., in_features / W]``. ``reduce`` is
    ``"allreduce"`` or ``"reduce_scatter"``; the full bias is added once, after the reduction.

    With ``"reduce_scatter"`` the bias is applied on every rank's rows, so its gradient is summed
    over the ranks in backward (the unsharded layer's bias gradient, on every rank).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 reduce: str = "allreduce", backend: str | None = None, device=None, dtype=None):
        if reduce not in REDUCE_OPS:
            raise ValueError(f"reduce must be one of {REDUCE_OPS}, got {reduce!r}")
        super().__init__(in_features, out_features, bias, group, backend, device, dtype)
        self.reduce = reduce

    def _shard_shapes(self):
        self.in_shard = self._shard("in_features")
        return (self.out_features, self.in_shard), self.out_features

    def _slices(self, weight, bias):
        # this rank's columns of the weight; the bias is added after the reduction: kept whole
        return weight[:, self.rank * self.in_shard:(self.rank + 1) * self.in_shard], bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows(x, self.in_shard, f"this rank's 1/{self.world_size} of in_features="
                          f"{self.in_features}")
        y = overlap(rows, self.weight.t(), self.reduce, self.group, backend=self.backend)
        if self.reduce == "allreduce":
            y = y.reshape(*x.shape[:-1], self.out_features)
        if self.bias is None:
            return y
        if self.reduce == "reduce_scatter":
            return y + _SumGradOverRanks.apply(self.bias, group_name(self.group))
        return y + self.bias

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.RMSNorm):
        """``(norm(residual + self(x)), residual + self(x))`` with the reduction's
        post-communication reorder fused into the residual add and the norm
        (:func:`fo.overlap_add_rmsnorm <flashoverlap_core.torch_ops.overlap_add_rmsnorm>`).
        ``residual`` has the shape of ``self(x)`` (with ``"reduce_scatter"``, this rank's rows);
        ``norm`` is an ``nn.RMSNorm(out_features)``: its weight (none: ones) and eps (none:
        the dtype's, as nn.RMSNorm's)."""
        if not isinstance(norm, nn.RMSNorm):
            raise TypeError(f"norm must be a torch.nn.RMSNorm, got {type(norm).__name__}")
        if tuple(norm.normalized_shape) != (self.out_features,):
            raise ValueError(f"norm must normalise over out_features={self.out_features}, got "
                             f"normalized_shape {tuple(norm.normalized_shape)}")
        rows = self._rows(x, self.in_shard, f"this rank's 1/{self.world_size} of in_features="
                          f"{self.in_features}")
        shape = residual.shape
        flat = residual.reshape(-1, self.out_features)
        if self.bias is not None:  # added once, after the reduction: fold it into the residual
            bias = self.bias
            if self.reduce == "reduce_scatter":
                bias = _SumGradOverRanks.apply(bias, group_name(self.group))
            flat = flat + bias
        weight = norm.weight if norm.weight is not None else flat.new_ones(self.out_features)
        eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
        normed, resid = overlap_add_rmsnorm(rows, self.weight.t(), flat, weight, eps=eps,
                                            op=self.reduce, group=self.group,
                                            backend=self.backend)
        return normed.reshape(shape), resid.reshape(shape)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (shard {self.in_shard}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"reduce={self.reduce!r}, world_size={self.world_size}")


class ColumnParallelLinear(_ParallelLinear):
    """The first linear layer of a tensor-parallel pair: weight ``[out_features / W,
    in_features]`` (this rank's row slice) and this rank's bias slice.

    ``gather_input=False``: ``x @ weight.T + bias`` on the full input ``[..., in_features]``.
    The input's gradient is then this rank's partial: the caller's model-parallel region sums it
    over the ranks (Megatron's copy-to-model-parallel-region), as with any column-parallel layer.

    ``gather_input=True`` (sequence parallel): the input is this rank's token rows
    ``[..., in_features]`` (leading dimensions flattened, the same count on every rank) and the
    forward is ``allgather(x) @ weight.T + bias``, ``[W * tokens, out_features / W]``, with the
    gather overlapped with the GEMM; the input's gradient is reduce-scattered back to its rows.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 gather_input: bool = False, backend: str | None = None, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, group, backend, device, dtype)
        self.gather_input = bool(gather_input)

    def _shard_shapes(self):
        self.out_shard = self._shard("out_features")
        return (self.out_shard, self.in_features), self.out_shard

    def _slices(self, weight, bias):
        rows = slice(self.rank * self.out_shard, (self.rank + 1) * self.out_shard)
        return weight[rows], bias[rows] if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gather_input:
            self._check_group()
            return F.linear(x, self.weight, self.bias)
        rows = self._rows(x, self.in_features, "this rank's token rows")
        y = overlap(rows, self.weight.t(), "allgather", self.group, backend=self.backend)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(shard {self.out_shard}), bias={self.bias is not None}, "
                f"gather_input={self.gather_input}, world_size={self.world_size}")


class _SumGradOverRanks(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group's ranks. For a replicated
    parameter applied to each rank's own rows (the bias after a reduce-scatter)."""

    @staticmethod
    def forward(ctx, t, name):
        ctx.group_name = name
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.group_name:
            return grad, None
        from torch.distributed import _functional_collectives as funcol
        return funcol.all_reduce(grad, "sum", ctx.group_name), None
