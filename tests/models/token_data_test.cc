#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include <fstream>
#include <map>
#include <numeric>
#include <set>

#include "strata/models/safetensors.h"
#include "strata/models/token_data.h"
#include "../../bench/pack_baseline.h"
#include "test_util.h"

namespace strata::models {
namespace {

std::filesystem::path write_tokens(const test::TempDir& dir, const std::string& name,
                                   const std::vector<uint32_t>& ids, bool wide) {
  std::ofstream out(dir / name, std::ios::binary);
  for (uint32_t id : ids) {
    if (wide) {
      out.write(reinterpret_cast<const char*>(&id), 4);
    } else {
      const uint16_t v = static_cast<uint16_t>(id);
      out.write(reinterpret_cast<const char*>(&v), 2);
    }
  }
  return dir / name;
}

TEST(TokenData, WindowsHoldTheFileTokensAndEveryEpochVisitsEachWindowOnce) {
  test::TempDir dir;
  std::vector<uint32_t> ids(10007);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint32_t>((i * 7919) % 70000);
  for (bool wide : {false, true}) {
    if (!wide)
      for (auto& id : ids) id %= 65536;
    auto path = write_tokens(dir, wide ? "t32.bin" : "t16.bin", ids, wide);
    auto corpus = std::make_shared<TokenCorpus>(path, wide ? TokenFormat::kUint32 : TokenFormat::kUint16);
    ASSERT_EQ(corpus->size(), ids.size());
    BatchLoader loader(corpus, 64, 8, 0, 1, 42);
    const uint64_t w = loader.windows_per_epoch();
    EXPECT_EQ(w, (ids.size() - 1) / 64);
    std::vector<int64_t> win(65);
    for (int epoch = 0; epoch < 2; ++epoch) {
      std::set<uint64_t> starts;
      for (uint64_t s = epoch * w; s < (epoch + 1) * w; ++s) {
        loader.sample(s, win.data());
        // Find which window it is from its first token position: windows are i * 64.
        bool found = false;
        for (uint64_t i = 0; i < w && !found; ++i) {
          if (std::equal(win.begin(), win.end(), ids.begin() + i * 64,
                         [](int64_t a, uint32_t b) { return a == static_cast<int64_t>(b); })) {
            found = starts.insert(i).second;
          }
        }
        ASSERT_TRUE(found) << "sample " << s << " is not a fresh window of the file";
      }
      EXPECT_EQ(starts.size(), w);
    }
  }
}

TEST(TokenData, RanksSplitEachGlobalBatchAndPositionsReshard) {
  test::TempDir dir;
  std::vector<uint32_t> ids(5000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint32_t>(i);
  auto corpus = std::make_shared<TokenCorpus>(write_tokens(dir, "t.bin", ids, true), TokenFormat::kUint32);
  const uint64_t T = 16, B = 8;
  // Reference: one rank, 5 steps.
  BatchLoader one(corpus, T, B, 0, 1, 3);
  std::vector<std::vector<int64_t>> ref(5, std::vector<int64_t>(B * (T + 1)));
  for (auto& batch : ref) one.next(batch.data());
  for (int world : {2, 4}) {
    std::vector<BatchLoader> ranks;
    for (int r = 0; r < world; ++r) ranks.emplace_back(corpus, T, B, r, world, 3);
    for (int step = 0; step < 5; ++step) {
      // Steps 0-1 run at this world size; then fresh loaders (a new job at this world size)
      // restore the position the one-rank run had after two steps.
      if (step == 2) {
        ranks.clear();
        for (int r = 0; r < world; ++r) {
          ranks.emplace_back(corpus, T, B, r, world, 3);
          ranks.back().set_position(2 * B);
        }
      }
      std::vector<int64_t> global;
      for (auto& l : ranks) {
        std::vector<int64_t> local(l.local_batch() * (T + 1));
        l.next(local.data());
        global.insert(global.end(), local.begin(), local.end());
      }
      EXPECT_EQ(global, ref[step]) << "world " << world << " step " << step;
    }
  }
  EXPECT_THROW(one.set_position(3), std::invalid_argument);
  EXPECT_THROW(BatchLoader(corpus, T, 6, 0, 4, 3), std::invalid_argument);
}

TEST(TokenData, OrderIsAShuffleThatDependsOnTheSeedAndTheEpoch) {
  test::TempDir dir;
  std::vector<uint32_t> ids(4001);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint32_t>(i);
  auto corpus = std::make_shared<TokenCorpus>(write_tokens(dir, "t.bin", ids, true), TokenFormat::kUint32);
  auto order = [&](uint64_t seed, uint64_t epoch) {
    BatchLoader l(corpus, 8, 1, 0, 1, seed);
    std::vector<int64_t> firsts, w(9);
    for (uint64_t s = epoch * l.windows_per_epoch(); s < (epoch + 1) * l.windows_per_epoch(); ++s) {
      l.sample(s, w.data());
      firsts.push_back(w[0] / 8);  // window index
    }
    return firsts;
  };
  const auto a = order(1, 0);
  std::vector<int64_t> identity(a.size());
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_NE(a, identity);
  EXPECT_NE(a, order(2, 0));
  EXPECT_NE(a, order(1, 1));
  EXPECT_EQ(a, order(1, 0));  // and deterministic
}

TEST(TokenData, BadInputsAreClearErrors) {
  test::TempDir dir;
  {
    std::ofstream odd(dir / "odd.bin", std::ios::binary);
    odd << "abc";
  }
  try {
    TokenCorpus c(dir / "odd.bin", TokenFormat::kUint16);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("odd.bin: 3 bytes is not a whole number of 2-byte tokens"),
              std::string::npos) << e.what();
  }
  auto p = write_tokens(dir, "v.bin", {1, 2, 300, 4}, false);
  try {
    TokenCorpus c(p, TokenFormat::kUint16, 256);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("token 2 is 300, outside the vocabulary of 256"), std::string::npos) << e.what();
  }
  auto small = std::make_shared<TokenCorpus>(p, TokenFormat::kUint16);
  EXPECT_THROW(BatchLoader(small, 8, 1, 0, 1, 0), std::runtime_error);
  EXPECT_THROW(TokenCorpus(dir / "missing.bin", TokenFormat::kUint16), std::runtime_error);
}

// A supervised examples file as `strata data prepare --chat` writes it (docs/FORMATS.md).
struct SftFile {
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<uint8_t>> mask;
  StDType token_type = StDType::kI32;
};

std::filesystem::path write_sft(const test::TempDir& dir, const std::string& name, const SftFile& f) {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  std::vector<int64_t> offsets{0};
  for (size_t e = 0; e < f.ids.size(); ++e) {
    tokens.insert(tokens.end(), f.ids[e].begin(), f.ids[e].end());
    mask.insert(mask.end(), f.mask[e].begin(), f.mask[e].end());
    offsets.push_back(int64_t(tokens.size()));
  }
  SafetensorsWriter w(dir / name,
                      {{"tokens", f.token_type, {int64_t(tokens.size())}},
                       {"loss_mask", StDType::kU8, {int64_t(mask.size())}},
                       {"offsets", StDType::kI64, {int64_t(offsets.size())}}});
  w.write("tokens", std::as_bytes(std::span(tokens)));
  w.write("loss_mask", std::as_bytes(std::span(mask)));
  w.write("offsets", std::as_bytes(std::span(offsets)));
  w.finish();
  return dir / name;
}

TEST(SftData, ExamplesArePaddedOrCutAndTargetJCountsWhenTokenJPlusOneIsInTheLoss) {
  test::TempDir dir;
  SftFile f;
  // Lengths around seq_len + 1 = 7: shorter (padded), exact, longer (cut, with response tokens).
  f.ids = {{5, 6, 7, 8}, {1, 2, 3, 4, 5, 6, 7}, {9, 9, 8, 8, 7, 7, 6, 6, 5, 5}};
  f.mask = {{0, 0, 1, 1}, {0, 1, 0, 1, 1, 0, 1}, {0, 0, 0, 1, 1, 1, 1, 1, 1, 0}};
  const auto path = write_sft(dir, "a.sft", f);
  SftExamples ex(path, 6, /*vocab=*/10, /*pad_id=*/3);
  ASSERT_EQ(ex.size(), 3u);
  EXPECT_TRUE(ex.masked());
  EXPECT_EQ(ex.truncated_examples(), 1u);
  EXPECT_EQ(ex.truncated_loss_tokens(), 2u);  // tokens 7 and 8 of the third example
  std::vector<int64_t> ids(7);
  std::vector<uint8_t> loss(6);
  ex.sample(0, ids.data(), loss.data());
  EXPECT_EQ(ids, (std::vector<int64_t>{5, 6, 7, 8, 3, 3, 3}));
  EXPECT_EQ(loss, (std::vector<uint8_t>{0, 1, 1, 0, 0, 0}));
  ex.sample(1, ids.data(), loss.data());
  EXPECT_EQ(ids, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(loss, (std::vector<uint8_t>{1, 0, 1, 1, 0, 1}));
  ex.sample(2, ids.data(), loss.data());
  EXPECT_EQ(ids, (std::vector<int64_t>{9, 9, 8, 8, 7, 7, 6}));
  EXPECT_EQ(loss, (std::vector<uint8_t>{0, 0, 1, 1, 1, 1}));
  EXPECT_THROW(ex.sample(3, ids.data(), loss.data()), std::out_of_range);

  // The loader visits examples like windows: each once per epoch; ranks take their slices.
  auto src = std::make_shared<SftExamples>(path, 6, 10);
  BatchLoader l0(src, 2, 0, 2, 1), l1(src, 2, 1, 2, 1);
  std::multiset<int64_t> firsts;
  for (int step = 0; step < 3; ++step) {
    std::vector<int64_t> a(7), b(7);
    std::vector<uint8_t> ma(6), mb(6);
    l0.next(a.data(), ma.data());
    l1.next(b.data(), mb.data());
    std::vector<int64_t> whole(14);
    l0.sample(uint64_t(step) * 2, whole.data());
    l0.sample(uint64_t(step) * 2 + 1, whole.data() + 7);
    EXPECT_EQ(std::vector<int64_t>(whole.begin(), whole.begin() + 7), a);
    EXPECT_EQ(std::vector<int64_t>(whole.begin() + 7, whole.end()), b);
    // Epoch 0 is global samples 0, 1, 2: step 0's two and step 1's first.
    if (step <= 1) firsts.insert(a[0]);
    if (step == 0) firsts.insert(b[0]);
  }
  EXPECT_EQ(firsts, (std::multiset<int64_t>{1, 5, 9}));  // every example once
}

// Best fit decreasing: every item in exactly one bin, no bin over capacity, no fewer bins than the
// lengths need; the same bins for the same seed, and for distinct lengths whatever the seed; and
// the rule's choices on a case worked by hand.
TEST(Packing, BestFitDecreasingPlacesEachItemOnceWithinCapacity) {
  // Worked by hand, capacity 10: 7 opens bin 0 (3 left), 6 bin 1 (4 left), 4 fills bin 1 (its
  // room 4 fits best), 3 fills bin 0, 2 opens bin 2, 1 joins it.
  const Bins hand = best_fit_decreasing({3, 7, 2, 6, 4, 1}, 10, 0);
  EXPECT_EQ(hand.begin, (std::vector<uint64_t>{0, 2, 4, 6}));
  EXPECT_EQ(hand.order, (std::vector<uint64_t>{1, 0, 3, 4, 2, 5}));
  EXPECT_EQ(best_fit_decreasing({3, 7, 2, 6, 4, 1}, 10, 99).order, hand.order);

  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 20; ++trial) {
    const uint64_t capacity = 17 + rng() % 300, n = 1 + rng() % 400;
    std::vector<uint64_t> lengths(n);
    uint64_t total = 0;
    for (auto& l : lengths) total += (l = 1 + rng() % capacity);
    const Bins b = best_fit_decreasing(lengths, capacity, trial);
    ASSERT_EQ(b.order.size(), n);
    std::vector<int> seen(n, 0);
    for (size_t k = 0; k + 1 < b.begin.size(); ++k) {
      uint64_t used = 0;
      for (uint64_t i = b.begin[k]; i < b.begin[k + 1]; ++i) used += lengths[b.order[i]], ++seen[b.order[i]];
      EXPECT_LE(used, capacity);
      EXPECT_GT(used, 0u);
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), int64_t(n));
    const uint64_t bins = b.begin.size() - 1, least = (total + capacity - 1) / capacity;
    EXPECT_GE(bins, least);
    EXPECT_LE(bins, least * 11 / 9 + 1);  // BFD's bound: 11/9 OPT + 6/9, and OPT >= least
    EXPECT_EQ(best_fit_decreasing(lengths, capacity, trial).order, b.order);  // deterministic
  }
  EXPECT_THROW(best_fit_decreasing({3, 11}, 10, 0), std::invalid_argument);
}

