"""The inputs of `strata data prepare` (see prepare_data.py): which files a path names (a file, a
directory, a `datasets` save_to_disk directory, a Hugging Face dataset snapshot with its splits),
their records (parquet, arrow, JSON arrays, JSONL; whole text files), and the schemas records
come in, turned into one form: the messages of a conversation, or a document's text.

Every record is named `FILE:ROW` (JSONL: the line) in errors. Nothing here tokenizes."""
import json
import os
import re

from prepare_data_io import PrepareError, fail

# datasets' split keywords: a file or directory named by one of these belongs to that split.
SPLIT_WORDS = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
               "val": "validation", "dev": "validation", "test": "test", "testing": "test", "eval": "test",
               "evaluation": "test"}
# The Hub's data/{split}-00000-of-00003.parquet, with the hash older uploads appended.
SHARD = re.compile(r"^(.+?)-\d{5}-of-\d{5}(?:-[0-9a-f]+)?$")
NOISE = re.compile(r"^(\d+|of|[0-9a-f]{8,})$")  # shard numbers and hashes in a file name
METADATA = {"dataset_info.json", "state.json", "dataset_dict.json", "README.md", "dataset_infos.json"}
DATASET_KINDS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json"}


def split_name(rel):
    """The split a file belongs to from its path relative to the dataset's root (None: none):
    a Hub shard's prefix (train_sft-00000-of-00003); a directory named by a split keyword
    (train/), or starting with one (train_sft/); a file whose name, shard numbers and hashes
    aside, is a split keyword or ends with one (train.jsonl, train-0001.parquet, alpaca_dev.json;
    not eval_results.json)."""
    parts = rel.split(os.sep)
    stem = parts[-1].split(".")[0]
    m = SHARD.match(stem)
    if m:
        return m.group(1)
    for d in parts[:-1]:
        if d.lower() in SPLIT_WORDS:
            return d
        if re.split(r"[-_]", d)[0].lower() in SPLIT_WORDS:
            return d
    words = [w for w in re.split(r"[-_. ]", stem.lower()) if w and not NOISE.match(w)]
    if words and words[-1] in SPLIT_WORDS:
        return words[-1]
    return None


def same_split(a, b):
    return a == b or SPLIT_WORDS.get(a.lower(), a.lower()) == SPLIT_WORDS.get(b.lower(), b.lower())


def kind_of(path, chat):
    """How a file is read: a dataset file (parquet, arrow, json, jsonl) or, without --chat, a
    whole text file ("text"). With --chat another extension is read as JSONL."""
    ext = os.path.splitext(path)[1].lower()
    return DATASET_KINDS.get(ext, "jsonl" if chat else "text")


def walk(root):
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for n in sorted(names):
            p = os.path.join(d, n)
            if not n.startswith(".") and n not in METADATA and os.path.isfile(p):
                out.append(p)
    return out


