// The exchange of a load from node-local disks (load.cc, load_recut.cc): where some rank of this
// run cannot read a data file its slice of a (unit, kind) needs, every chunk of that (unit, kind)
// is read once, by the rank that serves it, and what each owning rank needs of it travels there
// by an all-to-all: only the needed elements, never a unit's buffer, in rounds that keep what is
// in flight on every rank within a bound (ExchangeLimits: 64 MiB by default).
//
// The rounds are planned alike on every rank from the same list of needs (plan_exchange, a pure
// function), so every rank issues the same number of all-to-alls and the pieces line up: a
// sender packs its pieces for each rank in the plan's order (chunk, then element), and the
// receiver unpacks them in the same order. Each element is copied, never summed: exact for
// every bit pattern.
//
// Ownership: the plan is a value; the caller's slice is written in place.
// Errors: a failed read is kept by the LoadFailure (the rank goes on sending zeros of the agreed
// sizes, so every all-to-all still runs) and agreed by the caller at the end of the load.
// Thread safety: exchange_slices is a collective, called by every rank in the same order on the
// training thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "checkpoint/catalog.h"
#include "checkpoint/chunk_reader.h"
#include "checkpoint/load_support.h"
#include "strata/engine/comm.h"

namespace strata::engine::ckpt {

// Elements [from, from + numel) of `chunk` (in its saved unit's element numbering) go to rank
// `owner`'s slice at element `to`.
struct ExchangeNeed {
  Chunk chunk;
  uint64_t from = 0, numel = 0;
  int owner = 0;
  uint64_t to = 0;
};

// What one rank holds in flight in one round, in bytes: the chunks it reads (whole: their CRC
// covers them whole), the pieces it sends, the pieces it receives. A chunk larger than a bound
// is alone in its role on its rank in that round.
struct ExchangeLimits {
  uint64_t read_bytes = 16ull << 20, send_bytes = 16ull << 20, receive_bytes = 32ull << 20;
  // Collective: the default, or rank 0's STRATA_EXCHANGE_BYTES (a whole number of bytes: a
  // quarter to read, a quarter to send, half to receive), which the tests set small to make many
  // rounds. Rank 0's value reaches every rank, so that all plan the same rounds; a bad one throws
  // std::invalid_argument on every rank alike.
  static ExchangeLimits agreed(Communicator& comm);
};

struct ExchangePlan {
  std::vector<ExchangeNeed> needs;  // sorted by (chunk, from)
  std::vector<int> server;          // [need]: the rank that reads its chunk
  std::vector<uint32_t> round;      // [need]: every need of a chunk travels in the same round
  uint32_t rounds = 0;
};

// Chunks in order, each in the first round, no earlier than the last round of the ranks it
// involves, in which its server's reads and sends and each owner's receipts stay within `limits`
// (a greedy list schedule: chunks of disjoint ranks share rounds). Alike on every rank.
// `server(chunk)` must be a rank that sees the chunk's file.
ExchangePlan plan_exchange(std::vector<ExchangeNeed> needs, const std::function<int(const Chunk&)>& server, int world,
                           const ExchangeLimits& limits);

// Collective: runs `plan`'s rounds. This rank reads the chunks it serves (through `reader`, after
// `failure` fails: nothing), sends each owner its pieces, and writes the pieces it owns into
// `slice` (any device; undefined after a failure: nothing is written).
void exchange_slices(Communicator& comm, ChunkReader& reader, LoadFailure& failure, const ExchangePlan& plan,
                     const at::Tensor& slice);

}  // namespace strata::engine::ckpt
