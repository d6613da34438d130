"""KV-cache reuse with a real transformer: ``python -m gdkv_demo.reuse``.

Request A prefills a prompt and stores its KV cache in gdkv as blocks of ``--block-tokens``
tokens (each block's K and V for every layer, under chain keys salted with the model's identity
and KV layout). Request B runs in a new process: its prompt shares a long prefix with A's. It asks
gdkv once how many leading blocks exist (``lookup_prefix``), loads them in one batch straight into
the model's cache tensors (``get_many_into``, each block scattered into every layer's K and V),
and prefills only the rest. B also recomputes its whole prompt in the same process, and the demo
prints the time to first token of both, and checks that the greedy output tokens are identical
and the logits equal within ``--tolerance``.

    python -m gdkv_demo.reuse --connect /run/gdkvd                 # a running gdkvd (any backend)
    python -m gdkv_demo.reuse --backend rados --ceph-conf ceph.conf  # in-process controller on RADOS
    python -m gdkv_demo.reuse --backend local --store DIR          # in-process local store
    python -m gdkv_demo.reuse --backend local --device cuda        # the model and its KV on a GPU:
                                                             # blocks move by the CUDA copy engine

The model is a Llama-architecture transformer with random weights from a fixed seed, built and
saved locally the first time (``--model``; nothing is downloaded). Exit status 0 when B's output
matched, 1 when it did not, 2 for usage errors.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_MODEL = os.environ.get("GDKV_MODEL_DIR",
                               str(Path.home() / ".cache" / "gdkv" / "models" / "llama-demo"))


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m gdkv_demo.reuse",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--connect", metavar="DIR", help="the socket directory of a running gdkvd")
    where.add_argument("--backend", choices=["local", "rados"],
                       help="an in-process controller over this backend (default: local)")
    p.add_argument("--store", help="local store directory (default: as gdkv.open)")
    p.add_argument("--pool", default="gdkv-rep3", help="RADOS pool (default gdkv-rep3)")
    p.add_argument("--ceph-conf", default=os.environ.get("GDKV_CEPH_CONF", ""),
                   help="ceph.conf (default $GDKV_CEPH_CONF, then librados' default)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model and its KV cache live (cuda: in-process backends only; "
                        "the blocks move between gdkv and the CUDA tensors by its copy engine)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model folder (default {DEFAULT_MODEL})")
    p.add_argument("--prompt-tokens", type=int, default=3072, help="tokens in each prompt (3072)")
    p.add_argument("--shared-tokens", type=int, default=2560,
                   help="leading tokens B shares with A (2560)")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per KV block (64)")
    p.add_argument("--steps", type=int, default=16, help="greedy tokens B generates (16)")
    p.add_argument("--seed", type=int, default=1, help="seed of the prompts' token ids (1)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest |logit difference| accepted between reuse and recompute (1e-4)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--phase", choices=["store", "reuse"], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not 0 < a.shared_tokens <= a.prompt_tokens or a.block_tokens < 1 or a.steps < 1:
        p.error("need 0 < --shared-tokens <= --prompt-tokens, --block-tokens >= 1, --steps >= 1")
    if a.device == "cuda" and a.connect:
        p.error("--device cuda needs an in-process controller (--backend): through gdkvd the "
                "package does not reach CUDA memory yet")
    return a


def _client(a):
    import gdkv

    if a.connect:
        return gdkv.connect(a.connect)
    cuda = 0 if a.device == "cuda" else None
    if (a.backend or "local") == "rados":
        return gdkv.open("rados", pool=a.pool, ceph_conf=a.ceph_conf, cuda_device=cuda)
    return gdkv.open("local", store=a.store, cuda_device=cuda)


def _buffer(c, a, shape, dtype):
    """A tensor gdkv moves bytes to and from in place: in the client's memory on the CPU; on
    the GPU a CUDA tensor registered with the controller's copy engine (unregister it after)."""
    if a.device == "cpu":
        return c.empty(shape, dtype)
    import torch

    t = torch.empty(shape, dtype=dtype, device="cuda")
    c.register(t)
    return t


def _sync(a):
    if a.device == "cuda":
        import torch

        torch.cuda.synchronize()


def _prompts(a, vocab):
    import numpy as np

    rng = np.random.default_rng(a.seed)
    prompt_a = rng.integers(0, vocab, a.prompt_tokens).tolist()
    tail = np.random.default_rng(a.seed + 1_000_003).integers(
        0, vocab, a.prompt_tokens - a.shared_tokens).tolist()
    return prompt_a, prompt_a[:a.shared_tokens] + tail


