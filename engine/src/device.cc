#include "strata/engine/device.h"
#include "strata/kernels/quant4.h"

#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <new>
#include <thread>

namespace strata::engine {

uint64_t device_memory_reserve(uint64_t total) {
  return std::min(total, std::max<uint64_t>(uint64_t(4) << 30, total / 100 * 8));
}

at::Tensor Device::unpinned_host(uint64_t numel, at::ScalarType t) {
  const uint64_t bytes = numel * c10::elementSize(t);
  void* p = std::aligned_alloc(4096, std::max<uint64_t>(4096, (bytes + 4095) / 4096 * 4096));
  if (!p) throw std::bad_alloc();
  return at::from_blob(p, {int64_t(numel)}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(t));
}

at::Tensor Device::host_state(uint64_t numel, at::ScalarType t, const std::string& what) const {
  (void)what;
  return unpinned_host(numel, t);
}

struct Device::Reservation::Ledger {
  std::atomic<uint64_t> used{0};
  std::atomic<uint64_t> peak{0};
};

Device::Device(uint64_t budget_bytes) : budget_(budget_bytes), ledger_(std::make_shared<Ledger>()) {}

uint64_t Device::used() const { return ledger_->used.load(); }
uint64_t Device::peak() const { return ledger_->peak.load(); }
void Device::reset_peak() { ledger_->peak.store(ledger_->used.load()); }

at::Tensor Device::empty(at::IntArrayRef shape, at::ScalarType dtype, const std::string& what) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const uint64_t bytes = uint64_t(numel) * c10::elementSize(dtype);
  acquire(bytes, what);
  void* ptr = nullptr;
  try {
    ptr = raw_allocate(bytes == 0 ? 1 : bytes);
  } catch (...) {
    ledger_->used.fetch_sub(bytes);
    throw;
  }
  // The deleter holds what it needs, not the device: the tensor may outlive it.
  return at::from_blob(
      ptr, shape,
      [free = raw_free(), ledger = ledger_, bytes](void* q) {
        free(q);
        ledger->used.fetch_sub(bytes);
      },
      at::TensorOptions().dtype(dtype).device(torch_device()));
}

kernels::DType Device::kernel_dtype(at::ScalarType t) {
  if (t == at::kBFloat16) return kernels::DType::kBF16;
  if (t == at::kHalf) return kernels::DType::kF16;
  return kernels::DType::kF32;
}

void Device::adam_step(const kernels::AdamConfig& config, const std::vector<AdamTensors>& units,
                       const kernels::CpuExec& exec) {
  for (const AdamTensors& t : units) {
    const kernels::DType out = kernel_dtype(t.out.scalar_type());
    kernels::adam_step(config, t.master.data_ptr<float>(), t.exp_avg.data_ptr<float>(), t.exp_avg_sq.data_ptr<float>(),
                       t.grad.data_ptr<float>(), kernels::DType::kF32, t.out.data_ptr(), out,
                       size_t(t.master.numel()), exec);
  }
}

void Device::dequantize_4bit(const Quant4View& v, kernels::Quant4 type, int64_t blocksize, const at::Tensor& out) {
  dequantize_4bit_on_host(v, type, blocksize, out);
}

void Device::dequantize_4bit_on_host(const Quant4View& v, kernels::Quant4 type, int64_t blocksize,
                                     const at::Tensor& out) {
  const bool nested = v.nested_absmax.defined();
  TORCH_CHECK(v.packed.is_contiguous() && v.absmax.is_contiguous() && out.is_contiguous() &&
                  v.packed.scalar_type() == at::kByte && v.absmax.scalar_type() == (nested ? at::kByte : at::kFloat),
              "dequantize_4bit: uint8 codes, fp32 absmax (uint8 with double quantization) and an output, contiguous");
  if (nested)
    kernels::dequantize_4bit_nested(v.packed.const_data_ptr<uint8_t>(), v.absmax.const_data_ptr<uint8_t>(),
                                    v.nested_absmax.const_data_ptr<float>(), v.offset.const_data_ptr<float>()[0],
                                    out.numel(), type, blocksize, out.data_ptr(), kernel_dtype(out.scalar_type()));
  else
    kernels::dequantize_4bit(v.packed.const_data_ptr<uint8_t>(), v.absmax.const_data_ptr<float>(), out.numel(), type,
                             blocksize, out.data_ptr(), kernel_dtype(out.scalar_type()));
}

