// Training data as samples of seq_len + 1 tokens: windows of a token corpus (flat binary files of
// uint16 or uint32 token ids, or raw text tokenized byte by byte, ids 0..255, read through a
// memory map), or supervised fine-tuning examples with a loss mask (SftExamples).
//
// Sampling: the corpus is cut into W = floor((tokens - 1) / seq_len) windows of seq_len + 1
// tokens (inputs and next-token targets), window i starting at token i * seq_len. Epoch e visits
// the windows (or examples) in a permutation drawn from (seed, e). Global sample s is window
// perm_{s / W}[s % W].
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

// Numbered training or evaluation samples: each is seq_len + 1 token ids (inputs and next-token
// targets), seq_len flags saying which targets count in the loss, and seq_len segment ids saying
// which example each input token belongs to (packed sources; else 0: one sequence), -1 for
// padding after a sample's examples (models::TokenLayout: out of the load-balancing loss).
// Thread safety: implementations are immutable after construction.
class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual uint64_t size() const = 0;     // samples
  virtual uint64_t seq_len() const = 0;
  // Sample i into ids[0, seq_len + 1) and, when `loss` is not null, loss[j] = 1 when target
  // ids[j + 1] counts in the loss, else 0; when `segments` is not null, segments[j] the example
  // of input token j (models::TokenLayout).
  virtual void sample(uint64_t i, int64_t* ids, uint8_t* loss, int64_t* segments = nullptr) const = 0;
  // Whether any target may be out of the loss (else every flag is 1).
  virtual bool masked() const = 0;
  // Whether a sample holds several examples (else its segments are all 0).
  virtual bool packed() const { return false; }
  // Of the samples' (seq_len + 1) * size() token slots, how many hold data rather than padding.
  virtual uint64_t real_tokens() const { return (seq_len() + 1) * size(); }
  virtual std::string description() const = 0;
};

// The corpus cut into floor((tokens - 1) / seq_len) windows, window i starting at token
// i * seq_len; every target counts. Throws std::runtime_error when not even one window fits.
class TokenWindows final : public SampleSource {
 public:
  TokenWindows(std::shared_ptr<const TokenCorpus> corpus, uint64_t seq_len);
  uint64_t size() const override { return windows_; }
  uint64_t seq_len() const override { return seq_len_; }
  void sample(uint64_t i, int64_t* ids, uint8_t* loss, int64_t* segments = nullptr) const override;
  bool masked() const override { return false; }
  std::string description() const override { return corpus_->description(); }

 private:
  std::shared_ptr<const TokenCorpus> corpus_;
  uint64_t seq_len_, windows_;
};

// Supervised fine-tuning examples (data.format "sft"): a safetensors file (docs/FORMATS.md,
// written by `strata data prepare --chat`) holding "tokens" (I32 [n]), "loss_mask" (U8 [n]: 1
// where the token is part of a response, a target the loss learns) and "offsets" (I64
// [examples + 1]: example e is tokens [offsets[e], offsets[e + 1])). One example is one sample
// (PackedExamples packs several in one): its first seq_len + 1 tokens, then padding (id `pad_id`,
// out of the loss) to seq_len + 1. Target j counts when loss_mask of token j + 1 is 1.
// Errors: std::runtime_error naming the file (not safetensors, a tensor missing or of the wrong
// dtype or shape, offsets not increasing from 0 to n, a token id < 0 or >= vocab_size, a mask
// value other than 0 and 1, no example with a target in the loss).
class SftExamples final : public SampleSource {
 public:
  SftExamples(const std::filesystem::path& path, uint64_t seq_len, uint64_t vocab_size = 0, int64_t pad_id = 0);
  ~SftExamples() override;
  uint64_t size() const override { return examples_; }
  uint64_t seq_len() const override { return seq_len_; }
  void sample(uint64_t i, int64_t* ids, uint8_t* loss, int64_t* segments = nullptr) const override;
  bool masked() const override { return true; }
  uint64_t real_tokens() const override { return kept_tokens_; }
  std::string description() const override { return description_; }
  // Examples longer than seq_len + 1 tokens (cut), and the response tokens cut with them.
  uint64_t truncated_examples() const { return truncated_; }
  uint64_t truncated_loss_tokens() const { return truncated_loss_; }
  // Example e's tokens as a sample holds them: min(its length, seq_len + 1).
  uint64_t kept_length(uint64_t e) const;
  // The first `count` (<= kept_length(e)) tokens of example e into ids, and into `loss` flags
  // for targets: loss[j] = loss_mask of token j + 1, for j + 1 < count (count - 1 flags).
  void copy(uint64_t e, uint64_t count, int64_t* ids, uint8_t* loss) const;
  int64_t pad_id() const { return pad_id_; }

 private:
  struct Data;
  std::unique_ptr<Data> data_;
  uint64_t seq_len_, examples_ = 0, truncated_ = 0, truncated_loss_ = 0, kept_tokens_ = 0;
  int64_t pad_id_;
  std::string description_;
};

