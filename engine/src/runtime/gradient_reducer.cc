#include "runtime/gradient_reducer.h"

#include <chrono>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>

namespace strata::engine::runtime {

using state::kGrad;

GradientReducer::GradientReducer(const layout::Schedule& schedule, const Partition& partition,
                                 state::StateStore& store, state::HostMemory& host, Device& device,
                                 Communicator& comm, Profiler& prof, bool reduce_bf16,
                                 std::vector<std::vector<ParamRef>> stage_params, size_t transient_buffers,
                                 uint64_t buffer_numel)
    : schedule_(schedule), partition_(partition), store_(store), host_(host), dev_(device), comm_(comm), prof_(prof),
      reduce_bf16_(reduce_bf16), stage_params_(std::move(stage_params)), fresh_(partition.num_units(), 1),
      last_write_(partition.num_units()) {
  if (store.plan().grads_transient) {
    if (transient_buffers == 0)
      throw std::invalid_argument("GradientReducer: transient gradients need at least one gradient buffer");
    buffers_ = std::make_unique<GradientBuffers>(store, partition, device, prof, host, transient_buffers, buffer_numel);
  }
}

GradientReducer::~GradientReducer() {
  try {
    finish_writes();
  } catch (...) {
  }
}

void GradientReducer::hand_final_gradients(size_t stage, FinalGradientSink& sink) {
  for (size_t u : schedule_.units_of(stage)) {
    if (partition_.frozen(u) || schedule_.last_use_stage(u) != stage) continue;
    dev_.launch_host(dev_.d2h_stream(), [this, &sink, u] {
      sink.mark_final(u, store_.placement(u, kGrad) == Placement::kNvme ? last_write(u) : offload::IoFuture());
    });
  }
}

offload::IoFuture GradientReducer::last_write(size_t u) {
  std::lock_guard<std::mutex> lock(mu_);
  return last_write_.at(u);
}

void GradientReducer::bound_pending_writes() {
  const auto done = [](const std::pair<offload::IoFuture, std::array<at::Tensor, 2>>& w) {
    return w.first.ready() && w.first.wait().ok();  // failures stay, for the step's end to report
  };
  std::unique_lock<std::mutex> lock(mu_);
  std::erase_if(writes_, done);
  while (writes_.size() > kMaxPendingWrites) {
    const offload::IoFuture oldest = writes_.front().first;
    lock.unlock();
    {
      auto t = prof_.time(prof_.step.wait_grads, "wait gradient write");
      oldest.get();  // a failure fails the step now
    }
    lock.lock();
    std::erase_if(writes_, done);
  }
}

void GradientReducer::finish_writes() {
  std::vector<std::pair<offload::IoFuture, std::array<at::Tensor, 2>>> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending.swap(writes_);
    for (auto& w : last_write_) w = {};
  }
  for (auto& [w, buffer] : pending) w.wait();
  for (auto& [w, buffer] : pending) w.get();
}

void GradientReducer::end_step() {
  reduces_in_flight_.clear();  // the step's end synchronized the d2h stream
  for (size_t u = 0; u < fresh_.size(); ++u) {
    if (partition_.frozen(u)) continue;
    if (store_.placement(u, kGrad) == Placement::kDevice) store_.tensor(u, kGrad).zero_();
    else fresh_[u] = 1;  // the next step's first reduce overwrites
  }
}

// The units' flat fp32 buffers: autograd's gradients copied in, zeros only where none came
// (tensors without a gradient, the padding after the tensors), so each element is written once.
std::map<size_t, at::Tensor> GradientReducer::flat_gradients(size_t stage) {
  std::map<size_t, at::Tensor> flats;
  std::map<size_t, std::vector<bool>> missing;  // by unit: its tensors that got no gradient
  for (size_t u : schedule_.units_of(stage)) {
    const UnitLayout& L = partition_.unit(u);
    if (L.frozen) continue;  // no gradient (every rank skips it alike)
    flats[u] = dev_.empty({int64_t(L.padded_numel())}, at::kFloat, "gradient of unit " + L.name);
    flats[u].narrow(0, int64_t(L.numel), int64_t(L.padded_numel() - L.numel)).zero_();
    missing[u].assign(L.tensors.size(), true);
  }
  for (ParamRef& p : stage_params_.at(stage)) {
    at::Tensor g = p.tensor.grad();
    if (!g.defined()) continue;
    const TensorSlot& s = partition_.unit(p.unit).tensors[p.slot];
    flats.at(p.unit).narrow(0, int64_t(s.offset), int64_t(s.numel)).copy_(g.reshape(-1));
    missing.at(p.unit).at(p.slot) = false;
    p.tensor.mutable_grad() = at::Tensor();
  }
  for (auto& [u, none] : missing)
    for (size_t i = 0; i < none.size(); ++i)
      if (none[i]) {
        const TensorSlot& s = partition_.unit(u).tensors[i];
        flats.at(u).narrow(0, int64_t(s.offset), int64_t(s.numel)).zero_();
      }
  return flats;
}

