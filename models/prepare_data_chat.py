"""`strata data prepare --chat` (see prepare_data.py): conversations read record by record
(prepare_data_sources.py, in any schema prepare_data_schema.py knows), formatted by the
tokenizer's chat template (or plainly without one) into ids and a loss mask in worker processes
(prepare_data_parallel.py), and streamed into one safetensors file of supervised fine-tuning
examples (prepare_data_write.py)."""
import itertools
import json
import os
import re
from array import array

from prepare_data_io import commit, fail, load_tokenizer
from prepare_data_parallel import Progress, ordered
from prepare_data_schema import Schema
from prepare_data_sources import records
from prepare_data_write import SftWriter

BATCH = 64  # records a worker formats at once


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

    def turn_tokens(self, text):
        return len(self.hf.encode(text, add_special_tokens=False))

    def example(self, msgs, where):
        for i, m in enumerate(msgs, 1):
            if m["role"] == "assistant" and not self.turn_tokens(m["content"]):
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

    def turn_tokens(self, text):
        return len(self.tok.encode(text, add_special_tokens=False).ids)

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




class ChatWorker:
    """What a worker process holds: the formatting, the schema and the limits."""

    def __init__(self, tokenizer, no_template, schema, column, max_tokens):
        template = has_chat_template(tokenizer)
        self.fmt = TemplateFormat(tokenizer) if template and not no_template else PlainFormat(tokenizer, template)
        if self.fmt.vocab > 1 << 31:
            fail(f"a vocabulary of {self.fmt.vocab} ids does not fit int32")
        self.schema = Schema(schema, column, chat=True)
        self.max_tokens = max_tokens


def format_batch(w, batch):
    """A batch of (FILE:ROW, record) -> the examples' ids (int32 bytes), mask (uint8 bytes),
    lengths, loss tokens, longest, the count longer than --max-tokens, and the formatting's name
    and vocabulary size (what the summary reports)."""
    tokens, mask, lengths, loss, longest, over = array("i"), array("B"), [], 0, 0, 0
    for where, rec in batch:
        msgs = w.schema.messages(rec, where)
        if w.max_tokens is not None:
            for i, m in enumerate(msgs, 1):
                n = w.fmt.turn_tokens(m["content"])
                if n > w.max_tokens:
                    fail(f"{where}: message {i} ({m['role']}) is {n} tokens, longer than --max-tokens {w.max_tokens}")
        ids, m = w.fmt.example(msgs, where)
        if not any(m[1:]):  # target j is token j + 1: a first token in the loss is no target
            fail(f"{where}: no token is in the loss (the assistant turns give no target)")
        if max(ids) >= w.fmt.vocab or min(ids) < 0:
            fail(f"{where}: token id {max(ids)} is outside the tokenizer's vocabulary of {w.fmt.vocab}")
        tokens.extend(ids)
        mask.extend(m)
        lengths.append(len(ids))
        loss += sum(m)
        longest = max(longest, len(ids))
        over += w.max_tokens is not None and len(ids) > w.max_tokens
    return tokens.tobytes(), mask.tobytes(), lengths, loss, longest, over, w.fmt.name, w.fmt.vocab


def batches(files, progress):
    """Batches of (FILE:ROW, record) over every input, in order, with the bytes read so far."""
    done = 0
    for path, kind in files:
        it = ((f"{path}:{row}", rec, at) for row, rec, at in records(path, kind))
        while True:
            chunk = list(itertools.islice(it, BATCH))
            if not chunk:
                break
            progress["bytes"] = done + chunk[-1][2]
            yield [(where, rec) for where, rec, _ in chunk]
        done += os.path.getsize(path)


def prepare_chat(a, files):
    setup = (ChatWorker, (a.tokenizer, a.no_template, a.schema, a.column, a.max_tokens))
    total = sum(os.path.getsize(f) for f, _ in files)
    writer = SftWriter(a.output)
    progress, read = Progress("prepared", total), {"bytes": 0}
    examples = tokens = loss_tokens = longest = over = 0
    try:
        for t, m, lengths, loss, top, n_over, name, vocab in ordered(format_batch, batches(files, read), a.workers,
                                                                      *setup):
            writer.add(t, m, lengths)
            examples += len(lengths)
            tokens += len(m)
            loss_tokens, longest, over = loss_tokens + loss, max(longest, top), over + n_over
            progress.update(read["bytes"], examples, f"{tokens} tokens, {loss_tokens} in the loss")
        progress.close()
        if examples == 0:
            fail("the inputs hold no examples")
        writer.finish({"format": "strata-sft-1", "tokenizer": os.path.abspath(a.tokenizer), "examples": str(examples)})
    except BaseException:  # failed or interrupted: no partial file stays behind
        writer.abandon()
        raise
    meta = {
        "format": "sft",
        "examples": examples,
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "longest_example": longest,
        "vocab_size": vocab,
        "formatting": name,
        "tokenizer": os.path.abspath(a.tokenizer),
        "inputs": [os.path.abspath(f) for f, _ in files],
        "text_bytes": total,
        "workers": a.workers,
    }
    if a.max_tokens is not None:
        meta["max_tokens"] = a.max_tokens
        meta["longer_than_max_tokens"] = over
    commit(writer.tmp, a.output, meta)
    s = progress.seconds()
    print(f"wrote {a.output}: {examples} examples, {tokens} tokens ({loss_tokens} in the loss, longest example "
          f"{longest}) with the {name} formatting from {len(files)} file(s), {total} bytes, in {s:.1f} s "
          f"({examples / max(s, 1e-9):.0f} examples/s, {a.workers} worker(s))")
    if a.max_tokens is not None:
        print(f"{over} of {examples} examples are longer than --max-tokens {a.max_tokens} tokens (kept whole here; "
              "training cuts an example at data.seq_len + 1 tokens)")
    print(f'config: "data": {{"path": "{a.output}", "format": "sft"}} (model.vocab_size >= {vocab})')
