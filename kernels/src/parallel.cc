#include "parallel.h"

#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace strata::kernels::detail {
namespace {

class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  void run(size_t tasks, unsigned threads, const std::function<void(size_t)>& fn) {
    std::lock_guard serial(run_mu_);
    const unsigned helpers = static_cast<unsigned>(std::min<size_t>(threads, tasks)) - 1;
    {
      std::unique_lock lock(mu_);
      while (workers_.size() < helpers) workers_.emplace_back([this] { work(); });
      fn_ = &fn;
      tasks_ = tasks;
      next_ = 0;
      error_ = nullptr;
      wanted_ = helpers;
      busy_ = helpers;
      ++generation_;
    }
    cv_.notify_all();
    drain();
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return busy_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void drain() {
    for (;;) {
      const size_t t = next_.fetch_add(1);
      if (t >= tasks_) return;
      try {
        (*fn_)(t);
      } catch (...) {
        std::lock_guard lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  void work() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || (generation_ != seen && wanted_ > 0); });
        if (stop_) return;
        seen = generation_;
        --wanted_;
      }
      drain();
      std::lock_guard lock(mu_);
      if (--busy_ == 0) done_cv_.notify_all();
    }
  }

  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(size_t)>* fn_ = nullptr;
  size_t tasks_ = 0;
  std::atomic<size_t> next_{0};
  std::exception_ptr error_;
  unsigned wanted_ = 0, busy_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace

void parallel_for(size_t tasks, unsigned threads, const std::function<void(size_t)>& fn) {
  if (tasks == 0) return;
  if (threads <= 1 || tasks == 1) {
    for (size_t t = 0; t < tasks; ++t) fn(t);
    return;
  }
  static Pool pool;
  pool.run(tasks, threads, fn);
}

}  // namespace strata::kernels::detail
