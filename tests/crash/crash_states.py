#!/usr/bin/env python3
"""Power cuts at every point of a run's saves: does `strata train --resume` still load the right
checkpoint, bitwise, and keep every commit it reported?

  crash_states.py STRATA FS_RECORDER_SO WORK_DIR SCENARIO

1. The straight run: `strata train` with saves, recorded by fs_recorder.so (LD_PRELOAD): every
   mkdir, create, rename, unlink, rmdir, fsync of a file (with its content then), fsync of a
   directory, close (with the content then) and stderr line, in order, under WORK_DIR/fs. The
   writes themselves are not seen one by one (io_uring's bypass libc): a file's content is known
   at its fsyncs and closes, and the cut just before an fsync returns has that content written
   but not yet durable.
2. A model of the file system replays the record. After every operation (a cut point) it builds
   the states a power cut can leave there:
   - strict POSIX: a file's data is what its last fsync made durable, and a create, rename,
     unlink, mkdir or rmdir survives only if its directory was fsynced after it: "strict" keeps
     none of the unsynced ones; "strict-only-J" only the J-th and "strict-all-but-J" all but
     the J-th (every one of them in turn, so every single reordering is tried); and
     "strict-random-K" a random subset of them (sampled: two per cut), in order, with the unsynced
     data torn (each 4 KiB page old or new at random);
   - ordered: every metadata operation up to the cut survives, in order; the unsynced data is
     lost ("ordered"), torn ("ordered-torn"), or kept ("ordered-all", a kill -9).
   Identical states are tried once.
3. Each distinct state is laid out in WORK_DIR/fs and `strata train --resume` runs on it. It must:
   - resume from the checkpoint `latest` names if that one is intact (every file byte for byte as
     it was when its manifest was renamed in), else from the newest intact one, else start at
     step 0 when the state holds no `latest` and no manifest, else fail saying "cannot resume";
   - say why on stderr and in the log's `resume_note` when it did not take `latest`'s, and
     leave the state as it was when it refuses (a read removes nothing);
   - train the remaining steps to the straight run's losses, bitwise (no wrong load);
   - leave no step directory without a manifest behind (the next save tidies a crash's leftovers).
   And in the state itself: the newest commit the straight run had reported ("strata train:
   committed ...") by that cut is intact (no reported commit lost), and every directory holding a
   manifest is intact (no manifest over missing or torn files).
Prints one line per failing state and a summary (cut points, states, distinct states, outcomes);
exits 1 if any state failed. WORK_DIR/summary.json keeps the numbers.
"""
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

PAGE = 4096

SCENARIOS = {
    # A root the run creates (and its parent), synchronous saves, retention.
    "new-root": dict(ranks=1, root="runs/a/ckpt", make_root=False, steps=6, save_every=2, keep=2,
                     asynchronous=False, swap=False),
    # A root that existed before, background saves, master and moments in NVMe swap files
    # (copied file to file into the checkpoint), keep 1.
    "async-swap": dict(ranks=1, root="ckpt", make_root=True, steps=6, save_every=2, keep=1,
                       asynchronous=True, swap=True),
    # The recorded run is itself a resume: a first run saved steps 2 and 4 (keeping 1) and a
    # crash left step 5 half-written; the recorded run resumes from step 4, saves 6 and 8, and
    # its retention removes step 4 and the half-written step 5 (cut there too).
    "resume-tidy": dict(ranks=1, root="ckpt", make_root=False, steps=8, save_every=2, keep=1,
                        asynchronous=False, swap=False, prelude_steps=4, half_written="step-00000005"),
    # Two ranks (strata launch), each writing its own files, rank 0 the manifest and `latest`.
    "two-ranks": dict(ranks=2, root="runs/b/ckpt", make_root=False, steps=4, save_every=2, keep=1,
                      asynchronous=True, swap=False),
}


def config(work, sc):
    c = {
        "model": {"preset": "gpt2", "layers": 2, "hidden": 64, "heads": 4, "vocab_size": 256,
                  "max_positions": 64, "seed": 0},
        "data": {"seq_len": 32, "seed": 0},
        "batch": {"micro_batch": 2, "grad_accum": 1},
        "optimizer": {"lr": 0.001, "clip_grad_norm": 1.0},
        "placement": {"activations": "host"},
        "run": {"steps": sc["steps"], "progress": False, "save_every": sc["save_every"],
                "checkpoint_dir": os.path.join(work, "fs", sc["root"]), "keep_checkpoints": sc["keep"],
                "async_checkpoint": sc["asynchronous"]},
    }
    if sc["swap"]:
        c["placement"].update({"master": "nvme", "moments": "nvme"})
        c["offload"] = {"nvme_dirs": [os.path.join(work, "swap")]}
    return c


def command(strata, sc, cfg, log, resume):
    cmd = [strata, "train", "--config", cfg, "--log", log] + (["--resume"] if resume else [])
    if sc["ranks"] > 1:
        cmd = [strata, "launch", "-n", str(sc["ranks"]), "--"] + cmd
    return cmd


