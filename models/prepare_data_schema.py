"""The schemas of `strata data prepare` records (see prepare_data.py), each turned into one form:
a conversation's messages [{"role", "content"}, ...] (--chat), or a document's text.

  messages         "messages": [{"role": system|user|assistant|tool, "content": str}, ...]
                   (OpenAI style; also under "conversations" when its items have role/content)
  sharegpt         "conversations": [{"from": system|human|gpt|tool|observation, "value": str}, ...],
                   an optional "system" column put first
  alpaca           "instruction", optional "input" (joined to the instruction by a newline when not
                   empty), "output"; optional "system" and "history" ([[prompt, response], ...],
                   the turns before); Dolly's "context" and "response" for "input" and "output"
  prompt-response  "prompt" and "response" (or "completion"): strings, or TRL's conversational
                   prompt-completion (lists of messages)
  text             "text": a document (without --chat)

An empty system prompt is dropped. Detected from a record's columns when exactly one schema fits; --schema chooses, --column names
the column of a messages, sharegpt or text schema. Errors name FILE:ROW."""
import json

from prepare_data_io import fail

SCHEMAS = ("messages", "sharegpt", "alpaca", "prompt-response", "text")
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "tool": "tool", "observation": "tool"}
DEFAULT_COLUMN = {"messages": "messages", "sharegpt": "conversations", "text": "text"}


def is_list_of(value, keys):
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and all(k in value[0] for k in keys)


def candidates(rec, chat):
    """The schemas a record's columns fit, each with the column it reads."""
    out = []
    if chat:
        if "messages" in rec:
            out.append(("messages", "messages"))
        conv = rec.get("conversations")
        if "conversations" in rec:
            out.append(("messages", "conversations") if is_list_of(conv, ("role",)) else ("sharegpt", "conversations"))
        if "instruction" in rec and ("output" in rec or "response" in rec):
            out.append(("alpaca", None))
        if "prompt" in rec and ("response" in rec or "completion" in rec):
            out.append(("prompt-response", None))
    elif "text" in rec:
        out.append(("text", "text"))
    return out


class Schema:
    """Turns records into messages (chat) or text, by the given schema and column or by what
    each record's columns fit (one decision per set of columns)."""

    def __init__(self, schema, column, chat):
        if schema == "text" and chat:
            fail("--schema text is a token file's documents: drop --chat (or give a conversation schema)")
        if schema not in (None, "text") and not chat:
            fail(f"--schema {schema} is a conversation schema: it needs --chat")
        if column is not None and schema in ("alpaca", "prompt-response"):
            fail(f"--column does not apply to --schema {schema} (it reads several columns)")
        self.schema, self.column, self.chat = schema, column, chat
        self.known = {}

    def resolve(self, rec, where):
        if not isinstance(rec, dict):
            fail(f"{where}: not a JSON object but {type(rec).__name__}")
        if self.schema is not None:
            return self.schema, self.column or DEFAULT_COLUMN.get(self.schema)
        if self.column is not None:
            if self.column not in rec:
                fail(f"{where}: no column {self.column!r} (columns: {', '.join(map(str, rec))})")
            if not self.chat:
                return "text", self.column
            return ("messages" if is_list_of(rec[self.column], ("role",)) else "sharegpt"), self.column
        key = tuple(sorted(map(str, rec)))
        if key not in self.known:
            found = candidates(rec, self.chat)
            cols = ", ".join(map(str, rec)) or "none"
            if not found:
                wanted = ('"messages", "conversations", "instruction" + "output", "prompt" + "response"'
                          if self.chat else '"text" (or --column)')
                fail(f"{where}: no schema fits its columns ({cols}): expected {wanted}; give --schema and --column")
            if len(found) > 1:
                fail(f"{where}: its columns ({cols}) fit more than one schema "
                     f"({', '.join(s for s, _ in found)}): give --schema")
            self.known[key] = found[0]
        return self.known[key]

    def text(self, rec, where):
        """A document's text ("" for an empty one, which the caller skips)."""
        schema, column = self.resolve(rec, where)
        value = rec.get(column)
        if value is None:
            return ""  # a null text (parquet) is an empty document
        if not isinstance(value, str):
            fail(f'{where}: "{column}" must be a string, not {type(value).__name__}')
        return value

    def messages(self, rec, where):
        schema, column = self.resolve(rec, where)
        if schema == "messages":
            msgs = message_list(rec.get(column), where, column, "role", "content", {r: r for r in ROLES})
        elif schema == "sharegpt":
            msgs = message_list(rec.get(column), where, column, "from", "value", SHAREGPT_ROLES)
            if rec.get("system"):
                msgs.insert(0, {"role": "system", "content": string(rec["system"], where, '"system"')})
        elif schema == "alpaca":
            msgs = alpaca(rec, where)
        else:
            msgs = prompt_response(rec, where)
        check_turns(msgs, where)
        return msgs


