// Writing safetensors: SafetensorsWriter streams tensors in their declared order into a
// temporary file beside the output and renames it into place once complete.
#include "strata/models/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <system_error>
#include <unordered_map>
#include <utility>

#include "safetensors_internal.h"

namespace strata::models {

using namespace safetensors_detail;

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
