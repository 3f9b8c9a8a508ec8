#include "runtime/activation_store.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cerrno>
#include <span>
#include <stdexcept>
#include <utility>

namespace strata::engine::runtime {
namespace {

std::span<std::byte> bytes_of(const at::Tensor& t) {
  return {static_cast<std::byte*>(t.data_ptr()), size_t(t.nbytes())};
}

}  // namespace

ActivationStore::ActivationStore(Placement where, std::vector<std::vector<int64_t>> shapes, at::ScalarType dtype,
                                 std::vector<std::string> unit_names, const std::vector<size_t>& checkpointed, Device& dev,
                                 const state::HostMemory& host, Profiler& prof, offload::SwapSpace* swap)
    : where_(where), shapes_(std::move(shapes)), dtype_(dtype), unit_names_(std::move(unit_names)), dev_(dev),
      host_(host), prof_(prof), swap_(swap) {
  if (where_ == Placement::kAuto) throw std::logic_error("ActivationStore: placement not resolved");
  if (where_ == Placement::kNvme) {
    if (!swap_) throw std::logic_error("ActivationStore: nvme placement without a swap space");
    for (size_t s : checkpointed) swap_->allocate(swap_name(s), numel(s) * c10::elementSize(dtype_));
  }
  if (shapes_.size() != unit_names_.size())
    throw std::logic_error("ActivationStore: " + std::to_string(shapes_.size()) + " shapes for " +
                           std::to_string(unit_names_.size()) + " stages");
  slots_.resize(unit_names_.size());
}

uint64_t ActivationStore::numel(size_t s) const {
  uint64_t n = 1;
  for (int64_t d : shapes_.at(s)) n *= uint64_t(d);
  return n;
}

ActivationStore::~ActivationStore() {
  // Writes of a step that failed half way must finish before their buffers go (only those whose
  // host function ran: a failed CUDA stream may never run the others).
  for (const Write& w : writes_)
    if (w.submitted->load()) w.written.wait();
  for (Slot& a : slots_)
    if (a.read.valid()) a.read.wait();
}

void ActivationStore::prune() {
  std::erase_if(writes_, [](const Write& w) { return w.written.ready(); });
}

void ActivationStore::begin_micro_batch() {
  for (Slot& a : slots_)
    if (a.read.valid()) a.read.wait();
  slots_.clear();
  slots_.resize(unit_names_.size());
  host_bytes_ = 0;
}

void ActivationStore::put(size_t s, const at::Tensor& x, Device::Reservation& res) {
  Slot& a = slots_.at(s);
  if (where_ == Placement::kDevice) {
    a.device = x;
    a.res = std::move(res);
    return;
  }
  const bool nvme = where_ == Placement::kNvme;
  if (nvme) {
    prune();
    if (writes_.size() >= kStaging) {
      auto t = prof_.time(prof_.step.wait_activations, "wait activation write");
      writes_.front().written.wait();
      prune();
    }
  }
  at::Tensor host = nvme ? host_.buffer(uint64_t(x.numel()), dtype_).view(x.sizes())
                         : at::empty(x.sizes(), host_.options(dtype_));
  dev_.wait(dev_.d2h_stream(), dev_.record(dev_.compute_stream()));  // x is computed there
  dev_.copy_async(host, x, dev_.d2h_stream());
  prof_.step.d2h_bytes += uint64_t(host.nbytes());
  if (!nvme) {
    a.host = host;
    host_bytes_ += uint64_t(host.nbytes());
    host_peak_ = std::max(host_peak_, host_bytes_);
    return;
  }
  // Written to swap once the copy has run; the staging buffer goes once the write is done.
  offload::IoPromise written;
  a.written = written.future();
  prof_.nvme_write += uint64_t(host.nbytes());
  auto submitted = std::make_shared<std::atomic<bool>>(false);
  writes_.push_back({a.written, host, submitted});  // before the write can start
  uint64_t staged = 0;
  for (const Write& w : writes_) staged += uint64_t(w.buffer.nbytes());
  host_peak_ = std::max(host_peak_, staged);
  dev_.launch_host(dev_.d2h_stream(), [swap = swap_, name = swap_name(s), bytes = bytes_of(host), written, submitted] {
    submitted->store(true);
    try {
      swap->write(name, 0, bytes).then([written](const offload::IoStatus& st) { written.complete(st); });
    } catch (const std::exception& e) {
      written.complete(offload::IoStatus(EIO, std::string("activation checkpoint write: ") + e.what()));
      throw;
    }
  });
}

void ActivationStore::read_ahead(size_t s) {
  Slot& a = slots_.at(s);
  if (where_ != Placement::kNvme || a.read.valid() || a.ready) return;  // reading, or fetched
  {
    // Every write was submitted during the forward, long before; waiting for the ones still
    // pending (the forward's last few) frees their staging buffers before a read takes one, so
    // the backward's buffers never add to the forward's.
    auto t = prof_.time(prof_.step.wait_activations, "wait activation write", &unit_names_.at(s));
    a.written.get();
    for (Write& w : writes_) w.written.get();
  }
  prune();
  a.staged = host_.buffer(numel(s), dtype_);
  prof_.nvme_read += uint64_t(a.staged.nbytes());
  // Host memory now: buffers still being written or read, and the last one read, which may
  // still be in the copy queue.
  uint64_t held = 0;
  for (const Write& w : writes_) held += uint64_t(w.buffer.nbytes());
  for (const Slot& b : slots_) held += b.staged.defined() ? uint64_t(b.staged.nbytes()) : 0;
  host_peak_ = std::max(host_peak_, held + uint64_t(a.staged.nbytes()));
  a.read = swap_->read(swap_name(s), 0, bytes_of(a.staged));
}

void ActivationStore::fetch(size_t s) {
  Slot& a = slots_.at(s);
  if (a.device.defined()) return;
  a.device = dev_.empty(shapes_.at(s), dtype_, "activation checkpoint of unit " + unit_names_.at(s));
  at::Tensor src = a.host;
  dev_.wait(dev_.h2d_stream(), dev_.record(dev_.compute_stream()));  // the buffer may be reused memory
  if (where_ == Placement::kNvme) {
    read_ahead(s);
    src = a.staged.view(shapes_.at(s));
    offload::IoFuture read = a.read;
    dev_.launch_host(dev_.h2d_stream(), [read] { read.get(); });
    a.staged = at::Tensor();
    a.read = {};  // src stays alive in the copy queue until after the read
  } else {
    host_bytes_ -= uint64_t(src.nbytes());
  }
  dev_.copy_async(a.device, src, dev_.h2d_stream());  // keeps src alive until done
  prof_.step.h2d_bytes += uint64_t(src.nbytes());
  a.host = at::Tensor();
  a.ready = dev_.record(dev_.h2d_stream());
}

at::Tensor ActivationStore::take(size_t s, Device::Reservation& res) {
  fetch(s);
  Slot& a = slots_.at(s);
  if (a.ready) {
    auto t = prof_.time(prof_.step.wait_activations, "wait activations", &unit_names_.at(s));
    dev_.wait(dev_.compute_stream(), a.ready);  // blocks on the host device only
  }
  at::Tensor x = std::move(a.device);
  res = std::move(a.res);
  a = Slot{};
  return x;
}

}  // namespace strata::engine::runtime
