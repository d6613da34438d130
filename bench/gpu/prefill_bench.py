#!/usr/bin/env python3
"""Prefill time of a Llama-3-8B-shaped model in PyTorch, for scripts/gpu-check's TTFT comparison.

32 layers, hidden 4096, 32 query heads and 8 KV heads of 128, SwiGLU MLP of 14336, RMSNorm, RoPE,
bf16, random weights. One layer's weights serve all 32 layers (same work per layer, a 16 GB
smaller footprint); embedding and LM head are left out. Causal attention through
scaled_dot_product_attention (flash kernels where PyTorch has them). Each layer's K and V are kept,
as a prefill that fills the KV cache would.

Prints "name value unit" lines (prefill_8k_ms ...) on stdout.
Usage: prefill_bench.py [TOKENS ...]   (default 8192 32768)
"""
import sys
import time

import torch
import torch.nn.functional as F

LAYERS, D, HEADS, KV_HEADS, HD, FFN = 32, 4096, 32, 8, 128, 14336


def main() -> int:
    tokens = [int(t) for t in sys.argv[1:]] or [8192, 32768]
    if not torch.cuda.is_available():
        print("# prefill: no CUDA device visible to PyTorch", file=sys.stderr)
        return 77
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def weight(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=g) * 0.02

    w_qkv = weight(D, (HEADS + 2 * KV_HEADS) * HD)
    w_o = weight(HEADS * HD, D)
    w_gate_up = weight(D, 2 * FFN)
    w_down = weight(FFN, D)
    norm = torch.ones(D, device=dev, dtype=dt)

    def rms(x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + 1e-5)).to(dt) * norm

    def rope_tables(t):
        inv = 1.0 / (500000.0 ** (torch.arange(0, HD, 2, device=dev).float() / HD))
        ang = torch.outer(torch.arange(t, device=dev).float(), inv)
        return ang.cos().to(dt), ang.sin().to(dt)

    def rope(x, cos, sin):  # x: [heads, T, HD]
        x1, x2 = x[..., : HD // 2], x[..., HD // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

    def layer(x, cos, sin):
        t = x.shape[0]
        q, k, v = (rms(x) @ w_qkv).split([HEADS * HD, KV_HEADS * HD, KV_HEADS * HD], dim=-1)
        q = rope(q.view(t, HEADS, HD).transpose(0, 1), cos, sin)
        k = rope(k.view(t, KV_HEADS, HD).transpose(0, 1), cos, sin)
        v = v.view(t, KV_HEADS, HD).transpose(0, 1)
        rep = HEADS // KV_HEADS
        o = F.scaled_dot_product_attention(
            q.unsqueeze(0),
            k.repeat_interleave(rep, dim=0).unsqueeze(0),
            v.repeat_interleave(rep, dim=0).unsqueeze(0),
            is_causal=True,
        )
        x = x + o.squeeze(0).transpose(0, 1).reshape(t, HEADS * HD) @ w_o
        gate, up = (rms(x) @ w_gate_up).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ w_down
        return x, k.contiguous(), v.contiguous()

    def prefill(t):
        x = torch.randn(t, D, device=dev, dtype=dt, generator=g)
        cos, sin = rope_tables(t)
        kv = []
        for _ in range(LAYERS):
            x, k, v = layer(x, cos, sin)
            kv.append((k, v))
        return x, kv

    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name(0)}", file=sys.stderr)
    with torch.inference_mode():
        for t in tokens:
            prefill(min(t, 4096))  # warm-up: kernels picked, allocator primed
            torch.cuda.synchronize()
            best = None
            for _ in range(2):
                start = time.perf_counter()
                out, kv = prefill(t)
                torch.cuda.synchronize()
                ms = (time.perf_counter() - start) * 1e3
                best = ms if best is None else min(best, ms)
                del out, kv
            print(f"prefill_{t // 1024}k_ms {best:.3f} ms")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
