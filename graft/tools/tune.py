"""``graft tune``: measure every implementation of graft's ops on this device, the
framework's own included, for a model's shapes, and write the winners to a tuning table
(format and how dispatch uses it: :mod:`graft.tuning`).

Shapes come from a model's config (``--model``: a Hugging Face ``config.json`` or the folder
holding it; hidden size, heads, KV heads, head dim, intermediate size, experts, dtype) times
token-count buckets, or from recorded shapes (``--shapes FILE``, ``graft-shapes/1``). Each
candidate is first checked against the op's torch reference (a wrong one is rejected, with
the reason in the table), then all are timed on the same inputs, interleaved in rounds
(:func:`graft.tools.bench.timing.interleaved`), medians. The table is rewritten after every shape,
so an interrupted run resumes where it stopped (entries already in ``--out`` for this device
and versions are kept and skipped; ``--fresh`` measures again).
"""
from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from graft import framework_backend, tuning
from graft.errors import GraftConfigError

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
QUICK_TOKENS = (1, 16, 128)
FRAMEWORKS_DEFAULT = "vllm"


def add_arguments(parser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="CONFIG", help="a Hugging Face config.json (or its folder): shapes of its layers")
    src.add_argument("--shapes", metavar="FILE", help=f"recorded shapes ({tuning.SHAPES_FORMAT}, see graft.tuning)")
    parser.add_argument("--out", metavar="FILE", default="graft-tuning.json",
                        help="the tuning table to write (and resume from); default graft-tuning.json")
    parser.add_argument("--tokens", metavar="N,N,...", default=None,
                        help=f"token counts to measure (default {','.join(map(str, DEFAULT_TOKENS))}; "
                             f"--quick: {','.join(map(str, QUICK_TOKENS))})")
    parser.add_argument("--dtype", default=None, help="dtype of the measured tensors (default: the model's)")
    parser.add_argument("--ops", default=None, help="comma-separated ops to tune (default: every op the shapes name)")
    parser.add_argument("--frameworks", default=FRAMEWORKS_DEFAULT,
                        help="frameworks whose own code competes (default vllm; '' for none)")
    parser.add_argument("--device", default=None, help="device to measure on (default: this machine's accelerator, else cpu)")
    parser.add_argument("--quick", action="store_true", help="fewer token counts and rounds (a minute or two on a CPU)")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds per shape (default 15, --quick 7)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads while measuring (default: torch's; match what the framework will use)")
    parser.add_argument("--fresh", action="store_true", help="measure every shape again (ignore entries in --out)")


# --------------------------------------------------------------------------- shapes


def _dtype(name) -> torch.dtype:
    from graft.tools.replay import dtype_of

    return dtype_of(name)


def _read_json(path: Path, what: str):
    """A JSON file's data, or GraftConfigError starting with ``what`` saying what is wrong."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise GraftConfigError(f"{what}: cannot read it: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise GraftConfigError(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise GraftConfigError(f"{what} is nested too deeply to be graft's JSON") from None
    except json.JSONDecodeError as exc:
        raise GraftConfigError(f"{what} is not JSON: {exc}") from None


def read_model_config(path: str) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    cfg = _read_json(p, f"--model {path!r}: {p}")
    if not isinstance(cfg, dict):
        raise GraftConfigError(f"--model {path!r}: {p} holds a {type(cfg).__name__}, not a config object")
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size") if k not in cfg]
    if missing:
        raise GraftConfigError(f"--model {path!r}: {p} lacks {', '.join(missing)} (a decoder's config.json has them)")
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "num_key_value_heads", "head_dim",
                "num_local_experts", "num_experts", "num_experts_per_tok", "max_position_embeddings"):
        value = cfg.get(key)
        required = key in ("hidden_size", "num_attention_heads", "intermediate_size")
        if value is None and not required:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if required else 0):
            raise GraftConfigError(f"--model {path!r}: {key} must be a positive integer, got {value!r}")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 <= eps < 1:
        raise GraftConfigError(f"--model {path!r}: rms_norm_eps must be a small number, got {eps!r}")
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if heads % kv:
        raise GraftConfigError(f"--model {path!r}: num_attention_heads {heads} is not a multiple of "
                               f"num_key_value_heads {kv}")
    if not cfg.get("head_dim") and cfg["hidden_size"] % heads:
        raise GraftConfigError(f"--model {path!r}: hidden_size {cfg['hidden_size']} is not a multiple of "
                               f"num_attention_heads {heads} (and no head_dim is given)")
    return cfg


def model_shapes(cfg: dict, tokens, dtype: torch.dtype) -> list:
    """Shape entries (graft-shapes/1 items) of a decoder layer's ops for each token count."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    inter = cfg["intermediate_size"]
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    top_k = cfg.get("num_experts_per_tok") or 2
    max_pos = min(int(cfg.get("max_position_embeddings") or 4096), 8192)
    name = str(dtype).replace("torch.", "")
    out = []

    def add(op, *args):
        out.append({"op": op, "dtype": name, "args": list(args)})

    def weight(*shape):  # random normal / sqrt(fan-in): unit-sized outputs, as in a trained model
        return {"shape": list(shape), "scale": 1.0 / math.sqrt(shape[-1])}

    for t in tokens:
        x = {"shape": [t, hidden]}
        add("fused.rms_norm", x, {"shape": [hidden]}, float(cfg.get("rms_norm_eps", 1e-6)), None)
        add("fused.rms_norm", x, {"shape": [hidden]}, float(cfg.get("rms_norm_eps", 1e-6)), {"shape": [t, hidden]})
        add("fused.rotary_embedding", {"shape": [t], "dtype": "int64", "high": max_pos},
            {"shape": [t, heads * head_dim]}, {"shape": [t, kv_heads * head_dim]}, head_dim,
            {"shape": [max_pos, head_dim]}, True)
        add("gemm.linear", x, weight((heads + 2 * kv_heads) * head_dim, hidden), None, "none")
        add("gemm.linear", {"shape": [t, heads * head_dim]}, weight(hidden, heads * head_dim), None, "none")
        if experts:
            add("moe.fused_experts", x, weight(experts, 2 * inter, hidden), weight(experts, hidden, inter),
                {"shape": [t, top_k], "softmax": True, "dtype": "float32"},
                {"shape": [t, top_k], "dtype": "int32", "high": experts}, "silu")
        else:
            add("fused.silu_and_mul", {"shape": [t, 2 * inter]})
            add("gemm.linear", x, weight(2 * inter, hidden), None, "none")
            add("gemm.linear", {"shape": [t, inter]}, weight(hidden, inter), None, "none")
    return out


def read_shapes(path: str) -> list:
    data = _read_json(Path(path), f"--shapes {path!r}")
    if not isinstance(data, dict) or data.get("format") != tuning.SHAPES_FORMAT:
        raise GraftConfigError(f"--shapes {path!r}: format must be {tuning.SHAPES_FORMAT!r} (see graft.tuning)")
    shapes = data.get("shapes")
    if not isinstance(shapes, list):
        raise GraftConfigError(f"--shapes {path!r}: 'shapes' must be a list of {{op, dtype, args}}")
    for i, entry in enumerate(shapes):
        if not isinstance(entry, dict) or not isinstance(entry.get("op"), str) or not isinstance(entry.get("args"), list):
            raise GraftConfigError(f"--shapes {path!r}: entry {i} needs 'op' (a string) and 'args' (a list): {entry!r}")
    return shapes


def make_call(entry: dict, device, gen: torch.Generator | None, where: str = "shape entry") -> tuple:
    """``(args, kwargs)`` of one shape entry, as tensors on ``device``, drawn there from ``gen``
    (seeded; a generator of that device): a GPU's large weights are not made on the host. On
    ``meta`` (shapes only, ``gen`` None) nothing is drawn or allocated. Index arguments are
    made valid from the other arguments' shapes (:mod:`graft.tools.replay`)."""
    from graft.plugins import get_registry
    from graft.tools.replay import call_arguments

    return call_arguments(entry, get_registry().op(entry["op"]), device, gen, where)


def make_args(entry: dict, device, gen: torch.Generator | None) -> tuple:
    """The positional arguments of :func:`make_call` (entries without keyword arguments)."""
    return make_call(entry, device, gen)[0]


def generator(device, seed: int = 0) -> torch.Generator:
    """A seeded generator on ``device`` (what :func:`make_args` draws from)."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


# --------------------------------------------------------------------------- measuring


def _close(out, ref, dtype) -> str | None:
    """Why ``out`` does not match the reference's ``ref`` (None: it does)."""
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if isinstance(ref, (tuple, list)):
        if not isinstance(out, (tuple, list)) or len(out) != len(ref):
            return f"returns {type(out).__name__}, the reference a {len(ref)}-tuple"
        for o, r in zip(out, ref):
            why = _close(o, r, dtype)
            if why:
                return why
        return None
    if ref is None:
        return None if out is None else "returns a tensor where the reference returns None"
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return f"shape {getattr(out, 'shape', None)} != the reference's {tuple(ref.shape)}"
    diff = (out.float() - ref.float()).abs()
    bound = tol + tol * ref.float().abs()
    if diff.numel() and bool((diff > bound).any()):
        return f"differs from the reference by up to {float(diff.max()):.3g} (tolerance {tol:g})"
    return None


def _candidates(registry, op: str, device, dtype, args, kwargs=None) -> tuple[dict, dict]:
    """``({name: impl}, {name: why not})`` of the implementations that can serve ``args``:
    one per backend (the one selection would take), named by backend."""
    from graft.platform import device_info

    arch = device_info(device).arch if device.type == "cuda" else device.type
    usable, rejected = {}, {}
    for impl in registry.implementations(op):  # highest priority first within a backend
        if impl.backend in usable or impl.backend in rejected:
            continue
        why = impl.reason(device.type, dtype, arch, args, kwargs or {})
        if why is None:
            usable[impl.backend] = impl
        elif impl.framework or impl.backend != "torch":
            rejected[impl.backend] = why
    return usable, rejected


def measure(entry: dict, device, rounds: int, registry, seed: int = 0) -> dict | None:
    """One shape: the table entry (winner, ratio, medians), or None when fewer than one
    candidate can serve it."""
    from graft.tools.bench.timing import interleaved

    op, dtype = entry["op"], _dtype(entry.get("dtype", "float32"))
    spec = registry.op(op)
    args, kwargs = make_call(entry, device, generator(device, seed))
    spec.validate(*args, **kwargs) if spec.validate is not None else None
    usable, rejected = _candidates(registry, op, device, dtype, args, kwargs)
    ref = spec.reference(*args, **kwargs)
    variants = {}
    for backend, impl in usable.items():
        try:
            why = _close(impl.fn(*args, **kwargs), ref, dtype)
        except Exception as exc:  # a candidate that fails here must not stop the run
            why = f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if why:
            rejected[backend] = why
            continue
        variants[backend] = (lambda fn=impl.fn: fn(*args, **kwargs))
    if not variants:
        return None
    unmeasured = {i.backend: rejected.get(i.backend) or "cannot serve this shape here" for i in registry.implementations(op)
                  if i.framework and framework_backend.enabled(i.framework) and i.backend not in variants}
    if unmeasured and not any(usable[b].framework for b in variants):
        # The framework's own code cannot be called here with the op's arguments: graft is not
        # known faster, so the framework keeps the bucket (the integration leaves it alone).
        backend, why = sorted(unmeasured.items())[0]
        return {"op": op, "dtype": tuning.dtype_name(dtype), "bucket": tuning.bucket(op, args, kwargs),
                "tokens": _tokens(spec, args), "backend": backend, "provider": backend, "providers": {},
                "ratio": None, "median_us": {}, "spread": {}, "rejected": rejected,
                "note": f"{backend}'s own code could not be measured here ({why}); graft is not known faster"}
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    once = _time_once(variants, sync)
    inner = max(1, min(500, int(1e-3 / max(once, 1e-7))))  # ~1 ms a sample: stalls average out
    timings = interleaved(variants, rounds=rounds, inner=inner, warmup=2, sync=sync)
    order = sorted(timings, key=lambda b: timings[b])
    winner = order[0]
    frameworks = [b for b in variants if usable[b].framework]
    if frameworks and winner not in frameworks:
        fw = min(frameworks, key=lambda b: timings[b])
        if timings.ratio(fw, winner) < 1 + tuning.MARGIN:  # within the margin: graft steps aside
            winner = fw
    others = [b for b in order if b != winner]
    ratio = timings.ratio(others[0], winner) if others else None
    return {
        "op": op, "dtype": tuning.dtype_name(dtype), "bucket": tuning.bucket(op, args, kwargs),
        "tokens": _tokens(spec, args),
        "backend": winner, "provider": usable[winner].provider,
        "providers": {b: usable[b].provider for b in variants},
        "ratio": None if ratio is None else round(ratio, 4),
        "median_us": {b: round(timings[b] * 1e6, 3) for b in order},
        "spread": {b: [round(min(timings.samples[b]) * 1e6, 3), round(max(timings.samples[b]) * 1e6, 3)]
                   for b in order},
        "rounds": rounds, "inner": inner,
        "rejected": rejected,
    }


def _tokens(spec, args):
    key = args[spec.key_arg] if len(args) > spec.key_arg else None
    return int(key.shape[0]) if isinstance(key, torch.Tensor) and key.dim() else None


def _time_once(variants: dict, sync) -> float:
    """The slowest candidate's best of three calls (a shared machine's stalls are not the
    call's time: the best of a few is what the call costs)."""
    from graft.tools.bench.timing import fastest

    return max((fastest(fn, 3, sync) for fn in variants.values()), default=0.0)


# --------------------------------------------------------------------------- the command


def _enable_frameworks(names) -> list:
    """Let the frameworks' own implementations compete (their module must import); returns
    the ones enabled, and says why for the others."""
    import importlib

    from graft import framework_backend

    done = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:
            print(f"  {name}: not measured ({type(exc).__name__}: {exc})", flush=True)
            continue
        framework_backend.enable(name)
        done.append(name)
    return done


def _existing(out: Path, device: dict, versions: dict) -> list:
    if not out.exists():
        return []
    table = tuning.load(str(out))
    why = tuning.mismatch(table, device, versions)
    if why:
        raise GraftConfigError(f"--out {out}: an existing table {why}; write to another file or pass --fresh")
    return list(table.entries.values())


def write_table(out: Path, device: dict, versions: dict, entries: list, source: str) -> None:
    data = {"format": tuning.FORMAT, "device": device, "versions": versions,
            "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "source": source, "entries": entries}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, out)  # atomic: an interrupted run leaves the last complete table


def _device(name: str | None):
    """--device as a torch.device this machine has (GraftConfigError naming what is valid)."""
    from graft.platform import default_device

    if not name:
        return default_device()
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise GraftConfigError(f"--device {name!r} is not a device; use cpu or cuda (cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise GraftConfigError(f"--device {name!r}: graft tune measures on cpu or cuda (ROCm GPUs are cuda in torch)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise GraftConfigError(f"--device {name!r}: this machine has no GPU torch can use")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise GraftConfigError(f"--device {name!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def _check_out(out: Path) -> None:
    """--out must be a file path in a folder that exists and can be written, checked before
    anything is measured."""
    if out.is_dir():
        raise GraftConfigError(f"--out {str(out)!r} is a folder; give the table's file path (e.g. graft-tuning.json)")
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise GraftConfigError(f"--out {str(out)!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise GraftConfigError(f"--out {str(out)!r}: not writable")


class _Lock:
    """An exclusive lock on ``--out`` for one run (``<out>.lock``, flock): a second ``graft tune``
    writing the same table is refused with a clear message instead of both reporting
    success and one losing the other's entries. Released when the process ends, however."""

    def __init__(self, out: Path):
        self.path = out.with_name(out.name + ".lock")
        self.file = None

    def __enter__(self):
        import fcntl

        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise GraftConfigError(f"--out {str(self.path)[:-5]!r} is being written by another graft tune "
                                   f"({holder}); wait for it, or write to another file") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()}")
        self.file.flush()
        return self

    def __exit__(self, *exc):
        try:
            self.path.unlink()
        except OSError:
            pass
        self.file.close()  # closing releases the lock


def run(args) -> int:
    from graft.plugins import get_registry

    device = _device(args.device)
    out = Path(args.out)
    _check_out(out)
    tokens: tuple = QUICK_TOKENS if args.quick else DEFAULT_TOKENS
    if args.tokens:
        try:
            tokens = tuple(int(t) for t in args.tokens.split(",") if t.strip())
        except ValueError:
            raise GraftConfigError(f"--tokens {args.tokens!r}: give comma-separated token counts, e.g. 1,16,128") from None
        if not tokens or min(tokens) < 1:
            raise GraftConfigError(f"--tokens {args.tokens!r}: token counts must be >= 1")
    rounds = args.rounds or (7 if args.quick else 15)
    if rounds < 1:
        raise GraftConfigError(f"--rounds {rounds}: at least 1")
    if args.model:
        cfg = read_model_config(args.model)
        dtype = _dtype(args.dtype or cfg.get("torch_dtype") or "float32")
        shapes = model_shapes(cfg, tokens, dtype)
        source = f"graft tune --model {args.model}"
    else:
        shapes = read_shapes(args.shapes)
        if args.dtype:
            shapes = [dict(s, dtype=args.dtype) for s in shapes]
        source = f"graft tune --shapes {args.shapes}"
    registry = get_registry()
    if args.ops:
        wanted = [o.strip() for o in args.ops.split(",") if o.strip()]
        for op in wanted:
            registry.op(op)  # unknown op: a clear error
        shapes = [s for s in shapes if s["op"] in wanted]
    keys = []
    for i, s in enumerate(shapes):  # every entry checked before anything is measured
        registry.op(s["op"])
        where = f"{args.shapes or args.model}: shape {i} ({s['op']})"
        meta_args, meta_kwargs = make_call(s, "meta", None, where)
        keys.append((s["op"], tuning.dtype_name(_dtype(s.get("dtype", "float32"))),
                     tuning.bucket(s["op"], meta_args, meta_kwargs)))
    if args.threads is not None:
        if args.threads < 1:
            raise GraftConfigError(f"--threads {args.threads}: at least 1")
        torch.set_num_threads(args.threads)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    print(f"graft tune: {len(shapes)} shapes on {device.type} ({torch.get_num_threads()} threads), {rounds} rounds "
          f"each; frameworks competing: {', '.join(frameworks) or 'none'}", flush=True)
    _enable_frameworks(frameworks)
    with _Lock(out):
        return _tune(shapes, keys, device, rounds, registry, out, source, args.fresh)


def _tune(shapes, keys, device, rounds, registry, out: Path, source: str, fresh: bool) -> int:
    from graft.errors import GraftError

    device_desc, here_versions = tuning.device_key(device.type), tuning.versions()
    entries = [] if fresh else _existing(out, device_desc, here_versions)
    done = {(e["op"], e["dtype"], e["bucket"]) for e in entries}
    started, measured, skipped = time.perf_counter(), 0, 0
    todo = shapes
    for i, (s, key) in enumerate(zip(todo, keys), 1):
        if key in done:
            print(f"[{i}/{len(todo)}] {key[0]} {key[1]} {key[2]}: in {out} already (resumed)", flush=True)
            continue
        try:
            entry = measure(s, device, rounds, registry)
        except GraftError as exc:  # this shape cannot be called as recorded: say why, go on
            skipped += 1
            print(f"[{i}/{len(todo)}] {key[0]} {key[1]} {key[2]}: skipped: {exc}", flush=True)
            continue
        measured += 1
        elapsed = time.perf_counter() - started
        left = elapsed / measured * (len(todo) - i)
        if entry is None:
            print(f"[{i}/{len(todo)}] {key[0]} {key[1]} {key[2]}: nothing can serve it here", flush=True)
            continue
        entries = [e for e in entries if (e["op"], e["dtype"], e["bucket"]) != key] + [entry]
        done.add(key)
        write_table(out, device_desc, here_versions, entries, source)
        times = ", ".join(f"{b} {us:.1f} us" for b, us in entry["median_us"].items()) or entry.get("note", "")
        ratio = f" ({entry['ratio']:.2f}x)" if entry["ratio"] else ""
        print(f"[{i}/{len(todo)}] {key[0]} {key[1]} {key[2]}: {times} -> {entry['backend']}{ratio}; "
              f"about {left:.0f} s left", flush=True)
    print(f"graft tune: wrote {out} ({len(entries)} entries); use it with {tuning.TABLE_VAR}={out}", flush=True)
    if skipped:
        print(f"graft tune: {skipped} shape(s) skipped (the reasons are above)", flush=True)
    return 0


def summary(entries: list) -> dict:
    """``{op: {backend: buckets won}}`` (reports, tests)."""
    out: dict = {}
    for e in entries:
        out.setdefault(e["op"], {}).setdefault(e["backend"], 0)
        out[e["op"]][e["backend"]] += 1
    return out


if __name__ == "__main__":  # pragma: no cover
    from graft.tools.cli import main

    sys.exit(main(["tune", *sys.argv[1:]]))

