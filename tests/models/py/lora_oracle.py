"""LoRA fine-tuning through `strata train` against transformers + peft + torch.optim.AdamW.

  lora_oracle.py STRATA_BIN WORKDIR CASE

Each case makes a tiny model with transformers (save_pretrained) and a PEFT LoRA adapter on q, k,
v, o, gate, up and down (r 8, lora_alpha 16) initialized with init_lora_weights=False, so that B
is not zero and A has a gradient from the first step (save_pretrained: adapter_config.json and
adapter_model.safetensors). `strata train` starts from both (model.init_from, model.adapter_from)
for 4 steps of masked SFT in fp32; peft trains the same adapter with torch.optim.AdamW and
clip_grad_norm_ over the adapters. Compared:
  - the per-step losses (1e-6 relative);
  - Strata's export (run.export, a PEFT adapter directory): its adapters against peft's after the
    last step (||diff|| / ||ref|| <= 1e-5 per tensor); peft.PeftModel.from_pretrained loads it on the
    untouched base, and that model's loss on the evaluation examples equals Strata's evaluation
    after the last step (1e-6 relative), its logits the oracle's (1e-5);
  - the merged export (run.export_merged, <export>-merged): transformers loads it, its logits equal
    those of peft's merge_and_unload() (1e-5), and its tensors not adapted are the base's, bitwise;
  - `strata ckpt export` of the run's last checkpoint, with --base: the adapter and the merged
    model byte for byte the run's exports (adapter_config.json the same but for the base's name).
Exit 0 on agreement, 1 otherwise.

Cases:
  llama         Llama with grouped-query attention and an odd intermediate size (83), one rank.
  qwen2         Qwen2 (q/k/v biases), one rank.
  gemma         Gemma (tied embeddings scaled by sqrt(hidden), GELU-tanh MLP), one rank.
  gpt2          GPT-2: the fused c_attn and Conv1D layers (fan_in_fan_out), one rank.
  llama-2rank   the Llama case under `strata launch -n 2`, the frozen base in NVMe swap.
  llama-resume  the Llama case stopped after 2 steps and resumed from its checkpoint: losses and
                exports bitwise those of the straight run.
  llama-tiles-2rank
                the Llama case under `strata launch -n 2` with block tiles (2 attention x 3 MLP
                tiles, the base on the host) and modules_to_save (lm_head and every
                post_attention_layernorm trained whole, exported in the adapter directory and
                loaded by peft); the merged export of `ckpt export` tensor for tensor the run's
                (the run writes tiled weights as their last part comes, so not in the same order).
  gpt2-tiles    the GPT-2 case with block tiles (its fused c_attn cut into q, k, v rows per tile)
                and modules_to_save ln_2, one rank.
  mixtral-experts
                Mixtral (5 experts, top-2, expert width 37): LoRA on q, k, v, o and on the experts
                through PEFT's target_parameters (the fused gate_up_proj and down_proj, each expert
                its own rank-8 A and B), one rank.
  qwen3-moe-experts-tiles-2rank
                Qwen3-MoE (5 experts, top-3, a dense block among sparse ones) with the attention
                and down_proj's experts alone adapted, under `strata launch -n 2`
                with block tiles: the 5 experts in 3 expert tiles (2, 2, 1), the first holding
                the fused adapters, the others using their experts' rows and columns.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_oracle import mean_loss, perturbed, sft_batch, sft_examples, write_sft  # noqa: E402

SEQ = 24
MICRO, ACCUM = 2, 2
LR, WD, BETAS, EPS, CLIP = 3e-3, 0.1, (0.9, 0.95), 1e-8, 1.0
STEPS = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]  # attention's and the MLP's c_proj both
SAVED = ["lm_head", "post_attention_layernorm"]  # modules_to_save of the tiles cases
GPT2_SAVED = ["ln_2"]  # (GPT-2's LM head is the tied embedding)


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
    elif case == "gemma":
        m = tf.GemmaForCausalLM(tf.GemmaConfig(**dict(common, tie_word_embeddings=True), head_dim=16,
                                               hidden_act="gelu_pytorch_tanh"))
    elif case.startswith("mixtral"):
        m = tf.MixtralForCausalLM(tf.MixtralConfig(**dict(common, intermediate_size=37), num_local_experts=5,
                                                   num_experts_per_tok=2, experts_implementation="eager"))
    elif case.startswith("qwen3-moe"):
        m = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**dict(common, num_hidden_layers=3), head_dim=16,
                                                     moe_intermediate_size=19, num_experts=5, num_experts_per_tok=3,
                                                     norm_topk_prob=True, mlp_only_layers=[1],
                                                     experts_implementation="eager"))
    elif case.startswith("gpt2"):
        m = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=vocab, n_embd=48, n_layer=2, n_head=4, n_positions=64,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                             initializer_range=0.2))
    else:
        raise SystemExit(f"unknown case {case}")
    return perturbed(m)


def peft_saved_key(name):
    """A trainable parameter's key as peft saves it (adapter name dropped)."""
    return name.replace(".modules_to_save.default.", ".").replace(".default.", ".")


