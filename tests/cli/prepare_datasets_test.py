#!/usr/bin/env python3
"""`strata data prepare` on the datasets fine-tuners download, against TRL and datasets.

Three hundred conversations (multi-turn, system prompts, unicode) are written by `datasets`
itself and by hand in every format and schema the command reads: OpenAI messages as JSONL and a
JSON array, ShareGPT as parquet (Dataset.to_parquet) and JSONL, Alpaca with history as a JSON
array, datasets' save_to_disk (a Dataset and a DatasetDict), and a Hub snapshot directory with
data/train-0000x-of-00002.parquet shards and a test split. Every one must give a byte-identical
prepared file, with 1 worker and with 3. TRL is the oracle of the examples: SFTTrainer with
assistant_only_loss on the same messages, with a ChatML template whose {% generation %} blocks
hold each answer and its <|im_end|>\\n, tokenizes every conversation to the ids and loss mask
Strata writes, both with those blocks and with the same template without them (Strata's
incremental rendering). Plain text datasets (parquet "text") give the token file `tokenizers`
gives. Bad inputs fail naming file and row, leaving no file behind.

usage: prepare_datasets_test.py STRATA WORKDIR
"""
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np

strata, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
failures, checks = [], [0]


def check(cond, what):
    checks[0] += 1
    if not cond:
        failures.append(what)
        print("FAILED:", what, file=sys.stderr)


def run(*args):
    env = dict(os.environ, STRATA_PYTHON=sys.executable)
    return subprocess.run([strata, "data", "prepare", *args], capture_output=True, text=True, env=env, timeout=300)


def leftovers():
    return [os.path.join(d, n) for d, _, names in os.walk(work) for n in names if ".tmp" in n]


# A byte-level BPE tokenizer with ChatML's special tokens, trained offline on real text.
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

licenses = "/usr/share/common-licenses"
corpus = [os.path.join(licenses, n) for n in sorted(os.listdir(licenses)) if os.path.isfile(os.path.join(licenses, n))]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GENERATION = CHATML.replace("{{ m['content'] }}<|im_end|>\n",
                            "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n"
                            "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}")


def tokenizer_dir(name, template):
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = template
    d = os.path.join(work, name)
    hf.save_pretrained(d)
    return d


plain_tpl, gen_tpl = tokenizer_dir("chatml", CHATML), tokenizer_dir("chatml-generation", GENERATION)

# Conversations that look like the real thing: sentences of the license texts, unicode, code.
rng = random.Random(64)
words = open(os.path.join(licenses, "GPL-3"), encoding="utf-8").read().split()
extras = ["naïve café", "“quoted”", "日本語のテキスト", "🙂", "Ελληνικά", "def f(x):\n    return x * 2", "a\tb", "\n\n"]


def sentence():
    start = rng.randrange(len(words) - 40)
    text = " ".join(words[start:start + rng.randint(1, 40)])
    return text + (" " + rng.choice(extras) if rng.random() < 0.3 else "")


def conversation():
    msgs = [{"role": "system", "content": sentence()}] if rng.random() < 0.4 else []
    for _ in range(rng.choice([1, 1, 2, 3, 4])):
        msgs += [{"role": "user", "content": sentence()}, {"role": "assistant", "content": sentence()}]
    return msgs


convs = [conversation() for _ in range(300)]
test_convs = [conversation() for _ in range(20)]


def sharegpt(msgs):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in msgs]}


def alpaca(msgs):
    system = [m["content"] for m in msgs if m["role"] == "system"]
    turns = [m["content"] for m in msgs if m["role"] != "system"]
    pairs = [[turns[i], turns[i + 1]] for i in range(0, len(turns) - 2, 2)]
    rec = {"instruction": turns[-2], "input": "", "output": turns[-1], "history": pairs}
    return {**rec, "system": system[0]} if system else rec


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=rng.random() < 0.5) + "\n")
    return path


def write_json(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rows, f, ensure_ascii=False, indent=1)
    return path


import datasets  # noqa: E402
from datasets import Dataset, DatasetDict  # noqa: E402

datasets.disable_progress_bars()

