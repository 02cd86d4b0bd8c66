"""Column-parallel linear under tensor parallelism (Megatron's ``allreduce_dgrad`` path) on
``gemm.linear``.

Under tensor parallelism a ``ColumnParallelLinear`` does not wrap its input in a copy-to-TP
region; its autograd function all-reduces the input gradient over the TP group itself
(``LinearWithGradAccumulationAndAsyncCommunication`` in megatron-core). This is that
function with the forward GEMM on graft's ``gemm.linear``; the backward does what
Megatron's does: dgrad GEMM, the dgrad all-reduce started asynchronously, the wgrad GEMM
(and bias gradient) while it is in flight, then the wait. Gradients are the torch
reference's (plain matmuls, as in Megatron), so losses match the local spec exactly.

Features this does not cover (gradient-accumulation fusion into ``main_grad``, sequence
parallelism, deferred embedding wgrad) stay on Megatron's code; the caller decides.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _LinearAllreduceDgrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward_fn, input, weight, bias, tp_group):
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        ctx.tp_group = tp_group
        return forward_fn(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        # Started before the wgrad GEMM so the two overlap, as in Megatron.
        handle = dist.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        input_2d = input.reshape(-1, input.shape[-1])
        grad_weight = grad_2d.t().matmul(input_2d) if ctx.needs_input_grad[2] else None
        grad_bias = grad_2d.sum(dim=0) if ctx.use_bias and ctx.needs_input_grad[3] else None
        handle.wait()
        return None, grad_input, grad_weight, grad_bias, None


def linear_allreduce_dgrad(forward_fn, input, weight, bias, tp_group):
    """``forward_fn(input, weight, bias)`` forward; backward with the TP dgrad all-reduce
    overlapped with the wgrad GEMM."""
    return _LinearAllreduceDgrad.apply(forward_fn, input, weight, bias, tp_group)
