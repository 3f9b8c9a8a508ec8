"""Fine-tuning through `strata train` against transformers + torch.optim.AdamW.

  finetune_oracle.py STRATA_BIN WORKDIR CASE

Each case makes a tiny model with transformers (save_pretrained), runs `strata train` on it with
`model.init_from` for three steps (exporting fp32 weights), trains a transformers copy the same
way with torch.optim.AdamW (two parameter groups: no weight decay on biases and norms) and
compares the per-step losses in Strata's log, the evaluation losses, and the exported weights
(relative error ||diff|| / ||ref|| <= 1e-5 for each tensor) and logits (max|diff| / max|ref|). Exit 0 on agreement, 1 otherwise.

Cases:
  sft-llama       supervised examples (data.format "sft"): loss only on response tokens, examples of
                  awkward lengths padded and cut; an evaluation file of 5 examples (not a multiple
                  of the global batch) evaluated after every step.
  sft-llama-2rank the same under `strata launch -n 2` (the loss mean over both ranks' targets).
  eval-split      token windows (data.format "uint32") with data.eval_split: the held-out windows'
                  loss equals transformers' on the same windows (lr 0: the initial model).
  qwen2, mistral, gemma, qwen3, gemma2
                  the model families: Qwen2 (q/k/v biases, no o bias), Mistral with a sliding
                  window larger than the sequence, Gemma (scaled embeddings, (1 + w) RMSNorm,
                  GELU-tanh MLP, tied head), Qwen3 (q_norm/k_norm, a sliding window of 6 on layer 1),
                  Gemma 2 (attention and final soft caps, query_pre_attn_scalar, the sandwich
                  norms, a sliding window of 7 on layer 0), each trained on supervised examples;
                  Qwen3's and Gemma 2's have an odd intermediate size, and their losses must agree
                  within 1e-6. Mistral's run also exports every 2 steps (run.export_every: the
                  weights after step 2) in shards of 24 KB (with the index); Gemma's exports
                  bfloat16 (run.export_dtype).

Every global batch holds the whole training set (examples == global batch), so the order in which
Strata's loader visits them changes only the floating-point summation order.
"""
import json
import os
import subprocess
import sys

import numpy as np
import torch
from safetensors.numpy import save_file
from safetensors.torch import load_file

TOL = 1e-5
SEQ = 24           # data.seq_len
MICRO, ACCUM = 2, 2
LR, WD, BETAS, EPS, CLIP = 3e-3, 0.1, (0.9, 0.95), 1e-8, 1.0
STEPS = 3


def family_model(case, vocab):
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  initializer_range=0.2, rms_norm_eps=1e-6)
    if case in ("sft-llama", "sft-llama-2rank", "eval-split"):
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=False))
    elif case == "qwen2":
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=False))
    elif case == "mistral":
        m = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=SEQ + 8, tie_word_embeddings=False))
    elif case == "gemma":
        m = tf.GemmaForCausalLM(tf.GemmaConfig(**common, head_dim=16, hidden_act="gelu_pytorch_tanh"))
    elif case == "qwen3":
        m = tf.Qwen3ForCausalLM(tf.Qwen3Config(**dict(common, intermediate_size=77), head_dim=16,
                                               tie_word_embeddings=False, use_sliding_window=True, sliding_window=6,
                                               max_window_layers=1))
    elif case == "gemma2":
        m = tf.Gemma2ForCausalLM(tf.Gemma2Config(**dict(common, intermediate_size=77), head_dim=16,
                                                 query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                                                 final_logit_softcapping=5.0, sliding_window=7,
                                                 hidden_activation="gelu_pytorch_tanh"))
    else:
        raise SystemExit(f"unknown case {case}")
    return perturbed(m)


