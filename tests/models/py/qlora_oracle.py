"""LoRA over a 4-bit base (QLoRA) through `strata train` against transformers + bitsandbytes + peft.

  qlora_oracle.py STRATA_BIN WORKDIR CASE

Each case makes a tiny model of awkward shapes with transformers (save_pretrained, fp32) and a
PEFT LoRA adapter on q, k, v, o, gate, up and down (r 8, lora_alpha 16, init_lora_weights=False so
that B is not zero). `strata train` loads the 16-bit base with model.quantize (bitsandbytes'
BitsAndBytesConfig keys, fp32 compute) and the adapter (model.adapter_from) for 4 steps of masked
SFT; the oracle loads the same base with transformers' BitsAndBytesConfig (bitsandbytes' Linear4bit
on the CPU), the adapter with peft, and trains it with torch.optim.AdamW and clip_grad_norm_.
Compared:
  - the per-step losses (1e-6 relative; the issue's bound is 1e-5);
  - the adapter export against peft's trained adapters (||diff|| / ||ref|| <= 1e-5 a tensor);
  - peft loading the export on a freshly quantized base: its evaluation loss equals Strata's last
    evaluation (1e-6);
  - `strata ckpt export --base` of the last checkpoint (the adapters merged into the 16-bit base
    the 4-bit one was quantized from): transformers' logits of the merged model equal peft's
    merge_and_unload() of the export on the 16-bit base (1e-5);
  - llama-nf4: the run stopped after 2 steps and resumed, its losses bitwise the straight run's;
  - the same run from the base transformers saved in 4 bits (prequantized(): losses and adapters
    bitwise, evaluation against peft on transformers' load of it, the merge into its dequantized
    weights by `strata ckpt export --base`);
  - run.export_merged with run.export_merged_into "dequantized" and `strata ckpt export --base
    --merge-into dequantized`: logits equal to peft's merge into transformers' dequantize() of the
    4-bit base (1e-5);
  - refusals: a resume with another quantization (the base's fingerprint names it).
Exit 0 on agreement, 1 otherwise.

Cases:
  llama-nf4        Llama, hidden 56 and intermediate 83 (weights of 1568 to 4648 elements: partial
                   last blocks), NF4, the base on the host, one rank.
  qwen3-fp4        Qwen3 (q/k norms, head_dim 16 beside hidden 45: odd element counts), FP4, one rank.
  llama-nf4-double the Llama case with double quantization (bnb_4bit_use_double_quant: the absmax
                   in 8 bits around their mean), the base in NVMe swap.
  qwen2-nf4-2rank  Qwen2 (q/k/v biases kept in fp32) under `strata launch -n 2`, NF4, the 4-bit base
                   in NVMe swap.
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
from lora_oracle import (ACCUM, BETAS, CLIP, EPS, LR, MICRO, SEQ, STEPS, TARGETS, WD,  # noqa: E402
                         peft_saved_key, read_safetensors, rel, run_strata, run_strata_output, train_steps)


def base_model(case, vocab):
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=56, intermediate_size=83, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if case.startswith("llama"):
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif case.startswith("qwen3"):
        m = tf.Qwen3ForCausalLM(tf.Qwen3Config(**dict(common, hidden_size=45), head_dim=16))
    elif case.startswith("qwen2"):
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, use_sliding_window=False))
    else:
        raise SystemExit(f"unknown case {case}")
    return perturbed(m)


def quant_type(case):
    return "fp4" if "fp4" in case else "nf4"


def quantized_base(model_dir, qt, double):
    """transformers + bitsandbytes: the 16-bit base loaded in 4 bits, fp32 compute, on the CPU."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=qt, bnb_4bit_compute_dtype=torch.float32,
                           bnb_4bit_use_double_quant=double)
    return AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=q, dtype=torch.float32,
                                                device_map="cpu")


