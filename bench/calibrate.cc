// `strata plan --calibrate`: the probes of the compute device (linear layers, attention, GPT
// blocks, copies, the CPU Adam kernel), timed in rounds, and the planner's constants derived
// from their medians. The machine around it (RAM, disk, collectives) is measured in
// calibrate_host.cc.
#include "calibrate.h"

#include <ATen/ATen.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "calibrate_internal.h"
#include "strata/kernels/cpu_optim.h"
#ifdef STRATA_HAVE_CUDA
#include <cuda_runtime.h>
#endif
#include "strata/models/decoder.h"
#include "strata/planner/compute.h"

namespace strata::bench {

using namespace calibrate_detail;

namespace {

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

}  // namespace

// Blocks in the block probe's stack.
constexpr int kProbeBlocks = 4;

// A timed operation, run once a round; keeps every round's seconds per call.
struct Probe {
  std::function<void()> op;
  double window;  // seconds a round
  std::vector<double> times;  // by round
  // The median over rounds `which` (every round where empty).
  double median(const std::vector<int>& which = {}) const {
    std::vector<double> t;
    if (which.empty()) t = times;
    for (int r : which) t.push_back(times.at(size_t(r)));
    std::nth_element(t.begin(), t.begin() + long(t.size() / 2), t.end());
    return t[t.size() / 2];
  }
};

struct Calibration::Impl {
  CalibrateOptions o;
  bool cuda;
  unsigned cores;
  at::Device dev{at::kCPU};
  at::ScalarType primary, secondary;
  planner::Cluster base;  // what no round changes: names, memory, the collectives and the disk
  std::vector<Probe> probes;
  // Which probe measures what.
  std::vector<int64_t> sizes;  // linear layers [4s, s] x [s, 4s]
  std::vector<size_t> linear;
  int64_t secondary_size;
  size_t secondary_probe, attention_probe, copy_up, copy_down, adam_probe;
  int64_t att_b, att_heads, att_seq, att_d = 64;
  // A stack of real GPT blocks.
  models::ModelConfig block_config;
  std::unique_ptr<models::Decoder> block_model;
  size_t block_probe = 0;
  int64_t block_batch;
  int64_t copy_elems = 64 << 20;  // 256 MiB of fp32
  size_t adam_count;
  // The Adam probe's arrays and its step count (advanced each call).
  std::vector<float> adam_p, adam_m, adam_v, adam_g;
  std::vector<uint16_t> adam_copy;
  kernels::AdamConfig adam_cfg;
  bool direct = true;  // the disk was measured with direct I/O
  int rounds = 0;