def perturbed(m):
    """Every tensor of `m` moved away from its default (norm weights, biases included), seeded; fp32."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in sorted(m.named_parameters()):
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return m.float()


def sft_examples(rng, count, vocab, lengths):
    """Examples as (ids, mask) with a prompt and a response part; some longer than SEQ + 1."""
    out = []
    for i in range(count):
        n = lengths[i % len(lengths)]
        ids = rng.integers(1, vocab, size=n).astype(np.int32)
        mask = np.zeros(n, dtype=np.uint8)
        p = max(1, n // 3 + (i % 3))
        mask[p:] = 1
        out.append((ids, mask))
    return out


def read_sft(path):
    """The examples of a data.format "sft" file as (ids, mask) pairs (docs/FORMATS.md)."""
    from safetensors.numpy import load_file as load_np
    t = load_np(path)
    o = t["offsets"]
    return [(t["tokens"][o[e]:o[e + 1]], t["loss_mask"][o[e]:o[e + 1]]) for e in range(len(o) - 1)]


def write_sft(path, examples):
    tokens = np.concatenate([e[0] for e in examples]).astype(np.int32)
    mask = np.concatenate([e[1] for e in examples]).astype(np.uint8)
    offsets = np.cumsum([0] + [len(e[0]) for e in examples]).astype(np.int64)
    save_file({"tokens": tokens, "loss_mask": mask, "offsets": offsets}, path,
              metadata={"format": "strata-sft-1"})


def sft_batch(examples, seq=SEQ, pad_id=0):
    """input_ids and labels as Strata samples them: the first seq + 1 tokens, padded with pad_id
    out of the loss; transformers shifts labels itself, so label j + 1 is target j."""
    ids = np.full((len(examples), seq + 1), pad_id, dtype=np.int64)
    labels = np.full((len(examples), seq + 1), -100, dtype=np.int64)
    for r, (t, m) in enumerate(examples):
        n = min(len(t), seq + 1)
        ids[r, :n] = t[:n]
        keep = m[:n] == 1
        labels[r, :n][keep] = t[:n][keep]
    labels[:, 0] = -100
    return torch.from_numpy(ids), torch.from_numpy(labels)


def mean_loss(model, ids, labels):
    logits = model(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                             labels[:, 1:].reshape(-1), ignore_index=-100,
                                             reduction="sum") / (labels[:, 1:] != -100).sum()


def same_weights(export_dir, model, tol, what, dtype=torch.float32):
    """Whether export_dir's weights (sharded or not) are `model`'s in `dtype`: per tensor
    ||diff|| / ||ref|| <= tol. Prints what differs."""
    from safetensors import safe_open
    index = os.path.join(export_dir, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    got = {}
    for f in files:
        with safe_open(os.path.join(export_dir, f), "pt") as st:
            for k in st.keys():
                got[k] = st.get_tensor(k)
    ok = True
    state = model.state_dict()
    for name, ref in state.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name not in got:
            print(f"FAIL: {what}: no {name}")
            return False
        if got[name].dtype != dtype:
            print(f"FAIL: {what}: {name} is {got[name].dtype}, not {dtype}")
            ok = False
        e = float((got[name].float() - ref.float()).norm() / max(ref.float().norm(), 1e-30))
        if e > tol:
            print(f"FAIL: {what}: {name} differs by {e:.3g}")
            ok = False
    print(f"{what}: {len(files)} file(s), {'equal' if ok else 'different'}")
    return ok


def rel(a, b):
    return float((a - b).abs().max() / max(b.abs().max(), 1e-30))


def main():
    strata, work, case = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(work, exist_ok=True)
    vocab = 61
    model = family_model(case, vocab)
    model_dir = os.path.join(work, "model")
    model.save_pretrained(model_dir, safe_serialization=True)
    rng = np.random.default_rng(11)
    world = 2 if case == "sft-llama-2rank" else 1
    global_batch = MICRO * ACCUM * world
    lr = 0.0 if case == "eval-split" else LR

    cfg = {"model": {"init_from": model_dir},
           "data": {"seq_len": SEQ, "seed": 3, "pack": False},  # one example a row (packing_oracle.py packs)
           "batch": {"micro_batch": MICRO, "grad_accum": ACCUM},
           "optimizer": {"type": "adamw", "lr": lr, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
                         "no_decay": ["bias", "norm"], "clip_grad_norm": CLIP},
           "device": {"budget": "64MiB"},
           "run": {"steps": STEPS, "progress": False, "log": os.path.join(work, "log.jsonl"),
                   "export": os.path.join(work, "export"), "export_overwrite": True}}
    # The exports: mistral's every 2 steps and in shards of at most 24 KB (as transformers cuts
    # them, with the index); gemma's in bfloat16.
    if case == "mistral":
        cfg["run"].update({"export_every": 2, "export_shard_size": "24KB"})
    if case == "gemma":
        cfg["run"]["export_dtype"] = "bfloat16"
    if case == "eval-split":
        windows = global_batch + 3  # 3 held out
        tokens = rng.integers(0, vocab, size=windows * SEQ + 1).astype(np.uint32)
        tokens.tofile(os.path.join(work, "train.bin"))
        cfg["data"].update({"path": os.path.join(work, "train.bin"), "format": "uint32", "eval_split": 3 / windows})
        train = None
        held = [tokens[i * SEQ:i * SEQ + SEQ + 1] for i in range(windows - 3, windows)]
        eval_ids = torch.from_numpy(np.stack(held).astype(np.int64))
        eval_labels = eval_ids.clone()
    else:
        # Lengths around SEQ + 1 = 25: shorter (padded), exact, longer (cut).
        train = sft_examples(rng, global_batch, vocab, [9, 25, 31, 14, 20, 40, 25, 11])
        evals = sft_examples(rng, 5, vocab, [12, 30, 25, 7, 18])
        write_sft(os.path.join(work, "train.sft"), train)
        write_sft(os.path.join(work, "eval.sft"), evals)
        cfg["data"].update({"path": os.path.join(work, "train.sft"), "format": "sft",
                            "eval_path": os.path.join(work, "eval.sft"), "eval_every": 1})
        eval_ids, eval_labels = sft_batch(evals)
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
    lines = [json.loads(l) for l in open(cfg["run"]["log"])]
    steps = [l for l in lines if "loss" in l and l.get("event") is None]
    evals_logged = [l for l in lines if l.get("event") == "eval"]

    # The oracle: transformers, torch.optim.AdamW with the same two groups, clip_grad_norm_.
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=BETAS, eps=EPS)
    ok = True
    ref_losses, ref_evals = [], []
    periodic = os.path.join(work, "export-step-2")
    for s in range(STEPS):
        if case == "mistral" and s == 2:  # the export after step 2: the weights then
            ok &= same_weights(periodic, model, 1e-5, "the export after step 2")
        if train is not None:
            ids, labels = sft_batch(train)
            opt.zero_grad()
            loss = mean_loss(model, ids, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            ref_losses.append(loss.item())
        with torch.no_grad():
            ref_evals.append(mean_loss(model, eval_ids, eval_labels).item())
    if train is not None:
        got = [l["loss"] for l in steps]
        print("losses strata", got, "transformers", ref_losses)
        loss_tol = 1e-6 if case in ("qwen3", "gemma2") else TOL
        if len(got) != STEPS or any(abs(a - b) > loss_tol * abs(b) for a, b in zip(got, ref_losses)):
            print("FAIL: training losses differ")
            ok = False
    got_eval = [l["eval_loss"] for l in evals_logged]
    want_eval = ref_evals if train is not None else ref_evals[-1:]
    print("eval losses strata", got_eval, "transformers", want_eval)
    if len(got_eval) != len(want_eval) or any(abs(a - b) > TOL * abs(b) for a, b in zip(got_eval, want_eval)):
        print("FAIL: evaluation losses differ")
        ok = False
    if case == "mistral":
        index = os.path.join(work, "export", "model.safetensors.index.json")
        shards = len(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else 1
        if shards < 2:
            print("FAIL: the export is not sharded at 24 KB")
            ok = False
        else:
            # The same grouping as huggingface_hub's splitter given the tensors in the order
            # Strata writes them (the schedule's: embedding, each block's tensors, final norm, head).
            from huggingface_hub import split_torch_state_dict_into_shards
            sd = model.state_dict()
            order = ["model.embed_tokens.weight"]
            for i in range(model.config.num_hidden_layers):
                p = f"model.layers.{i}."
                order += [p + "input_layernorm.weight"] + [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
                order += [p + "post_attention_layernorm.weight"] + [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
            order += ["model.norm.weight", "lm_head.weight"]
            split = split_torch_state_dict_into_shards({k: sd[k] for k in order}, max_shard_size=24000)
            want = split.tensor_to_filename
            got_map = json.load(open(index))["weight_map"]
            if got_map != want:
                print("FAIL: shards differ from huggingface_hub's:", got_map, want)
                ok = False
    if case == "gemma":
        # bfloat16: the fp32 weights rounded (Strata's and transformers' fp32 weights differ by
        # ~1e-6, which can flip a rounding: 2^-8 relative at most per element).
        ok &= same_weights(os.path.join(work, "export"), model, 4e-3, "the bfloat16 export", torch.bfloat16)
        if json.load(open(os.path.join(work, "export", "config.json"))).get("dtype") != "bfloat16":
            print("FAIL: config.json does not say bfloat16")
            ok = False
    exported = {}
    from safetensors import safe_open
    for f in os.listdir(os.path.join(work, "export")):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(work, "export", f), "pt") as st:
                for k in st.keys():
                    exported[k] = st.get_tensor(k).float()
    state = {k: v for k, v in model.state_dict().items()}
    weight_tol = 4e-3 if case == "gemma" else TOL
    # Per tensor ||diff|| / ||ref|| (as the engine's equivalence tests): Adam divides each
    # element's step by its own gradient scale, so elements with tiny gradients (a bias) differ
    # by more than the summation order alone in an elementwise max.
    worst, worst_name = 0.0, ""
    for name, t in exported.items():
        if name not in state:
            print(f"FAIL: exported tensor {name} is not in the transformers model")
            ok = False
            continue
        e = float((t.float() - state[name].float()).norm() / max(state[name].float().norm(), 1e-30))
        if e > worst:
            worst, worst_name = e, name
    missing = [n for n in state if n not in exported and not (n == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing:
        print("FAIL: not exported:", missing)
        ok = False
    print(f"weights: worst relative error {worst:.3g} ({worst_name})")
    if worst > weight_tol:
        print("FAIL: weights differ")
        ok = False
    # The export loads in transformers as the same family with the same logits.
    from transformers import AutoModelForCausalLM
    back = AutoModelForCausalLM.from_pretrained(os.path.join(work, "export"), dtype=torch.float32)  # shards too
    if type(back) is not type(model):
        print(f"FAIL: export loads as {type(back).__name__}, not {type(model).__name__}")
        ok = False
    ref = model
    if case == "gemma":  # the reference's weights rounded to bfloat16 as the export's are
        import copy
        ref = copy.deepcopy(model)
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    with torch.no_grad():
        e = rel(back(input_ids=eval_ids).logits, ref(input_ids=eval_ids).logits)
    print(f"export logits: relative error {e:.3g}")
    # bfloat16: a rounding flipped by the ~1e-6 difference of the fp32 weights moves an element
    # by 2^-8 of itself.
    if e > (1e-3 if case == "gemma" else TOL):
        print("FAIL: the export's logits differ")
        ok = False
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