inputs = {
    "messages.jsonl": write_jsonl(os.path.join(work, "in", "messages.jsonl"), [{"messages": c} for c in convs]),
    "messages.json": write_json(os.path.join(work, "in", "messages.json"), [{"messages": c, "id": i} for i, c in enumerate(convs)]),
    "sharegpt.jsonl": write_jsonl(os.path.join(work, "in", "sharegpt.jsonl"), [sharegpt(c) for c in convs]),
    "alpaca.json": write_json(os.path.join(work, "in", "alpaca.json"), [alpaca(c) for c in convs]),
}
sharegpt_ds = Dataset.from_list([sharegpt(c) for c in convs])
inputs["sharegpt.parquet"] = os.path.join(work, "in", "sharegpt.parquet")
sharegpt_ds.to_parquet(inputs["sharegpt.parquet"])
inputs["save_to_disk"] = os.path.join(work, "in", "saved")
Dataset.from_list([{"messages": c} for c in convs]).save_to_disk(inputs["save_to_disk"], max_shard_size="20KB")
inputs["DatasetDict"] = os.path.join(work, "in", "saved-dict")
DatasetDict({"train": sharegpt_ds, "test": Dataset.from_list([sharegpt(c) for c in test_convs])}).save_to_disk(
    inputs["DatasetDict"])
snapshot = os.path.join(work, "in", "snapshot")  # a Hub dataset repository as downloaded
os.makedirs(os.path.join(snapshot, "data"))
with open(os.path.join(snapshot, "README.md"), "w") as f:
    f.write("---\nconfigs:\n- config_name: default\n---\n# a dataset\n")
with open(os.path.join(snapshot, ".gitattributes"), "w") as f:
    f.write("*.parquet filter=lfs\n")
with open(os.path.join(snapshot, "LICENSE"), "w") as f:  # not data: the snapshot's dataset files are
    f.write("Permission is hereby granted\n")
half = len(convs) // 2
for k, part in enumerate((convs[:half], convs[half:])):  # named as older uploads are: a hash after the count
    Dataset.from_list([{"messages": c, "source": "x"} for c in part]).to_parquet(
        os.path.join(snapshot, "data", f"train-0000{k}-of-00002-{'a09b74b3ef9c3b56' if k else '0123abcd4567ef89'}.parquet"))
Dataset.from_list([{"messages": c, "source": "x"} for c in test_convs]).to_parquet(
    os.path.join(snapshot, "data", "test-00000-of-00001.parquet"))
inputs["snapshot"] = snapshot
# UltraChat 200k's layout and columns: splits train_sft / test_sft, "prompt" beside "messages".
ultra = os.path.join(work, "in", "ultrachat")
os.makedirs(os.path.join(ultra, "data"))
for split, rows in (("train_sft", convs), ("test_sft", test_convs)):
    Dataset.from_list([{"prompt": c[1 if c[0]["role"] == "system" else 0]["content"], "prompt_id": str(i), "messages": c}
                       for i, c in enumerate(rows)]).to_parquet(
        os.path.join(ultra, "data", f"{split}-00000-of-00001-5e4c1ee6ab2a1b0c.parquet"))
inputs["ultrachat --split train_sft"] = ultra
# ShareGPT with an empty system turn (as Orca-style data has): no system prompt.
inputs["sharegpt-empty-system.jsonl"] = write_jsonl(
    os.path.join(work, "in", "sharegpt-empty-system.jsonl"),
    [{"conversations": ([] if c[0]["role"] == "system" else [{"from": "system", "value": ""}]) + sharegpt(c)["conversations"]}
     for c in convs])

# Every format and schema -> the same bytes.
reference = os.path.join(work, "out", "reference.sft")
r = run("--chat", "--workers", "1", "--tokenizer", gen_tpl, "--output", reference, inputs["messages.jsonl"])
check(r.returncode == 0, f"messages.jsonl prepares (got {r.returncode}: {r.stderr.strip()[-400:]})")
ref_bytes = open(reference, "rb").read() if r.returncode == 0 else b""
for name, path in inputs.items():
    workers = "3" if name in ("messages.jsonl", "sharegpt.parquet", "snapshot") else "1"
    out = os.path.join(work, "out", name.split(" ")[0] + ".sft")
    split = ["--split", name.split(" ")[-1]] if "--split" in name else []
    r = run("--chat", "--workers", workers, "--tokenizer", gen_tpl, "--output", out, *split, path)
    same = r.returncode == 0 and open(out, "rb").read() == ref_bytes
    check(same, f"{name} with {workers} worker(s) gives the reference bytes (got {r.returncode}: {r.stderr.strip()[-400:]})")
