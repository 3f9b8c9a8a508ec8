// Safetensors reading (validated, memory-mapped) and streamed writing. See safetensors.h.
#include "strata/models/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <sstream>
#include <system_error>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace strata::models {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// The safetensors library refuses headers above 100 MB; so do we (and we never allocate for a
// header before checking its length against the file).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// A valid header nests three deep ({name: {shape: [..]}}); anything much deeper is garbage, and
// refusing it early bounds the parser's memory on hostile input.
constexpr int kMaxJsonDepth = 16;

[[noreturn]] void fail(const std::string& file, const std::string& what) {
  throw SafetensorsError(file + ": " + what);
}

[[noreturn]] void fail_tensor(const std::string& file, const std::string& tensor,
                              const std::string& what) {
  throw SafetensorsError(file + ": tensor '" + tensor + "': " + what);
}

[[noreturn]] void fail_errno(const std::string& op, const fs::path& path, int err) {
  throw std::system_error(err, std::generic_category(), op + " " + path.string());
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// numel * dtype size, or false if either overflows uint64. A zero dimension makes everything 0
// regardless of the other dimensions.
bool byte_size(const std::vector<int64_t>& shape, StDType dtype, uint64_t* numel,
               uint64_t* bytes) {
  uint64_t n = 1;
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) {
    n = 0;
  } else {
    for (int64_t d : shape) {
      const uint64_t u = static_cast<uint64_t>(d);
      if (n > std::numeric_limits<uint64_t>::max() / u) return false;
      n *= u;
    }
  }
  const uint64_t size = st_dtype_bytes(dtype);
  if (n > std::numeric_limits<uint64_t>::max() / size) return false;
  *numel = n;
  *bytes = n * size;
  return true;
}

