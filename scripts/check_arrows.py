#!/usr/bin/env python3
"""Checks Strata's dependency arrows against docs/ARCHITECTURE.md.

    check_arrows.py [SOURCE_DIR] [--list]

An arrow "a -> b" says that part a uses part b directly. The arrows are computed from
  (a) target_link_libraries in the CMakeLists.txt files (the library's part -> the linked
      library's part), and
  (b) the #include "..." lines of the sources: "strata/<lib>/..." and relative includes, each
      file mapped to a part by its path (PATH_PARTS below; tests/ are left out).
The layers (top to bottom) and the allowed arrows have one source of truth: the ```arrows block
of docs/ARCHITECTURE.md. Fails (exit 1), naming each offending arrow with the file:line of every
line that creates it, when an arrow is not allowed, points upward or sideways, is allowed only as
header-only and comes from a link line or another header, when a library compiles a source of
another part, when a file or a CMake target maps to no part, or when strata_planner's
transitive link closure holds strata_offload or libtorch. --list prints every arrow found.
Standard library only; runs in well under a second.
"""
import collections
import fnmatch
import os
import re
import sys

# ---------------------------------------------------------------------------------------------
# The one mapping table: a file's part by its path (relative to the source root, '/'-separated).
# The first pattern that matches wins (fnmatch: '*' also crosses '/'). A file that matches none
# fails the check: new engine files must be placed here on purpose.
PATH_PARTS = [
    # models/: the formats (strata_formats, no libtorch) and the decoders (strata_models).
    ("models/include/strata/models/decoder.h", "models"),
    ("models/include/strata/models/hf_io.h", "models"),
    ("models/include/strata/models/token_layout.h", "models"),
    ("models/include/strata/models/moe.h", "models"),
    ("models/src/decoder*", "models"),
    ("models/src/hf_io.cc", "models"),
    ("models/include/strata/models/quant4_checkpoint.h", "models"),
    ("models/src/quant4_checkpoint.cc", "models"),
    ("models/src/token_layout.cc", "models"),
    ("models/*", "formats"),
    ("offload/*", "offload"),
    ("kernels/*", "kernels"),
    ("tiling/*", "tiling"),
    ("planner/*", "planner"),
    ("bench/*", "bench"),
    ("cli/*", "cli"),
    # engine: the layout library (strata_layout), no libtorch.
    ("engine/src/layout/*", "layout"),
    ("engine/include/strata/engine/layout/*", "layout"),
    ("engine/src/bytes.cc", "layout"),
    ("engine/src/config.cc", "layout"),
    ("engine/src/lr_schedule.cc", "layout"),
    ("engine/src/partition.cc", "layout"),
    ("engine/src/placement.cc", "layout"),
    ("engine/include/strata/engine/bytes.h", "layout"),
    ("engine/include/strata/engine/config.h", "layout"),
    ("engine/include/strata/engine/lr_schedule.h", "layout"),
    ("engine/include/strata/engine/partition.h", "layout"),
    ("engine/include/strata/engine/placement.h", "layout"),
    ("engine/include/strata/engine/predict.h", "layout"),
    ("engine/include/strata/engine/shard.h", "layout"),
    # engine: configuration parsing (strata_config).
    ("engine/src/config_parse.cc", "config"),
    ("engine/src/config_model.cc", "config"),
    ("engine/src/config_lora.cc", "config"),
    ("engine/src/config_quantize.cc", "config"),
    ("engine/src/config_section.h", "config"),
    ("engine/include/strata/engine/config_parse.h", "config"),
    # engine: the leaves every other engine part uses: device, collectives, cores, profiler.
    ("engine/src/device.cc", "device"),
    ("engine/src/cuda_device.cc", "device"),
    ("engine/src/comm.cc", "device"),
    ("engine/src/comm_nodes.*", "device"),
    ("engine/src/comm_peers.*", "device"),
    ("engine/src/dist_env.cc", "device"),
    ("engine/src/cpu_share.cc", "device"),
    ("engine/src/profiler.h", "device"),
    ("engine/include/strata/engine/device.h", "device"),
    ("engine/include/strata/engine/precision_dtype.h", "device"),
    ("engine/include/strata/engine/comm.h", "device"),
    ("engine/include/strata/engine/cpu_share.h", "device"),
    ("engine/include/strata/engine/timeline.h", "device"),
    # engine: state (StateHold is implemented in state/hold_gate.cc).
    ("engine/src/state/*", "state"),
    ("engine/include/strata/engine/state_hold.h", "state"),
    ("engine/src/runtime/*", "runtime"),
    ("engine/src/checkpoint/*", "checkpoint"),
    ("engine/include/strata/engine/checkpoint.h", "checkpoint"),
    ("engine/include/strata/engine/checkpoint_store.h", "checkpoint"),
    # engine-top: the Engine, its construction, step and evaluation, build information.
    ("engine/src/engine.cc", "engine-top"),
    ("engine/src/engine_impl.h", "engine-top"),
    ("engine/src/construct.cc", "engine-top"),
    ("engine/src/step.cc", "engine-top"),
    ("engine/src/evaluate.cc", "engine-top"),
    ("engine/src/build_info.cc", "engine-top"),
    ("engine/include/strata/engine/engine.h", "engine-top"),
    ("engine/include/strata/engine/build_info.h", "engine-top"),
]

