"""The fused ops' conformance cases (and ``cos_sin_cache``, a rotary table builder)."""
from __future__ import annotations

import torch

from graft.cases import OpCase
from graft.ops.fused import OP


def _randn(shape, device, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _rms_case(name, shape, residual, tags=frozenset({"quick"})):
    def make(device, dtype, gen):
        x = _randn(shape, device, dtype, gen)
        w = (1.0 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device=device, dtype=dtype)
        r = _randn(shape, device, dtype, gen) if residual else None
        return (x, w, 1e-6, r), {}

    def moved(args, kwargs):
        x = args[0]
        return x.numel() * x.element_size() * (4 if residual else 2)

    return OpCase("fused.rms_norm", name + ("_residual" if residual else ""), make, tags=tags, flops=moved)


def _ln_case(name, shape, bias=True, tags=frozenset({"quick"})):
    def make(device, dtype, gen):
        x = _randn(shape, device, dtype, gen, scale=2.0) + 0.5
        w = (1.0 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device=device, dtype=dtype)
        b = _randn((shape[-1],), device, dtype, gen, scale=0.1) if bias else None
        return (x, w, b, 1e-5), {}

    def moved(args, kwargs):
        x = args[0]
        return x.numel() * x.element_size() * 2

    return OpCase("fused.layer_norm", name + ("" if bias else "_nobias"), make, tags=tags, flops=moved)


def _silu_case(name, shape, tags=frozenset({"quick"})):
    def make(device, dtype, gen):
        return (_randn(shape, device, dtype, gen, scale=2.0),), {}

    def moved(args, kwargs):
        x = args[0]
        return x.numel() * x.element_size() * 3 // 2

    return OpCase("fused.silu_and_mul", name, make, tags=tags, flops=moved)


def cos_sin_cache(max_position: int, rot_dim: int, base: float = 10000.0, dtype=torch.float32, device="cpu"):
    """The standard rotary cache: ``[max_position, rot_dim]`` = ``[cos | sin]`` of ``pos * base^(-2i/rot_dim)``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device=device, dtype=dtype)


def _rope_case(name, tokens, q_heads, k_heads, head_size, rot_dim, is_neox, three_d=False, with_k=True,
               tags=frozenset({"quick"})):
    def make(device, dtype, gen):
        max_pos = 4 * tokens + 7
        positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
        shape_q = (tokens, q_heads, head_size) if three_d else (tokens, q_heads * head_size)
        shape_k = (tokens, k_heads, head_size) if three_d else (tokens, k_heads * head_size)
        q = _randn(shape_q, device, dtype, gen)
        k = _randn(shape_k, device, dtype, gen) if with_k else None
        return (positions, q, k, head_size, cos_sin_cache(max_pos, rot_dim, device=device), is_neox), {}

    def moved(args, kwargs):
        q, k = args[1], args[2]
        return 2 * (q.numel() + (0 if k is None else k.numel())) * q.element_size()

    style = "neox" if is_neox else "gptj"
    # Without k the second output is None: compare q_out only.
    normalize = None if with_k else (lambda out: out[0])
    return OpCase("fused.rotary_embedding", f"{name}_{style}", make, tags=tags, flops=moved, normalize=normalize)


_GPU = frozenset({"gpu"})


CASES = [
    _rms_case("t1_h33", (1, 33), False),
    _rms_case("t1_h33", (1, 33), True),
    _rms_case("t7_h128", (7, 128), False),
    _rms_case("b3_t5_h64", (3, 5, 64), True),
    _rms_case("t3_h4097", (3, 4097), False),
    _rms_case("t3_h4097", (3, 4097), True),
    _rms_case("t0_h64_empty", (0, 64), True),
    _rms_case("t4096_h4096", (4096, 4096), False, _GPU),
    _rms_case("t4096_h8192", (4096, 8192), True, _GPU),
    _ln_case("t1_h33", (1, 33)),
    _ln_case("t7_h128", (7, 128), bias=False),
    _ln_case("b3_t5_h64", (3, 5, 64)),
    _ln_case("t3_h1025", (3, 1025)),
    _ln_case("t0_h64_empty", (0, 64)),
    _ln_case("t4096_h4096", (4096, 4096), tags=_GPU),
    _silu_case("t1_d33", (1, 66)),
    _silu_case("t5_d128", (5, 256)),
    _silu_case("b2_t3_d17", (2, 3, 34)),
    _silu_case("t3_d2049", (3, 4098)),
    _silu_case("t0_d16_empty", (0, 32)),
    _silu_case("t4096_d11008", (4096, 22016), _GPU),
    _rope_case("t5_hq4_hk2_d64", 5, 4, 2, 64, 64, True),
    _rope_case("t5_hq4_hk2_d64", 5, 4, 2, 64, 64, False),
    _rope_case("t3_hq3_hk1_d80_rot32", 3, 3, 1, 80, 32, True),
    _rope_case("t3_hq3_hk1_d80_rot32", 3, 3, 1, 80, 32, False),
    _rope_case("t4_hq2_hk2_d72_rot40_3d", 4, 2, 2, 72, 40, False, three_d=True),
    _rope_case("t2_hq2_d32_no_k", 2, 2, 0, 32, 32, True, with_k=False),
    _rope_case("t4096_hq32_hk8_d128", 4096, 32, 8, 128, 128, True, tags=_GPU),
    _rope_case("t4096_hq32_hk8_d128", 4096, 32, 8, 128, 128, False, tags=_GPU),
]


def _adam_case(name, shape, step, weight_decay, adam_w_mode, bias_correction=True, fp32_states=False,
               tags=frozenset({"quick"})):
    def make(device, dtype, gen):
        param = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        grad = (0.1 * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)
        state_dtype = torch.float32 if fp32_states else dtype
        exp_avg = (0.01 * torch.randn(shape, generator=gen)).to(device=device, dtype=state_dtype)
        exp_avg_sq = (1e-4 * torch.rand(shape, generator=gen)).to(device=device, dtype=state_dtype)
        return (param, grad, exp_avg, exp_avg_sq, 1e-3, 0.9, 0.999, 1e-8, step,
                weight_decay, adam_w_mode, bias_correction), {}

    def moved(args, kwargs):
        return sum(t.numel() * t.element_size() for t in args[:4]) * 7 // 4  # read 4, write 3

    return OpCase(OP, name, make, tags=tags, flops=moved)


CASES += [
    _adam_case("n1_step1_adamw", (1,), 1, 0.01, True),
    _adam_case("n7_step3_adam_l2", (7,), 3, 0.1, False),
    _adam_case("n33x65_step10_adamw", (33, 65), 10, 0.01, True),
    _adam_case("n129_step2_nodecay_nobias", (129,), 2, 0.0, True, bias_correction=False),
    _adam_case("n17x3_fp32_states", (17, 3), 5, 0.05, True, fp32_states=True),
    _adam_case("n16M_adamw", (4096, 4096), 100, 0.01, True, tags=frozenset({"gpu"})),
]
