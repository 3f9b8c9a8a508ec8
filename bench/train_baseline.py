#!/usr/bin/env python3
"""PyTorch baselines for `strata bench train`: seconds per training step of a GPT-2-shaped decoder.

The model matches Strata's `gpt2` presets exactly (same parameter count and FLOPs): token embedding
[vocab, d] tied with the LM head, learned positions [max_pos, d], pre-LayerNorm blocks with a fused
qkv projection, causal SDPA attention and a 4d tanh-GELU MLP, a final LayerNorm, fp32 cross entropy
over the token mean. One step = forward + backward (per-block activation recompute) + grad-norm clip
+ AdamW, on a fixed batch of random tokens; the median of the timed steps is reported.

Modes:
  plain  everything on the GPU, fp32 master params, bf16 autocast, fused CUDA AdamW.
  fsdp2  FSDP2 (fully_shard) in a one-process world with CPUOffloadPolicy (params, grads and
         optimizer state on the host, bf16 params on the GPU for compute) and the fused CPU AdamW
         (--default-adamw: torch's default foreach/for-loop one): the usual "offload with PyTorch".

`strata bench train` (and scripts/gpu-machine.sh, phase `baseline`) runs this with the same
--layers/--hidden/--seq/--batch as its own run and compares against the LAST stdout line, one JSON
object: {"metric": "train_step_seconds", "mode", "params", "layers", "hidden", "seq", "batch",
"adamw", "value" (median s), "model_tflops", "peak_gpu_bytes", "oom"}. An out-of-memory is a result
("oom": true, "value": null), not a crash. Progress goes to stderr.
Model TFLOPS = (6*N*tokens + 12*L*d*T*tokens) / step_seconds / 1e12, tokens = batch*seq.
"""
import argparse, json, os, statistics, sys, tempfile, time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def log(*a):
    print("[train_baseline]", *a, file=sys.stderr, flush=True)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, max_pos, d, layers, heads):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_pos, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight), nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied LM head
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def setup_fsdp2(model, dev):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1").items():
        os.environ.setdefault(k, v)
    store = tempfile.NamedTemporaryFile(prefix="strata-baseline-store-", delete=False).name
    os.unlink(store)  # FileStore wants to create it
    backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method="file://" + store, rank=0, world_size=1)
    mesh = init_device_mesh(dev.type, (1,))
    # pin_memory needs a CUDA driver; without one (CPU smoke test) the offload is a no-op anyway.
    kw = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=dev.type == "cuda"),
              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for blk in model.blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    return model, store


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["plain", "fsdp2"], default="plain")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=None, help="default hidden // 128")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--max-pos", type=int, default=None, help="position table rows (default --seq)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip", type=float, default=1.0, help="grad-norm clip, as Strata's configs; 0 = off")
    p.add_argument("--default-adamw", action="store_true", help="fsdp2: torch's default AdamW, not fused")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    heads = a.heads or max(1, a.hidden // 128)
    max_pos = a.max_pos or a.seq
    dev = torch.device("cuda", 0) if a.device == "cuda" else torch.device(a.device)
    cuda = dev.type == "cuda"
    if a.hidden % heads:
        p.error("--hidden must be divisible by --heads")
    if a.steps < 1:
        p.error("--steps must be at least 1")
    if max_pos < a.seq:
        p.error("--max-pos must be at least --seq")
    torch.manual_seed(a.seed)
    if cuda:
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    tokens = a.batch * a.seq
    result = dict(metric="train_step_seconds", mode=a.mode,
                  adamw="default" if a.mode == "fsdp2" and a.default_adamw else "fused",
                  params=None, layers=a.layers, hidden=a.hidden, seq=a.seq, batch=a.batch,
                  value=None, model_tflops=None, peak_gpu_bytes=0, oom=False)
    store = None
    try:
        # plain: build straight on the device; fsdp2: on the host, FSDP2 keeps the shards there.
        with torch.device(dev if a.mode == "plain" else "cpu"):
            model = GPT(a.vocab, max_pos, a.hidden, a.layers, heads)
        n = sum(q.numel() for q in model.parameters())  # parameters() yields the tied wte once
        result["params"] = n
        log(f"mode {a.mode}: {n / 1e6:.1f}M params, {a.layers} layers, d {a.hidden}, {heads} heads, "
            f"{a.batch}x{a.seq} tokens/step, device {dev}")
        if a.mode == "fsdp2":
            model, store = setup_fsdp2(model, dev)
        fused = a.mode == "plain" or not a.default_adamw
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                fused=fused or None)
        log(f"AdamW fused={fused}")
        g = torch.Generator().manual_seed(a.seed)
        data = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(dev)
        idx, tgt = data[:, :-1].contiguous(), data[:, 1:].contiguous()
        amp_dtype = torch.bfloat16
        times = []
        for step in range(a.warmup + a.steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=amp_dtype):
                loss = model(idx, tgt)
            loss.backward()
            if a.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            warm = step < a.warmup
            if not warm:
                times.append(dt)
            log(f"step {step}{' (warmup)' if warm else ''}: {dt:.3f} s, loss {loss.item():.4f}")
        s = statistics.median(times)
        result["value"] = s
        result["model_tflops"] = (6 * n * tokens + 12 * a.layers * a.hidden * a.seq * tokens) / s / 1e12
    except torch.cuda.OutOfMemoryError as e:
        log("out of memory:", str(e).splitlines()[0])
        result["oom"] = True
    if cuda:
        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    log(f"median {result['value']} s/step, model TFLOPS {result['model_tflops']}")
    if store is not None:
        import torch.distributed as dist
        dist.destroy_process_group()
        if os.path.exists(store):
            os.unlink(store)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
