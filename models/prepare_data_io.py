"""Shared by `strata data prepare` (prepare_data.py) and its --chat path (prepare_data_chat.py):
the error type, the tokenizer loader, the text-file reader and the commit of a finished output."""
import json
import os
import sys


class PrepareError(Exception):
    """A bad input or setting, reported as one line naming what failed (exit 1). Raised rather
    than exiting so that it crosses from a tokenizing worker process to the main one."""


def fail(msg):
    raise PrepareError(msg)


def report(error):
    print(f"strata data prepare: error: {error}", file=sys.stderr)
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
