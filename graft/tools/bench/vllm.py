"""``graft bench vllm``: offline generation throughput in a real vLLM engine, with graft against
without it (``GRAFT_VLLM=0``), in the same run.

Run it with the Python that has vLLM (here ``.venv-vllm-cpu/bin/python -m graft bench vllm``).
A 4-layer Llama (hidden 1024, 16 heads of 64, 4 KV heads, FFN 2816, vocab 32000, fp32,
random weights) is built locally once (``--model-dir``; nothing is downloaded). One engine
per variant stays alive in its own process (eager, in-process engine core, prefix caching
off), so the runs interleave: every round runs each workload on every variant, in rotating
order, and a variant's ratio is the median over rounds of (time without graft / its time)
measured back to back (> 1: graft faster). Variants:

* ``without``: ``GRAFT_VLLM=0``, vLLM as it is;
* ``with``: graft's default install (every part graft serves, its selection);
* ``attention``: graft's attention forced on (``GRAFT_VLLM_ATTENTION_OVERRIDE=CPU_ATTN``: vLLM's
  CPU platform always picks its own CPU_ATTN, this routes it to graft's GRAFT backend);
* ``attention_only``: the same with graft serving nothing else (``GRAFT_VLLM_OPS=attention``):
  graft's attention against vLLM's, every other layer vLLM's own;
* ``tuned`` and ``tuned_attention``: ``with`` and ``attention`` reading the tuning table named by
  ``--tuning-table`` (``graft tune``'s output), so the same run compares graft's default (no
  table: it steps aside wherever it is not known faster) with graft as the table selects.

No other variant reads a table: ``GRAFT_TUNING_TABLE`` in the environment is not passed to the
engines (a table would silently change what ``with`` means).

Each engine runs one OpenMP thread, bound to no core (``--cpus nobind``, the default: vLLM's
``VLLM_CPU_OMP_THREADS_BIND=nobind`` with ``OMP_NUM_THREADS=1``), so the OS runs it on whichever
core is free. On a shared 2-core machine two threads that wait on each other at every parallel
region turn any other process's time slice into a stall of both, and a thread bound to a core
waits whenever another process holds that core (runs of one variant varied up to 5x either way).
Any other ``--cpus`` value is passed to ``VLLM_CPU_OMP_THREADS_BIND`` (``auto``: vLLM's own
binding, one thread per physical core; ``0-1``: both cores).

Workloads (:data:`graft.tools.bench.vllm_engine.WORKLOADS`): ``decode`` (16 prompts of 32 tokens,
64 new tokens each; throughput = generated tokens/s) and ``prefill`` (8 prompts of 384 tokens,
1 new token; throughput = prompt tokens/s). Greedy token ids of every variant are compared with
``without`` (fp32: they should be identical) and reported. ``--profile`` adds one untimed round
with per-layer timers (RMSNorm, SiLU-and-mul, rotary, linear, attention; the rest is "other").
``--compiled`` (or ``--compiled-only``) times vLLM's compiled mode from a cold start per variant:
a fresh engine with ``enforce_eager=False`` and an empty compile cache, its build (which traces and
compiles the model) and its first generate.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from graft.tools.bench import choose, timing
from graft.errors import GraftConfigError

VARIANTS = {
    "without": {"GRAFT_VLLM": "0"},
    "with": {},
    "attention": {"GRAFT_VLLM_ATTENTION_OVERRIDE": "CPU_ATTN"},
    "attention_only": {"GRAFT_VLLM_OPS": "attention", "GRAFT_VLLM_ATTENTION_OVERRIDE": "CPU_ATTN"},
    "tuned": {},
    "tuned_attention": {"GRAFT_VLLM_ATTENTION_OVERRIDE": "CPU_ATTN"},
}
TUNED = ("tuned", "tuned_attention")  # the variants that read --tuning-table
MODEL: dict[str, Any] = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False)
BASELINE = "without"


def build_model(model_dir: Path) -> Path:
    """The benchmark's Llama, random weights (seeded), saved once as safetensors in fp32."""
    if (model_dir / "config.json").exists():
        return model_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(LlamaConfig(**MODEL))
    model = model.to(torch.float32)
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)
    return model_dir


