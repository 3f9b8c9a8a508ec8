#include "strata/models/sharded_safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace strata::models {

std::string shard_file_name(size_t index, size_t count) {
  if (count == 1) return "model.safetensors";
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return name;
}

std::vector<std::string> shard_set_files(size_t count) {
  std::vector<std::string> files;
  for (size_t i = 0; i < count; ++i) files.push_back(shard_file_name(i, count));
  if (count > 1) files.push_back("model.safetensors.index.json");
  return files;
}

namespace {
uint64_t spec_bytes(const SafetensorsWriter::Spec& spec) {
  uint64_t bytes = st_dtype_bytes(spec.dtype);
  for (int64_t d : spec.shape) bytes *= uint64_t(d);
  return bytes;
}
}  // namespace

std::vector<std::vector<size_t>> plan_shards(const std::vector<SafetensorsWriter::Spec>& specs, uint64_t max_shard_bytes) {
  if (max_shard_bytes == 0) throw SafetensorsError("safetensors shards: the shard limit must be > 0");
  // huggingface_hub's split_state_dict_into_shards: a tensor above the limit is a shard of its
  // own, appended when it comes; the others fill the shard in progress, which is appended when
  // the next one would pass the limit, and at the end.
  std::vector<size_t> current;
  uint64_t current_bytes = 0;
  std::vector<std::vector<size_t>> shards;
  for (size_t t = 0; t < specs.size(); ++t) {
    const uint64_t bytes = spec_bytes(specs[t]);
    if (bytes > max_shard_bytes) {
      shards.push_back({t});
      continue;
    }
    if (current_bytes + bytes > max_shard_bytes) {
      shards.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(t);
    current_bytes += bytes;
  }
  if (!current.empty()) shards.push_back(std::move(current));
  return shards;
}

ShardedSafetensorsWriter::ShardedSafetensorsWriter(const std::filesystem::path& dir,
                                                   std::vector<SafetensorsWriter::Spec> specs,
                                                   uint64_t max_shard_bytes,
                                                   const std::map<std::string, std::string>& metadata, Part part)
    : dir_(dir), metadata_(metadata), part_(std::move(part)) {
  if (specs.empty()) throw SafetensorsError("ShardedSafetensorsWriter: no tensors to write to " + dir.string());
  const std::vector<std::vector<size_t>> shards = plan_shards(specs, max_shard_bytes);
  if (!part_.shards.empty() && part_.shards.size() != shards.size())
    throw SafetensorsError("ShardedSafetensorsWriter: a part names " + std::to_string(part_.shards.size()) +
                           " shards of " + std::to_string(shards.size()));
  for (const auto& spec : specs) {
    tensor_bytes_.push_back(spec_bytes(spec));
    total_bytes_ += tensor_bytes_.back();
  }
  shard_of_.resize(specs.size());
  for (size_t i = 0; i < shards.size(); ++i) {
    shard_specs_.emplace_back();
    for (size_t t : shards[i]) {
      shard_of_[t] = i;
      shard_specs_[i].push_back(specs[t]);
    }
    last_of_shard_.push_back(shards[i].back());
  }
  files_ = shard_set_files(shards.size());
  for (const auto& spec : specs) order_.push_back(spec.name);
  writers_.resize(shards.size());
  begin_tensor(0);
}

ShardedSafetensorsWriter::~ShardedSafetensorsWriter() = default;

// Tensor t is next: its shard's writer opened if this is the shard's first tensor; zero-byte
// tensors are complete at once.
void ShardedSafetensorsWriter::begin_tensor(size_t t) {
  for (tensor_ = t; tensor_ < order_.size(); ++tensor_) {
    const size_t sh = shard_of_[tensor_];
    if (!writes_shard(sh)) continue;  // another writer's
    if (!writers_[sh]) writers_[sh] = std::make_unique<SafetensorsWriter>(dir_ / files_[sh], shard_specs_[sh], metadata_);
    left_in_tensor_ = tensor_bytes_[tensor_];
    if (left_in_tensor_ > 0) return;
    end_tensor();
  }
}

void ShardedSafetensorsWriter::end_tensor() {
  const size_t sh = shard_of_[tensor_];
  if (last_of_shard_[sh] == tensor_) {
    writers_[sh]->finish();
    writers_[sh].reset();
    if (on_shard_) on_shard_(files_[sh]);
  }
}

void ShardedSafetensorsWriter::append(std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    if (tensor_ >= order_.size()) throw SafetensorsError(dir_.string() + ": more bytes than the declared tensors hold");
    const size_t n = size_t(std::min<uint64_t>(bytes.size(), left_in_tensor_));
    writers_[shard_of_[tensor_]]->append(bytes.first(n));
    left_in_tensor_ -= n;
    bytes = bytes.subspan(n);
    if (left_in_tensor_ == 0) {
      end_tensor();
      begin_tensor(tensor_ + 1);
    }
  }
}