// The rule at scale against its previous method (a multimap of open bins, bench/pack_baseline.h):
// the same bins for lengths with many ties (small capacities, many equal rooms), one-token items,
// items the size of a bin, and 200 thousand chat-like lengths.
TEST(Packing, BestFitDecreasingMakesThePreviousMethodsBins) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 40; ++trial) {
    const uint64_t capacity = trial < 10 ? 1 + rng() % 8 : trial < 30 ? 9 + rng() % 200 : 60 + rng() % 9000;
    std::vector<uint64_t> lengths(trial < 30 ? rng() % 3000 : 200000);
    for (auto& l : lengths) l = trial % 3 == 0 ? capacity - rng() % std::min<uint64_t>(capacity, 3) : 1 + rng() % capacity;
    const Bins now = best_fit_decreasing(lengths, capacity, trial), before =
        strata::bench::best_fit_decreasing_multimap(lengths, capacity, trial);
    ASSERT_EQ(now.begin, before.begin) << "trial " << trial << " capacity " << capacity;
    ASSERT_EQ(now.order, before.order) << "trial " << trial;
  }
  EXPECT_TRUE(best_fit_decreasing({}, 5, 0).order.empty());
  EXPECT_EQ(best_fit_decreasing({}, 5, 0).begin, (std::vector<uint64_t>{0}));
}

