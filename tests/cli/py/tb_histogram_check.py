"""Test oracle for histograms from Strata's TensorBoard event writer, using TensorBoard.

  tb_histogram_check.py DIR EXPECTED.json

EXPECTED.json: {"histograms": [{"tag", "step", "values": [...], "buckets": N}, ...]}, in the
order written. Reads DIR's event file with TensorBoard's EventAccumulator (what `tensorboard
--logdir` serves) and checks each histogram's min, max, count, sum, sum of squares, and its
buckets: N equal-width buckets from min to max (one where min == max), bucket i counting the
values x with floor((x - min) / (max - min) * N) == i (the last also max). Exits 1 on a mismatch.
"""
import json
import math
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def expected_buckets(values, n):
    lo, hi = min(values), max(values)
    if hi == lo:
        return [hi], [float(len(values))]
    counts = [0.0] * n
    for x in values:
        counts[min(n - 1, int((x - lo) / (hi - lo) * n))] += 1
    limits = [lo + (hi - lo) * (i + 1) / n for i in range(n - 1)] + [hi]
    return limits, counts


def main():
    d, expected_path = sys.argv[1], sys.argv[2]
    want = json.load(open(expected_path))["histograms"]
    acc = EventAccumulator(d, size_guidance={"histograms": 0})
    acc.Reload()
    errs = []
    for w in want:
        got = [h for h in acc.Histograms(w["tag"]) if h.step == w["step"]]
        if len(got) != 1:
            errs.append(f"{w['tag']} step {w['step']}: {len(got)} histograms")
            continue
        h = got[0].histogram_value
        v = w["values"]
        limits, counts = expected_buckets(v, w["buckets"])
        checks = {"min": (h.min, min(v)), "max": (h.max, max(v)), "num": (h.num, len(v)), "sum": (h.sum, sum(v)),
                  "sum_squares": (h.sum_squares, sum(x * x for x in v))}
        for k, (g, e) in checks.items():
            if not math.isclose(g, e, rel_tol=1e-12, abs_tol=1e-15):
                errs.append(f"{w['tag']}: {k} {g}, want {e}")
        if [round(x, 12) for x in h.bucket_limit] != [round(x, 12) for x in limits] or list(h.bucket) != counts:
            errs.append(f"{w['tag']}: buckets {list(h.bucket_limit)} {list(h.bucket)}, want {limits} {counts}")
    for e in errs:
        print(e)
    if not errs:
        print(f"ok: {len(want)} histograms")
    return 1 if errs else 0


if __name__ == "__main__":
    sys.exit(main())
