// Swap space: data round trips, and the on-disk layout is exactly the one docs/FORMATS.md
// describes (checked by reading the swap files directly, computing stripe positions from the
// documented rule rather than from the implementation).
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "strata/offload/aligned_buffer.h"
#include "strata/offload/swap_space.h"
#include "test_util.h"

namespace strata::offload {
namespace {

using test::TempDir;

std::vector<std::byte> read_range(const std::filesystem::path& p, uint64_t off, uint64_t n) {
  std::ifstream in(p, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(off));
  std::vector<std::byte> out(n);
  in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(n));
  EXPECT_EQ(static_cast<uint64_t>(in.gcount()), n) << p << " @" << off;
  return out;
}

class SwapSpaceTest : public ::testing::TestWithParam<IoBackend> {
 protected:
  void SetUp() override {
    if (GetParam() == IoBackend::kIoUring && !io_uring_available()) GTEST_SKIP();
    for (int d = 0; d < 3; ++d) {
      dirs_.push_back(root_ / ("nvme" + std::to_string(d)));
      std::filesystem::create_directories(dirs_.back());
    }
    IoEngineConfig c;
    c.backend = GetParam();
    c.block_bytes = 256 << 10;
    io_ = IoEngine::create(c);
  }
  SwapConfig config(int rank = 3) {
    SwapConfig c;
    c.dirs = dirs_;
    c.rank = rank;
    c.stripe_bytes = 64 << 10;
    return c;
  }
  TempDir root_;
  std::vector<std::filesystem::path> dirs_;
  std::unique_ptr<IoEngine> io_;
  AlignedBuffers pool_;
};

TEST_P(SwapSpaceTest, StripedPartitionsRoundTripAndFollowTheDocumentedLayout) {
  SwapSpace swap(*io_, config());
  const std::vector<uint64_t> sizes = {1, 4097, 64 << 10, (64 << 10) + 1, 1000003, 5 << 20, 0};
  std::map<std::string, std::vector<std::byte>> data;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string name = "block" + std::to_string(i) + ".master";
    swap.allocate(name, sizes[i]);
    data[name] = test::random_bytes(sizes[i], 50 + i);
    AlignedBuffer b = pool_.allocate(sizes[i]);
    std::memcpy(b.data(), data[name].data(), sizes[i]);
    swap.write(name, 0, b.span()).get();
  }
  for (int d = 0; d < 3; ++d) {
    char expect[64];
    std::snprintf(expect, sizeof expect, "strata-swap-r00003-d%d.bin", d);
    EXPECT_TRUE(std::filesystem::exists(dirs_[d] / expect)) << expect;
  }
  // Layout oracle: stripe j of a partition is in directory (first_dir + j) % D, at
  // extent.offset + (j / D) * stripe within that directory's extent.
  const uint64_t S = 64 << 10, D = 3;
  for (const SwapPartition& p : swap.partitions()) {
    const auto& expect = data.at(p.name);
    for (uint64_t j = 0; j * S < p.bytes; ++j) {
      const uint32_t d = static_cast<uint32_t>((p.first_dir + j) % D);
      const SwapExtent* e = nullptr;
      for (auto& x : p.extents)
        if (x.dir == d) e = &x;
      ASSERT_NE(e, nullptr);
      EXPECT_EQ(e->offset % 4096, 0u);
      const uint64_t n = std::min(S, p.bytes - j * S);
      auto got = read_range(swap.file_path(d), e->offset + (j / D) * S, n);
      ASSERT_EQ(0, std::memcmp(got.data(), expect.data() + j * S, n)) << p.name << " stripe " << j;
    }
  }
  // Reads through the swap API: whole partitions and random sub-ranges.
  std::mt19937_64 rng(11);
  AlignedBuffer buf = pool_.allocate(5 << 20);
  for (auto& [name, expect] : data) {
    if (expect.empty()) continue;
    swap.read(name, 0, {buf.data(), expect.size()}).get();
    ASSERT_EQ(0, std::memcmp(buf.data(), expect.data(), expect.size())) << name;
    for (int k = 0; k < 10; ++k) {
      const uint64_t a = rng() % expect.size(), n = 1 + rng() % (expect.size() - a);
      swap.read(name, a, {buf.data(), n}).get();
      ASSERT_EQ(0, std::memcmp(buf.data(), expect.data() + a, n)) << name << " @" << a;
    }
  }
  // Sub-range writes land where they should.
  const std::string big = "block5.master";
  auto patch = test::random_bytes(300000, 99);
  swap.write(big, 123457, {patch.data(), patch.size()}).get();
  std::memcpy(data[big].data() + 123457, patch.data(), patch.size());
  swap.read(big, 0, {buf.data(), data[big].size()}).get();
  EXPECT_EQ(0, std::memcmp(buf.data(), data[big].data(), data[big].size()));

