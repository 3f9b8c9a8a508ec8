"""Mixtures of experts through `strata train` against transformers + torch.optim.AdamW.

  moe_oracle.py STRATA_BIN WORKDIR CASE

Each case makes a tiny Mixtral or Qwen3-MoE with transformers (save_pretrained writes the Hub's
layout, one tensor per expert and projection), runs `strata train` on supervised examples from it
for three steps with the load-balancing loss added (output_router_logits, router_aux_loss_coef
0.05), and trains a transformers copy the same way: each of Strata's micro-batches (the loader's
order, strata_data.py) run as one forward with output_router_logits and the attention mask of its
padding (which the load-balancing loss leaves out), its summed cross entropy over
the global batch's counted targets plus the coefficient times its aux_loss over the micro-batches,
then clip_grad_norm_ and torch.optim.AdamW (no decay on norms). Compared: each step's loss (cross
entropy + aux) and aux_loss, the least and most chosen expert's share of its block's choices,
the evaluation loss (cross entropy alone), the exported weights loaded by transformers (per
tensor ||diff|| / ||ref|| <= 1e-5) and their logits.

Cases:
  mixtral          5 experts, top-2, GQA, an odd expert width (37); expert 4's router row points
                   away from every token (embedding feature 0 large, the row -5 there), so it
                   receives no token in any step and must still take AdamW's step (weight decay)
                   with a zero gradient, as transformers' fused experts do.
  qwen3-moe        5 experts, top-3, norm_topk_prob false, q/k norms, a dense block (1 of 3:
                   mlp_only_layers) with its own odd width (45), expert width 19.
  qwen3-moe-2rank  the same with norm_topk_prob true under `strata launch -n 2`.
  mixtral-frozen   model.trainable: attention, routers, norms, embeddings and head train; the
                   experts are frozen (requires_grad false in transformers).
  mixtral-tiles-2rank  expert tiles: each block's attention in 2 tiles and its 5 experts in 2
                   (3 and 2), every tile a unit, under `strata launch -n 2`.
  mixtral-resume   Strata against itself and transformers: stopped after 2 steps (1 rank, 2 expert
                   tiles, a checkpoint) and resumed for the third at 1 rank and 2 tiles (bitwise the
                   straight run: losses and exported weights) and at 2 ranks and 3 tiles (within
                   1e-5, and against transformers as every case); into a model of 4 experts
                   refused, saying so.
"""
import json
import os
import shutil
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_oracle import perturbed, rel, sft_batch, sft_examples, write_sft  # noqa: E402
from lora_oracle import run_strata_output  # noqa: E402
from moe_names import hub_state  # noqa: E402
from strata_data import global_samples  # noqa: E402

TOL = 1e-5
SEQ, MICRO, ACCUM = 24, 2, 2
# AdamW's eps is 1e-6, not torch's 1e-8: Adam's first step moves an element by lr g / (|g| + eps),
# so where a gradient cancels to near eps (qwen3-moe: one of 2160 elements at 5e-8, the median at
# 7e-3), fp32 rounding of 1e-8 between two exact implementations moved it by 2e-3. With 1e-6 that
# sensitivity is a hundred times less and the comparison measures the model, not the rounding.
LR, WD, BETAS, EPS, CLIP = 3e-3, 0.1, (0.9, 0.95), 1e-6, 1.0
STEPS, SEED, COEF = 3, 3, 0.05


def make_model(case, vocab):
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  output_router_logits=True, router_aux_loss_coef=COEF, experts_implementation="eager")
    if case.startswith("mixtral"):
        m = perturbed(tf.MixtralForCausalLM(tf.MixtralConfig(**common, intermediate_size=37, num_local_experts=5,
                                                             num_experts_per_tok=2)))
        if case == "mixtral":
            with torch.no_grad():  # expert 4 of every block never chosen: feature 0 large, its row -5 there
                m.model.embed_tokens.weight[:, 0] = 10.0
                for layer in m.model.layers:
                    layer.mlp.gate.weight[4].zero_()
                    layer.mlp.gate.weight[4, 0] = -5.0
        return m
    common.update(num_hidden_layers=3, head_dim=16)
    return perturbed(tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        **common, intermediate_size=45, moe_intermediate_size=19, num_experts=5, num_experts_per_tok=3,
        norm_topk_prob=case == "qwen3-moe-2rank", mlp_only_layers=[1])))


