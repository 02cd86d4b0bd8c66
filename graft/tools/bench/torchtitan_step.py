"""TorchTitan training steps on CPU ranks (gloo), graft's converter on vs off: TorchTitan
0.3.0's own model registry, parallelize functions, loss and optimizer builders, driven the
way its Trainer drives them. ``graft bench overhead --only torchtitan`` times a step
(:func:`measure`); tests/test_torchtitan_*.py train with it (:func:`train_ranks`).

The shims, all here and none in TorchTitan:

* TorchTitan picks its device type once at import (``torchtitan.tools.utils.device_type``,
  ``"cuda"`` where no accelerator is found) and builds its device mesh on it: the ranks set
  ``torchtitan.distributed.parallel_dims.device_type = "cpu"``.
* Its language models build FlexAttention (no backward on CPU) or varlen attention (CUDA
  flash): the config tree's inner attention is swapped for TorchTitan's own
  ``ScaledDotProductAttention`` (causal, the config its graph-trainer tests use), on both
  sides of every comparison.
* ``Decoder.Config.update_from_config`` imports ``torchtitan.trainer`` only to ask whether its
  argument is a ``Trainer.Config``; that module imports tensorboard and wandb (metrics), which
  ci/setup.sh does not install. Where it does not import, a stand-in module whose
  ``Trainer.Config`` nothing is an instance of answers "no" (the non-trainer path TorchTitan's
  RL generator takes).
* TorchTitan's default SPMD backend, ``spmd_types``, does not build here: with torch 2.13's
  FSDP2 ``fully_shard`` refuses its parameters ("all parameters must be DTensors on the full
  SPMD mesh"), graft or not. The runs use its ``partial_dtensor`` backend (DTensor on the
  model-parallel axes only), on both sides of every comparison;
  ``GRAFT_BENCH_TITAN_SPMD=spmd_types`` selects the default where it works.
* gloo has no ``PREMUL_SUM`` reduction: every FSDP2 module gets
  ``set_force_sum_reduction_for_comms(True)`` (TorchTitan already sets a divide factor of 1).

TorchTitan's ``Trainer`` itself is not run: it needs a tokenizer and a dataset on disk
(``hf_assets_path``, ``c4_test``). What it does per step is driven directly: the model from the
registry (the converter in its ``converters`` list, as a job config names it),
``update_from_config``, build on meta, ``parallelize_llama`` / ``parallelize_deepseekv3`` (TP
plans, FullAC activation checkpointing, FSDP2), ``init_weights``, TorchTitan's
``CrossEntropyLoss``, its ``OptimizersContainer`` (``default_adamw``, or graft's container), the
SPMD context, forward/backward and ``optimizers.step()``. Not exercised: ``Trainer`` construction
and its train loop, the tokenizer and dataloader (synthetic tokens), checkpointing, metrics
logging, the LR scheduler, gradient clipping, gradient accumulation (one micro-batch a step),
validation, ``ChunkedLossWrapper`` (the loss runs on the full logits), float8/MX converters,
pipeline and context parallelism, and the inductor backend (``compile_model="aot_eager"`` runs
TorchTitan's compile path, per-block ``fullgraph=True``, without a C++ toolchain).
"""
from __future__ import annotations

import tempfile