# Each CMake target's part (a link line's arrow starts at it), and the parts whose sources it
# may compile. Targets not named here (tests, imported and system libraries) are not parts.
TARGET_PARTS = {
    "strata_offload": ("offload", {"offload"}),
    "strata_kernels": ("kernels", {"kernels"}),
    "strata_formats": ("formats", {"formats"}),
    "strata_models": ("models", {"models"}),
    "strata_tiling": ("tiling", {"tiling"}),
    "strata_layout": ("layout", {"layout"}),
    "strata_config": ("config", {"config"}),
    "strata_engine": ("engine-top", {"engine-top", "device", "state", "runtime", "checkpoint"}),
    "strata_planner": ("planner", {"planner"}),
    "strata_bench": ("bench", {"bench"}),
    "strata_cli_report": ("cli", {"cli"}),
    "strata": ("cli", {"cli"}),
}

# "strata/<lib>/x.h" lives in <folder>/include/strata/<lib>/x.h.
INCLUDE_LIBS = {"offload": "offload", "kernels": "kernels", "models": "models", "tiling": "tiling",
                "engine": "engine", "planner": "planner"}
SCANNED = ["offload", "kernels", "models", "tiling", "engine", "planner", "bench", "cli"]
SOURCE_EXT = (".h", ".hpp", ".hh", ".cc", ".cpp", ".cxx", ".c", ".cu", ".cuh")
DOC = "docs/ARCHITECTURE.md"

# The planner's link closure may hold neither of these.
PLANNER = "strata_planner"
PLANNER_FORBIDDEN = [("strata_offload", re.compile(r"^strata_offload$")),
                     ("libtorch", re.compile(r"TORCH_LIBRARIES|^Torch::|^torch(_cpu|_cuda)?$|^c10$"))]


def part_of(path):
    for pattern, part in PATH_PARTS:
        if fnmatch.fnmatchcase(path, pattern):
            return part
    return None


class Arrow:
    def __init__(self):
        self.sites = []  # (where "file:line", what, kind) with kind "link" or "include"


