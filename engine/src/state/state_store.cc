#include "state/state_store.h"

#include <stdexcept>

#include "state/host_memory.h"

namespace strata::engine::state {

StateStore::StateStore(const Partition& partition, at::ScalarType compute_dtype, const StatePlacement& placement,
                       Device& device, HostMemory& host, offload::SwapSpace* swap, Profiler& prof)
    : partition_(partition), compute_(compute_dtype), plan_(placement), prof_(prof),
      device_(device_tier(device)), host_(host_tier(host)), swap_(swap ? nvme_tier(*swap) : nullptr),
      resident_(partition.num_units()), region_(partition.num_units()) {
  for (auto& r : region_) r.fill(kNone);
}

TierDriver::Region StateStore::region(size_t u, int k, const char* op) const {
  const TierDriver::Region r = region_.at(u).at(size_t(k));
  if (r == kNone)
    throw std::logic_error(std::string(op) + ": kind " + kind_name(k) + " of unit " + partition_.unit(u).name +
                           " has no storage in the store (a transient gradient)");
  return r;
}

TierDriver& StateStore::driver(Placement p) const {
  switch (p) {
    case Placement::kDevice: return *device_;
    case Placement::kHost: return *host_;
    case Placement::kNvme:
      if (swap_) return *swap_;
      throw std::logic_error("state placed in swap without a swap space");
    default: break;
  }
  throw std::logic_error("state placed in an unresolved tier");
}

void StateStore::allocate(size_t u, const at::Tensor& initial_master, bool transient_grads) {
  const UnitLayout& L = partition_.unit(u);
  std::vector<offload::IoFuture> writes;
  std::vector<at::Tensor> buffers;  // alive until their writes complete
  for (int k = 0; k < kKinds; ++k) {
    if (L.frozen && k != kCompute) continue;  // a frozen unit has only its compute copy
    const Placement p = placement(u, k);
    if (k == kGrad && transient_grads && p != Placement::kDevice) continue;  // lent per step
    TierDriver& d = driver(p);
    region_[u][size_t(k)] = d.allocate(L.name + "." + kind_name(k), L.shard_numel, dtype(k));
    const bool weights = k == kMaster || k == kCompute;
    if (p != Placement::kNvme) {
      at::Tensor& x = resident_[u][size_t(k)] = d.locate(region_[u][size_t(k)]);
      if (weights) x.copy_(initial_master);
      else x.zero_();
      continue;
    }
    if (k == kGrad) continue;  // written by the first reduce
    // fp32 or the compute dtype; HostMemory::unpinned: page aligned, so the write goes direct.
    at::Tensor init = HostMemory::unpinned(L.shard_numel, dtype(k));
    if (weights) init.copy_(initial_master);
    else init.zero_();
    writes.push_back(write(u, k, 0, init));
    buffers.push_back(init);
  }
  for (auto& w : writes) w.wait();
  for (auto& w : writes) w.get();
}

offload::IoFuture StateStore::read(size_t u, int k, uint64_t begin, const at::Tensor& dst) {
  const Placement p = placement(u, k);
  if (p == Placement::kNvme) prof_.read_counter() += uint64_t(dst.nbytes());
  return driver(p).read(region(u, k, "read"), begin, dst);
}

offload::IoFuture StateStore::write(size_t u, int k, uint64_t begin, const at::Tensor& src) {
  const Placement p = placement(u, k);
  if (p == Placement::kNvme) prof_.write_counter() += uint64_t(src.nbytes());
  return driver(p).write(region(u, k, "write"), begin, src);
}

bool StateStore::copies_to_file(size_t u, int k) const {
  return driver(placement(u, k)).copies_to_file();
}

void StateStore::copy_to_file(size_t u, int k, uint64_t begin, uint64_t numel, const offload::File& dst,
                              uint64_t offset) {
  driver(placement(u, k)).copy_to_file(region(u, k, "copy_to_file"), begin, numel, dst, offset);
}

bool StateStore::streamed(size_t u, int k) const {
  const Placement p = placement(u, k);
  return p == Placement::kNvme || (k == kCompute && p == Placement::kDevice);
}

void* StateStore::resident(size_t u, int k, uint64_t begin) {
  const at::Tensor& t = tensor(u, k);
  return t.defined() ? static_cast<char*>(t.data_ptr()) + begin * c10::elementSize(dtype(k)) : nullptr;
}

void StateStore::store(size_t u, int k, uint64_t begin, const at::Tensor& src) {
  tensor(u, k).narrow(0, int64_t(begin), src.numel()).copy_(src);
}

}  // namespace strata::engine::state
