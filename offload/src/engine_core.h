// Shared core of the I/O backends (private header).
//
// A request is planned into operations: blocks of at most `block_bytes`, each sent through the
// O_DIRECT descriptor when offset, length and address allow, with any unaligned tail sent
// through the buffered descriptor. A backend only executes operations (one kernel call each) and
// reports results to complete_op(), which owns the policy: fault injection, bounded retry of
// EINTR/EAGAIN, resubmission of short transfers, end-of-file detection, error messages and
// completing the request's future when its last operation finishes.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

#include "strata/offload/io_engine.h"

namespace strata::offload::detail {

struct Request {
  IoPromise promise;
  std::atomic<size_t> remaining_ops{0};
  std::mutex mu;
  IoStatus first_error;
  uint64_t bytes = 0;
  IoRequest::Kind kind;
};

struct Op {
  std::shared_ptr<Request> request;
  IoRequest::Kind kind;
  const File* file;
  bool direct;
  uint64_t offset;     // next byte to transfer (file offset)
  std::byte* data;     // next byte to transfer (memory)
  uint64_t remaining;  // bytes still to transfer
  unsigned retries = 0;

  int fd() const { return direct ? file->direct_fd() : file->buffered_fd(); }
};

class EngineCore : public IoEngine {
 public:
  explicit EngineCore(const IoEngineConfig& config);

  std::vector<IoFuture> submit(std::span<const IoRequest> requests) final;
  const IoEngineConfig& config() const final { return config_; }
  IoEngineStats stats() const final;

 protected:
  // Starts the operations; the backend must eventually call complete_op() once per execution.
  virtual void enqueue(std::vector<Op*>& ops) = 0;
  // `result`: bytes transferred or -errno. May call enqueue() again (retry or remainder).
  void complete_op(Op* op, int64_t result);
  // Blocks until every submitted operation has completed (destructors call it first).
  void wait_idle();
  // Backends report how many operations they have in the kernel after each change.
  void note_in_flight(uint64_t n) {
    uint64_t peak = peak_in_flight_.load(std::memory_order_relaxed);
    while (n > peak && !peak_in_flight_.compare_exchange_weak(peak, n)) {
    }
  }

  IoEngineConfig config_;

 private:
  void finish_op(Op* op, IoStatus status);
  void plan(const IoRequest& r, const std::shared_ptr<Request>& req, std::vector<Op*>& ops);

  std::atomic<uint64_t> bytes_read_{0}, bytes_written_{0}, requests_{0}, blocks_{0},
      resubmits_{0}, retries_{0}, buffered_ops_{0}, failures_{0}, peak_in_flight_{0};
  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  uint64_t outstanding_ = 0;  // operations not yet finished (guarded by idle_mu_)
};

std::unique_ptr<IoEngine> make_uring_engine(const IoEngineConfig& config);  // throws IoError
std::unique_ptr<IoEngine> make_thread_pool_engine(const IoEngineConfig& config);

}  // namespace strata::offload::detail
