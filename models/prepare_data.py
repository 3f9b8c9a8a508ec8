#!/usr/bin/env python3
"""Tokenizes text into the flat token-id files `strata train` reads (data.format "uint16" or
"uint32"), or, with --chat, conversations into supervised fine-tuning examples (data.format
"sft"), with the Hugging Face tokenizer of the model being fine-tuned, in --workers processes.

    strata data prepare --tokenizer MODEL_DIR --output train.bin corpus/ more.txt
    strata data prepare --chat --tokenizer MODEL_DIR --output train.sft DATASET_DIR

Inputs (prepare_data_sources.py): files, or directories of them (in name order, hidden files,
README.md and datasets' metadata skipped). Parquet (.parquet), arrow (.arrow, as datasets writes
them), JSON arrays or JSONL (.json), JSONL (.jsonl) are datasets: one record a row. A directory
written by datasets' save_to_disk (a Dataset, or a DatasetDict's --split) is read through its
state.json. A directory whose files are named by split (a Hugging Face dataset snapshot's
data/train-00000-of-00002.parquet, train/ and test/ directories, dev.jsonl) gives the files of
--split (default train). Records come in a schema (prepare_data_schema.py): messages, sharegpt,
alpaca, prompt-response (--chat) or text; detected from each record's columns when exactly one
fits, else --schema (and --column). Errors name FILE:ROW (JSONL: the line).

The token file is what models/include/strata/models/token_data.h reads: token ids back to back,
2 or 4 bytes each in host byte order, no header. Each document (a text file, or a dataset
record's text) is followed by the tokenizer's end-of-sequence id (unless --no-eos), so that
windows spanning two documents see the boundary the model was trained with. Other files than
datasets are whole text documents; one larger than --piece is encoded in pieces cut after a
newline (after a whole UTF-8 character where a piece has no newline): the ids can differ from
encoding the whole file at once only at a cut, where a token would have spanned it, or, with
tokenizers that prepend a space marker to every text they encode (SentencePiece "Metaspace" ones
such as Llama 2's), by one such marker per cut. The tokenizer's saved truncation and padding are
turned off: every byte of text is encoded.

--chat: each record is one example. The output is a safetensors file (docs/FORMATS.md, read by
models/token_data.h SftExamples): "offsets" (I64 [examples + 1]: example e is
tokens[offsets[e]:offsets[e+1]]), "tokens" (I32 [n], every example's ids back to back) and
"loss_mask" (U8 [n], 1 on the tokens the loss learns: every assistant turn), metadata {"format":
"strata-sft-1", "tokenizer": path, "examples": count}; its sidecar adds the example and
loss-token counts. With a chat template (MODEL_DIR's tokenizer_config.json "chat_template",
chat_template.jinja or chat_template.json) an example's ids are transformers'
apply_chat_template of its messages, and its loss mask comes from the template's
{% generation %} blocks where it has them, otherwise from rendering the conversation
incrementally: for assistant message i, the ids of messages[:i] with add_generation_prompt=True
must be a prefix of the ids of messages[:i+1], which must be a prefix of the whole
conversation's, and the tokens between the two (the response and the template's end-of-turn
tokens, such as <|im_end|>\n or <|eot_id|>) are in the loss. Without a template, or with
--no-template, an example is one user and one assistant message: [bos, where the tokenizer
config has bos_token and add_bos_token] + ids(prompt) + ids(response) + [eos], the response and
eos in the loss. Every example is kept whole (training cuts one longer than data.seq_len + 1
tokens); --max-tokens N reports how many are longer than N and refuses a single message longer
than N. Errors name FILE:ROW: a missing or ill-typed column, a role the schema does not know,
roles that do not alternate (user, assistant, ... after an optional system message; tool results
after an assistant message), empty content, no assistant message, a response that tokenizes to
no tokens, a template that rejects the conversation or breaks the prefix property, more than one
prompt and response without a chat template.

Workers (--workers, default: this machine's cores) tokenize batches of records (text: about a
MiB) in order: the output is the same for any number of workers. A progress line shows the
fraction read, examples/s and the time left. Outputs are written to temporary names and renamed
when complete (with a sidecar OUTPUT.json: the tokenizer, the format, the counts, the inputs), so
an interrupted run leaves no partial file under the final name; running it again starts over.
Memory: a few batches a worker, and with --chat 8 bytes an example (the offsets).
"""
import argparse
import os
import sys
from array import array

