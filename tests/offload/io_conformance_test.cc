// The conformance suite every I/O backend must pass: the same tests run on io_uring and on the
// thread pool. The oracle is the data itself: everything written is read back (through the
// engine and through plain reads) and compared byte for byte.
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/vfs.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>

#include "strata/offload/fault_injection.h"
#include "strata/offload/io_engine.h"
#include "strata/offload/aligned_buffer.h"
#include "test_util.h"

namespace strata::offload {
namespace {

using test::TempDir;

std::vector<std::byte> read_plain(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(c.size());
  std::memcpy(out.data(), c.data(), c.size());
  return out;
}

class IoConformance : public ::testing::TestWithParam<IoBackend> {
 protected:
  void SetUp() override {
    std::string why;
    if (GetParam() == IoBackend::kIoUring && !io_uring_available(&why)) {
      GTEST_SKIP() << "io_uring unavailable here: " << why;
    }
  }
  std::unique_ptr<IoEngine> make(unsigned qd = 32, uint64_t block = 1 << 20,
                                 std::shared_ptr<FaultInjector> faults = nullptr,
                                 unsigned max_retries = 64) {
    IoEngineConfig c;
    c.backend = GetParam();
    c.queue_depth = qd;
    c.block_bytes = block;
    c.fault_injector = std::move(faults);
    c.max_retries = max_retries;
    auto e = IoEngine::create(c);
    EXPECT_EQ(e->backend(), GetParam());
    return e;
  }
  TempDir dir_;
  AlignedBuffers pool_;
};

TEST_P(IoConformance, AwkwardSizesOffsetsAndBuffersRoundTrip) {
  auto io = make(8, 64 << 10);  // small blocks: large requests split into many
  File f = File::open(dir_ / "a.bin", OpenMode::kTruncate);
  std::mt19937_64 rng(1);
  const std::vector<uint64_t> sizes = {1, 7, 511, 512, 513, 4095, 4096, 4097, 65536 + 3,
                                       (1 << 20) + 1, 1000003, 3 << 20};
  // Expected file content, built from the same writes.
  std::vector<std::byte> expect;
  uint64_t offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const uint64_t n = sizes[i];
    // Alternate aligned and unaligned file offsets and memory addresses.
    if (i % 2 == 1) offset += 1 + rng() % 4000;
    AlignedBuffer buf = pool_.allocate(n + 64);
    std::byte* data = buf.data() + (i % 3 == 2 ? 17 : 0);
    test::fill_random(data, n, 100 + i);
    io->write(f, offset, {data, n}).get();
    if (expect.size() < offset + n) expect.resize(offset + n);
    std::memcpy(expect.data() + offset, data, n);
    offset += n;
  }
  ASSERT_EQ(f.size(), expect.size());
  // Whole file through the engine into a pinned and into an unaligned buffer.
  AlignedBuffer back = pool_.allocate(expect.size() + 64);
  io->read(f, 0, {back.data(), expect.size()}).get();
  EXPECT_EQ(0, std::memcmp(back.data(), expect.data(), expect.size()));
  io->read(f, 0, {back.data() + 3, expect.size()}).get();
  EXPECT_EQ(0, std::memcmp(back.data() + 3, expect.data(), expect.size()));
  // And independently of the engine.
  EXPECT_EQ(read_plain(dir_ / "a.bin"), expect);
  // Random sub-ranges.
  for (int k = 0; k < 50; ++k) {
    const uint64_t a = rng() % expect.size();
    const uint64_t n = 1 + rng() % (expect.size() - a);
    io->read(f, a, {back.data(), n}).get();
    ASSERT_EQ(0, std::memcmp(back.data(), expect.data() + a, n)) << "range " << a << "+" << n;
  }
  auto s = io->stats();
  EXPECT_GT(s.buffered_ops, 0u);  // the unaligned tails went buffered ...
  if (f.direct()) {
    EXPECT_GT(s.blocks, s.buffered_ops);  // ... the aligned bodies direct
  }
}

TEST_P(IoConformance, HundredsInFlightInterleavedReadsAndWritesVerifyByChecksum) {
  auto io = make(256, 1 << 20);  // hundreds of blocks in the kernel at once
  File f = File::open(dir_ / "b.bin", OpenMode::kTruncate);
  constexpr int kSlots = 400;
  constexpr uint64_t kSlot = 96 << 10;  // each request owns one slot region of the file
  std::mt19937_64 rng(2);
  std::vector<uint64_t> len(kSlots);
  for (auto& l : len) l = 1 + rng() % kSlot;
  AlignedBuffer src = pool_.allocate(kSlots * kSlot);
  AlignedBuffer dst = pool_.allocate(kSlots * kSlot);
  test::fill_random(src.data(), kSlots * kSlot, 3);
  // Phase 1: even slots written, all at once.
  std::vector<IoRequest> reqs;
  for (int i = 0; i < kSlots; i += 2)
    reqs.push_back({IoRequest::Kind::kWrite, &f, i * kSlot, src.data() + i * kSlot, len[i]});
  for (auto& fu : io->submit(reqs)) fu.get();
  // Phase 2: read the even slots while writing the odd ones, interleaved in one batch.
  reqs.clear();
  for (int i = 0; i < kSlots; ++i) {
    const bool even = i % 2 == 0;
    reqs.push_back({even ? IoRequest::Kind::kRead : IoRequest::Kind::kWrite, &f, i * kSlot,
                    (even ? dst.data() : src.data()) + i * kSlot, len[i]});
  }
  auto futures = io->submit(reqs);
  ASSERT_EQ(futures.size(), static_cast<size_t>(kSlots));
  for (auto& fu : futures) fu.get();
  // Phase 3: read the odd slots.
  reqs.clear();
  for (int i = 1; i < kSlots; i += 2)
    reqs.push_back({IoRequest::Kind::kRead, &f, i * kSlot, dst.data() + i * kSlot, len[i]});
  for (auto& fu : io->submit(reqs)) fu.get();
  // io_uring takes a whole queue depth at once; pool threads reach it only as fast as they wake.
  EXPECT_GE(io->stats().peak_in_flight, GetParam() == IoBackend::kIoUring ? 256u : 16u)
      << "peak " << io->stats().peak_in_flight;
  auto checksum = [](const std::byte* p, size_t n) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<uint8_t>(p[i])) * 1099511628211ull;
    return h;
  };
  for (int i = 0; i < kSlots; ++i) {
    ASSERT_EQ(checksum(src.data() + i * kSlot, len[i]), checksum(dst.data() + i * kSlot, len[i]))
        << "slot " << i;
  }
}