check(r.returncode == 0 and "examples/s" in r.stdout, f"the summary gives examples/s ({r.stdout.strip()[-200:]})")
test_out = os.path.join(work, "out", "test.sft")
r = run("--chat", "--split", "test", "--tokenizer", gen_tpl, "--output", test_out, inputs["snapshot"])
r2 = run("--chat", "--split", "test", "--tokenizer", gen_tpl, "--output", test_out + "2", inputs["DatasetDict"])
r3 = run("--chat", "--tokenizer", gen_tpl, "--output", test_out + "3",
         write_jsonl(os.path.join(work, "in", "test-only.jsonl"), [{"messages": c} for c in test_convs]))
check(r.returncode == r2.returncode == r3.returncode == 0 and
      open(test_out, "rb").read() == open(test_out + "2", "rb").read() == open(test_out + "3", "rb").read(),
      f"--split test of the snapshot and of the DatasetDict are the test conversations ({r.stderr[-300:]}{r2.stderr[-300:]})")
r = run("--chat", "--split", "validation", "--tokenizer", gen_tpl, "--output", test_out, inputs["snapshot"])
check(r.returncode == 1 and "no files of the split 'validation'" in r.stderr and "test, train" in r.stderr,
      f"a split the snapshot lacks is refused, naming its splits ({r.stderr.strip()})")


def load_sft(path):
    from safetensors.numpy import load_file

    t = load_file(path)
    o = t["offsets"]
    return [(t["tokens"][o[e]:o[e + 1]].tolist(), t["loss_mask"][o[e]:o[e + 1]].tolist()) for e in range(len(o) - 1)]


# TRL as the oracle: SFTTrainer's own tokenization of the messages with assistant_only_loss.
import torch  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

hf_tok = AutoTokenizer.from_pretrained(gen_tpl)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=len(hf_tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1))
cfg = SFTConfig(output_dir=os.path.join(work, "trl"), assistant_only_loss=True, max_length=None, packing=False,
                report_to=[], dataset_num_proc=None, use_cpu=True, bf16=False)
trainer = SFTTrainer(model=model, args=cfg, train_dataset=Dataset.from_list([{"messages": c} for c in convs]),
                     processing_class=hf_tok)
# TRL folds the assistant mask into labels: -100 where the loss leaves a token out.
trl_examples = [(list(x["input_ids"]), [int(label != -100) for label in x["labels"]]) for x in trainer.train_dataset]
got = load_sft(reference) if ref_bytes else []
check(len(got) == len(trl_examples) == len(convs), f"{len(got)} examples, TRL {len(trl_examples)}")
bad = [e for e, (a, b) in enumerate(zip(got, trl_examples)) if a != b]
check(not bad, f"every example's ids and loss mask are TRL's (differ at {bad[:5]})")
check(sum(sum(m) for _, m in got) > 0 and all(m[-1] == 1 for _, m in got), "the loss covers the final answers")
incremental = os.path.join(work, "out", "incremental.sft")
r = run("--chat", "--tokenizer", plain_tpl, "--output", incremental, inputs["sharegpt.parquet"])
check(r.returncode == 0 and load_sft(incremental) == trl_examples,
      f"without generation blocks (incremental rendering) the examples are TRL's too ({r.stderr.strip()[-300:]})")

# Alpaca's input joins the instruction by a newline; prompt-response and TRL's prompt-completion.
single = [c for c in convs if [m["role"] for m in c] == ["user", "assistant"]][:30]
forms = {"prompt-response": [{"prompt": c[0]["content"], "response": c[1]["content"]} for c in single],
         "completion": [{"prompt": c[0]["content"], "completion": c[1]["content"]} for c in single],
         "conversational": [{"prompt": c[:1], "completion": c[1:]} for c in single],
         "alpaca-input": [{"instruction": c[0]["content"].split(" ")[0], "input": " ".join(c[0]["content"].split(" ")[1:]),
                           "output": c[1]["content"]} for c in single]}
