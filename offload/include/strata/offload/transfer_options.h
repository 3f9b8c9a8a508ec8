// How large object-store transfers are cut (object_store.h's put_object, get_object, put_file,
// and the checkpoint reader's ranged reads): parts of part_bytes with up to `concurrency` in
// flight. Apart from object_store.h so that a configuration can hold one without the drivers.
// A plain value; no dependencies.
#pragma once

#include <cstdint>

namespace strata::offload {

// What the defaults reach: docs/PERFORMANCE.md (`strata bench ckpt --store`).
struct TransferOptions {
  uint64_t part_bytes = 16ull << 20;
  int concurrency = 8;
};

}  // namespace strata::offload
