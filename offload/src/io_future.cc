#include "strata/offload/io_future.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <exception>

namespace strata::offload {

namespace detail {
void run_continuation(const std::function<void(const IoStatus&)>& fn, const IoStatus& status) {
  try {
    fn(status);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata: exception escaped an I/O continuation: %s\n", e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "strata: exception escaped an I/O continuation\n");
    std::abort();
  }
}
}  // namespace detail

bool IoFuture::ready() const {
  std::lock_guard lock(state_->mu);
  return state_->done;
}

IoStatus IoFuture::wait() const {
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  return state_->status;  // immutable once done
}

void IoFuture::then(std::function<void(const IoStatus&)> fn) const {
  {
    std::lock_guard lock(state_->mu);
    if (!state_->done) {
      state_->continuations.push_back(std::move(fn));
      return;
    }
  }
  detail::run_continuation(fn, state_->status);
}

IoFuture IoFuture::completed(IoStatus status) {
  IoPromise p;
  p.complete(std::move(status));
  return p.future();
}

void IoPromise::complete(IoStatus status) const {
  // A waiter may destroy the promise as soon as `done` is visible: keep the state alive here.
  const std::shared_ptr<detail::IoState> state = state_;
  std::vector<std::function<void(const IoStatus&)>> continuations;
  {
    std::lock_guard lock(state->mu);
    state->status = std::move(status);
    state->done = true;
    continuations.swap(state->continuations);
  }
  state->cv.notify_all();
  for (auto& fn : continuations) detail::run_continuation(fn, state->status);
}

IoFuture when_all(std::span<const IoFuture> futures) {
  if (futures.empty()) return IoFuture::completed();
  if (futures.size() == 1) return futures[0];
  struct Join {
    IoPromise promise;
    std::atomic<size_t> remaining;
    std::mutex mu;
    std::vector<IoStatus> statuses;
  };
  auto join = std::make_shared<Join>();
  join->remaining = futures.size();
  join->statuses.resize(futures.size());
  for (size_t i = 0; i < futures.size(); ++i) {
    futures[i].then([join, i](const IoStatus& s) {
      if (!s.ok()) {
        std::lock_guard lock(join->mu);
        join->statuses[i] = s;
      }
      if (join->remaining.fetch_sub(1) == 1) {
        for (auto& st : join->statuses) {
          if (!st.ok()) return join->promise.complete(st);
        }
        join->promise.complete({});
      }
    });
  }
  return join->promise.future();
}

}  // namespace strata::offload
