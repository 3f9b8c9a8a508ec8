// Completion of asynchronous I/O: a future that can be waited on, queried, or chained.
//
// Thread safety: every member is safe to call from any thread. Continuations registered with
// then() run exactly once, either immediately on the calling thread (already complete) or on the
// thread that completes the future (an I/O engine's completion thread): they must be short, must
// not block waiting for I/O of the same engine, must not destroy that engine, and must not throw
// (an escaping exception is reported on stderr and aborts: there is no caller to receive it).
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "strata/offload/io_status.h"

namespace strata::offload {

namespace detail {
struct IoState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  IoStatus status;
  std::vector<std::function<void(const IoStatus&)>> continuations;
};
void run_continuation(const std::function<void(const IoStatus&)>& fn, const IoStatus& status);
}  // namespace detail

class IoFuture {
 public:
  IoFuture() = default;  // invalid until assigned
  explicit IoFuture(std::shared_ptr<detail::IoState> state) : state_(std::move(state)) {}

  bool valid() const { return state_ != nullptr; }
  bool ready() const;
  // Blocks until complete; returns (a copy of) the final status, never throws.
  IoStatus wait() const;
  // Blocks until complete; throws IoError on failure.
  void get() const { wait().throw_if_error(); }
  // Registers a continuation (see the thread-safety note above).
  void then(std::function<void(const IoStatus&)> fn) const;

  // A future that is already complete with `status`.
  static IoFuture completed(IoStatus status = {});

 private:
  std::shared_ptr<detail::IoState> state_;
};

// The producing side of an IoFuture. complete() must be called exactly once.
class IoPromise {
 public:
  IoPromise() : state_(std::make_shared<detail::IoState>()) {}
  IoFuture future() const { return IoFuture(state_); }
  void complete(IoStatus status) const;

 private:
  std::shared_ptr<detail::IoState> state_;
};

// Completes when all `futures` have completed; its status is the first failure among them (in
// the order given), or ok.
IoFuture when_all(std::span<const IoFuture> futures);

}  // namespace strata::offload
