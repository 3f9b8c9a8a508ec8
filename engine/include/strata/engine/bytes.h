// Byte counts as people read and write them, and the error every device-budget test throws.
// No libtorch: the resolution, the configuration and the planner use these without a device.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace strata::engine {

// A device budget would be exceeded: by an allocation (Device::empty, reserve), or by a plan
// that construction or `--plan` checks before running (check_working_set).
class BudgetExceeded : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// "1.50 GiB", "512 B".
std::string format_bytes(uint64_t bytes);
// "512MiB", "2GB", "1.5GiB", "4096" -> bytes. Throws std::invalid_argument on junk.
uint64_t parse_bytes(const std::string& text);

}  // namespace strata::engine
