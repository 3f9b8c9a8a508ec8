#!/usr/bin/env python3
"""`strata data prepare` end to end, against Hugging Face `tokenizers` as the oracle.

A byte-level BPE tokenizer is trained here, offline, on the license texts; two documents (one
ASCII, one with multi-byte UTF-8 and no final newline) are tokenized in small pieces; the token
file must decode back to exactly the documents, with one end-of-sequence id after each, the
sidecar must agree with it, and `strata train` must train on it. Failures leave no file behind
and an earlier output untouched. --chat (supervised fine-tuning examples) is checked against a
hand-rendered ChatML oracle, with and without {% generation %} blocks, against a word-level
tokenizer without a template, and on malformed lines.

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

# --chat: supervised fine-tuning examples (safetensors). The oracle renders ChatML by hand, keeps
# the character spans of the assistant turns (content + "<|im_end|>\n") and maps them to tokens
# through the `tokenizers` offsets; transformers' apply_chat_template must give the same ids.
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402


def load_sft(path):
    """The tensors and metadata, after checking what models/src/token_data.cc SftExamples requires."""
    t = load_file(path)
    with safe_open(path, "np") as f:
        md = f.metadata()
    check(sorted(t) == ["loss_mask", "offsets", "tokens"], f"{path}: exactly tokens, loss_mask, offsets ({sorted(t)})")
    tokens, mask, offsets = t["tokens"], t["loss_mask"], t["offsets"]
    check(tokens.dtype.str == "<i4" and mask.dtype.str == "|u1" and offsets.dtype.str == "<i8",
          f"{path}: dtypes I32, U8, I64 ({tokens.dtype}, {mask.dtype}, {offsets.dtype})")
    check(tokens.ndim == mask.ndim == offsets.ndim == 1 and len(mask) == len(tokens), f"{path}: 1-D, mask as long as tokens")
    check(offsets[0] == 0 and offsets[-1] == len(tokens) and all(offsets[1:] > offsets[:-1]),
          f"{path}: offsets increase strictly from 0 to n")
    check(set(mask.tolist()) <= {0, 1}, f"{path}: mask values 0 and 1")
    check(md.get("format") == "strata-sft-1" and md.get("examples") == str(len(offsets) - 1),
          f"{path}: metadata format and example count ({md})")
    return [(tokens[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])], md


chat_tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
chat_tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer(name, template, in_config=False):
    """A transformers model directory: the template in chat_template.jinja (transformers 5's
    layout) or, in_config, in tokenizer_config.json (transformers 4's)."""
    d = os.path.join(work, name)
    hf = PreTrainedTokenizerFast(tokenizer_object=chat_tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = template
    hf.save_pretrained(d)
    if in_config:
        os.unlink(os.path.join(d, "chat_template.jinja"))
        cfg = json.load(open(os.path.join(d, "tokenizer_config.json")))
        cfg["chat_template"] = template
        json.dump(cfg, open(os.path.join(d, "tokenizer_config.json"), "w"))
    return d


chat_dir = chat_tokenizer("chatml", chatml)
# The same template with {% generation %} blocks: transformers' own assistant mask.
gen_dir = chat_tokenizer("chatml-generation", chatml.replace(
    "{{ m['content'] }}<|im_end|>\n",
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"), in_config=True)
convs = [
    {"prompt": "What is the GNU General Public License?", "response": "A free software license."},
    {"id": 7, "messages": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Can I copy it?"},
        {"role": "assistant", "content": " Yes: verbatim copies are allowed.\n\nSee section 4."},
        {"role": "user", "content": "Et les modifications — naïve question 🙂?"},
        {"role": "assistant", "content": "Oui, sous conditions (section 5) — 日本語も。"}]},
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                  {"role": "user", "content": "a last question, unanswered"}]},
]
chats = os.path.join(work, "chats")
os.makedirs(chats)
with open(os.path.join(chats, "a.jsonl"), "w", encoding="utf-8") as f:
    f.write(json.dumps(convs[0]) + "\n\n   \n" + json.dumps(convs[1], ensure_ascii=False) + "\n")
with open(os.path.join(chats, "b.jsonl"), "w", encoding="utf-8") as f:
    f.write(json.dumps(convs[2]))  # no final newline
hf_chat = AutoTokenizer.from_pretrained(chat_dir)
sft = os.path.join(work, "out", "train.sft")
r = run("--chat", "--tokenizer", chat_dir, "--output", sft, chats)
check(r.returncode == 0, f"--chat with a chat template exits 0 (got {r.returncode}: {r.stderr.strip()[-400:]})")
got, md = load_sft(sft) if r.returncode == 0 else ([], {})
check(len(got) == 3 and md.get("tokenizer") == os.path.abspath(chat_dir), f"three examples, the tokenizer named ({md})")
total_loss = 0
for k, (conv, (ids, mask)) in enumerate(zip(convs, got)):
    msgs = conv.get("messages") or [{"role": "user", "content": conv["prompt"]},
                                    {"role": "assistant", "content": conv["response"]}]
    text, spans = "", []
    for m in msgs:
        text += f"<|im_start|>{m['role']}\n"
        start = len(text)
        text += m["content"] + "<|im_end|>\n"
        if m["role"] == "assistant":
            spans.append((start, len(text)))
    check(hf_chat.apply_chat_template(msgs, tokenize=False) == text, f"example {k}: the hand-made ChatML is the template's")
    enc = chat_tok.encode(text, add_special_tokens=False)
    inside = [any(a <= s and e <= b for a, b in spans) for s, e in enc.offsets]
    check(all(i or not any(s < b and a < e for a, b in spans) for i, (s, e) in zip(inside, enc.offsets)),
          f"example {k}: no token straddles an assistant turn's edge (the oracle is well defined)")
    check(ids == enc.ids, f"example {k}: tokens are the encoding of the rendered conversation")
    check(ids == list(hf_chat.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]),
          f"example {k}: tokens are apply_chat_template's ids")
    check(mask == [int(i) for i in inside], f"example {k}: loss mask is exactly the assistant turns' tokens")
    answers = "".join(m["content"] + "<|im_end|>\n" for m in msgs if m["role"] == "assistant")
    check(chat_tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False) == answers,
          f"example {k}: the tokens in the loss decode to the responses and their <|im_end|>\\n")
    total_loss += sum(mask)
