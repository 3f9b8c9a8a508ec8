"""The model of the file system that crash_states.py replays its record into, and the states a
power cut can leave at each cut point (strict POSIX and ordered; see crash_states.py's docstring);
file contents by name (Blobs) and by digest (Contents), and states laid out on disk.
"""
import hashlib
import os
import random
import shutil

PAGE = 4096


class Node:
    __slots__ = ("kind", "durable", "volatile", "pending")

    def __init__(self, kind, durable, volatile):
        self.kind = kind  # "d" or "f"
        # d: {name: node id}; f: a blob name (None: no data ever made durable)
        self.durable = durable
        self.volatile = volatile
        self.pending = []  # d: ("set", name, id) / ("del", name) not yet made durable


class Model:
    def __init__(self, fs_dir, blobs):
        self.blobs = blobs
        self.nodes = {}
        self.root = self._scan(fs_dir)

    def _new(self, kind, durable, volatile):
        i = len(self.nodes)
        self.nodes[i] = Node(kind, durable, volatile)
        return i

    def _scan(self, path):
        if os.path.isdir(path):
            entries = {n: self._scan(os.path.join(path, n)) for n in sorted(os.listdir(path))}
            return self._new("d", dict(entries), dict(entries))
        with open(path, "rb") as f:
            blob = self.blobs.put(f.read())
        return self._new("f", blob, blob)

    def lookup(self, rel):
        i = self.root
        if rel == ".":
            return i
        for part in rel.split("/"):
            i = self.nodes[i].volatile[part]
        return i

    def parent(self, rel):
        head, _, name = rel.rpartition("/")
        return self.lookup(head or "."), name

    def apply(self, op, args):
        if op in ("mkdir", "create"):
            d, name = self.parent(args[0])
            i = self._new("d", {}, {}) if op == "mkdir" else self._new("f", None, self.blobs.empty)
            self.nodes[d].volatile[name] = i
            self.nodes[d].pending.append(("set", name, i))
        elif op == "trunc":
            self.nodes[self.lookup(args[0])].volatile = self.blobs.empty
        elif op in ("unlink", "rmdir"):
            d, name = self.parent(args[0])
            self.nodes[d].volatile.pop(name, None)
            self.nodes[d].pending.append(("del", name))
        elif op == "rename":
            d, name = self.parent(args[0])
            d2, name2 = self.parent(args[1])
            i = self.nodes[d].volatile.pop(name)
            self.nodes[d2].volatile[name2] = i
            self.nodes[d].pending.append(("del", name))
            self.nodes[d2].pending.append(("set", name2, i))
        elif op in ("close", "write"):
            self.nodes[self.lookup(args[0])].volatile = args[1]
        elif op == "fsync":
            n = self.nodes[self.lookup(args[0])]
            n.volatile = n.durable = args[1]
        elif op == "fsyncdir":
            n = self.nodes[self.lookup(args[0])]
            for p in n.pending:
                if p[0] == "set":
                    n.durable[p[1]] = p[2]
                else:
                    n.durable.pop(p[1], None)
            n.pending = []
        else:
            raise ValueError("unknown operation " + op)

    def pending(self):
        """Every entry operation not yet made durable, as (directory node, index) pairs."""
        return [(i, k) for i, n in self.nodes.items() if n.kind == "d" for k in range(len(n.pending))]

    def state(self, namespace, data, rng, keep=None):
        """The tree a power cut leaves now: {relpath: None (directory) or bytes}.
        namespace: "durable" | "random" | "all" | "keep" (the unsynced entry operations for which
        keep(directory node, index) is true survive); data: "durable" | "torn" | "all"."""
        out = {}

        def entries(i):
            n = self.nodes[i]
            if namespace == "all":
                return n.volatile
            e = dict(n.durable)
            for k, p in enumerate(n.pending):
                if namespace == "random" and rng.random() < 0.5:
                    continue
                if namespace == "keep" and not keep(i, k):
                    continue
                if p[0] == "set":
                    e[p[1]] = p[2]
                else:
                    e.pop(p[1], None)
            return e

        def content(n):
            if data == "all":
                return self.blobs.get(n.volatile)
            old = self.blobs.get(n.durable) if n.durable is not None else b""
            if data == "durable" or n.volatile == n.durable:
                return old
            new = self.blobs.get(n.volatile)
            size = rng.choice([len(old), len(new)])
            pages = []
            for at in range(0, size, PAGE):
                src = new if rng.random() < 0.5 else old
                page = src[at:at + PAGE]
                pages.append(page + b"\0" * (min(PAGE, size - at) - len(page)))
            return b"".join(pages)

        def walk(i, rel):
            n = self.nodes[i]
            if n.kind == "d":
                if rel:
                    out[rel] = None
                for name, child in sorted(entries(i).items()):
                    walk(child, rel + "/" + name if rel else name)
            else:
                out[rel] = content(n)

        walk(self.root, "")
        return out

    def volatile_files(self, rel):
        """The files under `rel` as the running program sees them: {relpath: blob}."""
        out = {}

        def walk(i, r):
            n = self.nodes[i]
            if n.kind == "d":
                for name, child in n.volatile.items():
                    walk(child, r + "/" + name)
            else:
                out[r] = n.volatile

        walk(self.lookup(rel), rel)
        return out


