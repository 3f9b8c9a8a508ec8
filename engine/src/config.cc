#include "strata/engine/config.h"
#include "strata/models/trainable.h"

#include <stdexcept>
#include <string>

namespace strata::engine {

const char* to_string(Precision p) {
  switch (p) {
    case Precision::kFp32: return "fp32";
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
  }
  return "?";
}
const char* to_string(Placement p) {
  switch (p) {
    case Placement::kDevice: return "device";
    case Placement::kHost: return "host";
    case Placement::kNvme: return "nvme";
    case Placement::kAuto: return "auto";
  }
  return "?";
}

const char* to_string(UpdateOverlap o) {
  switch (o) {
    case UpdateOverlap::kOff: return "off";
    case UpdateOverlap::kForward: return "forward";
    case UpdateOverlap::kBackward: return "backward";
  }
  return "?";
}

void EngineConfig::validate() const {
  auto bad = [](const std::string& m) { throw std::invalid_argument(m); };
  if (!(lr >= 0)) bad("optimizer.lr must be >= 0");
  if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1))
    bad("optimizer.betas must be in [0, 1)");
  if (!(eps > 0)) bad("optimizer.eps must be > 0");
  models::TrainableTensors{trainable};  // a malformed pattern throws, naming it
  if (!(weight_decay >= 0)) bad("optimizer.weight_decay must be >= 0");
  if (!(clip_grad_norm >= 0)) bad("optimizer.clip_grad_norm must be >= 0 (0: off)");
  if (update_overlap == UpdateOverlap::kBackward && clip_grad_norm > 0)
    bad("optimizer.overlap \"backward\" needs optimizer.clip_grad_norm 0: clipping scales every "
        "update by the global gradient norm, which is known only after the whole backward");
  if (update_overlap == UpdateOverlap::kBackward && compute == Precision::kFp16)
    bad("optimizer.overlap \"backward\" cannot run with precision.compute fp16: the loss scaler "
        "skips a step whose gradients overflow, which is known only after the whole backward");
  if (micro_batch < 1) bad("batch.micro_batch must be >= 1");
  if (grad_accum < 1) bad("batch.grad_accum must be >= 1");
  if (seq_len < 1) bad("data.seq_len must be >= 1");
  if (mlp_token_chunk < kMlpChunkAuto) bad("placement.tiling.mlp_tokens must be \"auto\", \"off\" or >= 1 tokens");
  if (reduce == Precision::kFp16) bad("precision.reduce must be fp32 or bf16");
  if (!(initial_loss_scale > 0)) bad("precision.initial_loss_scale must be > 0");
  if (loss_scale_window < 1) bad("precision.loss_scale_window must be >= 1");
  if (device != "cpu" && device != "cuda")
    bad("device.type must be \"cpu\" or \"cuda\", not \"" + device + "\"");
  const auto A = Placement::kAuto;
  if (moments != master && moments != A && master != A)
    bad("placement.moments and placement.master must be the same: the optimizer updates them "
        "together where they live");
  if (grads != A && master != A && grads != master && !(master == Placement::kNvme && grads == Placement::kHost))
    bad("placement.grads must be placement.master's (or \"host\" with master on \"nvme\"): the "
        "optimizer runs where the master weights live and reads the gradients there");
  const bool nvme = params == Placement::kNvme || grads == Placement::kNvme || master == Placement::kNvme ||
                    activations == Placement::kNvme;
  if (nvme && nvme_dirs.empty())
    bad("a placement is \"nvme\" but offload.nvme_dirs is empty: name at least one directory");
  if (io_queue_depth < 1 || io_queue_depth > 4096) bad("offload.queue_depth must be in 1..4096");
  if (nvme_chunk_bytes < 4096) bad("offload.optimizer_chunk must be >= 4KiB");
  if (device_budget == 0) bad("device.budget must be > 0");
  if (prefetch < 0) bad("device.prefetch must be >= 0");
  if (recompute_blocks < kRecomputeAuto) bad("placement.recompute must be >= 0 blocks");
  if (!(timeout_s > 0)) bad("distributed.timeout_s must be > 0");
}

}  // namespace strata::engine