TEST_P(IoConformance, ContinuationsCanChainFurtherIo) {
  auto io = make(4);
  File f = File::open(dir_ / "c.bin", OpenMode::kTruncate);
  AlignedBuffer a = pool_.allocate(8192), b = pool_.allocate(8192);
  test::fill_random(a.data(), 8192, 4);
  IoPromise chained;
  io->write(f, 0, a.span()).then([&](const IoStatus& s) {
    if (!s.ok()) return chained.complete(s);  // never assert on the completion thread
    io->read(f, 0, b.span()).then([&](const IoStatus& s2) { chained.complete(s2); });
  });
  chained.future().get();
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), 8192));
}

TEST_P(IoConformance, DestructorWaitsForEverythingInFlight) {
  File f = File::open(dir_ / "d.bin", OpenMode::kTruncate);
  AlignedBuffer a = pool_.allocate(64 << 20);
  test::fill_random(a.data(), a.size(), 5);
  std::vector<IoFuture> futures;
  {
    auto io = make(4, 256 << 10);
    for (int i = 0; i < 16; ++i) futures.push_back(io->write(f, i * (4 << 20), {a.data() + i * (4 << 20), 4 << 20}));
  }  // engine destroyed with writes queued
  for (auto& fu : futures) {
    ASSERT_TRUE(fu.ready());
    EXPECT_TRUE(fu.wait().ok()) << fu.wait().message();
  }
  EXPECT_EQ(read_plain(dir_ / "d.bin"), std::vector<std::byte>(a.data(), a.data() + a.size()));
}

TEST_P(IoConformance, ZeroLengthCompletesAtOnce) {
  auto io = make();
  File f = File::open(dir_ / "z.bin", OpenMode::kTruncate);
  auto fu = io->write(f, 12345, {});
  EXPECT_TRUE(fu.ready());
  EXPECT_TRUE(fu.wait().ok());
  EXPECT_EQ(f.size(), 0u);
}

TEST_P(IoConformance, ReadPastEndOfFileFailsNamingFileAndOffset) {
  auto io = make();
  File f = File::open(dir_ / "e.bin", OpenMode::kTruncate);
  AlignedBuffer a = pool_.allocate(8192);
  io->write(f, 0, {a.data(), 5000}).get();
  const IoStatus s = io->read(f, 0, {a.data(), 8192}).wait();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error(), ENODATA);
  EXPECT_NE(s.message().find((dir_ / "e.bin").string()), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("offset 5000"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("end of file"), std::string::npos) << s.message();
  EXPECT_THROW(io->read(f, 0, {a.data(), 8192}).get(), IoError);
  EXPECT_EQ(io->stats().failures, 2u);
}

