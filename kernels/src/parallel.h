// A process-wide pool of worker threads for CPU kernels (private header).
#pragma once

#include <cstddef>
#include <functional>

namespace strata::kernels::detail {

// Runs fn(task) for task in [0, tasks) on up to `threads` threads (the caller is one of them) and
// returns when all are done. Exceptions from fn are rethrown on the caller (the first one).
// Concurrent calls from different threads are serialized.
void parallel_for(size_t tasks, unsigned threads, const std::function<void(size_t)>& fn);

}  // namespace strata::kernels::detail