  void sync() const {
#ifdef STRATA_HAVE_CUDA
    if (cuda && cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error("calibrate: CUDA synchronize failed");
#endif
  }
  at::TensorOptions opts(at::ScalarType dt) const { return at::TensorOptions().dtype(dt).device(dev); }
  size_t probe(std::function<void()> op, double window) {
    probes.push_back({std::move(op), window, {}});
    return probes.size() - 1;
  }
  static double linear_flops(int64_t s) { return 2.0 * double(4 * s) * double(s) * double(4 * s); }
};

Calibration::Calibration(const CalibrateOptions& o) : impl_(std::make_unique<Impl>()) {
  Impl& I = *impl_;
  I.o = o;
  I.cores = std::max(1u, std::thread::hardware_concurrency());
  I.cuda = o.device == "cuda";
  const bool cuda = I.cuda;
  if (o.device != "cpu" && !cuda) throw std::invalid_argument("calibrate: --device must be cpu or cuda, not " + o.device);
#ifndef STRATA_HAVE_CUDA
  if (cuda) throw std::invalid_argument("calibrate: this build has no CUDA");
#endif
  // The compute runs where training runs: the CPU (host device, fp32) or the GPU (bf16). The
  // same code measures both; CUDA work is timed up to a device synchronization.
  I.dev = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  I.primary = cuda ? at::kBFloat16 : at::kFloat;
  I.secondary = cuda ? at::kFloat : at::kBFloat16;
  planner::Cluster& c = I.base;
  c.name = "this-machine";
  c.nodes = 1;
  planner::NodeSpec& n = c.node;
  n.gpus = 1;
  planner::GpuSpec& g = n.gpu;
  g.name = "host device (" + std::to_string(I.cores) + " cores)";
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
  std::cout << "strata plan --calibrate: measuring this machine (" << I.cores << " cores, compute on " << g.name << ")"
            << std::endl;

  // Matrix products through libtorch, shaped as a transformer's linear layers run them: X [4s, s]
  // by W [4s, s] forward, and the backward's two products (dY W, dY^T X), one rate per size keyed
  // by the FLOPs of one product; in the compute precision (fp32 on the CPU, bf16 on a GPU).
  const auto linear_probe = [&](int64_t s, at::ScalarType dt) {
    const at::Tensor x = at::randn({4 * s, s}, I.opts(dt)), w = at::randn({4 * s, s}, I.opts(dt)),
                     dy = at::randn({4 * s, 4 * s}, I.opts(dt));
    return I.probe(
        [x, w, dy] {
          const at::Tensor y = at::linear(x, w);
          const at::Tensor dx = at::mm(dy, w);
          const at::Tensor dw = at::mm(dy.t(), x);
        },
        o.seconds / 2);
  };
  I.sizes = cuda ? std::vector<int64_t>{128, 256, 512, 1024, 2048, 4096} : std::vector<int64_t>{32, 64, 128, 256, 512, 1024};
  for (int64_t s : I.sizes) I.linear.push_back(linear_probe(s, I.primary));
  // The other precision at one size, as a peak on the same curve.
  I.secondary_size = cuda ? 2048 : 512;
  I.secondary_probe = linear_probe(I.secondary_size, I.secondary);

  // Fused causal attention (what the blocks run), forward and backward, against the products' rate
  // at the same work.
  I.att_b = cuda ? 8 : 4;
  I.att_heads = cuda ? 16 : 4;
  I.att_seq = cuda ? 1024 : 256;
  {
    // All three need gradients, as in a block: otherwise a backend may skip dK and dV.
    const auto qkv = [&] { return at::randn({I.att_b, I.att_heads, I.att_seq, I.att_d}, I.opts(I.primary)).requires_grad_(true); };
    const at::Tensor q = qkv(), k = qkv(), v = qkv();
    I.attention_probe = I.probe(
        [q, k, v] {
          const at::Tensor a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, true);
          a.sum().backward();
        },
        o.seconds / 2);
  }

  // Memory-bound kernels (norms, activations, softmax, residuals) as a block runs them: real
  // blocks' forward and backward are timed, the products' and the attention's share is taken out
  // as the rates above predict it, and what is left is the memory-bound traffic the planner counts
  // for a block (planner/compute.h) at this rate. The probe runs a stack of kProbeBlocks blocks
  // forward, then backward, as training does, so that a block's operands have left the caches by
  // the time it runs again (on the 2-core VM a block of hidden 512 took the same 50 ms either
  // way, 2026-11-27; a block that fits a larger cache would not).
  {
    models::ModelConfig& mc = I.block_config;
    mc = models::preset("gpt2");
    mc.layers = kProbeBlocks;
    mc.hidden = cuda ? 2048 : 256;
    mc.heads = mc.kv_heads = mc.hidden / 64;
    mc.head_dim = 64;
    mc.intermediate = 4 * mc.hidden;
    mc.vocab_size = 512;
    mc.max_positions = cuda ? 1024 : 128;
    I.block_model = std::make_unique<models::Decoder>(mc, 1);
    std::vector<models::Stage*> blocks;
    for (size_t i = 0; i < I.block_model->num_blocks(); ++i) {
      blocks.push_back(&I.block_model->block(i));
      blocks.back()->to(I.dev, I.primary);
    }
    I.block_batch = cuda ? 8 : 4;
    const at::Tensor x = at::randn({I.block_batch, mc.max_positions, mc.hidden}, I.opts(I.primary)).requires_grad_(true);
    I.block_probe = I.probe(
        [blocks, x] {
          at::Tensor y = x;
          for (models::Stage* block : blocks) y = block->forward(y);
          y.backward(at::ones_like(y));
        },
        o.seconds);
  }

  // Copies: on the host device a memory copy; to and from a GPU, pinned host memory each way.
  if (cuda) {
    at::Tensor host = at::empty({I.copy_elems}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true)).fill_(1);
    at::Tensor device = at::empty({I.copy_elems}, I.opts(at::kFloat));
    I.copy_up = I.probe([host, device]() mutable { device.copy_(host, true); }, o.seconds);
    I.copy_down = I.probe([host, device]() mutable { host.copy_(device, true); }, o.seconds);
  } else {
    const at::Tensor a = at::randn({I.copy_elems});
    at::Tensor b = at::empty({I.copy_elems});
    I.copy_up = I.copy_down = I.probe([a, b]() mutable { b.copy_(a); }, o.seconds);
  }

