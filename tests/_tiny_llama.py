"""A tiny Llama-style decoder (RMSNorm, RoPE, GQA causal attention, SwiGLU) written on graft's
ops, for training tests: ``GRAFT`` runs graft's selected implementations (Triton here),
``reference_ops()`` the torch references that define the ops."""
from __future__ import annotations

import types

import torch

from graft.ops import attention, fused, gemm

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, SEQ, BATCH = 64, 32, 2, 1, 16, 48, 8, 1

GRAFT = types.SimpleNamespace(rms_norm=fused.rms_norm, linear=gemm.linear, rope=fused.rotary_embedding,
                              attention=attention.prefill, silu_and_mul=fused.silu_and_mul)


def reference_ops():
    """The torch references (looked up now, so a test may have wrapped them)."""
    return types.SimpleNamespace(rms_norm=fused.rms_norm_reference, linear=gemm.linear_reference,
                                 rope=fused.rotary_embedding_reference, attention=attention.prefill_reference,
                                 silu_and_mul=fused.silu_and_mul_reference)


class TinyLlama(torch.nn.Module):
    def __init__(self, layers: int = 1, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)

        def param(*shape, scale=None):
            scale = scale if scale is not None else shape[-1] ** -0.5
            return torch.nn.Parameter(torch.randn(*shape, generator=gen) * scale)

        qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.embed = param(VOCAB, HIDDEN, scale=1.0)
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            layer = torch.nn.Module()
            layer.ln1 = torch.nn.Parameter(1.0 + 0.1 * torch.randn(HIDDEN, generator=gen))
            layer.wqkv = param(qkv, HIDDEN)
            layer.wo = param(HIDDEN, HEADS * HEAD_DIM)
            layer.ln2 = torch.nn.Parameter(1.0 + 0.1 * torch.randn(HIDDEN, generator=gen))
            layer.w13 = param(2 * FFN, HIDDEN)
            layer.b13 = torch.nn.Parameter(torch.zeros(2 * FFN))  # a bias, so gemm.linear's dbias trains too
            layer.w2 = param(HIDDEN, FFN)
            self.layers.append(layer)
        self.ln_f = torch.nn.Parameter(torch.ones(HIDDEN))
        self.head = param(VOCAB, HIDDEN)
        self.register_buffer("cos_sin", fused.cos_sin_cache(SEQ, HEAD_DIM))

    def forward(self, tokens, ops):
        batch, seq = tokens.shape
        tokens_total = batch * seq
        positions = torch.arange(seq).repeat(batch)
        cu = torch.arange(0, tokens_total + 1, seq, dtype=torch.int32)
        x = self.embed[tokens.reshape(-1)]
        for layer in self.layers:
            h = ops.rms_norm(x, layer.ln1, 1e-6)
            qkv = ops.linear(h, layer.wqkv)
            q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            q, k = ops.rope(positions, q, k, HEAD_DIM, self.cos_sin, True)
            o = ops.attention(q.reshape(tokens_total, HEADS, HEAD_DIM), k.reshape(tokens_total, KV_HEADS, HEAD_DIM),
                              v.reshape(tokens_total, KV_HEADS, HEAD_DIM), cu, cu, seq, seq, True)
            attn = ops.linear(o.reshape(tokens_total, -1), layer.wo)
            h, x = ops.rms_norm(attn, layer.ln2, 1e-6, x)  # fused residual add
            x = x + ops.linear(ops.silu_and_mul(ops.linear(h, layer.w13, layer.b13)), layer.w2)
        logits = torch.nn.functional.linear(ops.rms_norm(x, self.ln_f, 1e-6), self.head)
        return logits.view(batch, seq, VOCAB)


def batches(steps: int, seed: int = 1):
    """A learnable toy task: predict the next token of a shifted arithmetic sequence."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
        stride = torch.randint(1, 4, (BATCH, 1), generator=gen)
        seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        yield seq[:, :-1], seq[:, 1:]


def train(ops, steps: int, lr: float = 1e-2, layers: int = 1):
    """Losses per step and the final parameters of ``steps`` Adam steps."""
    model = TinyLlama(layers)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for tokens, labels in batches(steps):
        logits = model(tokens, ops)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