// Supervised examples packed into windows of seq_len + 1 tokens (data.pack), so that a step
// computes examples rather than padding. The rule (best_fit_decreasing) depends only on the
// examples' lengths, seq_len and the seed: never on the world size, so a resume at any world size
// reproduces the windows. A window holds its examples one after another, then padding (`pad_id`,
// out of the loss, segment -1). Segment j of a window is the index of input token j's
// example within it; target j counts when loss_mask of token j + 1 is 1 and tokens j and j + 1
// are of the same example, so no target crosses from one example into the next.
// Thread safety: immutable after construction.
class PackedExamples final : public SampleSource {
 public:
  PackedExamples(std::shared_ptr<const SftExamples> examples, uint64_t seed);
  uint64_t size() const override { return begin_.size() - 1; }
  uint64_t seq_len() const override { return examples_->seq_len(); }
  void sample(uint64_t i, int64_t* ids, uint8_t* loss, int64_t* segments = nullptr) const override;
  bool masked() const override { return true; }
  bool packed() const override { return true; }
  uint64_t real_tokens() const override { return examples_->real_tokens(); }
  std::string description() const override;
  // The examples of window w, in the order it holds them.
  std::vector<uint64_t> window_examples(uint64_t w) const;

 private:
  std::shared_ptr<const SftExamples> examples_;
  std::vector<uint64_t> order_, begin_;  // window w holds examples order_[begin_[w] .. begin_[w + 1])
};

// Bins of at most `capacity` for items of the given lengths (each <= capacity), by best fit
// decreasing as TRL's "bfd" packs: items by decreasing length, ties in an order shuffled from
// `seed`; each into the open bin it leaves least room in (among equals the oldest), else a new
// bin. Returns the items bin by bin (`order`) and where each bin starts in it (`begin`, one more
// entry than bins). O(n + capacity) time and 5 words an item, whatever the number of bins (a
// multimap of open bins, the method it replaced, stays in bench/pack_baseline.h as the baseline).
struct Bins {
  std::vector<uint64_t> order, begin;
};
Bins best_fit_decreasing(const std::vector<uint64_t>& lengths, uint64_t capacity, uint64_t seed);

// Samples [begin, end) of another source, renumbered from 0: a held-out split (data.eval_split
// keeps the last part of a source for evaluation and trains on the rest).
class SampleRange final : public SampleSource {
 public:
  SampleRange(std::shared_ptr<const SampleSource> source, uint64_t begin, uint64_t end);
  uint64_t size() const override { return end_ - begin_; }
  uint64_t seq_len() const override { return source_->seq_len(); }
  void sample(uint64_t i, int64_t* ids, uint8_t* loss, int64_t* segments = nullptr) const override;
  bool masked() const override { return source_->masked(); }
  bool packed() const override { return source_->packed(); }
  uint64_t real_tokens() const override;
  std::string description() const override;

 private:
  std::shared_ptr<const SampleSource> source_;
  uint64_t begin_, end_;
};

// Global sample s of the training stream is sample perm_{s / N}[s % N] of the source (N its
// size), epoch e's permutation drawn from (seed, e).
class BatchLoader {
 public:
  BatchLoader(std::shared_ptr<const SampleSource> source, uint64_t global_batch, int rank, int world_size,
              uint64_t seed);
  // The corpus's windows (TokenWindows).
  BatchLoader(std::shared_ptr<const TokenCorpus> corpus, uint64_t seq_len, uint64_t global_batch,
              int rank, int world_size, uint64_t seed);

  uint64_t windows_per_epoch() const { return windows_; }
  uint64_t local_batch() const { return global_batch_ / world_; }
  const SampleSource& source() const { return *source_; }
  // Global sample s: seq_len + 1 token ids (and seq_len loss flags and segments when not null).
  void sample(uint64_t s, int64_t* out, uint8_t* loss = nullptr, int64_t* segments = nullptr) const;
  // This rank's slice of the next global batch: local_batch() rows of seq_len + 1 ids, row-major
  // (and of seq_len loss flags and segments when not null).
  void next(int64_t* out, uint8_t* loss = nullptr, int64_t* segments = nullptr);
  uint64_t position() const { return position_; }  // global samples consumed
  void set_position(uint64_t global_samples);        // must be a multiple of the global batch

 private:
  uint64_t window_of(uint64_t s) const;

  std::shared_ptr<const SampleSource> source_;
  uint64_t seq_len_, global_batch_, seed_, windows_;
  int rank_, world_;
  uint64_t position_ = 0;
  mutable uint64_t cached_epoch_ = UINT64_MAX;
  mutable std::vector<uint64_t> perm_;
};

// The evaluation pass over a whole source, in order, each sample once: batch b (of batches())
// holds samples b*B .. b*B + B - 1 (B = global_batch), rank r its slice as BatchLoader; rows past
// the end are padding, entirely out of the loss.
class EvalBatches {
 public:
  EvalBatches(std::shared_ptr<const SampleSource> source, uint64_t global_batch, int rank, int world_size);
  uint64_t batches() const { return (source_->size() + global_batch_ - 1) / global_batch_; }
  uint64_t local_batch() const { return global_batch_ / world_; }
  void batch(uint64_t b, int64_t* ids, uint8_t* loss, int64_t* segments = nullptr) const;

 private:
  std::shared_ptr<const SampleSource> source_;
  uint64_t global_batch_;
  int rank_, world_;
};

}  // namespace strata::models
