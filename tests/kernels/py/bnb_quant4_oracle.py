"""bitsandbytes' 4-bit quantization on the CPU, the oracle of tests/kernels/quant4_test.cc.

Usage: bnb_quant4_oracle.py OUT_DIR [plain|nested|blockwise|all]   (default all)

Writes OUT_DIR/cases.json (a list of {name, n, blocksize, type, dtype}) and per case NAME.in (the
input's raw bytes in its dtype), NAME.packed (quantize_4bit's bytes), NAME.absmax (fp32) and
NAME.out (dequantize_4bit back to the input's dtype, raw bytes). Inputs are fresh random values
of awkward sizes (not multiples of 64 or 256), tiny and large magnitudes, zeros, a block of one
repeated value, values on the codes' midpoints, in fp32, bf16 and fp16.

Double quantization (compress_statistics=True): OUT_DIR/nested.json (the same fields) and per case
NAME.in, NAME.packed, NAME.qabsmax (uint8), NAME.nested (state2's fp32 absmax), NAME.offset (the
fp32 mean, 4 bytes), NAME.out; inputs with numbers of blocks not multiples of 256. The 8-bit
blockwise quantization alone: OUT_DIR/blockwise.json ({name, n, blocksize}) and NAME.in (fp32),
NAME.q, NAME.absmax, NAME.out. OUT_DIR/code8.bin holds create_dynamic_map() and OUT_DIR/code8_state.bin
the code that a quantize_blockwise's state carries (fp32 each).
"""
import json
import os
import sys

import torch


def inputs():
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    r = lambda n: torch.randn(n, generator=g)  # noqa: E731
    yield "awkward", r(1000)
    yield "one", r(1)
    yield "odd", r(63)
    yield "block_and_one", r(65)
    yield "long_tail", r(4097) * 3
    yield "tiny", r(300) * 1e-30
    yield "large", r(200) * 1e6
    yield "zeros", torch.zeros(129)
    yield "constant", torch.full((190,), -0.7)
    mixed = r(777)
    mixed[64:128] = 0.0
    mixed[128:192] = 2.5
    mixed[300] = -40.0
    yield "mixed", mixed
    # Values on the midpoints of the NF4 and FP4 tables (absmax 1 set by the first element).
    import bitsandbytes.functional as F
    for t in ("nf4", "fp4"):
        c = torch.sort(F.get_4bit_type(t, device="cpu")).values
        mids = (c[:-1] + c[1:]) / 2
        yield "midpoints_" + t, torch.cat([torch.tensor([1.0]), mids, -mids, mids * 0.999999, mids * 1.000001])


def nested_inputs(g):
    r = lambda n: torch.randn(n, generator=g)  # noqa: E731
    # Element counts give 1, 255, 257, 300, 513 and 1000 blocks of 64 (about half that of 128).
    yield "one_block", r(50)
    yield "blocks_255", r(64 * 255 - 7)
    yield "blocks_257", r(64 * 257)
    yield "blocks_300", r(64 * 300 - 33) * 5
    yield "blocks_513", r(64 * 512 + 1)
    yield "tiny", r(64 * 300 + 17) * 1e-30
    yield "large", r(64 * 270) * 1e6
    yield "zeros", torch.zeros(64 * 260 + 5)
    spread = r(64 * 1000) * torch.exp(torch.randn(1000, generator=g) * 3).repeat_interleave(64)
    spread[64 * 10:64 * 200] = 0.0
    spread[64 * 300:64 * 301] = -0.7  # a block of one value
    yield "spread", spread
    constant = torch.full((64 * 300 + 3,), 0.375)
    yield "constant", constant


def write(out, name, ext, t):
    with open(os.path.join(out, name + "." + ext), "wb") as f:
        f.write(t.contiguous().view(torch.uint8).numpy().tobytes())


def nested_cases(out, g):
    import bitsandbytes.functional as F
    cases = []
    for name, x in nested_inputs(g):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            if dtype == torch.float16 and x.abs().max() > 6e4:
                continue
            for t in ("nf4", "fp4"):
                for blocksize in (64, 128):
                    a = x.to(dtype)
                    q, st = F.quantize_4bit(a, blocksize=blocksize, quant_type=t, compress_statistics=True)
                    assert st.nested and st.state2.blocksize == 256 and st.absmax.dtype == torch.uint8
                    d = F.dequantize_4bit(q, st)
                    case = f"nested_{name}_{str(dtype)[6:]}_{t}_{blocksize}"
                    write(out, case, "in", a)
                    write(out, case, "packed", q)
                    write(out, case, "qabsmax", st.absmax)
                    write(out, case, "nested", st.state2.absmax.float())
                    write(out, case, "offset", st.offset.float().reshape(1))
                    write(out, case, "out", d.to(dtype))
                    cases.append({"name": case, "n": a.numel(), "blocksize": blocksize, "type": t,
                                  "dtype": str(dtype)[6:]})
    return cases