def losses(log):
    out = {}
    with open(log) as f:
        for line in f:
            j = json.loads(line)
            if "loss" in j and "step" in j:
                out[j["step"]] = j["loss"]
    return out


def start_line(log):
    with open(log) as f:
        for line in f:
            j = json.loads(line)
            if "resumed_from" in j:
                return j
    return None


# --- the model of the file system ------------------------------------------------------------

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


def main():
    strata, recorder, work, name = sys.argv[1:5]
    sc = SCENARIOS[name]
    t_start = time.time()
    work = os.path.abspath(work)
    shutil.rmtree(work, ignore_errors=True)
    fs_dir = os.path.join(work, "fs")
    os.makedirs(fs_dir)
    os.makedirs(os.path.join(work, "swap"))
    root_rel = sc["root"]
    if sc["make_root"]:
        os.makedirs(os.path.join(fs_dir, root_rel))
    cfg = os.path.join(work, "config.json")
    with open(cfg, "w") as f:
        json.dump(config(work, sc), f)

    # 0. A prelude (not recorded): its checkpoints and a crash's half-written save are there
    # before the recorded run, durable.
    straight = {}
    if sc.get("prelude_steps"):
        prelude_log = os.path.join(work, "prelude.jsonl")
        p = subprocess.run(command(strata, sc, cfg, prelude_log, False) + ["--steps", str(sc["prelude_steps"])],
                           capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            sys.exit("the prelude failed:\n" + p.stdout + p.stderr)
        straight.update(losses(prelude_log))
        half = os.path.join(fs_dir, root_rel, sc["half_written"])
        os.makedirs(half)
        with open(os.path.join(half, "rank-00000.data"), "wb") as f:
            f.write(os.urandom(3 * PAGE + 100))

    # 1. The straight run, recorded.
    record = os.path.join(work, "ops.log")
    blobs = Blobs(record + ".blobs")
    model = Model(fs_dir, blobs)
    env = dict(os.environ, LD_PRELOAD=os.path.abspath(recorder), STRATA_FSREC_ROOT=fs_dir,
               STRATA_FSREC_LOG=record)
    straight_log = os.path.join(work, "straight.jsonl")
    p = subprocess.run(command(strata, sc, cfg, straight_log, bool(sc.get("prelude_steps"))), env=env,
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        sys.exit("the straight run failed:\n" + p.stdout + p.stderr)
    straight.update(losses(straight_log))
    if sorted(straight) != list(range(1, sc["steps"] + 1)):
        sys.exit("the straight run logged steps %s" % sorted(straight))
    ops = read_record(record)
    if not any(op == "fsyncdir" for op, _ in ops):
        sys.exit("the record holds no directory fsync: was the recorder loaded? (%d operations)" % len(ops))

    # 2. Replay: every cut point's states, the reported commits and the intact checkpoints.
    contents = Contents()  # each distinct file content once: states hold their digests
    states = {}  # digest -> {"state", "reported" (newest reported step), "cuts": [(cut, variant)]}
    references = {}  # checkpoint name -> {relpath: blob} when its manifest was renamed in
    try:  # the prelude's committed checkpoints, as the model holds them before the replay
        at_start = model.nodes[model.lookup(root_rel)].volatile
    except KeyError:
        at_start = {}
    for c, i in sorted(at_start.items()):
        if model.nodes[i].kind == "d" and "manifest.json" in model.nodes[i].volatile:
            base = root_rel + "/" + c
            references[c] = {os.path.relpath(r, base): b for r, b in model.volatile_files(base).items()}
    stderr_text = {}
    reported = 0
    cuts = n_states = 0
    for k in range(len(ops) + 1):
        if k > 0:
            op, args = ops[k - 1]
            if op == "stderr":
                pid, text = args[0], bytes.fromhex(args[1] if len(args) > 1 else "").decode(errors="replace")
                stderr_text[pid] = stderr_text.get(pid, "") + text
                while "\n" in stderr_text[pid]:
                    line, stderr_text[pid] = stderr_text[pid].split("\n", 1)
                    m = re.search(r"strata train: committed \S*/step-(\d+)", line)
                    if m:
                        reported = max(reported, int(m.group(1)))
            else:
                model.apply(op, args)
            if op == "rename" and args[1].endswith("/manifest.json"):
                ckpt = args[1][:-len("/manifest.json")]
                references[os.path.basename(ckpt)] = {
                    os.path.relpath(r, ckpt): b for r, b in model.volatile_files(ckpt).items() if not r.endswith(".tmp")}
        cuts += 1
        for variant, tree in variants(model, name, k):
            n_states += 1
            st = {}
            for rel, content in tree.items():
                st[rel] = None if content is None else contents.put(content)
            d = digest(st)
            e = states.setdefault(d, {"state": st, "reported": 0, "cuts": []})
            e["reported"] = max(e["reported"], reported)
            e["cuts"].append((k, variant))
    if len(references) < 2:
        sys.exit("the straight run committed %d checkpoints; the scenario needs more" % len(references))

    def intact(st, ckpt_name):
        ref = references.get(ckpt_name)
        if ref is None:
            return False
        base = root_rel + "/" + ckpt_name
        return all(st.get(base + "/" + rel) == contents.put(blobs.get(b)) for rel, b in ref.items())

    # 3. Each distinct state, resumed.
    failures = []
    outcomes = {}
    problem_kinds = {}  # states failing each check
    resume_log = os.path.join(work, "resume.jsonl")
    for n, (d, e) in enumerate(sorted(states.items(), key=lambda x: x[1]["cuts"][0])):
        st = e["state"]
        where = "cut %d (%s; %d more cut/variant pairs give this state)" % (
            e["cuts"][0][0], e["cuts"][0][1], len(e["cuts"]) - 1)
        problems = []
        steps_dirs = {rel.split("/")[-1] for rel in st if rel.startswith(root_rel + "/step-") and rel.count("/") ==
                      root_rel.count("/") + 1}
        with_manifest = sorted(s for s in steps_dirs if (root_rel + "/" + s + "/manifest.json") in st)
        for s in with_manifest:
            if not intact(st, s):
                problems.append(("manifest over other files", "%s holds a manifest over files that are not the ones it committed" % s))
        if e["reported"]:
            rep = "step-%08d" % e["reported"]
            if not intact(st, rep):
                problems.append(("reported commit lost", "the reported commit %s is lost" % rep))
        latest = st.get(root_rel + "/latest")
        latest_name = contents.by_digest[latest].decode(errors="replace").strip() if latest is not None else None
        intact_names = sorted(s for s in steps_dirs if intact(st, s))
        if latest_name and intact(st, latest_name):
            expect = latest_name
        elif intact_names:
            expect = intact_names[-1]
        elif latest is not None or with_manifest:
            expect = "error"
        else:
            expect = "fresh"
        lay_out(st, contents, fs_dir)
        if os.path.exists(resume_log):
            os.unlink(resume_log)
        p = subprocess.run(command(strata, sc, cfg, resume_log, True), capture_output=True, text=True, timeout=600)
        out = p.stdout + p.stderr
        if expect == "error":
            outcome = "refused"
            if p.returncode == 0 or "cannot resume" not in out:
                problems.append(("no refusal", "expected a clear refusal (no intact checkpoint), got exit %d" % p.returncode))
            if tree_digest(fs_dir) != digest(st):
                problems.append(("a read changed the state", "the refused resume changed the checkpoint directory"))
        elif p.returncode != 0:
            outcome = "failed"
            problems.append(("resume failed", "expected to resume from %s, but the run failed (exit %d): %s" %
                             (expect, p.returncode, out.strip().splitlines()[-1:] if out.strip() else "")))
        else:
            start = start_line(resume_log)
            got = os.path.basename(start["resumed_from"]) if start and start["resumed_from"] else "fresh"
            outcome = "fresh start" if got == "fresh" else "resumed"
            if got != expect:
                problems.append(("wrong checkpoint", "resumed from %s, expected %s" % (got, expect)))
            elif got != "fresh" and got != latest_name and (
                    "cannot follow `latest`" not in out or not start.get("resume_note")):
                problems.append(("silent fallback", "took %s instead of `latest`'s %s without saying why on "
                                 "stderr and in the log" % (got, latest_name)))
            resumed = losses(resume_log)
            first = min(resumed) if resumed else None
            for s, l in resumed.items():
                if straight.get(s) != l:
                    problems.append(("wrong load", "step %d's loss %r, the straight run's %r (a wrong load)" % (s, l, straight.get(s))))
                    break
            if sorted(resumed) != list(range(first or sc["steps"] + 1, sc["steps"] + 1)):
                problems.append(("wrong steps", "the resumed run logged steps %s" % sorted(resumed)))
            left = [s for s in os.listdir(os.path.join(fs_dir, root_rel)) if s.startswith("step-") and
                    not os.path.exists(os.path.join(fs_dir, root_rel, s, "manifest.json"))]
            if left and got != "step-%08d" % sc["steps"]:  # a run with steps to go saves, and tidies
                problems.append(("half-written left", "half-written directories left after the resumed run's saves: %s" % left))
        key = outcome if outcome != "resumed" else "resumed from " + expect
        outcomes[key] = outcomes.get(key, 0) + 1
        if problems:
            failures.append(where)
            for kind, _ in problems:
                problem_kinds[kind] = problem_kinds.get(kind, 0) + 1
            print("FAIL %s: %s" % (where, "; ".join(text for _, text in problems)))
            if "--verbose" in sys.argv:
                print("  state: %s\n  output: %s" % (sorted(st), out[-2000:]))
        if (n + 1) % 20 == 0:
            print("%s: %d of %d distinct states tried, %d failed (%.0f s)" % (name, n + 1, len(states), len(failures),
                                                                           time.time() - t_start), flush=True)
    summary = {"scenario": name, "operations": len(ops), "cut_points": cuts, "states": n_states,
               "distinct_states": len(states), "checkpoints_committed": len(references), "outcomes": outcomes,
               "failed_states": len(failures), "failures_by_check": problem_kinds, "seconds": round(time.time() - t_start, 1)}
    with open(os.path.join(work, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    print("%d passed, %d failed" % (len(states) - len(failures), len(failures)))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