// Packed windows: the examples one after another, then padding; segments per example (the padding
// -1); a target counts only within its example and where the mask says so; every example in
// exactly one window; the windows the same at any world size, and at any rank's slice.
TEST(Packing, WindowsHoldWholeExamplesAndNoTargetCrossesFromOneToTheNext) {
  test::TempDir dir;
  SftFile f;
  // seq_len 6: windows of 7 tokens. Kept lengths 3, 4, 2, 7 (cut from 9), 5.
  f.ids = {{1, 2, 3}, {4, 5, 6, 7}, {8, 9}, {1, 1, 2, 2, 3, 3, 4, 4, 5}, {6, 6, 7, 7, 8}};
  f.mask = {{0, 1, 1}, {0, 0, 1, 1}, {1, 1}, {0, 1, 1, 1, 1, 1, 1, 1, 1}, {0, 1, 0, 1, 1}};
  auto ex = std::make_shared<SftExamples>(write_sft(dir, "p.sft", f), 6, 10, /*pad_id=*/0);
  EXPECT_EQ(ex->real_tokens(), 3u + 4 + 2 + 7 + 5);
  const PackedExamples packed(ex, 0);
  EXPECT_TRUE(packed.packed());
  // BFD: 7 alone; 5 + 2; 4 + 3.
  ASSERT_EQ(packed.size(), 3u);
  EXPECT_EQ(packed.window_examples(0), (std::vector<uint64_t>{3}));
  EXPECT_EQ(packed.window_examples(1), (std::vector<uint64_t>{4, 2}));
  EXPECT_EQ(packed.window_examples(2), (std::vector<uint64_t>{1, 0}));
  std::vector<int64_t> ids(7), seg(6);
  std::vector<uint8_t> loss(6);
  packed.sample(1, ids.data(), loss.data(), seg.data());
  EXPECT_EQ(ids, (std::vector<int64_t>{6, 6, 7, 7, 8, 8, 9}));
  EXPECT_EQ(seg, (std::vector<int64_t>{0, 0, 0, 0, 0, 1}));
  // Targets 0..3 are example 4's (mask of its tokens 1..4); target 4 crosses into example 2;
  // target 5 is example 2's second token.
  EXPECT_EQ(loss, (std::vector<uint8_t>{1, 0, 1, 1, 0, 1}));
  packed.sample(2, ids.data(), loss.data(), seg.data());
  EXPECT_EQ(ids, (std::vector<int64_t>{4, 5, 6, 7, 1, 2, 3}));
  EXPECT_EQ(seg, (std::vector<int64_t>{0, 0, 0, 0, 1, 1}));
  EXPECT_EQ(loss, (std::vector<uint8_t>{0, 1, 1, 0, 1, 1}));
  packed.sample(0, ids.data(), loss.data(), seg.data());
  EXPECT_EQ(ids, (std::vector<int64_t>{1, 1, 2, 2, 3, 3, 4}));
  EXPECT_EQ(seg, (std::vector<int64_t>(6, 0)));
  EXPECT_EQ(loss, (std::vector<uint8_t>{1, 1, 1, 1, 1, 1}));

  // Padding: segment -1, out of the loss.
  SftFile g;
  g.ids = {{1, 2, 3, 4}, {5, 6, 7}, {8, 9}};
  g.mask = {{1, 1, 1, 1}, {1, 1, 1}, {1, 1}};
  auto ex2 = std::make_shared<SftExamples>(write_sft(dir, "q.sft", g), 6, 10, /*pad_id=*/0);
  const PackedExamples two(ex2, 5);
  ASSERT_EQ(two.size(), 2u);  // 4 + 3; 2 and padding
  two.sample(1, ids.data(), loss.data(), seg.data());
  EXPECT_EQ(ids, (std::vector<int64_t>{8, 9, 0, 0, 0, 0, 0}));
  EXPECT_EQ(seg, (std::vector<int64_t>{0, 0, -1, -1, -1, -1}));
  EXPECT_EQ(loss, (std::vector<uint8_t>{1, 0, 0, 0, 0, 0}));

  // The loader hands out the same windows whatever the world size: rank r's rows are global
  // samples r * local .. of each batch, as for any source.
  auto src = std::make_shared<PackedExamples>(ex, 0);
  BatchLoader one(src, 2, 0, 1, 7), r0(src, 2, 0, 2, 7), r1(src, 2, 1, 2, 7);
  for (int step = 0; step < 4; ++step) {
    std::vector<int64_t> a(14), b(7), c(7), sa(12), sb(6), sc(6);
    std::vector<uint8_t> la(12), lb(6), lc(6);
    one.next(a.data(), la.data(), sa.data());
    r0.next(b.data(), lb.data(), sb.data());
    r1.next(c.data(), lc.data(), sc.data());
    EXPECT_EQ(std::vector<int64_t>(a.begin(), a.begin() + 7), b);
    EXPECT_EQ(std::vector<int64_t>(a.begin() + 7, a.end()), c);
    EXPECT_EQ(std::vector<int64_t>(sa.begin() + 6, sa.end()), sc);
  }
}

