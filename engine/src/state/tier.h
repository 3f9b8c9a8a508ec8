// The tiers that state lives in, behind one interface: the device, host RAM and swap files.
//
// A driver stores regions: a fixed number of elements of one dtype, created by allocate() and
// named for messages and swap files ("<unit>.<kind>"). Every driver passes the one conformance
// suite (tests/engine/tier_driver_test.cc); adding a tier (object storage, a second NVMe class)
// means writing a driver that passes it and giving it a Placement.
//
//   locate(r)        the region's memory where it is addressable (device and host tiers); an
//                    undefined tensor where it is not (swap: reach it through read/write).
//   read(r, b, dst)  elements [b, b + dst.numel()) into dst: host memory, contiguous, the
//                    region's dtype (page aligned, for swap's direct I/O to go straight).
//   write(r, b, src) the same the other way.
//   copy_to_file(r, b, n, file, off)
//                    elements [b, b + n) straight into `file` at byte `off`, never through this
//                    process's memory (swap: inside the kernel, offload::copy_range), for a tier
//                    whose copies_to_file() says so; the others throw std::logic_error (read()
//                    into memory and write that instead). Synchronous.
//
// Completion: swap reads and writes are asynchronous (the future completes on an I/O thread and
// src/dst must stay alive until then); the device and host tiers copy before they return and
// hand back a completed future (device: a blocking copy on a stream of the caller's own for
// reads, the calling thread's current stream for writes).
// Errors: out-of-range or mismatched transfers throw std::out_of_range / std::invalid_argument
// before anything moves; allocation failures throw as the tier's allocator does
// (BudgetExceeded, std::bad_alloc, offload::IoError); I/O failures complete the future with
// an error (get() throws offload::IoError).
// Thread safety: allocate() from one thread, before transfers start; read/write/locate from any
// thread, for different regions or disjoint ranges.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>

#include "strata/engine/config.h"
#include "strata/engine/device.h"
#include "strata/offload/io_future.h"

namespace strata::offload {
class File;
class SwapSpace;
}

namespace strata::engine::state {

class HostMemory;

class TierDriver {
 public:
  using Region = size_t;  // a driver's handle, from 0 in allocation order
  virtual ~TierDriver() = default;

  virtual Placement tier() const = 0;
  // Contents undefined until written.
  virtual Region allocate(const std::string& name, uint64_t numel, at::ScalarType dtype) = 0;
  virtual at::Tensor locate(Region r) const = 0;
  virtual offload::IoFuture read(Region r, uint64_t begin, const at::Tensor& dst) = 0;
  virtual offload::IoFuture write(Region r, uint64_t begin, const at::Tensor& src) = 0;
  virtual bool copies_to_file() const { return false; }
  virtual void copy_to_file(Region r, uint64_t begin, uint64_t numel, const offload::File& dst, uint64_t offset);

  uint64_t numel(Region r) const;
  at::ScalarType dtype(Region r) const;
  const std::string& name(Region r) const;
  size_t regions() const { return regions_.size(); }
  uint64_t bytes() const { return bytes_; }  // allocated in this tier by this driver

 protected:
  // Records a region (allocate's bookkeeping) and checks a transfer against it.
  Region add(const std::string& name, uint64_t numel, at::ScalarType dtype);
  void check(const char* op, Region r, uint64_t begin, const at::Tensor& host) const;
  void check_range(const char* op, Region r, uint64_t begin, uint64_t numel) const;

 private:
  struct Meta {
    std::string name;
    uint64_t numel;
    at::ScalarType dtype;
  };
  std::vector<Meta> regions_;
  uint64_t bytes_ = 0;
};

// `device` must outlive the driver and its regions' tensors.
std::unique_ptr<TierDriver> device_tier(Device& device);
// Regions from HostMemory::state (counted in its state_bytes()).
std::unique_ptr<TierDriver> host_tier(HostMemory& host);
// Regions are partitions of `swap` named after them.
std::unique_ptr<TierDriver> nvme_tier(offload::SwapSpace& swap);

}  // namespace strata::engine::state
