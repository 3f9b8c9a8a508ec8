#include "sft_bench.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <future>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <thread>

#include <unistd.h>

#include "bench_model.h"
#include "engine_args.h"
#include "strata/engine/comm.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "strata/models/safetensors.h"
#include "strata/models/token_data.h"

namespace strata::bench {
namespace {

namespace fs = std::filesystem;

// The benchmark's chat examples as a data.format "sft" file (docs/FORMATS.md).
void write_examples(const fs::path& path, int64_t vocab) {
  const double mu = std::log(kMedianTokens), sigma = std::log(kTailTokens / kMedianTokens) / 2.326;
  std::mt19937_64 rng(20261129);
  std::lognormal_distribution<double> length(mu, sigma);
  std::uniform_int_distribution<int32_t> token(1, int32_t(vocab - 1));
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;
  std::vector<int64_t> offsets{0};
  for (uint64_t e = 0; e < kExamples; ++e) {
    const int64_t n = std::max<int64_t>(2, std::llround(length(rng)));
    for (int64_t j = 0; j < n; ++j) {
      tokens.push_back(token(rng));
      mask.push_back(j >= std::max<int64_t>(1, n / 3) ? 1 : 0);
    }
    offsets.push_back(int64_t(tokens.size()));
  }
  using models::StDType;
  models::SafetensorsWriter w(path,
                              {{"tokens", StDType::kI32, {int64_t(tokens.size())}},
                               {"loss_mask", StDType::kU8, {int64_t(mask.size())}},
                               {"offsets", StDType::kI64, {int64_t(offsets.size())}}},
                              {{"format", "strata-sft-1"}});
  w.write("tokens", std::as_bytes(std::span(tokens)));
  w.write("loss_mask", std::as_bytes(std::span(mask)));
  w.write("offsets", std::as_bytes(std::span(offsets)));
  w.finish();
}

struct SideResult {
  std::string name;
  double real_tokens_per_s = 0, efficiency = 0, step_s = 0;
  uint64_t windows = 0, real_tokens = 0;
};

}  // namespace

void run_sft_bench(const SftBenchOptions& o) {
  const unsigned threads = o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  at::set_num_threads(int(threads));
  const fs::path dir = o.dir.empty() ? fs::temp_directory_path() / ("strata-bench-sft-" + std::to_string(::getpid()))
                                     : fs::path(o.dir);
  fs::create_directories(dir);
  const fs::path file = dir / "chats.sft";
  write_examples(file, o.vocab);
  auto examples = std::make_shared<models::SftExamples>(file, uint64_t(o.seq), uint64_t(o.vocab));
  auto packed = std::make_shared<models::PackedExamples>(examples, 0);

  auto comm = engine::Communicator::create(engine::DistEnv{}, std::chrono::seconds(600));
  const models::ModelConfig c = llama_shape("llama-sft-bench", o.layers, o.hidden, o.heads, o.kv_heads,
                                            o.intermediate, o.vocab);
  engine::EngineConfig e;
  e.device = o.device;
  e.compute = compute_named(o.compute, "bench sft: --compute");
  e.micro_batch = o.batch;
  e.seq_len = o.seq;
  e.lr = 1e-4;
  e.cpu_threads = threads;
  e.params = e.grads = e.master = e.moments = placement_named(o.params, "bench sft: --params");
  e.recompute_blocks = engine::EngineConfig::kRecomputeAll;
  auto dev = engine::Device::create(o.device, 0, UINT64_MAX);
  engine::Engine eng(std::make_unique<models::Decoder>(c, 1, models::Decoder::Init::kDeferred), e, *comm, *dev);
  std::cerr << "bench sft: " << kExamples << " examples (log-normal lengths, median " << kMedianTokens << ", "
            << kTailShare * 100 << "% over " << kTailTokens << ", cut at " << o.seq + 1 << "), "
            << double(examples->real_tokens()) / double(kExamples) << " tokens on average; " << c.parameters() / 1e6
            << "M parameters (" << o.layers << " x " << o.hidden << "), " << o.batch << " x " << o.seq
            << " a step, " << o.compute << " on " << dev->description() << ", " << threads << " threads" << std::endl;

  std::vector<SideResult> results;
  for (const auto& [name, source] :
       std::vector<std::pair<std::string, std::shared_ptr<const models::SampleSource>>>{{"padded", examples},
                                                                                       {"packed", packed}}) {
    models::BatchLoader loader(source, uint64_t(o.batch), 0, 1, 0);
    const int64_t T = o.seq;
    at::Tensor ids = at::empty({o.batch, T + 1}, at::kLong), mask = at::empty({o.batch, T}, at::kByte);
    at::Tensor segments = source->packed() ? at::empty({o.batch, T}, at::kLong) : at::Tensor();
    // A step; returns its real tokens: each row's examples' tokens, not the padding after them
    // (the trailing run of pad id 0, never a token here).
    const auto step = [&] {
      loader.next(ids.data_ptr<int64_t>(), mask.data_ptr<uint8_t>(),
                  segments.defined() ? segments.data_ptr<int64_t>() : nullptr);
      eng.train_step(ids, mask, segments);
      uint64_t real = 0;
      const int64_t* row = ids.data_ptr<int64_t>();
      for (int64_t b = 0; b < o.batch; ++b, row += T + 1) {
        int64_t n = T + 1;
        while (n > 0 && row[n - 1] == 0) --n;
        real += uint64_t(n);
      }
      return real;
    };
    step();  // warm-up
    uint64_t real = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (unsigned k = 0; k < o.steps; ++k) real += step();
    const std::shared_future<void> update = eng.update_finished();
    if (update.valid()) update.get();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    SideResult r;
    r.name = name;
    r.windows = source->size();
    r.real_tokens = real;
    r.step_s = secs / o.steps;
    r.real_tokens_per_s = double(real) / secs;
    r.efficiency = double(source->real_tokens()) / double(uint64_t(T + 1) * source->size());
    std::cout << nlohmann::json{{"side", name},
                                {"windows", r.windows},
                                {"packing_efficiency", r.efficiency},
                                {"step_s", r.step_s},
                                {"timed_real_tokens", real},
                                {"real_tokens_per_s", r.real_tokens_per_s}}
                     .dump()
              << std::endl;
    results.push_back(r);
  }
  // The file, then the directory (empty): libtorch.so carries its own std::filesystem::remove_all,
  // which crashes in binaries that link it (docs/ARCHITECTURE.md).
  fs::remove(file);
  if (o.dir.empty()) fs::remove(dir);
  const SideResult &padded = results[0], &pack = results[1];
  std::cout << nlohmann::json{{"metric", "sft_real_tokens_per_s"},
                              {"value", pack.real_tokens_per_s},
                              {"baseline", "padded_real_tokens_per_s"},
                              {"baseline_value", padded.real_tokens_per_s},
                              {"ratio", pack.real_tokens_per_s / padded.real_tokens_per_s},
                              {"packed_efficiency", pack.efficiency},
                              {"padded_efficiency", padded.efficiency},
                              {"examples", kExamples},
                              {"seq_len", o.seq},
                              {"device", dev->description()},
                              {"compute", o.compute},
                              {"threads", threads}}
                   .dump()
            << std::endl;
}

}  // namespace strata::bench