def parse_doc(root):
    """The ```arrows block: 'layer A B ...' lines top to bottom, then 'a -> b c ...' lines,
    where a target may carry '[header-only: H1 H2]' (only #include of those headers)."""
    path = os.path.join(root, DOC)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError as e:
        sys.exit(f"check_arrows: cannot read {DOC}: {e.strerror}")
    start = next((i for i, l in enumerate(lines) if l.strip() == "```arrows"), None)
    if start is None:
        sys.exit(f"check_arrows: {DOC} has no ```arrows block")
    layers, allowed, header_only, errors = [], {}, {}, []
    for n in range(start + 1, len(lines)):
        raw = lines[n]
        text = raw.split("#", 1)[0].strip()
        where = f"{DOC}:{n + 1}"
        if raw.strip() == "```":
            break
        if not text:
            continue
        if text.startswith("layer "):
            layers.append(text.split()[1:])
            continue
        m = re.match(r"^(\S+)\s*->\s*(.+)$", text)
        if not m:
            errors.append(f"{where}: cannot read '{raw.strip()}'")
            continue
        src, rest = m.group(1), m.group(2)
        # a target with its header-only list: "offload[header-only: strata/offload/x.h]"
        for tm in re.finditer(r"([\w-]+)(\[header-only:([^\]]*)\])?", rest):
            dst = tm.group(1)
            if (src, dst) in allowed:
                errors.append(f"{where}: {src} -> {dst} is listed twice")
            allowed[(src, dst)] = where
            if tm.group(2):
                header_only[(src, dst)] = set(tm.group(3).split())
    else:
        errors.append(f"{DOC}: the ```arrows block is not closed")
    return layers, allowed, header_only, errors


def strip_cmake_comments(text):
    out = []
    for line in text.split("\n"):
        in_q = False
        for i, ch in enumerate(line):
            if ch == '"':
                in_q = not in_q
            elif ch == "#" and not in_q:
                line = line[:i]
                break
        out.append(line)
    return "\n".join(out)


def cmake_commands(root, rel):
    """(command, [(token, line)]) for add_library, add_executable, target_sources,
    target_link_libraries and target_include_directories of one CMakeLists.txt."""
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        text = strip_cmake_comments(f.read())
    result = []
    for m in re.finditer(r"\b(add_library|add_executable|target_sources|target_link_libraries|"
                         r"target_include_directories)\s*\(", text, re.IGNORECASE):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        body_start = m.end()
        tokens = []
        for tm in re.finditer(r'"[^"]*"|[^\s"]+', text[body_start:i - 1]):
            line = text.count("\n", 0, body_start + tm.start()) + 1
            tokens.append((tm.group(0).strip('"'), line))
        result.append((m.group(1).lower(), tokens))
    return result


def read_cmake(root):
    files = ["CMakeLists.txt"] + [f"{d}/CMakeLists.txt" for d in SCANNED]
    aliases, sources, links, include_dirs = {}, collections.defaultdict(list), [], []
    defined = {}  # target -> "file:line" of its add_library / add_executable
    keywords = {"PUBLIC", "PRIVATE", "INTERFACE", "LINK_PUBLIC", "LINK_PRIVATE", "STATIC",
                "SHARED", "MODULE", "OBJECT", "SYSTEM", "BEFORE", "AFTER", "EXCLUDE_FROM_ALL"}
    for rel in files:
        if not os.path.exists(os.path.join(root, rel)):
            continue
        d = os.path.dirname(rel)
        for cmd, tokens in cmake_commands(root, rel):
            if not tokens:
                continue
            target = tokens[0][0]
            args = [(t, l) for t, l in tokens[1:] if t not in keywords]
            if cmd == "add_library" and args and args[0][0] == "ALIAS":
                aliases[target] = args[1][0]
            elif cmd in ("add_library", "add_executable", "target_sources"):
                if args and args[0][0] in ("IMPORTED", "UNKNOWN", "ALIAS", "INTERFACE"):
                    continue
                if cmd != "target_sources":
                    defined.setdefault(target, f"{rel}:{tokens[0][1]}")
                for t, l in args:
                    if not t.startswith("$") and t.endswith(SOURCE_EXT):
                        sources[target].append((os.path.normpath(os.path.join(d, t)), f"{rel}:{l}"))
            elif cmd == "target_link_libraries":
                for t, l in args:
                    links.append((target, t, f"{rel}:{l}"))
            elif cmd == "target_include_directories":
                for t, l in args:
                    t = t.replace("${CMAKE_CURRENT_SOURCE_DIR}", d or ".")
                    t = t.replace("${CMAKE_SOURCE_DIR}", ".").replace("${PROJECT_SOURCE_DIR}", ".")
                    if "$" not in t:
                        include_dirs.append(os.path.normpath(t))
    resolve = lambda t: aliases.get(t, t)
    links = [(resolve(a), resolve(b), where) for a, b, where in links]
    sources = {resolve(t): s for t, s in sources.items()}
    return defined, sources, links, include_dirs


