"""Test oracle for Strata's safetensors reader and writer, using the Python safetensors package.

  st_oracle.py make DIR
      Writes safetensors files with safetensors.numpy and safetensors.torch into DIR (awkward
      shapes: scalars, zero-sized, odd sizes; F32, F16, BF16, I64, U8, BOOL and more; metadata;
      names with quotes and non-ASCII), a sharded checkpoint in DIR/sharded (two shards and
      model.safetensors.index.json), the raw little-endian bytes of every tensor in DIR/bin/N.bin
      and DIR/expected.json describing all of it:
        {"files": [{"file": "np.safetensors", "metadata": {...},
                    "tensors": [{"name": .., "dtype": "F32", "shape": [..], "bin": "bin/3.bin"}]}],
         "sharded": [{"name": .., "dtype": .., "shape": [..], "bin": ..}]}
  st_oracle.py check FILE [FILE ...]
      Loads each FILE (written by Strata) with safetensors.torch.load_file,
      safetensors.numpy.load_file (when numpy has all its dtypes) and safe_open (metadata), and
      compares everything with FILE.json, a JSON description of the same form as one entry of
      "files" above (bin paths relative to its directory). Prints every mismatch, prefixed with
      the file, and exits 1 if there was any.
"""
import json
import os
import sys

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import load_file as np_load_file
from safetensors.numpy import save_file as np_save_file
from safetensors.torch import load_file as torch_load_file
from safetensors.torch import save_file as torch_save_file

