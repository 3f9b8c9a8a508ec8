#include "runtime/coordinator.h"
#include "runtime/quant4_record.h"
#include "strata/kernels/quant4.h"

#include <ATen/ops/empty.h>

#include <algorithm>

namespace strata::engine::runtime {

using layout::Use;
using state::kCompute;

ParameterCoordinator::ParameterCoordinator(const layout::Schedule& schedule, const layout::MemoryModel& memory,
                                           const layout::Choices& choice, const Partition& partition,
                                           state::StateStore& store, state::HostMemory& host, Device& device,
                                           Communicator& comm, Profiler& prof, UpdateFence* fence)
    : schedule_(schedule), memory_(memory), choice_(choice), partition_(partition), store_(store), host_(host),
      dev_(device), comm_(comm), prof_(prof), fence_(fence),
      cdt_(store.dtype(kCompute)), tensors_(partition.num_units()) {}

ParameterCoordinator::~ParameterCoordinator() {
  for (auto& [u, g] : live_)
    if (!g.bound) try {
        wait_gathered(g);
      } catch (...) {
      }
}

void ParameterCoordinator::wait_gathered(Gathered& g) {
  if (g.work) g.work->wait();
  if (g.uploaded) dev_.wait(dev_.compute_stream(), g.uploaded);
}

void ParameterCoordinator::adopt(size_t u, std::vector<at::Tensor> tensors) {
  tensors_.at(u) = std::move(tensors);
  release(u);
}

// The room test: the device-placed state, the gathered units, the working set's scratch with the
// largest stage graph (the running use's, or a later one's while what is gathered now is still
// held: MemoryModel::room_scratch), device checkpoints and the kept graphs, plus `extra`, within
// the budget.
bool ParameterCoordinator::fits(uint64_t extra) const {
  uint64_t gathered = 0;
  for (auto& [u, g] : live_) gathered += unit_bytes(u);
  return base_bytes_ + gathered + extra + memory_.room_scratch(choice_) + memory_.device_checkpoints(choice_) +
             graphs_held_ <=
         dev_.budget();
}

// A shard off the device is uploaded straight into this rank's slice of the gathered buffer,
// which the all-gather then fills around it in place; at world size 1 the upload is the whole
// gather, and the compute stream waits for it only when the unit is bound (on the host device,
// where waiting blocks the thread, the prefetch then runs beside the compute instead of before
// it).
void ParameterCoordinator::start_gather(size_t u) {
  if (fence_) fence_->wait_updated(u);
  const UnitLayout& L = partition_.unit(u);
  Gathered g;
  g.flat = dev_.empty({int64_t(L.padded_numel())}, cdt_, "parameters of unit " + L.name);
  at::Tensor src = store_.tensor(u, kCompute);
  const Placement where = store_.placement(u, kCompute);
  if (where != Placement::kDevice) {
    const at::Tensor mine = g.flat.narrow(0, int64_t(L.shard_begin(comm_.rank())), int64_t(L.shard_numel));
    // The upload stream must not write memory the compute stream may still be using.
    dev_.wait(dev_.h2d_stream(), dev_.record(dev_.compute_stream()));
    if (where == Placement::kNvme) {
      // NVMe -> host buffer now; the upload stream waits for the read before copying it up.
      src = host_.buffer(L.shard_numel, cdt_);
      offload::IoFuture read = store_.read(u, kCompute, 0, src);
      dev_.launch_host(dev_.h2d_stream(), [read] { read.get(); });
    }
    dev_.copy_async(mine, src, dev_.h2d_stream());
    prof_.step.h2d_bytes += uint64_t(src.nbytes());
    if (comm_.world_size() == 1) {
      g.uploaded = dev_.record(dev_.h2d_stream());
      live_.emplace(u, std::move(g));
      return;
    }
    {
      auto t = prof_.time(prof_.step.wait_params, "wait params", &L.name);  // blocks on the host device only
      dev_.wait(dev_.compute_stream(), dev_.record(dev_.h2d_stream()));
    }
    src = mine;
  }
  g.work = comm_.all_gather(g.flat, src);
  prof_.step.network_bytes += uint64_t(src.nbytes()) * uint64_t(comm_.world_size() - 1);
  live_.emplace(u, std::move(g));
}

void ParameterCoordinator::bind(size_t u) {
  Gathered& g = live_.at(u);
  if (g.bound) return;
  {
    auto t = prof_.time(prof_.step.wait_params, "wait params", &partition_.unit(u).name);
    wait_gathered(g);
  }
  const UnitLayout& L = partition_.unit(u);
  for (size_t i = 0; i < L.tensors.size(); ++i) {
    const TensorSlot& s = L.tensors[i];
    const at::Tensor slot = g.flat.narrow(0, int64_t(s.offset), int64_t(s.numel));
    if (!s.quantized) {
      tensors_[u][i].set_data(slot.view(s.shape));
      continue;
    }
    const at::Tensor w = dev_.empty(s.shape, cdt_, s.name + " dequantized");
    dev_.dequantize_4bit(quant4_view(slot, uint64_t(w.numel()), quant_), kernels::quant4_from_string(quant_.quant_type),
                         quant_.blocksize, w);
    tensors_[u][i].set_data(w);
  }
  g.bound = true;
}

void ParameterCoordinator::release(size_t u) {
  auto it = live_.find(u);
  if (it != live_.end() && !it->second.bound) wait_gathered(it->second);
  drop_storage(tensors_.at(u), cdt_, dev_);
  if (it != live_.end()) live_.erase(it);
}

void ParameterCoordinator::drop_storage(std::vector<at::Tensor>& tensors, at::ScalarType dtype, Device& device) {
  for (at::Tensor& t : tensors) t.set_data(at::empty({0}, at::TensorOptions().dtype(dtype).device(device.torch_device())));
}

void ParameterCoordinator::acquire(size_t k) {
  const std::vector<size_t>& need = schedule_.units_of(schedule_.use_at(k).stage);
  for (size_t u : need) {
    if (live_.count(u)) continue;
    if (!fits(unit_bytes(u))) {
      // Units kept for later uses make room for the one needed now.
      std::vector<size_t> drop;
      for (auto& [v, g] : live_)
        if (std::find(need.begin(), need.end(), v) == need.end() && !held_.count(v)) drop.push_back(v);
      for (size_t v : drop) release(v);
    }
    start_gather(u);
  }
  for (size_t u : need) bind(u);
}

void ParameterCoordinator::prefetch(size_t k, size_t total) {
  uint64_t graphs_ahead = 0;  // graphs of kept blocks whose forward comes before use j
  for (size_t j = k + 1; j <= k + size_t(depth_) && j < total; ++j) {
    const Use& use = schedule_.use_at(j);
    if (use.kind == Use::kForward && memory_.keeps_graph(use.stage, choice_)) graphs_ahead += memory_.sizes().graph(use.stage);
    for (size_t u : schedule_.units_of(use.stage)) {
      if (live_.count(u)) continue;
      if (!fits(unit_bytes(u) + graphs_ahead)) return;
      start_gather(u);
    }
  }
}

void ParameterCoordinator::release_after(size_t k, size_t total) {
  std::vector<size_t> drop;
  for (auto& [u, g] : live_) {
    bool needed = held_.count(u) > 0;
    for (size_t j = k + 1; j <= k + 1 + size_t(depth_) && j < total && !needed; ++j)
      for (size_t v : schedule_.units_of(schedule_.use_at(j).stage)) needed |= v == u;
    if (!needed) drop.push_back(u);
  }
  for (size_t u : drop) release(u);
}

void ParameterCoordinator::begin_micro_batch() {
  held_.clear();
  graphs_held_ = 0;
}

void ParameterCoordinator::hold(size_t stage) {
  for (size_t u : schedule_.units_of(stage)) held_.insert(u);
}

void ParameterCoordinator::unhold(size_t stage) {
  for (size_t u : schedule_.units_of(stage)) held_.erase(u);
}

}  // namespace strata::engine::runtime
