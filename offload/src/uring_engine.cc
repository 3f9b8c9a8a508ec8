// io_uring backend. Submission side: any thread, under sq_mu_. Completion side: one reaper
// thread that owns the CQ. At most queue_depth operations are in the kernel; the rest wait in
// pending_ and are pushed as completions free slots, so submit() never blocks.
#include <liburing.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>

#include "engine_core.h"

namespace strata::offload {

bool io_uring_available(std::string* why_not) {
  if (const char* off = std::getenv("STRATA_DISABLE_IO_URING"); off && *off && std::string(off) != "0") {
    if (why_not) *why_not = "disabled by STRATA_DISABLE_IO_URING";
    return false;
  }
  io_uring ring;
  const int rc = io_uring_queue_init(2, &ring, 0);
  if (rc < 0) {
    if (why_not) *why_not = std::string("io_uring_queue_init: ") + std::strerror(-rc);
    return false;
  }
  io_uring_queue_exit(&ring);
  return true;
}

namespace detail {
namespace {

class UringEngine final : public EngineCore {
 public:
  explicit UringEngine(const IoEngineConfig& config) : EngineCore(config) {
    const int rc = io_uring_queue_init(config.queue_depth, &ring_, 0);
    if (rc < 0) {
      throw IoError(-rc, std::string("io_uring_queue_init with ") +
                             std::to_string(config.queue_depth) +
                             " entries: " + std::strerror(-rc) +
                             " (use the thread-pool backend: io.backend = \"threads\")");
    }
    reaper_ = std::thread([this] { reap(); });
  }

  ~UringEngine() override {
    wait_idle();
    {
      // A NOP with no Op tells the reaper to stop (everything else has completed).
      std::lock_guard lock(sq_mu_);
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data(sqe, nullptr);
      submit_locked();
    }
    reaper_.join();
    io_uring_queue_exit(&ring_);
  }

  IoBackend backend() const override { return IoBackend::kIoUring; }

 protected:
  void enqueue(std::vector<Op*>& ops) override {
    std::lock_guard lock(sq_mu_);
    for (Op* op : ops) pending_.push_back(op);
    pump_locked();
  }

 private:
  void pump_locked() {
    unsigned prepared = 0;
    while (inflight_ < config_.queue_depth && !pending_.empty()) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) break;  // SQ full until the next submit
      Op* op = pending_.front();
      pending_.pop_front();
      if (op->kind == IoRequest::Kind::kRead) {
        io_uring_prep_read(sqe, op->fd(), op->data, static_cast<unsigned>(op->remaining),
                           op->offset);
      } else {
        io_uring_prep_write(sqe, op->fd(), op->data, static_cast<unsigned>(op->remaining),
                            op->offset);
      }
      io_uring_sqe_set_data(sqe, op);
      ++inflight_;
      ++prepared;
    }
    if (prepared > 0) {
      note_in_flight(inflight_);
      submit_locked();
    }
  }

  void submit_locked() {
    for (int attempt = 0;; ++attempt) {
      const int rc = io_uring_submit(&ring_);
      if (rc >= 0 && io_uring_sq_ready(&ring_) == 0) return;  // everything taken by the kernel
      if (rc >= 0) continue;                                   // partial: submit the rest
      if ((rc == -EINTR || rc == -EAGAIN || rc == -EBUSY) && attempt < 1000) {
        std::this_thread::yield();
        continue;
      }
      // The SQEs are in the ring and their owners wait on them: there is no safe way to go on.
      std::fprintf(stderr, "strata: io_uring_submit failed: %s\n", std::strerror(-rc));
      std::abort();
    }
  }

  void reap() {
    std::vector<std::pair<Op*, int>> done;
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      const int rc = io_uring_wait_cqe(&ring_, &cqe);
      if (rc == -EINTR || rc == -EAGAIN) continue;
      if (rc < 0) {
        std::fprintf(stderr, "strata: io_uring_wait_cqe failed: %s\n", std::strerror(-rc));
        std::abort();
      }
      done.clear();
      unsigned head, seen = 0;
      bool stop = false;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        auto* op = static_cast<Op*>(io_uring_cqe_get_data(cqe));
        if (op == nullptr) {
          stop = true;
        } else {
          done.emplace_back(op, cqe->res);
        }
        ++seen;
      }
      io_uring_cq_advance(&ring_, seen);
      {
        std::lock_guard lock(sq_mu_);
        inflight_ -= static_cast<unsigned>(done.size());
      }
      for (auto& [op, res] : done) complete_op(op, res);
      {
        std::lock_guard lock(sq_mu_);
        pump_locked();
      }
      if (stop) return;
    }
  }

  io_uring ring_{};
  std::mutex sq_mu_;
  std::deque<Op*> pending_;
  unsigned inflight_ = 0;
  std::thread reaper_;
};

}  // namespace

std::unique_ptr<IoEngine> make_uring_engine(const IoEngineConfig& config) {
  std::string why;
  if (!io_uring_available(&why)) {
    throw IoError(ENOSYS, "io_uring backend requested but unavailable: " + why +
                              " (use the thread-pool backend: io.backend = \"threads\")");
  }
  return std::make_unique<UringEngine>(config);
}

}  // namespace detail
}  // namespace strata::offload
