#!/usr/bin/env python3
"""The package's CUDA path on a GPU (scripts/gpu-check runs it; exit 77 without CUDA): values put
from host memory land in a registered CUDA tensor through the CUDA copy engine, whole and
scattered, and a CUDA tensor is stored from directly."""

import sys

import torch

import gdkv


def main() -> int:
    if not gdkv.cuda_build or not torch.cuda.is_available():
        print("skipped: no CUDA build or no GPU visible to PyTorch")
        return 77
    with gdkv.open("memory", cuda_device=0) as c:
        src = torch.randint(0, 255, (2 << 20,), dtype=torch.uint8)
        c.put(b"v", src)
        dst = torch.full((2 << 20,), 7, dtype=torch.uint8, device="cuda")
        c.register(dst)
        assert c.get_into(b"v", dst) == 2 << 20
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), src), "whole value"
        halves = [dst[: 1 << 20], dst[1 << 20:]]
        dst.fill_(0)
        c.get_into(b"v", halves)
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), src), "scattered value"
        c.put(b"w", dst)
        assert c.get(b"w") == src.numpy().tobytes(), "stored from CUDA memory"
        c.unregister(dst)
        assert c.copies() == (0, 0)
    print("python CUDA path: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