TEST(SftData, HeldOutRangesAndEvaluationBatchesCoverEverySampleOnceThenPad) {
  test::TempDir dir;
  SftFile f;
  for (int e = 0; e < 5; ++e) {
    f.ids.push_back({e + 1, e + 1, e + 1});
    f.mask.push_back({0, 1, 1});
  }
  auto src = std::make_shared<SftExamples>(write_sft(dir, "b.sft", f), 4, 10);
  auto eval = std::make_shared<SampleRange>(src, 2, 5);  // examples 2, 3, 4
  ASSERT_EQ(eval->size(), 3u);
  // Two ranks, a global batch of 2: batches {2, 3} and {4, padding}.
  EvalBatches r0(eval, 2, 0, 2), r1(eval, 2, 1, 2);
  ASSERT_EQ(r0.batches(), 2u);
  std::vector<int64_t> ids(5);
  std::vector<uint8_t> loss(4);
  std::vector<int64_t> seen;
  for (uint64_t b = 0; b < 2; ++b) {
    for (const EvalBatches* r : {&r0, &r1}) {
      r->batch(b, ids.data(), loss.data());
      const int n = std::accumulate(loss.begin(), loss.end(), 0);
      if (n == 0) {
        EXPECT_EQ(ids, std::vector<int64_t>(5, 0));  // padding: no target counts
      } else {
        EXPECT_EQ(loss, (std::vector<uint8_t>{1, 1, 0, 0}));
        seen.push_back(ids[0]);
      }
    }
  }
  EXPECT_EQ(seen, (std::vector<int64_t>{3, 4, 5}));
  EXPECT_THROW(SampleRange(src, 3, 3), std::invalid_argument);
  EXPECT_THROW(SampleRange(src, 0, 6), std::invalid_argument);
}

