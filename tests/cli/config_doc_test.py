"""Every key `strata train` reads from a configuration file is documented in docs/CONFIG.md.

    config_doc_test.py SOURCE_DIR

The keys are those engine/src/config_parse.cc, config_model.cc, config_lora.cc and config_quantize.cc read (`s.read("key", ...)`, `read_bytes`, `read_enum`,
`get("key")`, by section); each must appear as a table row "| `key` |" in the section of
docs/CONFIG.md that documents its JSON object ("## `data`", ...). Exit 1 naming what is missing.
"""
import re
import sys

src = sys.argv[1]
code = "".join(open(f"{src}/engine/src/{f}").read() for f in ("config_parse.cc", "config_model.cc", "config_lora.cc", "config_quantize.cc"))
doc = open(f"{src}/docs/CONFIG.md").read()

# The parser reads each section in a function `void read_NAME(Section& s, ...)` (or inline in
# parse_train_config's `section("name", [&](Section& s) { ... })`); a function it calls with `s`
# reads the same section; `Section v(*x, "a.b", ...)` opens a nested one whose keys are read
# through `v`.
functions = {}
for m in re.finditer(r'^void (read_\w+)\(Section& s[^)]*\) \{\n(.*?)^\}', code, re.M | re.S):
    functions[m.group(1)] = m.group(2)
section_of = {}  # function -> section of its `s`
for m in re.finditer(r'Section s\([^,]+,\s*"([\w.]+)"[^;]*;\s*(read_\w+)\(s', code):
    section_of[m.group(2)] = m.group(1)
inline = {}
for m in re.finditer(r'section\("([\w.]+)",\s*\[&\]\(Section& s\)\s*\{(.*?)\}\);', code):
    for call in re.findall(r'(read_\w+)\(s\b', m.group(2)):
        section_of[call] = m.group(1)
    inline.setdefault(m.group(1), []).append(m.group(2))
changed = True
while changed:  # callees read their caller's section
    changed = False
    for f, body in functions.items():
        if f not in section_of:
            continue
        for call in re.findall(r'(read_\w+)\(s\b', body):
            if call not in section_of:
                section_of[call] = section_of[f]
                changed = True

keys = {"(top)": set()}
def reads(var, body):
    return set(re.findall(r'\b' + var + r'\.(?:read|read_bytes|read_enum|get)\("(\w+)"', body))
for f, body in functions.items():
    if f in section_of:
        keys.setdefault(section_of[f], set()).update(reads("s", body))
    for var, nested in re.findall(r'Section (\w+)\([^,]+,\s*"([\w.]+)"', body):
        if var != "s":
            keys.setdefault(nested, set()).update(reads(var, body))
for section, bodies in inline.items():
    for body in bodies:
        keys.setdefault(section, set()).update(reads("s", body))
unread = [f for f in functions if f not in section_of]
if unread:
    print("functions whose section this test cannot tell:", ", ".join(unread))
    sys.exit(1)
if sum(len(v) for v in keys.values()) < 50:
    print("found only", sum(len(v) for v in keys.values()), "keys: the parser's shape changed; fix this test")
    sys.exit(1)

# Sections of the doc: "## `name`" (or "### `name`") up to the next heading of that level.
doc_rows = {}
for m in re.finditer(r'^#{2,3} `([\w.]+)`\s*\n(.*?)(?=^#{2,3} |\Z)', doc, re.M | re.S):
    doc_rows.setdefault(m.group(1), set()).update(re.findall(r'^\| `(\w+)` \|', m.group(2), re.M))

missing = []
for section, ks in sorted(keys.items()):
    if section == "(top)":
        continue
    if "." in section:  # a nested object (optimizer.schedule): its keys named in its parent's row
        parent, child = section.split(".", 1)
        m = re.search(r'^#{2,3} `' + re.escape(parent) + r'`\s*\n(.*?)(?=^#{2,3} |\Z)', doc, re.M | re.S)
        row = re.search(r'^\| `' + re.escape(child) + r'` \|.*$', m.group(1), re.M) if m else None
        missing += [f"{section}.{k}" for k in sorted(ks) if not row or f"`{k}`" not in row.group(0)]
        continue
    have = doc_rows.get(section, set())
    for k in sorted(ks):
        if k not in have:
            missing.append(f"{section}.{k}")
print(f"{sum(len(v) for s, v in keys.items() if s != '(top)')} keys in {len(keys) - 1} sections")
if missing:
    print("not documented in docs/CONFIG.md:", ", ".join(missing))
    sys.exit(1)
print("OK")