def summarize(samples: dict, tokens: dict, work: dict) -> dict:
    """Per workload and variant: throughput (median, min, max), the paired ratio against the
    baseline (median, min, max over rounds), and whether its tokens equal the baseline's.

    ``samples[workload][variant]`` are seconds per round, ``tokens[workload][variant]`` the
    token ids of its runs (all rounds), ``work[workload]`` the tokens a run processes."""
    out: dict = {}
    for workload, by_variant in samples.items():
        base = by_variant[BASELINE]
        rows = {}
        for variant, seconds in by_variant.items():
            throughput = [work[workload] / s for s in seconds]
            row = {"seconds": seconds, "throughput_median": timing.median(throughput),
                   "throughput_min": min(throughput), "throughput_max": max(throughput)}
            if variant != BASELINE:
                ratios = [b / s for b, s in zip(base, seconds)]  # > 1: faster than without graft
                row.update(timing.ratio_summary(ratios, se=False))
                runs, base_runs = tokens[workload][variant], tokens[workload][BASELINE]
                row["tokens_identical"] = all(r == base_runs[0] for r in runs) and all(
                    r == base_runs[0] for r in base_runs)
                row["tokens_differing"] = _differing(runs[0], base_runs[0])
                row["tokens_total"] = sum(len(r) for r in base_runs[0])
                row["prompts_identical"] = sum(a == b for a, b in zip(runs[0], base_runs[0]))
                row["first_difference"] = [_first_difference(a, b) for a, b in zip(runs[0], base_runs[0])]
            rows[variant] = row
        out[workload] = rows
    return out


def _first_difference(a: list, b: list) -> int | None:
    """The index of the first generated token where two runs of one prompt differ, or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _differing(a: list, b: list) -> int:
    """Token positions (over all prompts) where two runs' ids differ."""
    return sum(x != y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) + sum(abs(len(ra) - len(rb))
                                                                             for ra, rb in zip(a, b))


