"""Every key `strata train` reads from a configuration file is documented in docs/CONFIG.md.

    config_doc_test.py SOURCE_DIR

The keys are those engine/src/config.cc reads (`s.read("key", ...)`, `read_bytes`, `read_enum`,
`get("key")`, by section); each must appear as a table row "| `key` |" in the section of
docs/CONFIG.md that documents its JSON object ("## `data`", ...). Exit 1 naming what is missing.
"""
import re
import sys

src = sys.argv[1]
code = open(f"{src}/engine/src/config.cc").read()
doc = open(f"{src}/docs/CONFIG.md").read()

# Sections of the code: `Section s(*x, "name", source)` up to the next Section.
keys = {}
parts = re.split(r'Section\s+(\w+)\((?:[^,]+),\s*"([\w.]+)"', code)
for i in range(1, len(parts), 3):
    var, section, body = parts[i], parts[i + 1], parts[i + 2]
    found = re.findall(var + r'\.(?:read|read_bytes|read_enum|get)\("(\w+)"', body)
    keys.setdefault(section, set()).update(found)

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