def cpu_attention(model_config):
    """Swap TorchTitan's own FlexAttention/varlen configs for its causal SDPA config (CPU shim:
    its flex needs compiled kernels for a backward, its varlen is CUDA flash attention); graft's
    varlen attention (a subclass) stays: it runs on the CPU."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

    for cls in (FlexAttention.Config, VarlenAttention.Config):
        for _fqn, cfg, parent, attr in list(model_config.traverse(cls)):
            if type(cfg) is cls:
                setattr(parent, attr, ScaledDotProductAttention.Config())
    return model_config


def model_spec(model: str, graft_on: bool, flavor: str = "debugmodel", parts=None, attn_backend: str = "flex"):
    """TorchTitan's ModelSpec from its registry, with graft's converter named when ``graft_on``."""
    import importlib

    from graft.adapters.torchtitan import GraftConverter

    registry = importlib.import_module(f"torchtitan.models.{model}").model_registry
    config = GraftConverter.Config() if parts is None else GraftConverter.Config(parts=tuple(parts))
    spec = registry(flavor, attn_backend=attn_backend, converters=[config] if graft_on else None)
    cpu_attention(spec.model)
    return spec


def attention_masks(model, positions):
    """What TorchTitan's trainer passes a model whose attention takes masks (its varlen or flex
    inner attention: ``model.get_attention_masks(positions)``), else None."""
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    first = getattr(getattr(model, "config", None), "first_attention", None)
    inner = getattr(first, "inner_attention", None)
    if isinstance(inner, (FlexAttention.Config, VarlenAttention.Config)):
        return model.get_attention_masks(positions)
    return None


def shrink(model_config, n_layers: int):
    """Keep the first ``n_layers`` layers (a smaller debug model, faster tests)."""
    model_config.layers = model_config.layers[:n_layers]
    return model_config


def _trainer_stand_in():
    import sys
    import types

    try:
        import torchtitan.trainer  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("torchtitan.trainer")
        stand_in.Trainer = type("Trainer", (), {"Config": type("Config", (), {})})
        sys.modules["torchtitan.trainer"] = stand_in


def build_model(model: str, graft_on: bool, seed: int = 0, n_layers: int | None = None, parts=None,
                attn_backend: str = "flex"):
    """A single-process model (no parallelism), weights from ``seed``."""
    import torch

    spec = model_spec(model, graft_on, parts=parts, attn_backend=attn_backend)
    if n_layers is not None:
        shrink(spec.model, n_layers)
    torch.manual_seed(seed)
    m = spec.model.build()
    m.init_states()
    return spec, m


def fp32_experts():
    """Test-only: TorchTitan's ``GroupedExperts`` casts its inputs and weights to bfloat16
    (``x.bfloat16()``) whatever the model dtype; this makes ``Tensor.bfloat16`` the identity in
    this process, so its experts compute in fp32 and can be compared with graft's
    ``moe.fused_experts`` at fp32 tolerance (nothing else in these fp32 jobs calls it)."""
    import torch

    torch.Tensor.bfloat16 = lambda self, *args, **kwargs: self  # type: ignore[method-assign]


class Job:
    """One rank's TorchTitan training job, set up in the order its Trainer does it: config
    ``update_from_config`` (sharding declarations), build on the meta device, its parallelize
    function (TP plans, activation checkpointing, compile, FSDP2), ``to_empty`` +
    ``init_weights``, its loss (``CrossEntropyLoss``) and optimizer (``default_adamw`` ->
    ``OptimizersContainer``) builders. :meth:`step` runs one step: forward/backward in its SPMD
    context, then the optimizer step. Needs an initialised process group."""

    def __init__(self, model, graft_on, tp, seed=0, n_layers=None, batch=2, seq=16, compile_model=False,
                 ac=False, spmd_backend=None, graft_optim=False, parts=None, attn_backend="flex", pp=1):
        import types

        from graft import settings

        import torch
        import torchtitan.distributed.parallel_dims as pdims
        import torchtitan.distributed.utils as dist_utils
        from torch.distributed.fsdp import FSDPModule
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.components.optimizer import default_adamw
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims

        world = torch.distributed.get_world_size()
        pdims.device_type = "cpu"  # shim: see the module docstring
        spec = model_spec(model, graft_on, parts=parts, attn_backend=attn_backend)
        if n_layers is not None:
            shrink(spec.model, n_layers)
        self.spec, self.tp, self.pp, self.dp, self.batch, self.seq = spec, tp, pp, world // (tp * pp), batch, seq
        spmd_backend = spmd_backend or settings.get("GRAFT_BENCH_TITAN_SPMD")
        # PP: TorchTitan's pipelining_fn splits the model into stages (one per rank here), each
        # parallelized by parallelize_fn, driven by its schedule (1F1B, microbatches of 1)
        self.parallelism = parallelism = ParallelismConfig(
            data_parallel_shard_degree=self.dp, tensor_parallel_degree=tp, spmd_backend=spmd_backend,
            pipeline_parallel_degree=pp, pipeline_parallel_microbatch_size=1)
        self.parallel_dims = parallel_dims = ParallelDims.from_config(parallelism, world)
        parallel_dims.build_mesh()
        dist_utils.set_spmd_backend(parallelism.spmd_backend)
        training = TrainingConfig(local_batch_size=batch, seq_len=seq, mixed_precision_param="float32",
                                  mixed_precision_reduce="float32")
        _trainer_stand_in()
        spec.model.update_from_config(config=types.SimpleNamespace(parallelism=parallelism, training=training))
        with torch.device("meta"):
            m = spec.model.build()
        ac_config = None
        if ac:
            from torchtitan.distributed.activation_checkpoint import FullAC

            ac_config = FullAC.Config()
        compile_config = CompileConfig(enable=bool(compile_model),
                                       backend=compile_model if isinstance(compile_model, str) else "inductor")
        self.loss_fn = CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size).build()
        with tempfile.TemporaryDirectory() as dump:
            if pp > 1:
                self.schedule, parts_, self.first_stage, self.last_stage = spec.pipelining_fn(
                    m, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                    compile_config=compile_config, ac_config=ac_config, dump_folder=dump,
                    device=torch.device("cpu"), model_config=spec.model, parallelize_fn=spec.parallelize_fn,
                    loss_fn=self.loss_fn)
            else:
                parts_ = [spec.parallelize_fn(m, parallel_dims=parallel_dims, training=training,
                                              parallelism=parallelism, compile_config=compile_config,
                                              ac_config=ac_config, dump_folder=dump)]
        for part in parts_:
            for module in part.modules():  # shim: gloo has no PREMUL_SUM (FSDP2 then reduces with plain SUM)
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
            part.to_empty(device="cpu")
            torch.manual_seed(seed)
            with torch.no_grad():
                part.init_weights(buffer_device=None)
            part.train()
        self.parts = parts_
        self.model = parts_[0]
        if graft_optim:  # graft's container, as a job config names it (Adam/AdamW on fused.adam_step)
            from graft.adapters.torchtitan.optimizer import graft_adamw

            opt_config = graft_adamw(lr=1e-3)
        else:
            opt_config = default_adamw(lr=1e-3)
        opt_config.implementation = "for-loop"
        self.optim = opt_config.build(model_parts=parts_)
        self.context = dist_utils.get_spmd_context(parallel_dims=parallel_dims, spmd_typechecking=False)
        self.dp_rank = parallel_dims.get_mesh("fsdp").get_local_rank() if self.dp > 1 else 0

    def batch_from(self, gen):
        """This rank's inputs, labels and extra inputs from the global batch ``gen`` draws."""
        import torch
        from torchtitan.distributed.spmd_types import annotate_input_spmd_types

        batch, seq = self.batch, self.seq
        tokens = torch.randint(0, self.spec.model.vocab_size, (self.dp, batch, seq + 1), generator=gen)
        inputs, labels = tokens[self.dp_rank, :, :-1], tokens[self.dp_rank, :, 1:]
        extra = {"positions": torch.arange(seq).expand(batch, seq).contiguous()}
        masks = attention_masks(self.model, extra["positions"])  # as TorchTitan's trainer does
        if masks is not None:
            extra["attention_masks"] = masks
        if self.parallelism.spmd_backend == "spmd_types":
            inputs, labels, extra = annotate_input_spmd_types(self.parallel_dims, inputs, labels, extra)
        return inputs, labels, extra

    def step(self, inputs, labels, extra, after_backward=None):
        """One training step; returns this rank's loss (a tensor)."""
        import torch

        global_tokens = torch.tensor(float(labels.numel() * self.dp))
        self.optim.zero_grad()
        if self.pp > 1:
            # as TorchTitan's Trainer.pp_forward_backward_step, through torch 2.13's schedule API
            # (whole batch, split into microbatches of one row by the schedule); positions are
            # the default 0..seq-1, so no stage needs them passed
            losses = [] if self.last_stage else None
            with self.context():
                self.schedule.step(*((inputs,) if self.first_stage else ()),
                                   target=labels if self.last_stage else None, losses=losses,
                                   loss_kwargs={"global_valid_tokens": global_tokens}, return_outputs=False)
            if after_backward is not None:
                after_backward()
            self.optim.step()
            return torch.sum(torch.stack(losses)).detach() if self.last_stage else torch.zeros(())
        with self.context():
            pred = self.model(inputs, **extra)
            loss, _ = self.loss_fn(pred, labels, global_tokens)
            loss.backward()
        if after_backward is not None:
            after_backward()
        self.optim.step()
        return loss.detach()


