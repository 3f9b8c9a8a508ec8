#include "adam_bench.h"
#include "timing.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "strata/kernels/cpu_optim.h"
#ifdef STRATA_HAVE_CUDA
#include <cuda_runtime.h>

#include "strata/kernels/cuda_optim.h"
#endif

namespace strata::bench {

namespace {

using Clock = std::chrono::steady_clock;
constexpr double kLr = 1e-3, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8, kWd = 0.01;

// The Adam step's memory traffic with next to no arithmetic: p, m and v read and written in
// place and g read, as the kernels do. Vectorized whatever the build's optimization level (the
// default -O2 of GCC 12 leaves loops with a remainder scalar, and a scalar loop is compute bound
// on a few cores, which made the old single-array probe report less than the kernels reached).
__attribute__((optimize("O3"))) void traffic_of_a_step(float* __restrict p, float* __restrict m,
                                                      float* __restrict v, const float* __restrict g,
                                                      size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float gi = g[i];
    p[i] = p[i] * 0.999f + gi * 1e-6f;
    m[i] = m[i] * 0.9f + gi * 0.1f;
    v[i] = v[i] * 0.999f + gi * gi * 1e-3f;  // stays >= 0, as Adam's v does
  }
}

// Parameters per second at which the step's traffic alone runs on these arrays and threads
// (contiguous ranges, one per thread), best of 5: the memory-bandwidth bound of an Adam step,
// measured on the very pages the kernels use. Changes p, m and v slightly (no denormals: v
// gains g^2-sized terms).
double memory_bound_params_per_s(at::Tensor& p, at::Tensor& m, at::Tensor& v, const at::Tensor& g,
                                 unsigned threads) {
  const size_t n = size_t(p.numel());
  float *pp = p.data_ptr<float>(), *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = Clock::now();
    std::vector<std::thread> ts;
    const size_t part = (n + threads - 1) / threads;
    for (unsigned i = 0; i < threads; ++i)
      ts.emplace_back([=] {
        const size_t b = std::min(n, i * part), e = std::min(n, b + part);
        traffic_of_a_step(pp + b, mp + b, vp + b, gp + b, e - b);
      });
    for (auto& t : ts) t.join();
    best = std::max(best, double(n) / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

#ifdef STRATA_HAVE_CUDA
// The CUDA Adam kernel on a GPU-resident partition beside PyTorch's fused CUDA AdamW
// (at::_fused_adamw_ on CUDA tensors) and the device's copy bandwidth (a large device-to-device
// copy, bytes read plus written). Returns the JSON fields, or null without a GPU.
nlohmann::json cuda_adam_bench(int64_t n, unsigned steps) {
  if (!kernels::cuda::device_available()) return nullptr;
  std::cerr << "bench adam: CUDA, " << n << " parameters" << std::endl;
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
  at::Tensor p = at::randn({n}, opts), m = at::zeros({n}, opts), v = at::zeros({n}, opts);
  at::Tensor g = at::randn({n}, opts);
  at::Tensor a = at::randn({n * 4}, opts), b = at::empty({n * 4}, opts);
  auto sync = [] { cudaDeviceSynchronize(); };
  int64_t step = 0;
  auto ours = [&] {
    kernels::AdamConfig c{kLr, kBeta1, kBeta2, kEps, kWd, true, ++step};
    kernels::cuda::AdamTensor t{p.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                                g.data_ptr<float>(), nullptr, size_t(n)};
    kernels::cuda::adam_step(c, &t, 1, kernels::DType::kF32, kernels::DType::kF32, nullptr);
    sync();
  };
  at::Tensor step_t = at::zeros({}, opts);
  auto fused = [&] {
    step_t.add_(1);
    at::_fused_adamw_({p}, {g}, {m}, {v}, {}, {step_t}, kLr, kBeta1, kBeta2, kWd, kEps, false,
                      false, std::nullopt, std::nullopt);
    sync();
  };
  auto copy = [&] {
    b.copy_(a);
    sync();
  };
  ours();
  fused();
  copy();
  const std::vector<double> sec = median_seconds(steps, {ours, fused, copy});
  const double copy_bps = 2.0 * double(b.nbytes()) / sec[2];
  const double pps = double(n) / sec[0], fused_pps = double(n) / sec[1];
  return {{"value", pps}, {"baseline", "at::_fused_adamw_ on CUDA"}, {"baseline_value", fused_pps},
          {"ratio", pps / fused_pps}, {"copy_bandwidth_GBps", copy_bps / 1e9},
          {"achieved_GBps", 28.0 * pps / 1e9}, {"fraction_of_copy_bandwidth", 28.0 * pps / copy_bps}};
}
#endif

}  // namespace

void run_adam_bench(const AdamBenchOptions& o) {
  const unsigned threads = o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  const int64_t n = static_cast<int64_t>(o.params);
  at::set_num_threads(static_cast<int>(threads));
  kernels::CpuExec exec{threads, kernels::cpu_features().best()};
  std::cerr << "bench adam: " << n << " parameters, " << threads << " threads, kernels "
            << kernels::to_string(exec.isa) << ", libtorch " << at::get_num_threads()
            << " threads" << std::endl;

  at::manual_seed(0);
  auto randn = [&] { return at::randn({n}, at::kFloat); };
  at::Tensor p = randn(), m = at::zeros({n}), v = at::zeros({n}), g = randn();
  const double bound_pps = memory_bound_params_per_s(p, m, v, g, threads);
  at::Tensor g_bf16 = g.to(at::kBFloat16), out_bf16 = at::empty({n}, at::kBFloat16);
  int64_t step = 0;

  // Strata's kernel.
  auto strata_fp32 = [&] {
    kernels::AdamConfig c{kLr, kBeta1, kBeta2, kEps, kWd, true, ++step};
    kernels::adam_step(c, p.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                       g.data_ptr<float>(), kernels::DType::kF32, nullptr, kernels::DType::kF32,
                       n, exec);
  };
  auto strata_bf16 = [&] {
    kernels::AdamConfig c{kLr, kBeta1, kBeta2, kEps, kWd, true, ++step};
    kernels::adam_step(c, p.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                       g_bf16.data_ptr(), kernels::DType::kBF16, out_bf16.data_ptr(),
                       kernels::DType::kBF16, n, exec);
  };
  // ATen's fused AdamW, the kernel behind torch.optim.AdamW(fused=True) on CPU.
  at::Tensor step_t = at::zeros({}, at::kFloat);
  auto fused_fp32 = [&] {
    step_t.add_(1);
    at::_fused_adamw_({p}, {g}, {m}, {v}, {}, {step_t}, kLr, kBeta1, kBeta2, kWd, kEps, false,
                      false, std::nullopt, std::nullopt);
  };
  // What PyTorch needs for the engine's case: upcast the bf16 gradient, fused step, downcast.
  at::Tensor g_up = at::empty({n}, at::kFloat);
  auto fused_bf16 = [&] {
    g_up.copy_(g_bf16);
    step_t.add_(1);
    at::_fused_adamw_({p}, {g_up}, {m}, {v}, {}, {step_t}, kLr, kBeta1, kBeta2, kWd, kEps, false,
                      false, std::nullopt, std::nullopt);
    out_bf16.copy_(p);
  };
  // libtorch's C++ optimizer (torch::optim::AdamW).
  at::Tensor p_opt = p.clone().set_requires_grad(true);
  p_opt.mutable_grad() = g.clone();
  torch::optim::AdamW opt({p_opt}, torch::optim::AdamWOptions(kLr).betas({kBeta1, kBeta2}).eps(kEps).weight_decay(kWd));
  auto optim_fp32 = [&] { opt.step(); };

  // Both cases move 28 bytes a parameter: read p, m, v, grad and write p, m, v (fp32 grad), or
  // the same with a bf16 grad in and a bf16 copy out; the bound moves the fp32 case's bytes.
  const double bytes_per_param = 28;
  nlohmann::json summary = {{"metric", "adam_params_per_s"}, {"params", n}, {"threads", threads},
                            {"isa", kernels::to_string(exec.isa)},
                            {"stream_bandwidth_GBps", bound_pps * bytes_per_param / 1e9},
                            {"bandwidth_bound_params_per_s", bound_pps}};
  struct Case {
    const char* name;
    std::function<void()> ours, fused, optim;
  };
  for (const Case& c : {Case{"fp32", strata_fp32, fused_fp32, optim_fp32},
                        Case{"bf16_grad_bf16_out", strata_bf16, fused_bf16, nullptr}}) {
    std::cerr << "bench adam: " << c.name << std::endl;
    std::vector<std::function<void()>> fns{c.ours, c.fused};
    if (c.optim) fns.push_back(c.optim);
    const std::vector<double> sec = median_seconds(o.steps, fns);
    const double ours = n / sec[0], fused = n / sec[1], optim = c.optim ? n / sec[2] : 0;
    nlohmann::json line = {{"metric", std::string("adam_") + c.name + "_params_per_s"},
                           {"value", ours},
                           {"baseline", c.optim ? "at::_fused_adamw_" : "upcast + at::_fused_adamw_ + downcast"},
                           {"baseline_value", fused},
                           {"ratio", ours / fused},
                           {"torch_optim_adamw", optim},
                           {"ratio_vs_torch_optim", optim > 0 ? ours / optim : 0},
                           {"bandwidth_bound", bound_pps},
                           {"fraction_of_bound", ours / bound_pps}};
    std::cout << line.dump() << std::endl;
    summary["value"][c.name] = ours;
    summary["baseline_value"][c.name] = fused;
    summary["ratio"][c.name] = ours / fused;
    summary["fraction_of_bound"][c.name] = ours / bound_pps;
  }
  summary["baseline"] = "at::_fused_adamw_ (PyTorch fused=True), same threads";
#ifdef STRATA_HAVE_CUDA
  // The CUDA kernel, fp32, on the GPU when there is one (target: >= 80% of the copy bandwidth).
  if (nlohmann::json cuda = cuda_adam_bench(n, o.steps); !cuda.is_null()) {
    nlohmann::json line = {{"metric", "adam_cuda_fp32_params_per_s"}};
    line.update(cuda);
    std::cout << line.dump() << std::endl;
    summary["cuda_fp32"] = cuda;
  }
#endif
  std::cout << summary.dump() << std::endl;
}

}  // namespace strata::bench