class Engine:
    """One engine process: commands in on stdin, ``GRAFT_BENCH {json}`` lines out."""

    def __init__(self, name: str, model_dir: Path, env: dict, log_path: Path):
        self.name = name
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "graft.tools.bench.vllm_engine", str(model_dir)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     bufsize=1, start_new_session=True)
        self.log_path = log_path

    def read(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                tail = self.log_path.read_text()[-3000:]
                raise RuntimeError(f"vLLM engine {self.name!r} exited ({self.proc.poll()}):\n{tail}")
            if line.startswith("GRAFT_BENCH "):
                reply = json.loads(line[len("GRAFT_BENCH "):])
                if "error" in reply:
                    raise RuntimeError(f"vLLM engine {self.name!r}: {reply['error']}")
                return reply
        raise TimeoutError(f"vLLM engine {self.name!r} did not answer in {timeout:.0f} s")

    def ask(self, command: dict, timeout: float) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        self.log.close()


# Not passed to the engines: Triton's interpreter (the test suite's conftest sets it) makes graft
# select its Triton kernels and run them interpreted on the CPU, about 1000x slower: a decode
# round in the CI took over 14 minutes instead of seconds. A throughput bench measures compiled code.
# Each with what the bench says when it finds one set.
DROPPED = {"TRITON_INTERPRET": "Triton's interpreter is not a throughput measurement",
           "GRAFT_TUNING_TABLE": "only the tuned variants read a table, the one --tuning-table names"}


def engine_env(variant: str, options: dict, cpus: str = "nobind", tuning_table: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GRAFT_VLLM") and k not in ("GRAFT_BENCH_ENGINE", "VLLM_ENABLE_V1_MULTIPROCESSING")
           and k not in DROPPED}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(VARIANTS[variant], VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1",
               VLLM_CPU_OMP_THREADS_BIND=cpus, GRAFT_BENCH_ENGINE=json.dumps(options))
    if variant in TUNED:
        if not tuning_table:
            raise GraftConfigError(f"graft bench vllm: variant {variant!r} needs --tuning-table FILE (graft tune's "
                                   "output)")
        env["GRAFT_TUNING_TABLE"] = tuning_table
    if cpus == "nobind":  # one thread, wherever the OS finds a free core
        env["OMP_NUM_THREADS"] = "1"
    return env


def measure(rounds: int, variants: list, workloads: list, model_dir: Path, logs: Path, progress, profile=False,
            cpus: str = "nobind", kv_cache_dtype: str = "auto", timeout: float = 600.0,
            tuning_table: str | None = None) -> dict:
    from graft.tools.bench.vllm_engine import WORKLOADS

    if BASELINE not in variants:
        variants = [BASELINE] + variants
    engines: dict = {}
    results: dict = {"variants": {v: VARIANTS[v] for v in variants}, "rounds": rounds, "cpus": cpus,
                     "kv_cache_dtype": kv_cache_dtype, "workloads": {}}
    try:
        for variant in variants:  # one at a time: a start-up is not timed against another's
            settings = ", ".join(f"{k}={v}" for k, v in VARIANTS[variant].items()) or "graft default"
            progress(f"  starting engine {variant!r} ({settings})")
            # The engine warms up on the workloads it will run only (a prefill warm-up is 3072 tokens).
            options = {"profile": profile, "kv_cache_dtype": kv_cache_dtype, "workloads": list(workloads)}
            engine = engines[variant] = Engine(variant, model_dir, engine_env(variant, options, cpus, tuning_table),
                                               logs / f"{variant}.log")
            ready = engine.read(timeout)
            results.setdefault("engines", {})[variant] = {k: ready[k] for k in ("engine_seconds",
                                                                                "first_generate_seconds", "graft")}
        samples: dict[str, dict[str, list]] = {w: {v: [] for v in variants} for w in workloads}
        tokens: dict[str, dict[str, list]] = {w: {v: [] for v in variants} for w in workloads}
        started = time.monotonic()
        for r in range(rounds):
            order = variants[r % len(variants):] + variants[: r % len(variants)]
            for workload in workloads:
                for variant in order:
                    reply = engines[variant].ask({"run": workload}, timeout)
                    samples[workload][variant].append(reply["seconds"])
                    tokens[workload][variant].append(reply["tokens"])
            done = r + 1
            left = (time.monotonic() - started) / done * (rounds - done)
            line = ", ".join(f"{w} {v} {samples[w][v][-1]:.2f}s" for w in workloads for v in variants)
            progress(f"  round {done}/{rounds}: {line} (about {left:.0f} s left)")
        work = {w: WORKLOADS[w][0] * (WORKLOADS[w][2] if w != "prefill" else WORKLOADS[w][1]) for w in workloads}
        results["workloads"] = {w: {"prompts": WORKLOADS[w][0], "prompt_tokens": WORKLOADS[w][1],
                                    "new_tokens": WORKLOADS[w][2], "tokens_per_run": work[w],
                                    "throughput_unit": "prompt tokens/s" if w == "prefill" else "generated tokens/s"}
                                for w in workloads}
        results["results"] = summarize(samples, tokens, work)
        if profile:
            progress("  profile round (per-layer timers, untimed in the results above)")
            layers: dict = {}
            for workload in workloads:
                for variant in variants:
                    reply = engines[variant].ask({"profile": workload}, timeout)
                    row = {k: reply["layers"].get(k, 0.0) for k in _layer_kinds()}
                    row["other"] = max(reply["seconds"] - sum(row.values()), 0.0)
                    row["total"] = reply["seconds"]
                    layers.setdefault(workload, {})[variant] = row
            results["layers"] = layers
    finally:
        for engine in engines.values():
            engine.close()
    return results


def measure_compiled(rounds: int, variants: list, model_dir: Path, logs: Path, progress, cpus: str = "nobind",
                     timeout: float = 600.0, tuning_table: str | None = None) -> dict:
    """vLLM's compiled mode (``enforce_eager=False``) from a cold start: each run a fresh engine
    with an empty compile cache (its own ``VLLM_CACHE_ROOT``), timed to its engine build (which
    compiles) and its first generate; variants alternate, ``rounds`` runs each."""
    if BASELINE not in variants:
        variants = [BASELINE] + variants
    runs: dict = {v: [] for v in variants}
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for variant in order:
            with tempfile.TemporaryDirectory(prefix="graft-bench-vllm-cache-") as cache:
                env = engine_env(variant, {"enforce_eager": False}, cpus, tuning_table)
                env["VLLM_CACHE_ROOT"] = cache
                engine = Engine(f"{variant} compiled", model_dir, env, logs / f"{variant}-compiled-{r}.log")
                try:
                    ready = engine.read(timeout)
                finally:
                    engine.close()
            first = ready["first_generate_seconds"]["decode"]
            runs[variant].append({"engine_seconds": ready["engine_seconds"], "first_generate_seconds": first,
                                  "total_seconds": ready["engine_seconds"] + first})
            progress(f"  compiled, round {r + 1}/{rounds}, {variant}: engine built (and compiled) in "
                     f"{ready['engine_seconds']:.1f} s, first generate {first:.2f} s")
    out: dict = {}
    for variant, rows in runs.items():
        row = {k: timing.median(x[k] for x in rows) for k in rows[0]}
        row["runs"] = rows
        if variant != BASELINE:
            ratios = [b["total_seconds"] / x["total_seconds"] for b, x in zip(runs[BASELINE], rows)]
            row.update(timing.ratio_summary(ratios, se=False))
        out[variant] = row
    return out


def _layer_kinds():
    from graft.tools.bench.vllm_engine import LAYER_KINDS

    return LAYER_KINDS


def report_lines(results: dict) -> list:
    lines = []
    for workload, rows in results.get("results", {}).items():
        unit = results["workloads"][workload]["throughput_unit"]
        lines.append(f"{workload} ({unit}; ratio = without graft's time / this variant's, > 1 faster):")
        for variant, row in rows.items():
            text = (f"  {variant:15s} {row['throughput_median']:9.1f} "
                    f"({row['throughput_min']:.1f}-{row['throughput_max']:.1f})")
            if "ratio_median" in row:
                same = "tokens identical" if row["tokens_identical"] else (
                    f"{row['tokens_differing']}/{row['tokens_total']} tokens differ, {row['prompts_identical']}/"
                    f"{len(row['first_difference'])} prompts identical")
                text += f"  ratio {row['ratio_median']:.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f}), {same}"
            lines.append(text)
    if "compiled" in results:
        lines.append("compiled (enforce_eager=False), cold compile cache: engine build + first generate, seconds "
                     "(ratio = without graft's / this variant's):")
        for variant, row in results["compiled"].items():
            text = (f"  {variant:15s} build {row['engine_seconds']:7.1f}  first generate "
                    f"{row['first_generate_seconds']:6.2f}")
            if "ratio_median" in row:
                text += f"  ratio {row['ratio_median']:.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})"
            lines.append(text)
    for workload, by_variant in results.get("layers", {}).items():
        lines.append(f"{workload}: seconds per layer kind in one run")
        kinds = list(_layer_kinds()) + ["other", "total"]
        lines.append("  " + " " * 15 + "".join(f"{k:>13s}" for k in kinds))
        for variant, row in by_variant.items():
            lines.append(f"  {variant:15s}" + "".join(f"{row[k]:13.3f}" for k in kinds))
    return lines


def add_arguments(parser) -> None:
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of {', '.join(VARIANTS)} "
                                                          f"({BASELINE} always runs)")
    parser.add_argument("--workloads", default=None, help="comma-separated subset of decode, prefill")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick 3)")
    parser.add_argument("--profile", action="store_true", help="add one round with per-layer timers")
    parser.add_argument("--compiled", action="store_true",
                        help="also time vLLM's compiled mode from a cold start (engine build + first generate, "
                             "fresh compile cache per run)")
    parser.add_argument("--compiled-only", action="store_true",
                        help="only the compiled-mode section (skip the throughput rounds)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="vLLM's kv_cache_dtype for every engine (fp8: graft's fp8 path against vLLM's own CPU "
                             "fp8 path; tokens then agree only as far as the two roundings to fp8 allow)")
    parser.add_argument("--cpus", default="nobind",
                        help="VLLM_CPU_OMP_THREADS_BIND for every engine (default nobind: one thread on no fixed "
                             "core; auto: vLLM's own binding; 0-1: both cores)")
    parser.add_argument("--tuning-table", default=None, metavar="FILE",
                        help="a graft tuning table (graft tune's output) read by the variants tuned and "
                             "tuned_attention (added to --variants when given); no other variant reads a table")
    parser.add_argument("--model-dir", default=None,
                        help="where the benchmark's model is built once (default: a folder under the temp dir)")