def scan_includes(root, include_dirs):
    """Every source file, and [(file, line, included text, resolved path)] for every quoted
    #include."""
    files, found, unresolved = [], [], []
    inc_re = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
    for top in SCANNED:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(x for x in dirnames if not x.startswith("."))
            for name in sorted(filenames):
                if not name.endswith(SOURCE_EXT):
                    continue
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                files.append(rel)
                with open(full, encoding="utf-8", errors="replace") as f:
                    for n, line in enumerate(f, 1):
                        m = inc_re.match(line)
                        if not m:
                            continue
                        inc = m.group(1)
                        target = resolve_include(root, rel, inc, include_dirs)
                        if target is None:
                            unresolved.append(f"{rel}:{n}: #include \"{inc}\"")
                        else:
                            found.append((rel, n, inc, target))
    return files, found, unresolved


def resolve_include(root, rel, inc, include_dirs):
    parts = inc.split("/")
    if len(parts) >= 3 and parts[0] == "strata" and parts[1] in INCLUDE_LIBS:
        # mapped by where it lives, or would live (a header being added maps all the same)
        return f"{INCLUDE_LIBS[parts[1]]}/include/{inc}"
    own = os.path.dirname(rel)
    top = rel.split("/")[0]
    dirs = [own] + [d for d in include_dirs if d.split("/")[0] == top] + \
           [d for d in include_dirs if d.split("/")[0] != top]
    for d in dirs:
        cand = os.path.normpath(os.path.join(d, inc)).replace(os.sep, "/")
        if os.path.isfile(os.path.join(root, cand)):
            return cand
    return None


