// Resolution of the tiles (strata/engine/layout/resolve.h): the head's tiles and passes, logits
// tiles against vocabulary tiles, the MLP's token chunks, and a few layers standing for all of
// them when weighing a tiling, with the ranks' agreement simulated by a peer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "resolve_fixture.h"
#include "strata/engine/bytes.h"
#include "strata/engine/layout/memory_model.h"
#include "strata/engine/layout/resolve.h"
#include "strata/engine/layout/schedule.h"
#include "strata/engine/layout/tiles.h"
#include "strata/engine/placement.h"
#include "strata/models/model_config.h"

namespace strata::engine {
namespace {

using namespace resolve_testing;

// placement.tiling "auto": the fewest head tiles whose working set fits, exactly (one fewer does
// not, in one pass or two), with the explicit device state counted; with head_pass "one" the
// count cut in one pass where that fits, else in two; a peer needing more tiles, or two passes, wins; an explicit count
// is kept (in one pass when it fits); a budget that nothing fits gets the most tiles
// (construction's check then names it).
TEST(ResolveHeadTiles, PicksTheFewestThatFitAndAgrees) {
  layout::ModelSizes z = Model::sizes();
  z.tokens = 512;
  z.vocab = 3001;  // the logits dominate: 512 x 3001 x 10 bytes
  const layout::Schedule schedule{{{0}, {1}, {2}, {3}, {4, 0}}, 5};
  layout::Choices lean;
  lean.recomputed = 3;
  const auto working = [&](const layout::LogitsTiles& t) {
    layout::ModelSizes s = z;
    s.logits = t;
    return layout::MemoryModel(schedule, s).working_set(lean);
  };
  const auto two = [&](uint64_t count) { return layout::logits_tiles(z.tokens, z.vocab, count); };
  const auto one = [&](uint64_t count) { return layout::one_pass_tiles(z.tokens, z.vocab, count); };
  const auto same_cut = [](const layout::LogitsTiles& a, const layout::LogitsTiles& b) {
    return a.token_chunk == b.token_chunk && a.vocab_tile == b.vocab_tile && a.one_pass == b.one_pass;
  };
  EngineConfig c = all_auto();
  c.head_one_pass = true;
  const uint64_t base = 4096;
  int one_pass_picks = 0;
  for (uint64_t want : {2ull, 3ull, 7ull, 20ull}) {
    for (const layout::LogitsTiles& room : {two(want), one(want)}) {
      const uint64_t usable = base + working(room);
      Peer alone;
      const HeadCut got = resolve_head_tiles(c, schedule, z, lean, base, usable, alone.agree());
      EXPECT_LE(base + working(got.logits), usable) << want;
      for (uint64_t fewer = 1; fewer < got.count; ++fewer) {
        EXPECT_GT(base + working(two(fewer)), usable) << want << ": " << fewer << " tiles fit too";
        if (fewer > 1) {
          EXPECT_GT(base + working(one(fewer)), usable) << want << ": " << fewer << " fit in one pass";
        }
      }
      EXPECT_LE(got.count, want);
      // One pass whenever it fits at that count.
      const bool one_fits = base + working(one(got.count)) <= usable;
      EXPECT_TRUE(same_cut(got.logits, one_fits ? one(got.count) : two(got.count))) << want;
      one_pass_picks += got.logits.one_pass;
      Peer more{{int64_t(got.count) + 5, 1}};  // more tiles, and two passes
      const HeadCut agreed = resolve_head_tiles(c, schedule, z, lean, base, usable, more.agree());
      EXPECT_EQ(agreed.count, got.count + 5);
      EXPECT_TRUE(same_cut(agreed.logits, two(got.count + 5)));
    }
  }
  EXPECT_GT(one_pass_picks, 0);
  Peer alone;
  EXPECT_EQ(resolve_head_tiles(c, schedule, z, lean, 0, UINT64_MAX, alone.agree()).count, 1u);  // no limit: untiled
  EXPECT_FALSE(resolve_head_tiles(c, schedule, z, lean, 0, UINT64_MAX, alone.agree()).logits.tiled(z.tokens, z.vocab));
  // Nothing fits: the smallest tiles "auto" cuts (64 tokens x 1024 rows: 8 x 3 of them here).
  EXPECT_EQ(layout::max_auto_logits_tiles(z.tokens, z.vocab), 8u * 3u);
  EXPECT_EQ(resolve_head_tiles(c, schedule, z, lean, 0, 1000, alone.agree()).count, 24u);
  c.head_tiles = 6;
  const HeadCut kept = resolve_head_tiles(c, schedule, z, lean, 0, 1000, alone.agree());
  EXPECT_EQ(kept.count, 6u);
  EXPECT_TRUE(same_cut(kept.logits, two(6))) << "no room: two passes";
  EXPECT_TRUE(same_cut(resolve_head_tiles(c, schedule, z, lean, 0, UINT64_MAX, alone.agree()).logits, one(6)));
  // head_pass "two" (the default): never one pass.
  c.head_one_pass = false;
  EXPECT_TRUE(same_cut(resolve_head_tiles(c, schedule, z, lean, 0, UINT64_MAX, alone.agree()).logits, two(6)));
  c.head_one_pass = true;
  // Vocabulary tiles: never one pass (the weight's ranges are never together).
  layout::ModelSizes tiled = z;
  tiled.vocab_tiles = 2;
  const layout::Schedule vocab_schedule{{{0}, {1}, {2}, {3}, {4}, {5}}, 6, 2, 2};
  EXPECT_FALSE(resolve_head_tiles(c, vocab_schedule, tiled, lean, 0, UINT64_MAX, alone.agree()).logits.one_pass);
}

// One-pass cuts: even token chunks over the whole vocabulary, as many as asked (clamped to the
// tokens); their scratch holds one chunk's logits and the fp32 weight gradient.
TEST(ResolveHeadTiles, OnePassCutsAreTokenChunksOverTheWholeVocabulary) {
  for (auto [tokens, vocab] : {std::pair<uint64_t, uint64_t>{512, 3001}, {1000, 50257}, {7, 64}})
    for (uint64_t count : {2ull, 3ull, 7ull, 16ull, 1000ull}) {
      const layout::LogitsTiles t = layout::one_pass_tiles(tokens, vocab, count);
      EXPECT_TRUE(t.one_pass);
      EXPECT_EQ(t.vocab_tile, vocab);
      EXPECT_EQ(t.tiles(tokens, vocab), std::min(count, tokens)) << tokens << " " << count;
      EXPECT_EQ(layout::head_scratch_bytes(tokens, vocab, 64, 2, t),
                t.token_chunk * vocab * 6 + t.token_chunk * 64 * 2 + tokens * 64 * 4 + vocab * 64 * 6 + tokens * 16);
    }
  EXPECT_FALSE(layout::one_pass_tiles(512, 3001, 1).tiled(512, 3001));
  EXPECT_EQ(layout::describe(layout::one_pass_tiles(512, 3001, 4), 512, 3001),
            "4 tiles of 128 tokens x the whole vocabulary in one pass");
}

// "auto" tiles of the logits: no more than max_efficient_logits_tiles before the vocabulary is
// cut instead (tiles of about 2^22 logits, or up to 16 tiles), within max_auto_logits_tiles.
TEST(ResolveTiles, EfficientLogitsTilesAreAboutFourMegaLogitsOrSixteen) {
  EXPECT_EQ(layout::max_efficient_logits_tiles(8192, 131072), 256u);  // 2^30 logits / 2^22
  EXPECT_EQ(layout::max_efficient_logits_tiles(8192, 131073), 257u);
  EXPECT_EQ(layout::max_efficient_logits_tiles(256, 4096), 16u);    // 16 cheap tiles (the most)
  EXPECT_EQ(layout::max_efficient_logits_tiles(256, 2048), 8u);     // the most "auto" cuts: 4 x 2
  EXPECT_EQ(layout::max_efficient_logits_tiles(64, 1000), 1u);      // too small to cut
}

// The vocabulary search runs with the smallest logits tiles, then again with efficient ones at no
// larger block cut, whose answer it takes when there is one: more vocabulary tiles rather than
// logits tiles too small to run well, never more block tiles; an explicit head or vocabulary count
// makes it one search.
TEST(ResolveTiles, PrefersVocabularyTilesToTinyLogitsTilesAndFallsBackToThem) {
  models::ModelConfig mc = models::preset("gpt2");
  mc.layers = 2;
  mc.hidden = 64;
  mc.heads = 4;
  mc.kv_heads = 4;
  mc.head_dim = 16;
  mc.intermediate = 256;
  mc.vocab_size = 16384;
  mc.max_positions = 64;
  mc.validate();
  EngineConfig c = all_auto();
  ASSERT_EQ(c.vocab_tiles, EngineConfig::kTilesAuto);
  int efficient_tests = 0, smallest_tests = 0;
  // Whole blocks fit; the vocabulary fits whole only with the smallest logits tiles, and from 4
  // vocabulary tiles on with efficient ones.
  const auto fits = [&](const models::LayerTiles& t, bool efficient) {
    ++(efficient ? efficient_tests : smallest_tests);
    return t.blocks_whole() && t.vocab >= (efficient ? 4 : 1);
  };
  Peer alone;
  models::LayerTiles got = resolve_tiles(c, mc, fits, alone.agree());
  EXPECT_TRUE(got.blocks_whole());
  EXPECT_EQ(got.vocab, 4) << "more vocabulary tiles, not tiny logits tiles";
  EXPECT_GT(efficient_tests, 0);
  // Efficient logits tiles would need the blocks cut: whole blocks and the smallest logits tiles
  // instead (block tiles are not traded for larger logits tiles).
  got = resolve_tiles(
      c, mc, [&](const models::LayerTiles& t, bool efficient) { return efficient ? !t.blocks_whole() : true; },
      alone.agree());
  EXPECT_TRUE(got.blocks_whole());
  EXPECT_EQ(got.vocab, 1);
  // Nothing fits with efficient logits tiles: the smallest ones, and the vocabulary whole.
  efficient_tests = smallest_tests = 0;
  got = resolve_tiles(
      c, mc, [&](const models::LayerTiles& t, bool efficient) { return fits(t, efficient) && !efficient; },
      alone.agree());
  EXPECT_TRUE(got.blocks_whole());
  EXPECT_EQ(got.vocab, 1);
  EXPECT_GT(efficient_tests, 0);
  EXPECT_GT(smallest_tests, 0);
  // An explicit head count, or a vocabulary that is not "auto": one search.
  for (const bool explicit_head : {true, false}) {
    EngineConfig one = c;
    (explicit_head ? one.head_tiles : one.vocab_tiles) = 8;
    efficient_tests = smallest_tests = 0;
    got = resolve_tiles(one, mc, fits, alone.agree());
    EXPECT_EQ(efficient_tests, 0) << explicit_head;
    EXPECT_GT(smallest_tests, 0) << explicit_head;
    EXPECT_EQ(got.vocab, explicit_head ? 1 : 8) << explicit_head;
  }
}

// placement.tiling "mlp_tokens" "auto": no chunks where the leanest tiling (every "auto" kind at
// its most, configured counts as they are) fits without them; an eighth of the tokens (at least
// 256, or all) where it does not; a peer that chunks makes every rank chunk; a configured value is
// kept without a test or an agreement.
TEST(ResolveMlpTokenChunk, ChunksOnlyWhereTheLeanestTilingDoesNotFitWithoutThem) {
  EXPECT_EQ(layout::auto_mlp_token_chunk(100), 100u);
  EXPECT_EQ(layout::auto_mlp_token_chunk(256), 256u);
  EXPECT_EQ(layout::auto_mlp_token_chunk(2048), 256u);
  EXPECT_EQ(layout::auto_mlp_token_chunk(2049), 257u);
  EXPECT_EQ(layout::auto_mlp_token_chunk(32768), 4096u);

  models::ModelConfig mc = models::preset("llama-1b");
  mc.layers = 2;
  mc.hidden = 64;
  mc.heads = 4;
  mc.kv_heads = 2;
  mc.head_dim = 16;
  mc.intermediate = 640;
  mc.vocab_size = 5000;
  mc.validate();
  EngineConfig c = all_auto();
  c.micro_batch = 2;
  c.seq_len = 2048;
  ASSERT_EQ(c.mlp_token_chunk, EngineConfig::kMlpChunkAuto);
  const models::LayerTiles leanest = leanest_tiling(c, mc);
  EXPECT_EQ(leanest.attention, 2);
  EXPECT_EQ(leanest.mlp, 10);
  EXPECT_EQ(leanest.vocab, 4);
  std::vector<std::pair<models::LayerTiles, int64_t>> asked;
  const auto fits_unchunked = [&](bool fit) {
    return [&asked, fit](const models::LayerTiles& t, int64_t chunk) {
      asked.push_back({t, chunk});
      return fit || chunk > 0;
    };
  };
  Peer alone;
  EXPECT_EQ(resolve_mlp_token_chunk(c, mc, fits_unchunked(true), alone.agree()), 0);
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0].first, leanest);
  EXPECT_EQ(asked[0].second, 0);
  EXPECT_EQ(resolve_mlp_token_chunk(c, mc, fits_unchunked(false), alone.agree()), 512);
  Peer chunking{{512}};
  EXPECT_EQ(resolve_mlp_token_chunk(c, mc, fits_unchunked(true), chunking.agree()), 512) << "a peer chunks";
  // Configured counts are the leanest cut's.
  c.attention_tiles = 1;
  c.mlp_tiles = 3;
  c.vocab_tiles = 1;
  EXPECT_EQ(leanest_tiling(c, mc), (models::LayerTiles{1, 3, 1}));
  // A configured chunk (or "off") is kept: nothing tested, nothing agreed.
  asked.clear();
  Peer asked_peer;
  for (int64_t configured : {int64_t(0), int64_t(7)}) {
    c.mlp_token_chunk = configured;
    EXPECT_EQ(resolve_mlp_token_chunk(c, mc, fits_unchunked(false), asked_peer.agree()), configured);
  }
  EXPECT_TRUE(asked.empty());
  EXPECT_EQ(asked_peer.calls, 0);
}

