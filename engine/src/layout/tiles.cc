#include "strata/engine/layout/tiles.h"

#include <algorithm>
#include <cmath>

namespace strata::engine::layout {
namespace {
uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
}  // namespace

uint64_t LogitsTiles::tiles(uint64_t tokens, uint64_t vocab) const {
  const uint64_t c = token_chunk ? token_chunk : tokens, v = vocab_tile ? vocab_tile : vocab;
  return c && v ? ceil_div(tokens, c) * ceil_div(vocab, v) : 1;
}

LogitsTiles logits_tiles(uint64_t tokens, uint64_t vocab, uint64_t count) {
  if (tokens == 0 || vocab == 0 || count <= 1) return {tokens, vocab};
  count = std::min(count, tokens * vocab);
  // Chunks of tokens: about sqrt(count * tokens / vocab), so that a tile's sides compare as the
  // whole's do; at least 1, at most the count, and only as many as the vocabulary cannot take
  // alone.
  uint64_t chunks = uint64_t(std::llround(std::sqrt(double(count) * double(tokens) / double(vocab))));
  chunks = std::clamp<uint64_t>(chunks, 1, std::min(tokens, count));
  const uint64_t pieces = std::min(vocab, ceil_div(count, chunks));
  if (pieces * chunks < count) chunks = std::min(tokens, ceil_div(count, pieces));
  // Even sizes; cutting n into ceil(n / size) pieces may give fewer than asked: then one more
  // vocabulary piece at a time (tokens once the vocabulary is cut to single rows) until the count
  // is reached.
  LogitsTiles t{ceil_div(tokens, chunks), ceil_div(vocab, pieces)};
  // Each turn shrinks a side by at least one, so the loop ends (at 1 x 1 tiles at the latest).
  const auto shrink = [](uint64_t n, uint64_t size) {
    return std::min(size - 1, ceil_div(n, ceil_div(n, size) + 1));
  };
  while (t.tiles(tokens, vocab) < count) {
    if (t.vocab_tile > 1) t.vocab_tile = shrink(vocab, t.vocab_tile);
    else t.token_chunk = shrink(tokens, t.token_chunk);
  }
  return t;
}

LogitsTiles one_pass_tiles(uint64_t tokens, uint64_t vocab, uint64_t count) {
  if (tokens == 0 || vocab == 0 || count <= 1) return {tokens, vocab};
  LogitsTiles t{ceil_div(tokens, std::min(count, tokens)), vocab, true};
  // Even chunks may come out fewer than asked (ceil): smaller ones until the count is reached.
  while (t.token_chunk > 1 && t.tiles(tokens, vocab) < std::min(count, tokens)) --t.token_chunk;
  return t;
}

LogitsTiles within_vocab_tiles(const LogitsTiles& t, uint64_t tokens, uint64_t vocab, uint64_t vocab_tiles) {
  if (vocab_tiles <= 1 || vocab == 0) return t;
  const uint64_t rows = ceil_div(vocab, std::min(vocab, vocab_tiles));
  return {t.token_chunk ? std::min(t.token_chunk, tokens) : tokens, std::min(t.vocab_tile ? t.vocab_tile : vocab, rows),
          false};
}

uint64_t max_auto_logits_tiles(uint64_t tokens, uint64_t vocab) {
  return ceil_div(tokens, std::min(tokens, kMinTileTokens)) * ceil_div(vocab, std::min(vocab, kMinTileVocab));
}

uint64_t max_efficient_logits_tiles(uint64_t tokens, uint64_t vocab) {
  const uint64_t efficient = std::max(kCheapLogitsTiles, ceil_div(tokens * vocab, kEfficientTileElements));
  return std::max<uint64_t>(1, std::min(efficient, max_auto_logits_tiles(tokens, vocab)));
}

uint64_t auto_mlp_token_chunk(uint64_t tokens) {
  return std::max((tokens + 7) / 8, std::min(tokens, kMinAutoMlpChunk));
}

uint64_t head_scratch_bytes(uint64_t tokens, uint64_t vocab, uint64_t hidden, uint64_t compute_bytes,
                            const LogitsTiles& t) {
  if (!t.tiled(tokens, vocab)) return tokens * vocab * (8 + compute_bytes);
  const uint64_t chunk = std::min(t.token_chunk, tokens), tile = std::min(t.vocab_tile, vocab);
  if (t.one_pass)
    return chunk * vocab * (4 + compute_bytes) + chunk * hidden * compute_bytes + tokens * hidden * 4 +
           vocab * hidden * (4 + compute_bytes) + tokens * 16;
  return chunk * tile * (4 + compute_bytes) + std::max(chunk, tile) * hidden * compute_bytes + tokens * hidden * 4 +
         tile * hidden * 4 + tokens * 16;
}

std::string describe(const LogitsTiles& t, uint64_t tokens, uint64_t vocab) {
  if (!t.tiled(tokens, vocab)) return "untiled";
  if (t.one_pass)
    return std::to_string(t.tiles(tokens, vocab)) + " tiles of " + std::to_string(std::min(t.token_chunk, tokens)) +
           " tokens x the whole vocabulary in one pass";
  return std::to_string(t.tiles(tokens, vocab)) + " tiles of " + std::to_string(std::min(t.token_chunk, tokens)) +
         " tokens x " + std::to_string(std::min(t.vocab_tile, vocab)) + " vocabulary rows";
}

}  // namespace strata::engine::layout