def train_ranks(rank, world, model, graft_on, tp, steps, seed, n_layers, batch, seq, compile_model=False,
                ac=False, env=None, graft_optim=False, parts=None, attn_backend="flex", pp=1, experts_fp32=False):
    """One rank of a training job (:class:`Job`) for ``steps`` steps on synthetic tokens.
    Returns per-step global losses, step-1 gradients (rank 0, full tensors as numpy
    arrays), graft's counted calls and fallbacks, and how many graft modules the model holds.
    ``experts_fp32``: TorchTitan's experts compute in fp32 (test-only, :func:`fp32_experts`)."""
    import os

    if env:
        os.environ.update(env)
    import torch

    import graft
    from graft.adapters.torchtitan import modules as graft_modules
    from graft.adapters.torchtitan.integration import counter

    graft.reload_config()
    counter.reset()
    if experts_fp32:
        fp32_experts()
    job = Job(model, graft_on, tp, seed, n_layers, batch, seq, compile_model=compile_model, ac=ac,
              graft_optim=graft_optim, parts=parts, attn_backend=attn_backend, pp=pp)
    gen = torch.Generator().manual_seed(seed + 1)
    losses, grads = [], {}

    def keep_grads():
        for name, p in (item for part in job.parts for item in part.named_parameters()):
            g = p.grad
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
            grads[name] = g.detach().numpy().copy()  # numpy: pickled by value back to the launcher

    for step in range(steps):
        total = job.step(*job.batch_from(gen), after_backward=keep_grads if step == 0 else None).clone()
        torch.distributed.all_reduce(total)
        # each data-parallel rank's loss is its share of the global mean (TorchTitan divides by
        # the global token count); TP ranks hold the same share
        losses.append(total.item() / tp)
    held = [x for part in job.parts for x in part.modules()]
    kinds = {name: sum(isinstance(x, getattr(graft_modules, name)) for x in held)
             for name in ("GraftRMSNorm", "GraftFeedForward", "GraftRoutedExperts", "GraftVarlenAttention")
             if any(isinstance(x, getattr(graft_modules, name)) for x in held)}
    # each pipeline stage's own parameters: every rank's gradients under PP
    return {"losses": losses, "grads": grads if rank == 0 or pp > 1 else None, "served": dict(counter.served_calls()),
            "fallbacks": counter.fallbacks(), "modules": kinds,
            "optimizers": [type(o).__name__ for o in job.optim.optimizers],
            "n_params": sum(1 for part in job.parts for p in part.parameters() if p.requires_grad)}


