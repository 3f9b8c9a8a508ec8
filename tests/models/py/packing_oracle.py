"""Packed supervised fine-tuning (data.pack) through `strata train` against transformers.

  packing_oracle.py STRATA_BIN WORKDIR CASE

Strata packs the examples into windows of seq_len + 1 tokens by best fit decreasing
(models::best_fit_decreasing, made again by strata_data.py). Every global batch is all the
windows, so the loader's order changes only the summation order.

Cases:
  llama, gpt2      4 steps: the losses equal (1e-5 relative) a transformers + torch AdamW run fed
                   the same packed batches with per-example position ids and an explicit
                   block-diagonal causal mask; the packed evaluation equals transformers' loss
                   over each example alone, unpadded; the exported weights (1e-5 per tensor);
                   the run reports the packing efficiency transformers' side counts.
  mistral-window   Mistral with a sliding window of 7 tokens, shorter than seq_len 24 and than
                   most examples: the mask also keeps each token to the last 7 of its example.
  gpt2-tiles       GPT-2 cut into 2 attention x 2 MLP tiles and 2 vocabulary tiles (the learned
                   positions in the first embedding tile, the head's loss in vocabulary tiles).
  gemma2           Gemma 2 (soft-capped attention and logits, query_pre_attn_scalar, sandwich
                   norms, a sliding window of 7 on alternate layers) with its head in 2
                   vocabulary tiles (the final cap applied tile by tile).
  lora             LoRA (peft, every Llama linear) on the packed batches: losses (1e-6) and the
                   exported adapters (1e-5).
  mixtral          a mixture of experts (5 experts, top-2) with its load-balancing loss: each
                   micro-batch's windows (the loader's order) run as one forward with their mask,
                   and their load_balancing_loss_func over the windows' tokens (packed examples
                   all counted, the padding after them not: a 2-d attention mask of it),
                   averaged over the micro-batches.
  resume           14 examples (8 windows), global batch 4: 2 steps, a checkpoint, resumed to 4
                   steps: at 1 rank its losses and exported weights are bitwise the straight
                   run's; at 2 ranks (grad_accum halved) within 1e-5.
"""
import json
import os
import shutil
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_oracle import perturbed, sft_examples, write_sft  # noqa: E402
from lora_oracle import read_safetensors, rel  # noqa: E402
from lora_oracle import run_strata_output as run_strata  # noqa: E402
from strata_data import best_fit_decreasing, one_by_one_loss, packed_batch, packed_loss  # noqa: E402

SEQ = 24
MICRO, ACCUM = 2, 2
LR, WD, BETAS, EPS, CLIP = 3e-3, 0.1, (0.9, 0.95), 1e-8, 1.0
STEPS = 4
WINDOW = 7  # mistral-window's sliding window
# Kept lengths 25 (cut from 31), 21, 3, 17, 8, 13, 12: four windows of 25, one with a padding token.
TRAIN_LENGTHS = [31, 21, 3, 17, 8, 13, 12]
EVAL_LENGTHS = [12, 30, 25, 7, 18]
AUX_COEF = 0.05  # mixtral's router_aux_loss_coef
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_for(case, vocab):
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=48, intermediate_size=83, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if case in ("llama", "lora", "resume"):
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif case == "mistral-window":
        m = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=WINDOW))
    elif case == "gemma2":
        m = tf.Gemma2ForCausalLM(tf.Gemma2Config(**dict(common, tie_word_embeddings=True), head_dim=16,
                                                 query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                                                 final_logit_softcapping=5.0, sliding_window=WINDOW,
                                                 hidden_activation="gelu_pytorch_tanh"))
        return perturbed(m)  # eager attention: sdpa has no soft cap
    elif case == "mixtral":
        m = tf.MixtralForCausalLM(tf.MixtralConfig(**dict(common, intermediate_size=37), num_local_experts=5,
                                                   num_experts_per_tok=2, output_router_logits=True,
                                                   router_aux_loss_coef=AUX_COEF, experts_implementation="eager"))
    elif case in ("gpt2", "gpt2-tiles"):
        m = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=vocab, n_embd=48, n_layer=2, n_head=4, n_positions=64,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                             initializer_range=0.2))
    else:
        raise SystemExit(f"unknown case {case}")
    m = perturbed(m)
    m.config._attn_implementation = "sdpa"  # takes a boolean 4-d mask as given
    return m


