// `strata train`: the data and the model a run starts with (train_parts.h).
#include "train_parts.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>

#include "object_paths.h"
#include "strata/models/hf_io.h"
#include "strata/models/token_data.h"
#include "strata/offload/object_store.h"

namespace strata::cli::train {
namespace {

std::shared_ptr<const models::SampleSource> open_samples(const engine::TrainConfig& tc, const std::string& path,
                                                         const std::string& format, uint64_t vocab, bool lead) {
  const uint64_t T = uint64_t(tc.engine.seq_len);
  if (format != "sft")
    return std::make_shared<models::TokenWindows>(
        std::make_shared<models::TokenCorpus>(path, models::parse_token_format(format), vocab), T);
  auto sft = std::make_shared<models::SftExamples>(path, T, vocab, tc.data_pad_id);
  if (sft->truncated_examples() > 0) {
    const std::string what = std::to_string(sft->truncated_examples()) + " of " + std::to_string(sft->size()) +
                             " examples of " + path + " are longer than seq_len + 1 = " + std::to_string(T + 1) +
                             " tokens";
    if (tc.data_overlong == "refuse")
      throw std::runtime_error(what + " (data.overlong \"refuse\"): raise data.seq_len, drop them, or set "
                               "data.overlong \"truncate\"");
    if (lead)
      std::cerr << "strata train: warning: " << what << " and are cut there (data.overlong \"truncate\"; "
                << sft->truncated_loss_tokens() << " response tokens never trained on); raise data.seq_len to keep them\n";
  }
  const auto efficiency = [&](const models::SampleSource& s) {
    return 100.0 * double(s.real_tokens()) / double((T + 1) * s.size());
  };
  if (!tc.data_pack) {
    if (lead)
      std::cerr << "strata train: " << path << ": " << sft->size() << " examples, one a window (data.pack false): "
                << std::fixed << std::setprecision(1) << efficiency(*sft) << "% of the window tokens are examples'\n"
                << std::defaultfloat;
    return sft;
  }
  auto packed = std::make_shared<models::PackedExamples>(sft, tc.data_seed);
  if (lead)
    std::cerr << "strata train: " << path << ": " << sft->size() << " examples packed into " << packed->size()
              << " windows of " << T + 1 << " tokens: packing efficiency " << std::fixed << std::setprecision(1)
              << efficiency(*packed) << "% (unpacked " << efficiency(*sft) << "%)\n"
              << std::defaultfloat;
  return packed;
}

}  // namespace

DataSources open_data(const engine::TrainConfig& tc, uint64_t vocab, bool lead) {
  DataSources d;
  d.train = open_samples(tc, tc.data_path, tc.data_format, vocab, lead);
  if (!tc.eval_path.empty()) d.eval = open_samples(tc, tc.eval_path, tc.eval_format, vocab, lead);
  if (tc.eval_split > 0) {  // the last samples are held out
    const uint64_t n = d.train->size(), held = std::max<uint64_t>(1, uint64_t(std::llround(tc.eval_split * double(n))));
    if (held >= n)
      throw std::invalid_argument("data.eval_split " + std::to_string(tc.eval_split) + " of the " + std::to_string(n) +
                                  " samples of " + d.train->description() + " leaves none to train on");
    d.eval = std::make_shared<models::SampleRange>(d.train, n - held, n);
    d.train = std::make_shared<models::SampleRange>(d.train, 0, n - held);
  }
  if (d.eval && tc.eval_max_samples > 0 && d.eval->size() > uint64_t(tc.eval_max_samples))
    d.eval = std::make_shared<models::SampleRange>(d.eval, 0, uint64_t(tc.eval_max_samples));
  return d;
}

// A model in a bucket: one rank per node mirrors it into the cache (ranged GETs, files whose
// size and etag match the last copy skipped), the others wait; then it loads from there.
void fetch_init_model(engine::TrainConfig& tc, const engine::DistEnv& env, engine::Communicator& comm, bool lead) {
  if (!offload::is_object_store_url(tc.init_from)) return;
  const std::string local = cache_path("models", tc.init_from);
  if (env.local_rank == 0) {
    const uint64_t bytes = offload::mirror_to_directory(
        *offload::open_object_store(tc.init_from), local, {}, [&](const std::string& name, uint64_t size) {
          if (lead) std::cerr << "strata train: fetching " << tc.init_from << "/" << name << " (" << double(size) / (1 << 20) << " MiB)\n";
        });
    if (lead)
      std::cerr << "strata train: model " << tc.init_from << " in " << local << " (" << double(bytes) / (1 << 20)
                << " MiB fetched)\n";
  }
  comm.barrier();
  tc.init_from = local;
}

// Deferred: the engine initializes (loads) it one unit at a time as it places the state.
std::unique_ptr<models::Decoder> make_model(const engine::TrainConfig& tc) {
  if (!tc.init_from.empty())
    return models::open_hf_model(tc.init_from, tc.model.lora, tc.adapter_from, tc.model.quantize);
  auto m = std::make_unique<models::Decoder>(tc.model, tc.init_seed, models::Decoder::Init::kDeferred);
  if (!tc.adapter_from.empty()) m->set_source(models::peft_adapter_source(m->config(), tc.adapter_from));
  return m;
}

}  // namespace strata::cli::train