# The bench's job: Llama 3 debugmodel (dim 256, vocab 2048), 2 layers, 2 x 32 tokens a rank.
BENCH = {"model": "llama3", "n_layers": 2, "batch": 2, "seq": 32}


def measure(tps, rounds: int, progress=print) -> list:
    """Per TP degree (the rest of the 2 ranks FSDP2): a TorchTitan step with graft's converter
    (graft's torch backend: the same kernels) against the same job without it, both jobs in the
    same processes, steps interleaved, barrier-synced; median of per-round ratios."""
    import torch
    import torch.distributed as dist

    from graft.adapters.torchtitan.integration import counter
    from graft.tools.bench.timing import framework_steps

    rows = []
    for tp in tps:
        jobs = {name: Job(BENCH["model"], name == "graft", tp, seed=0, n_layers=BENCH["n_layers"],
                          batch=BENCH["batch"], seq=BENCH["seq"]) for name in ("torchtitan", "graft")}
        data = jobs["graft"].batch_from(torch.Generator().manual_seed(1))
        losses: dict = {name: [] for name in jobs}

        def stepper(name):
            return lambda: losses[name].append(jobs[name].step(*data).item())

        row = {"tp": tp, **framework_steps({name: stepper(name) for name in jobs}, losses, counter.calls, rounds,
                                          "torchtitan", sync=dist.barrier)}
        progress(f"  torchtitan Llama3 debug step, FSDP{2 // tp}{f' TP{tp}' if tp > 1 else ''}: TorchTitan "
                 f"{row['torchtitan_ms']:7.2f} ms, with graft {row['graft_ms']:7.2f} ms -> {row['ratio']:.2f}x")
        rows.append(row)
    return rows
