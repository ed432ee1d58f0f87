#!/usr/bin/env python3
"""The runtime's model in PyTorch eager, for speed comparisons (scripts/bench-vs-pytorch).

Same architecture as runtime/model/stage_model.h: token + learned position embeddings,
pre-LayerNorm blocks (causal multi-head attention with biases, GELU(tanh) MLP of 4x width),
final LayerNorm, LM head tied to the token embedding, mean cross-entropy; AdamW on FP32
weights. Times whole optimizer steps (forward, backward, step) on random byte tokens and
prints one JSON line: {"tokens_per_s": ..., "step_time_s": ..., ...}.
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 4 * h)
        self.fc_out = nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        shape = (b, s, self.heads, h // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, h, heads, seq, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(h)

    def forward(self, tokens, targets):
        pos = torch.arange(tokens.shape[1])
        x = self.wte(tokens) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()

    torch.manual_seed(1)
    torch.set_num_threads(a.threads)
    model = GPT(a.layers, a.hidden, a.heads, a.seq, a.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    data = torch.randint(0, a.vocab, (a.steps, a.micro_batches, a.micro_batch, a.seq + 1))
    times = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for mb in range(a.micro_batches):
            chunk = data[step, mb]
            loss = model(chunk[:, :-1], chunk[:, 1:]) / a.micro_batches
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    step_time = statistics.median(times[1:] if len(times) > 1 else times)
    tokens = a.micro_batch * a.micro_batches * a.seq
    print(json.dumps({"tokens_per_s": tokens / step_time, "step_time_s": step_time, "threads": a.threads,
                      "torch": torch.__version__, "params": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main()