// A JSON number that is a non-negative integer (not 3.0, not "3"), or false.
bool json_uint(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

TensorInfo parse_tensor(const std::string& file, const std::string& name, const json& entry,
                        uint64_t data_bytes) {
  if (!entry.is_object()) fail_tensor(file, name, "entry is " + std::string(entry.type_name()) +
                                                      ", not an object");
  TensorInfo info;
  info.name = name;

  const auto dt = entry.find("dtype");
  if (dt == entry.end() || !dt->is_string()) fail_tensor(file, name, "dtype missing or not a string");
  try {
    info.dtype = parse_st_dtype(dt->get<std::string>());
  } catch (const SafetensorsError& e) {
    fail_tensor(file, name, e.what());
  }

  const auto sh = entry.find("shape");
  if (sh == entry.end() || !sh->is_array()) fail_tensor(file, name, "shape missing or not an array");
  for (const json& d : *sh) {
    uint64_t u = 0;
    if (!json_uint(d, &u) || u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail_tensor(file, name, "shape " + sh->dump() + " is not a list of non-negative integers");
    }
    info.shape.push_back(static_cast<int64_t>(u));
  }

  const auto off = entry.find("data_offsets");
  uint64_t begin = 0, end = 0;
  if (off == entry.end() || !off->is_array() || off->size() != 2 || !json_uint((*off)[0], &begin) ||
      !json_uint((*off)[1], &end)) {
    fail_tensor(file, name,
                "data_offsets " + (off == entry.end() ? std::string("missing") : off->dump()) +
                    " is not a pair [begin, end] of non-negative integers");
  }
  const std::string range = "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
  if (begin > end) fail_tensor(file, name, range + " end before they begin");
  if (end > data_bytes) {
    fail_tensor(file, name, range + " go beyond the data section of " + std::to_string(data_bytes) +
                                " bytes (truncated file?)");
  }
  info.begin = begin;
  info.end = end;

  uint64_t numel = 0, bytes = 0;
  if (!byte_size(info.shape, info.dtype, &numel, &bytes)) {
    fail_tensor(file, name, "shape " + shape_string(info.shape) + " of " + to_string(info.dtype) +
                                " overflows 64 bits");
  }
  if (bytes != info.bytes()) {
    fail_tensor(file, name, range + " hold " + std::to_string(info.bytes()) + " bytes but shape " +
                                shape_string(info.shape) + " of " + to_string(info.dtype) +
                                " needs " + std::to_string(bytes));
  }
  return info;
}

// Sorts tensors into file order (by data offset; JSON order among equal offsets) and checks that
// no two share a byte. Gaps between tensors are allowed.
void sort_and_check_overlaps(std::vector<TensorInfo>* tensors, const std::string& file) {
  std::stable_sort(tensors->begin(), tensors->end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const TensorInfo* prev = nullptr;  // the last tensor holding at least one byte
  for (const TensorInfo& t : *tensors) {
    if (t.bytes() == 0) continue;  // holds no byte, overlaps nothing
    if (prev != nullptr && t.begin < prev->end) {
      fail_tensor(file, t.name,
                  "data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                      ") overlap tensor '" + prev->name + "' at [" + std::to_string(prev->begin) +
                      ", " + std::to_string(prev->end) + ")");
    }
    prev = &t;
  }
}

// Parses JSON, rejecting duplicate top-level keys and deep nesting; records top-level key order.
json parse_json(const std::string& text, const std::string& file,
                std::vector<std::string>* key_order) {
  std::unordered_set<std::string> seen;
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    if ((event == json::parse_event_t::object_start ||
         event == json::parse_event_t::array_start) &&
        depth >= kMaxJsonDepth) {
      fail(file, "header JSON nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    }
    if (event == json::parse_event_t::key && depth == 1 && key_order != nullptr) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second) fail(file, "header names '" + key + "' twice");
      key_order->push_back(key);
    }
    return true;
  };
  // nlohmann's lexer takes a NUL byte for the end of the input and would ignore what follows;
  // valid JSON never holds one (control characters in strings must be escaped).
  const size_t nul = text.find('\0');
  if (nul != std::string::npos) {
    fail(file, "header is not valid JSON: NUL byte at offset " + std::to_string(nul));
  }
  try {
    return json::parse(text, callback);
  } catch (const json::exception& e) {
    fail(file, std::string("header is not valid JSON: ") + e.what());
  }
}

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

const char* to_string(StDType dtype) {
  switch (dtype) {
    case StDType::kF64: return "F64";
    case StDType::kF32: return "F32";
    case StDType::kF16: return "F16";
    case StDType::kBF16: return "BF16";
    case StDType::kI64: return "I64";
    case StDType::kI32: return "I32";
    case StDType::kI16: return "I16";
    case StDType::kI8: return "I8";
    case StDType::kU8: return "U8";
    case StDType::kBool: return "BOOL";
  }
  return "?";
}

StDType parse_st_dtype(const std::string& name) {
  static const std::pair<const char*, StDType> kNames[] = {
      {"F64", StDType::kF64}, {"F32", StDType::kF32}, {"F16", StDType::kF16},
      {"BF16", StDType::kBF16}, {"I64", StDType::kI64}, {"I32", StDType::kI32},
      {"I16", StDType::kI16}, {"I8", StDType::kI8}, {"U8", StDType::kU8},
      {"BOOL", StDType::kBool}};
  for (const auto& [n, t] : kNames) {
    if (name == n) return t;
  }
  throw SafetensorsError("unknown dtype '" + name +
                         "' (supported: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)");
}

size_t st_dtype_bytes(StDType dtype) {
  switch (dtype) {
    case StDType::kF64:
    case StDType::kI64: return 8;
    case StDType::kF32:
    case StDType::kI32: return 4;
    case StDType::kF16:
    case StDType::kBF16:
    case StDType::kI16: return 2;
    case StDType::kI8:
    case StDType::kU8:
    case StDType::kBool: return 1;
  }
  return 1;
}

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);  // validated: no overflow unless 0
  return n;
}

