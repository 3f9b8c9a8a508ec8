// Thread-pool backend: queue_depth threads each running one pread/pwrite at a time. Used where
// io_uring is unavailable, and as the second implementation the conformance suite checks.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <thread>

#include "engine_core.h"

namespace strata::offload::detail {
namespace {

class ThreadPoolEngine final : public EngineCore {
 public:
  explicit ThreadPoolEngine(const IoEngineConfig& config) : EngineCore(config) {
    for (unsigned i = 0; i < config.queue_depth; ++i) workers_.emplace_back([this] { work(); });
  }

  ~ThreadPoolEngine() override {
    wait_idle();
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  IoBackend backend() const override { return IoBackend::kThreadPool; }

 protected:
  void enqueue(std::vector<Op*>& ops) override {
    {
      std::lock_guard lock(mu_);
      for (Op* op : ops) pending_.push_back(op);
    }
    if (ops.size() == 1) {
      cv_.notify_one();
    } else {
      cv_.notify_all();
    }
  }

 private:
  void work() {
    for (;;) {
      Op* op;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
        if (pending_.empty()) return;  // stopping
        op = pending_.front();
        pending_.pop_front();
        note_in_flight(++running_);
      }
      const ssize_t n = op->kind == IoRequest::Kind::kRead
                            ? ::pread(op->fd(), op->data, op->remaining,
                                      static_cast<off_t>(op->offset))
                            : ::pwrite(op->fd(), op->data, op->remaining,
                                       static_cast<off_t>(op->offset));
      const int64_t result = n < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(n);
      {
        std::lock_guard lock(mu_);
        --running_;
      }
      complete_op(op, result);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op*> pending_;
  bool stopping_ = false;
  uint64_t running_ = 0;  // operations inside pread/pwrite (guarded by mu_)
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<IoEngine> make_thread_pool_engine(const IoEngineConfig& config) {
  return std::make_unique<ThreadPoolEngine>(config);
}

}  // namespace strata::offload::detail
