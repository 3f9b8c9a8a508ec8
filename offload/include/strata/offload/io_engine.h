// The asynchronous file I/O engine: the only way Strata moves bytes between host memory and
// files (NVMe swap, checkpoints).
//
// Two backends share this interface and one conformance suite:
//   - io_uring: one ring per engine; any thread submits (under a lock), one completion thread
//     reaps and runs continuations;
//   - thread pool: `queue_depth` threads running pread/pwrite; used when io_uring is unavailable
//     (old kernel, seccomp, io_uring_disabled) or when configured.
// Requests larger than `block_bytes` are split into blocks; at most `queue_depth` blocks are in
// the kernel at once, the rest wait in the engine's queue (submission never blocks). Short reads
// and writes are resubmitted for the remainder; EINTR/EAGAIN are retried a bounded number of
// times; a read that meets end-of-file fails (the file shrank or was never written) instead of
// returning fewer bytes.
//
// Contract: buffers and Files must stay alive and untouched until the request's future
// completes. Overlapping concurrent requests on the same bytes have no defined order.
// Thread safety: all members may be called concurrently from any thread. The destructor waits
// for every submitted request to complete; it must not run on the engine's own completion thread
// (from a continuation).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/offload/file.h"
#include "strata/offload/io_future.h"

namespace strata::offload {

class FaultInjector;

enum class IoBackend { kAuto, kIoUring, kThreadPool };
IoBackend parse_io_backend(std::string_view name);  // "auto" | "io_uring" | "threads"
std::string_view to_string(IoBackend backend);

struct IoEngineConfig {
  IoBackend backend = IoBackend::kAuto;
  unsigned queue_depth = 32;         // blocks in flight in the kernel
  uint64_t block_bytes = 1ull << 20; // split size of large requests (bytes)
  unsigned max_retries = 64;         // per block, for EINTR/EAGAIN
  // Tests only: consulted on every completion, may replace its result (see fault_injection.h).
  std::shared_ptr<FaultInjector> fault_injector;
};

struct IoEngineStats {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t requests = 0;      // read()/write() calls
  uint64_t blocks = 0;        // kernel operations issued, resubmissions included
  uint64_t resubmits = 0;     // short transfers continued
  uint64_t retries = 0;       // EINTR/EAGAIN retried
  uint64_t buffered_ops = 0;  // operations that could not use O_DIRECT (unaligned)
  uint64_t failures = 0;      // requests completed with an error
  uint64_t peak_in_flight = 0;  // most operations in the kernel (or in pread/pwrite) at once
};

struct IoRequest {
  enum class Kind { kRead, kWrite } kind;
  const File* file;
  uint64_t offset;
  std::byte* data;  // for writes, read only
  size_t length;
};

class IoEngine {
 public:
  // Creates the configured backend. kAuto tries io_uring and falls back to the thread pool.
  // Throws std::invalid_argument on a bad configuration and IoError if kIoUring is requested
  // explicitly and unavailable.
  static std::unique_ptr<IoEngine> create(const IoEngineConfig& config = {});

  virtual ~IoEngine() = default;

  IoFuture read(const File& file, uint64_t offset, std::span<std::byte> dst);
  IoFuture write(const File& file, uint64_t offset, std::span<const std::byte> src);
  // Batched submission: one future per request, submitted to the kernel together.
  virtual std::vector<IoFuture> submit(std::span<const IoRequest> requests) = 0;

  virtual IoBackend backend() const = 0;
  virtual const IoEngineConfig& config() const = 0;
  virtual IoEngineStats stats() const = 0;
};

// True if this process can create an io_uring (kernel support, seccomp, sysctl) and
// STRATA_DISABLE_IO_URING is unset (or "0"). kAuto and `strata version` use it.
bool io_uring_available(std::string* why_not = nullptr);

}  // namespace strata::offload
