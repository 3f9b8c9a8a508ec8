// A 4-bit record's parts (models/quantized_base.h) as views of the elements holding it: what a
// binding (the coordinator, on the device) and a read-back (Engine::gather_parameters, on the
// host) dequantize through Device::Quant4View. `slot` is the record's elements (any dtype,
// contiguous, on any device, starting 16-byte aligned); `numel` the tensor's elements.
// Thread safety: pure. Errors: none beyond libtorch's view checks.
#pragma once

#include <ATen/core/Tensor.h>

#include "strata/engine/device.h"
#include "strata/models/quantized_base.h"

namespace strata::engine::runtime {

inline Device::Quant4View quant4_view(const at::Tensor& slot, uint64_t numel, const models::QuantizedBase& q) {
  const models::Quant4Record r = models::quant4_record(numel, q);
  const at::Tensor bytes = slot.view(at::kByte);
  const auto part = [&](uint64_t at, uint64_t n) { return bytes.narrow(0, int64_t(at), int64_t(n)); };
  Device::Quant4View v;
  v.packed = part(r.packed_at(), r.packed_bytes);
  v.absmax = q.double_quant ? part(r.absmax_at(), r.absmax_bytes) : part(r.absmax_at(), r.absmax_bytes).view(at::kFloat);
  if (q.double_quant) {
    v.nested_absmax = part(r.nested_at(), r.nested_bytes).view(at::kFloat);
    v.offset = part(0, r.offset_bytes).view(at::kFloat);
  }
  return v;
}

}  // namespace strata::engine::runtime