side = json.load(open(sft + ".json")) if r.returncode == 0 else {}
check(side.get("format") == "sft" and side.get("examples") == 3 and side.get("loss_tokens") == total_loss
      and side.get("tokens") == sum(len(i) for i, _ in got), f"the sidecar counts examples, tokens and loss tokens ({side})")
check('"format": "sft"' in r.stdout and "3 examples" in r.stdout, f"prints the summary and config ({r.stdout.strip()})")
lengths = sorted(len(i) for i, _ in got)
r = run("--chat", "--tokenizer", gen_dir, "--output", os.path.join(work, "gen.sft"), "--max-tokens", str(lengths[0]), chats)
check(r.returncode == 0 and f"2 of 3 examples are longer than --max-tokens {lengths[0]}" in r.stdout,
      f"--max-tokens reports the longer examples and keeps them (got {r.returncode}: {r.stdout.strip()} {r.stderr.strip()[-300:]})")
gen = load_sft(os.path.join(work, "gen.sft"))[0] if r.returncode == 0 else []
check(gen == got, "a template with {% generation %} blocks (in tokenizer_config.json) gives the same examples")

# No template: [bos] + prompt + response + eos, the response and eos in the loss. A word-level
# tokenizer, so the oracle is the vocabulary itself.
words = "<unk> <s> </s> what is free software ? it respects users freedom . a b".split()
vocab = {w: i for i, w in enumerate(words)}
wl = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
wl.pre_tokenizer = pre_tokenizers.Whitespace()
plain_dir = os.path.join(work, "wordlevel")
os.makedirs(plain_dir)
wl.save(os.path.join(plain_dir, "tokenizer.json"))
json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True},
          open(os.path.join(plain_dir, "tokenizer_config.json"), "w"))
plain = [("what is free software ?", "it respects users freedom ."), ("a b", "b unknownword a")]
with open(os.path.join(work, "plain.jsonl"), "w") as f:
    f.write(json.dumps({"prompt": plain[0][0], "response": plain[0][1]}) + "\n")
    f.write(json.dumps({"messages": [{"role": "user", "content": plain[1][0]},
                                     {"role": "assistant", "content": plain[1][1]}]}) + "\n")
r = run("--chat", "--tokenizer", plain_dir, "--output", os.path.join(work, "plain.sft"), os.path.join(work, "plain.jsonl"))
check(r.returncode == 0, f"--chat without a template exits 0 (got {r.returncode}: {r.stderr.strip()[-300:]})")
got = load_sft(os.path.join(work, "plain.sft"))[0] if r.returncode == 0 else []
want = []
for p, a in plain:
    pi, ai = [vocab.get(w, 0) for w in p.split()], [vocab.get(w, 0) for w in a.split()]
    want.append(([vocab["<s>"]] + pi + ai + [vocab["</s>"]], [0] * (1 + len(pi)) + [1] * (len(ai) + 1)))
