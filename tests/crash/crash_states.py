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
2. A model of the file system (fs_model.py, beside this script) replays the record. After every
   operation (a cut point) it builds the states a power cut can leave there:
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
import json
import os
import re
import shutil
import subprocess
import sys
import time

# The file-system model beside this script (tests/crash/fs_model.py), whichever directory ctest
# runs it from.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fs_model import PAGE, Blobs, Contents, Model, digest, lay_out, read_record, tree_digest, variants  # noqa: E402

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
