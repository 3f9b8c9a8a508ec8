#include "strata/models/sharded_safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

namespace strata::models {

std::string shard_file_name(size_t index, size_t count) {
  if (count == 1) return "model.safetensors";
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return name;
}

ShardedSafetensorsWriter::ShardedSafetensorsWriter(const std::filesystem::path& dir,
                                                   std::vector<SafetensorsWriter::Spec> specs,
                                                   uint64_t max_shard_bytes,
                                                   const std::map<std::string, std::string>& metadata)
    : dir_(dir), metadata_(metadata) {
  if (max_shard_bytes == 0) throw SafetensorsError("ShardedSafetensorsWriter: the shard limit must be > 0");
  if (specs.empty()) throw SafetensorsError("ShardedSafetensorsWriter: no tensors to write to " + dir.string());
  for (auto& spec : specs) {
    uint64_t bytes = st_dtype_bytes(spec.dtype);
    for (int64_t d : spec.shape) bytes *= uint64_t(d);
    if (shard_specs_.empty() || (shard_bytes_.back() > 0 && shard_bytes_.back() + bytes > max_shard_bytes)) {
      shard_specs_.emplace_back();
      shard_bytes_.push_back(0);
    }
    order_.push_back(spec.name);
    shard_specs_.back().push_back(std::move(spec));
    shard_bytes_.back() += bytes;
    total_bytes_ += bytes;
  }
  for (size_t i = 0; i < shard_specs_.size(); ++i) files_.push_back(shard_file_name(i, shard_specs_.size()));
  if (shard_specs_.size() > 1) files_.push_back("model.safetensors.index.json");
  open_shard(0);
}

ShardedSafetensorsWriter::~ShardedSafetensorsWriter() = default;

void ShardedSafetensorsWriter::open_shard(size_t i) {
  shard_ = i;
  left_in_shard_ = shard_bytes_[i];
  writer_ = std::make_unique<SafetensorsWriter>(dir_ / files_[i], shard_specs_[i], metadata_);
}

void ShardedSafetensorsWriter::append(std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    if (left_in_shard_ == 0) {
      if (shard_ + 1 >= shard_specs_.size())
        throw SafetensorsError(dir_.string() + ": more bytes than the declared tensors hold");
      writer_->finish();
      open_shard(shard_ + 1);
    }
    const size_t n = size_t(std::min<uint64_t>(bytes.size(), left_in_shard_));
    writer_->append(bytes.first(n));
    left_in_shard_ -= n;
    bytes = bytes.subspan(n);
  }
}

void ShardedSafetensorsWriter::write(const std::string& name, std::span<const std::byte> bytes) {
  if (next_tensor_ >= order_.size() || order_[next_tensor_] != name)
    throw SafetensorsError(dir_.string() + ": tensor " + name + " is not the next one to write (" +
                           (next_tensor_ < order_.size() ? order_[next_tensor_] : std::string("none left")) + ")");
  ++next_tensor_;
  append(bytes);  // a zero-byte tensor is complete once the bytes before it are
}

void ShardedSafetensorsWriter::finish() {
  if (finished_) return;
  writer_->finish();
  if (shard_ + 1 != shard_specs_.size())
    throw SafetensorsError(dir_.string() + ": tensor " + shard_specs_[shard_ + 1].front().name + " was not written");
  if (shard_specs_.size() > 1) {
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

}  // namespace strata::models
