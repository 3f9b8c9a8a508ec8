"""Tokenization in worker processes for `strata data prepare` (see prepare_data.py), in order.

`ordered(work, batches, workers, setup, setup_args)` yields work(batch) for every batch in the
order given. With one worker it runs here; with more, in that many processes (forked, each
running setup(*setup_args) once: the tokenizer is loaded in each worker, never before the fork,
as Hugging Face tokenizers ask), at most 4 batches a worker in flight, so that memory stays a few
batches whatever the input's size (multiprocessing's imap would read the whole input ahead).
The results are the same whatever the number of workers. An exception raised by work (a
PrepareError naming a bad record) is raised here, in order, after the batches before it.

`Progress` prints a line with the fraction done, examples/s and the time left: every 0.2 s on a
terminal (one line rewritten), every 10 s otherwise."""
import collections
import multiprocessing
import os
import sys
import time

_state = {}


def _setup(setup, args):
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core a worker: the workers are the parallelism
    _state["value"] = setup(*args)


def _run(work, batch):
    return work(_state["value"], batch)


def ordered(work, batches, workers, setup, setup_args=()):
    """work(state, batch) for each batch, in order; state = setup(*setup_args) once a worker."""
    if workers <= 1:
        state = setup(*setup_args)
        for b in batches:
            yield work(state, b)
        return
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(workers, initializer=_setup, initargs=(setup, setup_args)) as pool:
        pending = collections.deque()
        for b in batches:
            pending.append(pool.apply_async(_run, (work, b)))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _call(state, fn):
    return fn(state)


def in_worker(fn, setup, setup_args=()):
    """fn(state) (fn a module-level function) computed in a forked process, so that this one never
    loads the tokenizer before it forks the workers."""
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1, initializer=_setup, initargs=(setup, setup_args)) as pool:
        return pool.apply(_run, (_call, fn))


def default_workers():
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def clock(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    def __init__(self, verb, total_bytes):
        self.verb, self.total = verb, max(total_bytes, 1)
        self.tty = sys.stderr.isatty()
        self.t0 = self.last = time.monotonic()
        self.shown = False

    def update(self, done_bytes, examples, detail):
        now = time.monotonic()
        if now - self.last < (0.2 if self.tty else 10.0):
            return
        self.last, self.shown = now, True
        elapsed = now - self.t0
        frac = min(done_bytes / self.total, 1.0)
        eta = f", {clock(elapsed * (1 - frac) / frac)} left" if frac > 0 else ""
        msg = (f"{self.verb} {frac * 100:.0f}% ({examples} examples, {examples / max(elapsed, 1e-9):.0f} examples/s"
               f"{eta}, {detail})")
        print(("\r" + msg + "   ") if self.tty else msg, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def seconds(self):
        return time.monotonic() - self.t0

    def close(self):
        if self.tty and self.shown:
            print(file=sys.stderr)