forms["dolly"] = [{"instruction": f["instruction"], "context": f["input"], "response": f["output"], "category": "qa"}
                  for f in forms["alpaca-input"]]
base = os.path.join(work, "out", "single.sft")
run("--chat", "--tokenizer", gen_tpl, "--output", base,
    write_jsonl(os.path.join(work, "in", "single.jsonl"), [{"messages": c} for c in single]))
alp = [{"messages": [{"role": "user", "content": (f["instruction"] + "\n" + f["input"]) if f["input"] else f["instruction"]},
                     {"role": "assistant", "content": f["output"]}]} for f in forms["alpaca-input"]]
alp_ref = os.path.join(work, "out", "alpaca-ref.sft")
run("--chat", "--tokenizer", gen_tpl, "--output", alp_ref, write_jsonl(os.path.join(work, "in", "alp-ref.jsonl"), alp))
for name, rows in forms.items():
    out = os.path.join(work, "out", name + ".sft")
    r = run("--chat", "--tokenizer", gen_tpl, "--output", out, write_jsonl(os.path.join(work, "in", name + ".jsonl"), rows))
    want = alp_ref if name in ("alpaca-input", "dolly") else base
    check(r.returncode == 0 and open(out, "rb").read() == open(want, "rb").read(),
          f"{name} gives the messages' bytes ({r.stderr.strip()[-300:]})")

# Plain text datasets: a parquet "text" column and JSONL give the token file tokenizers gives.
texts = [sentence() for _ in range(50)] + [""]
Dataset.from_list([{"text": t, "n": i} for i, t in enumerate(texts)]).to_parquet(os.path.join(work, "in", "text.parquet"))
write_jsonl(os.path.join(work, "in", "text.jsonl"), [{"content": t} for t in texts])
eos = tok.token_to_id("<|im_end|>")
want = [i for t in texts if t for i in tok.encode(t, add_special_tokens=False).ids + [eos]]
for path, extra in (("text.parquet", []), ("text.jsonl", ["--column", "content"])):
    out = os.path.join(work, "out", path + ".bin")
    r = run("--tokenizer", plain_tpl, "--output", out, "--workers", "2", *extra, os.path.join(work, "in", path))
    ids = np.fromfile(out, dtype=np.uint16).tolist() if r.returncode == 0 else []
    check(ids == want and "1 empty records skipped" in r.stdout,
          f"{path}: each record's ids and eos, the empty record skipped ({r.returncode}: {r.stderr.strip()[-300:]})")

# A text corpus directory is read whole, whatever its files are called.
corpus_dir = os.path.join(work, "in", "corpus")
os.makedirs(corpus_dir)
for name, t in (("a.txt", texts[0]), ("test-driven.md", texts[1]), ("train.txt", texts[2])):
    with open(os.path.join(corpus_dir, name), "w") as f:
        f.write(t)
r = run("--tokenizer", plain_tpl, "--output", os.path.join(work, "out", "corpus.bin"), corpus_dir)
ids = np.fromfile(os.path.join(work, "out", "corpus.bin"), dtype=np.uint16).tolist() if r.returncode == 0 else []
check(ids == [i for t in (texts[0], texts[1], texts[2]) for i in tok.encode(t, add_special_tokens=False).ids + [eos]],
      f"a corpus directory's text files are all read, split-like names or not ({r.stderr.strip()[-300:]})")