  // The index describes the same layout.
  auto j = nlohmann::json::parse(swap.index_json());
  EXPECT_EQ(j["format"], "strata-swap-index");
  EXPECT_EQ(j["partitions"].size(), sizes.size());
  EXPECT_EQ(j["files"].size(), 3u);
}

// locate() names the file bytes read() would move, and copy_range moves them file to file:
// random sub-ranges of a striped partition copied piece by piece into a plain file equal the
// partition's bytes.
TEST_P(SwapSpaceTest, LocatedPiecesCopiedFileToFileEqualThePartition) {
  SwapSpace swap(*io_, config());
  const uint64_t bytes = 1000003;
  swap.allocate("x", 13);  // the partition under test does not start in directory 0
  swap.allocate("block.exp_avg", bytes);
  const auto data = test::random_bytes(bytes, 7);
  AlignedBuffer b = pool_.allocate(bytes);
  std::memcpy(b.data(), data.data(), bytes);
  swap.write("block.exp_avg", 0, {b.data(), bytes}).get();
  File out = File::open(root_ / "copy.bin", OpenMode::kTruncate);
  std::mt19937_64 rng(5);
  for (int k = 0; k < 20; ++k) {
    const uint64_t a = k == 0 ? 0 : rng() % bytes, n = k == 0 ? bytes : 1 + rng() % (bytes - a);
    const auto pieces = swap.locate("block.exp_avg", a, n);
    uint64_t at = 0;
    std::set<const File*> files;
    for (const auto& p : pieces) {
      copy_range(*p.file, p.file_offset, out, at, p.length);
      at += p.length;
      files.insert(p.file);
    }
    ASSERT_EQ(at, n);
    if (n > 3 * (64 << 10)) EXPECT_EQ(files.size(), 3u) << "stripes in every directory";
    auto got = read_range(root_ / "copy.bin", 0, n);
    ASSERT_EQ(0, std::memcmp(got.data(), data.data() + a, n)) << "range " << a << "+" << n;
  }
  EXPECT_THROW(swap.locate("block.exp_avg", bytes - 1, 2), std::invalid_argument);
  EXPECT_THROW(swap.locate("nope", 0, 1), std::invalid_argument);
}

TEST_P(SwapSpaceTest, FreedExtentsAreReusedAndOtherPartitionsUntouched) {
  SwapSpace swap(*io_, config(0));
  auto keep = test::random_bytes(3 << 20, 1);
  swap.allocate("keep", keep.size());
  swap.write("keep", 0, {keep.data(), keep.size()}).get();
  for (int round = 0; round < 5; ++round) {
    for (int i = 0; i < 10; ++i) swap.allocate("tmp" + std::to_string(i), (i + 1) * 100000);
    for (int i = 0; i < 10; ++i) {
      auto junk = test::random_bytes((i + 1) * 100000, round * 100 + i);
      swap.write("tmp" + std::to_string(i), 0, {junk.data(), junk.size()}).get();
    }
    for (int i : {4, 0, 9, 2, 7, 1, 8, 3, 6, 5}) swap.free("tmp" + std::to_string(i));
  }
  const auto u = swap.usage();
  EXPECT_EQ(u.partitions, 1u);
  EXPECT_EQ(u.bytes, keep.size());
  // Five rounds of the same allocations did not grow the files beyond one round's worth.
  uint64_t total = 0;
  for (auto b : u.file_bytes) total += b;
  EXPECT_LT(total, keep.size() + 5.6e6 + 3 * (64 << 10) * 10);
  std::vector<std::byte> back(keep.size());
  swap.read("keep", 0, {back.data(), back.size()}).get();
  EXPECT_EQ(back, keep);
}

