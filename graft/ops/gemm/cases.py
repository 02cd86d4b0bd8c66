"""The GEMM ops' conformance cases and their input builders."""
from __future__ import annotations

import math

import torch

from graft.cases import OpCase
from graft.ops.gemm import FLOAT_DTYPES, W8A8_OUT_DTYPES, w4a16_dims
from graft.quant import FORMATS


def _randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


def _linear_inputs(lead, n, k, bias, activation):
    def make(device, dtype, gen):
        x = _randn(gen, *lead, k).to(device, dtype)
        w = _randn(gen, n, k, scale=1.0 / math.sqrt(k)).to(device, dtype)
        b = _randn(gen, n).to(device, dtype) if bias else None
        return (x, w, b, activation), {}

    return make


def _w8a8_inputs(m, n, k, per_tensor, bias):
    def make(device, out_dtype, gen):
        x_q = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
        w_q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        # Scales sized so the output is O(1): uniform int8 codes have std ~73, so x_q * xs
        # is ~unit and w_q * ws ~1/sqrt(K).
        xs0, ws0 = 1.0 / 73.0, 1.0 / (73.0 * math.sqrt(k))
        if per_tensor:
            xs, ws = torch.tensor(xs0), torch.tensor(ws0)
        else:
            xs = (torch.rand(m, 1, generator=gen) + 0.5) * xs0
            ws = (torch.rand(n, generator=gen) + 0.5) * ws0
        b = _randn(gen, n).to(out_dtype) if bias else None
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        return (to(x_q), to(w_q), to(xs.float()), to(ws.float()), to(b), out_dtype), {}

    return make


