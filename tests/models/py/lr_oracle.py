"""Learning rates step by step from transformers' schedulers: the oracle of Strata's schedules.

Reads a JSON list of {"decay", "warmup_steps", "total_steps", "min_lr_ratio", "lr", "steps"} on
stdin; prints a JSON list with, for each, the learning rate of steps 0..steps-1 as a torch
optimizer sees it (param_groups[0]["lr"] before optimizer.step(), scheduler.step() after).
"""
import json
import sys

import torch
import transformers

specs = json.load(sys.stdin)
out = []
for s in specs:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=s["lr"])
    w, t, r = s["warmup_steps"], s["total_steps"], s["min_lr_ratio"]
    if s["decay"] == "constant":
        sched = transformers.get_constant_schedule_with_warmup(opt, num_warmup_steps=w)
    elif s["decay"] == "linear":
        assert r == 0, "transformers' linear schedule has no floor"
        sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=w, num_training_steps=t)
    elif r == 0:
        sched = transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=w, num_training_steps=t)
    else:
        sched = transformers.get_cosine_with_min_lr_schedule_with_warmup(
            opt, num_warmup_steps=w, num_training_steps=t, min_lr_rate=r)
    lrs = []
    for _ in range(s["steps"]):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    out.append(lrs)
json.dump(out, sys.stdout)