def check_vllm_runs() -> None:
    """vLLM importable and with a platform to run a model on (a CUDA wheel on a machine
    without a GPU imports, but has none)."""
    hint = "run it with the Python whose vLLM runs here (on a CPU machine: .venv-vllm-cpu/bin/python -m graft " \
           "bench vllm)"
    try:
        from vllm.platforms import current_platform
    except ImportError as exc:
        raise GraftConfigError(f"graft bench vllm: vLLM is not importable in {sys.executable} ({exc}); {hint}") from None
    if not current_platform.device_type:
        raise GraftConfigError(f"graft bench vllm: vLLM in {sys.executable} finds no platform to run a model on "
                               f"({type(current_platform).__name__}); {hint}")


def chosen_variants(args) -> tuple:
    """``(variants, tuning table path or None)`` from --variants and --tuning-table: the tuned
    variants run only with a table (added to the default set when one is given; named
    without one, a GraftConfigError)."""
    variants = choose(args.variants, VARIANTS, "--variants", "variants")
    table = args.tuning_table
    if table is not None:
        from graft.tuning import load

        table = str(Path(table).resolve())
        load(table)  # a missing or malformed table: a clear error now, not in every engine
        if args.variants is None:
            variants = [v for v in variants if v not in TUNED] + list(TUNED)
        elif not any(v in TUNED for v in variants):
            variants += list(TUNED)
    elif args.variants is not None and any(v in TUNED for v in variants):
        raise GraftConfigError(f"--variants {','.join(v for v in variants if v in TUNED)} read a tuning table: "
                               "give one with --tuning-table FILE")
    else:  # the default set without a table: every variant but the tuned ones
        variants = [v for v in variants if v not in TUNED]
    return variants, table