  // The engine's CPU Adam kernel, every core, fp32 gradients, writing the new compute copy where
  // training keeps one in 16 bits (a GPU's bf16). Its arrays outgrow the last-level cache four
  // times over: a state that fit would run at cache speed, which no model's state does.
  {
    const long l3 = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
    I.adam_count = std::max<size_t>(16 << 20, size_t(std::max(0L, l3)) * 4 / 16);
    I.adam_p.assign(I.adam_count, 0.5f);
    I.adam_m.assign(I.adam_count, 0.f);
    I.adam_v.assign(I.adam_count, 0.f);
    I.adam_g.assign(I.adam_count, 1e-3f);
    I.adam_copy.assign(cuda ? I.adam_count : 0, 0);
    I.adam_cfg.decoupled_weight_decay = true;
    I.adam_cfg.weight_decay = 0.01;
    kernels::CpuExec exec;
    exec.threads = I.cores;
    Impl* self = &I;
    I.adam_probe = I.probe(
        [self, exec] {
          kernels::adam_step(self->adam_cfg, self->adam_p.data(), self->adam_m.data(), self->adam_v.data(),
                             self->adam_g.data(), kernels::DType::kF32,
                             self->cuda ? self->adam_copy.data() : nullptr,
                             self->cuda ? kernels::DType::kBF16 : kernels::DType::kF32, self->adam_count, exec);
          ++self->adam_cfg.step;
        },
        o.seconds);
  }

  // Measured once: the collectives between this machine's ranks; RAM; the disk under `dir`.
  const CollectiveRate collectives = local_collective_rate(64ull << 20);
  n.intra_bandwidth = collectives.bytes_per_s;
  n.intra_cpu_share = collectives.cpu_share;
  n.host_memory = double(meminfo("MemTotal:"));
  if (!cuda) g.memory = n.host_memory;  // the host device's "device memory": its budget limits it in a run
  std::filesystem::create_directories(o.dir);
  struct statvfs st {};
  if (::statvfs(o.dir.c_str(), &st) != 0)
    throw std::runtime_error("calibrate: cannot measure the file system under " + o.dir + ": " + std::strerror(errno));
  n.nvme_drives = 1;
  n.nvme_capacity = double(st.f_bavail) * double(st.f_frsize);
  const DiskRates d = disk_rates(o.dir, 512ull << 20, I.direct);
  n.nvme_read = d.read;
  n.nvme_write = d.write;
  n.nvme_duplex = d.duplex;
  c.source = std::string("strata plan --calibrate on this machine (compute on ") + (cuda ? "the GPU, bf16" : "the CPU, fp32") +
             "): libtorch linear layers forward and backward, fused attention, a stack of GPT blocks forward and backward, a "
             "256 MiB copy, the CPU Adam kernel on every core (medians of rounds spread over the measurement), an "
             "all-gather and a reduce-scatter of 64 MiB between two local ranks (Gloo over loopback TCP; their rate and CPU share), 512 MiB through the I/O engine under " + o.dir;
}

Calibration::~Calibration() = default;

void Calibration::rounds(int count) {
  Impl& I = *impl_;
  for (int r = 0; r < count; ++r, ++I.rounds)
    for (Probe& p : I.probes)
      p.times.push_back(per_call(
          [&] {
            p.op();
            I.sync();
          },
          p.window));
}

int Calibration::rounds_done() const { return impl_->rounds; }