# Bad input: one line naming the file and row; the earlier output stays, nothing half-written.
before = open(reference, "rb").read()
Dataset.from_list([{"question": "a", "answer": "b"}]).to_parquet(os.path.join(work, "in", "columns.parquet"))
shard = os.path.join(work, "in", "corrupt.parquet")
data = open(os.path.join(snapshot, "data", "train-00001-of-00002-a09b74b3ef9c3b56.parquet"), "rb").read()
with open(shard, "wb") as f:
    f.write(data[:len(data) // 2])
long_turn = [{"messages": [{"role": "user", "content": " ".join(words[:400])}, {"role": "assistant", "content": "yes"}]}]
alternate = [{"messages": c} for c in convs[:3]] + [{"messages": [{"role": "user", "content": "a"},
                                                                   {"role": "user", "content": "b"},
                                                                   {"role": "assistant", "content": "c"}]}]
cases = [
    ([os.path.join(work, "in", "columns.parquet")], [], "columns.parquet:1: no schema fits its columns (question, answer)"),
    ([write_jsonl(os.path.join(work, "in", "alternate.jsonl"), alternate)], [],
     "alternate.jsonl:4: message 2 (user) follows a user message"),
    ([write_jsonl(os.path.join(work, "in", "long.jsonl"), long_turn)], ["--max-tokens", "64"],
     "long.jsonl:1: message 1 (user) is"),
    ([shard], [], "corrupt.parquet: not a readable parquet file"),
    ([write_jsonl(os.path.join(work, "in", "ambiguous.jsonl"), [{"messages": convs[0], "instruction": "a", "output": "b"}])],
     [], "ambiguous.jsonl:1: its columns (messages, instruction, output) fit more than one schema (messages, alpaca)"),
    ([write_jsonl(os.path.join(work, "in", "empty.jsonl"), [sharegpt(c) for c in convs[:5]] +
                  [{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": ""}]}])],
     [], 'empty.jsonl:6: message 2 (assistant) "value" is empty'),
    ([write_jsonl(os.path.join(work, "in", "function.jsonl"),
                  [{"conversations": [{"from": "human", "value": "a"}, {"from": "function_call", "value": "{}"}]}])],
     [], 'function.jsonl:1: message 2 has from "function_call" (function calls are not supported)'),
]
configs = os.path.join(work, "in", "configs")  # a Hub dataset with configurations (gsm8k's main/, socratic/)
for c in ("main", "socratic"):
    os.makedirs(os.path.join(configs, c))
    Dataset.from_list([{"messages": convs[0]}]).to_parquet(os.path.join(configs, c, "train-00000-of-00001.parquet"))
cases.append(([configs], [], "the split 'train' has files in several directories (main, socratic)"))
empty_tok = os.path.join(work, "no-tokenizer")
os.makedirs(empty_tok)
for paths, extra, want in cases + [([inputs["messages.jsonl"]], ["--tokenizer", empty_tok], f"tokenizer {empty_tok}: ")]:
    for workers in ("1", "2"):
        tokenizer = [] if "--tokenizer" in extra else ["--tokenizer", gen_tpl]
        r = run("--chat", "--workers", workers, *tokenizer, "--output", reference, *extra, *paths)
        check(r.returncode == 1 and want in r.stderr and r.stderr.strip().count("\n") == 0,
              f"error {want!r} with {workers} worker(s) (got {r.returncode}: {r.stderr.strip()[-400:]})")
# Ctrl-C in the middle: exit 130, the partial output removed, the earlier one kept.
many = write_jsonl(os.path.join(work, "in", "many.jsonl"), [{"messages": c} for c in convs * 40])
p = subprocess.Popen([strata, "data", "prepare", "--chat", "--workers", "2", "--tokenizer", plain_tpl, "--output",
                      reference, many], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     env=dict(os.environ, STRATA_PYTHON=sys.executable))
import time  # noqa: E402

deadline = time.monotonic() + 60
while not os.path.exists(reference + ".tmp.tokens") and time.monotonic() < deadline and p.poll() is None:
    time.sleep(0.05)
time.sleep(2)  # the workers are tokenizing
p.send_signal(2)
out, err = p.communicate(timeout=60)
check(p.returncode == 130 and "interrupted; no output written" in err,
      f"Ctrl-C stops the run, saying so (got {p.returncode}: {err.strip()[-300:]})")
check(open(reference, "rb").read() == before and not leftovers(),
      f"failed runs leave the earlier file and no temporary ({leftovers()})")

print(f"prepare_datasets: {checks[0] - len(failures)} passed, {len(failures)} failed")
sys.exit(1 if failures else 0)