std::vector<TensorInfo> parse_safetensors_header(const std::string& text, uint64_t data_bytes,
                                                 const std::string& file,
                                                 std::map<std::string, std::string>* metadata) {
  std::vector<std::string> order;
  const json root = parse_json(text, file, &order);
  if (!root.is_object()) {
    fail(file, std::string("header is a JSON ") + root.type_name() + ", not an object");
  }
  std::vector<TensorInfo> tensors;
  tensors.reserve(order.size());
  std::map<std::string, std::string> meta;
  for (const std::string& key : order) {
    const json& value = root.at(key);
    if (key == "__metadata__") {
      if (!value.is_object()) fail(file, "__metadata__ is not an object");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) fail(file, "__metadata__ value of '" + k + "' is not a string");
        meta.emplace(k, v.get<std::string>());
      }
      continue;
    }
    tensors.push_back(parse_tensor(file, key, value, data_bytes));
  }
  sort_and_check_overlaps(&tensors, file);
  if (metadata != nullptr) *metadata = std::move(meta);
  return tensors;
}

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

// ---------------------------------------------------------------------------------------------
// SafetensorsWriter

struct SafetensorsWriter::Impl {
  fs::path path;
  fs::path tmp;
  int fd = -1;
  std::vector<Spec> specs;
  std::vector<uint64_t> sizes;
  std::unordered_map<std::string, size_t> index;
  uint64_t total = 0;    // data bytes declared
  uint64_t written = 0;  // data bytes appended
  size_t cur = 0;        // first tensor not fully written
  uint64_t in_cur = 0;   // bytes of it written
  bool finished = false;
  bool broken = false;  // an I/O error left the file in an unknown state
  std::vector<char> buf;

  static constexpr size_t kBufBytes = 1 << 20;

  std::string who() const { return "SafetensorsWriter " + path.string(); }

  void check_usable() const {
    if (finished) throw SafetensorsError(who() + ": already finished");
    if (broken) throw SafetensorsError(who() + ": an earlier write failed");
  }