def _salt(model, layout, block_tokens):
    """Keys name the model, its KV layout and the block size: different models never collide."""
    from . import model as m

    return (f"gdkv-demo|{m.model_identity(model)}|{layout['dtype']}|L{layout['layers']}"
            f"/H{layout['kv_heads']}/D{layout['head_dim']}|B{block_tokens}")


def _store(a):
    """Request A: prefill, then store every full block gdkv does not have yet."""
    import torch

    import gdkv
    from . import model as m

    model = m.load_model(a.model, device=a.device)
    layout = m.kv_layout(model)
    prompt_a, _ = _prompts(a, model.config.vocab_size)
    t0 = time.perf_counter()
    _, cache = m.prefill(model, prompt_a)
    _sync(a)
    prefill_s = time.perf_counter() - t0
    B, L, H, D = a.block_tokens, layout["layers"], layout["kv_heads"], layout["head_dim"]
    keys = gdkv.chain_keys(prompt_a, B, _salt(model, layout, B))
    kv = m.layer_kv(cache)
    with _client(a) as c:
        todo = [i for i, have in enumerate(gdkv.raise_first(c.exists_many(keys))) if not have]
        t0 = time.perf_counter()
        if todo:
            # One block = [layer][K|V][kv head][token][dim]: gathered from the cache once into
            # memory gdkv reads in place, then stored in one batch.
            blocks = _buffer(c, a, (len(todo), L, 2, H, B, D), layout["dtype"])
            for j, i in enumerate(todo):
                for layer, (k, v) in enumerate(kv):
                    blocks[j, layer, 0].copy_(k[0, :, i * B:(i + 1) * B])
                    blocks[j, layer, 1].copy_(v[0, :, i * B:(i + 1) * B])
            gdkv.raise_first(c.put_many((keys[i], blocks[j]) for j, i in enumerate(todo)))
            if a.device == "cuda":
                c.unregister(blocks)
        store_s = time.perf_counter() - t0
        copies = c.copies()
    block_bytes = B * layout["bytes_per_token"]
    return {"pid": os.getpid(), "prompt_tokens": len(prompt_a), "prefill_s": prefill_s,
            "blocks": len(keys), "stored_blocks": len(todo), "stored_bytes": len(todo) * block_bytes,
            "store_s": store_s, "copies": copies[0], "torch_threads": torch.get_num_threads()}


