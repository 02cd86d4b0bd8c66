"""Small fused ops the framework integrations need: RMSNorm (optionally fused with the
residual add), LayerNorm, SiLU-and-mul (the gated MLP activation) and rotary position embedding.

Semantics follow what vLLM, DeepSpeed and Megatron expect from these layers:

* ``rms_norm(x, weight, eps, residual=None)``: ``x * rsqrt(mean(x^2) + eps) * weight``
  over the last dim, reduced in fp32. With ``residual`` it is the fused residual-add
  variant: ``residual_out = x + residual`` and ``out = rms_norm(residual_out)``;
  returns ``(out, residual_out)``.
* ``layer_norm(x, weight, bias=None, eps)``: ``(x - mean) * rsqrt(var + eps) * weight + bias``
  over the last dim with fp32 statistics (biased variance), as ``torch.nn.LayerNorm``.
* ``silu_and_mul(x)``: ``silu(x[..., :D]) * x[..., D:]`` for ``x`` of last dim ``2*D``.
* ``rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox)``: rotates the
  first ``rot_dim`` features of every head of ``q`` and ``k`` by the angles of each
  token's position. ``cos_sin_cache[pos] = [cos(theta_0..), sin(theta_0..)]`` (each
  half ``rot_dim/2`` wide). Neox style rotates the two halves of the rotary part;
  GPT-J style rotates interleaved (even, odd) pairs. Features past ``rot_dim`` pass
  through (partial rotary). Functional: returns new ``(q_out, k_out)``. A position
  outside ``[0, max_position)`` is a ``GraftInputError`` with the value checks on; with
  them off (``GRAFT_CHECK_VALUES=0``, tracing, CUDA graphs) its token passes through
  unrotated (cos 1, sin 0) in every backend: no kernel reads outside the cache.

All compute in fp32 and round once to the input dtype.
"""
from __future__ import annotations

import math

import torch

from graft.cases import OpCase
from graft.dispatch import call
from graft.errors import GraftInputError
from graft.ops._validate import can_read_values, check_same_device, check_tensor, checks_values_on
from graft.registry import OpSpec

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------- references


def rms_norm_reference(x, weight, eps=1e-6, residual=None):
    xf = x.float()
    if residual is not None:
        xf = xf + residual.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = (xf * rstd * weight.float()).to(x.dtype)
    if residual is None:
        return out
    return out, xf.to(x.dtype)


def rms_norm_torch(x, weight, eps=1e-6, residual=None):
    """graft's torch backend of fused.rms_norm: torch's fused RMSNorm kernel
    (``F.rms_norm``, what ``torch.nn.RMSNorm`` runs) on the reference's fp32 values, rounded
    once to ``x``'s dtype; differentiable through torch's own backward."""
    xf = x.float()
    if residual is not None:
        xf = xf + residual.float()
    out = torch.nn.functional.rms_norm(xf, (xf.shape[-1],), weight.float(), eps).to(x.dtype)
    if residual is None:
        return out
    return out, xf.to(x.dtype)


def torch_implementations():
    """graft's torch backend of fused.rms_norm (ranks above the plain reference)."""
    from graft.registry import Implementation

    return [Implementation(
        op="fused.rms_norm", backend="torch", fn=rms_norm_torch, provider="graft",
        description="torch.nn.functional.rms_norm (what torch.nn.RMSNorm runs) on fp32 values",
        devices=frozenset({"cpu", "cuda", "xpu", "mps", "meta"}), priority=-50,
    )]


def layer_norm_reference(x, weight, bias=None, eps=1e-5):
    b = None if bias is None else bias.float()
    return torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(), b, eps).to(x.dtype)


def silu_and_mul_reference(x):
    d = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def _rotate_reference(x, cos, sin, head_size, is_neox):
    """x: [T, H*D] or [T, H, D]; cos/sin: [T, rot_dim/2] fp32."""
    shape = x.shape
    xf = x.float().reshape(shape[0], -1, head_size)
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
    cos_sin = cos_sin_cache.float().index_select(0, torch.where(ok, pos, 0))
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos = torch.where(ok[:, None], cos, 1.0)
    sin = torch.where(ok[:, None], sin, 0.0)
    q_out = _rotate_reference(q, cos, sin, head_size, is_neox)
    k_out = None if k is None else _rotate_reference(k, cos, sin, head_size, is_neox)
    return q_out, k_out


# --------------------------------------------------------------------------- validation


def _check_float(name, t):
    check_tensor(name, t, dtypes=FLOAT_DTYPES)


_FLOAT_SET = frozenset(FLOAT_DTYPES)


