// The CUDA device: cudaStream/cudaEvent streams, budgeted allocations from libtorch's caching
// allocator, copies with cudaMemcpyAsync, host functions with cudaLaunchHostFunc.
//
// Status: run on an H100 (tests/engine/engine_cuda_test.cc, strata train on GPT 1.4B). The
// optimizer methods (adam_step, sum_squares, read_to_host, own_stream_scope) moved here from the
// engine unchanged in substance, 2026-11-25, and have been compiled but not yet run on a GPU
// since.
//
// The compute stream is libtorch's current stream on this device at construction, so the torch
// ops the engine issues run on it. The two copy streams (h2d, d2h) are non-blocking streams of
// our own. Host functions (cudaLaunchHostFunc) may run one at a time across streams, so an h2d
// host function waiting for a swap read can still wait behind a d2h one.
// Tensors handed to copy_async are kept alive until an event recorded after the copy has
// completed (retired on later calls), never released from a host function: freeing device
// memory is a CUDA call, which host functions may not make.
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>

#include "strata/engine/device.h"
#include "strata/kernels/cuda_optim.h"
#include "strata/kernels/cuda_quant4.h"

namespace strata::engine {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

class CudaStream final : public Stream {
 public:
  CudaStream(cudaStream_t s, const char* name, bool owned) : s_(s), name_(name), owned_(owned) {}
  ~CudaStream() override {
    if (owned_) cudaStreamDestroy(s_);
  }
  const char* name() const override { return name_; }
  cudaStream_t handle() const { return s_; }

  // Errors of host functions, rethrown by synchronize().
  std::mutex mu;
  std::exception_ptr error;

 private:
  cudaStream_t s_;
  const char* name_;
  bool owned_;
};

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(bool timed = false) {
    check(cudaEventCreateWithFlags(&e_, timed ? cudaEventDefault : cudaEventDisableTiming), "event create");
  }
  ~CudaEvent() override { cudaEventDestroy(e_); }
  bool done() const override { return cudaEventQuery(e_) == cudaSuccess; }
  cudaEvent_t handle() const { return e_; }

 private:
  cudaEvent_t e_;
};

struct HostCall {
  std::function<void()> fn;
  CudaStream* stream;
};

