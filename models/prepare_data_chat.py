"""`strata data prepare --chat` (see prepare_data.py): JSONL conversations checked line by line,
formatted by the tokenizer's chat template (or plainly without one) into ids and a loss mask, and
written as one safetensors file of supervised fine-tuning examples."""
import json
import os
import re
import sys
import time
from array import array

from prepare_data_io import commit, fail, input_files, load_tokenizer


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
