"""The supervised fine-tuning file of `strata data prepare --chat` (docs/FORMATS.md), written as
the examples come, without holding them: a safetensors file with "offsets" (I64 [examples + 1]),
"tokens" (I32 [n]) and "loss_mask" (U8 [n]), in that order in the file.

Memory: the offsets (8 bytes an example); the tokens and the mask stream into two side files
(OUTPUT.tmp.tokens, OUTPUT.tmp.mask), which `finish` copies after the header and the offsets into
OUTPUT.tmp (copy_file_range: the kernel copies) and removes. `abandon` removes every temporary
file; the caller renames OUTPUT.tmp (prepare_data_io.commit)."""
import json
import os
import sys
from array import array

from prepare_data_io import fail


class SftWriter:
    def __init__(self, output):
        if sys.byteorder != "little":
            fail("this machine is big-endian: the sft file's ids are little-endian")
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        self.tmp = output + ".tmp"
        self.sides = {"tokens": self.tmp + ".tokens", "loss_mask": self.tmp + ".mask"}
        self.files = {k: open(p, "wb") for k, p in self.sides.items()}
        self.offsets = array("q", [0])
        if self.offsets.itemsize != 8 or array("i").itemsize != 4:
            fail("this Python has no int32/int64 array type")

    def add(self, tokens, mask, lengths):
        """Examples back to back: tokens (int32 bytes), mask (uint8 bytes), each example's length."""
        self.files["tokens"].write(tokens)
        self.files["loss_mask"].write(mask)
        end = self.offsets[-1]
        for n in lengths:
            end += n
            self.offsets.append(end)

    def finish(self, metadata):
        n, offsets = self.offsets[-1], self.offsets.tobytes()
        for f in self.files.values():
            f.close()
        layout, at = {}, 0
        for name, dtype, count, size in (("offsets", "I64", len(self.offsets), 8), ("tokens", "I32", n, 4),
                                         ("loss_mask", "U8", n, 1)):
            layout[name] = {"dtype": dtype, "shape": [count], "data_offsets": [at, at + count * size]}
            at += count * size
        header = json.dumps({"__metadata__": metadata, **layout}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors pads it
        with open(self.tmp, "wb") as out:
            out.write(len(header).to_bytes(8, "little") + header + offsets)
            for name in ("tokens", "loss_mask"):
                with open(self.sides[name], "rb") as src:
                    copy(src, out, os.path.getsize(self.sides[name]))
                os.unlink(self.sides[name])
            out.flush()
            os.fsync(out.fileno())

    def abandon(self):
        for f in self.files.values():
            f.close()
        for p in (self.tmp, *self.sides.values()):
            if os.path.exists(p):
                os.unlink(p)


def copy(src, dst, size):
    dst.flush()
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(src.fileno(), dst.fileno(), min(size - done, 1 << 30))
            if n == 0:
                break
            done += n
    except OSError:
        pass  # a file system without copy_file_range: copied through this process below
    if done < size:
        src.seek(done)
        dst.seek(0, os.SEEK_END)
        while True:
            block = src.read(1 << 24)
            if not block:
                break
            dst.write(block)
            done += len(block)
    if done != size:
        fail(f"copying {src.name}: {done} of {size} bytes")
    dst.seek(0, os.SEEK_END)