def main(argv):
    args = [a for a in argv[1:] if not a.startswith("--")]
    listing = "--list" in argv[1:]
    root = os.path.abspath(args[0] if args else os.path.join(os.path.dirname(__file__), ".."))
    layers, allowed, header_only, errors = parse_doc(root)
    rank = {}
    for i, names in enumerate(layers):
        for p in names:
            if p in rank:
                errors.append(f"{DOC}: part {p} is in two layers")
            rank[p] = i
    known = {p for _, p in PATH_PARTS} | {p for p, _ in TARGET_PARTS.values()}
    for p in sorted(known - set(rank)):
        errors.append(f"{DOC}: part {p} (scripts/check_arrows.py) is in no layer of the ```arrows block")
    for p in sorted(set(rank) - known):
        errors.append(f"{DOC}: layer names {p}, which scripts/check_arrows.py does not know")
    for (a, b), where in sorted(allowed.items()):
        if a not in rank or b not in rank:
            errors.append(f"{where}: {a} -> {b} names an unknown part")
        elif rank[b] <= rank[a]:
            errors.append(f"{where}: the allowed arrow {a} -> {b} does not point down the layers")

    defined, sources, links, include_dirs = read_cmake(root)
    for target, where in sorted(defined.items()):
        if target not in TARGET_PARTS:
            errors.append(f"{where}: target {target} is no part (add it to TARGET_PARTS in "
                          "scripts/check_arrows.py)")
    arrows = collections.defaultdict(Arrow)
    n_link = 0
    for a, b, where in links:
        if a in TARGET_PARTS and b in TARGET_PARTS:
            pa, pb = TARGET_PARTS[a][0], TARGET_PARTS[b][0]
            if pa != pb:
                arrows[(pa, pb)].sites.append((where, f"{a} links {b}", "link"))
                n_link += 1
    # a library compiling another part's source would hide that part's arrows behind its own
    for target, srcs in sorted(sources.items()):
        if target not in TARGET_PARTS:
            continue
        for path, where in srcs:
            p = part_of(path)
            if p is not None and p not in TARGET_PARTS[target][1]:
                errors.append(f"{where}: {target} compiles {path}, which is part {p}, not "
                              f"{'/'.join(sorted(TARGET_PARTS[target][1]))}")

    files, includes, unresolved = scan_includes(root, include_dirs)
    errors += [f"{u}: not found (relative to the file or an include directory of the CMake files)"
               for u in unresolved]
    unmapped = set()
    for path in files + [target for _, _, _, target in includes]:
        if part_of(path) is None and path not in unmapped:
            unmapped.add(path)
            errors.append(f"{path}: in no part (add it to PATH_PARTS in scripts/check_arrows.py)")
    n_inc = 0
    for rel, n, inc, target in includes:
        pa, pb = part_of(rel), part_of(target)
        if pa is None or pb is None or pa == pb:
            continue
        arrows[(pa, pb)].sites.append((f"{rel}:{n}", f'#include "{inc}"', "include"))
        n_inc += 1

    offending = []
    for (a, b), arrow in sorted(arrows.items(), key=lambda kv: (rank.get(kv[0][0], 99), kv[0])):
        if a not in rank or b not in rank:
            continue  # reported above
        if rank[b] <= rank[a]:
            why = "points upward" if rank[b] < rank[a] else "points sideways (one layer)"
            offending.append((a, b, why, arrow.sites))
        elif (a, b) not in allowed:
            offending.append((a, b, "is not an allowed arrow", arrow.sites))
        elif (a, b) in header_only:
            bad = [s for s in arrow.sites if s[2] == "link" or
                   s[1][len('#include "'):-1] not in header_only[(a, b)]]
            if bad:
                offending.append((a, b, "is allowed only as #include of "
                                  + ", ".join(sorted(header_only[(a, b)])), bad))

    closure_errors = planner_closure(links)

    if listing:
        for (a, b), arrow in sorted(arrows.items()):
            kinds = collections.Counter(k for _, _, k in arrow.sites)
            print(f"{a} -> {b}: " + ", ".join(f"{c} {k}" for k, c in sorted(kinds.items())))
    for e in errors:
        print(f"ERROR {e}")
    for a, b, why, sites in offending:
        print(f"FAIL {a} -> {b} {why}:")
        for where, what, _ in sites:
            print(f"    {where}: {what}")
    for e in closure_errors:
        print(f"FAIL {e}")
    unused = sorted(set(allowed) - set(arrows))
    if errors or offending or closure_errors:
        print(f"check_arrows: {len(offending) + len(closure_errors)} failing arrow(s), "
              f"{len(errors)} other error(s); the allowed arrows are in {DOC} (```arrows)")
        return 1
    print(f"check_arrows: {len(rank)} parts in {len(layers)} layers; {len(arrows)} arrows "
          f"({n_link} link lines, {n_inc} includes; {len(files)} source files), all allowed and "
          f"pointing down; {PLANNER}'s link closure has no strata_offload and no libtorch")
    if unused:
        print("  allowed but not used now: " + ", ".join(f"{a} -> {b}" for a, b in unused))
    return 0


def planner_closure(links):
    graph = collections.defaultdict(list)
    for a, b, where in links:
        graph[a].append((b, where))
    parent = {PLANNER: None}
    queue = collections.deque([PLANNER])
    while queue:
        t = queue.popleft()
        for b, where in graph.get(t, []):
            if b not in parent:
                parent[b] = (t, where)
                queue.append(b)
    out = []
    for label, pattern in PLANNER_FORBIDDEN:
        for t in sorted(parent):
            if pattern.search(t):
                chain, x = [], t
                while parent[x] is not None:
                    p, where = parent[x]
                    chain.append(f"{p} -> {x} ({where})")
                    x = p
                out.append(f"{PLANNER}'s link closure holds {label}: " + ", ".join(reversed(chain)))
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv))
