// The compute device as the engine sees it: a memory budget it accounts for, and streams on
// which copies and host functions run asynchronously, ordered by events.
//
// Two implementations: the host device (compute on the CPU; each copy stream is a worker thread,
// so ordering and overlap bugs show up on machines without a GPU) and CUDA (cuda_device.cc). Stream model,
// the same on both: work enqueued on one stream runs in order; different streams run
// concurrently; `wait(stream, event)` orders a stream after an event recorded on another. The
// compute stream is the calling thread's: torch ops issued by the engine run on it (on the host
// device they run synchronously, so waiting on the compute stream blocks the caller).
//
// Memory: every tensor the engine places on the device comes from `empty()`, which counts its
// bytes against the budget until the tensor's storage is freed, and throws BudgetExceeded
// instead of going over. The budget covers what the engine holds (gathered parameters, gradient
// buffers, live boundary activations, device-placed optimizer state), not the autograd
// temporaries inside one running block.
//
// Lifetime: the Device must outlive every tensor and reservation it handed out.
// Thread safety: all members may be called from any thread. Host memory handed to copy_async
// must stay valid until the copy has run (record an event and wait on it).
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "strata/engine/bytes.h"
#include "strata/kernels/cpu_optim.h"

namespace strata::kernels {
enum class Quant4 : uint8_t;  // kernels/quant4.h
}  // namespace strata::kernels

namespace strata::engine {

class Stream {
 public:
  virtual ~Stream() = default;
  virtual const char* name() const = 0;
};

// A point in a stream's work; done() once everything enqueued before it has run.
class Event {
 public:
  virtual ~Event() = default;
  virtual bool done() const = 0;
};

class Device {
 public:
  // The host device. `budget_bytes` bounds what the engine allocates through empty().
  // Tests: after `d2h_fails_after` pieces of work (copies, host functions, event records), its
  // d2h stream fails as a CUDA stream does after an error: it runs nothing more (its host
  // functions included), synchronize() throws and stream_error() says why.
  static std::unique_ptr<Device> create_host(uint64_t budget_bytes, uint64_t d2h_fails_after = UINT64_MAX);
  // CUDA device `index`, or the only visible one whatever `index` (a launcher that gives each
  // rank its own GPU). Builds with CUDA only; throws std::runtime_error if none is visible or
  // `index` names none of several.
  static std::unique_ptr<Device> create_cuda(int index, uint64_t budget_bytes);
  // From the configuration's device.type: "cpu" or "cuda" (LOCAL_RANK picks the GPU).
  static std::unique_ptr<Device> create(const std::string& type, int local_rank, uint64_t budget_bytes);

  virtual ~Device() = default;
  virtual c10::Device torch_device() const = 0;
  virtual std::string description() const = 0;

  // An uninitialized contiguous tensor on the device, counted against the budget until its
  // storage is freed. Throws BudgetExceeded naming `what`, the request and the current use.
  at::Tensor empty(at::IntArrayRef shape, at::ScalarType dtype, const std::string& what);
  // Counts `bytes` of device memory that something else allocates (a torch op's output whose
  // size the engine knows) until the reservation is destroyed. Throws BudgetExceeded.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& o) noexcept = default;
    Reservation& operator=(Reservation&& o) noexcept {
      if (this != &o) {
        reset();
        ledger_ = std::move(o.ledger_);
        bytes_ = o.bytes_;
      }
      return *this;
    }
    ~Reservation() { reset(); }
    void reset();

   private:
    friend class Device;
    struct Ledger;
    Reservation(std::shared_ptr<Ledger> l, uint64_t b) : ledger_(std::move(l)), bytes_(b) {}
    std::shared_ptr<Ledger> ledger_;
    uint64_t bytes_ = 0;
  };
  Reservation reserve(uint64_t bytes, const std::string& what);
  bool fits(uint64_t bytes) const { return used() + bytes <= budget_; }
  uint64_t budget() const { return budget_; }
  uint64_t used() const;
  uint64_t peak() const;
  void reset_peak();
  // Memory the device can give the engine now: on CUDA, what cudaMemGetInfo says is free less
  // device_memory_reserve(total) for what the budget does not count (library workspaces created
  // later, the caching allocator's rounding and fragmentation, autograd temporaries beyond the
  // estimates); UINT64_MAX on the host device, whose only limit is the budget. Automatic
  // placement, prefetch and recompute decisions use min(budget, this).
  virtual uint64_t physical_free() const { return UINT64_MAX; }

