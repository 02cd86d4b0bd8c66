"""The op registry: op specifications and the implementations that serve them.

An :class:`OpSpec` names an op (``"attention.prefill"``), its family, a typed
signature, and its torch reference. Each :class:`Implementation` is one way of
running it (``backend`` = ``"torch"``, ``"triton"``, ``"hip"``, or anything a plugin
defines) and declares what it supports: device types, dtypes, architectures,
environment availability, and a per-call check for shapes and features.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from graft.errors import GraftError
from graft.platform import dtype_name

FAMILIES = ("attention", "gemm", "moe", "collectives", "fused", "loss")
FAMILY_DESCRIPTIONS = {
    "attention": "prefill flash-attention (causal, varlen, GQA) and paged-KV decode",
    "gemm": "dense fp16/bf16 GEMM with epilogues, W8A8 int8, W4A16 GPTQ/AWQ",
    "moe": "top-k routing, token alignment, fused grouped expert GEMMs",
    "collectives": "all-reduce, all-gather, reduce-scatter and GEMM/comm overlap",
    "fused": "small fused ops the framework integrations need (RMSNorm, SiLU-and-mul, rotary)",
    "loss": "training losses fused with the output projection (linear + cross-entropy, chunked over tokens)",
}


@dataclass(frozen=True)
class SignatureHooks:
    """How dispatch validates and remembers the argument signatures of an op whose validation
    depends on more than its arguments: a collective's cross-rank agreement is made for one
    process group, so the group belongs to the signature, and agreeing is done once per
    signature by the op's own planner. Dispatch calls these instead of special-casing a family.

    ``validate(op, *args)``: the cold path's validation of a positional call (outside tracing;
    keyword calls run the spec's ``validate``). ``context()``: the callable a remembered
    signature calls on every call to compare (the default group), built once. ``identity()``:
    the current context, or None when there is none to tie a signature to (nothing is then
    remembered). ``may_remember()``: whether signatures may be remembered under the settings in
    force (asked when a plan is built)."""

    validate: Callable
    context: Callable[[], Callable]
    identity: Callable[[], object]
    may_remember: Callable[[], bool]


@dataclass(frozen=True)
class OpSpec:
    """An op every backend implements the same way.

    ``reference`` is the torch implementation that defines the op's semantics.
    ``key_arg`` is the position of the tensor argument whose device and dtype drive
    backend selection. ``validate`` (optional) raises GraftInputError on bad input
    before any implementation runs, so every backend rejects bad input the same way.

    ``validate_cache`` says when dispatch may skip ``validate`` for arguments whose
    metadata (tensor shapes, dtypes and devices; scalar types and values) already passed
    it: ``"values"`` (the default) only while value checks are off for the key tensor's
    device (a validator may read tensor values: ``can_read_values``); ``"always"`` for a
    validator that reads metadata only; ``"never"`` to validate every call.
    ``validate_varying`` (optional) takes, by name, the scalar arguments whose values
    change from call to call (a step count, a learning rate) and checks them as
    ``validate`` does: a remembered signature then matches them by type only, and
    ``validate_varying`` runs on every call instead of ``validate``.
    ``check_values`` (optional) holds the checks that read tensor values (cu_seqlens, block
    tables, expert ids...), apart from the metadata: ``validate`` runs them too (by calling
    it), and a signature remembered while value checks are on runs only them on each call
    instead of the whole validator. It takes, by name, the validator's arguments it reads;
    scalars among them are matched by type only and must be checked by it (a
    ``max_seqlen`` that changes every call), and those of them a call may leave to their
    default come last. It reads values only where ``can_read_values`` allows. An op with
    ``check_values`` has no ``validate_varying``.
    """

    name: str
    family: str
    signature: str
    reference: Callable
    description: str = ""
    key_arg: int = 0
    validate: Callable | None = None
    dtypes: tuple = (torch.float16, torch.bfloat16, torch.float32)
    # Positions of the arguments that take gradients (activations, parameters; not positions,
    # caches, ids or scales): what `graft conformance --grad` differentiates. Empty: no gradient.
    grad_inputs: tuple = ()
    validate_cache: str = "values"
    validate_varying: Callable | None = None
    check_values: Callable | None = None
    # How dispatch validates and remembers signatures when validation depends on more than the
    # arguments (the collectives: see SignatureHooks); None for every other op.
    signature_hooks: SignatureHooks | None = None

    @property
    def varying_names(self) -> tuple:
        """The arguments a remembered signature may take from call to call without being
        a new signature (scalars among them are matched by type only): the parameters of
        ``validate_varying`` or ``check_values``. A tuning table's shape bucket leaves their
        scalar values out too (graft.tuning.bucket), so that a call's table choice depends
        on what its signature fixes and not on which call came first."""
        varying = self.validate_varying or self.check_values
        if varying is None:
            return ()
        try:
            return tuple(inspect.signature(varying).parameters)
        except (TypeError, ValueError):
            return ()

    def __post_init__(self):
        if self.check_values is not None and self.validate_varying is not None:
            raise GraftError(f"op {self.name!r}: check_values and validate_varying cannot both be given "
                             "(check_values checks the varying scalars it takes)")
        if self.validate_cache not in ("values", "always", "never"):
            raise GraftError(f"op {self.name!r}: validate_cache must be 'values', 'always' or 'never', "
                             f"got {self.validate_cache!r}")
        if self.family not in FAMILIES:
            raise GraftError(f"op {self.name!r}: unknown family {self.family!r}; families are {', '.join(FAMILIES)}")
        if not self.name.startswith(self.family + "."):
            raise GraftError(f"op name {self.name!r} must start with its family, e.g. '{self.family}.xyz'")


# A check returns None when it can serve the request, else the reason it cannot.
Check = Callable[..., "str | None"]


@dataclass(frozen=True)
class Implementation:
    """One way of running an op, and what it can serve."""

    op: str
    backend: str
    fn: Callable
    provider: str = ""  # filled with the registering plugin's name by the plugin host
    description: str = ""
    devices: frozenset = frozenset({"cpu", "cuda"})
    dtypes: frozenset | None = None  # None: any dtype the op accepts
    archs: tuple | None = None  # arch prefixes ("sm_9", "gfx94"); None: any (CPU included)
    available: Callable[[], "str | None"] | None = None  # environment check, e.g. toolchain present
    check: Check | None = None  # per-call check on the op's actual arguments
    # Declares that ``check`` reads only the arguments' metadata (shapes, strides, dtypes,
    # devices, which are None) and the scalar arguments named here: a remembered argument
    # signature then keeps the check's answer, decided on its first call instead of every
    # call (unless a named scalar is one the op checks on every call: OpSpec.validate_varying
    # or check_values). None: the check may read values and runs on every call.
    check_scalars: tuple | None = None
    custom_op: object = None  # the torch.ops handle when exposed as a torch.library op
    priority: int = 0  # tie-break between impls of the same backend: higher first
    # The framework whose own code this is ("vllm": vLLM's kernel for the op), registered
    # through the graft_framework_implementations hook (see graft.framework_backend); "" for
    # graft's and vendors' implementations.
    framework: str = ""

    @property
    def key(self) -> str:
        return f"{self.op}:{self.backend}:{self.provider}"

    def call_reason(self, args: tuple, kwargs: dict) -> str | None:
        """The per-call check's reason not to serve these arguments (None: it can serve).

        A check that raises is a reason too, naming the plugin: the next candidate serves.
        """
        if self.check is None:
            return None
        try:
            return self.check(*args, **kwargs)
        except Exception as exc:
            return f"{self.provider or self.backend}'s check() raised {type(exc).__name__}: {exc}"

    def reason(self, device_type: str, dtype: torch.dtype | None, arch: str | None,
               args: tuple | None = None, kwargs: dict | None = None) -> str | None:
        """Why this impl cannot serve a request, or None if it can: the static reasons,
        then, given the call's arguments, the per-call check. Selection asks the two parts
        separately (the first is cached per device and dtype); conformance asks this."""
        reason = self.static_reason(device_type, dtype, arch)
        if reason is None and args is not None:
            reason = self.call_reason(args, kwargs or {})
        return reason

    def static_reason(self, device_type: str, dtype: torch.dtype | None, arch: str | None) -> str | None:
        """Why this impl cannot serve a (device, dtype, arch) request, or None if it can.

        Environment availability is asked first: "no GPU and TRITON_INTERPRET unset" tells
        a user more than "device type 'cpu' not supported".
        """
        if self.available is not None:
            try:
                reason = self.available()
            except Exception as exc:  # a plugin's bug must not break the op for every backend
                return f"{self.provider or self.backend}'s available() raised {type(exc).__name__}: {exc}"
            if reason:
                return reason
        if device_type not in self.devices:
            return f"device type {device_type!r} not supported (supports {', '.join(sorted(self.devices))})"
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            names = ", ".join(sorted(dtype_name(d) for d in self.dtypes))
            return f"dtype {dtype_name(dtype)} not supported (supports {names})"
        if self.archs is not None and device_type != "cpu":
            if arch is None or not any(arch.startswith(p) for p in self.archs):
                return f"architecture {arch} not supported (supports {', '.join(self.archs)})"
        return None


@dataclass
class Registry:
    """All known ops and their implementations."""

    ops: dict = field(default_factory=dict)  # name -> OpSpec
    impls: dict = field(default_factory=dict)  # op name -> list[Implementation]
    # (device_type, arch) -> default backend priority, or None for graft's default.
    default_priority: Callable[[str, str | None], tuple | list | None] | None = None

    def add_op(self, spec: OpSpec) -> OpSpec:
        existing = self.ops.get(spec.name)
        if existing is not None and existing is not spec:
            raise GraftError(f"op {spec.name!r} is already defined")
        self.ops[spec.name] = spec
        self.impls.setdefault(spec.name, [])
        return spec

    def add_ops(self, specs: Iterable[OpSpec]) -> None:
        for spec in specs:
            self.add_op(spec)

    def add_impl(self, impl: Implementation) -> Implementation:
        if impl.op not in self.ops:
            raise GraftError(
                f"cannot register {impl.backend!r} implementation of unknown op {impl.op!r}; "
                f"known ops: {', '.join(sorted(self.ops)) or '(none)'}"
            )
        bucket = self.impls[impl.op]
        if any(i.key == impl.key for i in bucket):
            raise GraftError(f"implementation {impl.key} registered twice")
        bucket.append(impl)
        bucket.sort(key=lambda i: -i.priority)
        return impl

    def op(self, name: str) -> OpSpec:
        try:
            return self.ops[name]
        except KeyError:
            raise GraftError(f"unknown op {name!r}; known ops: {', '.join(sorted(self.ops))}") from None

    def implementations(self, name: str) -> list:
        self.op(name)
        return list(self.impls[name])

    def backends(self) -> set:
        return {i.backend for impls in self.impls.values() for i in impls}

    def families(self) -> dict:
        """op name -> family, for every op."""
        return {name: spec.family for name, spec in self.ops.items()}


TORCH_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps", "meta"})


def reference_impl(spec: OpSpec, provider: str = "graft") -> Implementation:
    """The torch reference as an implementation: any device, any dtype the op allows."""
    return Implementation(
        op=spec.name,
        backend="torch",
        fn=spec.reference,
        provider=provider,
        description="torch reference",
        devices=TORCH_DEVICES,
        priority=-100,
    )


def torch_fast_path(op: str, fn: Callable, description: str) -> Implementation:
    """graft's ``torch`` backend of ``op`` beside its reference: torch's own fused kernels or a
    batched formulation, on every device torch runs on, ranked above the reference."""
    return Implementation(op=op, backend="torch", fn=fn, provider="graft", description=description,
                          devices=TORCH_DEVICES, priority=-50)


def key_tensor(spec: OpSpec, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor whose device/dtype drives selection (first tensor if key_arg is out of range)."""
    if len(args) > spec.key_arg and isinstance(args[spec.key_arg], torch.Tensor):
        return args[spec.key_arg]
    try:
        params = list(inspect.signature(spec.reference).parameters)
        name = params[spec.key_arg]
        if isinstance(kwargs.get(name), torch.Tensor):
            return kwargs[name]
    except (ValueError, TypeError, IndexError):
        pass
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None
