"""Runs the README's quick start as it is written, then checks what it made.

    quickstart_test.py STRATA_BIN WORKDIR

The lines between `<!-- quickstart` and `<!-- /quickstart -->` in README.md run one by one in
bash, in WORKDIR, where `configs/` and `scripts/` link to the source tree and `build/strata` to
the binary under test (so the quick start's `build/quickstart` lands in WORKDIR). The first
`strata train` line (the one that says Ctrl-C) gets SIGINT once its log shows step 5, must end
as stopped by SIGINT after saving a checkpoint, and the `--resume` line must go on from there. Then:

- the losses of every step and the evaluation losses in the log, and the exported model's logits,
  equal those of a transformers copy of the initial model trained the same way: fed the packed
  windows Strata's loader hands out at each step (strata_data.py makes them again: the packing
  rule and the loader's shuffle), with per-example position ids and a block-diagonal mask;
  the held-out windows' examples evaluated one by one; AdamW with weight decay off for norms,
  clipping, transformers' cosine schedule with warmup and a floor; fp32, 1e-5 relative for
  losses, 1e-4 for logits after 16 steps;
- the export holds the tokenizer, generation_config.json and the special token ids, and
  `strata ckpt export --tokenizer-from` of the last checkpoint gives the same model;
- TensorBoard's reader finds train/loss for all 16 steps and eval/loss; the plot is a PNG of
  1200 x 900 that is not blank.
Then the README's LoRA variant (`quickstart-lora`) runs, and peft's model on its adapter export
must give Strata's last evaluation loss, the merged export's logits peft's merge_and_unload()'s.
Exit 0 when all hold.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(SRC, "tests", "models", "py"))
import finetune_oracle as fo  # noqa: E402
import strata_data as sd  # noqa: E402


def packed_split(examples, cfg):
    """The quick start's windows as Strata packs them (data.pack), split as data.eval_split splits
    its samples: the training windows and the held-out windows' examples."""
    seq = cfg["data"]["seq_len"]
    bins = sd.best_fit_decreasing([min(len(t), seq + 1) for t, _ in examples], seq + 1, cfg["data"]["seed"])
    held = max(1, int(cfg["data"]["eval_split"] * len(bins) + 0.5))  # llround
    return bins[:-held], [examples[e] for b in bins[-held:] for e in b]


def quickstart_lines(tag="quickstart"):
    text = open(os.path.join(SRC, "README.md"), encoding="utf-8").read()
    m = re.search(r"<!-- " + tag + r":.*?-->\s*```sh\n(.*?)```\s*<!-- /" + tag + " -->", text, re.S)
    if not m:
        sys.exit(f"FAIL: README.md has no {tag} block")
    lines, cur = [], ""
    for raw in m.group(1).splitlines():
        cur += raw
        if cur.rstrip().endswith("\\"):
            cur = cur.rstrip()[:-1] + " "
            continue
        if cur.strip():
            lines.append(cur)
        cur = ""
    return lines


