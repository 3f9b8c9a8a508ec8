"""LoRA fine-tuning through `strata train` against transformers + peft + torch.optim.AdamW.

  lora_oracle.py STRATA_BIN WORKDIR CASE

Each case makes a tiny model with transformers (save_pretrained) and a PEFT LoRA adapter on q, k,
v, o, gate, up and down (r 8, lora_alpha 16) initialized with init_lora_weights=False, so that B
is not zero and A has a gradient from the first step (save_pretrained: adapter_config.json and
adapter_model.safetensors). `strata train` starts from both (model.init_from, model.adapter_from)
for 4 steps of masked SFT in fp32; peft trains the same adapter with torch.optim.AdamW and
clip_grad_norm_ over the adapters. Compared: the per-step losses (1e-6 relative), the adapters
after the last step (||diff|| / ||ref|| <= 1e-5 per tensor), and the base, bitwise untouched.
Strata's export holds the base and the adapters' tensors (model.safetensors), read here. Exit 0 on
agreement, 1 otherwise.

Cases:
  llama        Llama with grouped-query attention and an odd intermediate size (83), one rank.
  qwen2        Qwen2 (q/k/v biases), one rank.
  llama-2rank  the Llama case under `strata launch -n 2`, the frozen base in NVMe swap.
"""
import json
import os
import subprocess
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_oracle import mean_loss, sft_batch, sft_examples, write_sft  # noqa: E402

SEQ = 24
MICRO, ACCUM = 2, 2
LR, WD, BETAS, EPS, CLIP = 3e-3, 0.1, (0.9, 0.95), 1e-8, 1.0
STEPS = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(case, vocab):
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=48, intermediate_size=83, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if case.startswith("llama"):
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif case == "qwen2":
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, use_sliding_window=False))
    else:
        raise SystemExit(f"unknown case {case}")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # every tensor away from its default (norm weights, biases included)
        for _, p in sorted(m.named_parameters()):
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return m.float()


def read_safetensors(path):
    from safetensors import safe_open
    out = {}
    with safe_open(path, "pt") as st:
        for k in st.keys():
            out[k] = st.get_tensor(k)
    return out


def main():
    strata, work, case = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(work, exist_ok=True)
    from peft import LoraConfig, get_peft_model
    vocab = 61
    base = base_model(case, vocab)
    model_dir, adapter_dir = os.path.join(work, "model"), os.path.join(work, "adapter")
    base.save_pretrained(model_dir, safe_serialization=True)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0,
                                            init_lora_weights=False))
    model.save_pretrained(adapter_dir)
    world = 2 if case.endswith("2rank") else 1
    rng = np.random.default_rng(11)
    train = sft_examples(rng, MICRO * ACCUM * world, vocab, [9, 25, 31, 14, 20, 40, 25, 11])
    write_sft(os.path.join(work, "train.sft"), train)
    cfg = {"model": {"init_from": model_dir, "adapter_from": adapter_dir},
           "data": {"seq_len": SEQ, "seed": 3, "path": os.path.join(work, "train.sft"), "format": "sft"},
           "batch": {"micro_batch": MICRO, "grad_accum": ACCUM},
           "optimizer": {"type": "adamw", "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
                         "clip_grad_norm": CLIP},
           "device": {"budget": "64MiB"},
           "run": {"steps": STEPS, "progress": False, "log": os.path.join(work, "log.jsonl"),
                   "export": os.path.join(work, "export"), "export_overwrite": True}}
    if world > 1:
        cfg["placement"] = {"params": "nvme", "grads": "host", "master": "host", "moments": "host"}
        cfg["offload"] = {"nvme_dirs": [os.path.join(work, "swap")]}
        os.makedirs(os.path.join(work, "swap"), exist_ok=True)
    with open(os.path.join(work, "train.json"), "w") as f:
        json.dump(cfg, f)
    cmd = [strata, "train", "--config", os.path.join(work, "train.json")]
    if world > 1:
        cmd = [strata, "launch", "-n", str(world), "--"] + cmd
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stdout, run.stderr)
        print(f"FAIL: strata exited {run.returncode}")
        return 1
    got = [json.loads(l)["loss"] for l in open(cfg["run"]["log"]) if '"event"' not in l]

    # The oracle: peft's model, AdamW and clipping over the parameters that require gradients.
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    ids, labels = sft_batch(train)
    want = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = mean_loss(model, ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        opt.step()
        want.append(loss.item())
    ok = True
    print("losses strata", got, "peft", want)
    if len(got) != STEPS or any(abs(a - b) > 1e-6 * abs(b) for a, b in zip(got, want)):
        print("FAIL: training losses differ")
        ok = False

    exported = read_safetensors(os.path.join(work, "export", "model.safetensors"))
    worst, worst_name, adapters = 0.0, "", 0
    for name, p in model.named_parameters():
        if "lora_" not in name:
            continue
        adapters += 1
        # base_model.model.<module>.lora_A.default.weight -> <module>.lora_A.weight
        key = name.replace("base_model.model.", "", 1).replace(".default.", ".")
        if key not in exported:
            print(f"FAIL: adapter {key} not exported")
            ok = False
            continue
        ref = p.detach().float()
        e = float((exported[key].float() - ref).norm() / max(ref.norm(), 1e-30))
        if e > worst:
            worst, worst_name = e, key
    print(f"adapters: {adapters}, worst relative error {worst:.3g} ({worst_name})")
    if adapters == 0 or worst > 1e-5:
        print("FAIL: adapters differ")
        ok = False
    changed = [k for k, v in base_state.items() if k in exported and not torch.equal(exported[k], v)]
    missing = [k for k in base_state if k not in exported]
    if changed or missing:
        print("FAIL: the base changed:", changed, "or is missing:", missing)
        ok = False
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
