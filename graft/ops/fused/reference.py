"""The torch definitions of the fused ops (fp32 math, one rounding to the input dtype)."""
from __future__ import annotations

import math

import torch

from graft.ops._validate import acc


def rms_norm_reference(x, weight, eps=1e-6, residual=None):
    xf = acc(x)
    if residual is not None:
        xf = xf + acc(residual)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = (xf * rstd * acc(weight)).to(x.dtype)
    if residual is None:
        return out
    return out, xf.to(x.dtype)


def layer_norm_reference(x, weight, bias=None, eps=1e-5):
    b = None if bias is None else acc(bias)
    return torch.nn.functional.layer_norm(acc(x), (x.shape[-1],), acc(weight), b, eps).to(x.dtype)


def silu_and_mul_reference(x):
    d = x.shape[-1] // 2
    if x.dtype is torch.float32:  # no conversions to skip: the framework's own expression
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:]
    xf = acc(x)
    return (torch.nn.functional.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def _rotate_reference(x, cos, sin, head_size, is_neox):
    """x: [T, H*D] or [T, H, D]; cos/sin: [T, rot_dim/2] fp32."""
    shape = x.shape
    xf = acc(x).reshape(shape[0], -1, head_size)
    rot_dim = cos.shape[-1] * 2
    rot, rest = xf[..., :rot_dim], xf[..., rot_dim:]
    c, s = cos[:, None, :], sin[:, None, :]
    if is_neox:
        x1, x2 = rot[..., : rot_dim // 2], rot[..., rot_dim // 2 :]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    if is_neox:
        rotated = torch.cat((o1, o2), dim=-1)
    else:
        rotated = torch.stack((o1, o2), dim=-1).flatten(-2)
    return torch.cat((rotated, rest), dim=-1).reshape(shape).to(x.dtype)


def rotary_embedding_reference(positions, q, k, head_size, cos_sin_cache, is_neox=True):
    pos = positions.reshape(-1).long()
    # Positions outside [0, max_position) (value checks off) leave their token unrotated.
    ok = (pos >= 0) & (pos < cos_sin_cache.shape[0])
    cos_sin = acc(cos_sin_cache).index_select(0, torch.where(ok, pos, 0))
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos = torch.where(ok[:, None], cos, 1.0)
    sin = torch.where(ok[:, None], sin, 0.0)
    q_out = _rotate_reference(q, cos, sin, head_size, is_neox)
    k_out = None if k is None else _rotate_reference(k, cos, sin, head_size, is_neox)
    return q_out, k_out


def adam_step_reference(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step,
                        weight_decay=0.0, adam_w_mode=True, bias_correction=True):
    p = param.float()
    g = grad.float()
    if not adam_w_mode and weight_decay:
        g = g + weight_decay * p
    m = beta1 * exp_avg.float() + (1.0 - beta1) * g
    v = beta2 * exp_avg_sq.float() + (1.0 - beta2) * g * g
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    update = (m / bc1) / (v.sqrt() / math.sqrt(bc2) + eps)
    if adam_w_mode and weight_decay:
        update = update + weight_decay * p
    p = p - lr * update
    return p.to(param.dtype), m.to(exp_avg.dtype), v.to(exp_avg_sq.dtype)