def validate_rms_norm(x, weight, eps=1e-6, residual=None):
    # Fast path: the common valid call in a few attribute reads (dispatch cost is per call);
    # anything else goes through the full checks below, which name the problem.
    if (residual is None and isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and x.dtype in _FLOAT_SET and weight.dtype in _FLOAT_SET and weight.ndim == 1 and x.ndim >= 1
            and weight.shape[0] == x.shape[-1] and type(eps) is float and 0.0 <= eps < math.inf
            and x.device == weight.device):
        return
    _check_float("fused.rms_norm: x", x)
    _check_float("fused.rms_norm: weight", weight)
    if x.dim() < 1:
        raise GraftInputError("fused.rms_norm: x must have at least 1 dim [..., hidden], got a scalar")
    hidden = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != hidden:
        raise GraftInputError(
            f"fused.rms_norm: weight must be 1-D of size hidden={hidden} (x's last dim), got shape {tuple(weight.shape)}"
        )
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:  # NaN fails >= 0
        raise GraftInputError(f"fused.rms_norm: eps must be a non-negative float (not NaN), got {eps!r}")
    if residual is not None:
        check_tensor("fused.rms_norm: residual", residual, dtypes=(x.dtype,))
        if residual.shape != x.shape:
            raise GraftInputError(
                f"fused.rms_norm: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
    check_same_device(x=x, weight=weight, residual=residual)


def validate_layer_norm(x, weight, bias=None, eps=1e-5):
    _check_float("fused.layer_norm: x", x)
    if x.dim() < 1:
        raise GraftInputError("fused.layer_norm: x must have at least 1 dim [..., hidden], got a scalar")
    hidden = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        check_tensor(f"fused.layer_norm: {name}", t, dtypes=(x.dtype,))
        if t.dim() != 1 or t.shape[0] != hidden:
            raise GraftInputError(
                f"fused.layer_norm: {name} must be 1-D of size hidden={hidden} (x's last dim), got shape {tuple(t.shape)}"
            )
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise GraftInputError(f"fused.layer_norm: eps must be a non-negative float, got {eps!r}")
    check_same_device(x=x, weight=weight, bias=bias)


def validate_silu_and_mul(x):
    if isinstance(x, torch.Tensor) and x.dtype in _FLOAT_SET and x.ndim >= 1 and not x.shape[-1] % 2:
        return  # fast path: the common valid call
    _check_float("fused.silu_and_mul: x", x)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise GraftInputError(
            f"fused.silu_and_mul: x must be [..., 2*D] with an even last dim, got shape {tuple(x.shape)}"
        )


def _check_heads(name, t, num_tokens, head_size):
    _check_float(f"fused.rotary_embedding: {name}", t)
    if t.dim() == 2:
        if t.shape[0] != num_tokens or t.shape[1] % head_size:
            raise GraftInputError(
                f"fused.rotary_embedding: {name} must be [num_tokens={num_tokens}, num_heads*head_size "
                f"(multiple of {head_size})], got shape {tuple(t.shape)}"
            )
    elif t.dim() == 3:
        if t.shape[0] != num_tokens or t.shape[2] != head_size:
            raise GraftInputError(
                f"fused.rotary_embedding: {name} must be [num_tokens={num_tokens}, num_heads, head_size={head_size}], "
                f"got shape {tuple(t.shape)}"
            )
    else:
        raise GraftInputError(
            f"fused.rotary_embedding: {name} must be [T, H*D] or [T, H, D], got shape {tuple(t.shape)}"
        )


def validate_rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox=True):
    # Fast path (value checks off, as on GPUs by default): 2-D q/k in a few attribute reads;
    # anything else goes through the full checks below, which name the problem.
    if (isinstance(positions, torch.Tensor) and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(cos_sin_cache, torch.Tensor) and type(head_size) is int and head_size > 0
            and positions.dtype in (torch.int64, torch.int32) and q.dtype in _FLOAT_SET and k.dtype == q.dtype
            and cos_sin_cache.dtype in _FLOAT_SET and q.ndim == 2 and k.ndim == 2 and cos_sin_cache.ndim == 2
            and q.shape[0] == positions.numel() and k.shape[0] == q.shape[0]
            and not q.shape[1] % head_size and not k.shape[1] % head_size
            and 0 < cos_sin_cache.shape[1] <= head_size and not cos_sin_cache.shape[1] % 2
            and type(is_neox) is bool and q.device == positions.device and k.device == positions.device
            and cos_sin_cache.device == positions.device and not checks_values_on(positions)):
        return
    check_tensor("fused.rotary_embedding: positions", positions, dtypes=(torch.int64, torch.int32))
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size <= 0:
        raise GraftInputError(f"fused.rotary_embedding: head_size must be a positive int, got {head_size!r}")
    num_tokens = positions.numel()
    _check_heads("q", q, num_tokens, head_size)
    if k is not None:
        _check_heads("k", k, num_tokens, head_size)
        if k.dtype != q.dtype:
            raise GraftInputError(f"fused.rotary_embedding: k has dtype {k.dtype}, q has {q.dtype}; they must match")
    check_tensor("fused.rotary_embedding: cos_sin_cache", cos_sin_cache, dtypes=FLOAT_DTYPES, ndim=2)
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim == 0 or rot_dim > head_size:
        raise GraftInputError(
            f"fused.rotary_embedding: cos_sin_cache must be [max_position, rot_dim] with even 0 < rot_dim <= "
            f"head_size={head_size}, got shape {tuple(cos_sin_cache.shape)}"
        )
    if not isinstance(is_neox, bool):
        raise GraftInputError(f"fused.rotary_embedding: is_neox must be a bool, got {is_neox!r}")
    check_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    if can_read_values(positions):
        max_position = cos_sin_cache.shape[0]
        lo, hi = torch.aminmax(positions)  # one pass; the details only when something is out of range
        bad = positions[(positions < 0) | (positions >= max_position)] if lo < 0 or hi >= max_position else positions[:0]
        if bad.numel():
            raise GraftInputError(
                f"fused.rotary_embedding: positions must lie in [0, max_position = {max_position}) "
                f"(cos_sin_cache rows), got {int(bad[0])} ({bad.numel()} such positions)"
            )