def _w4a16_inputs(lead, n, k, group_size, fmt, zeros=True, bias=False):
    from graft.quant import pack_int4

    def make(device, dtype, gen):
        g = k if group_size == -1 else group_size
        q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
        z = torch.randint(1, 16, (k // g, n), generator=gen, dtype=torch.int32) if zeros else None
        qweight, qzeros = pack_int4(q, z, fmt)
        scales = (torch.rand(k // g, n, generator=gen) + 0.5) / (4.0 * math.sqrt(k))
        x = _randn(gen, *lead, k)
        b = _randn(gen, n).to(device, dtype) if bias else None
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        return (x.to(device, dtype), to(qweight), scales.to(device, dtype), to(qzeros), b, group_size, fmt), {}

    return make


def _fp8_inputs(m, n, k, scales, bias):
    from graft.quant import quantize_fp8_block, quantize_fp8_per_tensor, quantize_fp8_per_token_group

    def make(device, out_dtype, gen):
        x = _randn(gen, m, k)
        w = _randn(gen, n, k, scale=1.0 / math.sqrt(k))
        if scales == "block":
            (x_q, xs), (w_q, ws) = quantize_fp8_per_token_group(x), quantize_fp8_block(w)
        elif scales == "tensor":
            (x_q, xs), (w_q, ws) = quantize_fp8_per_tensor(x), quantize_fp8_per_tensor(w)
        else:  # per token x per channel
            whole_row = max(k, 1)  # one group spanning K: one scale per row
            (x_q, xs), (w_q, ws) = quantize_fp8_per_token_group(x, whole_row), quantize_fp8_per_token_group(w, whole_row)
        b = _randn(gen, n).to(out_dtype) if bias else None
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        return (to(x_q), to(w_q), to(xs.float()), to(ws.float()), to(b), out_dtype), {}

    return make


def _reduction_k(args, kwargs):
    return args[0].shape[-1]


def _flops_linear(args, kwargs):
    x, w = args[0], args[1]
    return 2.0 * x.numel() * w.shape[0]


def _flops_w8a8(args, kwargs):
    x_q, w_q = args[0], args[1]
    return 2.0 * x_q.shape[0] * x_q.shape[1] * w_q.shape[0]


def _flops_fp8(args, kwargs):
    return _flops_w8a8(args, kwargs)


def _flops_w4a16(args, kwargs):
    x, qweight, fmt = args[0], args[1], args[6]
    _, n = w4a16_dims(x, qweight, fmt)
    return 2.0 * x.numel() * n


_QUICK = frozenset({"quick"})
_GPU = frozenset({"gpu"})
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _case(op, name, make, dtypes, tags, flops):
    return OpCase(op, name, make, dtypes, tags, flops=flops, reduction=_reduction_k)


def _lead_name(lead):
    return "x".join(map(str, lead))


def _cases():
    cases = []
    for lead, n, k, bias, act in [
        ((1,), 7, 16, False, "none"),
        ((3,), 48, 33, True, "relu"),
        ((17,), 129, 128, True, "gelu"),
        ((64,), 48, 96, False, "gelu_erf"),
        ((2, 5), 33, 64, True, "silu"),
    ]:
        name = f"m{_lead_name(lead)}_n{n}_k{k}{'_bias' if bias else ''}_{act}"
        make = _linear_inputs(lead, n, k, bias, act)
        cases.append(_case("gemm.linear", name, make, FLOAT_DTYPES, _QUICK, _flops_linear))
    for m, n, k, act in [(4096, 4096, 4096, "none"), (16, 4096, 4096, "none"), (2048, 11008, 4096, "silu")]:
        make = _linear_inputs((m,), n, k, False, act)
        cases.append(_case("gemm.linear", f"m{m}_n{n}_k{k}_{act}", make, _HALF_DTYPES, _GPU, _flops_linear))
    for m, n, k, per_tensor, bias in [(1, 7, 16, False, False), (17, 48, 33, True, True), (64, 129, 128, False, True)]:
        name = f"m{m}_n{n}_k{k}_{'per_tensor' if per_tensor else 'per_token'}{'_bias' if bias else ''}"
        make = _w8a8_inputs(m, n, k, per_tensor, bias)
        cases.append(_case("gemm.w8a8", name, make, W8A8_OUT_DTYPES, _QUICK, _flops_w8a8))
    for m, n, k in [(4096, 4096, 4096), (16, 4096, 4096)]:
        make = _w8a8_inputs(m, n, k, False, False)
        cases.append(_case("gemm.w8a8", f"m{m}_n{n}_k{k}_per_token", make, W8A8_OUT_DTYPES, _GPU, _flops_w8a8))
    for fmt in FORMATS:
        # gptq_interleaved needs K in blocks of 128; its group of 32 takes 2 MMA slices per step
        ks = (128, 128, 128, 256) if fmt == "gptq_interleaved" else (32, 64, 128, 256)
        for (lead, n, g, zeros, bias), k in zip([
            ((1,), 8, 32, True, False),
            ((3,), 24, -1, True, True),
            ((17,), 136, 64, False, False),
            ((2, 3), 16, 128, True, False),
        ], ks):
            name = f"{fmt}_m{_lead_name(lead)}_n{n}_k{k}_g{g}{'' if zeros else '_sym'}{'_bias' if bias else ''}"
            make = _w4a16_inputs(lead, n, k, g, fmt, zeros, bias)
            cases.append(_case("gemm.w4a16", name, make, _HALF_DTYPES, _QUICK, _flops_w4a16))
        for m, n, k in [(16, 4096, 4096), (4096, 4096, 4096)]:
            make = _w4a16_inputs((m,), n, k, 128, fmt)
            cases.append(_case("gemm.w4a16", f"{fmt}_m{m}_n{n}_k{k}_g128", make, _HALF_DTYPES, _GPU, _flops_w4a16))
    for m, n, k, scales, bias in [(1, 7, 16, "tensor", False), (17, 48, 33, "row", True), (5, 130, 300, "block", False),
                                  (64, 129, 128, "block", True)]:
        make = _fp8_inputs(m, n, k, scales, bias)
        cases.append(_case("gemm.fp8", f"m{m}_n{n}_k{k}_{scales}{'_bias' if bias else ''}", make, _HALF_DTYPES, _QUICK,
                           _flops_fp8))
    for m, n, k in [(16, 4096, 4096), (4096, 4096, 4096)]:
        make = _fp8_inputs(m, n, k, "block", False)
        cases.append(_case("gemm.fp8", f"m{m}_n{n}_k{k}_block", make, _HALF_DTYPES, _GPU, _flops_fp8))
    return cases


CASES = _cases()