# The modules beside this script (prepare_data_io.py: tokenizer, errors, the commit of an output;
# prepare_data_sources.py / _schema.py: inputs; prepare_data_parallel.py: workers and progress;
# prepare_data_chat.py / _write.py: --chat), however and from wherever it is run.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare_data_chat import prepare_chat  # noqa: E402
from prepare_data_io import PrepareError, commit, fail, load_tokenizer, pieces, report  # noqa: E402
from prepare_data_parallel import Progress, default_workers, ordered  # noqa: E402
from prepare_data_schema import SCHEMAS, Schema  # noqa: E402
from prepare_data_sources import input_files, records  # noqa: E402

TEXT_BATCH = 1 << 20  # bytes of text a worker encodes at once


def arguments():
    ap = argparse.ArgumentParser(prog="strata data prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+",
                    help="files or directories: text, parquet, arrow, JSON/JSONL, datasets' save_to_disk, a dataset snapshot")
    ap.add_argument("--tokenizer", required=True, help="Hugging Face model directory or tokenizer.json")
    ap.add_argument("--output", required=True, help="token file to write (e.g. train.bin; with --chat: train.sft)")
    ap.add_argument("--format", choices=["auto", "uint16", "uint32"], default="auto",
                    help="id width; auto: uint16 when every id of the vocabulary fits")
    ap.add_argument("--no-eos", action="store_true", help="no end-of-sequence id after each document")
    ap.add_argument("--piece", type=int, help="bytes of a text file encoded at once (default 1 MiB)")
    ap.add_argument("--chat", action="store_true",
                    help="supervised fine-tuning examples (safetensors, data.format sft) from conversations")
    ap.add_argument("--split", help="the split of a dataset with splits (default train)")
    ap.add_argument("--schema", choices=SCHEMAS, help="the records' schema (default: detected from their columns)")
    ap.add_argument("--column", help="the column holding the conversation (messages, sharegpt) or the text")
    ap.add_argument("--workers", type=int, default=default_workers(), help="tokenizing processes (default: cores)")
    ap.add_argument("--no-template", action="store_true",
                    help="with --chat: prompt + response + eos even where the tokenizer has a chat template")
    ap.add_argument("--max-tokens", type=int,
                    help="with --chat: report the examples longer than this; refuse a message longer than this")
    a = ap.parse_args()
    if a.workers < 1:
        fail("--workers must be >= 1")
    if a.chat:
        for given, flag in ((a.format != "auto", "--format"), (a.no_eos, "--no-eos"), (a.piece is not None, "--piece")):
            if given:
                fail(f"{flag} does not apply to --chat")
        if a.max_tokens is not None and a.max_tokens < 1:
            fail("--max-tokens must be >= 1")
    else:
        for given, flag in ((a.no_template, "--no-template"), (a.max_tokens is not None, "--max-tokens")):
            if given:
                fail(f"{flag} needs --chat")
        a.piece = (1 << 20) if a.piece is None else a.piece
        if a.piece < 1:
            fail("--piece must be >= 1")
    Schema(a.schema, a.column, a.chat)  # refuses a schema or column that does not apply
    return a


def text_units(files, schema, piece, skipped):
    """(where, text or bytes, end of document, bytes read so far) over every input, in order;
    records with empty text are counted in skipped["empty"], not documents."""
    done = 0
    for path, kind in files:
        if kind == "text":
            at = 0
            for p in pieces(path, piece):
                at += len(p)
                yield (path, at - len(p)), p, False, done + at
            yield path, b"", True, done + at
        else:
            for row, rec, at in records(path, kind):
                where = f"{path}:{row}"
                text = schema.text(rec, where)
                if not text:
                    skipped["empty"] += 1
                    continue
                yield where, text, True, done + at
        done += os.path.getsize(path)