void GradientReducer::reduce(size_t stage) {
  // Every unit the stage uses is reduced, gradient or not, so that the collectives are the same
  // on every rank whatever autograd produced locally.
  std::map<size_t, at::Tensor> flats = flat_gradients(stage);
  for (auto& [u, flat] : flats) {
    const UnitLayout& L = partition_.unit(u);
    at::Tensor send = flat;
    if (reduce_bf16_) {
      send = dev_.empty({int64_t(L.padded_numel())}, at::kBFloat16, "bf16 gradient of unit " + L.name);
      send.copy_(flat);
      flat = at::Tensor();
    }
    // Alone, the reduce-scatter is the identity: the buffer is the shard (no copy).
    at::Tensor shard = comm_.world_size() == 1
                           ? send
                           : dev_.empty({int64_t(L.shard_numel)}, send.scalar_type(), "reduced gradient of unit " + L.name);
    std::shared_ptr<Communicator::Work> work = comm_.reduce_scatter(shard, send);
    prof_.step.network_bytes += uint64_t(shard.nbytes()) * uint64_t(comm_.world_size() - 1);
    send = at::Tensor();  // the collective holds its buffers until it is done
    flat = at::Tensor();
    if (store_.plan().grads_transient && !store_.tensor(u, kGrad).defined()) {
      buffers_->take(u);
      fresh_[u] = 1;
    }
    const Placement where = store_.placement(u, kGrad);
    wait_reduced(std::move(work), where, shard, L.name);
    accumulate(u, shard, where);
  }
}

// A CPU collective's wait blocks until the ranks have exchanged the gradient (comm.h); a CUDA one
// only orders the streams. With other ranks, a shard accumulated off the device is waited for on
// the download stream, before its copy: the next stage's backward runs while the ranks exchange
// (the collective's buffers stay counted on the device until then). Alone, the reduce is the
// identity, done when issued.
void GradientReducer::wait_reduced(std::shared_ptr<Communicator::Work> work, Placement where, const at::Tensor& shard,
                                   const std::string& name) {
  if (where == Placement::kDevice || !Communicator::wait_blocks_host(shard) || comm_.world_size() == 1) {
    auto t = prof_.time(prof_.step.wait_grads, "wait gradient reduce-scatter", &name);
    work->wait();
    return;
  }
  while (reduces_in_flight_.size() >= kMaxReducesInFlight) {
    auto t = prof_.time(prof_.step.wait_grads, "wait gradient reduce-scatter", &name);
    // A failed d2h stream runs nothing more, the event's record included: its error ends the
    // wait instead of a hang.
    while (!reduces_in_flight_.front()->done()) {
      const std::string error = dev_.stream_error(dev_.d2h_stream());
      if (!error.empty()) throw std::runtime_error("gradient reduce-scatter: the download stream failed: " + error);
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    reduces_in_flight_.pop_front();
  }
  dev_.launch_host(dev_.d2h_stream(), [work] { work->wait(); });
  reduces_in_flight_.push_back(dev_.record(dev_.d2h_stream()));
}

// The reduced shard added to unit u's accumulator where it lives (the step's first contribution
// overwrites it).
void GradientReducer::accumulate(size_t u, const at::Tensor& shard, Placement where) {
  at::Tensor acc = store_.tensor(u, kGrad);
  const bool fresh = fresh_[u] != 0;
  if (where == Placement::kDevice) {
    acc.add_(shard);
    return;
  }
  fresh_[u] = 0;
  dev_.wait(dev_.d2h_stream(), dev_.record(dev_.compute_stream()));  // shard is filled there
  if (where == Placement::kHost && fresh && shard.scalar_type() == at::kFloat) {
    // The step's first contribution: copied down straight into the accumulator (no add, and
    // no zeroing after the step).
    dev_.copy_async(acc, shard, dev_.d2h_stream());
    prof_.step.d2h_bytes += uint64_t(shard.nbytes());
    return;
  }
  // Device -> host on the download stream, then accumulated there in fp32.
  at::Tensor host = host_.buffer(partition_.unit(u).shard_numel, shard.scalar_type());
  dev_.copy_async(host, shard, dev_.d2h_stream());
  prof_.step.d2h_bytes += uint64_t(shard.nbytes());
  if (where == Placement::kHost) {
    dev_.launch_host(dev_.d2h_stream(), [acc, host, fresh]() mutable {
      if (fresh) acc.copy_(host);
      else acc.add_(host);
    });
    return;
  }
  accumulate_on_nvme(u, std::move(host), fresh);
}

// Swap: the first micro-batch writes the shard, later ones read, add and write back. The write is
// submitted, not waited for: the stream goes on to the next unit, the next micro-batch's read of
// this unit waits for it, and the step's end waits for them all.
void GradientReducer::accumulate_on_nvme(size_t u, at::Tensor host, bool fresh) {
  bound_pending_writes();
  dev_.launch_host(dev_.d2h_stream(), [this, u, host, fresh]() mutable {
    // On the d2h stream's host function: no pinned (CUDA) allocation here, and the conversion
    // copy below is pageable too (at::Tensor::to allocates plain CPU memory).
    at::Tensor h = host.scalar_type() == at::kFloat ? host : host.to(at::kFloat);
    // Every write of a unit after its previous one (which a read must see, and which must not
    // land after this one).
    const offload::IoFuture before = last_write(u);
    if (before.valid()) before.get();
    if (!fresh) {
      at::Tensor sum = state::HostMemory::unpinned(uint64_t(h.numel()), at::kFloat);
      store_.read(u, kGrad, 0, sum).get();
      sum.add_(h);
      h = sum;
    } else if (!h.is_same(host)) {
      at::Tensor aligned = state::HostMemory::unpinned(uint64_t(h.numel()), at::kFloat);
      aligned.copy_(h);
      h = aligned;
    }
    offload::IoFuture written = store_.write(u, kGrad, 0, h);
    // The entry takes this function's last references (h, and host, which the capture would
    // otherwise free here), so the training thread frees them.
    std::lock_guard<std::mutex> lock(mu_);
    last_write_.at(u) = written;
    writes_.push_back({written, {std::move(h), std::move(host)}});
  });
}

}  // namespace strata::engine::runtime
