// The units' partitioned state: for each unit this rank's shard of each kind (master weights,
// the two Adam moments, the fp32 gradient accumulator, the compute-dtype copy), placed by one
// immutable table (StatePlacement) and held by the tier drivers (state/tier.h). Every question
// of where a shard is, how to read it and how to write it is answered here; it is also the
// chunk ring's Source (state/chunk_ring.h).
//
// Kinds and tiers: placement(u, k) is the plan's tier of kind k, per unit for the optimizer
// group (master, moments, gradients) of a split plan (StatePlacement::unit_tier). A kind in the
// device or host tier is a resident tensor (tensor(u, k)); one in swap is the partition
// "<unit>.<kind>" of the swap space, reached through read/write. Gradients may be transient
// (gradients_transient): then host- or swap-placed units have no accumulator here and the
// gradient reducer lends them a buffer (tensor(u, kGrad) is assigned, then reset).
//
// Ownership: the store owns its drivers and the resident tensors; the Device, HostMemory, the
// swap space, the partition and the profiler must outlive it.
// Thread safety: allocate() on the constructing thread, before training. read/write and the
// Source members from any thread for distinct (unit, kind) or disjoint ranges; tensor(u, k) of a
// unit is used by whichever thread the engine's step hands that unit to (the reducer before the
// update, the updater during it), never by two at once. Swap traffic is counted into the
// profiler's counters of the calling thread (Profiler::read_counter).
// Errors: as the drivers'; an unknown kind or unit throws std::out_of_range.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "profiler.h"
#include "state/chunk_ring.h"
#include "state/tier.h"
#include "strata/engine/partition.h"
#include "strata/engine/placement.h"

namespace strata::engine::state {

static_assert(ChunkRing::kKinds == kKinds);

class StateStore final : public ChunkRing::Source {
 public:
  // `swap` may be null when nothing is placed in swap.
  StateStore(const Partition& partition, at::ScalarType compute_dtype, const StatePlacement& placement, Device& device,
             HostMemory& host, offload::SwapSpace* swap, Profiler& prof);

  const StatePlacement& plan() const { return plan_; }
  // Kind k's tier as planned (of a split optimizer group: the tier of its last units).
  Placement kind_placement(int k) const { return kind_tier(plan_, k); }
  Placement placement(size_t u, int k) const { return unit_kind_tier(plan_, u, k); }
  size_t units() const { return partition_.num_units(); }
  // A frozen unit (model.trainable) has only its compute copy: no other kind is allocated.
  bool frozen(size_t u) const { return partition_.frozen(u); }

  // Unit u's shard of every kind, in its tier: master weights and the compute copy :=
  // `initial_master` (fp32 host [shard]), moments and gradients zero; a swap-placed gradient is
  // left unwritten (the first reduce writes it), a transient one is not allocated. A frozen
  // unit's compute copy only.
  void allocate(size_t u, const at::Tensor& initial_master, bool transient_grads);

  // The resident tensor of (u, k) in the device or host tier; undefined in swap.
  at::Tensor& tensor(size_t u, int k) { return resident_.at(u).at(size_t(k)); }
  // Elements [begin, begin + dst.numel()) of (u, k), in any tier, into host memory (see
  // TierDriver::read for completion), and the other way. A kind not allocated here (a transient
  // gradient, whose lent buffer is reached through tensor()) throws std::logic_error.
  offload::IoFuture read(size_t u, int k, uint64_t begin, const at::Tensor& dst) override;
  offload::IoFuture write(size_t u, int k, uint64_t begin, const at::Tensor& src) override;
  // Whether (u, k)'s tier copies straight into a file (TierDriver::copies_to_file: swap), and
  // that copy of elements [begin, begin + numel) into `dst` at byte `offset` (synchronous; a
  // kind whose tier cannot throws std::logic_error). Not counted as the step's swap traffic: it
  // is a checkpoint's.
  bool copies_to_file(size_t u, int k) const;
  void copy_to_file(size_t u, int k, uint64_t begin, uint64_t numel, const offload::File& dst, uint64_t offset);
  uint64_t nvme_bytes() const { return swap_ ? swap_->bytes() : 0; }

  // ChunkRing::Source.
  uint64_t shard_numel(size_t u) const override { return partition_.unit(u).shard_numel; }
  at::ScalarType dtype(int k) const override { return k == kCompute ? compute_ : at::kFloat; }
  bool streamed(size_t u, int k) const override;
  bool on_nvme(size_t u, int k) const override { return placement(u, k) == Placement::kNvme; }
  void* resident(size_t u, int k, uint64_t begin) override;
  void store(size_t u, int k, uint64_t begin, const at::Tensor& src) override;

 private:
  TierDriver& driver(Placement p) const;

  const Partition& partition_;
  const at::ScalarType compute_;
  const StatePlacement plan_;
  Profiler& prof_;
  std::unique_ptr<TierDriver> device_, host_, swap_;
  std::vector<std::array<at::Tensor, kKinds>> resident_;
  static constexpr TierDriver::Region kNone = ~TierDriver::Region(0);
  std::vector<std::array<TierDriver::Region, kKinds>> region_;  // in its placement's driver; kNone
  TierDriver::Region region(size_t u, int k, const char* op) const;
};

}  // namespace strata::engine::state
