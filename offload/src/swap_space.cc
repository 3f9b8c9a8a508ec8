#include "strata/offload/swap_space.h"

#include <sys/file.h>

#include <cerrno>
#include <cstring>

#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <system_error>

#include "extent_list.h"

namespace strata::offload {

struct SwapSpace::DirState {
  File file;
  detail::ExtentList free;  // freed extents below `end`
  uint64_t end = 0;         // high-water mark
};

namespace {
uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
}  // namespace

SwapSpace::SwapSpace(IoEngine& io, SwapConfig config) : io_(io), config_(std::move(config)) {
  if (config_.dirs.empty()) throw std::invalid_argument("swap: no directories configured");
  if (config_.alignment == 0 || config_.alignment % 4096 != 0) {
    throw std::invalid_argument("swap: alignment must be a positive multiple of 4096, got " +
                                std::to_string(config_.alignment));
  }
  if (config_.stripe_bytes == 0 || config_.stripe_bytes % config_.alignment != 0) {
    throw std::invalid_argument("swap: stripe_bytes (" + std::to_string(config_.stripe_bytes) +
                                ") must be a positive multiple of alignment (" +
                                std::to_string(config_.alignment) + ")");
  }
  if (config_.rank < 0) throw std::invalid_argument("swap: negative rank");
  // Every directory is checked before any file is created: a bad one leaves nothing behind.
  for (uint32_t d = 0; d < config_.dirs.size(); ++d) {
    std::error_code ec;
    if (!std::filesystem::is_directory(config_.dirs[d], ec)) {
      throw IoError(ENOENT, "swap: directory " + config_.dirs[d].string() +
                                " does not exist or is not a directory");
    }
  }
  for (uint32_t d = 0; d < config_.dirs.size(); ++d) {
    dirs_.push_back(std::make_unique<DirState>());
    // Locked before it is truncated: a second engine (or job) given the same directory and rank
    // would otherwise silently overwrite this one's state.
    File f = File::open(file_path(d), OpenMode::kCreate);
    if (::flock(f.buffered_fd(), LOCK_EX | LOCK_NB) != 0)
      throw IoError(errno, "swap: " + file_path(d).string() + " is in use by another engine (same "
                    "directory and rank): " + std::strerror(errno) +
                    "; give each job its own offload.nvme_dirs");
    f.truncate(0);
    dirs_[d]->file = std::move(f);
  }
}

SwapSpace::~SwapSpace() {
  if (!config_.remove_files_on_close) return;
  for (uint32_t d = 0; d < dirs_.size(); ++d) {
    dirs_[d]->file = File();
    ::unlink(file_path(d).c_str());  // best effort: scratch files
  }
}

std::filesystem::path SwapSpace::file_path(uint32_t dir) const {
  char name[64];
  std::snprintf(name, sizeof name, "strata-swap-r%05d-d%u.bin", config_.rank, dir);
  return config_.dirs.at(dir) / name;
}

uint64_t SwapSpace::reserve_in(uint32_t d, uint64_t length) {
  DirState& ds = *dirs_[d];
  if (auto offset = ds.free.take(length)) return *offset;
  const uint64_t off = ds.end;
  ds.file.reserve(off, length);  // ENOSPC surfaces here, with the file and range in the message
  ds.end += length;
  return off;
}

void SwapSpace::release_in(uint32_t d, uint64_t off, uint64_t len) {
  DirState& ds = *dirs_[d];
  const auto [merged_off, merged_len] = ds.free.give(off, len);
  if (merged_off + merged_len == ds.end) {
    ds.free.erase(merged_off);  // the tail is free again; the file keeps its size for reuse
    ds.end = merged_off;
  }
}

void SwapSpace::allocate(const std::string& name, uint64_t bytes) {
  std::lock_guard lock(mu_);
  if (parts_.count(name)) throw std::invalid_argument("swap: partition '" + name + "' exists");
  const uint64_t D = dirs_.size(), S = config_.stripe_bytes;
  SwapPartition p;
  p.name = name;
  p.bytes = bytes;
  p.first_dir = next_first_dir_;
  const uint64_t n = (bytes + S - 1) / S;  // stripes
  try {
    for (uint64_t r = 0; r < std::min(n, D); ++r) {
      const uint32_t d = static_cast<uint32_t>((p.first_dir + r) % D);
      const uint64_t count = (n - 1 - r) / D + 1;      // stripes r, r + D, ... < n
      const bool has_last = (n - 1) % D == r;
      const uint64_t last = bytes - (n - 1) * S;       // bytes in the final stripe
      const uint64_t len = has_last ? (count - 1) * S + round_up(last, config_.alignment)
                                    : count * S;
      p.extents.push_back({d, reserve_in(d, len), len});
    }
  } catch (const IoError& e) {
    for (auto& x : p.extents) release_in(x.dir, x.offset, x.length);
    throw IoError(e.error(), "swap: cannot allocate partition '" + name + "' of " +
                                 std::to_string(bytes) + " bytes: " + e.what());
  }
  next_first_dir_ = static_cast<uint32_t>((next_first_dir_ + 1) % D);
  std::sort(p.extents.begin(), p.extents.end(),
            [](const SwapExtent& a, const SwapExtent& b) { return a.dir < b.dir; });
  parts_.emplace(name, std::move(p));
}

void SwapSpace::free(const std::string& name) {
  std::lock_guard lock(mu_);
  auto it = parts_.find(name);
  if (it == parts_.end()) throw std::invalid_argument("swap: free of unknown partition '" + name + "'");
  for (auto& e : it->second.extents) release_in(e.dir, e.offset, e.length);
  parts_.erase(it);
}

bool SwapSpace::contains(const std::string& name) const {
  std::lock_guard lock(mu_);
  return parts_.count(name) != 0;
}

uint64_t SwapSpace::size(const std::string& name) const {
  std::lock_guard lock(mu_);
  auto it = parts_.find(name);
  if (it == parts_.end()) throw std::invalid_argument("swap: unknown partition '" + name + "'");
  return it->second.bytes;
}

std::vector<SwapSpace::Piece> SwapSpace::locate(const std::string& name, uint64_t offset,
                                                uint64_t length) const {
  std::lock_guard lock(mu_);
  auto it = parts_.find(name);
  if (it == parts_.end()) {
    throw std::invalid_argument("swap: unknown partition '" + name + "'");
  }
  const SwapPartition& p = it->second;
  if (offset > p.bytes || length > p.bytes - offset) {
    throw std::invalid_argument("swap: range [" + std::to_string(offset) + ", " +
                                std::to_string(offset + length) + ") outside partition '" +
                                name + "' of " + std::to_string(p.bytes) + " bytes");
  }
  const uint64_t D = dirs_.size(), S = config_.stripe_bytes;
  std::vector<Piece> out;
  uint64_t done = 0;
  while (done < length) {
    const uint64_t pos = offset + done;
    const uint64_t j = pos / S, in_stripe = pos % S;
    const uint64_t len = std::min(length - done, S - in_stripe);
    const uint32_t d = static_cast<uint32_t>((p.first_dir + j) % D);
    // extents are sorted by directory and there is at most one per directory
    auto e = std::lower_bound(p.extents.begin(), p.extents.end(), d,
                              [](const SwapExtent& x, uint32_t dir) { return x.dir < dir; });
    out.push_back({&dirs_[d]->file, e->offset + (j / D) * S + in_stripe, len});
    done += len;
  }
  return out;
}

IoFuture SwapSpace::transfer(IoRequest::Kind kind, const std::string& name, uint64_t offset,
                             std::byte* data, uint64_t length) {
  std::vector<IoRequest> reqs;
  uint64_t done = 0;
  for (const Piece& piece : locate(name, offset, length)) {
    reqs.push_back({kind, piece.file, piece.file_offset, data + done, piece.length});
    done += piece.length;
  }
  std::vector<IoFuture> futures = io_.submit(reqs);
  // A failure names the partition and the rank, not just the swap file and its offset: the
  // caller knows which tensor state "block.3.exp_avg" is; nobody knows what offset 38436864 is.
  IoPromise named;
  when_all(futures).then([named, name, offset, length, rank = config_.rank,
                          op = kind == IoRequest::Kind::kRead ? "read" : "write"](const IoStatus& st) {
    if (st.ok()) return named.complete(st);
    named.complete(IoStatus(st.error(), std::string("swap ") + op + " of partition '" + name + "' bytes [" +
                                            std::to_string(offset) + ", " + std::to_string(offset + length) +
                                            ") of rank " + std::to_string(rank) + ": " + st.message()));
  });
  return named.future();
}

IoFuture SwapSpace::write(const std::string& name, uint64_t offset,
                          std::span<const std::byte> src) {
  return transfer(IoRequest::Kind::kWrite, name, offset, const_cast<std::byte*>(src.data()),
                  src.size());
}

IoFuture SwapSpace::read(const std::string& name, uint64_t offset, std::span<std::byte> dst) {
  return transfer(IoRequest::Kind::kRead, name, offset, dst.data(), dst.size());
}

void SwapSpace::sync() {
  for (auto& d : dirs_) d->file.sync();
}

std::vector<SwapPartition> SwapSpace::partitions() const {
  std::lock_guard lock(mu_);
  std::vector<SwapPartition> out;
  for (auto& [n, p] : parts_) out.push_back(p);
  return out;
}

std::string SwapSpace::index_json() const {
  nlohmann::json j;
  j["format"] = "strata-swap-index";
  j["version"] = 1;
  j["rank"] = config_.rank;
  j["stripe_bytes"] = config_.stripe_bytes;
  j["alignment"] = config_.alignment;
  for (uint32_t d = 0; d < dirs_.size(); ++d) j["files"].push_back(file_path(d).string());
  j["partitions"] = nlohmann::json::array();
  for (const SwapPartition& p : partitions()) {
    nlohmann::json pj{{"name", p.name}, {"bytes", p.bytes}, {"first_dir", p.first_dir}};
    pj["extents"] = nlohmann::json::array();
    for (auto& e : p.extents) {
      pj["extents"].push_back({{"dir", e.dir}, {"offset", e.offset}, {"length", e.length}});
    }
    j["partitions"].push_back(std::move(pj));
  }
  return j.dump(1);
}

SwapUsage SwapSpace::usage() const {
  std::lock_guard lock(mu_);
  SwapUsage u;
  u.partitions = parts_.size();
  for (auto& [n, p] : parts_) {
    u.bytes += p.bytes;
    for (auto& e : p.extents) u.reserved_bytes += e.length;
  }
  for (auto& d : dirs_) u.file_bytes.push_back(d->end);
  return u;
}

}  // namespace strata::offload
