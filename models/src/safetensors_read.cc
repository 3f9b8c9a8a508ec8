// Reading safetensors: SafetensorsFile (one file, memory-mapped, its header validated by
// safetensors.cc) and SafetensorsCheckpoint (a single file, or shards named by an index).
#include "strata/models/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <system_error>
#include <utility>

#include "safetensors_internal.h"

namespace strata::models {

using namespace safetensors_detail;

namespace {

// Reads a whole (small) file, e.g. an index.
std::string read_small_file(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_errno("open", path, errno);
  std::string out;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      fail_errno("read", path, err);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > kMaxHeaderBytes) {
      ::close(fd);
      fail(path.string(), "index is larger than " + std::to_string(kMaxHeaderBytes) + " bytes");
    }
  }
  ::close(fd);
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile::SafetensorsFile(const fs::path& path) : path_(path) {
  const std::string file = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_errno("open", path, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail_errno("fstat", path, err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(file, "not a regular file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail(file, "file is " + std::to_string(size) + " bytes, too short for the 8-byte header length");
  }
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);
  if (m == MAP_FAILED) fail_errno("mmap", path, map_err);
  map_ = static_cast<const std::byte*>(m);
  map_bytes_ = size;

  try {
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(map_[i]);  // little-endian
    if (n > kMaxHeaderBytes) {
      fail(file, "header length " + std::to_string(n) + " is larger than the limit of " +
                     std::to_string(kMaxHeaderBytes) + " bytes (not a safetensors file?)");
    }
    if (n > size - 8) {
      fail(file, "header length " + std::to_string(n) + " goes beyond the file of " +
                     std::to_string(size) + " bytes (truncated file?)");
    }
    data_offset_ = 8 + n;
    const std::string header(reinterpret_cast<const char*>(map_ + 8), n);
    tensors_ = parse_safetensors_header(header, size - data_offset_, file, &metadata_);
    for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  } catch (...) {
    ::munmap(const_cast<std::byte*>(map_), map_bytes_);
    map_ = nullptr;
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<std::byte*>(map_), map_bytes_);
}

bool SafetensorsFile::contains(const std::string& name) const { return index_.count(name) != 0; }

void SafetensorsFile::release(const std::byte* begin, size_t bytes) const {
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = std::max(uintptr_t(begin), uintptr_t(map_)), hi = std::min(uintptr_t(begin) + bytes,
                                                                                  uintptr_t(map_) + map_bytes_);
  const uintptr_t first = (lo + page - 1) / page * page, last = hi / page * page;
  // A private mapping never written: dropping its pages loses nothing (they are the file's).
  if (map_ != nullptr && last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

TensorView SafetensorsFile::get(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) {
    fail_tensor(path_.string(), name, "no such tensor (the file holds " +
                                          std::to_string(tensors_.size()) + ")");
  }
  const TensorInfo& info = tensors_[it->second];
  return TensorView{&info, std::span<const std::byte>(map_ + data_offset_ + info.begin,
                                                      static_cast<size_t>(info.bytes()))};
}

// ---------------------------------------------------------------------------------------------
// SafetensorsCheckpoint

namespace {

constexpr const char* kSingleName = "model.safetensors";
constexpr const char* kIndexName = "model.safetensors.index.json";

}  // namespace

SafetensorsCheckpoint::SafetensorsCheckpoint(const fs::path& path) {
  fs::path file = path;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    // Like transformers: a single file first, then an index.
    if (fs::exists(path / kSingleName, ec)) {
      file = path / kSingleName;
    } else if (fs::exists(path / kIndexName, ec)) {
      file = path / kIndexName;
    } else {
      fail(path.string(), std::string("directory holds neither ") + kSingleName + " nor " +
                              kIndexName);
    }
  }

  if (file.extension() != ".json") {
    files_.push_back(std::make_unique<SafetensorsFile>(file));
    for (const TensorInfo& t : files_.back()->tensors()) where_.emplace(t.name, files_.back().get());
    return;
  }

  // An index: {"metadata": {...}, "weight_map": {"tensor": "shard file", ...}}.
  const std::string index_file = file.string();
  const json index = parse_json(read_small_file(file), index_file, nullptr);
  if (!index.is_object()) fail(index_file, "index is not a JSON object");
  const auto wm = index.find("weight_map");
  if (wm == index.end() || !wm->is_object()) fail(index_file, "index has no weight_map object");

  std::map<std::string, std::vector<std::string>> by_shard;  // shard -> tensors the index puts there
  for (const auto& [name, shard] : wm->items()) {
    if (!shard.is_string()) fail_tensor(index_file, name, "weight_map value is not a string");
    const std::string s = shard.get<std::string>();
    const fs::path sp(s);
    if (s.empty() || sp.is_absolute() ||
        std::any_of(sp.begin(), sp.end(), [](const fs::path& c) { return c == ".."; })) {
      fail_tensor(index_file, name, "shard '" + s + "' is not a file name inside " +
                                        file.parent_path().string());
    }
    by_shard[s].push_back(name);
  }

  const fs::path dir = file.parent_path();
  for (const auto& [shard, names] : by_shard) {
    files_.push_back(std::make_unique<SafetensorsFile>(dir / shard));
    const SafetensorsFile* f = files_.back().get();
    for (const std::string& name : names) {
      if (!f->contains(name)) {
        fail_tensor(index_file, name,
                    "weight_map puts it in shard '" + shard + "', which does not hold it");
      }
      where_.emplace(name, f);
    }
    const std::set<std::string> listed(names.begin(), names.end());
    for (const TensorInfo& t : f->tensors()) {
      if (listed.count(t.name) == 0) {
        fail_tensor(index_file, t.name,
                    "shard '" + shard + "' holds it but the weight_map does not put it there");
      }
    }
  }
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, file] : where_) out.push_back(name);
  return out;
}

bool SafetensorsCheckpoint::contains(const std::string& name) const {
  return where_.count(name) != 0;
}

TensorView SafetensorsCheckpoint::get(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) {
    const std::string where =
        files_.empty() ? std::string("checkpoint")
        : files_.size() == 1 ? files_[0]->path().string()
                             : "checkpoint in " + files_[0]->path().parent_path().string();
    fail_tensor(where, name, "no such tensor (the checkpoint holds " +
                                 std::to_string(where_.size()) + " tensors)");
  }
  return it->second->get(name);
}

}  // namespace strata::models
