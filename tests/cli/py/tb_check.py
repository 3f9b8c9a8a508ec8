"""Test oracle for Strata's TensorBoard event writer (cli/tensorboard.cc), using TensorBoard.

  tb_check.py DIR EXPECTED.json

DIR must hold exactly one event file. EXPECTED.json: {"points": [{"tag": .., "step": ..,
"value": "<double as text: 1e-08, -inf, nan>", "wall_time": ..}, ...]} in the order written.

Checks, with TensorBoard's own code:
  1. every record through its TFRecord reader (length and data CRC32C checked; a bad CRC is a
     DataLossError) and its Event proto: the first is file_version "brain.Event:2", then one
     scalar event per expected point (tag, step, wall_time exact, value == float32(value));
  2. EventAccumulator (what `tensorboard --logdir` serves): the same series for every tag whose
     steps are never negative (the accumulator discards a step below an earlier one as the
     orphan of a restarted run).
Prints each mismatch and exits 1 if there was any.
"""
import glob
import json
import math
import os
import sys

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

errs = []


def same(got, want):
    want32 = float(np.float32(want))
    if math.isnan(want32):
        return math.isnan(got)
    return got == want32 and math.copysign(1, got) == math.copysign(1, want32)


def main():
    d, expected_path = sys.argv[1], sys.argv[2]
    with open(expected_path) as f:
        points = json.load(f)["points"]
    for p in points:
        p["value"] = float(p["value"])
    files = glob.glob(os.path.join(d, "*tfevents*"))
    if len(files) != 1:
        print(f"{d}: {len(files)} event files, want 1: {files}")
        return 1

    reader = PyRecordReader_New(files[0])
    events = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            break
        except errors.DataLossError as e:
            print(f"record {len(events)}: {e.message}")
            return 1
        events.append(event_pb2.Event.FromString(reader.record()))
    if not events or events[0].file_version != "brain.Event:2":
        errs.append(f"first record is not file_version brain.Event:2: {events[:1]}")
    scalars = events[1:]
    if len(scalars) != len(points):
        errs.append(f"{len(scalars)} scalar records, want {len(points)}")
    for i, (e, p) in enumerate(zip(scalars, points)):
        vals = e.summary.value
        if len(vals) != 1:
            errs.append(f"record {i + 1}: {len(vals)} summary values, want 1")
            continue
        v = vals[0]
        if v.tag != p["tag"] or e.step != p["step"] or e.wall_time != p["wall_time"] \
                or v.WhichOneof("value") != "simple_value" or not same(v.simple_value, p["value"]):
            errs.append(f"record {i + 1}: got ({v.tag!r}, {e.step}, {v.simple_value!r}, {e.wall_time!r}), "
                        f"want ({p['tag']!r}, {p['step']}, {p['value']!r} as float32, {p['wall_time']!r})")

    acc = EventAccumulator(d, size_guidance={"scalars": 0})
    acc.Reload()
    by_tag = {}
    for p in points:
        by_tag.setdefault(p["tag"], []).append(p)
    checked = {t for t, ps in by_tag.items() if all(p["step"] >= 0 for p in ps)}
    got_tags = set(acc.Tags()["scalars"])
    if not checked <= got_tags:
        errs.append(f"EventAccumulator lacks tags {sorted(checked - got_tags)}")
    for t in sorted(checked & got_tags):
        got = acc.Scalars(t)
        want = by_tag[t]
        if len(got) != len(want):
            errs.append(f"EventAccumulator {t!r}: {len(got)} points, want {len(want)}")
            continue
        for g, w in zip(got, want):
            if g.step != w["step"] or g.wall_time != w["wall_time"] or not same(g.value, w["value"]):
                errs.append(f"EventAccumulator {t!r}: got ({g.step}, {g.value!r}, {g.wall_time!r}), "
                            f"want ({w['step']}, {w['value']!r}, {w['wall_time']!r})")
    for e in errs[:50]:
        print(e)
    if not errs:
        print(f"ok: {len(points)} points, {len(by_tag)} tags ({len(checked)} through EventAccumulator)")
    return 1 if errs else 0


if __name__ == "__main__":
    sys.exit(main())
