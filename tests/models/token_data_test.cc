#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <numeric>
#include <set>

#include "strata/models/token_data.h"
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
