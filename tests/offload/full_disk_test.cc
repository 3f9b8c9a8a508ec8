// A real full file system: a small tmpfs mounted for the test (needs CAP_SYS_ADMIN, which root
// has on the development machines and CI; skipped with the reason otherwise).
#include <gtest/gtest.h>
#include <sys/mount.h>

#include <cerrno>
#include <cstring>

#include "strata/offload/io_engine.h"
#include "strata/offload/aligned_buffer.h"
#include "strata/offload/swap_space.h"
#include "test_util.h"

namespace strata::offload {
namespace {

class FullDisk : public ::testing::TestWithParam<IoBackend> {
 protected:
  void SetUp() override {
    if (GetParam() == IoBackend::kIoUring && !io_uring_available()) GTEST_SKIP();
    if (mount("tmpfs", dir_.path().c_str(), "tmpfs", 0, "size=4m") != 0) {
      GTEST_SKIP() << "cannot mount a small tmpfs here: " << std::strerror(errno);
    }
    mounted_ = true;
    IoEngineConfig c;
    c.backend = GetParam();
    c.block_bytes = 256 << 10;
    io_ = IoEngine::create(c);
  }
  void TearDown() override {
    io_.reset();
    if (mounted_) umount2(dir_.path().c_str(), MNT_DETACH);
  }
  test::TempDir dir_;
  bool mounted_ = false;
  std::unique_ptr<IoEngine> io_;
  AlignedBuffers pool_;
};

TEST_P(FullDisk, WritePastCapacityFailsWithEnospcAndEarlierDataSurvives) {
  File keep = File::open(dir_ / "keep.bin", OpenMode::kTruncate);
  AlignedBuffer a = pool_.allocate(1 << 20);
  test::fill_random(a.data(), a.size(), 1);
  io_->write(keep, 0, a.span()).get();

  File big = File::open(dir_ / "big.bin", OpenMode::kTruncate);
  AlignedBuffer b = pool_.allocate(8 << 20);
  const IoStatus s = io_->write(big, 0, b.span()).wait();
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(s.is_no_space()) << s.message();
  EXPECT_NE(s.message().find((dir_ / "big.bin").string()), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("No space left on device"), std::string::npos) << s.message();

  AlignedBuffer back = pool_.allocate(1 << 20);
  io_->read(keep, 0, back.span()).get();
  EXPECT_EQ(0, std::memcmp(a.data(), back.data(), a.size()));
}

TEST_P(FullDisk, SwapAllocationBeyondTheDiskFailsUpFrontAndKeepsOtherPartitions) {
  SwapConfig c;
  c.dirs = {dir_.path()};
  c.stripe_bytes = 256 << 10;
  SwapSpace swap(*io_, c);
  swap.allocate("embed", 2 << 20);
  AlignedBuffer a = pool_.allocate(2 << 20);
  test::fill_random(a.data(), a.size(), 2);
  swap.write("embed", 0, a.span()).get();
  try {
    swap.allocate("block0.moments", 3 << 20);
    FAIL() << "allocated more than the file system holds";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error(), ENOSPC);
    EXPECT_NE(std::string(e.what()).find("block0.moments"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("fallocate"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(swap.contains("block0.moments"));
  AlignedBuffer back = pool_.allocate(2 << 20);
  swap.read("embed", 0, back.span()).get();
  EXPECT_EQ(0, std::memcmp(a.data(), back.data(), a.size()));
  swap.allocate("block0.small", 1 << 20);  // what still fits still works
}

INSTANTIATE_TEST_SUITE_P(Backends, FullDisk,
                         ::testing::Values(IoBackend::kIoUring, IoBackend::kThreadPool),
                         [](const auto& info) {
                           return info.param == IoBackend::kIoUring ? std::string("io_uring")
                                                                    : std::string("threads");
                         });

}  // namespace
}  // namespace strata::offload