  // Host memory as this device copies from and to it (state/host_memory.h is the one caller).
  // Whether it is pinned: a GPU's is page-locked, so that copies run asynchronously at full speed.
  virtual bool pins_host() const { return false; }
  // `numel` elements of host memory for state, exactly that size: pinned on a GPU (never a
  // caching allocator's power-of-two rounding), page-aligned and unpinned on the host device.
  // Throws std::runtime_error naming `what` when it cannot be had.
  virtual at::Tensor host_state(uint64_t numel, at::ScalarType t, const std::string& what) const;
  // Page-aligned (4 KiB: direct I/O) unpinned host memory, at least a page. Throws std::bad_alloc.
  static at::Tensor unpinned_host(uint64_t numel, at::ScalarType t);
  // `t` on this device: from the host asynchronously through pinned memory on a GPU (the caller
  // orders its use on the compute stream, as torch's non-blocking copies do), as it is on the host.
  virtual at::Tensor upload(const at::Tensor& t) const { return t.to(torch_device()); }

  virtual Stream& compute_stream() = 0;
  // Copies run on two streams, one each way: uploads (units being gathered, checkpoints coming
  // back) never queue behind downloads (gradients and checkpoints going to the host, and the
  // host functions that accumulate them or write them to swap), and a GPU's copy engines use
  // both directions of the bus at once.
  virtual Stream& h2d_stream() = 0;
  virtual Stream& d2h_stream() = 0;
  // dst.copy_(src) on `stream`; same numel and dtype, contiguous, either side host or device.
  // The stream keeps both tensors alive until the copy has run.
  virtual void copy_async(const at::Tensor& dst, const at::Tensor& src, Stream& stream) = 0;
  // Runs `fn` on the host once the stream reaches this point (it must not wait on work of the
  // same stream, and must not call CUDA: no device or pinned allocation, no copy to or from
  // the device, which on a GPU fails or deadlocks and on the host device passes unnoticed).
  // An exception from fn is kept and rethrown, once, by the next synchronize() of that stream;
  // later work on the stream still runs.
  virtual void launch_host(Stream& stream, std::function<void()> fn) = 0;
  virtual std::shared_ptr<Event> record(Stream& stream) = 0;
  // Work enqueued on `stream` after this call starts after `event`.
  virtual void wait(Stream& stream, const std::shared_ptr<Event>& event) = 0;
  // Blocks until everything enqueued on `stream` has run; rethrows the first error of its work.
  virtual void synchronize(Stream& stream) = 0;
  // Non-blocking: why `stream` can no longer run its work (a CUDA error, which also stops its
  // host functions), or "" while it can. The host device's streams always go on, unless a test
  // made its d2h stream fail (create_host).
  virtual std::string stream_error(Stream& stream) { (void)stream; return ""; }

