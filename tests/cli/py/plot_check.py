"""Test oracle for `strata plot` (cli/plot*.cc), using Pillow.

  plot_check.py PNG WIDTH HEIGHT

Checks that PNG opens, is RGB of the given size and is a drawing: more than two colors, and in
each of the four panels (quadrants: loss, learning rate, tokens/s, memory) a share of
non-background pixels, and the panel's series colors (cli/plot_internal.h's palette) on enough pixels
that more than the legend swatch (under 100 pixels) was drawn. Prints each failure; exits 1.
"""
import sys

from PIL import Image

BLUE, ORANGE, GREEN, PURPLE = (31, 119, 180), (255, 127, 14), (44, 160, 44), (148, 103, 189)
PANELS = [("loss", [BLUE, ORANGE]), ("learning rate", [GREEN]), ("tokens/s", [PURPLE]),
          ("memory", [BLUE, ORANGE, GREEN])]
MIN_SERIES_PIXELS = 150


def main():
    path, w, h = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    img = Image.open(path)
    img.load()
    errs = []
    if img.size != (w, h):
        errs.append(f"size {img.size}, want {(w, h)}")
    if img.mode != "RGB":
        errs.append(f"mode {img.mode}, want RGB")
    img = img.convert("RGB")
    colors = img.getcolors(maxcolors=1 << 20)
    if len(colors) <= 2:
        errs.append(f"{len(colors)} distinct colors")
    bg = max(colors)[1]
    for i, (name, series) in enumerate(PANELS):
        x0, y0 = (i % 2) * img.width // 2, (i // 2) * img.height // 2
        cell = img.crop((x0, y0, x0 + img.width // 2, y0 + img.height // 2))
        counts = {c: n for n, c in cell.getcolors(maxcolors=1 << 20)}
        total = cell.width * cell.height
        ink = total - counts.get(bg, 0)
        if not 0.02 <= ink / total <= 0.6:
            errs.append(f"panel {name}: {ink / total:.3%} of pixels drawn")
        for c in series:
            if counts.get(c, 0) < MIN_SERIES_PIXELS:
                errs.append(f"panel {name}: series color {c} on {counts.get(c, 0)} pixels, "
                            f"want >= {MIN_SERIES_PIXELS}")
    for e in errs:
        print(e)
    if not errs:
        print(f"ok: {img.size}, {len(colors)} colors")
    return 1 if errs else 0


if __name__ == "__main__":
    sys.exit(main())
