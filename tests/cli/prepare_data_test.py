#!/usr/bin/env python3
"""`strata data prepare` end to end, against Hugging Face `tokenizers` as the oracle.

A byte-level BPE tokenizer is trained here, offline, on the license texts; two documents (one
ASCII, one with multi-byte UTF-8 and no final newline) are tokenized in small pieces; the token
file must decode back to exactly the documents, with one end-of-sequence id after each, the
sidecar must agree with it, and `strata train` must train on it. Failures leave no file behind
and an earlier output untouched.

usage: prepare_data_test.py STRATA WORKDIR
"""
import json
import os
import shutil
import subprocess
import sys
from array import array

strata, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
failures = []
checks = [0]


def check(cond, what):
    checks[0] += 1
    if not cond:
        failures.append(what)
        print("FAILED:", what, file=sys.stderr)


def run(*args):
    env = dict(os.environ, STRATA_PYTHON=sys.executable)
    return subprocess.run([strata, "data", "prepare", *args], capture_output=True, text=True, env=env)


# A tokenizer of the kind GPT-2 uses (byte-level BPE), trained on real text.
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

licenses = "/usr/share/common-licenses"
corpus = [os.path.join(licenses, n) for n in sorted(os.listdir(licenses))
          if os.path.isfile(os.path.join(licenses, n))]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False))
tok_dir = os.path.join(work, "tok")
os.makedirs(tok_dir)
tok.save(os.path.join(tok_dir, "tokenizer.json"))
eos = tok.token_to_id("<|endoftext|>")

docs_dir = os.path.join(work, "docs")
os.makedirs(docs_dir)
texts = {
    "a.txt": open(os.path.join(licenses, "GPL-3"), encoding="utf-8").read()[:20000],
    "b.txt": ("naïve café, “quoted” — 日本語のテキスト 🙂\n\n  indented line\n" * 120) + "no final newline",
}
for name, text in texts.items():
    with open(os.path.join(docs_dir, name), "w", encoding="utf-8") as f:
        f.write(text)

out = os.path.join(work, "out", "train.bin")
r = run("--tokenizer", tok_dir, "--output", out, "--piece", "3000", docs_dir)
check(r.returncode == 0, f"prepare exits 0 (got {r.returncode}: {r.stderr.strip()})")
ids = array("H")
with open(out, "rb") as f:
    ids.frombytes(f.read())
meta = json.load(open(out + ".json"))
check(meta["format"] == "uint16", f"uint16 chosen for a 400-token vocabulary (got {meta['format']})")
check(meta["tokens"] == len(ids), f"sidecar token count {meta['tokens']} == file's {len(ids)}")
check(meta["eos_id"] == eos and meta["vocab_size"] == tok.get_vocab_size(), "sidecar eos and vocabulary")
check(ids[-1] == eos and list(ids).count(eos) == 2, "one end-of-sequence id after each document")
cut = list(ids).index(eos)
decoded = [tok.decode(list(ids[:cut])), tok.decode(list(ids[cut + 1:-1]))]
check(decoded[0] == texts["a.txt"], "document a decodes to its text exactly")
check(decoded[1] == texts["b.txt"], "document b (multi-byte UTF-8, pieces cut at newlines) decodes exactly")
# A piece per file (no cuts): exactly the oracle's encoding of each file.
whole = os.path.join(work, "whole.bin")
r = run("--tokenizer", os.path.join(tok_dir, "tokenizer.json"), "--output", whole, "--format", "uint32",
        os.path.join(docs_dir, "b.txt"))
check(r.returncode == 0, "prepare with a tokenizer.json path and uint32")
w = array("I")
with open(whole, "rb") as f:
    w.frombytes(f.read())
check(list(w) == tok.encode(texts["b.txt"], add_special_tokens=False).ids + [eos],
      "uint32 ids equal the oracle's encoding of the whole file plus the end-of-sequence id")
check("config: \"data\"" in r.stdout and '"format": "uint32"' in r.stdout, "prints the config snippet")

