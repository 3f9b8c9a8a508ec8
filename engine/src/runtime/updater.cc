#include "runtime/updater.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

namespace strata::engine::runtime {

using state::kGrad;

Updater::Updater(Optimizer& optimizer, state::StateStore& store, const layout::Schedule& schedule,
                 const Partition& partition, Device& device, Profiler& prof, GradientBuffers* buffers)
    : opt_(optimizer), store_(store), schedule_(schedule), partition_(partition), dev_(device), prof_(prof),
      units_(partition.num_units()), buffers_(buffers) {}

Updater::~Updater() { abort(); }

std::shared_future<void> Updater::over() const { return over_; }

void Updater::start(std::function<void(const UnitFn&)> work) {
  finish();
  {
    std::lock_guard<std::mutex> lock(mu_);
    updated_.assign(units_, 0);
    for (size_t u : opt_.units_where(true)) updated_[u] = 1;  // updated on the device, not here
    for (size_t u = 0; u < units_; ++u)
      if (partition_.frozen(u)) updated_[u] = 1;  // never updated
    abort_ = false;
  }
  if (buffers_) buffers_->reset();
  auto promise = std::make_shared<std::promise<void>>();
  over_ = promise->get_future().share();
  thread_ = std::thread([this, work = std::move(work), promise] {
    // Ready when the thread's work is over; carries its error, so that a save waiting on it
    // fails rather than copy half-updated swap files.
    struct SetOnExit {
      Updater& self;
      std::promise<void>& p;
      ~SetOnExit() {
        std::exception_ptr e;
        {
          std::lock_guard<std::mutex> lock(self.mu_);
          e = self.error_;
        }
        if (e) p.set_exception(e);
        else p.set_value();
      }
    } set_on_exit{*this, *promise};
    Profiler::on_updater = true;
    update_begin_ = Profiler::Clock::now();
    try {
      // Device-placed compute copies are written by blocking copies up: on a stream of this
      // thread's own, so that they neither wait for the compute stream's queue nor hold it up.
      // Ordering: a unit is written only after its last read of the step (its last use's
      // all-gather, which the compute stream waited for before the d2h stream's signal, or the
      // step's end), and read again only after wait_updated.
      const std::shared_ptr<void> own_stream = dev_.own_stream_scope();
      work([&](size_t u) {
        const auto end = Profiler::Clock::now();
        update_seconds_ += std::chrono::duration<double>(end - update_begin_).count();
        prof_.span("optimizer", "update " + partition_.unit(u).name, update_begin_, end);
        update_begin_ = end;
        std::lock_guard<std::mutex> lock(mu_);
        updated_.at(u) = 1;
        cv_.notify_all();
      });
    } catch (...) {
      if (buffers_) buffers_->fail(std::current_exception());  // a take waiting for a buffer stops
      std::lock_guard<std::mutex> lock(mu_);
      error_ = std::current_exception();
      std::fill(updated_.begin(), updated_.end(), 1);  // nobody waits any longer
      cv_.notify_all();
    }
  });
}

void Updater::launch_after_step(const kernels::AdamConfig& ac, UnitFn before_write) {
  start([this, ac, before_write = std::move(before_write)](const UnitFn& unit_done) {
    opt_.update_on_cpu(ac, opt_.units_where(false), unit_done, nullptr, [&](size_t u) {
      before_write(u);
      update_begin_ = Profiler::Clock::now();  // waiting for a snapshot is not optimizer work
    });
  });
  gathers_wait_ = true;
}

void Updater::launch_in_backward(const kernels::AdamConfig& ac, UnitFn before_write) {
  finish();
  {
    std::lock_guard<std::mutex> lock(mu_);
    final_.assign(units_, 0);
    final_write_.assign(units_, offload::IoFuture());
  }
  unit_sumsq_.assign(units_, 0.0);
  start([this, ac, before_write = std::move(before_write)](const UnitFn& unit_done) {
    backward_work(ac, before_write, unit_done);
  });
  gathers_wait_ = false;
}

void Updater::backward_work(const kernels::AdamConfig& ac, const UnitFn& before_write, const UnitFn& unit_done) {
  const UnitFn consumed = [&](size_t u) {
    if (buffers_) buffers_->release(u);
  };
  bool grads_on_nvme = false;
  for (size_t u = 0; u < units_; ++u)
    grads_on_nvme |= !partition_.frozen(u) && store_.placement(u, kGrad) == Placement::kNvme;
  if (!grads_on_nvme) {
    // One pass over the units in the order their gradients become final: the first chunks of
    // each unit's swap-resident master and moments are read while its gradient is still on its
    // way (the chunk ring runs ahead across units), and its update starts once the gradient is
    // there. The device's units are updated at the step's end, on the training thread.
    const std::vector<size_t> order = schedule_.in_final_gradient_order(opt_.units_where(false));
    opt_.update_on_cpu(ac, order, unit_done, &unit_sumsq_, [&](size_t u) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        wait_while_d2h_runs(lock, [&] { return final_[u] || abort_; });
        if (abort_) throw std::runtime_error("the step failed before its update was done");
      }
      before_write(u);  // before the first chunk is processed and written back
      update_begin_ = Profiler::Clock::now();  // waiting for gradients is not optimizer work
    }, consumed);
    return;
  }
  // Gradients in swap are read with the unit's state, so only once final: the ready units in
  // batches, each in the order their gradients became final (as Engine::update_order() says, so
  // that a checkpoint's writer releases them in the order this waits for them).
  std::vector<char> taken(units_, 1);
  const std::vector<size_t> on_cpu = opt_.units_where(false);
  for (size_t u : on_cpu) taken[u] = 0;  // the device's and the frozen units are not this thread's
  for (size_t left = on_cpu.size(); left > 0;) {
    std::vector<size_t> ready;
    std::vector<offload::IoFuture> writes;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wait_while_d2h_runs(lock, [&] {
        for (size_t u = 0; u < units_; ++u)
          if (final_[u] && !taken[u]) return true;
        return abort_;
      });
      if (abort_) throw std::runtime_error("the step failed before its update was done");
      for (size_t u = 0; u < units_; ++u)
        if (final_[u] && !taken[u]) {
          ready.push_back(u);
          taken[u] = 1;
          if (final_write_[u].valid()) writes.push_back(final_write_[u]);
        }
    }
    ready = schedule_.in_final_gradient_order(std::move(ready));
    left -= ready.size();
    for (const offload::IoFuture& w : writes) w.get();  // the gradient's last swap write
    update_begin_ = Profiler::Clock::now();  // waiting for gradients is not optimizer work
    opt_.update_on_cpu(ac, ready, unit_done, &unit_sumsq_, [&](size_t u) {
      before_write(u);
      update_begin_ = Profiler::Clock::now();
    }, consumed);
  }
}