def saved_dataset_files(path, split, explicit_split):
    """The arrow files of a `datasets` save_to_disk directory (a Dataset, or a DatasetDict's split)."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json")) as f:
            splits = json.load(f).get("splits", [])
        chosen = [s for s in splits if same_split(s, split)]
        if not chosen:
            fail(f"input {path}: a datasets DatasetDict without the split {split!r} (it has {', '.join(splits)}); "
                 "give --split")
        path = os.path.join(path, chosen[0])
    elif explicit_split:
        fail(f"input {path}: a saved datasets Dataset has no splits (--split {split} does not apply)")
    with open(os.path.join(path, "state.json")) as f:
        files = [os.path.join(path, e["filename"]) for e in json.load(f).get("_data_files", [])]
    if not files:
        fail(f"input {path}: its state.json lists no arrow files")
    return files


def input_files(paths, chat, split=None):
    """(file, kind) for every input, in order: a directory's files in name order (with chat, only its
    dataset files where it has some; only those of `split`, default "train", where they are named by
    split); a save_to_disk directory's arrow files. Errors name the input."""
    explicit = split is not None
    split = split or "train"
    out = []
    for p in paths:
        if os.path.isdir(p):
            if os.path.isfile(os.path.join(p, "state.json")) or os.path.isfile(os.path.join(p, "dataset_dict.json")):
                out += [(f, "arrow") for f in saved_dataset_files(p, split, explicit)]
                continue
            files = walk(p)
            datasets = [f for f in files if os.path.splitext(f)[1].lower() in DATASET_KINDS]
            if chat and datasets:
                files = datasets  # beside dataset files, others (a LICENSE, a loading script) are not data
            # Splits are read from dataset files' names only: a text corpus is read whole.
            named = {f: split_name(os.path.relpath(f, p)) if f in datasets else None for f in files}
            if any(named.values()):
                found = sorted({s for s in named.values() if s})
                files = [f for f in files if f not in datasets or (named[f] and same_split(named[f], split))]
                chosen = [f for f in files if f in datasets]
                if not chosen:
                    fail(f"input {p}: no files of the split {split!r} (its files are named for the splits "
                         f"{', '.join(found)}); give --split")
                dirs = sorted({os.path.relpath(os.path.dirname(f), p) for f in chosen})
                if len(dirs) > 1:
                    fail(f"input {p}: the split {split!r} has files in several directories ({', '.join(dirs[:6])}"
                         f"{', ...' if len(dirs) > 6 else ''}): the dataset's configurations; give one of them as "
                         "the input")
            elif explicit and split != "train":
                fail(f"input {p}: its files are not named by split (--split {split} names none of them)")
            if not files:
                fail(f"input {p}: an empty directory")
            out += [(f, kind_of(f, chat)) for f in files]
        elif os.path.isfile(p):
            out.append((p, kind_of(p, chat)))
        else:
            fail(f"input {p}: no such file or directory")
    return out


def arrow_batches(path):
    import pyarrow as pa

    with open(path, "rb") as f:  # datasets writes the IPC stream format; the file format is read too
        magic = f.read(6)
    if magic == b"ARROW1":
        reader = pa.ipc.open_file(path)
        return [reader.get_batch(i) for i in range(reader.num_record_batches)]
    return list(pa.ipc.open_stream(pa.memory_map(path)))


def records(path, kind):
    """(row, record) of a dataset file, row counted from 1 (JSONL: the line number), and the
    bytes of the file read so far (for progress)."""
    size = os.path.getsize(path)
    if kind in ("parquet", "arrow"):
        try:  # one reader a file: its row count (metadata) and then its rows
            if kind == "parquet":
                import pyarrow.parquet as pq

                reader = pq.ParquetFile(path)
                total, batches = reader.metadata.num_rows, reader.iter_batches(batch_size=1024)
            else:
                batches = arrow_batches(path)
                total = sum(b.num_rows for b in batches)
            total, row = max(total, 1), 0
            for b in batches:
                for rec in b.to_pylist():
                    row += 1
                    yield row, rec, size * row // total
        except PrepareError:
            raise
        except Exception as e:  # noqa: BLE001
            fail(f"input {path}: not a readable {kind} file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        return
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if kind == "json" and head.startswith(b"["):
        try:
            with open(path, encoding="utf-8-sig") as f:
                rows = json.load(f)
        except UnicodeDecodeError as e:
            fail(f"input {path}: not UTF-8 text ({e.reason} at byte {e.start})")
        except ValueError as e:
            fail(f"input {path}: not a JSON array ({getattr(e, 'msg', e)} at line {getattr(e, 'lineno', '?')})")
        for i, rec in enumerate(rows, 1):
            yield i, rec, size * i // max(len(rows), 1)
        return
    done = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            done += len(raw)
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                fail(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of the line)")
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                fail(f"{where}: not JSON ({getattr(e, 'msg', e)} at column {getattr(e, 'colno', '?')})")
            yield number, rec, done
