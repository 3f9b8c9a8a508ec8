#!/usr/bin/env python3
"""Tokenizes text files into the flat token-id files `strata train` reads (data.format "uint16"
or "uint32"), with the Hugging Face tokenizer of the model being fine-tuned.

    strata data prepare --tokenizer MODEL_DIR --output train.bin corpus/ more.txt

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
"""
import argparse
import json
import os
import sys
import time
from array import array


def fail(msg):
    print(f"strata data prepare: error: {msg}", file=sys.stderr)
    sys.exit(1)


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


def main():
    ap = argparse.ArgumentParser(prog="strata data prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="text files or directories (their regular files, in name order)")
    ap.add_argument("--tokenizer", required=True, help="Hugging Face model directory or tokenizer.json")
    ap.add_argument("--output", required=True, help="token file to write (e.g. train.bin)")
    ap.add_argument("--format", choices=["auto", "uint16", "uint32"], default="auto",
                    help="id width; auto: uint16 when every id of the vocabulary fits")
    ap.add_argument("--no-eos", action="store_true", help="no end-of-sequence id after each file")
    ap.add_argument("--piece", type=int, default=1 << 20, help="bytes of text encoded at once (default 1 MiB)")
    a = ap.parse_args()
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
    with open(a.output + ".json.tmp", "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    os.replace(tmp, a.output)
    os.replace(a.output + ".json.tmp", a.output + ".json")
    s = time.monotonic() - t0
    print(f"wrote {a.output}: {tokens} tokens ({fmt}) from {len(files)} file(s), {total} bytes of text in {s:.1f} s")
    print(f'config: "data": {{"path": "{a.output}", "format": "{fmt}"}} (model.vocab_size >= {vocab})')


if __name__ == "__main__":
    main()