def rows(examples):
    """Strata's rows of supervised examples (finetune_oracle.sft_batch) as the model takes them:
    inputs [B, SEQ], their targets [B, SEQ] (-100 out of the loss) and the attention mask of the
    padding after each example (0 there), which keeps it out of the load-balancing loss."""
    ids, labels = sft_batch(examples, SEQ)
    real = torch.tensor([[1 if j < min(len(t), SEQ + 1) else 0 for j in range(SEQ)] for t, _ in examples])
    return ids[:, :SEQ], labels[:, 1:], real


def shares(router_logits, top_k, real):
    """Each sparse block's choices per expert over a forward's tokens but padding (counts)."""
    keep = real.reshape(-1).bool()
    return [torch.bincount(torch.topk(torch.softmax(l.float(), -1), top_k, -1).indices[keep].reshape(-1),
                           minlength=l.size(-1)).double() for l in router_logits]


def run_strata(strata, work, cfg, world, name):
    """`strata train` on `cfg` at `world` ranks; its stderr, or None (printed) when it failed."""
    lines, err = run_strata_output(strata, work, cfg, world, name)
    return None if lines is None else err


def tensors(export):
    from safetensors import safe_open
    out = {}
    for f in os.listdir(export):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(export, f), "pt") as st:
                out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def resumed(strata, work, cfg):
    """Stopped after 2 steps (1 rank, 2 expert tiles) and resumed: at 1 rank and 2 tiles bitwise
    the straight run, at 2 ranks and 3 tiles within 1e-5."""
    ok = True
    straight = [json.loads(l)["loss"] for l in open(cfg["run"]["log"]) if "event" not in json.loads(l)]
    want = tensors(cfg["run"]["export"])
    first = json.loads(json.dumps(cfg))
    ck = os.path.join(work, "ckpt")
    first["run"].update({"steps": 2, "checkpoint_dir": ck, "log": os.path.join(work, "first.jsonl"),
                         "export": os.path.join(work, "export-first")})
    first["data"].pop("eval_path")
    first["data"].pop("eval_every")
    if run_strata(strata, work, first, 1, "first") is None:
        return False
    losses_first = [json.loads(l)["loss"] for l in open(first["run"]["log"]) if "event" not in json.loads(l)]
    for world, mlp in ((1, 2), (2, 3)):
        r = json.loads(json.dumps(first))
        r["batch"]["grad_accum"] = ACCUM // world
        r["placement"]["tiling"]["mlp"] = mlp
        own = f"{ck}-{world}"  # each resume from the same checkpoint (a resumed run saves its own)
        shutil.copytree(ck, own)
        r["run"].update({"steps": STEPS, "resume": True, "checkpoint_dir": own,
                         "log": os.path.join(work, f"resumed-{world}.jsonl"),
                         "export": os.path.join(work, f"export-resumed-{world}")})
        if run_strata(strata, work, r, world, f"resumed-{world}") is None:
            return False
        got = losses_first + [json.loads(l)["loss"] for l in open(r["run"]["log"]) if "event" not in json.loads(l)]
        b = tensors(r["run"]["export"])
        print(f"losses straight {straight}, resumed at {world} rank(s) and {mlp} expert tiles {got}")
        if world == 1:
            if got != straight or set(b) != set(want) or any(not torch.equal(want[k], b[k]) for k in want):
                print("FAIL: the run resumed at the same world and cut is not bitwise the straight run")
                ok = False
        else:
            worst = max(float((b[k] - want[k]).norm() / max(want[k].norm(), 1e-30)) for k in want)
            print(f"weights resumed at 2 ranks and 3 expert tiles: worst relative error {worst:.3g}")
            if len(got) != len(straight) or any(abs(x - y) > TOL * abs(y) for x, y in zip(got, straight)) or worst > TOL:
                print("FAIL: the run resumed at 2 ranks and 3 expert tiles differs by more than 1e-5")
                ok = False
    # A checkpoint of another expert count is refused, saying so.
    bad = json.loads(json.dumps(first))
    bad["model"] = {"preset": "mixtral-8x7b", "layers": 2, "hidden": 48, "heads": 4, "kv_heads": 2, "intermediate": 37,
                    "vocab_size": 61, "experts": 4, "experts_per_token": 2}
    own = f"{ck}-bad"
    shutil.copytree(ck, own)
    bad["run"].update({"steps": STEPS, "resume": True, "checkpoint_dir": own, "log": os.path.join(work, "bad.jsonl"),
                       "export": os.path.join(work, "export-bad")})
    lines, err = run_strata_output(strata, work, bad, 1, "bad", must_pass=False)
    if lines is not None or "its model has 5 experts a sparse block, this run's 4" not in err:
        print("FAIL: a checkpoint of 5 experts resumed into 4 was not refused saying so:", err[-400:])
        ok = False
    return ok