TEST_P(IoConformance, FileThatShrankIsReportedNotZeroFilled) {
  auto io = make();
  File f = File::open(dir_ / "s.bin", OpenMode::kTruncate);
  AlignedBuffer a = pool_.allocate(1 << 20);
  test::fill_random(a.data(), a.size(), 6);
  io->write(f, 0, a.span()).get();
  ASSERT_EQ(truncate((dir_ / "s.bin").c_str(), 100000), 0);  // someone else shrinks it
  const IoStatus s = io->read(f, 0, a.span()).wait();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("shrank"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("file is 100000 bytes"), std::string::npos) << s.message();
}

TEST_P(IoConformance, ShortTransfersAreResubmittedForTheRemainder) {
  auto faults = std::make_shared<RuleFaultInjector>();
  // Every operation longer than 1000 bytes comes back 1000 bytes short, over and over: each
  // remainder is resubmitted (and, once unaligned, goes buffered) until nothing is left.
  faults->add({.short_by = 1000, .uses = -1});
  auto io = make(8, 128 << 10, faults);
  File f = File::open(dir_ / "short.bin", OpenMode::kTruncate);
  const size_t n = (1 << 20) + 777;
  AlignedBuffer a = pool_.allocate(n), b = pool_.allocate(n);
  test::fill_random(a.data(), n, 7);
  io->write(f, 4096, {a.data(), n}).get();
  io->read(f, 4096, {b.data(), n}).get();
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), n));
  EXPECT_GT(faults->fired(), 10u);
  EXPECT_EQ(io->stats().resubmits, faults->fired());
  EXPECT_EQ(io->stats().bytes_written, n);
  EXPECT_EQ(io->stats().bytes_read, n);
}

TEST_P(IoConformance, TransientErrorsAreRetriedABoundedNumberOfTimes) {
  auto faults = std::make_shared<RuleFaultInjector>();
  faults->add({.kind = IoRequest::Kind::kWrite, .error = EAGAIN, .uses = 3});
  faults->add({.kind = IoRequest::Kind::kRead, .error = EINTR, .uses = 2});
  auto io = make(4, 1 << 20, faults, /*max_retries=*/5);
  File f = File::open(dir_ / "t.bin", OpenMode::kTruncate);
  AlignedBuffer a = pool_.allocate(65536), b = pool_.allocate(65536);
  test::fill_random(a.data(), 65536, 8);
  io->write(f, 0, a.span()).get();
  io->read(f, 0, b.span()).get();
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), 65536));
  EXPECT_EQ(io->stats().retries, 5u);

  // A condition that never clears is not retried forever.
  faults->add({.kind = IoRequest::Kind::kWrite, .error = EAGAIN, .uses = -1});
  const IoStatus s = io->write(f, 0, a.span()).wait();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error(), EAGAIN);
  EXPECT_NE(s.message().find("gave up after 5 retries"), std::string::npos) << s.message();
}

TEST_P(IoConformance, InjectedEnospcAndEioFailOnlyTheirRequestsAndCorruptNothingElse) {
  auto faults = std::make_shared<RuleFaultInjector>();
  auto io = make(16, 256 << 10, faults);
  File f = File::open(dir_ / "fault.bin", OpenMode::kTruncate);
  constexpr uint64_t kRegion = 1 << 20;
  AlignedBuffer a = pool_.allocate(8 * kRegion), b = pool_.allocate(8 * kRegion);
  test::fill_random(a.data(), 8 * kRegion, 9);
  io->write(f, 0, a.span()).get();  // good data everywhere first

  // Region 5 of a rewrite fails with ENOSPC; the others of the same batch succeed.
  faults->add({.kind = IoRequest::Kind::kWrite, .offset_begin = 5 * kRegion,
               .offset_end = 6 * kRegion, .error = ENOSPC, .uses = -1});
  AlignedBuffer c = pool_.allocate(8 * kRegion);
  test::fill_random(c.data(), 8 * kRegion, 10);
  std::vector<IoRequest> reqs;
  for (uint64_t r = 0; r < 8; ++r)
    reqs.push_back({IoRequest::Kind::kWrite, &f, r * kRegion, c.data() + r * kRegion, kRegion});
  auto futures = io->submit(reqs);
  for (uint64_t r = 0; r < 8; ++r) {
    const IoStatus s = futures[r].wait();
    if (r == 5) {
      ASSERT_FALSE(s.ok());
      EXPECT_TRUE(s.is_no_space());
      EXPECT_NE(s.message().find("write " + (dir_ / "fault.bin").string()), std::string::npos)
          << s.message();
      EXPECT_NE(s.message().find("No space left on device"), std::string::npos) << s.message();
    } else {
      EXPECT_TRUE(s.ok()) << s.message();
    }
  }
  // Reads of region 2 fail with EIO; everything else reads back what the rewrite put there.
  faults->add({.kind = IoRequest::Kind::kRead, .offset_begin = 2 * kRegion,
               .offset_end = 2 * kRegion + 1, .error = EIO, .uses = 1});
  const IoStatus s = io->read(f, 2 * kRegion, {b.data(), kRegion}).wait();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("Input/output error"), std::string::npos) << s.message();
  for (uint64_t r = 0; r < 8; ++r) {
    if (r == 5) continue;  // an injected write error leaves its own range unspecified
    io->read(f, r * kRegion, {b.data(), kRegion}).get();
    EXPECT_EQ(0, std::memcmp(b.data(), c.data() + r * kRegion, kRegion)) << "region " << r;
  }
}