check(got == want, f"bos + prompt + response + eos, the response and eos in the loss: {got} vs {want}")
# --no-template on the ChatML tokenizer: its eos (<|im_end|>), no bos (none configured).
r = run("--chat", "--no-template", "--tokenizer", chat_dir, "--output", os.path.join(work, "nt.sft"),
        os.path.join(chats, "a.jsonl"))
check(r.returncode == 1 and "a.jsonl:4: 5 messages" in r.stderr and "need a chat template" in r.stderr,
      f"--no-template refuses a multi-turn conversation, naming its line (got {r.returncode}: {r.stderr.strip()})")
one = os.path.join(work, "one.jsonl")
with open(one, "w") as f:
    f.write(json.dumps(convs[0]) + "\n")
r = run("--chat", "--no-template", "--tokenizer", chat_dir, "--output", os.path.join(work, "nt.sft"), one)
p, a = (chat_tok.encode(convs[0][k], add_special_tokens=False).ids for k in ("prompt", "response"))
got = load_sft(os.path.join(work, "nt.sft"))[0] if r.returncode == 0 else []
check(got == [(p + a + [chat_tok.token_to_id("<|im_end|>")], [0] * len(p) + [1] * (len(a) + 1))],
      f"--no-template: prompt + response + <|im_end|> (got {r.returncode}: {r.stderr.strip()[-300:]})")

# Bad examples: one line naming FILE:LINE and what is wrong; the earlier output stays, no temporary.
before = open(sft, "rb").read()
bad = os.path.join(work, "bad.jsonl")
cases = [
    (plain_dir, ['{"prompt": "a", "response": "b"}', '{"prompt": "a", "response": '], "bad.jsonl:2: not JSON"),
    (plain_dir, ['[1, 2]'], "bad.jsonl:1: not a JSON object"),
    (plain_dir, ['{"prompt": "a"}'], 'bad.jsonl:1: no schema fits its columns (prompt)'),
    (plain_dir, ['{"text": "a"}'], 'bad.jsonl:1: no schema fits its columns (text)'),
    (plain_dir, ['', '{"messages": [{"role": "user", "content": "a"}]}'], "bad.jsonl:2: no assistant message"),
    (chat_dir, ['{"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}'],
     'bad.jsonl:1: message 2 (tool) follows a user message: the roles must alternate'),
    (chat_dir, ['{"messages": [{"role": "user", "content": "a"}, {"role": "narrator", "content": "b"}]}'],
     'bad.jsonl:1: message 2 has role "narrator": expected one of system, user, assistant, tool'),
    (chat_dir, ['{"messages": [{"role": "user", "content": [{"type": "text"}]}, {"role": "assistant", "content": "b"}]}'],
     'bad.jsonl:1: message 1 (user) "content" must be a string, not list'),
    (chat_dir, ['{"prompt": "a", "response": ""}'], 'bad.jsonl:1: "response" is empty'),
    (plain_dir, ['{"prompt": "a", "response": "  \\t "}'], "bad.jsonl:1: the response tokenizes to no tokens"),
    (plain_dir, [json.dumps(convs[1])], "bad.jsonl:1: 5 messages (system, user, assistant, user, assistant) need a chat template"),
    # A template that drops earlier answers (as reasoning templates drop earlier thoughts) breaks
    # the prefix property the incremental loss mask rests on.
    (chat_tokenizer("drops-answers", chatml.replace(
        "{{ m['content'] }}", "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}")),
     [json.dumps(convs[1])], "bad.jsonl:1: the chat template breaks the prefix property"),
]
for tok_path, lines, want in cases:
    with open(bad, "w") as f:
        f.write("\n".join(lines) + "\n")
    r = run("--chat", "--tokenizer", tok_path, "--output", sft, bad)
    check(r.returncode == 1 and want in r.stderr and r.stderr.strip().count("\n") == 0,
          f"error {want!r} (got {r.returncode}: {r.stderr.strip()[-300:]})")
check(open(sft, "rb").read() == before and not [n for n in os.listdir(work) if ".tmp" in n],
      "failed --chat runs leave the earlier file and no temporary")
r = run("--chat", "--no-eos", "--tokenizer", chat_dir, "--output", sft, chats)
check(r.returncode == 1 and "--no-eos does not apply to --chat" in r.stderr, "--no-eos is refused with --chat")
r = run("--max-tokens", "8", "--tokenizer", tok_dir, "--output", out, docs_dir)
check(r.returncode == 1 and "--max-tokens needs --chat" in r.stderr, "--max-tokens is refused without --chat")

print(f"prepare_data: {checks[0] - len(failures)} passed, {len(failures)} failed")
sys.exit(1 if failures else 0)