def string(value, where, what):
    if not isinstance(value, str):
        fail(f"{where}: {what} must be a string, not {type(value).__name__}")
    if not value:
        fail(f"{where}: {what} is empty")
    return value


def message_list(value, where, column, role_key, content_key, roles):
    if not isinstance(value, list) or not value:
        fail(f'{where}: "{column}" must be a non-empty list of messages')
    out = []
    for i, m in enumerate(value, 1):
        if not isinstance(m, dict):
            fail(f"{where}: message {i} is not an object but {type(m).__name__}")
        for key in (role_key, content_key):
            if m.get(key) is None:
                fail(f'{where}: message {i} has no "{key}"')
        if m[role_key] not in roles:
            known = ", ".join(roles)
            extra = " (function calls are not supported)" if m[role_key] in ("function_call", "function") else ""
            fail(f'{where}: message {i} has {role_key} {json.dumps(m[role_key])}{extra}: expected one of {known}')
        if m.get("tool_calls"):
            fail(f"{where}: message {i} has tool_calls: function calls are not supported")
        role = roles[m[role_key]]
        if role == "system" and m[content_key] == "":
            continue  # an empty system prompt (common in Orca-style data) is no system prompt
        out.append({"role": role, "content": string(m[content_key], where, f'message {i} ({role}) "{content_key}"')})
    return out


def alpaca(rec, where):
    """Alpaca's columns, or Dolly's: "context" for "input", "response" for "output"."""
    instruction = string(rec.get("instruction"), where, '"instruction"')
    extra_key = "input" if "input" in rec else "context"
    extra = rec.get(extra_key)
    if extra is not None and not isinstance(extra, str):
        fail(f'{where}: "{extra_key}" must be a string, not {type(extra).__name__}')
    msgs = []
    if rec.get("system"):  # an empty or null system column is no system prompt
        msgs.append({"role": "system", "content": string(rec["system"], where, '"system"')})
    history = rec.get("history") or []
    if not isinstance(history, list):
        fail(f'{where}: "history" must be a list of [prompt, response] pairs')
    for k, pair in enumerate(history, 1):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            fail(f'{where}: "history" entry {k} is not a [prompt, response] pair')
        msgs += [{"role": "user", "content": string(pair[0], where, f'"history" entry {k} prompt')},
                 {"role": "assistant", "content": string(pair[1], where, f'"history" entry {k} response')}]
    out_key = "output" if "output" in rec else "response"
    msgs += [{"role": "user", "content": instruction + ("\n" + extra if extra else "")},
             {"role": "assistant", "content": string(rec.get(out_key), where, f'"{out_key}"')}]
    return msgs


def prompt_response(rec, where):
    key = "response" if "response" in rec else "completion"
    prompt, answer = rec.get("prompt"), rec.get(key)
    if isinstance(prompt, list) or isinstance(answer, list):  # TRL's conversational prompt-completion
        return (message_list(prompt, where, "prompt", "role", "content", {r: r for r in ROLES}) +
                message_list(answer, where, key, "role", "content", {r: r for r in ROLES}))
    return [{"role": "user", "content": string(prompt, where, '"prompt"')},
            {"role": "assistant", "content": string(answer, where, f'"{key}"')}]


def check_turns(msgs, where):
    """A system message only first; then user and assistant alternating from a user message
    (tool results only after an assistant message or another tool result); an assistant turn."""
    prev = None
    for i, m in enumerate(msgs, 1):
        role = m["role"]
        if role == "system":
            if i != 1:
                fail(f"{where}: message {i} (system) is not the first: a system message only opens a conversation")
            continue
        if role == "tool":
            ok = prev in ("assistant", "tool")
        elif role == "user":
            ok = prev in (None, "assistant", "tool")
        else:
            ok = prev in ("user", "tool")
        if not ok:
            before = f"follows a {prev} message" if prev else "opens the conversation"
            fail(f"{where}: message {i} ({role}) {before}: the roles must alternate user, assistant "
                 "(after an optional system message; tool results after an assistant message)")
        prev = role
    if not any(m["role"] == "assistant" for m in msgs):
        fail(f"{where}: no assistant message (nothing to learn)")
