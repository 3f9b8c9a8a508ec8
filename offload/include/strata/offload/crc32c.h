// CRC32C (Castagnoli), as iSCSI, ext4 and object stores use it: the checksum of checkpoint
// chunks. SSE4.2's crc32 instruction (three interleaved streams) when the CPU has it, else a
// table; same results.
// crc32c("123456789") == 0xE3069283. Thread safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::offload {

// Continues `crc` (0 to start) over `n` bytes.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

}  // namespace strata::offload
