// How the LM head's logits [tokens, vocab] are cut into tiles (token chunks x vocabulary tiles),
// and the device bytes the head's loss needs for a cut: the one rule that the engine's loss
// (tiling::linear_cross_entropy_sum gets the chunk and tile sizes), the memory model and
// `--plan` use. No libtorch.
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string>

namespace strata::engine::layout {

struct LogitsTiles {
  uint64_t token_chunk = 0;  // tokens a tile covers (0: not cut, as token_chunk == tokens)
  uint64_t vocab_tile = 0;   // vocabulary rows a tile covers (0: not cut)
  // Token chunks over the whole vocabulary, each chunk's loss and gradients computed at once in
  // the forward (tiling::linear_cross_entropy_sum's one pass): no logits recomputed in the
  // backward, for an fp32 weight gradient held from the forward to the backward.
  bool one_pass = false;
  bool tiled(uint64_t tokens, uint64_t vocab) const {
    return (token_chunk && token_chunk < tokens) || (vocab_tile && vocab_tile < vocab);
  }
  uint64_t tiles(uint64_t tokens, uint64_t vocab) const;
  // The backward computes the logits again: tiled in two passes (tiling::linear_cross_entropy_sum,
  // and the vocabulary-tiled head, whose cut within_vocab_tiles gives). The planner prices it.
  bool recomputes_logits(uint64_t tokens, uint64_t vocab) const { return tiled(tokens, vocab) && !one_pass; }
};

// At least `count` tiles (1: the logits whole), as few over as the division allows. The
// vocabulary is cut first (each weight tile is then read once a pass); tokens only once a
// vocabulary tile would be narrower than the token chunk, so tiles stay near square and their
// matmuls large. `count` beyond tokens x vocab is clamped.
LogitsTiles logits_tiles(uint64_t tokens, uint64_t vocab, uint64_t count);

// At least `count` tiles in one pass (as few over as even chunks allow): token chunks over the
// whole vocabulary (count clamped to the tokens); 1 or less: the logits whole.
LogitsTiles one_pass_tiles(uint64_t tokens, uint64_t vocab, uint64_t count);

// The tiles the loss runs over when the LM head's weight is cut into `vocab_tiles` row ranges
// (models::LayerTiles::vocab): `t`'s, no wider than a range (so tiled whenever the ranges are
// more than one), in two passes (the ranges are never together).
LogitsTiles within_vocab_tiles(const LogitsTiles& t, uint64_t tokens, uint64_t vocab, uint64_t vocab_tiles);

// The most tiles placement.tiling "auto" considers: tiles of at least kMinTileTokens tokens x
// kMinTileVocab vocabulary rows (or the whole of a smaller side). Smaller tiles would spend more
// on per-tile overhead than they save; an explicit count may still ask for them.
constexpr uint64_t kMinTileTokens = 64, kMinTileVocab = 1024;
uint64_t max_auto_logits_tiles(uint64_t tokens, uint64_t vocab);

// The most logits tiles "auto" cuts before it would rather cut the vocabulary into more tiles
// (units): tiles of about kEfficientTileElements logits (tokens x vocabulary / 2^22 tiles,
// rounded up: a matmul of about 2^23 x hidden FLOP, large enough to run near a GPU's peak), or up
// to kCheapLogitsTiles tiles whatever their size; never more than max_auto_logits_tiles. Below that size each tile's fixed cost (its kernels, its
// log-sum-exp bookkeeping) dominates: tens of thousands of 64 x 1024 tiles fit where a few more
// vocabulary tiles would, and run far slower.
constexpr uint64_t kEfficientTileElements = uint64_t(1) << 22, kCheapLogitsTiles = 16;
uint64_t max_efficient_logits_tiles(uint64_t tokens, uint64_t vocab);

// The MLP's token chunk placement.tiling "mlp_tokens" "auto" takes where it chunks: an eighth of
// the micro-batch's tokens (rounded up), at least kMinAutoMlpChunk (or every token when fewer), so
// that a chunk's intermediates and their gradients in the backward stay well below the whole MLP's
// activations that chunking takes out of the graph (4 intermediate widths a token for a gated MLP).
constexpr uint64_t kMinAutoMlpChunk = 256;
uint64_t auto_mlp_token_chunk(uint64_t tokens);

// Device bytes the head's loss holds beside its input and the weight's gradient: untiled, the
// fp32 logits, their fp32 gradient and the compute-dtype gradient (tokens x vocab x (8 +
// compute_bytes)); tiled, one tile of fp32 logits with its compute-dtype copy (the matmul's
// output in the forward, the narrowed gradient in the backward: chunk x tile x (4 +
// compute_bytes), an upper bound in fp32 where the two are one tensor), one matmul product of
// the backward in the compute dtype (max(chunk, tile) x hidden), the fp32 input gradient, one
// fp32 weight-gradient tile and 16 bytes a token (log-sum-exp, running maximum and sum, target
// logit). In one pass: one chunk's fp32 logits over the whole vocabulary with its compute-dtype
// copy, the chunk's input-gradient product in the compute dtype, the fp32 input gradient, the
// fp32 weight gradient with one chunk's product in the compute dtype (vocab x hidden x (4 +
// compute_bytes)) and 16 bytes a token.
uint64_t head_scratch_bytes(uint64_t tokens, uint64_t vocab, uint64_t hidden, uint64_t compute_bytes,
                            const LogitsTiles& t);

// "8 tiles of 2048 tokens x 16032 vocabulary rows", "8 tiles of 2048 tokens x the whole
// vocabulary in one pass" or "untiled".
std::string describe(const LogitsTiles& t, uint64_t tokens, uint64_t vocab);

}  // namespace strata::engine::layout