  // Optimizer math on device-resident state, on the calling thread's current stream (the
  // compute stream on the training thread), with the CPU kernels' arithmetic and reduction order
  // (kernels/cpu_optim.h), so that a unit's numbers do not depend on its tier. The host device
  // runs those CPU kernels with `exec`; CUDA runs the fused kernels (kernels/cuda_optim.h).
  // The kernels' dtype of a compute-copy tensor (fp32, bf16 or fp16).
  static kernels::DType kernel_dtype(at::ScalarType t);
  struct AdamTensors {
    at::Tensor master, exp_avg, exp_avg_sq, grad;  // fp32 [n], contiguous, on the device
    at::Tensor out;                                // the new compute copy [n], on the device
  };
  virtual void adam_step(const kernels::AdamConfig& config, const std::vector<AdamTensors>& units,
                         const kernels::CpuExec& exec);
  // A 4-bit tensor's parts (views into a gathered unit's record, models/quantized_base.h).
  struct Quant4View {
    at::Tensor packed;         // uint8 [(n + 1) / 2]: the codes
    at::Tensor absmax;         // fp32 [blocks]; with double quantization uint8 qabsmax [blocks]
    at::Tensor nested_absmax;  // double quantization: fp32 [(blocks + 255) / 256]; else undefined
    at::Tensor offset;         // double quantization: fp32 [1]; else undefined
  };
  // Its dequantization (kernels/quant4.h's rule, bitwise) into `out` (its dtype, contiguous, n
  // elements), all on the device, on the compute stream. The host device runs the CPU kernels
  // (dequantize_4bit_on_host); CUDA kernels::cuda::dequantize_4bit.
  virtual void dequantize_4bit(const Quant4View& v, kernels::Quant4 type, int64_t blocksize, const at::Tensor& out);
  // The CPU kernels on host tensors (the host device's dequantize_4bit, and any host copy).
  static void dequantize_4bit_on_host(const Quant4View& v, kernels::Quant4 type, int64_t blocksize,
                                      const at::Tensor& out);
  // The sum of squares of each fp32 device tensor, read back to the host (blocks until done).
  virtual std::vector<double> sum_squares(const std::vector<at::Tensor>& xs, const kernels::CpuExec& exec);
  // dst (host, contiguous) := src (device, contiguous, same dtype and numel); blocking, on a
  // stream of the calling thread's own, so that a reader beside training (a checkpoint's
  // writer) never queues behind the compute stream. The host device copies with memcpy on the
  // calling thread (not ATen's intra-op pool, which the training thread's CPU work shares).
  virtual void read_to_host(const at::Tensor& dst, const at::Tensor& src);
  // Until the returned guard goes, device work issued by the calling thread (torch ops, copies
  // through at::Tensor::copy_) runs on a stream of that thread's own, neither waiting for the
  // compute stream's queue nor holding it up. Null on the host device (work runs in place).
  virtual std::shared_ptr<void> own_stream_scope() { return nullptr; }

  // Profiling: an event that also notes when its stream reached it (a CUDA event with timing;
  // on the host device, the clock when it ran), and the seconds from `from` to `to`, two timed
  // events of this device (blocks until both are done; negative if `to` came first).
  virtual std::shared_ptr<Event> record_timed(Stream& stream) = 0;
  virtual double seconds_between(const std::shared_ptr<Event>& from, const std::shared_ptr<Event>& to) = 0;

 protected:
  explicit Device(uint64_t budget_bytes);
  // Frees device memory that is held only by finished (or, waiting, the oldest unfinished)
  // asynchronous work; true if anything was freed. Called before a request would exceed the
  // budget.
  virtual bool reclaim() { return false; }
  virtual void* raw_allocate(size_t bytes) = 0;
  // What frees raw_allocate's memory: a plain function, not a member, because a tensor from
  // empty() may outlive its device (a collective's worker thread can drop the last reference to
  // a failed all-gather's output after the engine and the device are gone).
  using RawFree = void (*)(void*);
  virtual RawFree raw_free() const = 0;

 private:
  using Ledger = Reservation::Ledger;
  void acquire(uint64_t bytes, const std::string& what);
  uint64_t budget_;
  // The bytes in use and the peak, shared with every tensor and reservation still counted, so
  // that those may go after the device.
  std::shared_ptr<Ledger> ledger_;
};

// The part of a GPU's memory (`total` bytes) that automatic decisions leave alone:
// max(4 GiB, 8% of total), at most total. 6.4 GB on an 80 GB H100: the head's backward alone at
// 16K tokens x 50K vocabulary needs ~3.4 GB more than its estimate.
uint64_t device_memory_reserve(uint64_t total);

}  // namespace strata::engine