planner::Cluster Calibration::cluster(bool say_it, const std::vector<int>& which) const {
  const Impl& I = *impl_;
  if (I.rounds == 0) throw std::logic_error("calibrate: no round measured yet");
  for (int r : which)
    if (r < 0 || r >= I.rounds) throw std::out_of_range("calibrate: no round " + std::to_string(r));
  const bool cuda = I.cuda;
  planner::Cluster c = I.base;
  planner::NodeSpec& n = c.node;
  planner::GpuSpec& g = n.gpu;
  const auto say = [&](const std::string& s) {
    if (say_it && !I.o.quiet) std::cout << "  " << s << std::endl;
  };
  say("medians of " + std::to_string(which.empty() ? I.rounds : int(which.size())) + " rounds:");
  std::vector<std::pair<double, double>> rates;  // (flops of one product, FLOP/s)
  for (size_t i = 0; i < I.sizes.size(); ++i) {
    const int64_t s = I.sizes[i];
    rates.emplace_back(Impl::linear_flops(s), 3 * Impl::linear_flops(s) / I.probes[I.linear[i]].median(which));
    say(std::string("linear ") + (cuda ? "bf16" : "fp32") + " [" + std::to_string(4 * s) + " x " + std::to_string(s) +
        "] x [" + std::to_string(s) + " x " + std::to_string(4 * s) +
        "] and its backward: " + std::to_string(rates.back().second / 1e9) + " GFLOP/s");
  }
  double peak = 0;
  for (auto [f, r] : rates) peak = std::max(peak, r);
  (cuda ? g.peak_flops : g.peak_flops_fp32) = peak;
  for (auto [f, r] : rates) g.matmul_efficiency.emplace_back(f, std::min(1.0, r / peak));
  {
    const double flops = Impl::linear_flops(I.secondary_size), rate = 3 * flops / I.probes[I.secondary_probe].median(which);
    const double fraction = planner::matmul_rate(g, flops, !cuda) / peak;
    (cuda ? g.peak_flops_fp32 : g.peak_flops) = rate / fraction;
    say(std::string("linear ") + (cuda ? "fp32" : "bf16") + " at " + std::to_string(I.secondary_size) + ": " +
        std::to_string(rate / 1e9) + " GFLOP/s");
  }
  {
    const double t = I.probes[I.attention_probe].median(which);
    const double flops = 3 * 4.0 * double(I.att_b * I.att_heads) * double(I.att_seq) * double(I.att_seq) * double(I.att_d);
    g.attention_efficiency = std::min(1.0, flops / t / planner::matmul_rate(g, flops / 3, !cuda));
    say("attention fwd+bwd: " + std::to_string(flops / t / 1e9) + " GFLOP/s (" +
        std::to_string(g.attention_efficiency) + " of the products' rate)");
  }
  {
    const double t = I.probes[I.block_probe].median(which) / kProbeBlocks;
    planner::ShardOf shard;
    shard.activation_bytes = double(c10::elementSize(I.primary));
    const planner::Work w =
        planner::block_forward(I.block_config, double(I.block_batch), I.block_config.max_positions, shard);
    g.memory_bandwidth = 1;  // only the products' and attention's shares below
    const planner::Seconds predicted = planner::seconds_by_kind(w, g, !cuda);
    const double left = std::max(t - 3 * (predicted.matmul + predicted.attention), 0.05 * t);
    g.memory_bandwidth = 3 * w.memory_bytes / left;
    say("a block's forward + backward: " + std::to_string(t * 1e3) + " ms, of which memory-bound kernels " +
        std::to_string(left * 1e3) + " ms: " + std::to_string(g.memory_bandwidth / 1e9) + " GB/s of their traffic");
  }
  n.pcie_h2d = double(I.copy_elems) * 4 / I.probes[I.copy_up].median(which);
  n.pcie_d2h = double(I.copy_elems) * 4 / I.probes[I.copy_down].median(which);
  if (cuda)
    say("PCIe up " + std::to_string(n.pcie_h2d / 1e9) + " GB/s, down " + std::to_string(n.pcie_d2h / 1e9) + " GB/s");
  else
    say("copy: " + std::to_string(n.pcie_h2d / 1e9) + " GB/s");
  n.cpu_adam_rate = double(I.adam_count) / I.probes[I.adam_probe].median(which);
  say("CPU Adam: " + std::to_string(n.cpu_adam_rate / 1e9) + " Gparam/s");
  say("collectives between two local ranks (Gloo over loopback): " + std::to_string(n.intra_bandwidth / 1e9) +
      " GB/s sent by each, " + std::to_string(n.intra_cpu_share) + " of their time on a core");
  say(std::string("disk under ") + I.o.dir + (I.direct ? " (direct I/O)" : " (buffered: no O_DIRECT here)") +
      ": read " + std::to_string(n.nvme_read / 1e9) + " GB/s, write " + std::to_string(n.nvme_write / 1e9) +
      " GB/s, both at once " + std::to_string(n.nvme_duplex / 1e9) + " GB/s");
  return c;
}

planner::Cluster calibrate_this_machine(const CalibrateOptions& o) {
  Calibration c(o);
  c.rounds(kCalibrationRounds);
  return c.cluster();
}

}  // namespace strata::bench
