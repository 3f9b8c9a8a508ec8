// A save's staging memory: buffers of one chunk each, at most `limit` bytes of them. take()
// hands out a free one, or a new one, or waits for the oldest write to finish and reuses its
// buffer; so host memory stays bounded and a disk slower than the copy makes the copy wait.
// Ownership: the staging owns its buffers; every write finishes before its buffer goes (the
// destructor waits). Errors: a failed write throws std::runtime_error from take(), reap() (at
// once, so that a failing disk stops the copy) or drain() (after waiting for all).
// Thread safety: one thread (the save's writer).
#pragma once

#include <ATen/core/Tensor.h>

#include <deque>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/format.h"
#include "strata/offload/io_future.h"

namespace strata::engine::ckpt {

class Staging {
 public:
  explicit Staging(uint64_t limit) : max_buffers_(std::max<uint64_t>(1, limit / (kChunkElements * 4))) {}
  ~Staging() {
    for (auto& [buf, write] : in_flight_) write.wait();
  }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  float* take() {
    if (!free_.empty()) {
      at::Tensor t = std::move(free_.back());
      free_.pop_back();
      return hand_out(std::move(t));
    }
    if (allocated_ < max_buffers_ || in_flight_.empty()) {
      ++allocated_;
      return hand_out(aligned_floats(int64_t(kChunkElements)));
    }
    auto [buf, write] = std::move(in_flight_.front());
    in_flight_.pop_front();
    const offload::IoStatus st = write.wait();
    if (!st.ok()) throw std::runtime_error(st.message());  // a full disk: stop copying now
    return hand_out(std::move(buf));
  }
  uint64_t allocated_bytes() const { return allocated_ * kChunkElements * 4; }
  // The buffer take() returned last goes out with `write`.
  void writing(offload::IoFuture write) { in_flight_.emplace_back(std::move(current_), std::move(write)); }
  // Without waiting: recycles the buffers whose writes are done; throws the first error.
  void reap() {
    while (!in_flight_.empty() && in_flight_.front().second.ready()) {
      const offload::IoStatus st = in_flight_.front().second.wait();
      free_.push_back(std::move(in_flight_.front().first));
      in_flight_.pop_front();
      if (!st.ok()) throw std::runtime_error(st.message());
    }
  }
  // Waits for every write; rethrows the first error.
  void drain() {
    std::string error;
    while (!in_flight_.empty()) {
      const offload::IoStatus st = in_flight_.front().second.wait();
      if (!st.ok() && error.empty()) error = st.message();
      free_.push_back(std::move(in_flight_.front().first));
      in_flight_.pop_front();
    }
    if (!error.empty()) throw std::runtime_error(error);
  }

 private:
  float* hand_out(at::Tensor t) {
    current_ = std::move(t);
    return current_.data_ptr<float>();
  }
  uint64_t max_buffers_, allocated_ = 0;
  at::Tensor current_;
  std::vector<at::Tensor> free_;
  std::deque<std::pair<at::Tensor, offload::IoFuture>> in_flight_;
};

}  // namespace strata::engine::ckpt
