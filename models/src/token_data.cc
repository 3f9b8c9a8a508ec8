#include "strata/models/token_data.h"

#include "strata/models/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <stdexcept>

namespace strata::models {

namespace {
std::runtime_error err(const std::string& what) { return std::runtime_error(what); }
}  // namespace

TokenFormat parse_token_format(const std::string& name) {
  if (name == "uint16") return TokenFormat::kUint16;
  if (name == "uint32") return TokenFormat::kUint32;
  if (name == "bytes") return TokenFormat::kBytes;
  throw std::invalid_argument("unknown token format '" + name + "' (uint16, uint32, bytes)");
}

TokenCorpus::TokenCorpus(const std::filesystem::path& path, TokenFormat format, uint64_t vocab)
    : description_(path.string()), format_(format) {
  std::error_code ec;
  if (format == TokenFormat::kBytes && std::filesystem::is_directory(path, ec)) {
    std::vector<std::filesystem::path> files;
    for (auto& e : std::filesystem::directory_iterator(path)) {
      if (e.is_regular_file()) files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    for (auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      if (!in) throw err("token data " + f.string() + ": cannot read");
      owned_.insert(owned_.end(), std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    description_ += " (" + std::to_string(files.size()) + " files)";
    data_ = owned_.data();
    tokens_ = owned_.size();
  } else {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw err("token data " + path.string() + ": " + std::strerror(errno));
    struct stat st {};
    if (fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      throw err("token data " + path.string() + ": fstat: " + std::strerror(e));
    }
    map_bytes_ = static_cast<size_t>(st.st_size);
    const size_t width = format == TokenFormat::kUint16 ? 2 : format == TokenFormat::kUint32 ? 4 : 1;
    if (map_bytes_ % width != 0) {
      ::close(fd);
      throw err("token data " + path.string() + ": " + std::to_string(map_bytes_) +
                " bytes is not a whole number of " + std::to_string(width) + "-byte tokens");
    }
    if (map_bytes_ > 0) {
      void* p = mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        const int e = errno;
        ::close(fd);
        throw err("token data " + path.string() + ": mmap: " + std::strerror(e));
      }
      data_ = static_cast<const unsigned char*>(p);
    }
    ::close(fd);
    tokens_ = map_bytes_ / width;
  }
  if (tokens_ == 0) throw err("token data " + description_ + " is empty");
  if (vocab > 0 && format != TokenFormat::kBytes) {
    for (uint64_t i = 0; i < tokens_; ++i) {
      const uint32_t id = token(i);
      if (id >= vocab) {
        if (map_bytes_ > 0) munmap(const_cast<unsigned char*>(data_), map_bytes_);  // no destructor
        throw err("token data " + description_ + ": token " + std::to_string(i) + " is " +
                  std::to_string(id) + ", outside the vocabulary of " + std::to_string(vocab));
      }
    }
  }
  if (vocab > 0 && format == TokenFormat::kBytes && vocab < 256) {
    throw err("byte-level text needs a vocabulary of at least 256, the model has " + std::to_string(vocab));
  }
}

TokenCorpus::~TokenCorpus() {
  if (map_bytes_ > 0 && owned_.empty() && data_ != nullptr) {
    munmap(const_cast<unsigned char*>(data_), map_bytes_);
  }
}

uint32_t TokenCorpus::token(uint64_t i) const {
  switch (format_) {
    case TokenFormat::kUint16: {
      uint16_t v;
      std::memcpy(&v, data_ + 2 * i, 2);
      return v;
    }
    case TokenFormat::kUint32: {
      uint32_t v;
      std::memcpy(&v, data_ + 4 * i, 4);
      return v;
    }
    case TokenFormat::kBytes: return data_[i];
  }
  return 0;
}

void TokenCorpus::copy(uint64_t begin, uint64_t count, int64_t* out) const {
  for (uint64_t i = 0; i < count; ++i) out[i] = token(begin + i);
}

TokenWindows::TokenWindows(std::shared_ptr<const TokenCorpus> corpus, uint64_t seq_len)
    : corpus_(std::move(corpus)), seq_len_(seq_len) {
  if (seq_len_ == 0) throw std::invalid_argument("data: seq_len must be positive");
  windows_ = corpus_->size() > seq_len_ ? (corpus_->size() - 1) / seq_len_ : 0;
  if (windows_ == 0) {
    throw std::runtime_error("token data " + corpus_->description() + " has " +
                             std::to_string(corpus_->size()) + " tokens, fewer than one window of " +
                             std::to_string(seq_len_ + 1));
  }
}

void TokenWindows::sample(uint64_t i, int64_t* ids, uint8_t* loss, int64_t* segments) const {
  corpus_->copy(i * seq_len_, seq_len_ + 1, ids);
  if (loss) std::memset(loss, 1, seq_len_);
  if (segments) std::fill(segments, segments + seq_len_, int64_t(0));
}

// Views into the mapping; safetensors data is only byte aligned, so the typed reads copy.
struct SftExamples::Data {
  std::unique_ptr<SafetensorsFile> file;
  const std::byte* tokens = nullptr;
  const uint8_t* mask = nullptr;
  const std::byte* offsets = nullptr;
  int32_t token(uint64_t i) const { return read<int32_t>(tokens, i); }
  int64_t offset(uint64_t e) const { return read<int64_t>(offsets, e); }
  template <class T>
  static T read(const std::byte* base, uint64_t i) {
    T v;
    std::memcpy(&v, base + i * sizeof(T), sizeof(T));
    return v;
  }
};

SftExamples::~SftExamples() = default;

SftExamples::SftExamples(const std::filesystem::path& path, uint64_t seq_len, uint64_t vocab_size, int64_t pad_id)
    : data_(std::make_unique<Data>()), seq_len_(seq_len), pad_id_(pad_id) {
  const std::string where = "sft data " + path.string();
  auto fail = [&](const std::string& what) { return std::runtime_error(where + ": " + what); };
  if (seq_len_ == 0) throw std::invalid_argument("data: seq_len must be positive");
  try {
    data_->file = std::make_unique<SafetensorsFile>(path);
  } catch (const std::exception& e) {
    throw fail(std::string("cannot be read as safetensors (strata data prepare --chat writes it): ") + e.what());
  }
  const SafetensorsFile& f = *data_->file;
  auto tensor = [&](const char* name, StDType dtype) {
    if (!f.contains(name)) throw fail(std::string("no tensor \"") + name + "\"");
    TensorView v = f.get(name);
    if (v.info->dtype != dtype || v.info->shape.size() != 1)
      throw fail(std::string("\"") + name + "\" must be a 1-D " + to_string(dtype) + " tensor, not " +
                 to_string(v.info->dtype) + " with " + std::to_string(v.info->shape.size()) + " dimensions");
    return v;
  };
  const TensorView tokens = tensor("tokens", StDType::kI32), mask = tensor("loss_mask", StDType::kU8),
                   offsets = tensor("offsets", StDType::kI64);
  const uint64_t n = tokens.info->numel();
  if (mask.info->numel() != n)
    throw fail("\"loss_mask\" has " + std::to_string(mask.info->numel()) + " entries for " + std::to_string(n) + " tokens");
  if (offsets.info->numel() < 2) throw fail("\"offsets\" holds no example");
  data_->tokens = tokens.data.data();
  data_->mask = reinterpret_cast<const uint8_t*>(mask.data.data());
  data_->offsets = offsets.data.data();
  examples_ = offsets.info->numel() - 1;
  const auto offset = [&](uint64_t e) { return data_->offset(e); };
  if (offset(0) != 0 || offset(examples_) != int64_t(n))
    throw fail("\"offsets\" must run from 0 to the token count " + std::to_string(n));
  // The passes below read the file once; what they have read is let go every 16 Mi tokens, so
  // that the process does not hold the file (the samples read back the few they need). The
  // kernel maps up to 64 KiB around each page a read faults in, so even the scattered reads of
  // the cut examples' masks would map most of the mask.
  constexpr uint64_t kReleaseEvery = 16ull << 20;
  const auto release_mask = [&](uint64_t from, uint64_t to) {
    f.release(reinterpret_cast<const std::byte*>(data_->mask + from), to - from);
  };
  uint64_t in_loss = 0, mask_released = 0;
  for (uint64_t e = 0; e < examples_; ++e) {
    const int64_t b = offset(e), x = offset(e + 1);
    if (x <= b) throw fail("example " + std::to_string(e) + " is empty (offsets must increase)");
    kept_tokens_ += std::min<uint64_t>(uint64_t(x - b), seq_len_ + 1);
    if (uint64_t(x - b) > seq_len_ + 1) {
      ++truncated_;
      for (int64_t i = b + int64_t(seq_len_) + 1; i < x; ++i) truncated_loss_ += data_->mask[i] != 0;
    }
    if (uint64_t(x) - mask_released >= kReleaseEvery) {
      release_mask(mask_released, uint64_t(x));
      mask_released = uint64_t(x);
    }
  }
  release_mask(0, n);
  for (uint64_t i = 0; i < n; ++i) {
    if (i % kReleaseEvery == 0 && i > 0) {
      f.release(data_->tokens + (i - kReleaseEvery) * sizeof(int32_t), kReleaseEvery * sizeof(int32_t));
      release_mask(i - kReleaseEvery, i);
    }
    const int32_t id = data_->token(i);
    if (id < 0 || (vocab_size > 0 && uint64_t(id) >= vocab_size))
      throw fail("token " + std::to_string(i) + " has id " + std::to_string(id) + ", outside the vocabulary of " +
                 std::to_string(vocab_size));
    const uint8_t m = data_->mask[i];
    if (m > 1) throw fail("loss_mask[" + std::to_string(i) + "] is " + std::to_string(m) + " (0 or 1)");
    in_loss += m;
  }
  f.release(data_->tokens, n * sizeof(int32_t));
  release_mask(0, n);
  if (in_loss == 0) throw fail("no token is in the loss (every loss_mask entry is 0)");
  if (pad_id_ < 0 || (vocab_size > 0 && uint64_t(pad_id_) >= vocab_size))
    throw fail("padding id " + std::to_string(pad_id_) + " is outside the vocabulary");
  description_ = path.string() + " (" + std::to_string(examples_) + " examples, " + std::to_string(n) + " tokens, " +
                 std::to_string(in_loss) + " in the loss)";
}

void SftExamples::sample(uint64_t i, int64_t* ids, uint8_t* loss, int64_t* segments) const {
  const uint64_t len = kept_length(i);
  std::vector<uint8_t> flags(len);
  copy(i, len, ids, flags.data());
  std::fill(ids + len, ids + seq_len_ + 1, pad_id_);
  if (loss)
    for (uint64_t j = 0; j < seq_len_; ++j) loss[j] = j + 1 < len ? flags[j] : 0;
  if (segments)  // the example, then padding
    for (uint64_t j = 0; j < seq_len_; ++j) segments[j] = j < len ? 0 : -1;
}

uint64_t SftExamples::kept_length(uint64_t e) const {
  if (e >= examples_) throw std::out_of_range("SftExamples: no example " + std::to_string(e));
  return std::min<uint64_t>(uint64_t(data_->offset(e + 1) - data_->offset(e)), seq_len_ + 1);
}

void SftExamples::copy(uint64_t e, uint64_t count, int64_t* ids, uint8_t* loss) const {
  if (count > kept_length(e)) throw std::out_of_range("SftExamples: example " + std::to_string(e) + " is shorter");
  const uint64_t b = uint64_t(data_->offset(e));
  for (uint64_t j = 0; j < count; ++j) ids[j] = data_->token(b + j);
  for (uint64_t j = 0; j + 1 < count; ++j) loss[j] = data_->mask[b + j + 1];
}

SampleRange::SampleRange(std::shared_ptr<const SampleSource> source, uint64_t begin, uint64_t end)
    : source_(std::move(source)), begin_(begin), end_(end) {
  if (begin_ >= end_ || end_ > source_->size())
    throw std::invalid_argument("data: samples [" + std::to_string(begin_) + ", " + std::to_string(end_) +
                                ") are not a non-empty part of the " + std::to_string(source_->size()) + " of " +
                                source_->description());
}

void SampleRange::sample(uint64_t i, int64_t* ids, uint8_t* loss, int64_t* segments) const {
  if (i >= size()) throw std::out_of_range("SampleRange: no sample " + std::to_string(i));
  source_->sample(begin_ + i, ids, loss, segments);
}

// Exact for unpadded sources; otherwise the range's share of the source's, in proportion.
uint64_t SampleRange::real_tokens() const {
  const uint64_t all = source_->real_tokens(), n = source_->size();
  if (all == (source_->seq_len() + 1) * n) return (seq_len() + 1) * size();
  return uint64_t(double(all) * double(size()) / double(n));
}

std::string SampleRange::description() const {
  return source_->description() + ", samples " + std::to_string(begin_) + ".." + std::to_string(end_ - 1);
}

BatchLoader::BatchLoader(std::shared_ptr<const TokenCorpus> corpus, uint64_t seq_len,
                         uint64_t global_batch, int rank, int world_size, uint64_t seed)
    : BatchLoader(std::make_shared<TokenWindows>(std::move(corpus), seq_len), global_batch, rank, world_size,
                  seed) {}

BatchLoader::BatchLoader(std::shared_ptr<const SampleSource> source, uint64_t global_batch, int rank,
                         int world_size, uint64_t seed)
    : source_(std::move(source)), seq_len_(source_->seq_len()), global_batch_(global_batch), seed_(seed),
      rank_(rank), world_(world_size) {
  if (seq_len_ == 0 || global_batch_ == 0) throw std::invalid_argument("data: seq_len and batch must be positive");
  if (world_ <= 0 || rank_ < 0 || rank_ >= world_) throw std::invalid_argument("data: bad rank/world size");
  if (global_batch_ % static_cast<uint64_t>(world_) != 0) {
    throw std::invalid_argument("data: global batch " + std::to_string(global_batch_) +
                                " is not divisible by the world size " + std::to_string(world_));
  }
  windows_ = source_->size();
  if (windows_ == 0) throw std::runtime_error("data " + source_->description() + " has no sample");
}

uint64_t BatchLoader::window_of(uint64_t s) const {
  const uint64_t epoch = s / windows_;
  if (epoch != cached_epoch_) {
    perm_.resize(windows_);
    std::iota(perm_.begin(), perm_.end(), 0);
    // A fixed generator and our own Fisher-Yates: std::shuffle's algorithm is not specified, so
    // it could differ between standard libraries.
    std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ull + epoch);
    for (uint64_t i = windows_ - 1; i > 0; --i) std::swap(perm_[i], perm_[rng() % (i + 1)]);
    cached_epoch_ = epoch;
  }
  return perm_[s % windows_];
}

void BatchLoader::sample(uint64_t s, int64_t* out, uint8_t* loss, int64_t* segments) const {
  source_->sample(window_of(s), out, loss, segments);
}

void BatchLoader::next(int64_t* out, uint8_t* loss, int64_t* segments) {
  const uint64_t local = local_batch();
  const uint64_t first = position_ + static_cast<uint64_t>(rank_) * local;
  for (uint64_t i = 0; i < local; ++i)
    sample(first + i, out + i * (seq_len_ + 1), loss ? loss + i * seq_len_ : nullptr,
           segments ? segments + i * seq_len_ : nullptr);
  position_ += global_batch_;
}

void BatchLoader::set_position(uint64_t global_samples) {
  if (global_samples % global_batch_ != 0) {
    throw std::invalid_argument("data: position " + std::to_string(global_samples) +
                                " is not a multiple of the global batch " + std::to_string(global_batch_));
  }
  position_ = global_samples;
}

EvalBatches::EvalBatches(std::shared_ptr<const SampleSource> source, uint64_t global_batch, int rank, int world_size)
    : source_(std::move(source)), global_batch_(global_batch), rank_(rank), world_(world_size) {
  if (global_batch_ == 0 || world_ <= 0 || global_batch_ % uint64_t(world_) != 0 || rank_ < 0 || rank_ >= world_)
    throw std::invalid_argument("data: evaluation batch " + std::to_string(global_batch_) + " over " +
                                std::to_string(world_) + " ranks");
}

void EvalBatches::batch(uint64_t b, int64_t* ids, uint8_t* loss, int64_t* segments) const {
  const uint64_t T = source_->seq_len(), local = local_batch();
  const uint64_t first = b * global_batch_ + uint64_t(rank_) * local;
  for (uint64_t i = 0; i < local; ++i) {
    if (first + i < source_->size()) {
      source_->sample(first + i, ids + i * (T + 1), loss + i * T, segments ? segments + i * T : nullptr);
    } else {
      std::fill(ids + i * (T + 1), ids + (i + 1) * (T + 1), int64_t(0));
      std::memset(loss + i * T, 0, T);
      if (segments) std::fill(segments + i * T, segments + (i + 1) * T, int64_t(0));
    }
  }
}

}  // namespace strata::models
