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
import os
import sys
import time
from array import array

# The modules beside this script (prepare_data_io.py: tokenizer and input readers, errors, the
# commit of an output; prepare_data_chat.py: --chat), however and from wherever it is run.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare_data_chat import prepare_chat  # noqa: E402
from prepare_data_io import commit, fail, input_files, load_tokenizer, pieces  # noqa: E402


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
