"""Tokenization in worker processes for `strata data prepare` (see prepare_data.py), in order.

`ordered(work, batches, workers, setup, setup_args)` yields work(batch) for every batch in the
order given. With one worker it runs here; with more, in that many processes (forked, each
running setup(*setup_args) once: the tokenizer is loaded in each worker, never before the fork,
as Hugging Face tokenizers ask), at most 4 batches a worker in flight, so that memory stays a few
batches whatever the input's size (multiprocessing's imap would read the whole input ahead).
The results are the same whatever the number of workers. An exception raised by work or by a
worker's setup (a PrepareError naming a bad record, a tokenizer that does not load) is raised
here, in order, after the batches before it; a worker that dies fails the run.

`Progress` prints a line with the fraction done, examples/s and the time left: every 0.2 s on a
terminal (one line rewritten), every 10 s otherwise."""
import collections
import multiprocessing
import os
import signal
import sys
import time

from prepare_data_io import fail

_state = {}


def _setup(setup, args):
    # Ctrl-C is the main process's to handle (it removes the partial output and ends the pool).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core a worker: the workers are the parallelism
    try:
        _state["value"] = setup(*args)
    except Exception as e:  # noqa: BLE001 (kept, and raised by the first task: a pool cannot report it)
        _state["error"] = e


def _run(work, batch):
    if "error" in _state:
        raise _state["error"]
    return work(_state["value"], batch)


class _Pool:
    """Forked worker processes; a worker that dies (killed, out of memory) fails the run."""

    def __init__(self, workers, setup, setup_args):
        from concurrent.futures import ProcessPoolExecutor

        self.ex = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                      initializer=_setup, initargs=(setup, setup_args))

    def submit(self, work, batch):
        return self.ex.submit(_run, work, batch)

    @staticmethod
    def result(future):
        from concurrent.futures.process import BrokenProcessPool

        try:
            return future.result()
        except BrokenProcessPool:
            fail("a tokenizing worker process died (killed, or out of memory?): give fewer --workers")

    def close(self):
        self.ex.shutdown(wait=True, cancel_futures=True)


def ordered(work, batches, workers, setup, setup_args=()):
    """work(state, batch) for each batch, in order; state = setup(*setup_args) once a worker."""
    if workers <= 1:
        state = setup(*setup_args)
        for b in batches:
            yield work(state, b)
        return
    pool = _Pool(workers, setup, setup_args)
    try:
        pending = collections.deque()
        for b in batches:
            pending.append(pool.submit(work, b))
            if len(pending) >= 4 * workers:
                yield pool.result(pending.popleft())
        while pending:
            yield pool.result(pending.popleft())
    finally:
        pool.close()


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