def blockwise_cases(out, g):
    import bitsandbytes.functional as F
    r = lambda n: torch.randn(n, generator=g)  # noqa: E731
    cases = []
    for i in range(24):
        n = int(torch.randint(1, 20000, (1,), generator=g))
        x = r(n) * float(10.0 ** (torch.rand(1, generator=g) * 60 - 30))
        if i % 3 == 0:
            x[: n // 3] = 0.0
        if i % 4 == 1:
            x = x - x.abs().max() / 2  # a shifted range, as absmax - offset is
        blocksize = (64, 256, 4096, 100)[i % 4]
        q, st = F.quantize_blockwise(x, blocksize=blocksize)
        d = F.dequantize_blockwise(q, st)
        case = f"blockwise_{i}"
        write(out, case, "in", x)
        write(out, case, "q", q)
        write(out, case, "absmax", st.absmax.float())
        write(out, case, "out", d.float())
        cases.append({"name": case, "n": n, "blocksize": blocksize})
        if i == 0:
            write(out, "code8_state", "bin", st.code.float())
    # Scaled values on the 65536 bins' edges and the codes' midpoints (absmax 1 set by the first).
    c = F.create_dynamic_map()
    edges = (torch.arange(65535, dtype=torch.float64) + 0.5) / 65535 * 2 - 1
    mids = (c[:-1] + c[1:]) / 2
    for k, v in enumerate((edges.float(), mids, c)):
        x = torch.cat([torch.tensor([1.0]), v, torch.nextafter(v, torch.tensor(2.0)).clamp(max=1.0), torch.nextafter(v, torch.tensor(-2.0))])
        q, st = F.quantize_blockwise(x, blocksize=x.numel())
        d = F.dequantize_blockwise(q, st)
        case = f"blockwise_edges_{k}"
        for ext, t in (("in", x), ("q", q), ("absmax", st.absmax.float()), ("out", d.float())):
            write(out, case, ext, t)
        cases.append({"name": case, "n": x.numel(), "blocksize": x.numel()})
    write(out, "code8", "bin", c)
    return cases


def main():
    import bitsandbytes.functional as F
    out, part = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "all"
    os.makedirs(out, exist_ok=True)
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    if part in ("nested", "all"):
        with open(os.path.join(out, "nested.json"), "w") as f:
            json.dump(nested_cases(out, g), f)
    if part in ("blockwise", "all"):
        with open(os.path.join(out, "blockwise.json"), "w") as f:
            json.dump(blockwise_cases(out, g), f)
    if part not in ("plain", "all"):
        return 0
    cases = []
    for name, x in inputs():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            if dtype == torch.float16 and x.abs().max() > 6e4:
                continue
            for t in ("nf4", "fp4"):
                for blocksize in (64, 128, 32):
                    a = x.to(dtype)
                    q, st = F.quantize_4bit(a, blocksize=blocksize, quant_type=t, compress_statistics=False)
                    d = F.dequantize_4bit(q, st)
                    case = f"{name}_{str(dtype)[6:]}_{t}_{blocksize}"
                    with open(os.path.join(out, case + ".in"), "wb") as f:
                        f.write(a.contiguous().view(torch.uint8).numpy().tobytes())
                    with open(os.path.join(out, case + ".packed"), "wb") as f:
                        f.write(q.contiguous().view(torch.uint8).numpy().tobytes())
                    with open(os.path.join(out, case + ".absmax"), "wb") as f:
                        f.write(st.absmax.float().contiguous().numpy().tobytes())
                    with open(os.path.join(out, case + ".out"), "wb") as f:
                        f.write(d.to(dtype).contiguous().view(torch.uint8).numpy().tobytes())
                    cases.append({"name": case, "n": a.numel(), "blocksize": blocksize, "type": t,
                                  "dtype": str(dtype)[6:]})
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
