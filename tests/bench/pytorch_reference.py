#!/usr/bin/env python3
"""The runtime's model in PyTorch eager, for speed comparisons (scripts/bench-vs-pytorch on the
CPU, scripts/bench-vs-pytorch-gpu on a GPU).

Same architecture as runtime/model/stage_model.h: token + learned position embeddings,
pre-LayerNorm blocks (causal multi-head attention with biases, GELU(tanh) MLP of 4x width),
final LayerNorm, LM head tied to the token embedding, mean cross-entropy; AdamW on FP32
weights. Times whole optimizer steps (forward, backward, step) on random tokens and prints
one JSON line: {"tokens_per_s": ..., "step_time_s": ..., "device": ..., "dtype": ..., ...}.
The step time is the median of the steps after the first --warmup ones, as the runtime reports
its own (the median step, the first excluded).

Precision follows the runtime's mixed-precision recipe: FP32 master weights and optimizer,
matrix products in --dtype. bf16/fp16 run the forward under torch.autocast; fp16 adds a
dynamic loss scale (torch GradScaler) with the runtime's defaults (initial 65536, x2 after
1000 clean steps, x0.5 on overflow; the runtime's hysteresis has no PyTorch counterpart).
tf32 (GPU only) lets FP32 matrix products use TF32 tensor cores.
"""
import argparse
import contextlib
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, h, heads, attention):
        super().__init__()
        self.heads = heads
        self.attention = attention
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
        if self.attention == "sdpa":  # PyTorch's fused kernels (flash / memory-efficient)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # the runtime's formulation: the whole score matrix, masked, softmax
            att = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.heads)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        y = y.transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, h, heads, seq, vocab, attention="eager"):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads, attention) for _ in range(layers))
        self.lnf = nn.LayerNorm(h)

    def forward(self, tokens, targets):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def grad_scaler(init_scale):
    """torch.amp.GradScaler (torch >= 2.3) or its older CUDA-only spelling."""
    kwargs = dict(init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000)
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda", **kwargs)
    return torch.cuda.amp.GradScaler(**kwargs)


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
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "tf32", "bf16", "fp16"], default="fp32",
                   help="format of the matrix products; weights and optimizer stay FP32")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the timing")
    p.add_argument("--attention", choices=["eager", "sdpa"], default="eager",
                   help="eager: the runtime's formulation; sdpa: torch's fused attention")
    p.add_argument("--loss-scale", type=float, default=65536.0, help="fp16: initial dynamic loss scale")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (forward and loss; the warm-up steps pay the compile)")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    if a.attention == "sdpa" and not hasattr(F, "scaled_dot_product_attention"):
        p.error(f"--attention sdpa needs torch 2.0 or later (this is {torch.__version__})")
    if a.dtype == "tf32" and a.device != "cuda":
        p.error("--dtype tf32 needs --device cuda (TF32 is a tensor-core mode)")
    if a.dtype == "fp16" and a.device != "cuda":
        p.error("--dtype fp16 needs --device cuda (the loss scaler is CUDA-only in older torch)")

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = a.dtype == "tf32"
        torch.backends.cudnn.allow_tf32 = a.dtype == "tf32"
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.dtype)
    scaler = grad_scaler(a.loss_scale) if a.dtype == "fp16" else None

    torch.manual_seed(1)
    torch.set_num_threads(a.threads)
    model = GPT(a.layers, a.hidden, a.heads, a.seq, a.vocab, a.attention).to(device)
    params = list(model.parameters())
    if a.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    data = torch.randint(0, a.vocab, (a.steps, a.micro_batches, a.micro_batch, a.seq + 1)).to(device)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    times = []
    for step in range(a.steps):
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for mb in range(a.micro_batches):
            chunk = data[step, mb]
            with torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext():
                loss = model(chunk[:, :-1], chunk[:, 1:]) / a.micro_batches
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        if scaler:
            scaler.step(opt)  # skipped when the gradients overflowed
            scaler.update()
        else:
            opt.step()
        sync()
        times.append(time.perf_counter() - t0)
    timed = times[a.warmup:] or times  # too few steps for a warm-up: time them all
    step_time = statistics.median(timed)
    tokens = a.micro_batch * a.micro_batches * a.seq
    result = {"tokens_per_s": tokens / step_time, "step_time_s": step_time, "threads": a.threads,
              "torch": torch.__version__, "params": sum(p.numel() for p in params), "compiled": a.compile,
              "device": a.device, "dtype": a.dtype, "timed_steps": len(timed), "attention": a.attention,
              "last_loss": loss.item() * a.micro_batches}  # the last micro-batch's
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(device)
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    if scaler:
        result["loss_scale"] = scaler.get_scale()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