TEST_P(IoConformance, WriteToReadOnlyFileFailsWithEbadf) {
  auto io = make();
  { File w = File::open(dir_ / "ro.bin", OpenMode::kTruncate); }
  File f = File::open(dir_ / "ro.bin", OpenMode::kRead);
  AlignedBuffer a = pool_.allocate(4096);
  const IoStatus s = io->write(f, 0, a.span()).wait();
  EXPECT_EQ(s.error(), EBADF) << s.message();
}

INSTANTIATE_TEST_SUITE_P(Backends, IoConformance,
                         ::testing::Values(IoBackend::kIoUring, IoBackend::kThreadPool),
                         [](const auto& info) {
                           return info.param == IoBackend::kIoUring ? std::string("io_uring")
                                                                    : std::string("threads");
                         });

TEST(IoEngine, MissingDirectoryIsAClearError) {
  try {
    File::open("/nonexistent-strata-dir/x.bin", OpenMode::kCreate);
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error(), ENOENT);
    EXPECT_NE(std::string(e.what()).find("/nonexistent-strata-dir/x.bin"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("No such file or directory"), std::string::npos);
  }
}

TEST(IoEngine, BadConfigurationIsRejected) {
  IoEngineConfig c;
  c.queue_depth = 0;
  EXPECT_THROW(IoEngine::create(c), std::invalid_argument);
  c.queue_depth = 8;
  c.block_bytes = 1000;
  EXPECT_THROW(IoEngine::create(c), std::invalid_argument);
  EXPECT_THROW(parse_io_backend("aio"), std::invalid_argument);
  EXPECT_EQ(parse_io_backend("threads"), IoBackend::kThreadPool);
}

TEST(IoEngine, AutoFallsBackToThreadsWhenIoUringIsUnavailable) {
  ASSERT_EQ(setenv("STRATA_DISABLE_IO_URING", "1", 1), 0);
  std::string why;
  EXPECT_FALSE(io_uring_available(&why));
  EXPECT_NE(why.find("STRATA_DISABLE_IO_URING"), std::string::npos);
  auto io = IoEngine::create({});
  EXPECT_EQ(io->backend(), IoBackend::kThreadPool);
  IoEngineConfig forced;
  forced.backend = IoBackend::kIoUring;
  EXPECT_THROW(IoEngine::create(forced), IoError);  // asked for explicitly: a clear error
  unsetenv("STRATA_DISABLE_IO_URING");
  if (io_uring_available()) EXPECT_EQ(IoEngine::create({})->backend(), IoBackend::kIoUring);
}

TEST(IoEngine, DirectIoIsUsedWhereTheFileSystemAllowsIt) {
  TempDir dir;
  struct statfs fs {};
  ASSERT_EQ(statfs(dir.path().c_str(), &fs), 0);
  File f = File::open(dir / "x.bin", OpenMode::kTruncate);
  if (fs.f_type == TMPFS_MAGIC && !f.direct()) GTEST_SKIP() << "test directory is on tmpfs without O_DIRECT";
  // Every other file system the tests run on here (ext4, xfs, btrfs) supports O_DIRECT: the
  // conformance suite must exercise it, not silently go buffered.
  EXPECT_TRUE(f.direct()) << dir.path();
  EXPECT_GE(f.offset_align(), 4096u);
}

}  // namespace
}  // namespace strata::offload