def text_batches(units):
    batch, size = [], 0
    for u in units:
        batch.append(u[:3])
        size += len(u[1])
        if size >= TEXT_BATCH:
            yield batch, u[3]
            batch, size = [], 0
    if batch:
        yield batch, None


class TextWorker:
    def __init__(self, tokenizer, typecode, limit, eos):
        self.tok = load_tokenizer(tokenizer)[0]
        self.typecode, self.limit, self.eos = typecode, limit, eos


def encode_batch(w, batch):
    """A batch of units -> their ids (bytes of the output's type), token and document counts."""
    out, docs = array(w.typecode), 0
    for where, text, end in batch[0]:
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as e:
                fail(f"input {where[0]}: not UTF-8 text ({e.reason} at byte {where[1] + e.start} of the file)")
        ids = w.tok.encode(text, add_special_tokens=False).ids if text else []
        if ids and max(ids) >= w.limit:
            fail(f"input {where if isinstance(where, str) else where[0]}: token id {max(ids)} does not fit "
                 f"{'uint16' if w.typecode == 'H' else 'uint32'}")
        out.extend(ids)
        if end:
            docs += 1
            if w.eos is not None:
                out.append(w.eos)
    return out.tobytes(), len(out), docs, batch[1]


def prepare_tokens(a, files):
    tok, eos, vocab = load_tokenizer(a.tokenizer)
    del tok  # the workers load their own
    if not a.no_eos and eos is None:
        fail(f"tokenizer {a.tokenizer} has no end-of-sequence token: give --no-eos to join files without one")
    fmt = a.format if a.format != "auto" else ("uint16" if vocab <= 1 << 16 else "uint32")
    limit = 1 << (16 if fmt == "uint16" else 32)
    if not a.no_eos and eos >= limit:
        fail(f"the end-of-sequence id {eos} does not fit {fmt}")
    typecode = "H" if fmt == "uint16" else "I"
    if array(typecode).itemsize != (2 if fmt == "uint16" else 4):
        fail(f"this Python has no {fmt} array type")
    total = sum(os.path.getsize(f) for f, _ in files)
    if total == 0:
        fail("the inputs hold no text")

    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    tmp = a.output + ".tmp"
    progress, tokens, docs = Progress("tokenized", total), 0, 0
    setup = (TextWorker, (a.tokenizer, typecode, limit, None if a.no_eos else eos))
    skipped = {"empty": 0}
    units = text_units(files, Schema(a.schema, a.column, chat=False), a.piece, skipped)
    try:
        with open(tmp, "wb") as out:
            for data, n, d, at in ordered(encode_batch, text_batches(units), a.workers, *setup):
                out.write(data)
                tokens, docs = tokens + n, docs + d
                progress.update(at if at is not None else total, docs, f"{tokens} tokens")
            out.flush()
            os.fsync(out.fileno())
    except BaseException:  # failed or interrupted: no partial file stays behind
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    progress.close()
    if tokens == 0:
        os.unlink(tmp)
        fail("the inputs gave no tokens")
    meta = {
        "format": fmt,
        "tokens": tokens,
        "documents": docs,
        "vocab_size": vocab,
        "eos_id": None if a.no_eos else eos,
        "tokenizer": os.path.abspath(a.tokenizer),
        "inputs": [os.path.abspath(f) for f, _ in files],
        "text_bytes": total,
        "empty_records_skipped": skipped["empty"],
    }
    commit(tmp, a.output, meta)
    empty = f" ({skipped['empty']} empty records skipped)" if skipped["empty"] else ""
    print(f"wrote {a.output}: {tokens} tokens ({fmt}) from {docs} document(s){empty} in {len(files)} file(s), "
          f"{total} bytes, in {progress.seconds():.1f} s ({a.workers} worker(s))")
    print(f'config: "data": {{"path": "{a.output}", "format": "{fmt}"}} (model.vocab_size >= {vocab})')


def main():
    try:
        a = arguments()
        files = input_files(a.inputs, a.chat, a.split)
        prepare_chat(a, files) if a.chat else prepare_tokens(a, files)
    except PrepareError as e:
        report(e)
    except KeyboardInterrupt:
        print("\nstrata data prepare: interrupted; no output written (an earlier one is kept)", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
