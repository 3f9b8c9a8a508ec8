#include "strata/engine/plan/tiling.h"

#include <algorithm>
#include <cmath>

namespace strata::engine::plan {
namespace {
uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
// The size that cuts n into `pieces` (>= 1) pieces: the even ceil(n / pieces) when that gives as
// many, else the largest size that gives at least as many.
uint64_t piece_size(uint64_t n, uint64_t pieces) {
  const uint64_t even = ceil_div(n, pieces);
  if (pieces <= 1 || ceil_div(n, even) >= pieces) return even;
  return std::max<uint64_t>(1, ceil_div(n, pieces - 1) - 1);
}
}  // namespace

uint64_t LogitsTiling::tiles(uint64_t tokens, uint64_t vocab) const {
  const uint64_t c = token_chunk ? token_chunk : tokens, v = vocab_tile ? vocab_tile : vocab;
  return c && v ? ceil_div(tokens, c) * ceil_div(vocab, v) : 1;
}

LogitsTiling logits_tiling(uint64_t tokens, uint64_t vocab, uint64_t count) {
  if (tokens == 0 || vocab == 0) return {tokens, vocab};
  count = std::clamp<uint64_t>(count, 1, tokens * vocab);
  // Chunks of tokens: about sqrt(count * tokens / vocab), so that a tile's sides compare as the
  // whole's do; at least 1, and only as many as the vocabulary cannot take alone.
  uint64_t chunks = uint64_t(std::llround(std::sqrt(double(count) * double(tokens) / double(vocab))));
  chunks = std::clamp<uint64_t>(chunks, 1, tokens);
  uint64_t pieces = std::min(vocab, ceil_div(count, chunks));
  if (pieces * chunks < count) chunks = std::min(tokens, ceil_div(count, pieces));
  return {piece_size(tokens, chunks), piece_size(vocab, pieces)};
}

uint64_t head_scratch_bytes(uint64_t tokens, uint64_t vocab, uint64_t hidden, uint64_t compute_bytes,
                            const LogitsTiling& t) {
  if (!t.tiled(tokens, vocab)) return tokens * vocab * (8 + compute_bytes);
  return t.token_chunk * t.vocab_tile * (8 + compute_bytes) + tokens * hidden * 4 + t.vocab_tile * hidden * 4 +
         tokens * 16;
}

std::string describe(const LogitsTiling& t, uint64_t tokens, uint64_t vocab) {
  if (!t.tiled(tokens, vocab)) return "untiled";
  return std::to_string(t.tiles(tokens, vocab)) + " tiles of " + std::to_string(std::min(t.token_chunk, tokens)) +
         " tokens x " + std::to_string(std::min(t.vocab_tile, vocab)) + " vocabulary rows";
}

}  // namespace strata::engine::plan