def _reuse(a):
    """Request B: full recompute, then the same prompt with the stored prefix loaded from gdkv."""
    import gdkv
    from . import model as m

    model = m.load_model(a.model, device=a.device)
    layout = m.kv_layout(model)
    _, prompt_b = _prompts(a, model.config.vocab_size)
    m.prefill(model, prompt_b[:512])  # warm-up: the first forward pays for one-time set-up
    _sync(a)

    t0 = time.perf_counter()
    logits_full, cache_full = m.prefill(model, prompt_b)
    _sync(a)
    ttft_full = time.perf_counter() - t0
    tokens_full, steps_full = m.greedy(model, cache_full, logits_full, a.steps)
    del cache_full

    B, L, H, D = a.block_tokens, layout["layers"], layout["kv_heads"], layout["head_dim"]
    block_bytes = B * layout["bytes_per_token"]
    salt = _salt(model, layout, B)  # once per model (it hashes the weights), as an engine would
    with _client(a) as c:
        t0 = time.perf_counter()
        keys = gdkv.chain_keys(prompt_b, B, salt)
        found = c.lookup_prefix(keys)
        n = min(found, (len(prompt_b) - 1) // B)  # at least one token is computed for logits
        loaded = 0
        past = None
        if n:
            # The model's cache tensors, in memory gdkv writes in place: per layer K and V of
            # shape [1, kv_heads, tokens, head_dim]. Each block lands in L * 2 * H pieces.
            kv = _buffer(c, a, (L, 2, 1, H, n * B, D), layout["dtype"])
            outs = [[kv[layer, j, 0, h, i * B:(i + 1) * B] for layer in range(L)
                     for j in range(2) for h in range(H)] for i in range(n)]
            lens = c.get_many_into(keys[:n], outs)
            # A block deleted since the lookup, or one that failed or is not a block long, ends
            # the prefix; the model recomputes from there.
            while loaded < n and lens[loaded] == block_bytes:
                loaded += 1
        P = loaded * B
        if P:
            past = [(kv[layer, 0, :, :, :P], kv[layer, 1, :, :, :P]) for layer in range(L)]
        _sync(a)
        load_s = time.perf_counter() - t0
        logits_reuse, cache_reuse = m.prefill(model, prompt_b[P:], past)
        _sync(a)
        ttft_reuse = time.perf_counter() - t0
        copies = c.copies()
        if n and a.device == "cuda":
            c.unregister(kv)   # the bytes have landed; the tensor stays the model's cache
    tokens_reuse, steps_reuse = m.greedy(model, cache_reuse, logits_reuse, a.steps)
    diff = max(float((x - y).abs().max())
               for x, y in zip([logits_full, *steps_full], [logits_reuse, *steps_reuse]))
    return {"pid": os.getpid(), "prompt_tokens": len(prompt_b), "shared_tokens": a.shared_tokens,
            "blocks_in_prompt": len(keys), "blocks_found": found, "blocks_loaded": loaded,
            "tokens_loaded": P, "bytes_loaded": loaded * block_bytes, "load_s": load_s,
            "ttft_reuse_s": ttft_reuse, "ttft_full_s": ttft_full,
            "tokens_identical": tokens_full == tokens_reuse, "tokens": tokens_reuse,
            "max_abs_logit_diff": diff, "copies": copies[0]}


def _run_phase(a, argv, phase):
    """Runs a phase in a new Python process and returns its JSON result."""
    from . import child_env
    cmd = [sys.executable, "-m", "gdkv_demo.reuse", *argv, "--phase", phase, "--json"]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, check=False, env=child_env())
    if out.returncode != 0:
        raise SystemExit(f"gdkv_demo.reuse: request {'A' if phase == 'store' else 'B'} failed "
                         f"(exit {out.returncode})")
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def _mib(n):
    return f"{n / (1 << 20):.1f} MiB"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _args(argv)
    import torch

    torch.set_num_threads(a.threads)
    if a.phase:
        result = _store(a) if a.phase == "store" else _reuse(a)
        print(json.dumps(result))
        return 0

    from . import model as m

    m.build_model(a.model)
    A = _run_phase(a, argv, "store")
    Bq = _run_phase(a, argv, "reuse")
    # Reuse must have happened: every full block of the shared prefix (leaving one token to
    # compute) was loaded. Identical tokens from a full recompute would prove nothing.
    expected = min(a.shared_tokens // a.block_tokens, (a.prompt_tokens - 1) // a.block_tokens)
    ok = (Bq["tokens_identical"] and Bq["max_abs_logit_diff"] <= a.tolerance
          and Bq["blocks_loaded"] == expected)
    where = (f"gdkvd at {a.connect}" if a.connect else
             f"in-process {a.backend or 'local'} backend")
    if a.device == "cuda":
        where += f", model and KV on {torch.cuda.get_device_name(0)}"
    if a.json:
        print(json.dumps({"ok": ok, "where": where, "tolerance": a.tolerance, "store": A,
                          "reuse": Bq}))
        return 0 if ok else 1
    layout = json.loads((Path(a.model) / "config.json").read_text())
    share = Bq["tokens_loaded"] / Bq["prompt_tokens"]
    speedup = Bq["ttft_full_s"] / Bq["ttft_reuse_s"]
    print(f"gdkv KV-cache reuse: Llama model ({layout['num_hidden_layers']} layers, "
          f"random weights) through {where}, {a.block_tokens}-token blocks")
    print(f"  request A (process {A['pid']}): prefilled {A['prompt_tokens']} tokens in "
          f"{A['prefill_s']:.2f} s, stored {A['stored_blocks']} of {A['blocks']} blocks "
          f"({_mib(A['stored_bytes'])})")
    print(f"  request B (process {Bq['pid']}): {Bq['prompt_tokens']} tokens, the first "
          f"{Bq['shared_tokens']} shared with A; found {Bq['blocks_found']} blocks, loaded "
          f"{Bq['blocks_loaded']} ({_mib(Bq['bytes_loaded'])}, {share:.0%} of the prompt) in "
          f"{Bq['load_s'] * 1e3:.0f} ms, {Bq['copies']} staging copies")
    print(f"  time to first token: {Bq['ttft_reuse_s']:.2f} s with reuse, "
          f"{Bq['ttft_full_s']:.2f} s recomputing ({speedup:.1f}x)")
    same = "identical to" if Bq["tokens_identical"] else "DIFFERENT from"
    print(f"  output: {a.steps} greedy tokens {same} the full recompute; logits max |diff| "
          f"{Bq['max_abs_logit_diff']:.1e} (tolerance {a.tolerance:.0e})")
    if ok:
        print("  OK")
    elif Bq["blocks_loaded"] != expected:
        print(f"  FAILED: {Bq['blocks_loaded']} blocks were reused, {expected} expected")
    else:
        print("  FAILED: reuse changed the output")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
