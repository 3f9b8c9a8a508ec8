#include "runtime/optimizer.h"

#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <array>

namespace strata::engine::runtime {

using state::kCompute;
using state::kExpAvg;
using state::kExpAvgSq;
using state::kGrad;
using state::kMaster;

namespace {

constexpr unsigned bit(int k) { return 1u << k; }

}  // namespace

Optimizer::Optimizer(state::StateStore& store, state::HostMemory& host, Device& device, kernels::CpuExec exec,
                     uint64_t chunk_bytes, std::vector<Ranges> no_decay)
    : store_(store), host_(host), dev_(device), exec_(exec), chunk_bytes_(chunk_bytes),
      compute_(Device::kernel_dtype(store.dtype(kCompute))), no_decay_(std::move(no_decay)),
      compute_bytes_(c10::elementSize(store.dtype(kCompute))) {}

template <typename F>
void Optimizer::by_group(const kernels::AdamConfig& ac, size_t u, uint64_t begin, uint64_t numel, F&& fn) const {
  if (ac.weight_decay == 0 || u >= no_decay_.size() || no_decay_[u].empty()) {
    fn(uint64_t(0), numel, ac);
    return;
  }
  kernels::AdamConfig none = ac;
  none.weight_decay = 0;
  const uint64_t end = begin + numel;
  uint64_t at = begin;
  for (const auto& [b, e] : no_decay_[u]) {
    if (e <= at) continue;
    if (b >= end) break;
    if (b > at) fn(at - begin, b - at, ac);
    const uint64_t stop = std::min(e, end);
    fn(std::max(b, at) - begin, stop - std::max(b, at), none);
    at = stop;
  }
  if (at < end) fn(at - begin, end - at, ac);
}

std::vector<size_t> Optimizer::units_where(bool on_device) const {
  std::vector<size_t> out;
  for (size_t u = 0; u < store_.units(); ++u)
    if (!store_.frozen(u) && (store_.placement(u, kMaster) == Placement::kDevice) == on_device) out.push_back(u);
  return out;
}

bool Optimizer::streams() const {
  const StatePlacement& p = store_.plan();
  return p.master == Placement::kNvme || p.grads == Placement::kNvme || p.params == Placement::kNvme;
}

void Optimizer::stream(unsigned in, unsigned out, const std::vector<size_t>& which, const state::ChunkRing::Fn& fn,
                       const UnitFn& unit_done, const UnitFn& before_unit) {
  state::ChunkRing ring(store_, host_, chunk_bytes_);
  ring.run(in, out, which, fn, unit_done, before_unit);
}

double Optimizer::local_sum_squares() {
  std::vector<double> parts(store_.units(), 0.0);
  device_sum_squares(units_where(true), parts);
  double sumsq = 0;
  for (double v : parts) sumsq += v;
  const std::vector<size_t> rest = units_where(false);
  if (store_.plan().grads == Placement::kNvme) {
    stream(bit(kGrad), 0, rest, [&](const state::ChunkRing::Chunk& c, const state::ChunkRing::Pointers& p) {
      sumsq += kernels::sum_squares(p[kGrad], kernels::DType::kF32, c.numel, exec_);
    });
  } else {
    for (size_t u : rest) {
      const at::Tensor& g = store_.tensor(u, kGrad);
      sumsq += kernels::sum_squares(g.data_ptr<float>(), kernels::DType::kF32, size_t(g.numel()), exec_);
    }
  }
  return sumsq;
}

void Optimizer::device_sum_squares(const std::vector<size_t>& which, std::vector<double>& parts) {
  std::vector<at::Tensor> grads;
  for (size_t u : which) grads.push_back(store_.tensor(u, kGrad));
  const std::vector<double> sums = dev_.sum_squares(grads, exec_);
  for (size_t i = 0; i < which.size(); ++i) parts[which[i]] += sums[i];
}

void Optimizer::update_on_device(const kernels::AdamConfig& ac, const std::vector<size_t>& which,
                                 std::vector<double>* sumsq, const UnitFn& before_write) {
  if (which.empty()) return;
  if (before_write)
    for (size_t u : which) before_write(u);  // one launch: all its units first
  if (sumsq) device_sum_squares(which, *sumsq);
  // Each unit as pieces of its parameter groups: one launch per group.
  std::vector<Device::AdamTensors> decayed, exempt;
  const auto add = [&](size_t u, const at::Tensor& out) {
    by_group(ac, u, 0, store_.shard_numel(u), [&](uint64_t off, uint64_t n, const kernels::AdamConfig& c) {
      const auto piece = [&](const at::Tensor& t) { return t.narrow(0, int64_t(off), int64_t(n)); };
      (c.weight_decay == ac.weight_decay ? decayed : exempt)
          .push_back({piece(store_.tensor(u, kMaster)), piece(store_.tensor(u, kExpAvg)),
                      piece(store_.tensor(u, kExpAvgSq)), piece(store_.tensor(u, kGrad)), piece(out)});
    });
  };
  const auto launch = [&] {
    kernels::AdamConfig none = ac;
    none.weight_decay = 0;
    if (!decayed.empty() || exempt.empty()) dev_.adam_step(ac, decayed, exec_);
    if (!exempt.empty()) dev_.adam_step(none, exempt, exec_);
    decayed.clear();
    exempt.clear();
  };
  const auto compute_on_device = [&](size_t u) { return store_.placement(u, kCompute) == Placement::kDevice; };
  for (size_t u : which)
    if (compute_on_device(u)) add(u, store_.tensor(u, kCompute));
  launch();
  // Compute copies on the host or in swap: through one device buffer of the largest such shard
  // (within the working set: no use is running), each stored (a blocking copy) before the next
  // launch writes the buffer again.
  int64_t largest = 0;
  for (size_t u : which)
    if (!compute_on_device(u)) largest = std::max(largest, int64_t(store_.shard_numel(u)));
  if (largest == 0) return;
  const at::Tensor out = dev_.empty({largest}, store_.dtype(kCompute), "compute copy out");
  for (size_t u : which) {
    if (compute_on_device(u)) continue;
    const at::Tensor values = out.narrow(0, 0, int64_t(store_.shard_numel(u)));
    add(u, values);
    launch();
    store_compute(u, values);
  }
}

void Optimizer::update_on_cpu(const kernels::AdamConfig& ac, const std::vector<size_t>& which,
                              const UnitFn& unit_done, std::vector<double>* sumsq, const UnitFn& before_unit,
                              const UnitFn& grad_consumed) {
  if (streams()) {
    stream(bit(kMaster) | bit(kExpAvg) | bit(kExpAvgSq) | bit(kGrad),
           bit(kMaster) | bit(kExpAvg) | bit(kExpAvgSq) | bit(kCompute), which,
           [&](const state::ChunkRing::Chunk& c, const state::ChunkRing::Pointers& p) {
             if (sumsq) (*sumsq)[c.unit] += kernels::sum_squares(p[kGrad], kernels::DType::kF32, c.numel, exec_);
             by_group(ac, c.unit, c.begin, c.numel, [&](uint64_t off, uint64_t n, const kernels::AdamConfig& g) {
               kernels::adam_step(g, static_cast<float*>(p[kMaster]) + off, static_cast<float*>(p[kExpAvg]) + off,
                                  static_cast<float*>(p[kExpAvgSq]) + off, static_cast<float*>(p[kGrad]) + off,
                                  kernels::DType::kF32, static_cast<char*>(p[kCompute]) + off * compute_bytes_,
                                  compute_, n, exec_);
             });
             if (grad_consumed && c.begin + c.numel == store_.shard_numel(c.unit)) grad_consumed(c.unit);
           },
           unit_done, before_unit);
    return;
  }
  for (size_t u : which) {
    if (before_unit) before_unit(u);
    if (sumsq) {
      const at::Tensor& g = store_.tensor(u, kGrad);
      (*sumsq)[u] += kernels::sum_squares(g.data_ptr<float>(), kernels::DType::kF32, size_t(g.numel()), exec_);
    }
    update_resident(ac, u);
    if (grad_consumed) grad_consumed(u);
    if (unit_done) unit_done(u);
  }
}

// One unit's host-resident master, moments and gradient; a compute copy placed on a GPU is
// written to a host buffer first.
void Optimizer::update_resident(const kernels::AdamConfig& ac, size_t u) {
  const uint64_t n = store_.shard_numel(u);
  const at::Tensor& compute = store_.tensor(u, kCompute);
  const at::Tensor out = compute.defined() && compute.is_cpu() ? compute : host_.buffer(n, store_.dtype(kCompute));
  float* master = store_.tensor(u, kMaster).data_ptr<float>();
  float* m = store_.tensor(u, kExpAvg).data_ptr<float>();
  float* v = store_.tensor(u, kExpAvgSq).data_ptr<float>();
  float* g = store_.tensor(u, kGrad).data_ptr<float>();
  char* o = static_cast<char*>(out.data_ptr());
  by_group(ac, u, 0, n, [&](uint64_t off, uint64_t count, const kernels::AdamConfig& c) {
    kernels::adam_step(c, master + off, m + off, v + off, g + off, kernels::DType::kF32, o + off * compute_bytes_,
                       compute_, count, exec_);
  });
  store_compute(u, out);
}

void Optimizer::store_compute(size_t u, const at::Tensor& values) {
  if (store_.placement(u, kCompute) != Placement::kNvme) {
    at::Tensor& compute = store_.tensor(u, kCompute);
    if (!values.is_same(compute)) compute.copy_(values);
    return;
  }
  at::Tensor host = values;
  if (!values.is_cpu()) {
    host = host_.buffer(uint64_t(values.numel()), values.scalar_type());
    host.copy_(values);
  }
  store_.write(u, kCompute, 0, host).get();
}

void Optimizer::refresh_compute_copies() {
  const StatePlacement& p = store_.plan();
  if (p.master != Placement::kNvme && p.params != Placement::kNvme) {
    for (size_t u = 0; u < store_.units(); ++u)
      if (!store_.frozen(u)) store_.tensor(u, kCompute).copy_(store_.tensor(u, kMaster));
    return;
  }
  const at::ScalarType cdt = store_.dtype(kCompute);
  for (size_t u : units_where(true)) store_compute(u, store_.tensor(u, kMaster).to(cdt));
  stream(bit(kMaster), bit(kCompute), units_where(false),
         [&](const state::ChunkRing::Chunk& c, const state::ChunkRing::Pointers& ptr) {
           const int64_t n = int64_t(c.numel);
           at::from_blob(ptr[kCompute], {n}, at::TensorOptions().dtype(cdt))
               .copy_(at::from_blob(ptr[kMaster], {n}, at::TensorOptions().dtype(at::kFloat)));
         });
}

}  // namespace strata::engine::runtime
