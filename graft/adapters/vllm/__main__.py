"""``python -m graft.adapters.vllm``: load vLLM's general plugins the way vLLM does and
show what graft registered (or why it stayed out)."""
from __future__ import annotations

import sys


def main() -> int:
    from graft.adapters.vllm.integration import INTEGRATION

    ok, why = INTEGRATION.status()
    print(f"graft vLLM integration: {'ready' if ok else 'off'} ({why})")
    if INTEGRATION.installed_version() is None:
        return 1
    if not ok:
        return 0  # nothing of graft's would be registered; vLLM runs unchanged
    import vllm.plugins
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from graft.adapters.vllm.plugin import activation_summary
    from graft.integration import served_calls

    vllm.plugins.load_general_plugins()  # vLLM's own loader (honours VLLM_PLUGINS)
    summary = activation_summary()
    if summary is None:
        print("graft's register() did not activate anything in this process (see the reason above / VLLM_PLUGINS)")
        return 0
    for part, status in summary.items():
        print(f"  {part}: {status}")
    for name, cls in sorted(op_registry_oot.items()):
        if cls.__module__.startswith("graft."):
            print(f"  vLLM {name} -> {cls.__module__}.{cls.__qualname__}")
    # GRAFT itself, plus any built-in name GRAFT_VLLM_ATTENTION_OVERRIDE routed to graft.
    for name, member in AttentionBackendEnum.__members__.items():
        path = _path_or_none(member)
        if path and path.startswith("graft."):
            print(f"  attention backend {name} -> {path}")
    # Counted where the model runs: here only for an engine built in this process. From an
    # engine's own process: LLM(..., worker_extension_cls=graft.adapters.vllm.worker.WORKER_EXTENSION)
    # and graft.adapters.vllm.worker.engine_served_calls(llm).
    served = served_calls("vllm")
    print("  served in this process: " + (", ".join(f"{k} x{n}" for k, n in sorted(served.items())) or "nothing yet"))
    return 0


def _path_or_none(member) -> str | None:
    try:
        return member.get_path()
    except ValueError:  # the CUSTOM placeholder has no path until registered
        return None


if __name__ == "__main__":
    sys.exit(main())