def main():
    strata, work, case = sys.argv[1], sys.argv[2], sys.argv[3]
    shutil.rmtree(work, ignore_errors=True)  # a resumed run appends to its log
    os.makedirs(work, exist_ok=True)
    vocab = 61
    model = make_model(case, vocab)
    model_dir = os.path.join(work, "model")
    model.save_pretrained(model_dir, safe_serialization=True)
    world = 2 if case.endswith("2rank") else 1
    global_batch = MICRO * ACCUM * world
    rng = np.random.default_rng(11)
    train = sft_examples(rng, global_batch, vocab, [9, 25, 31, 14, 20, 40, 25, 11])
    evals = sft_examples(rng, 5, vocab, [12, 30, 25, 7, 18])
    write_sft(os.path.join(work, "train.sft"), train)
    write_sft(os.path.join(work, "eval.sft"), evals)
    cfg = {"model": {"init_from": model_dir},
           "data": {"seq_len": SEQ, "seed": SEED, "pack": False, "path": os.path.join(work, "train.sft"),
                    "format": "sft", "eval_path": os.path.join(work, "eval.sft"), "eval_every": 1},
           "batch": {"micro_batch": MICRO, "grad_accum": ACCUM},
           "optimizer": {"type": "adamw", "lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD,
                         "no_decay": ["bias", "norm"], "clip_grad_norm": CLIP},
           "device": {"budget": "64MiB"},
           "run": {"steps": STEPS, "progress": False, "log": os.path.join(work, "log.jsonl"),
                   "export": os.path.join(work, "export"), "export_overwrite": True}}
    frozen = []
    if case == "mixtral-frozen":
        cfg["model"]["trainable"] = ["model.embed_tokens.weight", "model.layers.*.self_attn.*",
                                     "model.layers.*.block_sparse_moe.gate.weight", "model.layers.*layernorm.weight",
                                     "model.norm.weight", "lm_head.weight"]
        for n, p in model.named_parameters():
            if ".experts." in n:
                p.requires_grad_(False)
                frozen.append(n)
    if case in ("mixtral-tiles-2rank", "mixtral-resume"):
        cfg["placement"] = {"tiling": {"attention": 2, "mlp": 2}}
    if run_strata(strata, work, cfg, world, "train") is None:
        return 1
    lines = [json.loads(l) for l in open(cfg["run"]["log"])]
    steps = [l for l in lines if "loss" in l and l.get("event") is None]
    evals_logged = [l for l in lines if l.get("event") == "eval"]

    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.dim() > 1]
    no_decay = [p for p in trained if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    top_k = model.config.num_experts_per_tok
    micro_batches = global_batch // MICRO
    eval_ids, eval_labels, _ = rows(evals)
    ref = []  # per step: loss, aux, least and most share
    ref_evals = []
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
    for s in range(STEPS):
        order = global_samples(len(train), SEED, s * global_batch, global_batch)
        batches = [rows([train[i] for i in order[j * MICRO:(j + 1) * MICRO]]) for j in range(micro_batches)]
        counted = sum(int((labels != -100).sum()) for _, labels, _ in batches)
        opt.zero_grad()
        loss_value, aux_value, choices = 0.0, 0.0, None
        for ids, labels, real in batches:
            out = model(input_ids=ids, attention_mask=real, output_router_logits=True)
            ce = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, vocab), labels.reshape(-1),
                                                   ignore_index=-100, reduction="sum") / counted
            loss = ce + COEF * out.aux_loss / micro_batches
            loss.backward()
            loss_value += loss.item()
            aux_value += out.aux_loss.item() / micro_batches
            c = shares(out.router_logits, top_k, real)
            choices = c if choices is None else [a + b for a, b in zip(choices, c)]
        torch.nn.utils.clip_grad_norm_(trained, CLIP)
        opt.step()
        fractions = torch.cat([c / c.sum() for c in choices])
        ref.append((loss_value, aux_value, float(fractions.min()), float(fractions.max())))
        with torch.no_grad():
            logits = model(input_ids=eval_ids).logits.float()
            ref_evals.append(float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, vocab), eval_labels.reshape(-1), ignore_index=-100)))

    ok = True
    got = [(l["loss"], l.get("aux_loss", float("nan")), l.get("expert_share_min", -1), l.get("expert_share_max", -1))
           for l in steps]
    print("strata (loss, aux, least share, most share):", got)
    print("transformers:                                 ", ref)
    if len(got) != STEPS:
        print("FAIL: expected", STEPS, "steps")
        ok = False
    for (gl, ga, gmin, gmax), (rl, ra, rmin, rmax) in zip(got, ref):
        if abs(gl - rl) > TOL * abs(rl) or abs(ga - ra) > TOL * abs(ra):
            print("FAIL: loss or aux_loss differ")
            ok = False
        if abs(gmin - rmin) > 1e-12 or abs(gmax - rmax) > 1e-12:
            print("FAIL: expert shares differ")
            ok = False
    if case == "mixtral":
        if any(r[2] != 0 for r in ref):
            print("FAIL: the test's premise: expert 4 should receive no token")
            ok = False
        # ...and still took AdamW's steps: weight decay moved it.
        after = {n: p.detach() for n, p in model.named_parameters() if ".experts." in n}
        moved = float((after["model.layers.0.mlp.experts.down_proj"][4] - before["model.layers.0.mlp.experts.down_proj"][4]).abs().max())
        if moved == 0:
            print("FAIL: the unchosen expert did not move in transformers (weight decay)")
            ok = False
    got_eval = [l["eval_loss"] for l in evals_logged]
    print("eval losses strata", got_eval, "transformers", ref_evals)
    if len(got_eval) != STEPS or any(abs(a - b) > TOL * abs(b) for a, b in zip(got_eval, ref_evals)):
        print("FAIL: evaluation losses differ")
        ok = False

    # The export: the Hub's layout, loaded by transformers as the same family and weights.
    from safetensors import safe_open
    export = os.path.join(work, "export")
    names = set()
    for f in os.listdir(export):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(export, f), "pt") as st:
                names.update(st.keys())
    want = set(hub_state(model))
    if names != want:
        print("FAIL: exported names differ from the Hub layout:", sorted(names ^ want)[:8])
        ok = False
    from transformers import AutoModelForCausalLM
    back = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, experts_implementation="eager")
    if type(back) is not type(model):
        print(f"FAIL: export loads as {type(back).__name__}, not {type(model).__name__}")
        ok = False
    worst, worst_name = 0.0, ""
    ref_state = model.state_dict()
    for name, t in back.state_dict().items():
        e = float((t.float() - ref_state[name].float()).norm() / max(ref_state[name].float().norm(), 1e-30))
        if e > worst:
            worst, worst_name = e, name
    print(f"weights: worst relative error {worst:.3g} ({worst_name})")
    if worst > TOL:
        print("FAIL: weights differ")
        ok = False
    if frozen:
        for n in frozen:
            if not torch.equal(back.state_dict()[n], model.state_dict()[n]):
                print(f"FAIL: frozen {n} changed")
                ok = False
    # The export computes in transformers what Strata computed with the same weights: its eval
    # loss equals Strata's last one. Against the reference model (weights within TOL, not equal)
    # the logits are only near: a token whose top-k choice is a near tie there may pick another
    # expert, so that bound is looser.
    with torch.no_grad():
        logits = back(input_ids=eval_ids).logits.float()
        e = rel(logits, model(input_ids=eval_ids).logits)
        export_eval = float(torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), eval_labels.reshape(-1),
                                                              ignore_index=-100))
    print(f"export: eval loss in transformers {export_eval!r}, Strata's {got_eval[-1] if got_eval else None!r}; "
          f"logits against the reference: relative error {e:.3g}")
    if not got_eval or abs(export_eval - got_eval[-1]) > TOL * abs(got_eval[-1]) or e > 1e-3:
        print("FAIL: the export computes otherwise in transformers")
        ok = False
    if case == "mixtral-resume":
        ok &= resumed(strata, work, cfg)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
