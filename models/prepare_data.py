#!/usr/bin/env python3
"""Tokenizes text files into the flat token-id files `strata train` reads (data.format "uint16"
or "uint32"), or, with --chat, conversations into supervised fine-tuning examples (data.format
"sft"), with the Hugging Face tokenizer of the model being fine-tuned.

    strata data prepare --tokenizer MODEL_DIR --output train.bin corpus/ more.txt
    strata data prepare --chat --tokenizer MODEL_DIR --output train.sft chats.jsonl

The token file is what models/include/strata/models/token_data.h reads: token ids back to back,
2 or 4 bytes each in host byte order, no header. Each input file is one document: its ids are
followed by the tokenizer's end-of-sequence id (unless --no-eos), so that windows spanning two
documents see the boundary the model was trained with. A file larger than --piece is encoded in
pieces cut after a newline (after a whole UTF-8 character where a piece has no newline): the ids
can differ from encoding the whole file at once only at a cut, where a token would have spanned
it, or, with tokenizers that prepend a space marker to every text they encode (SentencePiece
"Metaspace" ones such as Llama 2's), by one such marker per cut. The tokenizer's saved
truncation and padding are turned off: every byte of text is encoded.

Beside the token file a sidecar OUTPUT.json records the tokenizer, the format, the token count and
the inputs. Both are written to temporary names and renamed when complete, so an interrupted run
leaves no partial file under the final name. Memory: about one piece of text and its ids at a time.

Errors (exit 1, one line naming what failed): an input that does not exist or is not UTF-8, a
tokenizer that cannot be loaded or has no end-of-sequence token (without --no-eos), an id that
does not fit the chosen format, no text at all.

--chat: the inputs are JSONL files (directories: their regular files, in name order), one example
a line, {"prompt": "...", "response": "..."} or {"messages": [{"role": "system" | "user" |
"assistant", "content": "..."}, ...]} (a prompt and response are the messages [user: prompt,
assistant: response]; other keys are ignored); blank lines are skipped. The output is a
safetensors file (docs/FORMATS.md, read by models/token_data.h SftExamples): "tokens" (I32 [n],
every example's ids back to back), "loss_mask" (U8 [n], 1 on the tokens the loss learns: the
assistant turns) and "offsets" (I64 [examples + 1]: example e is tokens[offsets[e]:offsets[e+1]]),
metadata {"format": "strata-sft-1", "tokenizer": path, "examples": count}; its sidecar adds the
example and loss-token counts. With a chat template (MODEL_DIR's tokenizer_config.json
"chat_template", chat_template.jinja or chat_template.json) an example's ids are transformers'
apply_chat_template of its messages, and its loss mask comes from the template's
{% generation %} blocks where it has them, otherwise from rendering the conversation
incrementally: for assistant message i, the ids of messages[:i] with add_generation_prompt=True
must be a prefix of the ids of messages[:i+1], which must be a prefix of the whole
conversation's, and the tokens between the two (the response and the template's end-of-turn
tokens, such as <|im_end|>\n or <|eot_id|>) are in the loss. Without a template, or with
--no-template, an example is one user and one assistant message: [bos, where the tokenizer
config has bos_token and add_bos_token] + ids(prompt) + ids(response) + [eos], the response and
eos in the loss. Every example is kept whole (training cuts one longer than data.seq_len + 1
tokens); --max-tokens N only reports how many are longer than N. Memory: the whole output, about
5 bytes a token. Errors name FILE:LINE: not UTF-8 or not JSON, a missing or ill-typed key, a role
other than system/user/assistant, empty content, no assistant message, a response that
tokenizes to no tokens, a template that rejects the conversation or breaks the prefix property,
more than one prompt and response without a chat template.
"""
import argparse
import json
import os
import re
import sys
import time
from array import array


def fail(msg):
    print(f"strata data prepare: error: {msg}", file=sys.stderr)
    sys.exit(1)


