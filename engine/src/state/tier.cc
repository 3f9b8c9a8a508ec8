#include "state/tier.h"

#include <cstring>
#include <stdexcept>
#include <vector>

#include "state/host_memory.h"
#include "strata/offload/file.h"
#include "strata/offload/swap_space.h"

namespace strata::engine::state {

uint64_t TierDriver::numel(Region r) const { return regions_.at(r).numel; }
at::ScalarType TierDriver::dtype(Region r) const { return regions_.at(r).dtype; }
const std::string& TierDriver::name(Region r) const { return regions_.at(r).name; }

TierDriver::Region TierDriver::add(const std::string& name, uint64_t numel, at::ScalarType dtype) {
  regions_.push_back({name, numel, dtype});
  bytes_ += numel * c10::elementSize(dtype);
  return regions_.size() - 1;
}

void TierDriver::check_range(const char* op, Region r, uint64_t begin, uint64_t n) const {
  if (r >= regions_.size())
    throw std::out_of_range(std::string(op) + ": no region " + std::to_string(r) + " in the " +
                            to_string(tier()) + " tier");
  const Meta& m = regions_[r];
  if (begin > m.numel || n > m.numel - begin)
    throw std::out_of_range(std::string(op) + " " + m.name + ": elements " + std::to_string(begin) + "+" +
                            std::to_string(n) + " outside its " + std::to_string(m.numel));
}

void TierDriver::check(const char* op, Region r, uint64_t begin, const at::Tensor& host) const {
  check_range(op, r, begin, host.defined() ? uint64_t(host.numel()) : 0);
  const Meta& m = regions_[r];
  if (!host.defined() || !host.is_cpu() || !host.is_contiguous() || host.scalar_type() != m.dtype)
    throw std::invalid_argument(std::string(op) + " " + m.name + ": needs a contiguous host tensor of the region's dtype");
}

void TierDriver::copy_to_file(Region r, uint64_t, uint64_t, const offload::File&, uint64_t) {
  throw std::logic_error("copy_to_file " + name(r) + ": the " + to_string(tier()) +
                         " tier has no file-to-file copy; read it into memory");
}

namespace {

// Device and host: regions are tensors; transfers are copies done before returning.
class TensorTier : public TierDriver {
 public:
  at::Tensor locate(Region r) const override { return tensors_.at(r); }
  offload::IoFuture write(Region r, uint64_t begin, const at::Tensor& src) override {
    check("write", r, begin, src);
    tensors_[r].narrow(0, int64_t(begin), src.numel()).copy_(src);
    return offload::IoFuture::completed();
  }

 protected:
  Region keep(const std::string& name, at::Tensor t) {
    const Region r = add(name, uint64_t(t.numel()), t.scalar_type());
    tensors_.push_back(std::move(t));
    return r;
  }
  std::vector<at::Tensor> tensors_;
};

class DeviceTier final : public TensorTier {
 public:
  explicit DeviceTier(Device& d) : dev_(d) {}
  Placement tier() const override { return Placement::kDevice; }
  Region allocate(const std::string& name, uint64_t numel, at::ScalarType dtype) override {
    return keep(name, dev_.empty({int64_t(numel)}, dtype, name));
  }
  offload::IoFuture read(Region r, uint64_t begin, const at::Tensor& dst) override {
    check("read", r, begin, dst);
    dev_.read_to_host(dst, tensors_[r].narrow(0, int64_t(begin), dst.numel()));
    return offload::IoFuture::completed();
  }

 private:
  Device& dev_;
};

class HostTier final : public TensorTier {
 public:
  explicit HostTier(HostMemory& h) : host_(h) {}
  Placement tier() const override { return Placement::kHost; }
  Region allocate(const std::string& name, uint64_t numel, at::ScalarType dtype) override {
    return keep(name, host_.state(numel, dtype, name));
  }
  // One memcpy on the calling thread, not ATen's copy on the intra-op pool that the training
  // thread's CPU work shares.
  offload::IoFuture read(Region r, uint64_t begin, const at::Tensor& dst) override {
    check("read", r, begin, dst);
    const size_t e = c10::elementSize(dtype(r));
    std::memcpy(dst.data_ptr(), static_cast<const char*>(tensors_[r].const_data_ptr()) + begin * e, size_t(dst.nbytes()));
    return offload::IoFuture::completed();
  }

 private:
  HostMemory& host_;
};

class NvmeTier final : public TierDriver {
 public:
  explicit NvmeTier(offload::SwapSpace& s) : swap_(s) {}
  Placement tier() const override { return Placement::kNvme; }
  Region allocate(const std::string& name, uint64_t numel, at::ScalarType dtype) override {
    swap_.allocate(name, numel * c10::elementSize(dtype));
    return add(name, numel, dtype);
  }
  at::Tensor locate(Region) const override { return {}; }
  offload::IoFuture read(Region r, uint64_t begin, const at::Tensor& dst) override {
    check("read", r, begin, dst);
    return swap_.read(name(r), begin * c10::elementSize(dtype(r)),
                      {static_cast<std::byte*>(dst.data_ptr()), size_t(dst.nbytes())});
  }
  offload::IoFuture write(Region r, uint64_t begin, const at::Tensor& src) override {
    check("write", r, begin, src);
    return swap_.write(name(r), begin * c10::elementSize(dtype(r)),
                       {static_cast<const std::byte*>(src.const_data_ptr()), size_t(src.nbytes())});
  }
  bool copies_to_file() const override { return true; }
  void copy_to_file(Region r, uint64_t begin, uint64_t numel, const offload::File& dst, uint64_t offset) override {
    check_range("copy_to_file", r, begin, numel);
    const uint64_t es = c10::elementSize(dtype(r));
    for (const auto& piece : swap_.locate(name(r), begin * es, numel * es)) {
      offload::copy_range(*piece.file, piece.file_offset, dst, offset, piece.length);
      offset += piece.length;
    }
  }

 private:
  offload::SwapSpace& swap_;
};

}  // namespace

std::unique_ptr<TierDriver> device_tier(Device& device) { return std::make_unique<DeviceTier>(device); }
std::unique_ptr<TierDriver> host_tier(HostMemory& host) { return std::make_unique<HostTier>(host); }
std::unique_ptr<TierDriver> nvme_tier(offload::SwapSpace& swap) { return std::make_unique<NvmeTier>(swap); }

}  // namespace strata::engine::state
