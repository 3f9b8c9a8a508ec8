#!/usr/bin/env python3
"""Tokenization throughput of `strata data prepare --chat`: the same Hub-style parquet dataset
prepared by 1 worker (the baseline: what one process does) and by N, in one run; the two outputs
must be byte-identical. Final JSON line: metric prepare_examples_per_s.

    bench/prepare_data_bench.py STRATA [--examples 20000] [--workers N] [--work DIR]

The tokenizer is a byte-level BPE of 32000 ids trained here on the system's license texts, with a
ChatML template; the conversations are 1-4 turns of those texts, a system prompt in 40%, written
as two parquet shards by pyarrow (data/train-0000k-of-00002.parquet)."""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("strata")
ap.add_argument("--examples", type=int, default=20000)
ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
ap.add_argument("--work", default="/tmp/strata-prepare-bench")
a = ap.parse_args()

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

shutil.rmtree(a.work, ignore_errors=True)
os.makedirs(os.path.join(a.work, "dataset", "data"))
licenses = "/usr/share/common-licenses"
corpus = [os.path.join(licenses, n) for n in sorted(os.listdir(licenses)) if os.path.isfile(os.path.join(licenses, n))]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train(corpus, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
tok_dir = os.path.join(a.work, "tokenizer")
hf.save_pretrained(tok_dir)

rng = random.Random(0)
words = " ".join(open(f, encoding="utf-8", errors="replace").read() for f in corpus).split()


def text():
    start = rng.randrange(len(words) - 200)
    return " ".join(words[start:start + rng.randint(5, 150)])


def conversation():
    msgs = [{"role": "system", "content": text()}] if rng.random() < 0.4 else []
    for _ in range(rng.randint(1, 4)):
        msgs += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
    return msgs


rows = [{"messages": conversation()} for _ in range(a.examples)]
half = len(rows) // 2
for k, part in enumerate((rows[:half], rows[half:])):
    pq.write_table(pa.Table.from_pylist(part), os.path.join(a.work, "dataset", "data", f"train-0000{k}-of-00002.parquet"))


def prepare(workers):
    out = os.path.join(a.work, f"w{workers}.sft")
    t0 = time.monotonic()
    r = subprocess.run([a.strata, "data", "prepare", "--chat", "--workers", str(workers), "--tokenizer", tok_dir,
                        "--output", out, os.path.join(a.work, "dataset")], capture_output=True, text=True,
                       env=dict(os.environ, STRATA_PYTHON=sys.executable))
    s = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"prepare with {workers} workers failed: {r.stderr.strip()}")
    print(f"{workers} worker(s): {a.examples} examples in {s:.1f} s ({a.examples / s:.0f} examples/s, the whole "
          f"command); {r.stdout.strip().splitlines()[0]}", flush=True)
    return a.examples / s, open(out, "rb").read()


one, one_bytes = prepare(1)
many, many_bytes = prepare(a.workers)
if one_bytes != many_bytes:
    sys.exit(f"{a.workers} workers wrote other bytes than 1 worker")
print(f"{a.workers} workers write the same bytes as 1")
print(json.dumps({"metric": "prepare_examples_per_s", "workers": a.workers, "examples": a.examples, "value": round(many, 1),
                  "baseline": "one worker", "baseline_value": round(one, 1), "ratio": round(many / one, 3)}))
