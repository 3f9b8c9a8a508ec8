// Reading a training configuration: JSON text or a file into TrainConfig, every key checked
// (docs/CONFIG.md is the reference). Its own library, strata::config, so that the layout library
// the planner links does no I/O: reading a configuration may fetch a model's config.json from an
// object store (offload).
//
// Errors: std::invalid_argument naming the source and the key. Thread safety: pure functions.
#pragma once

#include <string>

#include "strata/engine/config.h"

namespace strata::engine {

TrainConfig parse_train_config(const std::string& json_text, const std::string& source);
TrainConfig load_train_config(const std::string& path);

}  // namespace strata::engine
