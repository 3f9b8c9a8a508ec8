#include "calibrate.h"

#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <thread>
#include <vector>

#include "strata/kernels/cpu_optim.h"
#ifdef STRATA_HAVE_CUDA
#include <cuda_runtime.h>
#endif
#include "strata/offload/file.h"
#include "strata/offload/io_engine.h"
#include "strata/models/decoder.h"
#include "strata/planner/compute.h"

namespace strata::bench {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Repeats `op` until `budget` seconds have passed (at least twice, after one warm-up); returns
// seconds per call.
template <class F>
double per_call(F&& op, double budget) {
  op();
  int n = 0;
  const auto t0 = Clock::now();
  do {
    op();
    ++n;
  } while (since(t0) < budget || n < 2);
  return since(t0) / n;
}

uint64_t meminfo(const char* key) {
  std::ifstream in("/proc/meminfo");
  std::string k, unit;
  uint64_t kb = 0;
  while (in >> k >> kb >> unit)
    if (k == key) return kb * 1024;
  return 0;
}

// The swap space's I/O path: the engine's I/O engine (io_uring, else its thread pool) at its
// default queue depth, direct I/O where the file system allows, 4 MiB requests over `bytes`;
// write (then fsync) and read back, bytes/s.
std::pair<double, double> disk_rates(const std::string& dir, uint64_t bytes, bool& direct) {
  const std::filesystem::path path = std::filesystem::path(dir) / ".strata-calibrate.tmp";
  constexpr size_t kBlock = 4 << 20;
  auto io = offload::IoEngine::create();
  offload::File f = offload::File::open(path, offload::OpenMode::kTruncate);
  direct = f.direct();
  void* raw = nullptr;
  if (posix_memalign(&raw, 4096, kBlock)) throw std::bad_alloc();
  std::unique_ptr<void, decltype(&std::free)> buf(raw, &std::free);
  std::memset(raw, 0x5a, kBlock);
  const std::span<std::byte> block(static_cast<std::byte*>(raw), kBlock);
  const auto run = [&](bool write) {
    std::vector<offload::IoFuture> pending;
    const auto t0 = Clock::now();
    for (uint64_t off = 0; off < bytes; off += kBlock)
      pending.push_back(write ? io->write(f, off, block) : io->read(f, off, block));
    for (const offload::IoFuture& p : pending) p.get();
    if (write && !direct) f.sync();  // direct writes have reached the device, as swap writes do
    return double(bytes) / since(t0);
  };
  const double write = run(true), read = run(false);
  std::filesystem::remove(path);
  return {read, write};
}

// TCP over loopback (what Gloo's collectives between this machine's ranks use): bytes/s one way.
double loopback_rate(uint64_t bytes) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (listener < 0 || ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listener, 1) != 0 || ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    throw std::runtime_error(std::string("calibrate: loopback socket: ") + std::strerror(errno));
  // Connected here, before the sender starts: a failed connect cannot leave accept() waiting.
  const int out = ::socket(AF_INET, SOCK_STREAM, 0);
  if (out < 0 || ::connect(out, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    if (out >= 0) ::close(out);
    ::close(listener);
    throw std::runtime_error(std::string("calibrate: loopback connect: ") + std::strerror(errno));
  }
  std::thread sender([&] {
    std::vector<char> buf(1 << 20, 'x');
    for (uint64_t sent = 0; sent < bytes;) {
      const ssize_t n = ::send(out, buf.data(), std::min<uint64_t>(buf.size(), bytes - sent), 0);
      if (n <= 0) break;
      sent += uint64_t(n);
    }
    ::close(out);
  });
  const int fd = ::accept(listener, nullptr, nullptr);
  std::vector<char> buf(1 << 20);
  const auto t0 = Clock::now();
  uint64_t got = 0;
  for (ssize_t n; (n = ::recv(fd, buf.data(), buf.size(), 0)) > 0;) got += uint64_t(n);
  const double rate = double(got) / since(t0);
  sender.join();
  ::close(fd);
  ::close(listener);
  return rate;
}

}  // namespace