// tiles_fit weighs a model of many layers through one of a few (tiles_device_bytes): the same
// bytes as the whole model's, on random models, cuts and choices of awkward sizes: every
// placement of the state, checkpoints on the device or not, prefetch windows longer than a block,
// tied heads or not, several ranks. Where blocks keep their graphs the whole model is weighed.
TEST(TilingFits, AFewLayersStandForAllOfThemExactly) {
  std::mt19937 rng(20261129);
  const auto pick = [&](int64_t lo, int64_t hi) { return lo + int64_t(rng() % uint64_t(hi - lo + 1)); };
  int shortcuts = 0;
  for (int trial = 0; trial < 300; ++trial) {
    models::ModelConfig mc = models::preset(trial % 2 ? "llama-1b" : "gpt2");
    mc.heads = pick(2, 6);
    mc.kv_heads = trial % 2 ? mc.heads / (mc.heads % 2 ? 1 : 2) : mc.heads;
    mc.head_dim = 8 * pick(1, 3);
    mc.hidden = mc.heads * mc.head_dim;
    mc.intermediate = 64 * pick(1, 6) + pick(0, 3) * 8;
    mc.vocab_size = pick(300, 3000);
    mc.layers = pick(1, 24);
    mc.tie_embeddings = rng() % 2;
    mc.max_positions = 256;
    mc.validate();
    EngineConfig c;
    c.micro_batch = pick(1, 3);
    c.seq_len = pick(16, 200);
    c.compute = rng() % 2 ? Precision::kBf16 : Precision::kFp32;
    const Placement places[] = {Placement::kDevice, Placement::kHost};
    c.params = places[rng() % 2];
    c.grads = places[rng() % 2];
    c.master = c.moments = places[rng() % 2];
    const Placement checkpoints[] = {Placement::kDevice, Placement::kHost, Placement::kAuto};
    c.activations = checkpoints[rng() % 3];
    c.prefetch = int(pick(0, 9));
    c.recompute_blocks = rng() % 4 == 0 ? int(pick(0, mc.layers)) : EngineConfig::kRecomputeAuto;
    c.mlp_token_chunk = rng() % 2 ? 0 : 64;
    const models::LayerTiles tiles{pick(1, mc.kv_heads), pick(1, std::max<int64_t>(1, mc.intermediate / 64)),
                                   pick(1, 3)};
    const int world = int(pick(1, 7));
    const bool efficient = rng() % 2;
    const uint64_t whole = tiles_device_bytes(c, mc, tiles, world, efficient, /*few_layers=*/false);
    EXPECT_EQ(tiles_device_bytes(c, mc, tiles, world, efficient), whole)
        << "trial " << trial << ": " << mc.layers << " layers in " << tiles.attention << " x " << tiles.mlp
        << " tiles, prefetch " << c.prefetch << ", checkpoints " << to_string(c.activations);
    EXPECT_EQ(tiles_fit(c, mc, tiles, world, whole, efficient), true);
    EXPECT_EQ(tiles_fit(c, mc, tiles, world, whole - 1, efficient), false);
    const int64_t per_block = tiles.block_stages();
    shortcuts += c.recompute_blocks == EngineConfig::kRecomputeAuto &&
                 mc.layers > 2 * ((c.prefetch + per_block - 1) / per_block + 1) + 1;
  }
  EXPECT_GT(shortcuts, 100) << "the trials rarely took the few layers' way";
}

}  // namespace
}  // namespace strata::engine