std::vector<double> Device::sum_squares(const std::vector<at::Tensor>& xs, const kernels::CpuExec& exec) {
  std::vector<double> out;
  out.reserve(xs.size());
  for (const at::Tensor& x : xs)
    out.push_back(kernels::sum_squares(x.data_ptr<float>(), kernels::DType::kF32, size_t(x.numel()), exec));
  return out;
}

void Device::read_to_host(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.scalar_type() == src.scalar_type() &&
                  dst.numel() == src.numel(),
              "read_to_host: mismatched or non-contiguous tensors");
  std::memcpy(dst.data_ptr(), src.const_data_ptr(), size_t(src.nbytes()));
}

void Device::acquire(uint64_t bytes, const std::string& what) {
  std::atomic<uint64_t>& used = ledger_->used;
  uint64_t cur = used.load();
  do {
    while (cur + bytes > budget_ && reclaim()) cur = used.load();
    if (cur + bytes > budget_)
      throw BudgetExceeded("device budget exceeded: " + what + " needs " + format_bytes(bytes) +
                           ", " + format_bytes(cur) + " of " + format_bytes(budget_) +
                           " in use on " + description());
  } while (!used.compare_exchange_weak(cur, cur + bytes));
  uint64_t p = ledger_->peak.load();
  while (cur + bytes > p && !ledger_->peak.compare_exchange_weak(p, cur + bytes)) {
  }
}

Device::Reservation Device::reserve(uint64_t bytes, const std::string& what) {
  acquire(bytes, what);
  return Reservation(ledger_, bytes);
}

void Device::Reservation::reset() {
  if (ledger_) ledger_->used.fetch_sub(bytes_);
  ledger_ = nullptr;
  bytes_ = 0;
}

namespace {

// One worker thread running its queue in order.
class HostStream final : public Stream {
 public:
  // After `fails_after` pieces of work the stream fails for good (Device::create_host).
  HostStream(const char* name, uint64_t fails_after = UINT64_MAX)
      : name_(name), fails_after_(fails_after), worker_([this] { run(); }) {}
  ~HostStream() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  const char* name() const override { return name_; }

  void enqueue(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(fn));
      ++enqueued_;
    }
    cv_.notify_all();
  }
  // Blocks until all work enqueued so far has run; rethrows the first error.
  void drain() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t target = enqueued_;
    cv_.wait(lock, [&] { return completed_ >= target; });
    if (error_) {
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }
  // Blocks until the oldest work not yet done is done; false (at once) if there is none, or if
  // called by the stream's own worker (which would wait for itself).
  bool wait_oldest() {
    std::unique_lock<std::mutex> lock(mu_);
    if (completed_ >= enqueued_ || std::this_thread::get_id() == worker_.get_id()) return false;
    const uint64_t target = completed_ + 1;
    cv_.wait(lock, [&] { return completed_ >= target; });
    return true;
  }
  // Why the stream runs no more work, or "" (Device::stream_error).
  std::string error_text() {
    std::lock_guard<std::mutex> lock(mu_);
    return failed_ ? failure() : "";
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      auto fn = std::move(queue_.front());
      queue_.pop_front();
      if (completed_ >= fails_after_) {  // failed: the work is dropped, not run
        failed_ = true;
        if (!error_) error_ = std::make_exception_ptr(std::runtime_error(failure()));
        ++completed_;
        cv_.notify_all();
        lock.unlock();
        fn = nullptr;  // what it holds goes outside the lock
        lock.lock();
        continue;
      }
      lock.unlock();
      std::exception_ptr err;
      try {
        fn();
      } catch (...) {
        err = std::current_exception();
      }
      fn = nullptr;  // what the work holds (a copy's source) is freed before it counts as done
      lock.lock();
      if (err && !error_) error_ = err;
      ++completed_;
      cv_.notify_all();
    }
  }

  std::string failure() const { return std::string(name_) + " stream: injected failure (it runs no more work)"; }

  const char* name_;
  uint64_t fails_after_;
  bool failed_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t enqueued_ = 0, completed_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread worker_;
};

