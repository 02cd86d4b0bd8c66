"""DeepSpeed op builders whose ``load()`` returns graft-backed op modules instead of
compiling DeepSpeed's C++/CUDA extension.

DeepSpeed asks its accelerator for a builder class by name (``"FusedAdamBuilder"``),
then calls ``Builder().load()`` and uses attributes of the returned module
(``fused_adam.multi_tensor_adam``). A graft builder keeps the builder's public face
(``NAME``, ``is_compatible()``, ``absolute_name()``) so DeepSpeed's checks pass, and its
``load()`` needs no compiler: the work goes through graft op dispatch, which picks the
best registered implementation (a vendor kernel, or the torch reference).
"""
from __future__ import annotations

import torch
from deepspeed.ops.op_builder.builder import OpBuilder

from graft.adapters.deepspeed.integration import counter


class _GraftBuilder(OpBuilder):
    """Common face of graft builders: always compatible, nothing to compile."""

    NAME = ""
    BUILD_VAR = ""
    GRAFT_OP = ""  # the graft op the loaded module calls

    def __init__(self):
        super().__init__(name=self.NAME)

    def absolute_name(self):
        return f"graft.adapters.deepspeed.op_builders.{type(self).__name__}"

    def sources(self):
        return []

    def is_compatible(self, verbose=False):
        return True

    def builder(self):
        raise RuntimeError(f"{type(self).__name__} is served by graft at run time; there is no extension to build")

    def load(self, verbose=False):
        return self.op_module()

    def jit_load(self, verbose=False):
        return self.op_module()

    def op_module(self):
        raise NotImplementedError


class FusedAdamOps:
    """What ``FusedAdamBuilder().load()`` returns: ``multi_tensor_adam`` over graft's ``fused.adam_step``."""

    @staticmethod
    def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, adam_w_mode,
                          bias_correction, weight_decay):
        # chunk_size and noop_flag belong to the CUDA multi-tensor-apply launcher (DeepSpeed's
        # FusedAdam never sets the flag); graft's multi-tensor form takes the lists whole.
        grads, params, exp_avgs, exp_avg_sqs = tensor_lists
        with torch.no_grad():
            _adam_into(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, step, weight_decay, adam_w_mode,
                       bias_correction)
        counter.count("fused_adam.multi_tensor_adam")


class FusedAdamBuilder(_GraftBuilder):
    """Replaces DeepSpeed's ``FusedAdamBuilder`` (used by ``deepspeed.ops.adam.FusedAdam``,
    the default optimizer for ``"type": "Adam"/"AdamW"`` configs)."""

    NAME = "fused_adam"
    BUILD_VAR = "DS_BUILD_FUSED_ADAM"
    GRAFT_OP = "fused.adam_step"

    def op_module(self):
        return FusedAdamOps


def _adam_into(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, step, weight_decay, adam_w_mode,
               bias_correction):
    """One graft Adam step over lists of DeepSpeed's tensors, in place (one multi-tensor call
    when graft's torch backend serves)."""
    from graft.ops.fused import adam_step_

    # e.g. fp32 gradients of a bf16 offloaded copy
    grads = [g if g.dtype == p.dtype else g.to(p.dtype) for g, p in zip(grads, params)]
    backend = adam_step_(params, grads, exp_avgs, exp_avg_sqs, float(lr), float(beta1), float(beta2), float(eps),
                         int(step), float(weight_decay), bool(adam_w_mode), bool(bias_correction))
    if backend is not None:
        counter.count("fused.adam_step", len(params))
        counter.served("fused.adam_step", backend, len(params))


class CPUAdamOps:
    """What ``CPUAdamBuilder().load()`` returns for ``DeepSpeedCPUAdam`` (ZeRO-Offload's optimizer).

    DeepSpeed's C++ op keeps per-optimizer settings under an id (``create_adam``); only the
    AdamW/L2 mode is taken from there, the other hyper-parameters come with every update.
    """

    _modes: dict = {}

    @classmethod
    def create_adam(cls, opt_id, lr, beta1, beta2, eps, weight_decay, adamw_mode, should_log=False):
        cls._modes[opt_id] = bool(adamw_mode)
        return 0

    @classmethod
    def destroy_adam(cls, opt_id):
        cls._modes.pop(opt_id, None)
        return 0

    @classmethod
    def adam_update(cls, opt_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, params, grads,
                    exp_avg, exp_avg_sq):
        with torch.no_grad():
            _adam_into([params], [grads], [exp_avg], [exp_avg_sq], lr, beta1, beta2, eps, step, weight_decay,
                       cls._modes.get(opt_id, True), bias_correction)
        counter.count("cpu_adam.adam_update")
        return 0

    @classmethod
    def adam_rollback(cls, *args, **kwargs):
        from graft.errors import GraftUnsupportedError

        raise GraftUnsupportedError(
            "graft's CPUAdam has no rollback (used by ZenFlow's overlapped steps); set GRAFT_DEEPSPEED=0 to use "
            "DeepSpeed's compiled cpu_adam for it"
        )


class CPUAdamBuilder(_GraftBuilder):
    """Replaces DeepSpeed's ``CPUAdamBuilder`` (``deepspeed.ops.adam.DeepSpeedCPUAdam``, the
    optimizer of ZeRO-Offload: ``"offload_optimizer": {"device": "cpu"}``)."""

    NAME = "cpu_adam"
    BUILD_VAR = "DS_BUILD_CPU_ADAM"
    GRAFT_OP = "fused.adam_step"

    def op_module(self):
        return CPUAdamOps


# Builder class name (as DeepSpeed asks for it) -> graft builder.
BUILDERS = {
    "FusedAdamBuilder": FusedAdamBuilder,
    "CPUAdamBuilder": CPUAdamBuilder,
}