  void write_all(const char* p, size_t n) {
    while (n > 0) {
      const ssize_t w = ::write(fd, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        broken = true;
        fail_errno("write", tmp, errno);
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
  }

  void flush() {
    write_all(buf.data(), buf.size());
    buf.clear();
  }

  void put(const char* p, size_t n) {
    if (buf.size() + n > kBufBytes) flush();
    if (n >= kBufBytes) {
      write_all(p, n);
    } else {
      buf.insert(buf.end(), p, p + n);
    }
  }

  void skip_complete() {
    while (cur < sizes.size() && in_cur == sizes[cur]) {
      ++cur;
      in_cur = 0;
    }
  }
};

SafetensorsWriter::SafetensorsWriter(const fs::path& path, std::vector<Spec> specs,
                                     const std::map<std::string, std::string>& metadata)
    : impl_(std::make_unique<Impl>()) {
  Impl& w = *impl_;
  w.path = path;
  w.tmp = path;
  w.tmp += ".tmp";
  w.specs = std::move(specs);
  const std::string file = path.string();

  // The header: metadata first, then the tensors in the declared order, offsets contiguous.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (size_t i = 0; i < w.specs.size(); ++i) {
    const Spec& s = w.specs[i];
    if (s.name == "__metadata__") fail_tensor(file, s.name, "reserved name");
    if (!w.index.emplace(s.name, i).second) fail_tensor(file, s.name, "declared twice");
    for (int64_t d : s.shape) {
      if (d < 0) fail_tensor(file, s.name, "negative dimension in shape " + shape_string(s.shape));
    }
    uint64_t numel = 0, bytes = 0;
    if (!byte_size(s.shape, s.dtype, &numel, &bytes) ||
        w.total > std::numeric_limits<uint64_t>::max() - bytes) {
      fail_tensor(file, s.name, "shape " + shape_string(s.shape) + " overflows 64 bits");
    }
    header[s.name] = {{"dtype", to_string(s.dtype)},
                      {"shape", s.shape},
                      {"data_offsets", {w.total, w.total + bytes}}};
    w.sizes.push_back(bytes);
    w.total += bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // e.g. a name that is not UTF-8
    fail(file, std::string("cannot write the header: ") + e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // data section 8-byte aligned (8 + len)
  if (text.size() > kMaxHeaderBytes) {
    fail(file, "header of " + std::to_string(text.size()) + " bytes is larger than the limit of " +
                   std::to_string(kMaxHeaderBytes));
  }

  w.fd = ::open(w.tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w.fd < 0) fail_errno("open", w.tmp, errno);
  w.buf.reserve(Impl::kBufBytes);
  try {
    char len[8];
    uint64_t n = text.size();
    for (char& c : len) {
      c = static_cast<char>(n & 0xff);
      n >>= 8;
    }
    w.put(len, 8);
    w.put(text.data(), text.size());
  } catch (...) {
    ::close(w.fd);
    ::unlink(w.tmp.c_str());
    throw;
  }
  w.skip_complete();
}

SafetensorsWriter::~SafetensorsWriter() {
  if (!impl_ || impl_->finished) return;
  if (impl_->fd >= 0) ::close(impl_->fd);
  ::unlink(impl_->tmp.c_str());
}

void SafetensorsWriter::append(std::span<const std::byte> bytes) {
  Impl& w = *impl_;
  w.check_usable();
  if (bytes.size() > w.total - w.written) {
    const std::string at = w.cur < w.specs.size()
                               ? "at tensor '" + w.specs[w.cur].name + "'"
                               : std::string("after the last tensor");
    throw SafetensorsError(w.who() + ": append of " + std::to_string(bytes.size()) +
                           " bytes " + at + " goes " +
                           std::to_string(bytes.size() - (w.total - w.written)) +
                           " bytes beyond the declared tensors");
  }
  w.put(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  w.written += bytes.size();
  uint64_t left = bytes.size();
  while (left > 0) {
    const uint64_t take = std::min(left, w.sizes[w.cur] - w.in_cur);
    w.in_cur += take;
    left -= take;
    w.skip_complete();
  }
}

void SafetensorsWriter::write(const std::string& name, std::span<const std::byte> bytes) {
  Impl& w = *impl_;
  w.check_usable();
  const auto it = w.index.find(name);
  if (it == w.index.end()) fail_tensor(w.who(), name, "not declared");
  const size_t i = it->second;
  if (bytes.size() != w.sizes[i]) {
    fail_tensor(w.who(), name, "write of " + std::to_string(bytes.size()) +
                                   " bytes but the tensor holds " + std::to_string(w.sizes[i]));
  }
  // A zero-byte tensor is "written" once everything before it is.
  const bool ok = w.in_cur == 0 && (i == w.cur || (w.sizes[i] == 0 && i < w.cur));
  if (!ok) {
    const std::string next =
        w.cur < w.specs.size()
            ? "'" + w.specs[w.cur].name + "' (" + std::to_string(w.in_cur) + " of " +
                  std::to_string(w.sizes[w.cur]) + " bytes written)"
            : std::string("none (all written)");
    fail_tensor(w.who(), name, "written out of order: the next tensor is " + next);
  }
  append(bytes);
}

void SafetensorsWriter::finish() {
  Impl& w = *impl_;
  if (w.finished) return;
  w.check_usable();
  if (w.cur < w.specs.size()) {
    fail_tensor(w.who(), w.specs[w.cur].name,
                "not fully written at finish(): " + std::to_string(w.in_cur) + " of " +
                    std::to_string(w.sizes[w.cur]) + " bytes");
  }
  w.flush();
  if (::fsync(w.fd) != 0) {
    w.broken = true;
    fail_errno("fsync", w.tmp, errno);
  }
  const int rc = ::close(w.fd);
  w.fd = -1;
  if (rc != 0) {
    w.broken = true;
    fail_errno("close", w.tmp, errno);
  }
  if (::rename(w.tmp.c_str(), w.path.c_str()) != 0) {
    w.broken = true;
    fail_errno("rename " + w.tmp.string() + " to", w.path, errno);
  }
  w.finished = true;
  // Make the rename itself durable.
  const fs::path dir = w.path.has_parent_path() ? w.path.parent_path() : fs::path(".");
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) fail_errno("open", dir, errno);
  const int drc = ::fsync(dfd);
  const int derr = errno;
  ::close(dfd);
  if (drc != 0) fail_errno("fsync", dir, derr);
}

}  // namespace strata::models