TORCH_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
NP_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
             "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def raw_bytes(t):
    """The tensor's bytes as safetensors stores them (C order, little-endian)."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).tobytes()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def numpy_tensors(rng):
    return {
        "np.f32.matrix": rng.standard_normal((3, 5)).astype(np.float32),
        "np.f32.scalar": np.array(2.5, dtype=np.float32),
        "np.f16.odd": rng.standard_normal((7,)).astype(np.float16),
        "np.i64.cube": rng.integers(-2**62, 2**62, size=(2, 3, 4), dtype=np.int64),
        "np.u8.bytes": rng.integers(0, 256, size=(13,), dtype=np.uint8),
        "np.bool.mask": rng.integers(0, 2, size=(3, 3)).astype(np.bool_),
        "np.f32.empty": np.zeros((0,), dtype=np.float32),
        "np.i64.empty_mid": np.zeros((3, 0, 5), dtype=np.int64),
        "np.f64.ones": np.ones((1, 1, 1, 1), dtype=np.float64),
        "np.i32.col": rng.integers(-1000, 1000, size=(5, 1), dtype=np.int32),
        "np.i16.row": rng.integers(-1000, 1000, size=(1, 9), dtype=np.int16),
        "np.i8.vec": rng.integers(-128, 128, size=(11,), dtype=np.int8),
    }


def torch_tensors(g):
    return {
        "h.0.attn.c_attn.weight": torch.randn(4, 12, generator=g),
        "h.0.attn.c_attn.bias": torch.randn(12, generator=g).to(torch.bfloat16),
        "bf16.scalar": torch.tensor(-3.25, dtype=torch.bfloat16),
        "bf16.odd": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "f16.big": torch.randn(33, 65, generator=g).to(torch.float16),
        "i64.ids": torch.randint(0, 50000, (2, 9), generator=g),
        "u8.img": torch.randint(0, 256, (3, 4, 5), generator=g, dtype=torch.uint8),
        "bool.flags": torch.rand(17, generator=g) > 0.5,
        "bf16.empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "bool.empty": torch.zeros(0, dtype=torch.bool),
        'quote"and\\backslash': torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "ünïcödé.wëight": torch.randn(2, 2, generator=g),
    }


def make(out):
    os.makedirs(os.path.join(out, "bin"), exist_ok=True)
    counter = [0]

    def describe(tensors, dtype_of):
        entries = []
        for name, t in tensors.items():
            path = "bin/%d.bin" % counter[0]
            counter[0] += 1
            with open(os.path.join(out, path), "wb") as f:
                f.write(raw_bytes(t))
            entries.append({"name": name, "dtype": dtype_of(t), "shape": list(t.shape), "bin": path})
        return entries

    np_dtype = lambda a: {v: k for k, v in NP_DTYPES.items()}[a.dtype.type]
    torch_dtype = lambda t: TORCH_DTYPES[t.dtype]

    files = []
    rng = np.random.default_rng(7)
    tensors = numpy_tensors(rng)
    meta = {"format": "np", "note": "ünïcödé \"quoted\"", "empty": ""}
    np_save_file(tensors, os.path.join(out, "np.safetensors"), metadata=meta)
    files.append({"file": "np.safetensors", "metadata": meta,
                  "tensors": describe(tensors, np_dtype)})

    g = torch.Generator().manual_seed(11)
    tensors = torch_tensors(g)
    meta = {"format": "pt"}
    torch_save_file(tensors, os.path.join(out, "pt.safetensors"), metadata=meta)
    files.append({"file": "pt.safetensors", "metadata": meta,
                  "tensors": describe(tensors, torch_dtype)})

    # No metadata at all, one tensor; and no tensors at all (a zero-length data section).
    tensors = {"only": torch.randn(5, generator=g)}
    torch_save_file(tensors, os.path.join(out, "single.safetensors"))
    files.append({"file": "single.safetensors", "metadata": {},
                  "tensors": describe(tensors, torch_dtype)})
    torch_save_file({}, os.path.join(out, "empty.safetensors"))
    files.append({"file": "empty.safetensors", "metadata": {}, "tensors": []})
    tensors = {"z0": torch.zeros(0), "z1": torch.zeros(2, 0, dtype=torch.int64)}
    torch_save_file(tensors, os.path.join(out, "zeros.safetensors"), metadata={"k": "v"})
    files.append({"file": "zeros.safetensors", "metadata": {"k": "v"},
                  "tensors": describe(tensors, torch_dtype)})

    # A sharded checkpoint as transformers writes it.
    sharded_dir = os.path.join(out, "sharded")
    os.makedirs(sharded_dir, exist_ok=True)
    shards = [
        {"wte.weight": torch.randn(10, 4, generator=g), "h.0.ln.weight": torch.randn(4, generator=g),
         "h.0.ln.bias": torch.zeros(4, dtype=torch.bfloat16)},
        {"h.1.mlp.weight": torch.randn(4, 8, generator=g).half(), "lm_head.weight": torch.randn(10, 4, generator=g),
         "step": torch.tensor(7, dtype=torch.int64)},
    ]
    weight_map, sharded, total = {}, [], 0
    for i, tensors in enumerate(shards):
        shard = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
        torch_save_file(tensors, os.path.join(sharded_dir, shard), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = shard
            total += len(raw_bytes(t))
        sharded += describe(tensors, torch_dtype)
    with open(os.path.join(sharded_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"files": files, "sharded": sharded}, f, indent=1)


def check(path, description):
    with open(description) as f:
        want = json.load(f)
    base = os.path.dirname(os.path.abspath(description))
    problems = []
    by_torch = torch_load_file(path)
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        keys = set(f.keys())
    if metadata != want["metadata"]:
        problems.append("metadata %r != %r" % (metadata, want["metadata"]))
    names = [t["name"] for t in want["tensors"]]
    if keys != set(names) or set(by_torch) != set(names):
        problems.append("tensor names %r != %r" % (sorted(keys), sorted(names)))
    numpy_ok = all(t["dtype"] in NP_DTYPES for t in want["tensors"])
    by_numpy = np_load_file(path) if numpy_ok else {}
    for t in want["tensors"]:
        name = t["name"]
        with open(os.path.join(base, t["bin"]), "rb") as f:
            raw = f.read()
        got = by_torch.get(name)
        if got is None:
            continue
        if TORCH_DTYPES[got.dtype] != t["dtype"]:
            problems.append("%s: dtype %s != %s" % (name, TORCH_DTYPES[got.dtype], t["dtype"]))
        if list(got.shape) != t["shape"]:
            problems.append("%s: shape %s != %s" % (name, list(got.shape), t["shape"]))
        if raw_bytes(got) != raw:
            problems.append("%s: torch bytes differ" % name)
        if numpy_ok:
            a = by_numpy[name]
            if list(a.shape) != t["shape"] or raw_bytes(a) != raw:
                problems.append("%s: numpy shape %s or bytes differ" % (name, list(a.shape)))
    for p in problems:
        print("%s: %s" % (path, p), file=sys.stderr)
    if not problems:
        print("%s: ok, %d tensors" % (path, len(names)))
    return not problems


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) >= 3 and sys.argv[1] == "check":
        results = [check(f, f + ".json") for f in sys.argv[2:]]
        sys.exit(0 if all(results) else 1)
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
