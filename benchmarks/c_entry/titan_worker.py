"""One TorchTitan llama3 debug model (graft's converter on, GRAFT_BACKENDS=torch so graft serves
norm and SwiGLU), trained step by step on command: 'step N' -> seconds for N steps."""
import json
import sys
import time

import torch

from graft.tools.bench.torchtitan_step import build_model

torch.set_num_threads(1)
spec, model = build_model("llama3", graft_on=True, n_layers=4)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
gen = torch.Generator().manual_seed(0)
vocab = model.tok_embeddings.weight.shape[0] if hasattr(model, "tok_embeddings") else 2000
tokens = torch.randint(0, vocab, (2, 64), generator=gen)
labels = torch.randint(0, vocab, (2, 64), generator=gen)


def step():
    opt.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    loss.backward()
    opt.step()


for _ in range(3):
    step()
from graft.integration import served_calls

from graft.adapters.torchtitan.integration import counter
counter.reset()
step()
print(json.dumps({"ready": True, "calls_per_step": sum(served_calls("torchtitan").values()),
                  "entry": __import__("graft.dispatch").dispatch.call.__class__.__name__}), flush=True)
for line in sys.stdin:
    n = int(line.split()[1])
    start = time.perf_counter()
    for _ in range(n):
        step()
    print(json.dumps({"s": (time.perf_counter() - start) / n}), flush=True)