def run(args) -> int:
    from graft.tools.bench.vllm_engine import WORKLOADS

    check_vllm_runs()
    variants, table = chosen_variants(args)
    workloads = choose(args.workloads, WORKLOADS, "--workloads", "workloads")
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 5)
    if rounds < 1:
        raise GraftConfigError(f"--rounds must be >= 1, got {rounds}")
    model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / "graft-bench-vllm-llama")

    def progress(line):
        print(line, flush=True)

    started = time.perf_counter()
    for name, why in DROPPED.items():
        if os.environ.get(name, "0") not in ("", "0"):
            progress(f"vllm: {name}={os.environ[name]} is not passed to the engines ({why})")
    progress(f"vllm: building the model in {model_dir} (once)")
    build_model(model_dir)
    import vllm as vllm_module

    with tempfile.TemporaryDirectory(prefix="graft-bench-vllm-") as logs:
        if args.compiled_only:
            results = {"variants": {v: VARIANTS[v] for v in variants}, "cpus": args.cpus}
        else:
            progress(f"vllm: {rounds} interleaved rounds of {', '.join(workloads)} on {', '.join(variants)}")
            results = measure(rounds, variants, workloads, model_dir, Path(logs), progress, profile=args.profile,
                              cpus=args.cpus, kv_cache_dtype=args.kv_cache_dtype, tuning_table=table)
        if args.compiled or args.compiled_only:
            compiled_rounds = 1 if args.quick else 2
            progress(f"vllm: compiled mode from a cold start, {compiled_rounds} run(s) per variant")
            results["compiled"] = measure_compiled(compiled_rounds, variants, model_dir, Path(logs), progress,
                                                   cpus=args.cpus, tuning_table=table)
    results.update(bench="vllm", quick=bool(args.quick), vllm=vllm_module.__version__, model=MODEL, tuning_table=table,
                   seconds=time.perf_counter() - started)
    for line in report_lines(results):
        progress(line)
    progress(f"done in {results['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        progress(f"wrote {args.json}")
    return 0