def moe_packed_loss(model, train, bins, step):
    """A mixture's loss over the step's packed windows as Strata computes it: the cross entropy
    summed over every window's counted targets / their count, plus the coefficient times each
    micro-batch's load_balancing_loss_func (every token of its windows) averaged over them."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    from strata_data import global_samples
    c = model.config
    order = global_samples(len(bins), 3, step * len(bins), len(bins))
    batches = [packed_batch(train, [bins[i] for i in order[j:j + MICRO]], SEQ) for j in range(0, len(bins), MICRO)]
    counted = sum(int((b[3] != -100).sum()) for b in batches)
    # Each window's examples' tokens (1) and the padding after them (0).
    used = [sum(min(len(train[e][0]), SEQ + 1) for e in bins[i]) for i in order]
    reals = [torch.tensor([[1 if j < u else 0 for j in range(SEQ)] for u in used[j:j + MICRO]])
             for j in range(0, len(bins), MICRO)]
    loss = 0.0
    for (inputs, pos, mask, targets), real in zip(batches, reals):
        out = model.model(input_ids=inputs, position_ids=pos, attention_mask=mask, output_router_logits=True)
        logits = model.lm_head(out.last_hidden_state).float()
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                               ignore_index=-100, reduction="sum")
        aux = load_balancing_loss_func(out.router_logits, c.num_local_experts, c.num_experts_per_tok, real)
        loss = loss + ce / counted + c.router_aux_loss_coef * aux / len(batches)
    return loss


def export_close(export_dir, model, tol):
    """Per tensor ||diff|| / ||ref|| of a full export against `model` (a mixture's experts in the
    Hub's layout); the worst, or None if a tensor is missing."""
    from moe_names import hub_state
    got = read_safetensors(os.path.join(export_dir, "model.safetensors"))
    worst, name = 0.0, ""
    for n, ref in hub_state(model).items():
        if n == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if n not in got:
            print(f"FAIL: {n} not exported")
            return None
        if got[n].shape != ref.shape:  # GPT-2's Conv1D weights: transposed back on export
            print(f"FAIL: {n} exported as {tuple(got[n].shape)}")
            return None
        g = got[n]
        if n.endswith("attn.c_attn.bias"):
            # GPT-2's key bias adds the same to every score of a query: its exact gradient is 0, so
            # both sides step by Adam's normalized rounding noise, at most lr a step. The query and
            # value biases are compared as the rest.
            d = ref.numel() // 3
            k_gap = float((g[d:2 * d] - ref[d:2 * d]).abs().max())
            if k_gap > 2 * LR * STEPS:
                print(f"FAIL: {n}: the key bias moved {k_gap:.3g}, more than Adam's steps allow")
                return None
            g, ref = torch.cat([g[:d], g[2 * d:]]), torch.cat([ref[:d], ref[2 * d:]])
        e = rel(g, ref)
        if e > worst:
            worst, name = e, n
    print(f"weights: worst relative error {worst:.3g} ({name})")
    return worst if worst <= tol else None


def resume_case(strata, work, cfg):
    """Strata against itself: stopped after 2 steps and resumed, at 1 and at 2 ranks."""
    rng = np.random.default_rng(5)
    examples = sft_examples(rng, 14, 61, [31, 21, 3, 17, 8, 13, 12, 25, 19, 6, 10, 15, 4, 22])
    write_sft(os.path.join(work, "train.sft"), examples)
    cfg["data"].pop("eval_path")
    cfg["data"].pop("eval_every")
    straight, _ = run_strata(strata, work, cfg, 1, "straight")
    if straight is None:
        return 1
    ok = True
    want = [l["loss"] for l in straight if "event" not in l]
    for world in (1, 2):
        r = json.loads(json.dumps(cfg))
        ck = os.path.join(work, f"ckpt-{world}")
        r["run"].update({"steps": 2, "checkpoint_dir": ck, "log": os.path.join(work, f"log-first-{world}.jsonl"),
                         "export": os.path.join(work, f"export-first-{world}")})
        first, _ = run_strata(strata, work, r, 1, f"first-{world}")
        if first is None:
            return 1
        manifest = json.load(open(os.path.join(ck, open(os.path.join(ck, "latest")).read().strip(), "manifest.json")))
        if manifest.get("data_pack") is not True:
            print("FAIL: the checkpoint does not record data_pack true:", manifest.get("data_pack"))
            ok = False
        r["run"].update({"steps": STEPS, "resume": True, "log": os.path.join(work, f"log-resumed-{world}.jsonl"),
                         "export": os.path.join(work, f"export-resumed-{world}")})
        resumed, err = run_strata(strata, work, r, world, f"resumed-{world}")
        if resumed is None:
            return 1
        got = [l["loss"] for l in first if "event" not in l] + [l["loss"] for l in resumed if "event" not in l]
        print(f"losses straight {want}, stopped and resumed at {world} rank(s) {got}")
        a = read_safetensors(os.path.join(work, "export", "model.safetensors"))
        b = read_safetensors(os.path.join(work, f"export-resumed-{world}", "model.safetensors"))
        if world == 1:
            if got != want or any(not torch.equal(a[k], b[k]) for k in a):
                print("FAIL: the resumed run is not bitwise the straight run")
                ok = False
            # A checkpoint from before data_pack was recorded resumes unpacked, saying so.
            old = os.path.join(work, "ckpt-old")
            shutil.copytree(ck, old)
            m_path = os.path.join(old, open(os.path.join(old, "latest")).read().strip(), "manifest.json")
            m = json.load(open(m_path))
            del m["data_pack"]
            json.dump(m, open(m_path, "w"))
            o = json.loads(json.dumps(r))
            o["run"].update({"checkpoint_dir": old, "log": os.path.join(work, "log-old.jsonl"),
                             "export": os.path.join(work, "export-old")})
            resumed_old, err = run_strata(strata, work, o, 1, "resumed-old")
            if resumed_old is None or "trained on unpacked examples: resuming unpacked" not in err:
                print("FAIL: a checkpoint without data_pack did not resume unpacked, saying so:", err[-400:])
                ok = False
        else:
            worst = max(rel(b[k], a[k]) for k in a)
            print(f"weights at 2 ranks: worst relative error {worst:.3g}")
            if len(got) != len(want) or any(abs(x - y) > 1e-5 * abs(y) for x, y in zip(got, want)) or worst > 1e-5:
                print("FAIL: the run resumed at 2 ranks differs from the straight run by more than 1e-5")
                ok = False
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def main():
    strata, work, case = sys.argv[1], sys.argv[2], sys.argv[3]
    shutil.rmtree(work, ignore_errors=True)  # a resumed run appends to its log
    os.makedirs(work)
    vocab = 61
    model = model_for(case, vocab)
    model_dir = os.path.join(work, "model")
    model.save_pretrained(model_dir, safe_serialization=True)
    rng = np.random.default_rng(11)
    train = sft_examples(rng, len(TRAIN_LENGTHS), vocab, TRAIN_LENGTHS)
    evals = sft_examples(rng, len(EVAL_LENGTHS), vocab, EVAL_LENGTHS)
    write_sft(os.path.join(work, "train.sft"), train)
    write_sft(os.path.join(work, "eval.sft"), evals)
    cfg = {"model": {"init_from": model_dir},
           "data": {"seq_len": SEQ, "seed": 3, "path": os.path.join(work, "train.sft"), "format": "sft",
                    "eval_path": os.path.join(work, "eval.sft"), "eval_every": 2},
           "batch": {"micro_batch": MICRO, "grad_accum": ACCUM},
           "optimizer": {"type": "adamw", "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
                         "no_decay": ["bias", "norm"], "clip_grad_norm": CLIP},
           "device": {"budget": "64MiB"},
           "run": {"steps": STEPS, "progress": False, "log": os.path.join(work, "log.jsonl"),
                   "export": os.path.join(work, "export"), "export_overwrite": True}}
    if case == "resume":
        return resume_case(strata, work, cfg)
    if case == "gpt2-tiles":
        cfg["placement"] = {"tiling": {"attention": 2, "mlp": 2, "vocab": 2}}
    if case == "gemma2":
        cfg["placement"] = {"tiling": {"vocab": 2}}
    if case == "lora":
        from peft import LoraConfig, get_peft_model
        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0,
                                                 init_lora_weights=False))
        model.save_pretrained(os.path.join(work, "adapter"))
        cfg["model"]["adapter_from"] = os.path.join(work, "adapter")
        cfg["optimizer"].pop("no_decay")
    lines, err = run_strata(strata, work, cfg, 1, "train")
    if lines is None:
        return 1
    ok = True
    got = [l["loss"] for l in lines if "event" not in l]
    got_eval = [l["eval_loss"] for l in lines if l.get("event") == "eval"]

    kept = [min(len(t), SEQ + 1) for t, _ in train]
    bins = best_fit_decreasing(kept, SEQ + 1, cfg["data"]["seed"])
    assert len(bins) == MICRO * ACCUM, bins
    efficiency = 100.0 * sum(kept) / (len(bins) * (SEQ + 1))
    said = f"packed into {len(bins)} windows of {SEQ + 1} tokens: packing efficiency {efficiency:.1f}%"
    print("strata:", [l for l in err.splitlines() if "packing efficiency" in l])
    start = next(l for l in lines if l.get("event") == "start")
    if said not in err or abs(start.get("packing_efficiency", 0) - efficiency / 100) > 1e-9 or not start.get("data_packed"):
        print(f"FAIL: the run does not report '{said}' (and the log's start line its packing efficiency)")
        ok = False
    # data.overlong "refuse": an example longer than seq_len + 1 stops the run before it starts.
    refuse = json.loads(json.dumps(cfg))
    refuse["data"]["overlong"] = "refuse"
    refuse["run"]["log"] = os.path.join(work, "log-refuse.jsonl")
    _, refused = run_strata(strata, work, refuse, 1, "refuse", must_pass=False)
    if "1 of 7 examples" not in refused or 'data.overlong "refuse"' not in refused:
        print("FAIL: data.overlong \"refuse\" did not refuse the 31-token example:", refused[-300:])
        ok = False

    if case == "gemma2":  # its window on layers 0 (sliding) and 1 (full): two batches' masks
        full = packed_batch(train, bins, SEQ)
        windowed = packed_batch(train, bins, SEQ, WINDOW)
        batch = (full[0], full[1], {"full_attention": full[2], "sliding_attention": windowed[2]}, full[3])
    else:
        batch = packed_batch(train, bins, SEQ, WINDOW if case == "mistral-window" else 0)
    if case == "lora":
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    else:
        trainable = list(model.parameters())
        decay = [p for p in trainable if p.dim() > 1]
        no_decay = [p for p in trainable if p.dim() <= 1]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=LR, betas=BETAS, eps=EPS)
    want, want_eval = [], []
    for s in range(STEPS):
        opt.zero_grad()
        loss = moe_packed_loss(model, train, bins, s) if case == "mixtral" else packed_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        opt.step()
        want.append(loss.item())
        if (s + 1) % 2 == 0:
            want_eval.append(one_by_one_loss(model, evals, SEQ))
    tol = 1e-6 if case == "lora" else 1e-5
    print("losses strata", got, "transformers", want)
    if len(got) != STEPS or any(abs(a - b) > tol * abs(b) for a, b in zip(got, want)):
        print("FAIL: training losses differ")
        ok = False
    print("eval losses strata", got_eval, "transformers one example at a time", want_eval)
    if len(got_eval) != len(want_eval) or any(abs(a - b) > 1e-5 * abs(b) for a, b in zip(got_eval, want_eval)):
        print("FAIL: evaluation losses differ")
        ok = False

    if case == "lora":
        exported = read_safetensors(os.path.join(work, "export", "adapter_model.safetensors"))
        worst = 0.0
        for name, p in model.named_parameters():
            if p.requires_grad:
                key = name.replace(".default.", ".")
                if key not in exported:
                    print(f"FAIL: adapter {key} not exported")
                    ok = False
                    continue
                worst = max(worst, rel(exported[key], p.detach()))
        print(f"adapters: worst relative error {worst:.3g}")
        if worst > 1e-5:
            print("FAIL: adapters differ")
            ok = False
    elif export_close(os.path.join(work, "export"), model, 1e-5) is None:
        print("FAIL: weights differ")
        ok = False
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