def float64_oracle(case, vocab, adapter_dir, ids, labels):
    """The oracle's training in float64 from the same base and adapter: its trainable tensors by
    saved key."""
    from peft import PeftModel
    model = PeftModel.from_pretrained(base_model(case, vocab).double(), adapter_dir, is_trainable=True).double()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for _ in range(STEPS):
        opt.zero_grad()
        mean_loss(model, ids, labels).backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        opt.step()
    return {peft_saved_key(n): p.detach() for n, p in model.named_parameters() if p.requires_grad}


def read_safetensors(path):
    from safetensors import safe_open
    out = {}
    with safe_open(path, "pt") as st:
        for k in st.keys():
            out[k] = st.get_tensor(k)
    return out


def run_strata(strata, work, cfg, world, name):
    """`strata train` (under `strata launch -n world` when world > 1) on `cfg`: its log's lines, or
    None (saying why) when it fails."""
    return run_strata_output(strata, work, cfg, world, name)[0]


def run_strata_output(strata, work, cfg, world, name, must_pass=True):
    """run_strata's lines (None on failure, said only when `must_pass`) and the run's stderr."""
    path = os.path.join(work, name + ".json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    cmd = [strata, "train", "--config", path]
    if world > 1:
        cmd = [strata, "launch", "-n", str(world), "--"] + cmd
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        if must_pass:
            print(run.stdout, run.stderr)
            print(f"FAIL: strata ({name}) exited {run.returncode}")
        return None, run.stderr
    return [json.loads(l) for l in open(cfg["run"]["log"])], run.stderr


def train_steps(model, ids, labels):
    """STEPS steps of the oracle's training: AdamW and clip_grad_norm_ over the parameters that
    require gradients, the masked mean loss of the one batch; the losses before each update."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = mean_loss(model, ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        opt.step()
        losses.append(loss.item())
    return losses


def rel(a, b):
    return float((a.float() - b.float()).norm() / max(float(b.float().norm()), 1e-30))


def same_files(a, b):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def main():
    strata, work, case = sys.argv[1], sys.argv[2], sys.argv[3]
    shutil.rmtree(work, ignore_errors=True)  # a resumed run appends to its log: start from nothing
    os.makedirs(work)
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    vocab = 61
    base = base_model(case, vocab)
    model_dir, adapter_dir = os.path.join(work, "model"), os.path.join(work, "adapter")
    base.save_pretrained(model_dir, safe_serialization=True)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    torch.manual_seed(1)
    gpt2 = case.startswith("gpt2")
    moe = case.startswith(("mixtral", "qwen3-moe"))
    # A mixture of experts: the attention's linears (PEFT reads an MLP projection's name as the
    # experts' transformers 4 name), the experts through target_parameters.
    targets = GPT2_TARGETS if gpt2 else TARGETS[:4] if moe else TARGETS
    # Experts: PEFT's target_parameters (transformers 5's fused expert tensors).
    experts = (["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if case.startswith("mixtral")
               else ["experts.down_proj"] if case.startswith("qwen3-moe") else None)
    eager = {"experts_implementation": "eager"} if experts else {}  # transformers' grouped_mm wants 16-byte strides
    tiles = "tiles" in case
    saved = (GPT2_SAVED if gpt2 else SAVED) if tiles else None
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0,
                                            init_lora_weights=False, fan_in_fan_out=gpt2,
                                            modules_to_save=saved, target_parameters=experts))
    model.save_pretrained(adapter_dir)
    world = 2 if case.endswith("2rank") else 1
    rng = np.random.default_rng(11)
    train = sft_examples(rng, MICRO * ACCUM * world, vocab, [9, 25, 31, 14, 20, 40, 25, 11])
    evals = sft_examples(rng, 5, vocab, [12, 30, 25, 7, 18])
    write_sft(os.path.join(work, "train.sft"), train)
    write_sft(os.path.join(work, "eval.sft"), evals)
    export = os.path.join(work, "export")
    cfg = {"model": {"init_from": model_dir, "adapter_from": adapter_dir},
           "data": {"seq_len": SEQ, "seed": 3, "path": os.path.join(work, "train.sft"), "format": "sft",
                    "eval_path": os.path.join(work, "eval.sft"), "pack": False},
           "batch": {"micro_batch": MICRO, "grad_accum": ACCUM},
           "optimizer": {"type": "adamw", "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
                         "clip_grad_norm": CLIP},
           "device": {"budget": "64MiB"},
           "run": {"steps": STEPS, "progress": False, "log": os.path.join(work, "log.jsonl"),
                   "export": export, "export_overwrite": True, "export_merged": True,
                   "checkpoint_dir": os.path.join(work, "ckpt")}}
    if tiles:
        # (Qwen3's q/k norms keep its attention whole: MLP tiles only)
        cfg["placement"] = {"params": "host", "tiling": {"attention": 1 if moe else 2, "mlp": 3}}
    elif world > 1:
        cfg["placement"] = {"params": "nvme", "grads": "host", "master": "host", "moments": "host"}
        cfg["offload"] = {"nvme_dirs": [os.path.join(work, "swap")]}
        os.makedirs(os.path.join(work, "swap"), exist_ok=True)
    lines = run_strata(strata, work, cfg, world, "train")
    if lines is None:
        return 1
    got = [l["loss"] for l in lines if "event" not in l]
    got_eval = [l["eval_loss"] for l in lines if l.get("event") == "eval"]
    ok = True

    if case.endswith("resume"):
        # The same run stopped after 2 steps (its checkpoint), then resumed to the end.
        r = json.loads(json.dumps(cfg))
        r["run"].update({"steps": 2, "checkpoint_dir": os.path.join(work, "ckpt-resumed"),
                         "log": os.path.join(work, "log-first.jsonl"), "export": os.path.join(work, "export-first"),
                         "export_merged": False})
        r["data"].pop("eval_path")
        first = run_strata(strata, work, r, world, "first")
        r["run"].update({"steps": STEPS, "resume": True, "log": os.path.join(work, "log-resumed.jsonl"),
                         "export": os.path.join(work, "export-resumed"), "export_merged": True})
        resumed = run_strata(strata, work, r, world, "resumed") if first is not None else None
        if resumed is None:
            return 1
        both = [l["loss"] for l in first if "event" not in l] + [l["loss"] for l in resumed if "event" not in l]
        print("losses straight", got, "stopped and resumed", both)
        if both != got:
            print("FAIL: the resumed run's losses are not bitwise the straight run's")
            ok = False
        # A resume with other LoRA settings is refused, saying so.
        r["model"].pop("adapter_from")  # its adapter_config.json would refuse the settings first
        r["model"]["lora"] = {"r": 8, "lora_alpha": 32, "target_modules": TARGETS}
        r["run"].update({"log": os.path.join(work, "log-other.jsonl"), "export": os.path.join(work, "export-other")})
        with open(os.path.join(work, "other.json"), "w") as f:
            json.dump(r, f)
        other = subprocess.run([strata, "train", "--config", os.path.join(work, "other.json")], capture_output=True,
                               text=True)
        print("resume with lora_alpha 32:", other.stderr.strip().splitlines()[-1:] if other.stderr else "")
        if other.returncode == 0 or "resume with the same model.lora" not in other.stderr:
            print("FAIL: a resume with other LoRA settings was not refused naming model.lora")
            ok = False
        for a, b in ((os.path.join(export, "adapter_model.safetensors"),
                      os.path.join(work, "export-resumed", "adapter_model.safetensors")),
                     (os.path.join(export + "-merged", "model.safetensors"),
                      os.path.join(work, "export-resumed-merged", "model.safetensors"))):
            if not same_files(a, b):
                print(f"FAIL: {b} is not bitwise {a}")
                ok = False

    # The oracle: peft's model, AdamW and clipping over the parameters that require gradients.
    ids, labels = sft_batch(train)
    eval_ids, eval_labels = sft_batch(evals)
    want = train_steps(model, ids, labels)
    print("losses strata", got, "peft", want)
    if len(got) != STEPS or any(abs(a - b) > 1e-6 * abs(b) for a, b in zip(got, want)):
        print("FAIL: training losses differ")
        ok = False

    # The adapter export: PEFT's files, the oracle's adapters.
    exported = read_safetensors(os.path.join(export, "adapter_model.safetensors"))
    worst, worst_name, adapters, whole = 0.0, "", 0, set()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        adapters += 1
        # as peft saves them: base_model.model.<module>.lora_A.weight, and a module to save under
        # its own name (base_model.model.lm_head.weight)
        key = peft_saved_key(name)
        if "lora_" not in name:
            whole.add(key.replace("base_model.model.", "", 1))
        if key not in exported:
            print(f"FAIL: adapter {key} not exported")
            ok = False
            continue
        e = rel(exported[key], p.detach())
        if e > worst:
            worst, worst_name = e, key
    print(f"adapters: {adapters} ({len(exported)} exported, {len(whole)} of them modules to save), "
          f"worst relative error {worst:.3g} ({worst_name})")
    # Expert adapters: PEFT merges B A into each expert's weight before its product, Strata adds
    # (x A^T) B^T as for a linear layer, and an expert that sees few tokens gets a small gradient
    # that AdamW normalizes, so the two fp32 roundings part by more than 1e-5. The judge is then
    # the same training in float64: Strata's adapters may be no further from it than 2x peft's
    # own fp32 adapters are (and within 1e-5 still passes).
    limit = 1e-5
    if experts and worst > limit:
        exact = float64_oracle(case, vocab, adapter_dir, ids, labels)
        strata_err = max(rel(exported[k], v) for k, v in exact.items())
        peft_err = max(rel(dict(model.named_parameters())[n].detach(), exact[peft_saved_key(n)])
                       for n, p in model.named_parameters() if p.requires_grad)
        print(f"against peft in float64: strata {strata_err:.3g}, peft in float32 {peft_err:.3g}")
        limit = max(limit, 2 * peft_err) if strata_err <= max(1e-5, 2 * peft_err) else 0.0
    if adapters == 0 or worst > limit or len(exported) != adapters or (tiles and not whole):
        print("FAIL: adapters differ")
        ok = False

    # peft loads the adapter export on the untouched base: Strata's evaluation, the oracle's logits.
    with torch.no_grad():
        ref_logits = model(input_ids=eval_ids).logits
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **eager),
                                           export)
        loaded.eval()
        if any(not torch.equal(p, base_state[k]) for k, p in loaded.get_base_model().state_dict().items()
               if k in base_state):
            print("FAIL: loading the adapter changed the base")
            ok = False
        peft_eval = mean_loss(loaded, eval_ids, eval_labels).item()
        e = rel(loaded(input_ids=eval_ids).logits, ref_logits)
    print(f"evaluation: strata {got_eval}, peft on the adapter export {peft_eval:.9g}; logits vs the oracle {e:.3g}")
    if not got_eval or abs(got_eval[-1] - peft_eval) > 1e-6 * abs(peft_eval) or e > 1e-5:
        print("FAIL: the adapter export does not give Strata's evaluation or the oracle's logits")
        ok = False

    # The merged export against peft's merge_and_unload (last: it changes the oracle model).
    merged = AutoModelForCausalLM.from_pretrained(export + "-merged", dtype=torch.float32, **eager)
    with torch.no_grad():
        ref_merged = model.merge_and_unload()
        e = rel(merged(input_ids=eval_ids).logits, ref_merged(input_ids=eval_ids).logits)
        adapted = {k.replace(".default", "").rsplit(".lora_", 1)[0] + ".weight"
                   for k in exported if ".lora_A." in k}
        adapted = {k.replace("base_model.model.", "", 1) for k in adapted}
        adapted |= {k for k in base_state if ".mlp.experts." in k and any(k.endswith(t) for t in experts or [])}
        merged_state = merged.state_dict()
        changed = sorted(k for k, v in base_state.items()
                         if k not in adapted and k not in whole and k in merged_state
                         and not torch.equal(merged_state[k], v))
    print(f"merged export: logits vs merge_and_unload {e:.3g}, {len(adapted)} weights adapted")
    if e > 1e-5 or changed or len(adapted) == 0:
        print("FAIL: the merged export differs", changed[:5])
        ok = False

    # `strata ckpt export` of the last checkpoint: the run's exports, byte for byte.
    out = os.path.join(work, "ckpt-export")
    for d in (out, out + "-merged"):
        shutil.rmtree(d, ignore_errors=True)
    run = subprocess.run([strata, "ckpt", "export", os.path.join(work, "ckpt"), out, "--base", model_dir],
                         capture_output=True, text=True)
    print(run.stdout.strip())
    if run.returncode != 0:
        print(run.stderr)
        print("FAIL: strata ckpt export failed")
        return 1
    pairs = [(os.path.join(export, "adapter_model.safetensors"), os.path.join(out, "adapter_model.safetensors")),
             (os.path.join(export + "-merged", "config.json"), os.path.join(out + "-merged", "config.json"))]
    run_merged, ckpt_merged = (os.path.join(d + "-merged", "model.safetensors") for d in (export, out))
    if tiles:  # the same tensors, in another order
        a, b = read_safetensors(run_merged), read_safetensors(ckpt_merged)
        if a.keys() != b.keys() or any(not torch.equal(a[k], b[k]) for k in a):
            print(f"FAIL: {ckpt_merged} does not hold the tensors of {run_merged}")
            ok = False
    else:
        pairs.append((run_merged, ckpt_merged))
    for a, b in pairs:
        if not same_files(a, b):
            print(f"FAIL: {b} is not byte for byte {a}")
            ok = False
    # Another base is refused, naming both fingerprints.
    other_dir = os.path.join(work, "other-base")
    other_base = base_model(case, vocab)
    with torch.no_grad():
        for p in other_base.parameters():
            p.add_(1.0)
    other_base.save_pretrained(other_dir, safe_serialization=True)
    wrong = subprocess.run([strata, "ckpt", "export", os.path.join(work, "ckpt"), out + "-wrong", "--base", other_dir],
                           capture_output=True, text=True)
    if wrong.returncode == 0 or "trained on the base" not in wrong.stderr:
        print("FAIL: a merge onto another base was not refused:", wrong.stderr)
        ok = False
    run_cfg, ckpt_cfg = (json.load(open(os.path.join(d, "adapter_config.json"))) for d in (export, out))
    if run_cfg.pop("base_model_name_or_path") != model_dir or ckpt_cfg.pop("base_model_name_or_path") is not None \
            or run_cfg != ckpt_cfg:
        print("FAIL: adapter_config.json differs:", run_cfg, ckpt_cfg)
        ok = False
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