# A model directory in the older GPT-2 layout (vocab.json + merges.txt + tokenizer_config.json,
# no tokenizer.json) goes through transformers' AutoTokenizer: the same ids as the tokenizer
# itself, and its end-of-sequence token from tokenizer_config.json.
slow_dir = os.path.join(work, "gpt2-layout")
os.makedirs(slow_dir)
tok.model.save(slow_dir)  # vocab.json, merges.txt
with open(os.path.join(slow_dir, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "eos_token": "<|endoftext|>",
               "bos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}, f)
slow_out = os.path.join(work, "slow.bin")
r = run("--tokenizer", slow_dir, "--output", slow_out, "--piece", "3000", docs_dir)
check(r.returncode == 0, f"prepare through AutoTokenizer (got {r.returncode}: {r.stderr.strip()[-300:]})")
check(os.path.exists(slow_out) and open(slow_out, "rb").read() == open(out, "rb").read(),
      "the GPT-2 file layout gives the same token file as tokenizer.json")

# One long line (no newline to cut after) of multi-byte characters, pieces of 1000 bytes: cut
# between whole UTF-8 characters, it still decodes to exactly the text; and a tokenizer saved
# with truncation and padding on still encodes every byte.
line_dir = os.path.join(work, "line")
os.makedirs(line_dir)
line = "ä€😀x" * 700  # 2-, 3-, 4- and 1-byte characters: most 1000-byte cuts fall inside one
with open(os.path.join(line_dir, "line.txt"), "w", encoding="utf-8") as f:
    f.write(line)
trunc = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
trunc.enable_truncation(max_length=8)
trunc.enable_padding(length=16)
trunc_dir = os.path.join(work, "trunc")
os.makedirs(trunc_dir)
trunc.save(os.path.join(trunc_dir, "tokenizer.json"))
line_out = os.path.join(work, "line.bin")
r = run("--tokenizer", trunc_dir, "--output", line_out, "--piece", "1000", line_dir)
check(r.returncode == 0, f"prepare of a single long line (got {r.returncode}: {r.stderr.strip()})")
li = array("H")
with open(line_out, "rb") as f:
    li.frombytes(f.read())
check(li[-1] == eos and tok.decode(list(li[:-1])) == line,
      "a line with no newline, cut between whole UTF-8 characters, decodes exactly (no truncation, no padding)")

# Bad input: clear error, nothing under the output's name changes, no temporary left.
before = open(out, "rb").read()
with open(os.path.join(docs_dir, "c.txt"), "wb") as f:
    f.write(b"fine text\n" * 500 + b"\xff\xfe broken\n")
r = run("--tokenizer", tok_dir, "--output", out, "--piece", "1000", docs_dir)
check(r.returncode == 1 and "c.txt: not UTF-8 text" in r.stderr and "at byte 5000" in r.stderr,
      f"a non-UTF-8 input is named with its byte offset (got {r.returncode}: {r.stderr.strip()})")
check(open(out, "rb").read() == before, "the earlier token file is untouched")
check(not os.path.exists(out + ".tmp"), "no temporary file is left behind")
os.unlink(os.path.join(docs_dir, "c.txt"))
r = run("--tokenizer", os.path.join(work, "missing"), "--output", out, docs_dir)
check(r.returncode == 1 and "no such file or directory" in r.stderr, "a missing tokenizer is named")
r = run("--tokenizer", tok_dir, "--output", out, os.path.join(work, "nothing-here"))
check(r.returncode == 1 and "nothing-here: no such file or directory" in r.stderr, "a missing input is named")
noeos = Tokenizer(models.BPE())
noeos.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
noeos.train(corpus[:1], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                            show_progress=False))
noeos.save(os.path.join(work, "noeos.json"))
r = run("--tokenizer", os.path.join(work, "noeos.json"), "--output", os.path.join(work, "x.bin"), docs_dir)
check(r.returncode == 1 and "--no-eos" in r.stderr, "a tokenizer without end-of-sequence asks for --no-eos")
r = run("--tokenizer", os.path.join(work, "noeos.json"), "--output", os.path.join(work, "x.bin"), "--no-eos", docs_dir)
check(r.returncode == 0, "--no-eos joins the documents")

# strata train reads it.
cfg = {"model": {"preset": "gpt2", "layers": 2, "hidden": 64, "heads": 4, "vocab_size": 512, "max_positions": 64,
                 "seed": 0},
       "data": {"path": out, "format": "uint16", "seq_len": 32, "seed": 0},
       "batch": {"micro_batch": 2, "grad_accum": 1}, "optimizer": {"lr": 0.001},
       "run": {"steps": 3, "progress": False, "log": os.path.join(work, "train.jsonl")}}
json.dump(cfg, open(os.path.join(work, "train.json"), "w"))
r = subprocess.run([strata, "train", "--config", os.path.join(work, "train.json")], capture_output=True, text=True)
check(r.returncode == 0, f"strata train on the token file (got {r.returncode}: {r.stderr[-400:]})")
rows = [json.loads(l) for l in open(os.path.join(work, "train.jsonl")) if '"step"' in l] if r.returncode == 0 else []
check(len(rows) == 3 and all(0 < x["loss"] < 20 for x in rows), f"three steps with finite losses: {rows}")
check(out in r.stderr, "the run names its data")

print(f"prepare_data: {checks[0] - len(failures)} passed, {len(failures)} failed")
sys.exit(1 if failures else 0)