class Blobs:
    def __init__(self, blob_dir):
        self.dir = blob_dir
        self.cache = {}
        self.empty = self.put(b"")

    def put(self, data):
        name = "mem-" + hashlib.sha256(data).hexdigest()
        self.cache[name] = data
        return name

    def get(self, name):
        if name not in self.cache:
            with open(os.path.join(self.dir, name), "rb") as f:
                self.cache[name] = f.read()
        return self.cache[name]


class Contents:
    """File contents by their SHA-256: a state is {relpath: None (directory) or digest}."""

    def __init__(self):
        self.by_digest = {}

    def put(self, data):
        d = hashlib.sha256(data).hexdigest()
        self.by_digest.setdefault(d, data)
        return d


def digest(state):
    h = hashlib.sha256()
    for rel in sorted(state):
        h.update(rel.encode() + b"\0" + (b"D" if state[rel] is None else state[rel].encode()) + b"\0")
    return h.hexdigest()


def tree_digest(fs_dir):
    """digest() of the tree on disk, as a state's."""
    st = {}
    for top, dirs, files in os.walk(fs_dir):
        for d in dirs:
            st[os.path.relpath(os.path.join(top, d), fs_dir)] = None
        for f in files:
            with open(os.path.join(top, f), "rb") as fh:
                st[os.path.relpath(os.path.join(top, f), fs_dir)] = hashlib.sha256(fh.read()).hexdigest()
    return digest(st)


def lay_out(state, contents, fs_dir):
    shutil.rmtree(fs_dir, ignore_errors=True)
    os.makedirs(fs_dir)
    for rel in sorted(state):
        p = os.path.join(fs_dir, rel)
        if state[rel] is None:
            os.makedirs(p, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(contents.by_digest[state[rel]])


def read_record(path):
    """The recorded operations; before each fsync of a file, a "write" of what it then made
    durable: the cut between the writes and the end of their fsync, where they may be torn."""
    ops = []
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split(" ")
            if parts[0] == "fsync":
                ops.append(("write", parts[1:]))
            ops.append((parts[0], parts[1:]))
    return ops


VARIANTS = [("strict", "durable", "durable"), ("strict-random-1", "random", "torn"),
            ("strict-random-2", "random", "torn"), ("ordered", "all", "durable"),
            ("ordered-torn", "all", "torn"), ("ordered-all", "all", "all")]


def variants(model, name, k):
    """The states a cut after operation k can leave: VARIANTS, then, for each unsynced entry
    operation, the strict states in which only it survives and in which all but it survive."""
    for variant, namespace, data in VARIANTS:
        yield variant, model.state(namespace, data, random.Random("%s/%d/%s" % (name, k, variant)))
    pending = model.pending()
    if len(pending) < 2:
        return  # "strict" and "ordered" already cover none and all
    for j, op in enumerate(pending):
        yield "strict-only-%d" % j, model.state("keep", "durable", None, lambda i, q: (i, q) == op)
        yield "strict-all-but-%d" % j, model.state("keep", "durable", None, lambda i, q: (i, q) != op)