TEST_P(SwapSpaceTest, BadRequestsAreClearErrors) {
  SwapSpace swap(*io_, config());
  swap.allocate("a", 1000);
  std::vector<std::byte> b(2000);
  EXPECT_THROW(swap.allocate("a", 10), std::invalid_argument);
  try {
    swap.read("a", 500, {b.data(), 501}).get();
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("outside partition 'a' of 1000 bytes"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(swap.read("nope", 0, {b.data(), 1}), std::invalid_argument);
  EXPECT_THROW(swap.free("nope"), std::invalid_argument);
  // Allocated but never written: the extent was reserved with fallocate and reads as zeros.
  std::fill(b.begin(), b.end(), std::byte{0x5a});
  swap.read("a", 0, {b.data(), 1000}).get();
  EXPECT_EQ(std::count(b.begin(), b.begin() + 1000, std::byte{0}), 1000);

  SwapConfig bad = config();
  bad.dirs.push_back(root_ / "missing");
  try {
    SwapSpace s2(*io_, bad);
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("missing"), std::string::npos) << e.what();
  }
  bad = config();
  bad.stripe_bytes = 1000;
  EXPECT_THROW(SwapSpace(*io_, bad), std::invalid_argument);
}

// An I/O failure says which partition, which bytes and which rank, beside the file and errno.
TEST_P(SwapSpaceTest, IoFailuresNameThePartitionTheBytesAndTheRank) {
  SwapSpace swap(*io_, config(3));
  swap.allocate("block.7.exp_avg", 256 << 10);
  std::vector<std::byte> b(64 << 10, std::byte{1});
  swap.write("block.7.exp_avg", 0, b).get();
  // The disk loses the file's contents under us (as a failing drive or an operator might).
  for (uint32_t d = 0; d < dirs_.size(); ++d) std::filesystem::resize_file(swap.file_path(d), 0);
  try {
    swap.read("block.7.exp_avg", 65536, {b.data(), b.size()}).get();
    FAIL() << "a read past the end of the truncated swap file succeeded";
  } catch (const IoError& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("swap read of partition 'block.7.exp_avg' bytes [65536, 131072) of rank 3: read ", 0), 0u) << m;
    EXPECT_NE(m.find("strata-swap-r00003-d"), std::string::npos) << m;
    EXPECT_NE(m.find("shrank"), std::string::npos) << m;
    EXPECT_EQ(e.error(), ENODATA) << m;
  }
}

TEST_P(SwapSpaceTest, FilesAreRemovedOnCloseUnlessKept) {
  std::filesystem::path f;
  {
    SwapSpace swap(*io_, config());
    f = swap.file_path(1);
    EXPECT_TRUE(std::filesystem::exists(f));
  }
  EXPECT_FALSE(std::filesystem::exists(f));
  auto c = config();
  c.remove_files_on_close = false;
  { SwapSpace swap(*io_, c); }
  EXPECT_TRUE(std::filesystem::exists(f));
}

TEST_P(SwapSpaceTest, ASecondSwapOnTheSameFilesIsRefusedAndTouchesNothing) {
  SwapSpace first(*io_, config());
  first.allocate("w", 8192);
  std::vector<std::byte> data(8192);
  test::fill_random(data.data(), data.size(), 11);
  ASSERT_TRUE(first.write("w", 0, data).wait().ok());
  try {
    SwapSpace second(*io_, config());  // same directories, same rank
    FAIL() << "a second swap space on the same files was allowed";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("in use by another engine"), std::string::npos) << e.what();
  }
  SwapSpace other_rank(*io_, config(4));  // another rank's files are its own
  std::vector<std::byte> back(8192);
  ASSERT_TRUE(first.read("w", 0, back).wait().ok());
  EXPECT_EQ(back, data) << "the refused swap space truncated the first one's file";
}

INSTANTIATE_TEST_SUITE_P(Backends, SwapSpaceTest,
                         ::testing::Values(IoBackend::kIoUring, IoBackend::kThreadPool),
                         [](const auto& info) {
                           return info.param == IoBackend::kIoUring ? std::string("io_uring")
                                                                    : std::string("threads");
                         });

}  // namespace
}  // namespace strata::offload