# --------------------------------------------------------------------------- public entry points


def rms_norm(x, weight, eps: float = 1e-6, residual=None):
    """RMSNorm over the last dim; with ``residual``, returns ``(out, x + residual)``."""
    return call("fused.rms_norm", x, weight, eps, residual)


def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    """LayerNorm over the last dim: ``(x - mean) * rsqrt(var + eps) * weight + bias`` (fp32 statistics)."""
    return call("fused.layer_norm", x, weight, bias, eps)


def silu_and_mul(x):
    """``silu(x[..., :D]) * x[..., D:]`` for ``x`` of shape ``[..., 2*D]``."""
    return call("fused.silu_and_mul", x)


def rotary_embedding(positions, q, k, head_size: int, cos_sin_cache, is_neox: bool = True):
    """Rotary position embedding of ``q`` and ``k`` (``k`` may be None); returns ``(q_out, k_out)``."""
    return call("fused.rotary_embedding", positions, q, k, head_size, cos_sin_cache, is_neox)


OPS = [
    OpSpec(
        name="fused.rms_norm",
        family="fused",
        signature="rms_norm(x[..., H], weight[H], eps: float = 1e-6, residual[..., H] | None = None)"
        " -> out | (out, residual_out)",
        reference=rms_norm_reference,
        description="RMSNorm over the last dim (fp32 reduction), optionally fused with the residual add",
        validate=validate_rms_norm,
        grad_inputs=(0, 1, 3),
        validate_cache="always",  # metadata only
    ),
    OpSpec(
        name="fused.layer_norm",
        family="fused",
        signature="layer_norm(x[..., H], weight[H], bias[H] | None = None, eps: float = 1e-5) -> out",
        reference=layer_norm_reference,
        description="LayerNorm over the last dim (fp32 mean and variance, biased), optional bias",
        validate=validate_layer_norm,
        grad_inputs=(0, 1, 2),
        validate_cache="always",  # metadata only
    ),
    OpSpec(
        name="fused.silu_and_mul",
        family="fused",
        signature="silu_and_mul(x[..., 2*D]) -> [..., D]",
        reference=silu_and_mul_reference,
        description="silu(x[..., :D]) * x[..., D:] (gated-MLP activation)",
        validate=validate_silu_and_mul,
        grad_inputs=(0,),
        validate_cache="always",  # metadata only
    ),
    OpSpec(
        name="fused.rotary_embedding",
        family="fused",
        signature="rotary_embedding(positions[T] int64, q[T, Hq*D | Hq, D], k[T, Hk*D | Hk, D] | None, "
        "head_size: int, cos_sin_cache[max_pos, rot_dim], is_neox: bool = True) -> (q_out, k_out)",
        reference=rotary_embedding_reference,
        description="rotary position embedding, neox or GPT-J style, partial rotary (rot_dim <= head_size)",
        key_arg=1,
        validate=validate_rotary_embedding,
        grad_inputs=(1, 2),
    ),
]


# --------------------------------------------------------------------------- cases


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