void ShardedSafetensorsWriter::write(const std::string& name, std::span<const std::byte> bytes) {
  if (tensor_ >= order_.size() || order_[tensor_] != name || left_in_tensor_ != tensor_bytes_[tensor_])
    throw SafetensorsError(dir_.string() + ": tensor " + name + " is not the next one to write (" +
                           (tensor_ < order_.size() ? order_[tensor_] : std::string("none left")) + ")");
  if (bytes.size() != tensor_bytes_[tensor_])
    throw SafetensorsError(dir_.string() + ": tensor " + name + " holds " + std::to_string(tensor_bytes_[tensor_]) +
                           " bytes, not " + std::to_string(bytes.size()));
  append(bytes);
}

void ShardedSafetensorsWriter::finish() {
  if (finished_) return;
  if (tensor_ < order_.size()) throw SafetensorsError(dir_.string() + ": tensor " + order_[tensor_] + " was not written");
  if (shard_specs_.size() > 1 && part_.index) {
    nlohmann::json index = {{"metadata", {{"total_size", total_bytes_}}}, {"weight_map", nlohmann::json::object()}};
    for (size_t i = 0; i < shard_specs_.size(); ++i)
      for (const auto& spec : shard_specs_[i]) index["weight_map"][spec.name] = files_[i];
    const std::filesystem::path path = dir_ / "model.safetensors.index.json", tmp = dir_ / "model.safetensors.index.json.tmp";
    {
      std::ofstream out(tmp);
      out << index.dump(2) << "\n";
      if (!out.flush()) throw SafetensorsError("cannot write " + tmp.string());
    }
    const int fd = ::open(tmp.c_str(), O_RDONLY);
    if (fd < 0 || ::fsync(fd) != 0) {
      if (fd >= 0) ::close(fd);
      throw SafetensorsError("cannot sync " + tmp.string());
    }
    ::close(fd);
    std::filesystem::rename(tmp, path);
  }
  finished_ = true;
}

namespace {

constexpr uint64_t kFingerprintSamples = 16, kFingerprintSampleBytes = 4096;

struct Fnv1a64 {
  uint64_t h = 1469598103934665603ull;
  void add(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  void add(const std::string& s) {
    const uint64_t n = s.size();
    add(&n, sizeof n);  // lengths first: no two sequences of strings hash the same bytes
    add(s.data(), s.size());
  }
};

std::string read_bytes(const std::filesystem::path& p, uint64_t offset, uint64_t n) {
  std::ifstream in(p, std::ios::binary);
  std::string out(n, '\0');
  if (!in || !in.seekg(std::streamoff(offset)) || !in.read(out.data(), std::streamsize(n)))
    throw std::runtime_error("model fingerprint: cannot read " + std::to_string(n) + " bytes at " +
                             std::to_string(offset) + " of " + p.string());
  return out;
}

}  // namespace

std::string model_fingerprint(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  Fnv1a64 f;
  const fs::path config = dir / "config.json";
  f.add(read_bytes(config, 0, fs::file_size(config)));
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  uint64_t total = 0;
  for (const fs::path& p : files) {
    const uint64_t size = fs::file_size(p);
    const std::string len = read_bytes(p, 0, 8);
    uint64_t header = 0;
    for (int i = 7; i >= 0; --i) header = header << 8 | uint8_t(len[size_t(i)]);  // little-endian
    if (header > size - 8) throw std::runtime_error("model fingerprint: " + p.string() + " is not a safetensors file");
    f.add(p.filename().string());
    f.add(&size, sizeof size);
    f.add(read_bytes(p, 8, header));
    // Samples of the values: two models of one layout differ there (a few KiB read a file, not
    // the whole of it).
    const uint64_t data = 8 + header, span = size - data;
    for (uint64_t i = 0; i < kFingerprintSamples && span > 0; ++i) {
      const uint64_t n = std::min<uint64_t>(kFingerprintSampleBytes, span);
      f.add(read_bytes(p, data + (span - n) * i / (kFingerprintSamples - 1), n));
    }
    total += size;
  }
  char hex[17];
  snprintf(hex, sizeof hex, "%016llx", (unsigned long long)f.h);
  return std::string("fnv1a64:") + hex + " (" + std::to_string(files.size()) + " files, " + std::to_string(total) +
         " bytes)";
}

}  // namespace strata::models