def merged_into_dequantized(strata, work, qt, double, cfg, world, export, eval_ids):
    """run.export_merged with run.export_merged_into "dequantized", and `strata ckpt export --base
    --merge-into dequantized` of the checkpoint: the adapters merged into the 4-bit weights the run
    trained on, dequantized; the oracle is peft's merge into transformers' dequantize() of the base
    quantized by bitsandbytes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model_dir = cfg["model"]["init_from"]
    run_cfg = json.loads(json.dumps(cfg))
    run_export = os.path.join(work, "export-dq")
    run_cfg["run"].update({"export_merged": True, "export_merged_into": "dequantized", "export": run_export,
                           "log": os.path.join(work, "log-dq.jsonl"), "checkpoint_dir": os.path.join(work, "ckpt-dq")})
    lines, stderr = run_strata_output(strata, work, run_cfg, world, "export-merged-dequantized")
    if lines is None:
        return False
    said = [l for l in stderr.splitlines() if "merged model" in l]
    print(said[-1] if said else "(no line about the merged model)")
    ok = bool(said) and "merged into the dequantized 4-bit weights" in said[-1]
    if not ok:
        print("FAIL: the run's log does not say it merged into the dequantized 4-bit weights")
    out = os.path.join(work, "ckpt-export-dq")
    run = subprocess.run([strata, "ckpt", "export", os.path.join(work, "ckpt-dq"), out, "--base", model_dir,
                          "--merge-into", "dequantized"], capture_output=True, text=True)
    print(run.stdout.strip())
    if run.returncode != 0:
        print(run.stderr)
        print("FAIL: strata ckpt export --merge-into dequantized failed")
        return False
    with torch.no_grad():
        ref = PeftModel.from_pretrained(quantized_base(model_dir, qt, double).dequantize(), export).merge_and_unload()
        want = ref.float()(input_ids=eval_ids).logits
        for merged_dir in (run_export + "-merged", out + "-merged"):
            merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
            e = rel(merged(input_ids=eval_ids).logits, want)
            print(f"{merged_dir}: logits vs peft's merge into the dequantized 4-bit base {e:.3g}")
            if e > 1e-5:
                print("FAIL: the merge into the dequantized 4-bit weights differs")
                ok = False
    return ok


def prequantized(strata, work, case, cfg, world, got, export, eval_ids, eval_labels):
    """The same run from the base transformers saved in 4 bits (save_pretrained of the quantized
    model; config.json's quantization_config gives model.quantize, left out here): its losses and
    adapters bitwise the run that quantized the 16-bit base at load; peft on transformers' load of
    that checkpoint evaluates Strata's export as Strata does; a block linear trained whole
    (modules_to_save) starts from bitsandbytes' dequantization of its 4-bit weight; `strata ckpt
    export --base` of it merges into the dequantized 4-bit weights, as peft's merge into
    transformers' dequantize()."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model_dir = cfg["model"]["init_from"]
    saved = os.path.join(work, "model-4bit")
    quantized_base(model_dir, quant_type(case), "double" in case).save_pretrained(saved, safe_serialization=True)
    pre = json.loads(json.dumps(cfg))
    pre["model"].pop("quantize")
    pre["model"]["init_from"] = saved
    pre_export = os.path.join(work, "export-pre")
    pre["run"].update({"log": os.path.join(work, "log-pre.jsonl"), "checkpoint_dir": os.path.join(work, "ckpt-pre"),
                       "export": pre_export})
    lines, stderr = run_strata_output(strata, work, pre, world, "prequantized")
    if lines is None:
        return False
    ok = True
    pre_got = [l["loss"] for l in lines if "event" not in l]
    pre_eval = [l["eval_loss"] for l in lines if l.get("event") == "eval"]
    print("losses from the checkpoint saved in 4 bits", pre_got)
    if pre_got != got:
        print("FAIL: the run from the checkpoint saved in 4 bits is not bitwise the run that quantized at load")
        ok = False
    a = read_safetensors(os.path.join(export, "adapter_model.safetensors"))
    b = read_safetensors(os.path.join(pre_export, "adapter_model.safetensors"))
    if sorted(a) != sorted(b) or any(not torch.equal(a[k], b[k]) for k in a):
        print("FAIL: the adapters trained on the checkpoint saved in 4 bits differ from those quantized at load")
        ok = False
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, device_map="cpu"), pre_export)
        loaded.train()  # bitsandbytes dequantizes in training mode (see main)
        peft_eval = mean_loss(loaded, eval_ids, eval_labels).item()
    print(f"evaluation: strata {pre_eval}, peft on transformers' load of the 4-bit checkpoint {peft_eval:.9g}")
    if not pre_eval or abs(pre_eval[-1] - peft_eval) > 1e-6 * abs(peft_eval):
        print("FAIL: transformers' load of the 4-bit checkpoint does not evaluate Strata's export as Strata does")
        ok = False
    # A module the run trains (modules_to_save) that the checkpoint saved in 4 bits starts from its
    # dequantization: no step taken, the exported tensor is bitsandbytes' dequantize of it.
    still = json.loads(json.dumps(pre))
    still["model"].pop("adapter_from")
    still["model"]["lora"] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "modules_to_save": ["down_proj"]}
    still_export = os.path.join(work, "export-pre-saved")
    still["run"].update({"steps": 0, "log": os.path.join(work, "log-pre-saved.jsonl"), "export": still_export,
                         "checkpoint_dir": os.path.join(work, "ckpt-pre-saved")})
    still["data"].pop("eval_path")
    if run_strata_output(strata, work, still, world, "prequantized-modules-to-save")[0] is None:
        return False
    exported = read_safetensors(os.path.join(still_export, "adapter_model.safetensors"))
    with torch.no_grad():
        dequantized = dict(AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, device_map="cpu")
                           .dequantize().named_parameters())
    checked = 0
    for key, t in exported.items():
        if key.endswith("mlp.down_proj.weight"):
            name = key[len("base_model.model."):]
            checked += 1
            if not torch.equal(t, dequantized[name].detach()):
                print(f"FAIL: {key}, trained from the 4-bit checkpoint, does not start from its dequantization")
                ok = False
    print(f"modules_to_save from the 4-bit checkpoint: {checked} tensors start from bitsandbytes' dequantization")
    if checked == 0:
        print("FAIL: no down_proj exported as modules_to_save")
        ok = False
    out = os.path.join(work, "ckpt-export-pre")
    run = subprocess.run([strata, "ckpt", "export", os.path.join(work, "ckpt-pre"), out, "--base", saved],
                         capture_output=True, text=True)
    print(run.stdout.strip())
    if run.returncode != 0 or "merged into their dequantized 4-bit values" not in run.stdout:
        print(run.stderr)
        print("FAIL: strata ckpt export --base of the 4-bit checkpoint failed or did not say it dequantized")
        return False
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out + "-merged", dtype=torch.float32)
        ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, device_map="cpu").dequantize(),
                                        pre_export).merge_and_unload().float()
        e = rel(merged(input_ids=eval_ids).logits, ref(input_ids=eval_ids).logits)
    print(f"merged into the dequantized 4-bit weights: logits vs peft's merge into transformers' dequantize() {e:.3g}")
    if e > 1e-5:
        print("FAIL: the merge into the dequantized 4-bit weights differs")
        ok = False
    return ok


def main():
    strata, work, case = sys.argv[1], sys.argv[2], sys.argv[3]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    import bitsandbytes as bnb
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    vocab = 61
    model_dir, adapter_dir = os.path.join(work, "model"), os.path.join(work, "adapter")
    base_model(case, vocab).save_pretrained(model_dir, safe_serialization=True)
    torch.manual_seed(1)
    get_peft_model(base_model(case, vocab), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0,
                                                       init_lora_weights=False)).save_pretrained(adapter_dir)
    qt = quant_type(case)
    double = "double" in case
    world = 2 if case.endswith("2rank") else 1
    rng = np.random.default_rng(11)
    train = sft_examples(rng, MICRO * ACCUM * world, vocab, [9, 25, 31, 14, 20, 40, 25, 11])
    evals = sft_examples(rng, 5, vocab, [12, 30, 25, 7, 18])
    write_sft(os.path.join(work, "train.sft"), train)
    write_sft(os.path.join(work, "eval.sft"), evals)
    export = os.path.join(work, "export")
    quantize = {"load_in_4bit": True, "bnb_4bit_quant_type": qt, "bnb_4bit_compute_dtype": "float32",
                "bnb_4bit_use_double_quant": double}
    cfg = {"model": {"init_from": model_dir, "adapter_from": adapter_dir, "quantize": quantize},
           "data": {"seq_len": SEQ, "seed": 3, "path": os.path.join(work, "train.sft"), "format": "sft",
                    "eval_path": os.path.join(work, "eval.sft"), "pack": False},
           "batch": {"micro_batch": MICRO, "grad_accum": ACCUM},
           "optimizer": {"type": "adamw", "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
                         "clip_grad_norm": CLIP},
           "device": {"budget": "64MiB"},
           "run": {"steps": STEPS, "progress": False, "log": os.path.join(work, "log.jsonl"),
                   "export": export, "export_overwrite": True, "checkpoint_dir": os.path.join(work, "ckpt")}}
    if world > 1 or double:
        cfg["placement"] = {"params": "nvme", "grads": "host", "master": "host", "moments": "host"}
        cfg["offload"] = {"nvme_dirs": [os.path.join(work, "swap")]}
        os.makedirs(os.path.join(work, "swap"), exist_ok=True)
    else:
        cfg["placement"] = {"params": "host"}
    lines, stderr = run_strata_output(strata, work, cfg, world, "train")
    if lines is None:
        return 1
    got = [l["loss"] for l in lines if "event" not in l]
    got_eval = [l["eval_loss"] for l in lines if l.get("event") == "eval"]
    ok = True

    if case == "llama-nf4":
        # Stopped after 2 steps and resumed from its checkpoint: the losses bitwise the straight run's.
        r = json.loads(json.dumps(cfg))
        r["run"].update({"steps": 2, "checkpoint_dir": os.path.join(work, "ckpt-resumed"),
                         "log": os.path.join(work, "log-first.jsonl"), "export": os.path.join(work, "export-first")})
        r["data"].pop("eval_path")
        first = run_strata(strata, work, r, world, "first")
        r["run"].update({"steps": STEPS, "resume": True, "log": os.path.join(work, "log-resumed.jsonl"),
                         "export": os.path.join(work, "export-resumed")})
        resumed = run_strata(strata, work, r, world, "resumed") if first is not None else None
        if resumed is None:
            return 1
        both = [l["loss"] for l in first + resumed if "event" not in l]
        print("losses straight", got, "stopped and resumed", both)
        if both != got:
            print("FAIL: the resumed run's losses are not bitwise the straight run's")
            ok = False

    # The oracle: peft over bitsandbytes' Linear4bit, AdamW and clipping over the adapters.
    model = PeftModel.from_pretrained(quantized_base(model_dir, qt, double), adapter_dir, is_trainable=True)
    linear4 = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    if linear4 != len(TARGETS) * 2:
        print(f"FAIL: the oracle has {linear4} Linear4bit layers, not {len(TARGETS) * 2}")
        ok = False
    model.train()
    ids, labels = sft_batch(train)
    eval_ids, eval_labels = sft_batch(evals)
    want = train_steps(model, ids, labels)
    print("losses strata", got, "peft + bitsandbytes", want)
    if len(got) != STEPS or any(abs(a - b) > 1e-6 * abs(b) for a, b in zip(got, want)):
        print("FAIL: training losses differ")
        ok = False

    exported = read_safetensors(os.path.join(export, "adapter_model.safetensors"))
    worst, worst_name, adapters = 0.0, "", 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        adapters += 1
        key = peft_saved_key(name)
        if key not in exported:
            print(f"FAIL: adapter {key} not exported")
            ok = False
            continue
        e = rel(exported[key], p.detach())
        if e > worst:
            worst, worst_name = e, key
    print(f"adapters: {adapters} ({len(exported)} exported), worst relative error {worst:.3g} ({worst_name})")
    if adapters == 0 or worst > 1e-5 or len(exported) != adapters:
        print("FAIL: adapters differ")
        ok = False

    # peft loads the export on a freshly quantized base: Strata's evaluation.
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(quantized_base(model_dir, qt, double), export)
        # Training mode (no dropout here): in eval mode without gradients, bitsandbytes' CPU
        # Linear4bit repacks its weights for a bf16 inference kernel on AVX512-BF16 machines,
        # another computation than the dequantization the training ran.
        loaded.train()
        peft_eval = mean_loss(loaded, eval_ids, eval_labels).item()
    print(f"evaluation: strata {got_eval}, peft + bitsandbytes on the adapter export {peft_eval:.9g}")
    if not got_eval or abs(got_eval[-1] - peft_eval) > 1e-6 * abs(peft_eval):
        print("FAIL: the adapter export on the 4-bit base does not give Strata's evaluation")
        ok = False

    # The adapters merged into the 16-bit base (`strata ckpt export --base`): peft's merge on it.
    out = os.path.join(work, "ckpt-export")
    run = subprocess.run([strata, "ckpt", "export", os.path.join(work, "ckpt"), out, "--base", model_dir],
                         capture_output=True, text=True)
    print(run.stdout.strip())
    if run.returncode != 0:
        print(run.stderr)
        print("FAIL: strata ckpt export --base failed")
        return 1
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out + "-merged", dtype=torch.float32)
        ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                        export).merge_and_unload()
        e = rel(merged(input_ids=eval_ids).logits, ref(input_ids=eval_ids).logits)
    print(f"merged into the 16-bit base: logits vs peft's merge_and_unload {e:.3g}")
    if e > 1e-5:
        print("FAIL: the merge into the 16-bit base differs")
        ok = False

    # Refusals: a resume with another quantization; run.export_merged with a 4-bit base.
    other = json.loads(json.dumps(cfg))
    other["model"]["quantize"]["bnb_4bit_quant_type"] = "fp4" if qt == "nf4" else "nf4"
    other["run"].update({"resume": True, "log": os.path.join(work, "log-other.jsonl"),
                         "export": os.path.join(work, "export-other")})
    lines, err = run_strata_output(strata, work, other, world, "other-quantization", must_pass=False)
    print("resume with another quantization:", err.strip().splitlines()[-1:] if err else "")
    if lines is not None or "in 4 bits" not in err:
        print("FAIL: a resume with another quantization was not refused naming the 4-bit base")
        ok = False
    ok = merged_into_dequantized(strata, work, qt, double, cfg, world, export, eval_ids) and ok
    ok = prequantized(strata, work, case, cfg, world, got, export, eval_ids, eval_labels) and ok
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