def commit(tmp, output, meta):
    """Renames the finished `tmp` to `output` and writes its sidecar OUTPUT.json beside it, each
    complete under its final name or not there."""
    with open(output + ".json.tmp", "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    os.replace(tmp, output)
    os.replace(output + ".json.tmp", output + ".json")


def load_tokenizer(path):
    """A `tokenizers.Tokenizer` (no truncation, no padding), its end-of-sequence id (None if it
    has none) and its vocabulary size."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        fail(f"the Python package 'tokenizers' is missing ({e}): run with Strata's environment "
             "(scripts/setup.sh creates it; `strata data prepare` uses it)")

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if os.path.isfile(file):
        try:
            tok = Tokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001 (any parse failure is reported the same way)
            fail(f"tokenizer {file}: cannot be loaded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        tok.no_truncation()
        tok.no_padding()
        eos = None
        cfg = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        if os.path.isfile(cfg):
            eos_tok = json.load(open(cfg)).get("eos_token")
            if isinstance(eos_tok, dict):
                eos_tok = eos_tok.get("content")
            if eos_tok is not None:
                eos = tok.token_to_id(eos_tok)
        if eos is None:
            for name in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"):
                if tok.token_to_id(name) is not None:
                    eos = tok.token_to_id(name)
                    break
        return tok, eos, tok.get_vocab_size(with_added_tokens=True)
    if not os.path.isdir(path):
        fail(f"tokenizer {path}: no such file or directory")
    # A model directory with only the slow tokenizer's files (vocab.json + merges.txt, or a
    # sentencepiece model): transformers converts it to a fast one.
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(path, local_files_only=True, use_fast=True)
    except Exception as e:  # noqa: BLE001 (any loader failure is reported the same way)
        fail(f"tokenizer {path}: cannot be loaded ({type(e).__name__}: {str(e).splitlines()[0]})")
    if not getattr(hf, "is_fast", False):
        fail(f"tokenizer {path}: transformers gave no fast tokenizer")
    tok = hf.backend_tokenizer
    tok.no_truncation()
    tok.no_padding()
    return tok, hf.eos_token_id, len(hf)


def input_files(paths):
    files = []
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, names in os.walk(p):
                dirs.sort()
                files += [os.path.join(root, n) for n in sorted(names) if os.path.isfile(os.path.join(root, n))]
        elif os.path.isfile(p):
            files.append(p)
        else:
            fail(f"input {p}: no such file or directory")
    return files


def utf8_boundary(data):
    """The largest n <= len(data) such that data[:n] ends on a whole UTF-8 character."""
    n = len(data)
    back = 0
    while back < 4 and n - back > 0 and (data[n - back - 1] & 0xC0) == 0x80:
        back += 1  # continuation bytes
    if n - back > 0:
        lead = data[n - back - 1]
        need = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
        if back + 1 < need:
            return n - back - 1  # the last character is incomplete: cut before its lead byte
    return n


def pieces(path, piece_bytes):
    """The file's bytes in pieces of about piece_bytes: each cut after its last newline, or, with
    none, after its last whole UTF-8 character; every byte read once and copied about once."""
    with open(path, "rb") as f:
        pending = b""
        while True:
            block = f.read(max(piece_bytes - len(pending), 1))
            if not block:
                break
            data = pending + block
            if len(data) < piece_bytes:
                pending = data
                continue
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                cut = utf8_boundary(data) or len(data)  # undecodable bytes are reported later
            yield data[:cut]
            pending = data[cut:]
        if pending:
            yield pending


ROLES = ("system", "user", "assistant")


def tokenizer_config(path):
    """tokenizer_config.json beside the tokenizer ({} where there is none or it is not JSON)."""
    cfg = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), "tokenizer_config.json")
    try:
        with open(cfg, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def has_chat_template(path):
    """Whether the model directory stores a chat template (transformers 4 keeps it in
    tokenizer_config.json, transformers 5 in chat_template.jinja)."""
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, "chat_template.jinja")) or tokenizer_config(path).get("chat_template"):
        return True
    try:
        with open(os.path.join(path, "chat_template.json"), encoding="utf-8") as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def first_line(e):
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def parse_example(line, where):
    """The messages of one JSONL line, [{"role", "content"}, ...], checked."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        fail(f"{where}: not JSON ({getattr(e, 'msg', e)} at column {getattr(e, 'colno', '?')})")
    if not isinstance(obj, dict):
        fail(f"{where}: not a JSON object but {type(obj).__name__}")

    def text(value, what):
        if not isinstance(value, str):
            fail(f"{where}: {what} must be a string, not {type(value).__name__}")
        if not value:
            fail(f"{where}: {what} is empty")
        return value

    if "messages" in obj:
        if "prompt" in obj or "response" in obj:
            fail(f'{where}: has both "messages" and "prompt"/"response" (one form per line)')
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            fail(f'{where}: "messages" must be a non-empty list of messages')
        out = []
        for i, m in enumerate(msgs, 1):
            if not isinstance(m, dict):
                fail(f"{where}: message {i} is not an object but {type(m).__name__}")
            for key in ("role", "content"):
                if key not in m:
                    fail(f'{where}: message {i} has no "{key}"')
            if m["role"] not in ROLES:
                fail(f"{where}: message {i} has role {json.dumps(m['role'])} (system, user or assistant)")
            out.append({"role": m["role"], "content": text(m["content"], f'message {i} ({m["role"]}) "content"')})
        if not any(m["role"] == "assistant" for m in out):
            fail(f"{where}: no assistant message (nothing to learn)")
        return out
    if "prompt" in obj or "response" in obj:
        for key in ("prompt", "response"):
            if key not in obj:
                fail(f'{where}: has no "{key}"')
        return [{"role": "user", "content": text(obj["prompt"], '"prompt"')},
                {"role": "assistant", "content": text(obj["response"], '"response"')}]
    fail(f'{where}: needs "messages", or "prompt" and "response"')


class TemplateFormat:
    """Examples through the tokenizer's chat template (transformers' apply_chat_template)."""

    def __init__(self, path):
        try:
            from transformers import AutoTokenizer

            self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
            template = self.hf.get_chat_template()
        except Exception as e:  # noqa: BLE001 (any loader failure is reported the same way)
            fail(f"tokenizer {path}: cannot be loaded with its chat template ({first_line(e)})")
        # {% generation %} ... {% endgeneration %} marks what the assistant writes: transformers
        # turns it into the mask itself (it needs a fast tokenizer's offsets).
        marked = re.search(r"\{%-?\s*generation\s*-?%\}", template)
        self.generation = bool(marked) and getattr(self.hf, "is_fast", False)
        self.vocab = len(self.hf)
        self.name = "chat template" + (" (generation blocks)" if self.generation else "")

    def render(self, msgs, where, **kw):
        try:
            return self.hf.apply_chat_template(msgs, tokenize=True, return_dict=True, **kw)
        except Exception as e:  # noqa: BLE001 (templates raise what they like, e.g. on role order)
            fail(f"{where}: the chat template rejects the conversation ({first_line(e)})")

    def example(self, msgs, where):
        for i, m in enumerate(msgs, 1):
            if m["role"] == "assistant" and not self.hf.encode(m["content"], add_special_tokens=False):
                fail(f"{where}: message {i} (assistant) tokenizes to no tokens")
        if self.generation:
            out = self.render(msgs, where, return_assistant_tokens_mask=True)
            return list(out["input_ids"]), list(out["assistant_masks"])
        ids = list(self.render(msgs, where)["input_ids"])
        mask = [0] * len(ids)
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            if i == 0:
                fail(f"{where}: message 1 is the assistant's: a conversation starts with a system or user message")
            prefix = list(self.render(msgs[:i], where, add_generation_prompt=True)["input_ids"])
            turn = ids if i + 1 == len(msgs) else list(self.render(msgs[:i + 1], where)["input_ids"])
            for a, b, what in ((prefix, turn, f"messages 1-{i} with the generation prompt are not a prefix of "
                                              f"messages 1-{i + 1}"),
                               (turn, ids, f"messages 1-{i + 1} are not a prefix of the whole conversation")):
                if b[:len(a)] != a:
                    at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    fail(f"{where}: the chat template breaks the prefix property the loss mask needs: {what} "
                         f"(they differ from token {at}); give the template {{% generation %}} blocks, or --no-template")
            if len(turn) == len(prefix):
                fail(f"{where}: message {i + 1} (assistant) adds no tokens to the conversation")
            mask[len(prefix):len(turn)] = [1] * (len(turn) - len(prefix))
        return ids, mask


class PlainFormat:
    """[bos] + ids(prompt) + ids(response) + [eos], the response and eos in the loss."""

    def __init__(self, path, has_template):
        self.tok, self.eos, self.vocab = load_tokenizer(path)
        if self.eos is None:
            fail(f"tokenizer {path} has no end-of-sequence token, which ends each response without a chat template")
        cfg = tokenizer_config(path)
        bos = cfg.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        self.bos = self.tok.token_to_id(bos) if bos and cfg.get("add_bos_token") else None
        if bos and cfg.get("add_bos_token") and self.bos is None:
            fail(f"tokenizer {path}: its bos_token {bos!r} is not in the vocabulary")
        self.why = "--no-template formats" if has_template else f"tokenizer {path} has no chat template, which formats"
        self.name = "plain"

    def example(self, msgs, where):
        if [m["role"] for m in msgs] != ["user", "assistant"]:
            fail(f"{where}: {len(msgs)} messages ({', '.join(m['role'] for m in msgs)}) need a chat template: "
                 f"{self.why} only a prompt and a response")
        prompt = self.tok.encode(msgs[0]["content"], add_special_tokens=False).ids
        response = self.tok.encode(msgs[1]["content"], add_special_tokens=False).ids
        if not response:
            fail(f"{where}: the response tokenizes to no tokens")
        head = ([self.bos] if self.bos is not None else []) + prompt
        return head + response + [self.eos], [0] * len(head) + [1] * (len(response) + 1)


def prepare_chat(a):
    try:
        import numpy as np
        from safetensors.numpy import save_file
    except ImportError as e:
        fail(f"a Python package is missing ({e}): run with Strata's environment "
             "(scripts/setup.sh creates it; `strata data prepare --chat` uses numpy and safetensors)")
    template = has_chat_template(a.tokenizer)
    fmt = TemplateFormat(a.tokenizer) if template and not a.no_template else PlainFormat(a.tokenizer, template)
    if fmt.vocab > 1 << 31:
        fail(f"a vocabulary of {fmt.vocab} ids does not fit int32")
    files = input_files(a.inputs)
    total = sum(os.path.getsize(f) for f in files)

    tokens, mask, offsets = array("i"), array("B"), array("q", [0])
    if tokens.itemsize != 4 or offsets.itemsize != 8:
        fail("this Python has no int32/int64 array type")
    tty = sys.stderr.isatty()
    done_bytes, loss_tokens, longest, over, t0, shown = 0, 0, 0, 0, time.monotonic(), False
    last = t0
    for path in files:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                done_bytes += len(raw)
                where = f"{path}:{number}"
                try:
                    line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    fail(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of the line)")
                if not line.strip():
                    continue
                ids, m = fmt.example(parse_example(line, where), where)
                if not any(m[1:]):  # target j is token j + 1: a first token in the loss is no target
                    fail(f"{where}: no token is in the loss (the assistant turns give no target)")
                tokens.extend(ids)
                mask.extend(m)
                offsets.append(len(tokens))
                loss_tokens += sum(m)
                longest = max(longest, len(ids))
                over += a.max_tokens is not None and len(ids) > a.max_tokens
                now = time.monotonic()
                if now - last > (0.2 if tty else 10.0):
                    last, shown = now, True
                    msg = (f"prepared {done_bytes * 100 // max(total, 1)}% ({len(offsets) - 1} examples, "
                           f"{len(tokens)} tokens, {loss_tokens} in the loss)")
                    print(("\r" + msg) if tty else msg, end="" if tty else "\n", file=sys.stderr, flush=True)
    if tty and shown:
        print(file=sys.stderr)
    examples = len(offsets) - 1
    if examples == 0:
        fail("the inputs hold no examples")
    if max(tokens) >= fmt.vocab:
        fail(f"token id {max(tokens)} is outside the tokenizer's vocabulary of {fmt.vocab}")

    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    tmp = a.output + ".tmp"
    try:
        save_file({"tokens": np.frombuffer(tokens, dtype=np.int32),
                   "loss_mask": np.frombuffer(mask, dtype=np.uint8),
                   "offsets": np.frombuffer(offsets, dtype=np.int64)},
                  tmp, metadata={"format": "strata-sft-1", "tokenizer": os.path.abspath(a.tokenizer),
                                 "examples": str(examples)})
        with open(tmp, "rb+") as out:
            os.fsync(out.fileno())
    except BaseException:  # failed or interrupted: no partial file stays behind
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    meta = {
        "format": "sft",
        "examples": examples,
        "tokens": len(tokens),
        "loss_tokens": loss_tokens,
        "longest_example": longest,
        "vocab_size": fmt.vocab,
        "formatting": fmt.name,
        "tokenizer": os.path.abspath(a.tokenizer),
        "inputs": [os.path.abspath(f) for f in files],
        "text_bytes": total,
    }
    if a.max_tokens is not None:
        meta["max_tokens"] = a.max_tokens
        meta["longer_than_max_tokens"] = over
    commit(tmp, a.output, meta)
    s = time.monotonic() - t0
    print(f"wrote {a.output}: {examples} examples, {len(tokens)} tokens ({loss_tokens} in the loss, longest example "
          f"{longest}) with the {fmt.name} formatting from {len(files)} file(s), {total} bytes, in {s:.1f} s")
    if a.max_tokens is not None:
        print(f"{over} of {examples} examples are longer than --max-tokens {a.max_tokens} tokens (kept whole here; "
              "training cuts an example at data.seq_len + 1 tokens)")
    print(f'config: "data": {{"path": "{a.output}", "format": "sft"}} (model.vocab_size >= {fmt.vocab})')


def main():
    ap = argparse.ArgumentParser(prog="strata data prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+",
                    help="text files (with --chat: JSONL files) or directories (their regular files, in name order)")
    ap.add_argument("--tokenizer", required=True, help="Hugging Face model directory or tokenizer.json")
    ap.add_argument("--output", required=True, help="token file to write (e.g. train.bin; with --chat: train.sft)")
    ap.add_argument("--format", choices=["auto", "uint16", "uint32"], default="auto",
                    help="id width; auto: uint16 when every id of the vocabulary fits")
    ap.add_argument("--no-eos", action="store_true", help="no end-of-sequence id after each file")
    ap.add_argument("--piece", type=int, help="bytes of text encoded at once (default 1 MiB)")
    ap.add_argument("--chat", action="store_true",
                    help="supervised fine-tuning examples (safetensors, data.format sft) from JSONL conversations")
    ap.add_argument("--no-template", action="store_true",
                    help="with --chat: prompt + response + eos even where the tokenizer has a chat template")
    ap.add_argument("--max-tokens", type=int,
                    help="with --chat: report how many examples are longer than this (none is dropped)")
    a = ap.parse_args()
    if a.chat:
        for given, flag in ((a.format != "auto", "--format"), (a.no_eos, "--no-eos"), (a.piece is not None, "--piece")):
            if given:
                fail(f"{flag} does not apply to --chat")
        if a.max_tokens is not None and a.max_tokens < 1:
            fail("--max-tokens must be >= 1")
        return prepare_chat(a)
    for given, flag in ((a.no_template, "--no-template"), (a.max_tokens is not None, "--max-tokens")):
        if given:
            fail(f"{flag} needs --chat")
    if a.piece is None:
        a.piece = 1 << 20
    if a.piece < 1:
        fail("--piece must be >= 1")

    tok, eos, vocab = load_tokenizer(a.tokenizer)
    if not a.no_eos and eos is None:
        fail(f"tokenizer {a.tokenizer} has no end-of-sequence token: give --no-eos to join files without one")
    fmt = a.format if a.format != "auto" else ("uint16" if vocab <= 1 << 16 else "uint32")
    limit = 1 << (16 if fmt == "uint16" else 32)
    if not a.no_eos and eos >= limit:
        fail(f"the end-of-sequence id {eos} does not fit {fmt}")
    typecode = "H" if fmt == "uint16" else "I"
    if array(typecode).itemsize != (2 if fmt == "uint16" else 4):
        fail(f"this Python has no {fmt} array type")
    files = input_files(a.inputs)
    total = sum(os.path.getsize(f) for f in files)
    if total == 0:
        fail("the inputs hold no text")

    out_dir = os.path.dirname(os.path.abspath(a.output))
    os.makedirs(out_dir, exist_ok=True)
    tmp = a.output + ".tmp"
    tty = sys.stderr.isatty()
    done_bytes, tokens, t0, last = 0, 0, time.monotonic(), 0.0
    try:
        with open(tmp, "wb") as out:
            for path in files:
                file_bytes = 0
                for piece in pieces(path, a.piece):
                    try:
                        text = piece.decode("utf-8")
                    except UnicodeDecodeError as e:
                        fail(f"input {path}: not UTF-8 text ({e.reason} at byte {file_bytes + e.start} of the file)")
                    ids = tok.encode(text, add_special_tokens=False).ids
                    if ids and max(ids) >= limit:
                        fail(f"input {path}: token id {max(ids)} does not fit {fmt}")
                    array(typecode, ids).tofile(out)
                    tokens += len(ids)
                    done_bytes += len(piece)
                    file_bytes += len(piece)
                    now = time.monotonic()
                    if now - last > (0.2 if tty else 10.0):
                        last = now
                        rate = done_bytes / max(now - t0, 1e-9) / 1e6
                        msg = f"tokenized {done_bytes * 100 // total}% ({done_bytes}/{total} bytes, {tokens} tokens, {rate:.1f} MB/s)"
                        print(("\r" + msg) if tty else msg, end="" if tty else "\n", file=sys.stderr, flush=True)
                if not a.no_eos:
                    array(typecode, [eos]).tofile(out)
                    tokens += 1
            out.flush()
            os.fsync(out.fileno())
    except BaseException:  # failed or interrupted: no partial file stays behind
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if tty:
        print(file=sys.stderr)
    if tokens == 0:
        os.unlink(tmp)
        fail("the inputs gave no tokens")
    meta = {
        "format": fmt,
        "tokens": tokens,
        "vocab_size": vocab,
        "eos_id": None if a.no_eos else eos,
        "tokenizer": os.path.abspath(a.tokenizer),
        "inputs": [os.path.abspath(f) for f in files],
        "text_bytes": total,
    }
    commit(tmp, a.output, meta)
    s = time.monotonic() - t0
    print(f"wrote {a.output}: {tokens} tokens ({fmt}) from {len(files)} file(s), {total} bytes of text in {s:.1f} s")
    print(f'config: "data": {{"path": "{a.output}", "format": "{fmt}"}} (model.vocab_size >= {vocab})')


if __name__ == "__main__":
    main()
