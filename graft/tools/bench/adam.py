"""graft's Adam against ``torch.optim.Adam(foreach=True)`` on the same tensor: the in-place
multi-tensor form optimizers use (:func:`graft.ops.fused.adam_step_`) and the functional op
with its results copied back."""
from __future__ import annotations

import torch

from graft.tools.bench.timing import interleaved


def measure(numel: int, rounds: int, inner: int, progress=print) -> dict:
    from graft.ops.fused import adam_step, adam_step_

    gen = torch.Generator().manual_seed(0)
    init = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen)
    param = torch.nn.Parameter(init.clone())
    param.grad = grad.clone()
    torch_adam = torch.optim.Adam([param], lr=1e-3, foreach=True)
    p, m, v = init.clone(), torch.zeros(numel), torch.zeros(numel)
    step = [0]

    def graft_inplace():
        step[0] += 1
        adam_step_([p], [grad], [m], [v], 1e-3, 0.9, 0.999, 1e-8, step[0])

    def graft_functional():
        step[0] += 1
        new = adam_step(p, grad, m, v, 1e-3, 0.9, 0.999, 1e-8, step[0])
        for dst, src in zip((p, m, v), new):
            dst.copy_(src)

    with torch.no_grad():
        times = interleaved({"torch.optim.Adam": torch_adam.step, "graft": graft_inplace,
                             "graft_functional": graft_functional}, rounds=rounds, inner=inner)
    result = {"numel": numel, "torch_us": times["torch.optim.Adam"] * 1e6, "graft_us": times["graft"] * 1e6,
              "graft_functional_us": times["graft_functional"] * 1e6,
              "ratio": times.ratio("graft", "torch.optim.Adam"),
              "functional_ratio": times.ratio("graft_functional", "torch.optim.Adam")}
    progress(f"  adam {numel} fp32: torch.optim.Adam(foreach) {result['torch_us']:.1f} us, graft (in place) "
             f"{result['graft_us']:.1f} us -> {result['ratio']:.2f}x; functional op {result['functional_ratio']:.2f}x")
    return result
