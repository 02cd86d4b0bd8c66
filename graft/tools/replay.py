"""Arguments of a recorded call (a ``graft-shapes/1`` entry: what ``graft profile`` writes and
``graft tune --shapes`` reads), drawn again: tensors of the recorded shapes and dtypes,
scalars as recorded, keyword arguments included.

Random integers are not valid index tensors: cumulative lengths must rise to the token count,
block tables must name blocks the cache has, positions must be inside the rotary cache,
expert ids distinct per token and inside the expert count. So the index arguments are drawn
from the other arguments' shapes, by parameter name (:data:`INDEX_ARGS`), the way each op's
own test cases build them; a recorded ``"values"`` list (small integer tensors) is used as is.
"""
from __future__ import annotations

import inspect

import torch

from graft.errors import GraftConfigError

_ALIASES = {"float": "float32", "half": "float16", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def dtype_of(name) -> torch.dtype:
    """A torch dtype from its name ("float32", "bf16", "torch.int64"...), or GraftConfigError."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).replace("torch.", "")
    key = _ALIASES.get(key, key)
    value = getattr(torch, key, None)
    if not isinstance(value, torch.dtype):
        raise GraftConfigError(f"dtype {name!r} is not a torch dtype (float32, float16, bfloat16, int32...)")
    return value


def _tensor(spec: dict, default_dtype, device, gen, where: str) -> torch.Tensor:
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise GraftConfigError(f"{where}: 'shape' must be a list of non-negative ints, got {shape!r:.100}")
    dtype = dtype_of(spec["dtype"]) if "dtype" in spec else default_dtype
    if device.type == "meta":
        return torch.empty(shape, dtype=dtype, device=device)
    if "values" in spec:
        try:
            return torch.tensor(spec["values"], dtype=dtype, device=device).reshape(shape)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise GraftConfigError(f"{where}: 'values' do not make a {dtype} tensor of shape {shape}: {exc}") from None
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen, device=device)
        if "scale" in spec:
            t *= float(spec["scale"])
        if spec.get("softmax"):
            t = t.softmax(dim=-1)
        return t.to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, device=device).bool()
    high = spec.get("high", 2)
    if not isinstance(high, int) or high < 1:
        raise GraftConfigError(f"{where}: 'high' must be a positive int, got {high!r}")
    if dtype == torch.int32 and len(shape) == 2 and "high" in spec and shape[-1] <= high:
        # distinct ids per row (top-k): the first k of a random order of all ids
        return torch.rand(shape[0], high, generator=gen, device=device).argsort(dim=-1)[:, : shape[-1]].to(dtype)
    return torch.randint(0, high, shape, generator=gen, device=device).to(dtype)


def _value(item, default_dtype, device, gen, where: str):
    if isinstance(item, dict) and "shape" in item:
        return _tensor(item, default_dtype, device, gen, where)
    if isinstance(item, dict) and "torch_dtype" in item:
        return dtype_of(item["torch_dtype"])
    if isinstance(item, dict) and "type" in item:
        raise GraftConfigError(f"{where}: a {item['type']} argument was recorded by type only; it cannot be replayed")
    if isinstance(item, list):
        return [_value(v, default_dtype, device, gen, f"{where}[{i}]") for i, v in enumerate(item)]
    if item is None or isinstance(item, (bool, int, float, str)):
        return item
    raise GraftConfigError(f"{where}: {item!r:.100} is neither a literal nor a tensor {{'shape': [...]}}")


def _segments(total: int, count: int) -> list:
    """``count`` lengths summing to ``total``, as even as can be."""
    if count <= 0:
        return []
    base, extra = divmod(total, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def _cumulative(lengths: list, like: torch.Tensor) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=like.dtype, device=like.device)


def _fix_indices(op: str, values: dict) -> None:
    """Index arguments made valid from the other arguments' shapes (see the module doc)."""
    def tensor(name):
        v = values.get(name)
        return v if isinstance(v, torch.Tensor) and v.device.type != "meta" else None

    for side, tokens_from in (("q", ("q", "query")), ("k", ("k",))):
        cu = tensor(f"cu_seqlens_{side}")
        source = next((values[n] for n in tokens_from if isinstance(values.get(n), torch.Tensor)), None)
        if cu is None or source is None or cu.dim() != 1 or cu.numel() < 1:
            continue
        lengths = _segments(int(source.shape[0]), cu.numel() - 1)
        values[f"cu_seqlens_{side}"] = _cumulative(lengths, cu)
        key = f"max_seqlen_{side}"
        if isinstance(values.get(key), int) and lengths:
            values[key] = max(values[key], max(lengths))
    tables, cache = tensor("block_tables"), values.get("key_cache")
    if tables is not None and isinstance(cache, torch.Tensor) and tables.dim() == 2:
        blocks = int(cache.shape[0])
        ids = torch.arange(tables.numel(), device=tables.device) % max(blocks, 1)
        values["block_tables"] = ids.reshape(tables.shape).to(tables.dtype)
        seq_lens = tensor("seq_lens")
        if seq_lens is not None and cache.dim() >= 2:
            capacity = int(tables.shape[1]) * int(cache.shape[1])
            lens = torch.full(seq_lens.shape, capacity, dtype=seq_lens.dtype, device=seq_lens.device)
            cu = values.get("cu_seqlens_q")
            if isinstance(cu, torch.Tensor) and cu.numel() == seq_lens.numel() + 1:
                # a paged prefill's context holds at least its new tokens
                lens = torch.maximum(lens, (cu[1:] - cu[:-1]).to(lens.dtype))
            values["seq_lens"] = lens
    positions, rotary = tensor("positions"), values.get("cos_sin_cache")
    if positions is not None and isinstance(rotary, torch.Tensor):
        high = max(int(rotary.shape[0]), 1)
        values["positions"] = (torch.arange(positions.numel(), device=positions.device) % high).reshape(
            positions.shape).to(positions.dtype)
    ids = tensor("topk_ids")
    if ids is not None and ids.dim() == 2:
        experts = values.get("num_experts")
        for name in ("w13", "w13_q"):
            if isinstance(values.get(name), torch.Tensor):
                experts = int(values[name].shape[0])
        if isinstance(experts, int) and experts >= ids.shape[1] >= 1:
            rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
            values["topk_ids"] = ((rows + torch.arange(ids.shape[1], device=ids.device)) % experts).to(ids.dtype)
    target, weight = tensor("target"), values.get("weight")
    if target is not None and isinstance(weight, torch.Tensor) and op.startswith("loss."):
        vocab = max(int(weight.shape[0]), 1)
        values["target"] = (torch.arange(target.numel(), device=target.device) % vocab).reshape(
            target.shape).to(target.dtype)


def call_arguments(entry: dict, spec, device, gen: torch.Generator | None, where: str = "shape entry") -> tuple:
    """``(args, kwargs)`` of one recorded call of ``spec``'s op on ``device``, drawn from
    ``gen``; on ``meta`` (shapes only) nothing is drawn or fixed up."""
    device = torch.device(device)
    default = dtype_of(entry.get("dtype", "float32"))
    raw_args, raw_kwargs = entry.get("args", []), entry.get("kwargs") or {}
    if not isinstance(raw_args, list):
        raise GraftConfigError(f"{where}: 'args' must be a list, got {type(raw_args).__name__}")
    if not isinstance(raw_kwargs, dict):
        raise GraftConfigError(f"{where}: 'kwargs' must be an object, got {type(raw_kwargs).__name__}")
    args = [_value(a, default, device, gen, f"{where} argument {i}") for i, a in enumerate(raw_args)]
    kwargs = {k: _value(v, default, device, gen, f"{where} argument {k!r}") for k, v in raw_kwargs.items()}
    names = list(inspect.signature(spec.reference).parameters)
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise GraftConfigError(f"{where}: {spec.name} takes no argument {', '.join(map(repr, unknown))}")
    if device.type != "meta":
        values = dict(zip(names, args), **kwargs)
        _fix_indices(spec.name, values)
        args = [values[n] for n in names[: len(args)]]
        kwargs = {k: values[k] for k in kwargs}
    return tuple(args), kwargs
