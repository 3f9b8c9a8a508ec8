"""bitsandbytes' 4-bit quantization on the CPU, the oracle of tests/kernels/quant4_test.cc.

Usage: bnb_quant4_oracle.py OUT_DIR

Writes OUT_DIR/cases.json (a list of {name, n, blocksize, type, dtype}) and per case NAME.in (the
input's raw bytes in its dtype), NAME.packed (quantize_4bit's bytes), NAME.absmax (fp32) and
NAME.out (dequantize_4bit back to the input's dtype, raw bytes). Inputs are fresh random values
of awkward sizes (not multiples of 64 or 256), tiny and large magnitudes, zeros, a block of one
repeated value, values on the codes' midpoints, in fp32, bf16 and fp16.
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


def main():
    import bitsandbytes.functional as F
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
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
