#include "strata/models/token_data.h"

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

BatchLoader::BatchLoader(std::shared_ptr<const TokenCorpus> corpus, uint64_t seq_len,
                         uint64_t global_batch, int rank, int world_size, uint64_t seed)
    : corpus_(std::move(corpus)), seq_len_(seq_len), global_batch_(global_batch), seed_(seed),
      rank_(rank), world_(world_size) {
  if (seq_len_ == 0 || global_batch_ == 0) throw std::invalid_argument("data: seq_len and batch must be positive");
  if (world_ <= 0 || rank_ < 0 || rank_ >= world_) throw std::invalid_argument("data: bad rank/world size");
  if (global_batch_ % static_cast<uint64_t>(world_) != 0) {
    throw std::invalid_argument("data: global batch " + std::to_string(global_batch_) +
                                " is not divisible by the world size " + std::to_string(world_));
  }
  windows_ = corpus_->size() > seq_len_ ? (corpus_->size() - 1) / seq_len_ : 0;
  if (windows_ == 0) {
    throw std::runtime_error("token data " + corpus_->description() + " has " +
                             std::to_string(corpus_->size()) + " tokens, fewer than one window of " +
                             std::to_string(seq_len_ + 1));
  }
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

void BatchLoader::sample(uint64_t s, int64_t* out) const {
  corpus_->copy(window_of(s) * seq_len_, seq_len_ + 1, out);
}

void BatchLoader::next(int64_t* out) {
  const uint64_t local = local_batch();
  const uint64_t first = position_ + static_cast<uint64_t>(rank_) * local;
  for (uint64_t i = 0; i < local; ++i) sample(first + i, out + i * (seq_len_ + 1));
  position_ += global_batch_;
}

void BatchLoader::set_position(uint64_t global_samples) {
  if (global_samples % global_batch_ != 0) {
    throw std::invalid_argument("data: position " + std::to_string(global_samples) +
                                " is not a multiple of the global batch " + std::to_string(global_batch_));
  }
  position_ = global_samples;
}

}  // namespace strata::models
