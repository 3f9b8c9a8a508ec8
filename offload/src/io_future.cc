#include "strata/offload/io_future.h"

#include <atomic>

namespace strata::offload {

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
  fn(state_->status);
}

IoFuture IoFuture::completed(IoStatus status) {
  IoPromise p;
  p.complete(std::move(status));
  return p.future();
}

void IoPromise::complete(IoStatus status) const {
  std::vector<std::function<void(const IoStatus&)>> continuations;
  {
    std::lock_guard lock(state_->mu);
    state_->status = std::move(status);
    state_->done = true;
    continuations.swap(state_->continuations);
  }
  state_->cv.notify_all();
  for (auto& fn : continuations) fn(state_->status);
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
