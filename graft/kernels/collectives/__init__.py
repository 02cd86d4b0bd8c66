"""graft's collective implementations (registered by the ``collectives`` adapter plugin).

Modules:

``all_reduce``
    One-shot and two-shot all-reduce, the small-message technique of vLLM's custom
    all-reduce. On GPUs they run on torch's symmetric memory (peer-mapped buffers, one
    kernel, no NCCL protocol overhead); where that is unavailable they step aside for the
    library collective, with the reason logged. On the CPU (gloo) the same algorithms run
    over library primitives so that they are tested; there they exist for their
    determinism (bit-identical on every rank, independent of algorithm), not for speed.
``all_gather_quantized``
    All-gather that travels as int8 with one fp32 scale per block (ZeRO-style parameter
    gathering: about 3.9x fewer bytes for fp32 inputs, 1.9x for bf16/fp16).
``overlap``
    Tensor-parallel linear layers with communication hidden behind the GEMM: chunked
    GEMM + reduce-scatter, and all-gather + GEMM, pipelined with async work handles.
``fastpath``
    The hot path of every graft collective: one cached plan per call signature (checks,
    cross-rank agreement and selection done once), and the in-place, ``async_op`` forms.
``agreement``
    The cross-rank agreement on shapes, dtypes, algorithm and settings (through the
    process group's store), once per signature or before every call.

Their nccl-tests style benchmark is a tool: ``python -m graft.tools.bench.collectives_sweep``.
"""