def main():
    strata, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.join(work, "build"))
    for d in ("configs", "scripts"):
        os.symlink(os.path.join(SRC, d), os.path.join(work, d))
    os.symlink(strata, os.path.join(work, "build", "strata"))
    env = dict(os.environ)
    python = sys.executable
    ok = True
    prefix = []  # variable assignments carried to later lines
    log_path = os.path.join(work, "build/quickstart/train.jsonl")
    for line in quickstart_lines():
        # The README names the setup's Python; this test runs with the configured one (the same
        # environment under scripts/test.sh).
        cmd = line.replace("~/.cache/strata/venv/bin/python", python)
        script = "\n".join(prefix + [cmd])
        if re.match(r"^\w+=\S+\s*(#.*)?$", cmd):
            prefix.append(cmd)
            continue
        print("$", line, flush=True)
        if "Ctrl-C" in line:
            # Its own process group, signalled whole, as a terminal's Ctrl-C is (whether or not
            # bash execs the command).
            p = subprocess.Popen(["bash", "-c", script], cwd=work, env=env, start_new_session=True)
            t0 = time.time()
            while time.time() - t0 < 300:
                steps = []
                if os.path.exists(log_path):
                    for l in open(log_path):
                        try:
                            steps.append(json.loads(l).get("step", 0))
                        except ValueError:
                            pass
                if steps and max(steps) >= 5 or p.poll() is not None:
                    break
                time.sleep(0.005)
            if p.poll() is not None:
                print(f"FAIL: the run ended (exit {p.returncode}) before it could be interrupted at step 5")
                return 1
            os.killpg(p.pid, signal.SIGINT)
            rc = p.wait(timeout=300)
            # 130 through a shell; -2 where the process (bash exec'd the last command) ends
            # itself with the signal, as a program stopped by SIGINT should.
            if rc not in (130, -signal.SIGINT):
                print(f"FAIL: the interrupted run exited {rc}, not as stopped by SIGINT")
                return 1
            continue
        r = subprocess.run(["bash", "-c", script], cwd=work, env=env)
        if r.returncode != 0:
            print(f"FAIL: exit {r.returncode}: {line}")
            return 1

    import torch
    from transformers import AutoModelForCausalLM, get_cosine_with_min_lr_schedule_with_warmup
    qs = os.path.join(work, "build/quickstart")
    cfg = json.load(open(os.path.join(SRC, "configs/finetune.json")))
    seq, steps = cfg["data"]["seq_len"], cfg["run"]["steps"]
    o = cfg["optimizer"]
    examples = fo.read_sft(os.path.join(qs, "chats.sft"))
    train_bins, evals = packed_split(examples, cfg)
    gb = cfg["batch"]["micro_batch"] * cfg["batch"]["grad_accum"]
    model = AutoModelForCausalLM.from_pretrained(os.path.join(qs, "tiny-llama"), dtype=torch.float32)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=o["lr"], betas=tuple(o["betas"]),
                            eps=1e-8)
    sch = get_cosine_with_min_lr_schedule_with_warmup(opt, o["schedule"]["warmup_steps"], steps,
                                                      min_lr_rate=o["schedule"]["min_lr_ratio"])
    eval_ids, _ = fo.sft_batch(evals, seq)  # for the exports' logits
    model.config._attn_implementation = "sdpa"  # takes the packed batches' boolean masks as given
    ref_losses, ref_evals = [], {}
    for s in range(steps):
        windows = sd.global_samples(len(train_bins), cfg["data"]["seed"], s * gb, gb)
        batch = sd.packed_batch(examples, [train_bins[w] for w in windows], seq)
        opt.zero_grad()
        loss = sd.packed_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["clip_grad_norm"])
        opt.step()
        sch.step()
        ref_losses.append(loss.item())
        if (s + 1) % cfg["data"]["eval_every"] == 0 or s + 1 == steps:
            with torch.no_grad():
                ref_evals[s + 1] = sd.one_by_one_loss(model, evals, seq)

    lines = [json.loads(l) for l in open(log_path)]
    starts = [l for l in lines if l.get("event") == "start"]
    got = {l["step"]: l["loss"] for l in lines if "loss" in l and l.get("event") is None}
    got_eval = {l["step"]: l["eval_loss"] for l in lines if l.get("event") == "eval"}
    if len(starts) != 2 or starts[1].get("resumed_from", "") == "":
        print("FAIL: the log does not show a run and its resume:", [s.get("resumed_from") for s in starts])
        ok = False
    for k in range(1, steps + 1):
        if k not in got or abs(got[k] - ref_losses[k - 1]) > 1e-5 * ref_losses[k - 1]:
            print(f"FAIL: step {k}: loss {got.get(k)} vs transformers {ref_losses[k - 1]}")
            ok = False
    for k, v in ref_evals.items():
        if k not in got_eval or abs(got_eval[k] - v) > 1e-5 * v:
            print(f"FAIL: eval after step {k}: {got_eval.get(k)} vs transformers {v}")
            ok = False
    print("losses", [round(got.get(k, float('nan')), 5) for k in range(1, steps + 1)])
    print("eval losses", got_eval, "transformers", ref_evals)

    out = os.path.join(qs, "tiny-llama-ft")
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        a, b = back(input_ids=eval_ids).logits, model(input_ids=eval_ids).logits
    e = float((a - b).abs().max() / b.abs().max())
    print(f"export logits vs transformers: relative error {e:.3g}")
    if e > 1e-4:
        print("FAIL: the export's logits differ")
        ok = False
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if not os.path.isfile(os.path.join(out, f)):
            print(f"FAIL: the export has no {f}")
            ok = False
    src_cfg = json.load(open(os.path.join(qs, "tiny-llama", "config.json")))
    out_cfg = json.load(open(os.path.join(out, "config.json")))
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if out_cfg.get(k) != src_cfg.get(k):
            print(f"FAIL: config.json {k} {out_cfg.get(k)} != {src_cfg.get(k)}")
            ok = False

    # The last checkpoint exported by `strata ckpt export --tokenizer-from` is the run's export.
    again = os.path.join(qs, "from-checkpoint")
    r = subprocess.run([strata, "ckpt", "export", os.path.join(qs, "ckpt"), again, "--tokenizer-from",
                        os.path.join(qs, "tiny-llama")], capture_output=True, text=True)
    if r.returncode != 0:
        print("FAIL: strata ckpt export:", r.stderr)
        ok = False
    else:
        with torch.no_grad():
            c = AutoModelForCausalLM.from_pretrained(again, dtype=torch.float32)(input_ids=eval_ids).logits
        if not torch.equal(c, a) or not os.path.isfile(os.path.join(again, "tokenizer.json")):
            print("FAIL: the checkpoint's export differs from the run's, or has no tokenizer")
            ok = False
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb_steps, tb_eval = set(), set()
    tb = os.path.join(qs, "tensorboard")
    for f in sorted(os.listdir(tb)):
        acc = EventAccumulator(os.path.join(tb, f))
        acc.Reload()
        tags = acc.Tags()["scalars"]
        if "train/loss" in tags:
            tb_steps |= {e.step for e in acc.Scalars("train/loss")}
        if "eval/loss" in tags:
            tb_eval |= {e.step for e in acc.Scalars("eval/loss")}
    if tb_steps != set(range(1, steps + 1)) or tb_eval != set(ref_evals):
        print(f"FAIL: TensorBoard has train/loss at {sorted(tb_steps)} and eval/loss at {sorted(tb_eval)}")
        ok = False
    from PIL import Image
    img = Image.open(os.path.join(qs, "loss.png"))
    colors = len(img.convert("RGB").getcolors(1 << 24))
    if img.size != (1200, 900) or colors < 3:
        print(f"FAIL: loss.png is {img.size} with {colors} colors")
        ok = False
    ok = lora_quickstart(work, env, python, prefix) and ok
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def lora_quickstart(work, env, python, prefix):
    """The README's LoRA variant, run after the quick start (its data and model): peft's model on the
    adapter export gives Strata's last evaluation (1e-5), the merged export's logits are peft's
    merge_and_unload()'s (1e-5), the base is untouched, and the training loss fell."""
    for line in quickstart_lines("quickstart-lora"):
        print("$", line, flush=True)
        r = subprocess.run(["bash", "-c", "\n".join(prefix + [line.replace("~/.cache/strata/venv/bin/python", python)])],
                           cwd=work, env=env)
        if r.returncode != 0:
            print(f"FAIL: exit {r.returncode}: {line}")
            return False
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    ok = True
    qs = os.path.join(work, "build/quickstart")
    cfg = json.load(open(os.path.join(SRC, "configs/finetune-lora.json")))
    examples = fo.read_sft(os.path.join(qs, "chats.sft"))
    _, evals_held = packed_split(examples, cfg)
    eval_ids, _ = fo.sft_batch(evals_held, cfg["data"]["seq_len"])
    lines = [json.loads(l) for l in open(os.path.join(qs, "train-lora.jsonl"))]
    losses = [l["loss"] for l in lines if "loss" in l and l.get("event") is None]
    evals = [l["eval_loss"] for l in lines if l.get("event") == "eval"]
    base_dir = os.path.join(qs, "tiny-llama")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(base, os.path.join(qs, "tiny-llama-lora"))
        peft_eval = sd.one_by_one_loss(peft_model, evals_held, cfg["data"]["seq_len"])
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(qs, "tiny-llama-lora-merged"), dtype=torch.float32)
        a = merged(input_ids=eval_ids).logits
        b = peft_model.merge_and_unload()(input_ids=eval_ids).logits
    e = float((a - b).norm() / b.norm())
    print(f"LoRA: losses {[round(x, 4) for x in losses]}, Strata's evaluation {evals[-1] if evals else None}, "
          f"peft on the adapter export {peft_eval:.7g}; merged logits vs merge_and_unload {e:.3g}")
    if len(losses) != cfg["run"]["steps"] or not losses[-1] < losses[0]:
        print("FAIL: the LoRA run did not train")
        ok = False
    if not evals or abs(evals[-1] - peft_eval) > 1e-5 * peft_eval:
        print("FAIL: peft's model on the adapter export does not give Strata's evaluation")
        ok = False
    if e > 1e-5:
        print("FAIL: the merged export's logits differ from peft's merge_and_unload()")
        ok = False
    after = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).state_dict()
    if any(not torch.equal(after[k], v) for k, v in before.items()):
        print("FAIL: the base model changed on disk")
        ok = False
    return ok


if __name__ == "__main__":
    sys.exit(main())
