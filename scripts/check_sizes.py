#!/usr/bin/env python3
"""Sizes a reader can hold: no source file over 450 lines, no function over 80 lines in engine/ and
cli/ (docs/ARCHITECTURE.md, "Build"). Exits 1 naming each file or function over its limit.

Usage: scripts/check_sizes.py [REPO]   (default: the repository this script is in)

Functions are found by their braces: a `{` that opens at namespace or class level after a
parameter list `)` (not a control statement, a lambda or an initializer) starts one, and its
matching `}` ends it. Strings, characters and comments are skipped. Lines count from the line of
the signature's opening `{` to the closing `}`, both included.
"""
import pathlib
import re
import sys

FILE_LIMIT = 450
FUNCTION_LIMIT = 80
SOURCE_DIRS = ["offload", "kernels", "models", "tiling", "engine", "planner", "bench", "cli", "scripts", "tests"]
SOURCE_SUFFIXES = {".cc", ".h", ".c", ".cu", ".cuh", ".py", ".sh"}
FUNCTION_DIRS = ["engine", "cli"]
CONTROL = re.compile(r"\b(if|for|while|switch|catch|do|else|try)\s*(\(|$)")
SCOPE = re.compile(r"\b(namespace|class|struct|union|enum)\b[^()]*$")


def strip_code(text):
    """The text with comments, strings and character literals blanked (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # a digit separator: 1'000
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def long_functions(path):
    """(name, first line, lines) of each function over FUNCTION_LIMIT lines in a C++ file."""
    code = strip_code(path.read_text(errors="replace"))
    stack = []  # per open brace: "scope" (namespace, class, extern) or "body" (a function's) or "other"
    found = []
    start_of_statement = 0
    line = 1
    for i, c in enumerate(code):
        if c == "\n":
            line += 1
        elif c in ";":
            start_of_statement = i + 1
        elif c == "{":
            head = code[start_of_statement:i]
            flat = " ".join(head.split())
            kind = "other"
            if all(k[0] == "scope" for k in stack):
                if SCOPE.search(flat) or flat.startswith("extern"):
                    kind = "scope"
                elif re.search(r"\)\s*(const|noexcept|override|final|mutable|->\s*[\w:<>,\s*&]+|:\s*.*)?\s*$", flat) \
                        and not CONTROL.search(flat.split("(")[0] + "(") and not flat.endswith("=") \
                        and "[" not in flat.split("(")[0]:
                    kind = "body"
            stack.append((kind, line, flat))
            start_of_statement = i + 1
        elif c == "}":
            if stack:
                kind, first, flat = stack.pop()
                if kind == "body" and line - first + 1 > FUNCTION_LIMIT:
                    name = flat.split("(")[0].split()[-1] if "(" in flat else flat[:60]
                    found.append((name, first, line - first + 1))
            start_of_statement = i + 1
    return found


def main():
    repo = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
    problems = []
    files = 0
    for d in SOURCE_DIRS:
        for p in sorted((repo / d).rglob("*")):
            if not p.is_file() or p.suffix not in SOURCE_SUFFIXES or "py/__pycache__" in str(p):
                continue
            files += 1
            rel = p.relative_to(repo)
            lines = p.read_text(errors="replace").count("\n")
            if lines > FILE_LIMIT:
                problems.append(f"{rel}: {lines} lines (at most {FILE_LIMIT})")
            if rel.parts[0] in FUNCTION_DIRS and p.suffix in {".cc", ".h"}:
                for name, first, n in long_functions(p):
                    problems.append(f"{rel}:{first}: {name} is {n} lines (at most {FUNCTION_LIMIT})")
    for p in problems:
        print(p)
    if problems:
        print(f"check_sizes: {len(problems)} over their limits", file=sys.stderr)
        return 1
    print(f"check_sizes: {files} files within {FILE_LIMIT} lines, engine/ and cli/ functions within {FUNCTION_LIMIT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