planner::Cluster calibrate_this_machine(const CalibrateOptions& o) {
  planner::Cluster c;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const bool cuda = o.device == "cuda";
  if (o.device != "cpu" && !cuda) throw std::invalid_argument("calibrate: --device must be cpu or cuda, not " + o.device);
#ifndef STRATA_HAVE_CUDA
  if (cuda) throw std::invalid_argument("calibrate: this build has no CUDA");
#endif
  // The compute runs where training runs: the CPU (host device, fp32) or the GPU (bf16). The
  // same code measures both; CUDA work is timed up to a device synchronization.
  const at::Device dev = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const at::ScalarType primary = cuda ? at::kBFloat16 : at::kFloat, secondary = cuda ? at::kFloat : at::kBFloat16;
  const auto sync = [cuda] {
#ifdef STRATA_HAVE_CUDA
    if (cuda && cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error("calibrate: CUDA synchronize failed");
#else
    (void)cuda;
#endif
  };
  const auto timed = [&](auto&& op, double budget) {
    return per_call(
        [&] {
          op();
          sync();
        },
        budget);
  };
  const auto opts = [&](at::ScalarType dt) { return at::TensorOptions().dtype(dt).device(dev); };
  c.name = "this-machine";
  c.nodes = 1;
  planner::NodeSpec& n = c.node;
  n.gpus = 1;
  planner::GpuSpec& g = n.gpu;
  g.name = "host device (" + std::to_string(cores) + " cores)";
  g.is_host = !cuda;
#ifdef STRATA_HAVE_CUDA
  if (cuda) {
    cudaDeviceProp prop{};
    size_t free = 0, total = 0;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || cudaMemGetInfo(&free, &total) != cudaSuccess)
      throw std::runtime_error("calibrate: no usable CUDA device");
    g.name = prop.name;
    g.memory = double(total);
    g.reserved = double(total - free) + 1.5 * 1024 * 1024 * 1024;  // what others hold now, and a context's slack
  }
#endif
  const auto say = [&](const std::string& s) {
    if (!o.quiet) std::cout << "  " << s << std::endl;
  };
  std::cout << "strata plan --calibrate: measuring this machine (" << cores << " cores, compute on " << g.name << ")"
            << std::endl;

  // Matrix products through libtorch, shaped as a transformer's linear layers run them: X [4s, s]
  // by W [4s, s] forward, and the backward's two products (dY W, dY^T X), one rate per size keyed
  // by the FLOPs of one product; in the compute precision (fp32 on the CPU, bf16 on a GPU).
  std::vector<std::pair<double, double>> rates;  // (flops of one product, FLOP/s)
  const auto linear_rate = [&](int64_t s, at::ScalarType dt) {
    const at::Tensor x = at::randn({4 * s, s}, opts(dt)), w = at::randn({4 * s, s}, opts(dt)),
                     dy = at::randn({4 * s, 4 * s}, opts(dt));
    const double t = timed(
        [&] {
          const at::Tensor y = at::linear(x, w);
          const at::Tensor dx = at::mm(dy, w);
          const at::Tensor dw = at::mm(dy.t(), x);
        },
        o.seconds / 2);
    const double flops = 2.0 * double(4 * s) * double(s) * double(4 * s);
    return std::pair{flops, 3 * flops / t};
  };
  const std::vector<int64_t> sizes =
      cuda ? std::vector<int64_t>{128, 256, 512, 1024, 2048, 4096} : std::vector<int64_t>{32, 64, 128, 256, 512, 1024};
  for (int64_t s : sizes) {
    rates.push_back(linear_rate(s, primary));
    say(std::string("linear ") + (cuda ? "bf16" : "fp32") + " [" + std::to_string(4 * s) + " x " + std::to_string(s) +
        "] x [" + std::to_string(s) + " x " + std::to_string(4 * s) +
        "] and its backward: " + std::to_string(rates.back().second / 1e9) + " GFLOP/s");
  }
  double peak = 0;
  for (auto [f, r] : rates) peak = std::max(peak, r);
  (cuda ? g.peak_flops : g.peak_flops_fp32) = peak;
  for (auto [f, r] : rates) g.matmul_efficiency.emplace_back(f, std::min(1.0, r / peak));
  {
    // The other precision at one size, as a peak on the same curve.
    const int64_t s = cuda ? 2048 : 512;
    const auto [flops, rate] = linear_rate(s, secondary);
    const double fraction = planner::matmul_rate(g, flops, !cuda) / peak;
    (cuda ? g.peak_flops_fp32 : g.peak_flops) = rate / fraction;
    say(std::string("linear ") + (cuda ? "fp32" : "bf16") + " at " + std::to_string(s) + ": " +
        std::to_string(rate / 1e9) + " GFLOP/s");
  }
  // Fused causal attention (what the blocks run), forward and backward, against the products' rate
  // at the same work.
  {
    const int64_t b = cuda ? 8 : 4, heads = cuda ? 16 : 4, seq = cuda ? 1024 : 256, d = 64;
    // All three need gradients, as in a block: otherwise a backend may skip dK and dV.
    const at::Tensor q = at::randn({b, heads, seq, d}, opts(primary)).requires_grad_(true),
                     k = at::randn({b, heads, seq, d}, opts(primary)).requires_grad_(true),
                     v = at::randn({b, heads, seq, d}, opts(primary)).requires_grad_(true);
    const double t = timed(
        [&] {
          const at::Tensor a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, true);
          a.sum().backward();
        },
        o.seconds / 2);
    const double flops = 3 * 4.0 * double(b * heads) * double(seq) * double(seq) * double(d);
    g.attention_efficiency = std::min(1.0, flops / t / planner::matmul_rate(g, flops / 3, !cuda));
    say("attention fwd+bwd: " + std::to_string(flops / t / 1e9) + " GFLOP/s (" +
        std::to_string(g.attention_efficiency) + " of the products' rate)");
  }
  // Memory-bound kernels (norms, activations, softmax, residuals) as a block runs them: a real
  // block's forward and backward is timed, the products' and the attention's share is taken out
  // as the two rates above predict it, and what is left is the memory-bound traffic the planner
  // counts for that block (planner/compute.h) at this rate.
  {
    models::ModelConfig mc = models::preset("gpt2");
    mc.layers = 1;
    mc.hidden = cuda ? 2048 : 256;
    mc.heads = mc.kv_heads = mc.hidden / 64;
    mc.head_dim = 64;
    mc.intermediate = 4 * mc.hidden;
    mc.vocab_size = 512;
    mc.max_positions = cuda ? 1024 : 128;
    models::Decoder model(mc, 1);
    models::Stage& block = model.block(0);
    block.to(dev, primary);
    const int64_t batch = cuda ? 8 : 4, seq = mc.max_positions;
    const at::Tensor x = at::randn({batch, seq, mc.hidden}, opts(primary)).requires_grad_(true);
    const double t = timed(
        [&] {
          const at::Tensor y = block.forward(x);
          y.backward(at::ones_like(y));
        },
        o.seconds);
    planner::ShardOf shard;
    shard.activation_bytes = double(c10::elementSize(primary));
    const planner::Work w = planner::block_forward(mc, double(batch), seq, shard);
    g.memory_bandwidth = 1;  // only the products' and attention's shares below
    const planner::Seconds predicted = planner::seconds_by_kind(w, g, !cuda);
    const double left = t - 3 * (predicted.matmul + predicted.attention);
    g.memory_bandwidth = 3 * w.memory_bytes / std::max(left, 0.05 * t);
    say("a block's forward + backward: " + std::to_string(t * 1e3) + " ms, of which memory-bound kernels " +
        std::to_string(std::max(left, 0.05 * t) * 1e3) + " ms: " + std::to_string(g.memory_bandwidth / 1e9) +
        " GB/s of their traffic");
  }

  // Copies: on the host device a memory copy; to and from a GPU, pinned host memory each way.
  {
    const int64_t elems = 64 << 20;  // 256 MiB of fp32
    if (cuda) {
      at::Tensor host = at::empty({elems}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true)).fill_(1);
      at::Tensor device = at::empty({elems}, opts(at::kFloat));
      n.pcie_h2d = double(elems) * 4 / timed([&] { device.copy_(host, true); }, o.seconds);
      n.pcie_d2h = double(elems) * 4 / timed([&] { host.copy_(device, true); }, o.seconds);
      say("PCIe up " + std::to_string(n.pcie_h2d / 1e9) + " GB/s, down " + std::to_string(n.pcie_d2h / 1e9) + " GB/s");
    } else {
      const at::Tensor a = at::randn({elems});
      at::Tensor b = at::empty({elems});
      const double t = per_call([&] { b.copy_(a); }, o.seconds);
      n.pcie_h2d = n.pcie_d2h = double(elems) * 4 / t;
      say("copy: " + std::to_string(n.pcie_h2d / 1e9) + " GB/s");
    }
  }

  // The engine's CPU Adam kernel, every core, fp32 gradients.
  {
    const size_t count = 16 << 20;
    std::vector<float> p(count, 0.5f), m(count, 0.f), v(count, 0.f), grad(count, 1e-3f);
    kernels::AdamConfig cfg;
    cfg.decoupled_weight_decay = true;
    cfg.weight_decay = 0.01;
    kernels::CpuExec exec;
    exec.threads = cores;
    const double t = per_call(
        [&] {
          kernels::adam_step(cfg, p.data(), m.data(), v.data(), grad.data(), kernels::DType::kF32, nullptr,
                             kernels::DType::kF32, count, exec);
          ++cfg.step;
        },
        o.seconds);
    n.cpu_adam_rate = double(count) / t;
    say("CPU Adam: " + std::to_string(n.cpu_adam_rate / 1e9) + " Gparam/s");
  }

  // Ranks on this machine reach each other over loopback TCP.
  n.intra_bandwidth = loopback_rate(1ull << 30);
  say("loopback TCP: " + std::to_string(n.intra_bandwidth / 1e9) + " GB/s");

  // RAM and the disk under `dir`.
  n.host_memory = double(meminfo("MemTotal:"));
  if (!cuda) g.memory = n.host_memory;  // the host device's "device memory": its budget limits it in a run
  struct statvfs st {};
  if (::statvfs(o.dir.c_str(), &st) == 0) {
    n.nvme_drives = 1;
    n.nvme_capacity = double(st.f_bavail) * double(st.f_frsize);
    bool direct = true;
    const auto [read, write] = disk_rates(o.dir, 512ull << 20, direct);
    n.nvme_read = read;
    n.nvme_write = write;
    say(std::string("disk under ") + o.dir + (direct ? " (direct I/O)" : " (buffered: no O_DIRECT here)") +
        ": read " + std::to_string(read / 1e9) + " GB/s, write " + std::to_string(write / 1e9) + " GB/s");
  }
  c.source = std::string("strata plan --calibrate on this machine (compute on ") + (cuda ? "the GPU, bf16" : "the CPU, fp32") +
             "): libtorch linear layers forward and backward, fused "
             "attention, a GPT block forward and backward, a 256 MiB copy, the "
             "CPU Adam kernel on every core, 1 GiB over loopback TCP, 512 MiB through the I/O engine under " + o.dir;
  return c;
}

}  // namespace strata::bench
