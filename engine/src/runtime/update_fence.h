// What a gather waits for first: the update running behind the step (runtime/updater.h) to be
// done with unit u, so that every forward sees exactly the updated weights. The parameter
// coordinator calls it; the updater implements it. Training thread; rethrows the update's error.
#pragma once

#include <cstddef>

namespace strata::engine::runtime {

class UpdateFence {
 public:
  virtual ~UpdateFence() = default;
  virtual void wait_updated(size_t u) = 0;
};

}  // namespace strata::engine::runtime