// The caller's thread: work runs at once.
class CallerStream final : public Stream {
 public:
  const char* name() const override { return "compute"; }
};

class HostEvent final : public Event {
 public:
  bool done() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  void set() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
      when_ = std::chrono::steady_clock::now();
    }
    cv_.notify_all();
  }
  void wait() const {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
  }
  std::chrono::steady_clock::time_point when() const {
    wait();
    std::lock_guard<std::mutex> lock(mu_);
    return when_;
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  std::chrono::steady_clock::time_point when_;
};

class HostDevice final : public Device {
 public:
  HostDevice(uint64_t budget, uint64_t d2h_fails_after) : Device(budget), h2d_("h2d"), d2h_("d2h", d2h_fails_after) {}
  c10::Device torch_device() const override { return c10::Device(c10::kCPU); }
  std::string description() const override { return "host device (CPU)"; }
  Stream& compute_stream() override { return compute_; }
  Stream& h2d_stream() override { return h2d_; }
  Stream& d2h_stream() override { return d2h_; }

  void copy_async(const at::Tensor& dst, const at::Tensor& src, Stream& stream) override {
    TORCH_CHECK(dst.numel() == src.numel() && dst.scalar_type() == src.scalar_type() &&
                    dst.is_contiguous() && src.is_contiguous(),
                "copy_async: mismatched or non-contiguous tensors");
    // The lambda holds both tensors, so their memory outlives the copy.
    launch_host(stream, [dst, src] {
      std::memcpy(dst.data_ptr(), src.data_ptr(), size_t(src.numel()) * src.element_size());
    });
  }
  void launch_host(Stream& stream, std::function<void()> fn) override {
    if (auto* hs = dynamic_cast<HostStream*>(&stream)) hs->enqueue(std::move(fn));
    else fn();
  }
  std::shared_ptr<Event> record(Stream& stream) override {
    auto ev = std::make_shared<HostEvent>();
    launch_host(stream, [ev] { ev->set(); });
    return ev;
  }
  void wait(Stream& stream, const std::shared_ptr<Event>& event) override {
    auto ev = std::static_pointer_cast<HostEvent>(event);
    launch_host(stream, [ev] { ev->wait(); });
  }
  void synchronize(Stream& stream) override {
    if (auto* hs = dynamic_cast<HostStream*>(&stream)) hs->drain();
  }
  std::string stream_error(Stream& stream) override {
    auto* hs = dynamic_cast<HostStream*>(&stream);
    return hs ? hs->error_text() : "";
  }
  std::shared_ptr<Event> record_timed(Stream& stream) override { return record(stream); }
  double seconds_between(const std::shared_ptr<Event>& from, const std::shared_ptr<Event>& to) override {
    const auto a = static_cast<const HostEvent&>(*from).when(), b = static_cast<const HostEvent&>(*to).when();
    return std::chrono::duration<double>(b - a).count();
  }

 protected:
  void* raw_allocate(size_t bytes) override {
    void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    if (!p) throw std::bad_alloc();
    return p;
  }
  RawFree raw_free() const override { return &std::free; }
  // Device memory the engine has dropped may still be held by a copy queued on a copy stream
  // (the lambda holds its tensors until it has run): wait for the oldest work of each.
  bool reclaim() override {
    const bool d2h = d2h_.wait_oldest();
    const bool h2d = h2d_.wait_oldest();
    return d2h || h2d;
  }

 private:
  CallerStream compute_;
  HostStream h2d_, d2h_;
};

}  // namespace

std::unique_ptr<Device> Device::create_host(uint64_t budget_bytes, uint64_t d2h_fails_after) {
  return std::make_unique<HostDevice>(budget_bytes, d2h_fails_after);
}

#ifndef STRATA_HAVE_CUDA
std::unique_ptr<Device> Device::create_cuda(int, uint64_t) {
  throw std::runtime_error("device.type \"cuda\": this build of Strata has no CUDA support");
}
#endif

std::unique_ptr<Device> Device::create(const std::string& type, int local_rank, uint64_t budget) {
  if (type == "cpu") return create_host(budget);
  if (type == "cuda") return create_cuda(local_rank, budget);
  throw std::invalid_argument("device.type must be \"cpu\" or \"cuda\", not \"" + type + "\"");
}

}  // namespace strata::engine
