// Training data as token windows: flat binary files of uint16 or uint32 token ids, or raw text
// tokenized byte by byte (ids 0..255), read through a memory map.
//
// Sampling: the corpus is cut into W = floor((tokens - 1) / seq_len) windows of seq_len + 1
// tokens (inputs and next-token targets), window i starting at token i * seq_len. Epoch e visits
// the windows in a permutation drawn from (seed, e). Global sample s is window perm_{s / W}[s % W].
// A global batch of B samples at step k holds samples k*B .. k*B + B - 1; data-parallel rank r of
// R takes the contiguous slice r*B/R .. (r+1)*B/R - 1 of it. The loader's whole state is the
// number of global samples consumed (position()), so a checkpoint restores it at any world size
// and every rank still sees exactly the samples the uninterrupted run would have.
//
// Errors: std::runtime_error naming the file (missing, empty, size not a multiple of the token
// width, fewer tokens than one window, a token id >= vocab_size).
// Thread safety: TokenCorpus is immutable after construction; BatchLoader is single-threaded.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace strata::models {

enum class TokenFormat { kUint16, kUint32, kBytes };
TokenFormat parse_token_format(const std::string& name);  // "uint16" | "uint32" | "bytes"

class TokenCorpus {
 public:
  // One file, or (kBytes only) a directory whose regular files are concatenated in name order,
  // e.g. /usr/share/common-licenses. `vocab_size` bounds every id (0: no check).
  TokenCorpus(const std::filesystem::path& path, TokenFormat format, uint64_t vocab_size = 0);
  ~TokenCorpus();
  TokenCorpus(const TokenCorpus&) = delete;
  TokenCorpus& operator=(const TokenCorpus&) = delete;

  uint64_t size() const { return tokens_; }
  uint32_t token(uint64_t i) const;
  void copy(uint64_t begin, uint64_t count, int64_t* out) const;
  const std::string& description() const { return description_; }

 private:
  std::string description_;
  TokenFormat format_;
  const unsigned char* data_ = nullptr;  // mapped file (uint16/uint32) or owned bytes
  size_t map_bytes_ = 0;
  std::vector<unsigned char> owned_;
  uint64_t tokens_ = 0;
};

class BatchLoader {
 public:
  BatchLoader(std::shared_ptr<const TokenCorpus> corpus, uint64_t seq_len, uint64_t global_batch,
              int rank, int world_size, uint64_t seed);

  uint64_t windows_per_epoch() const { return windows_; }
  uint64_t local_batch() const { return global_batch_ / world_; }
  // Window of global sample s: seq_len + 1 token ids.
  void sample(uint64_t s, int64_t* out) const;
  // This rank's slice of the next global batch: local_batch() rows of seq_len + 1 ids, row-major.
  void next(int64_t* out);
  uint64_t position() const { return position_; }  // global samples consumed
  void set_position(uint64_t global_samples);        // must be a multiple of the global batch

 private:
  uint64_t window_of(uint64_t s) const;

  std::shared_ptr<const TokenCorpus> corpus_;
  uint64_t seq_len_, global_batch_, seed_, windows_;
  int rank_, world_;
  uint64_t position_ = 0;
  mutable uint64_t cached_epoch_ = UINT64_MAX;
  mutable std::vector<uint64_t> perm_;
};

}  // namespace strata::models