void CUDART_CB run_host_call(void* p) {
  std::unique_ptr<HostCall> call(static_cast<HostCall*>(p));
  try {
    call->fn();
  } catch (...) {
    std::lock_guard<std::mutex> lock(call->stream->mu);
    if (!call->stream->error) call->stream->error = std::current_exception();
  }
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int index, uint64_t budget)
      : Device(budget),
        index_(index),
        compute_(c10::cuda::getCurrentCUDAStream(c10::DeviceIndex(index)).stream(), "compute", false),
        h2d_(make_stream(index), "h2d", true),
        d2h_(make_stream(index), "d2h", true) {
    // The caching allocator is set up lazily by the first CUDA tensor libtorch creates; ours may
    // come first (raw_alloc), so make libtorch initialize it now.
    (void)at::empty({1}, at::TensorOptions().dtype(at::kByte).device(torch_device()));
  }

  ~CudaDevice() override {
    cudaStreamSynchronize(h2d_.handle());
    cudaStreamSynchronize(d2h_.handle());
    cudaStreamSynchronize(compute_.handle());
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.clear();
  }

  c10::Device torch_device() const override { return c10::Device(c10::kCUDA, c10::DeviceIndex(index_)); }
  std::string description() const override {
    cudaDeviceProp p{};
    cudaGetDeviceProperties(&p, index_);
    return std::string("CUDA device ") + std::to_string(index_) + " (" + p.name + ")";
  }
  bool pins_host() const override { return true; }
  at::Tensor host_state(uint64_t numel, at::ScalarType t, const std::string& what) const override {
    const uint64_t bytes = numel * c10::elementSize(t);
    void* p = nullptr;
    if (cudaHostAlloc(&p, std::max<uint64_t>(1, bytes), cudaHostAllocDefault) != cudaSuccess)
      throw std::runtime_error("cannot pin " + format_bytes(bytes) + " of host memory for " + what + ": " +
                               cudaGetErrorString(cudaGetLastError()));
    return at::from_blob(p, {int64_t(numel)}, [](void* q) { cudaFreeHost(q); },
                         at::TensorOptions().dtype(t).pinned_memory(true));
  }
  at::Tensor upload(const at::Tensor& t) const override {
    return t.is_cpu() ? t.pin_memory().to(torch_device(), /*non_blocking=*/true) : t.to(torch_device());
  }
  Stream& compute_stream() override { return compute_; }
  Stream& h2d_stream() override { return h2d_; }
  Stream& d2h_stream() override { return d2h_; }
  std::string stream_error(Stream& stream) override {
    const cudaError_t e = cudaStreamQuery(cuda(stream).handle());
    if (e == cudaSuccess || e == cudaErrorNotReady) return "";
    return std::string(stream.name()) + " stream: " + cudaGetErrorString(e);
  }

  // The fused multi-tensor kernel: one launch for the units whose output is a device tensor of
  // one dtype (kernels::cuda::adam_step groups up to 64 tensors a launch).
  void adam_step(const kernels::AdamConfig& config, const std::vector<AdamTensors>& units,
                 const kernels::CpuExec&) override {
    if (units.empty()) return;
    const at::ScalarType out_type = units.front().out.scalar_type();
    std::vector<kernels::cuda::AdamTensor> ts;
    for (const AdamTensors& t : units) {
      TORCH_CHECK(t.out.scalar_type() == out_type && t.master.is_cuda() && t.out.is_cuda(),
                  "adam_step: outputs of one dtype, everything on the device");
      ts.push_back({t.master.data_ptr<float>(), t.exp_avg.data_ptr<float>(), t.exp_avg_sq.data_ptr<float>(),
                    t.grad.data_ptr<float>(), t.out.data_ptr(), size_t(t.master.numel())});
    }
    const kernels::DType out = kernel_dtype(out_type);
    kernels::cuda::adam_step(config, ts.data(), ts.size(), kernels::DType::kF32, out,
                             c10::cuda::getCurrentCUDAStream(c10::DeviceIndex(index_)).stream());
  }
  void dequantize_4bit(const Quant4View& v, kernels::Quant4 type, int64_t blocksize, const at::Tensor& out) override {
    TORCH_CHECK(v.packed.is_cuda() && v.absmax.is_cuda() && out.is_cuda() && v.packed.is_contiguous() &&
                    v.absmax.is_contiguous() && out.is_contiguous(),
                "dequantize_4bit: contiguous device tensors");
    // The compute stream, where Device::empty allocates: the temporary absmax is freed in its order.
    const cudaStream_t stream = compute_.handle();
    at::Tensor absmax = v.absmax;
    if (v.nested_absmax.defined()) {  // double quantization: the fp32 absmax first
      absmax = empty({v.absmax.numel()}, at::kFloat, "4-bit absmax");
      kernels::cuda::dequantize_quant4_absmax(v.absmax.const_data_ptr<uint8_t>(), v.nested_absmax.const_data_ptr<float>(),
                                              v.offset.const_data_ptr<float>(), v.absmax.numel(),
                                              absmax.data_ptr<float>(), stream);
    }
    kernels::cuda::dequantize_4bit(v.packed.const_data_ptr<uint8_t>(), absmax.const_data_ptr<float>(), out.numel(),
                                   type, blocksize, out.data_ptr(), kernel_dtype(out.scalar_type()), stream);
  }
  std::vector<double> sum_squares(const std::vector<at::Tensor>& xs, const kernels::CpuExec&) override {
    if (xs.empty()) return {};
    at::Tensor sums = empty({int64_t(xs.size())}, at::kDouble, "gradient norm");
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(c10::DeviceIndex(index_)).stream();
    for (size_t i = 0; i < xs.size(); ++i)
      kernels::cuda::sum_squares(xs[i].data_ptr<float>(), kernels::DType::kF32, size_t(xs[i].numel()),
                                 sums.data_ptr<double>() + i, stream);
    const at::Tensor host = sums.to(at::kCPU);
    return std::vector<double>(host.data_ptr<double>(), host.data_ptr<double>() + xs.size());
  }
  void read_to_host(const at::Tensor& dst, const at::Tensor& src) override {
    // A pool stream per calling thread, not its current stream, which may be the legacy default
    // stream and so wait for the training thread's queued compute.
    thread_local std::optional<c10::cuda::CUDAStream> stream;
    if (!stream || stream->device_index() != src.device().index())
      stream = c10::cuda::getStreamFromPool(false, src.device().index());
    c10::cuda::CUDAStreamGuard guard(*stream);
    dst.copy_(src);  // blocking: dst may be pageable
  }
  std::shared_ptr<void> own_stream_scope() override {
    return std::make_shared<c10::cuda::CUDAStreamGuard>(c10::cuda::getStreamFromPool(false, c10::DeviceIndex(index_)));
  }

  void copy_async(const at::Tensor& dst, const at::Tensor& src, Stream& stream) override {
    TORCH_CHECK(dst.numel() == src.numel() && dst.scalar_type() == src.scalar_type() &&
                    dst.is_contiguous() && src.is_contiguous(),
                "copy_async: mismatched or non-contiguous tensors");
    auto& s = cuda(stream);
    check(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), size_t(src.nbytes()), cudaMemcpyDefault,
                          s.handle()),
          "copy");
    auto ev = std::make_shared<CudaEvent>();
    check(cudaEventRecord(ev->handle(), s.handle()), "event record");
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.push_back({ev, dst, src});
    retire_locked();
  }
  void launch_host(Stream& stream, std::function<void()> fn) override {
    auto& s = cuda(stream);
    auto* call = new HostCall{std::move(fn), &s};
    const cudaError_t e = cudaLaunchHostFunc(s.handle(), run_host_call, call);
    if (e != cudaSuccess) {
      delete call;
      check(e, "launch host function");
    }
  }
  // Memory held only for copies in flight: free what has finished; if nothing has, wait for the
  // oldest copy. The engine's bookkeeping releases a buffer when it drops it, but the device
  // keeps the storage until its copy completes, so a budget that fits on paper may need this.
  bool reclaim() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (in_flight_.empty()) return false;
    const size_t before = in_flight_.size();
    retire_locked();
    if (in_flight_.size() == before) {
      check(cudaEventSynchronize(in_flight_.front().event->handle()), "event synchronize");
      in_flight_.pop_front();
    }
    return true;
  }
  std::shared_ptr<Event> record(Stream& stream) override {
    auto ev = std::make_shared<CudaEvent>();
    check(cudaEventRecord(ev->handle(), cuda(stream).handle()), "event record");
    return ev;
  }
  uint64_t physical_free() const override {
    size_t free = 0, total = 0;
    check(cudaMemGetInfo(&free, &total), "memory info");
    const uint64_t reserve = device_memory_reserve(total);
    return free > reserve ? free - reserve : 0;
  }
  std::shared_ptr<Event> record_timed(Stream& stream) override {
    auto ev = std::make_shared<CudaEvent>(true);
    check(cudaEventRecord(ev->handle(), cuda(stream).handle()), "event record");
    return ev;
  }
  double seconds_between(const std::shared_ptr<Event>& from, const std::shared_ptr<Event>& to) override {
    const cudaEvent_t a = static_cast<CudaEvent&>(*from).handle(), b = static_cast<CudaEvent&>(*to).handle();
    check(cudaEventSynchronize(a), "event synchronize");
    check(cudaEventSynchronize(b), "event synchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b), "event elapsed time");
    return double(ms) / 1e3;
  }
  void wait(Stream& stream, const std::shared_ptr<Event>& event) override {
    check(cudaStreamWaitEvent(cuda(stream).handle(), static_cast<CudaEvent&>(*event).handle(), 0),
          "stream wait");
  }
  void synchronize(Stream& stream) override {
    auto& s = cuda(stream);
    check(cudaStreamSynchronize(s.handle()), "stream synchronize");
    {
      std::lock_guard<std::mutex> lock(mu_);
      retire_locked();
    }
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.error) {
      auto e = s.error;
      s.error = nullptr;
      std::rethrow_exception(e);
    }
  }

 protected:
  void* raw_allocate(size_t bytes) override {
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, compute_.handle());
  }
  RawFree raw_free() const override { return &c10::cuda::CUDACachingAllocator::raw_delete; }

 private:
  static cudaStream_t make_stream(int index) {
    check(cudaSetDevice(index), "set device");
    cudaStream_t s;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream create");
    return s;
  }
  CudaStream& cuda(Stream& s) { return static_cast<CudaStream&>(s); }
  // Copies on the two streams finish out of order: drop every finished one.
  void retire_locked() {
    std::erase_if(in_flight_, [](const InFlight& f) { return f.event->done(); });
  }

  struct InFlight {
    std::shared_ptr<CudaEvent> event;
    at::Tensor dst, src;
  };
  int index_;
  CudaStream compute_;
  CudaStream h2d_, d2h_;
  std::mutex mu_;
  std::deque<InFlight> in_flight_;
};

}  // namespace

std::unique_ptr<Device> Device::create_cuda(int index, uint64_t budget_bytes) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    throw std::runtime_error("device.type \"cuda\": no CUDA device is visible");
  // A launcher that gives each rank its own GPU (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES
  // set per rank) leaves one visible to each: that one, whatever the local rank.
  if (count == 1) index = 0;
  if (index < 0 || index >= count)
    throw std::runtime_error("CUDA device " + std::to_string(index) + " does not exist (" +
                             std::to_string(count) + " visible)");
  return std::make_unique<CudaDevice>(index, budget_bytes);
}

}  // namespace strata::engine
