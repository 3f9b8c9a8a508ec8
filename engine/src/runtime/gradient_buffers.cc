#include "runtime/gradient_buffers.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

namespace strata::engine::runtime {

using state::kGrad;

GradientBuffers::GradientBuffers(state::StateStore& store, const Partition& partition, Device& device,
                                 Profiler& prof, state::HostMemory& host, size_t count, uint64_t numel)
    : store_(store), partition_(partition), dev_(device), prof_(prof), used_(count, 0),
      slot_(partition.num_units(), 0) {
  for (size_t i = 0; i < count; ++i)
    pool_.push_back(host.state(numel, at::kFloat, "gradient buffer " + std::to_string(i)));
}

void GradientBuffers::take(size_t u) {
  size_t slot = 0;
  {
    std::unique_lock<std::mutex> lock(mu_);
    const auto free_slot = [&] { return std::find(used_.begin(), used_.end(), 0) != used_.end(); };
    if (!free_slot()) {
      auto t = prof_.time(prof_.step.wait_update, "wait update (gradient buffers)", &partition_.unit(u).name);
      // The updater frees buffers as the d2h stream's host functions mark gradients final: a
      // failed stream would stop it for good, so the wait checks the stream every second.
      while (!cv_.wait_for(lock, std::chrono::seconds(1), [&] { return free_slot() || error_; })) {
        const std::string error = dev_.stream_error(dev_.d2h_stream());
        if (!error.empty())
          throw std::runtime_error("gradient buffer for unit " + partition_.unit(u).name +
                                   ": the update that frees one waits for gradients that will not come: " + error);
      }
    }
    if (!free_slot()) std::rethrow_exception(error_);  // a failed updater frees nothing more
    slot = size_t(std::find(used_.begin(), used_.end(), 0) - used_.begin());
    used_[slot] = 1;
    slot_.at(u) = slot;
  }
  store_.tensor(u, kGrad) = pool_[slot].narrow(0, 0, int64_t(partition_.unit(u).shard_numel));
}

void GradientBuffers::release(size_t u) {
  store_.tensor(u, kGrad) = at::Tensor();
  std::lock_guard<std::mutex> lock(mu_);
  used_.at(slot_.at(u)) = 0;
  cv_.notify_all();
}

void GradientBuffers::fail(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mu_);
  error_ = std::move(error);
  cv_.notify_all();
}

void GradientBuffers::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  error_ = nullptr;
}

}  // namespace strata::engine::runtime