void Updater::mark_final(size_t u, offload::IoFuture written) {
  std::lock_guard<std::mutex> lock(mu_);
  final_.at(u) = 1;
  final_write_.at(u) = std::move(written);
  cv_.notify_all();
}

// What it waits for comes from host functions on the d2h stream (gradients marked final) or from
// the updater, which waits for them: a CUDA error on that stream would stop them for good, so
// the wait checks the stream every second and fails naming its error instead of hanging.
template <class Ready>
void Updater::wait_while_d2h_runs(std::unique_lock<std::mutex>& lock, Ready ready) {
  while (!cv_.wait_for(lock, std::chrono::seconds(1), ready)) {
    const std::string error = dev_.stream_error(dev_.d2h_stream());
    if (!error.empty())
      throw std::runtime_error("the update during backward waits for gradients that will not come: " + error);
  }
}

void Updater::wait_updated(size_t u) {
  if (!gathers_wait_) return;
  auto t = prof_.time(prof_.step.wait_update, "wait update", &partition_.unit(u).name);
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return updated_.at(u) != 0; });
  if (error_) {
    lock.unlock();
    finish();
  }
}

void Updater::finish() {
  if (thread_.joinable()) {
    {
      auto t = prof_.time(prof_.step.wait_update, "wait update");
      thread_.join();
    }
    prof_.step.optimizer += update_seconds_;
    update_seconds_ = 0;
    prof_.nvme_read += prof_.update_read.exchange(0);
    prof_.nvme_write += prof_.update_write.exchange(0);
  }
  gathers_wait_ = false;
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    e = std::exchange(error_, nullptr);
  }
  if (e) std::rethrow_exception(e);
}

void Updater::abort() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    abort_ = true;
    cv_.notify_all();
  }
  try {
    finish();
  } catch (...) {
  }
}

}  // namespace strata::engine::runtime
