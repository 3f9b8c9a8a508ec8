"""Strata's data order in Python, for oracles that feed transformers the batches Strata trains on:
std::mt19937_64, the packing rule (models::best_fit_decreasing) with its seeded tie order, and
the loader's per-epoch shuffle (models::BatchLoader), each as token_data.h states it."""

MASK64 = (1 << 64) - 1


class Mt19937_64:
    """std::mt19937_64 (the C++ standard's parameters); next() is operator()()."""

    def __init__(self, seed):
        self.mt = [seed & MASK64]
        for i in range(1, 312):
            prev = self.mt[-1]
            self.mt.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & MASK64)
        self.i = 312

    def next(self):
        if self.i >= 312:
            mt = self.mt
            for k in range(312):
                x = (mt[k] & ~0x7FFFFFFF & MASK64) | (mt[(k + 1) % 312] & 0x7FFFFFFF)
                xa = x >> 1
                if x & 1:
                    xa ^= 0xB5026F5AA96619E9
                mt[k] = mt[(k + 156) % 312] ^ xa
            self.i = 0
        y = self.mt[self.i]
        self.i += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & MASK64


def best_fit_decreasing(lengths, capacity, seed):
    """models::best_fit_decreasing: the items bin by bin."""
    n = len(lengths)
    items = list(range(n))
    rng = Mt19937_64((seed * 0x9E3779B97F4A7C15 + 0x7061636B) & MASK64)
    for i in range(n, 1, -1):
        j = rng.next() % i
        items[i - 1], items[j] = items[j], items[i - 1]
    items.sort(key=lambda i: -lengths[i])  # stable, as std::stable_sort
    bins, room, stamp = [], [], 0
    for i in items:
        fit = [r for r in room if r[0] >= lengths[i]]
        if fit:
            r = min(fit, key=lambda r: (r[0], r[1]))  # least room left; among equals the first there
            room.remove(r)
            b, free = r[2], r[0]
        else:
            b, free = len(bins), capacity
            bins.append([])
        bins[b].append(i)
        if free > lengths[i]:
            stamp += 1
            room.append([free - lengths[i], stamp, b])
    return bins


def epoch_permutation(size, seed, epoch):
    """models::BatchLoader's order of the samples in `epoch`."""
    perm = list(range(size))
    rng = Mt19937_64((seed * 0x9E3779B97F4A7C15 + epoch) & MASK64)
    for i in range(size - 1, 0, -1):
        j = rng.next() % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def global_samples(size, seed, first, count):
    """The samples of global positions first .. first + count - 1."""
    return [epoch_permutation(size, seed, s // size)[s % size] for s in range(first, first + count)]


if __name__ == "__main__":  # the standard's check: the 10000th output of a default-seeded engine
    g = Mt19937_64(5489)
    for _ in range(9999):
        g.next()
    assert g.next() == 9981545732273789042
    print("mt19937_64 OK")


def packed_batch(examples, bins, seq, window=0):
    """Windows of seq + 1 tokens holding `bins`' examples ((ids, mask) pairs) as Strata packs them,
    as transformers takes them: inputs [W, seq], per-example position ids, the block-diagonal causal
    mask [W, 1, seq, seq] (true: attend; with the sliding window when given), and the targets
    [W, seq] (-100 out of the loss and across examples)."""
    import torch
    w = len(bins)
    ids = torch.zeros(w, seq + 1, dtype=torch.long)
    labels = torch.full((w, seq + 1), -100, dtype=torch.long)
    seg = torch.zeros(w, seq + 1, dtype=torch.long)
    pos = torch.zeros(w, seq + 1, dtype=torch.long)
    for r, b in enumerate(bins):
        j = 0
        for k, e in enumerate(b):
            t, m = examples[e]
            n = min(len(t), seq + 1)
            ids[r, j:j + n] = torch.as_tensor(t[:n].astype("int64"))
            for q in range(1, n):  # the example's own targets
                if m[q]:
                    labels[r, j + q] = int(t[q])
            seg[r, j:j + n] = k
            pos[r, j:j + n] = torch.arange(n)
            j += n
        seg[r, j:] = len(b)
        pos[r, j:] = torch.arange(seq + 1 - j)
    s = seg[:, :seq]
    q, k = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    allowed = (k <= q) & (s[:, :, None] == s[:, None, :])
    if window:
        allowed &= (q - k) < window
    return ids[:, :seq], pos[:, :seq], allowed[:, None], labels[:, 1:]


def packed_loss(model, batch):
    """The mean cross entropy over a packed batch's counted targets. sdpa attention takes the
    boolean mask as given; eager attention (Gemma 2's) adds it, so it gets 0 / float min. A dict
    of masks by layer type (full_attention, sliding_attention) is passed as transformers' mask
    mapping."""
    import torch
    inputs, pos, mask, targets = batch
    def additive(m):
        return torch.zeros(m.shape).masked_fill(~m, torch.finfo(torch.float32).min)
    if model.config._attn_implementation == "eager":  # a mask per layer type (a dict) or one
        mask = {k: additive(v) for k, v in mask.items()} if isinstance(mask, dict) else additive(mask)
    logits = model(input_ids=inputs, position_ids=pos, attention_mask=mask).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                             ignore_index=-100, reduction="sum") / (targets != -100).sum()


def one_by_one_loss(model, examples, seq):
    """The mean cross entropy over every example's counted targets, each example (its first
    seq + 1 tokens) run alone and unpadded."""
    import torch
    total, count = 0.0, 0
    with torch.no_grad():
        for t, m in examples:
            n = min(len(t), seq + 1)
            ids = torch.as_tensor(t[:n].astype("int64"))[None]
            logits = model(input_ids=ids).logits[0].float()
            keep = torch.as_tensor(m[1:n] == 1)
            ce = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")
            total += float(ce[keep].sum())
            count += int(keep.sum())
    return total / count