TEST(SftData, BadFilesAreErrorsNamingTheFileAndTheProblem) {
  test::TempDir dir;
  const auto expect_error = [&](const SftFile& f, const std::string& what, uint64_t vocab = 10) {
    const auto path = write_sft(dir, "bad.sft", f);
    try {
      SftExamples ex(path, 4, vocab);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const std::runtime_error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(path.string()), std::string::npos) << m;
      EXPECT_NE(m.find(what), std::string::npos) << m;
    }
  };
  SftFile ok;
  ok.ids = {{1, 2, 3}};
  ok.mask = {{0, 1, 1}};
  SftFile f = ok;
  f.ids = {{1, 12, 3}};
  expect_error(f, "outside the vocabulary");
  f = ok;
  f.mask = {{0, 2, 1}};
  expect_error(f, "(0 or 1)");
  f = ok;
  f.mask = {{0, 0, 0}};
  expect_error(f, "no token is in the loss");
  f = ok;
  f.token_type = StDType::kI64;
  // Written as I64 with the I32 data's bytes: a wrong dtype, whatever the contents.
  {
    std::vector<int64_t> tokens{1, 2, 3};
    std::vector<uint8_t> mask{0, 1, 1};
    std::vector<int64_t> offsets{0, 3};
    SafetensorsWriter w(dir / "bad.sft", {{"tokens", StDType::kI64, {3}}, {"loss_mask", StDType::kU8, {3}},
                                          {"offsets", StDType::kI64, {2}}});
    w.write("tokens", std::as_bytes(std::span(tokens)));
    w.write("loss_mask", std::as_bytes(std::span(mask)));
    w.write("offsets", std::as_bytes(std::span(offsets)));
    w.finish();
    EXPECT_THROW(SftExamples(dir / "bad.sft", 4, 10), std::runtime_error);
  }
  {
    std::ofstream(dir / "text.sft") << "not safetensors";
    EXPECT_THROW(SftExamples(dir / "text.sft", 4, 10), std::runtime_error);
  }
  f = ok;
  f.ids = {{1, 2, 3}, {}};
  f.mask = {{0, 1, 1}, {}};
  expect_error(f, "example 1 is empty");
}


TEST(TokenData, DefaultCorpusOfDebianLicenseTextsReadsAsBytes) {
  const std::filesystem::path licenses = "/usr/share/common-licenses";
  if (!std::filesystem::is_directory(licenses)) GTEST_SKIP() << "not a Debian machine";
  TokenCorpus c(licenses, TokenFormat::kBytes, 256);
  EXPECT_GT(c.size(), 100000u);
  std::ifstream apache(licenses / "Apache-2.0");
  std::string first_line;
  std::getline(apache, first_line);
  // Apache-2.0 sorts first: the corpus starts with its bytes.
  std::vector<int64_t> head(first_line.size());
  c.copy(0, head.size(), head.data());
  for (size_t i = 0; i < head.size(); ++i) ASSERT_EQ(head[i], static_cast<unsigned char>(first_line[i]));
}

}  // namespace
}  // namespace strata::models
