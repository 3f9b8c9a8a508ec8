// `strata bench lora`: a LoRA step beside the full fine-tune's, same model, same placement, same
// run. Each side is an engine built from one EngineConfig, the LoRA side's model with adapters on
// every linear layer of its blocks ("all-linear") and model.trainable the adapters alone
// (models::adapter_patterns). Reports, per side, the step time (median of its steps run back to
// back after a warm-up: each side's update overlaps its own next step, never the other's), tokens/s,
// model TFLOPS (models::model_flops_per_token: 4 a frozen parameter, 6 a trainable one), the
// device peak and the host and swap state bytes; the final JSON line's metric is the LoRA step's
// seconds with the full fine-tune's as its baseline. --no-baseline runs the LoRA side alone (a
// model whose full fine-tune does not fit, the 70B row on a GPU).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::bench {

struct LoraBenchOptions {
  // A Llama shape (GQA, gated MLP).
  int64_t layers = 4, hidden = 1024, heads = 16, kv_heads = 4, intermediate = 2816, vocab = 8192;
  int64_t seq = 256, batch = 2;
  int64_t r = 16;
  double alpha = 32;
  unsigned steps = 3;  // timed steps per side, back to back, median reported
  std::string params = "host";  // placement of the compute copies: device, host, nvme or auto
  std::string state = "host";   // gradients, master weights and moments: device, host, nvme or auto
  std::vector<std::string> nvme_dirs;
  std::string device = "cpu";    // "cpu" (the host device) or "cuda"
  uint64_t budget = 0;           // device bytes; 0: no limit
  std::string compute = "fp32";  // fp32 or bf16
  bool recompute = true;         // every block recomputes its forward in the backward
  bool baseline = true;          // the full fine-tune beside it
  unsigned threads = 0;          // 0: every hardware thread
  bool qlora = false;            // the 4-bit base beside the 16-bit one instead of LoRA beside full
  std::string quant_type = "nf4";
};

// `strata bench qlora` (`qlora` set): the same LoRA step over a 4-bit base (model.quantize,
// `quant_type`) beside it over the compute dtype's base, same placement, one run; each side also
// reports the bytes its last step moved (host to device, swap reads). The final line's metric is
// the 4-bit side's seconds with the 16-bit side's as its baseline.
void run_lora_bench(const LoraBenchOptions& options);

}  // namespace strata::bench
