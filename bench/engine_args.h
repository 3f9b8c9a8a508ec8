// The engine settings the CPU benchmarks take by name on their command lines (bench lora, bench
// sft): a tier (engine::to_string's names, inverted) and the compute precision.
#pragma once

#include <stdexcept>
#include <string>

#include "strata/engine/config.h"

namespace strata::bench {

// `what` names the option in the error: "bench lora: --params".
inline engine::Placement placement_named(const std::string& name, const std::string& what) {
  for (engine::Placement p : {engine::Placement::kDevice, engine::Placement::kHost, engine::Placement::kNvme,
                              engine::Placement::kAuto})
    if (name == engine::to_string(p)) return p;
  throw std::invalid_argument(what + " must be device, host, nvme or auto, not " + name);
}

// fp32 or bf16.
inline engine::Precision compute_named(const std::string& name, const std::string& what) {
  if (name == "bf16") return engine::Precision::kBf16;
  if (name != "fp32") throw std::invalid_argument(what + " must be fp32 or bf16, not " + name);
  return engine::Precision::kFp32;
}

}  // namespace strata::bench
