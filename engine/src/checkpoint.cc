// Commit protocol (docs/FORMATS.md, "Checkpoints"):
//  0. Saving over an existing name first un-commits it: rank 0 removes its manifest (and fsyncs
//     the directory), then a barrier; so a crash while rewriting never leaves a manifest over
//     half-written data.
//  1. Each rank creates <root>/<name>/ itself (mkdir -p: it depends on no directory another
//     rank made), writes rank-R.data with the I/O engine, and fsyncs it.
//  2. Each rank writes rank-R.index.json atomically (temporary file, fsync, rename, fsync of
//     the directory).
//  3. The index entries travel to rank 0 over the communicator (an all-gather, which is also the
//     barrier): no rank reads a file another rank wrote.
//  4. Rank 0 writes manifest.json atomically. This is the commit point: a directory without a
//     manifest is never loaded, whatever else it holds.
//  5. Rank 0 replaces <root>/latest atomically; then every rank passes a barrier.
// A crash before 4 leaves an uncommitted directory that load refuses and `latest` still names
// the previous checkpoint; a crash between 4 and 5 leaves a committed checkpoint that `latest`
// does not name yet.
#include "strata/engine/checkpoint.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <deque>
#include <future>
#include <thread>
#include <tuple>
#include <map>
#include <sstream>

#include "strata/offload/crc32c.h"
#include "strata/offload/file.h"
#include "strata/offload/io_engine.h"
#include "strata/models/hf_io.h"
#include "strata/models/model_config.h"
#include "strata/models/safetensors.h"

namespace strata::engine {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr int kFormatVersion = 1;
constexpr uint64_t kChunkElements = 1ull << 20;  // 4 MiB of fp32
constexpr uint64_t kAlign = 4096;
const char* kKindNames[] = {"master", "exp_avg", "exp_avg_sq"};

std::string rank_name(int r) {
  char b[32];
  snprintf(b, sizeof b, "rank-%05d", r);
  return b;
}

[[noreturn]] void fail_errno(const std::string& what, const fs::path& p) {
  throw std::runtime_error(what + " " + p.string() + ": " + std::strerror(errno));
}

void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) fail_errno("cannot open directory", dir);
  if (::fsync(fd) != 0) {
    ::close(fd);
    fail_errno("cannot fsync directory", dir);
  }
  ::close(fd);
}

// Temporary file, fsync, rename, fsync of the directory.
void write_atomically(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail_errno("cannot create", tmp);
  size_t done = 0;
  while (done < text.size()) {
    ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      errno = e;
      fail_errno("cannot write", tmp);
    }
    done += size_t(w);
  }
  if (::fsync(fd) != 0) {
    const int e = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    errno = e;
    fail_errno("cannot fsync", tmp);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail_errno("cannot rename to", path);
  fsync_dir(path.parent_path());
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  if (!in) throw std::runtime_error("cannot read " + p.string());
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json partition_json(const Partition& part) {
  json units = json::array();
  for (const UnitLayout& u : part.units()) {
    json ts = json::array();
    for (const TensorSlot& t : u.tensors) ts.push_back({{"name", t.name}, {"shape", t.shape}});
    units.push_back({{"name", u.name}, {"numel", u.numel}, {"tensors", ts}});
  }
  return units;
}

// A page-aligned fp32 host tensor, so that the I/O engine can move it with O_DIRECT.
at::Tensor aligned_floats(int64_t n) {
  const size_t bytes = (size_t(std::max<int64_t>(n, 1)) * 4 + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, bytes);
  if (!p) throw std::bad_alloc();
  return at::from_blob(p, {n}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kFloat));
}

// Every rank's string, in rank order, through the communicator (also a barrier).
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  at::Tensor len = at::empty({1}, at::kLong);
  len[0] = int64_t(mine.size());
  at::Tensor lens = at::empty({comm.world_size()}, at::kLong);
  comm.all_gather(lens, len)->wait();
  int64_t max_len = 1;
  for (int r = 0; r < comm.world_size(); ++r) max_len = std::max(max_len, lens[r].item<int64_t>());
  at::Tensor buf = at::zeros({max_len}, at::kInt);
  for (size_t i = 0; i < mine.size(); ++i) buf.data_ptr<int32_t>()[i] = static_cast<unsigned char>(mine[i]);
  at::Tensor all = at::empty({comm.world_size() * max_len}, at::kInt);
  comm.all_gather(all, buf)->wait();
  std::vector<std::string> out;
  for (int r = 0; r < comm.world_size(); ++r) {
    std::string s(size_t(lens[r].item<int64_t>()), '\0');
    const int32_t* p = all.data_ptr<int32_t>() + r * max_len;
    for (size_t i = 0; i < s.size(); ++i) s[i] = char(p[i]);
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace

// One (unit, kind) slice of a snapshot: its real elements, written straight from host memory
// (`data`: a synchronous save of host-resident state), copied file to file from the engine's
// swap (`nvme`), or else copied out through staging buffers (Engine::read_state).
struct SnapshotSlice {
  size_t unit;
  int kind;
  uint64_t begin;  // first element in the unit's flat buffer
  uint64_t numel;
  at::Tensor data;
  Engine::NvmeSlice nvme;
};

// This rank's part of a save, taken at one instant, and what the manifest will say.
struct Snapshot {
  fs::path root, dir;
  std::string name;
  int rank = 0;
  std::vector<SnapshotSlice> slices;  // unit-major: slices[u * kStateKinds + k]
  std::vector<size_t> order;  // the units in the order the writer copies them out
  std::shared_future<void> update_finished;  // before any slice may be read
  std::shared_ptr<StateHold> hold;  // each unit released once copied out
  uint64_t staging_bytes = 0;
  CheckpointOptions options;  // the hooks
  SaveReport report;  // filled by write_rank_files
  json manifest;  // everything but the chunks (used by rank 0)
};

namespace {

// Step 0 (collective): un-commit an existing checkpoint of this name.
void uncommit_existing(Communicator& comm, const fs::path& root, const std::string& name) {
  const fs::path dir = root / name;
  if (comm.rank() == 0 && fs::exists(dir / "manifest.json")) {
    std::ifstream in(root / "latest");
    std::string latest;
    std::getline(in, latest);
    if (latest == name)
      throw std::runtime_error("cannot save over " + dir.string() +
                               ": it is the latest checkpoint; save under another name");
    ::unlink((dir / "manifest.json").c_str());
    fsync_dir(dir);
  }
  comm.barrier();
}

// Bytes of RAM the kernel says could be allocated now without swapping (/proc/meminfo), and the
// total; 0s if unknown.
std::pair<uint64_t, uint64_t> mem_available_and_total() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0, available = 0, total = 0;
  std::string unit;
  while (in >> key >> kb) {
    std::getline(in, unit);
    if (key == "MemAvailable:") available = kb * 1024;
    if (key == "MemTotal:") total = kb * 1024;
  }
  return {available, total};
}

uint64_t staging_limit(uint64_t configured, uint64_t needed) {
  constexpr uint64_t kMin = 2 * kChunkElements * 4;  // one chunk copied while another is written
  uint64_t limit = configured;
  if (limit == 0) {
    const auto [available, total] = mem_available_and_total();
    const uint64_t reserve = std::max<uint64_t>(2ull << 30, total / 10);
    limit = std::min(needed, available > reserve ? available - reserve : 0);
  }
  return std::max(limit, kMin);
}

// Records the snapshot's instant. `async`: every host- and device-resident slice goes through
// staging, since training changes it after this returns (the hold stops it for each unit until
// the writer releases that unit); else host-resident slices are written straight from the state.
Snapshot take_snapshot(Engine& engine, Communicator& comm, const fs::path& root, const std::string& name,
                       const CheckpointMeta& meta, bool async, const CheckpointOptions& options) {
  Snapshot snap;
  snap.root = root;
  snap.dir = root / name;
  snap.name = name;
  snap.rank = comm.rank();
  const Partition& part = engine.partition();
  uint64_t staged = 0;
  for (size_t u = 0; u < part.num_units(); ++u) {
    const UnitLayout& L = part.unit(u);
    const uint64_t valid = L.shard_valid_numel(snap.rank);
    for (int k = 0; k < Engine::kStateKinds; ++k) {
      SnapshotSlice s{u, k, L.shard_begin(snap.rank), valid, {}, engine.nvme_slice(u, Engine::StateKind(k))};
      if (!s.nvme.swap && !async) {
        at::Tensor slice = engine.state_slice(u, Engine::StateKind(k));  // waits for the update
        if (slice.is_cpu()) s.data = slice.narrow(0, 0, int64_t(valid));
      }
      if (!s.nvme.swap && !s.data.defined()) staged += valid * 4;
      snap.slices.push_back(std::move(s));
    }
  }
  snap.order = engine.update_order();
  snap.update_finished = engine.update_finished();
  snap.staging_bytes = staging_limit(options.staging_bytes, staged);
  snap.options = options;
  const Engine::Counters c = engine.counters();
  snap.manifest = {{"format", kFormatVersion},
                   {"kind", "strata-checkpoint"},
                   {"world_size", comm.world_size()},
                   {"model", json::parse(engine.model_config().to_hf_json("float32"))},
                   {"units", partition_json(part)},
                   {"state_kinds", {kKindNames[0], kKindNames[1], kKindNames[2]}},
                   {"counters", {{"optimizer_step", c.step}, {"loss_scale", c.loss_scale},
                                 {"good_steps", c.good_steps}}},
                   {"train_steps", meta.train_steps},
                   {"samples_consumed", meta.samples_consumed}};
  // Last, so that nothing above can throw with the engine held: from here on the writer (or the
  // caller, if it cannot start one) owns releasing every unit.
  snap.hold = std::make_shared<StateHold>(part.num_units());
  engine.hold_state(snap.hold);
  return snap;
}

// Staging buffers of one chunk each, at most `limit` bytes of them: take() hands out a free one,
// or a new one, or waits for the oldest write to finish and reuses its buffer.
class Staging {
 public:
  explicit Staging(uint64_t limit) : max_buffers_(std::max<uint64_t>(1, limit / (kChunkElements * 4))) {}
  ~Staging() {  // every write finishes before its buffer goes
    for (auto& [buf, write] : in_flight_) write.wait();
  }
  float* take() {
    if (!free_.empty()) {
      at::Tensor t = std::move(free_.back());
      free_.pop_back();
      return hand_out(std::move(t));
    }
    if (allocated_ < max_buffers_ || in_flight_.empty()) {
      ++allocated_;
      return hand_out(aligned_floats(int64_t(kChunkElements)));
    }
    auto [buf, write] = std::move(in_flight_.front());
    in_flight_.pop_front();
    const offload::IoStatus st = write.wait();
    if (!st.ok()) throw std::runtime_error(st.message());  // a full disk: stop copying now
    return hand_out(std::move(buf));
  }
  uint64_t allocated_bytes() const { return allocated_ * kChunkElements * 4; }
  // The buffer take() returned last goes out with `write`.
  void writing(offload::IoFuture write) { in_flight_.emplace_back(std::move(current_), std::move(write)); }
  // Without waiting: recycles the buffers whose writes are done; throws the first error, so
  // that a failing disk stops the copy at once.
  void reap() {
    while (!in_flight_.empty() && in_flight_.front().second.ready()) {
      const offload::IoStatus st = in_flight_.front().second.wait();
      free_.push_back(std::move(in_flight_.front().first));
      in_flight_.pop_front();
      if (!st.ok()) throw std::runtime_error(st.message());
    }
  }
  // Waits for every write; rethrows the first error.
  void drain() {
    while (!in_flight_.empty()) {
      check(in_flight_.front().second.wait());
      free_.push_back(std::move(in_flight_.front().first));
      in_flight_.pop_front();
    }
    if (!error_.empty()) {
      std::string e = std::move(error_);
      error_.clear();
      throw std::runtime_error(e);
    }
  }

 private:
  float* hand_out(at::Tensor t) {
    current_ = std::move(t);
    return current_.data_ptr<float>();
  }
  void check(const offload::IoStatus& st) {
    if (!st.ok() && error_.empty()) error_ = st.message();
  }
  uint64_t max_buffers_, allocated_ = 0;
  at::Tensor current_;
  std::vector<at::Tensor> free_;
  std::deque<std::pair<at::Tensor, offload::IoFuture>> in_flight_;
  std::string error_;
};

// Steps 1-2 (this rank alone, any thread): the data file and the index; returns the index.
// Unit by unit in snap.order, once the update running behind is over (if it failed, the state
// is half updated and the save fails with its error): NVMe-resident slices are copied swap file
// to data file inside the kernel (copy_range), the others written from the state or from
// staging buffers they are copied into (Engine::read_state); then the unit is released to the
// engine. The CRCs of file-to-file copies are computed by reading the data file back.
std::string write_rank_files(Engine& engine, Snapshot& snap) {
  struct ReleaseAll {  // on every way out: nothing may wait on this save for ever
    StateHold* h;
    ~ReleaseAll() { if (h) h->release_all(); }
  } release_all{snap.hold.get()};
  if (snap.update_finished.valid()) snap.update_finished.get();
  fs::create_directories(snap.dir);
  const fs::path data_path = snap.dir / (rank_name(snap.rank) + ".data");
  offload::IoEngineConfig io_config;
  io_config.fault_injector = snap.options.io_fault_injector;
  auto io = offload::IoEngine::create(io_config);
  offload::File file = offload::File::open(data_path, offload::OpenMode::kTruncate);
  json chunks = json::array();
  // Writes straight from the state: a synchronous save only, whose caller (the training thread)
  // is blocked until they are done, so the state cannot change under them although their units
  // are released before.
  std::vector<offload::IoFuture> direct_writes;
  uint64_t total = 0;  // allocate the file's extents up front: no allocating direct writes
  for (const SnapshotSlice& s : snap.slices)
    for (uint64_t e = 0; e < s.numel; e += kChunkElements)
      total += (std::min(kChunkElements, s.numel - e) * 4 + kAlign - 1) / kAlign * kAlign;
  if (total > 0) file.reserve(0, total);
  uint64_t offset = 0;
  std::vector<size_t> copied_chunks;  // their CRC is computed from the file
  std::exception_ptr first;
  {
    Staging staging(snap.staging_bytes);
    try {
      for (size_t u : snap.order) {
        for (int k = 0; k < Engine::kStateKinds; ++k) {
          const SnapshotSlice& s = snap.slices.at(u * Engine::kStateKinds + size_t(k));
          for (uint64_t e = 0; e < s.numel; e += kChunkElements) {
            const uint64_t n = std::min(kChunkElements, s.numel - e);
            json c = {{"unit", s.unit}, {"kind", kKindNames[s.kind]}, {"rank", snap.rank},
                      {"begin", s.begin + e}, {"numel", n},
                      {"file", data_path.filename().string()}, {"offset", offset}};
            if (s.nvme.swap) {
              uint64_t at = offset;
              for (const auto& piece : s.nvme.swap->locate(s.nvme.partition, e * 4, n * 4)) {
                offload::copy_range(*piece.file, piece.file_offset, file, at, piece.length);
                at += piece.length;
              }
              copied_chunks.push_back(chunks.size());
            } else {
              const float* from = nullptr;
              if (s.data.defined()) {
                from = s.data.data_ptr<float>() + e;
              } else {
                float* buf = staging.take();
                engine.read_state(u, Engine::StateKind(k), e, n, buf);
                from = buf;
              }
              std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(from), n * 4);
              offload::IoFuture w = io->write(file, offset, bytes);  // first: the CRC overlaps the write
              if (s.data.defined()) direct_writes.push_back(std::move(w));
              else staging.writing(std::move(w));
              c["crc32c"] = offload::crc32c(bytes.data(), bytes.size());
            }
            chunks.push_back(std::move(c));
            offset += (n * 4 + kAlign - 1) / kAlign * kAlign;
          }
        }
        if (snap.options.before_release) snap.options.before_release(u, *snap.hold);
        snap.hold->release(u);
        staging.reap();
      }
    } catch (...) {
      first = std::current_exception();
    }
    try {
      staging.drain();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
    snap.report.staging_peak_bytes = staging.allocated_bytes();
  }
  for (auto& w : direct_writes) {  // every write finishes before the state may change
    const offload::IoStatus st = w.wait();
    if (!st.ok() && !first) first = std::make_exception_ptr(std::runtime_error(st.message()));
  }
  if (first) std::rethrow_exception(first);
  std::vector<unsigned char> buf;
  for (size_t i : copied_chunks) {
    json& c = chunks[i];
    const uint64_t n = c["numel"].get<uint64_t>() * 4;
    buf.resize(n);
    // Through the page cache the copy went through (buffered descriptor).
    for (uint64_t got = 0; got < n;) {
      const ssize_t r = ::pread(file.buffered_fd(), buf.data() + got, n - got, off_t(c["offset"].get<uint64_t>() + got));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) fail_errno("cannot read back", data_path);
      got += uint64_t(r);
    }
    c["crc32c"] = offload::crc32c(buf.data(), n);
  }
  file.sync();
  snap.report.data_bytes = offset;
  const json index = {{"format", kFormatVersion}, {"rank", snap.rank}, {"chunks", chunks}};
  write_atomically(snap.dir / (rank_name(snap.rank) + ".index.json"), index.dump(1));
  return index.dump();
}

// Steps 3-5 (collective): indexes to rank 0, manifest, latest, barrier.
void commit(Communicator& comm, Snapshot& snap, const std::string& index) {
  const std::vector<std::string> indexes = all_gather_strings(comm, index);
  if (comm.rank() == 0) {
    json all_chunks = json::array();
    for (const std::string& s : indexes) {
      const json index_of_rank = json::parse(s);
      for (const json& c : index_of_rank["chunks"]) all_chunks.push_back(c);
    }
    snap.manifest["chunks"] = std::move(all_chunks);
    write_atomically(snap.dir / "manifest.json", snap.manifest.dump(1));
    write_atomically(snap.root / "latest", snap.name + "\n");
  }
  comm.barrier();
}

}  // namespace

fs::path save_checkpoint(Engine& engine, Communicator& comm, const fs::path& root,
                         const std::string& name, const CheckpointMeta& meta, const CheckpointOptions& options) {
  uncommit_existing(comm, root, name);
  Snapshot snap = take_snapshot(engine, comm, root, name, meta, /*async=*/false, options);
  // A rank whose writes failed must still take part in the collectives, then all ranks fail.
  std::string index, error;
  try {
    index = write_rank_files(engine, snap);
  } catch (const std::exception& e) {
    error = e.what();
  }
  at::Tensor failed = at::full({1}, error.empty() ? 0 : 1, at::kInt);
  comm.all_reduce(failed, ReduceOp::kMax);
  if (failed.item<int>() != 0)
    throw std::runtime_error("checkpoint " + snap.dir.string() + " not saved" +
                             (error.empty() ? " (another rank failed)" : ": " + error) +
                             "; the previous checkpoint is intact");
  commit(comm, snap, index);
  return snap.dir;
}

// --- AsyncCheckpointer -------------------------------------------------------------------------

struct AsyncCheckpointer::Pending {
  Snapshot snap;
  std::thread writer;
  std::atomic<bool> done{false};
  std::string index, error;
};

AsyncCheckpointer::AsyncCheckpointer(Communicator& comm, CheckpointOptions options)
    : comm_(comm), options_(std::move(options)) {}

AsyncCheckpointer::~AsyncCheckpointer() {
  if (pending_ && pending_->writer.joinable()) pending_->writer.join();  // never committed
}

double AsyncCheckpointer::start(Engine& engine, const fs::path& root, const std::string& name,
                                const CheckpointMeta& meta) {
  const auto t0 = std::chrono::steady_clock::now();
  if (pending_) finish();  // one save at a time: the earlier one completes first
  uncommit_existing(comm_, root, name);
  // pending_ is set only once a writer runs: a throw before leaves no save in flight, and a
  // writer that cannot start releases the hold so that training does not wait forever.
  auto pending = std::make_unique<Pending>();
  pending->snap = take_snapshot(engine, comm_, root, name, meta, /*async=*/true, options_);
  Pending* p = pending.get();
  try {
    p->writer = std::thread([p, &engine] {
      try {
        p->index = write_rank_files(engine, p->snap);
      } catch (const std::exception& e) {
        p->error = e.what();
      }
      p->done.store(true);
    });
  } catch (...) {
    p->snap.hold->release_all();
    throw;
  }
  pending_ = std::move(pending);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::optional<fs::path> AsyncCheckpointer::poll() {
  if (!pending_) {
    // Ranks agree on whether a save is in flight: they started it at the same step.
    return std::nullopt;
  }
  at::Tensor not_done = at::full({1}, pending_->done.load() ? 0 : 1, at::kInt);
  comm_.all_reduce(not_done, ReduceOp::kMax);
  if (not_done.item<int>() != 0) return std::nullopt;
  return complete();
}

std::optional<fs::path> AsyncCheckpointer::finish() {
  if (!pending_) return std::nullopt;
  pending_->writer.join();
  return complete();
}

std::optional<fs::path> AsyncCheckpointer::complete() {
  std::unique_ptr<Pending> p = std::move(pending_);
  if (p->writer.joinable()) p->writer.join();
  at::Tensor failed = at::full({1}, p->error.empty() ? 0 : 1, at::kInt);
  comm_.all_reduce(failed, ReduceOp::kMax);
  if (failed.item<int>() != 0)
    throw std::runtime_error("checkpoint " + p->snap.dir.string() + " not saved" +
                             (p->error.empty() ? " (another rank failed)" : ": " + p->error) +
                             "; the previous checkpoint is intact");
  commit(comm_, p->snap, p->index);
  last_report_ = p->snap.report;
  return p->snap.dir;
}

void prune_checkpoints(Communicator& comm, const fs::path& root, size_t keep) {
  if (keep == 0) keep = 1;
  std::string latest;
  {
    std::ifstream in(root / "latest");
    std::getline(in, latest);
  }
  std::vector<std::string> names;
  if (fs::exists(root))
    for (const auto& e : fs::directory_iterator(root))
      if (e.is_directory() && e.path().filename().string().rfind("step-", 0) == 0)
        names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  // Every rank must agree on the list: rank 0's view is broadcast as a count (names are sorted and
  // each rank sees its own files; a rank that lacks a directory simply has nothing to remove).
  std::vector<std::string> doomed;
  if (names.size() > keep)
    for (size_t i = 0; i + keep < names.size(); ++i)
      if (names[i] != latest) doomed.push_back(names[i]);
  if (comm.rank() == 0) {
    for (const auto& n : doomed) ::unlink((root / n / "manifest.json").c_str());
    if (!doomed.empty()) fsync_dir(root);
  }
  comm.barrier();
  const std::string mine = rank_name(comm.rank());
  for (const auto& n : doomed) {
    ::unlink((root / n / (mine + ".data")).c_str());
    ::unlink((root / n / (mine + ".index.json")).c_str());
    ::unlink((root / n / (mine + ".index.json.tmp")).c_str());
    ::unlink((root / n / "manifest.json.tmp").c_str());
  }
  comm.barrier();
  if (comm.rank() == 0)
    for (const auto& n : doomed) ::rmdir((root / n).c_str());  // fails harmlessly if not empty
}

std::optional<fs::path> latest_checkpoint(const fs::path& root) {
  std::ifstream in(root / "latest");
  if (!in) return std::nullopt;
  std::string name;
  std::getline(in, name);
  if (name.empty() || !fs::exists(root / name / "manifest.json")) return std::nullopt;
  return root / name;
}

namespace {

json read_manifest(const fs::path& dir) {
  const fs::path manifest_path = dir / "manifest.json";
  if (!fs::exists(manifest_path))
    throw std::runtime_error("checkpoint " + dir.string() +
                             " has no manifest.json: it was never committed (or is not a checkpoint)");
  json m;
  try {
    m = json::parse(read_text(manifest_path));
  } catch (const json::exception& e) {
    throw std::runtime_error("checkpoint " + manifest_path.string() + " is not valid JSON: " + e.what());
  }
  if (m.value("format", 0) != kFormatVersion || m.value("kind", "") != "strata-checkpoint")
    throw std::runtime_error("checkpoint " + dir.string() + ": not a Strata checkpoint of format " +
                             std::to_string(kFormatVersion));
  return m;
}

std::string chunk_name(const json& c, const json& units) {
  return c["file"].get<std::string>() + " at offset " + std::to_string(c["offset"].get<uint64_t>()) +
         " (unit " + units[c["unit"].get<size_t>()]["name"].get<std::string>() + ", " +
         c["kind"].get<std::string>() + ", elements " + std::to_string(c["begin"].get<uint64_t>()) +
         "+" + std::to_string(c["numel"].get<uint64_t>()) + ")";
}

}  // namespace

uint64_t verify_checkpoint(const fs::path& dir) {
  const json m = read_manifest(dir);
  const json& units = m["units"];
  auto io = offload::IoEngine::create();
  std::map<std::string, offload::File> files;
  // Coverage: per (unit, kind) the chunks, sorted by begin, must tile [0, numel).
  std::map<std::pair<size_t, std::string>, std::vector<std::pair<uint64_t, uint64_t>>> ranges;
  uint64_t bytes = 0;
  std::vector<unsigned char> buf;
  for (const json& c : m["chunks"]) {
    const size_t u = c["unit"].get<size_t>();
    if (u >= units.size()) throw std::runtime_error("checkpoint " + dir.string() + ": chunk of unknown unit");
    const std::string fname = c["file"].get<std::string>();
    auto it = files.find(fname);
    if (it == files.end()) {
      if (!fs::exists(dir / fname))
        throw std::runtime_error("checkpoint " + dir.string() + ": data file " + fname + " is missing");
      it = files.emplace(fname, offload::File::open(dir / fname, offload::OpenMode::kRead)).first;
    }
    const uint64_t n = c["numel"].get<uint64_t>() * 4;
    buf.resize(n);
    const offload::IoStatus st =
        io->read(it->second, c["offset"].get<uint64_t>(), {reinterpret_cast<std::byte*>(buf.data()), n}).wait();
    if (!st.ok())
      throw std::runtime_error("checkpoint " + dir.string() + ": cannot read chunk " + chunk_name(c, units) +
                               ": " + st.message());
    if (offload::crc32c(buf.data(), n) != c["crc32c"].get<uint32_t>())
      throw std::runtime_error("checkpoint " + dir.string() + ": chunk " + chunk_name(c, units) +
                               " is corrupt (CRC32C mismatch)");
    ranges[{u, c["kind"].get<std::string>()}].push_back({c["begin"].get<uint64_t>(), c["numel"].get<uint64_t>()});
    bytes += n;
  }
  for (size_t u = 0; u < units.size(); ++u)
    for (const char* kind : kKindNames) {
      auto& r = ranges[{u, kind}];
      std::sort(r.begin(), r.end());
      uint64_t next = 0;
      for (auto& [b, n] : r) {
        if (b != next) break;
        next = b + n;
      }
      if (next != units[u]["numel"].get<uint64_t>())
        throw std::runtime_error("checkpoint " + dir.string() + ": the chunks of " + kind + " of unit " +
                                 units[u]["name"].get<std::string>() + " do not cover its " +
                                 std::to_string(units[u]["numel"].get<uint64_t>()) + " elements exactly");
    }
  return bytes;
}

std::string describe_checkpoint(const fs::path& dir) {
  const json m = read_manifest(dir);
  uint64_t params = 0;
  for (const json& u : m["units"]) params += u["numel"].get<uint64_t>();
  std::ostringstream out;
  out << "checkpoint " << dir.string() << "\n"
      << "  format " << m["format"] << ", saved by " << m["world_size"] << " ranks\n"
      << "  model " << m["model"].value("model_type", "?") << ", " << params << " parameters in "
      << m["units"].size() << " units\n"
      << "  train steps " << m["train_steps"] << ", optimizer steps "
      << m["counters"]["optimizer_step"] << ", loss scale " << m["counters"]["loss_scale"]
      << ", samples consumed " << m["samples_consumed"] << "\n"
      << "  " << m["chunks"].size() << " chunks, " << params * 12 << " bytes of fp32 master and moments\n";
  return out.str();
}

CheckpointMeta load_checkpoint(Engine& engine, Communicator& comm, const fs::path& dir) {
  json m = read_manifest(dir);
  const Partition& part = engine.partition();
  const json units = partition_json(part);
  if (m["units"] != units) {
    std::string why = "different number of units";
    if (m["units"].size() == units.size())
      for (size_t u = 0; u < units.size(); ++u)
        if (m["units"][u] != units[u]) {
          why = "unit " + units[u]["name"].get<std::string>() + " differs";
          break;
        }
    throw std::runtime_error("checkpoint " + dir.string() + " holds a different model (" + why + ")");
  }

  // Unit by unit (so that NVMe-placed state is held in memory one unit at a time): this rank's
  // slices, the chunks that overlap their element range read in parallel and checked, then the
  // slices stored back.
  const int rank = comm.rank();
  auto io = offload::IoEngine::create();
  std::map<std::string, offload::File> files;
  std::vector<std::vector<const json*>> unit_chunks(part.num_units());
  for (const json& c : m["chunks"]) {
    const size_t u = c["unit"].get<size_t>();
    if (u >= part.num_units())
      throw std::runtime_error("checkpoint " + dir.string() + ": chunk of unknown unit " + std::to_string(u));
    unit_chunks[u].push_back(&c);
  }
  struct Read {
    const json* chunk;
    at::Tensor buf;
    offload::IoFuture done;
    int kind;
    bool direct;  // buf is a view of the slice itself
  };
  std::vector<uint64_t> covered(part.num_units() * Engine::kStateKinds, 0);
  for (size_t u = 0; u < part.num_units(); ++u) {
    const UnitLayout& L = part.unit(u);
    const uint64_t want_b = L.shard_begin(rank), want_e = want_b + L.shard_valid_numel(rank);
    std::array<at::Tensor, Engine::kStateKinds> slices;
    for (int k = 0; k < Engine::kStateKinds; ++k) slices[k] = engine.state_slice(u, Engine::StateKind(k));
    std::vector<Read> reads;
    try {
      for (const json* cp : unit_chunks[u]) {
        const json& c = *cp;
        const uint64_t b = c["begin"].get<uint64_t>(), e = b + c["numel"].get<uint64_t>();
        if (e <= want_b || b >= want_e) continue;
        const std::string fname = c["file"].get<std::string>();
        auto it = files.find(fname);
        if (it == files.end()) {
          const fs::path p = dir / fname;
          if (!fs::exists(p))
            throw std::runtime_error("checkpoint " + dir.string() + ": data file " + fname + " is missing");
          it = files.emplace(fname, offload::File::open(p, offload::OpenMode::kRead)).first;
        }
        int k = 0;
        while (k < Engine::kStateKinds && c["kind"] != kKindNames[k]) ++k;
        if (k == Engine::kStateKinds)
          throw std::runtime_error("checkpoint " + dir.string() + ": unknown state kind " + c["kind"].dump());
        // A chunk wholly inside this rank's range is read straight into the (page-aligned) host
        // slice; others go through a buffer and only their overlap is copied.
        const bool direct = b >= want_b && e <= want_e && slices[k].is_cpu();
        at::Tensor buf = direct ? slices[k].narrow(0, int64_t(b - want_b), int64_t(e - b))
                                : aligned_floats(int64_t(e - b));
        auto span = std::span<std::byte>(reinterpret_cast<std::byte*>(buf.data_ptr<float>()), (e - b) * 4);
        reads.push_back({&c, buf, io->read(it->second, c["offset"].get<uint64_t>(), span), k, direct});
      }
      for (Read& r : reads) {
        const json& c = *r.chunk;
        const std::string where = c["file"].get<std::string>() + " at offset " +
                                  std::to_string(c["offset"].get<uint64_t>()) + " (unit " + L.name + ", " +
                                  c["kind"].get<std::string>() + ", elements " +
                                  std::to_string(c["begin"].get<uint64_t>()) + "+" +
                                  std::to_string(c["numel"].get<uint64_t>()) + ")";
        const offload::IoStatus st = r.done.wait();
        if (!st.ok())
          throw std::runtime_error("checkpoint " + dir.string() + ": cannot read chunk " + where + ": " +
                                   st.message());
        if (offload::crc32c(r.buf.data_ptr<float>(), size_t(r.buf.numel()) * 4) != c["crc32c"].get<uint32_t>())
          throw std::runtime_error("checkpoint " + dir.string() + ": chunk " + where +
                                   " is corrupt (CRC32C mismatch)");
        const uint64_t b = c["begin"].get<uint64_t>(), e = b + c["numel"].get<uint64_t>();
        const uint64_t lo = std::max(b, want_b), hi = std::min(e, want_e);
        if (!r.direct)
          slices[r.kind].narrow(0, int64_t(lo - want_b), int64_t(hi - lo))
              .copy_(r.buf.narrow(0, int64_t(lo - b), int64_t(hi - lo)));
        covered[u * Engine::kStateKinds + size_t(r.kind)] += hi - lo;
      }
    } catch (...) {
      for (Read& r : reads) r.done.wait();  // no read may land in a freed buffer
      throw;
    }
    for (int k = 0; k < Engine::kStateKinds; ++k) engine.store_state_slice(u, Engine::StateKind(k), slices[k]);
  }
  for (size_t u = 0; u < part.num_units(); ++u)
    for (int k = 0; k < Engine::kStateKinds; ++k)
      if (covered[u * Engine::kStateKinds + size_t(k)] != part.unit(u).shard_valid_numel(rank))
        throw std::runtime_error("checkpoint " + dir.string() + ": the manifest's chunks do not cover " +
                                 kKindNames[k] + " of unit " + part.unit(u).name + " for rank " +
                                 std::to_string(rank) + " (" +
                                 std::to_string(covered[u * Engine::kStateKinds + size_t(k)]) + " of " +
                                 std::to_string(part.unit(u).shard_valid_numel(rank)) + " elements)");
  engine.refresh_compute_copies();
  const json& c = m["counters"];
  engine.set_counters({c["optimizer_step"].get<int64_t>(), c["loss_scale"].get<double>(),
                       c["good_steps"].get<int64_t>()});
  comm.barrier();
  return {m["train_steps"].get<int64_t>(), m["samples_consumed"].get<uint64_t>()};
}

ExportResult export_checkpoint_hf(const fs::path& dir, const fs::path& out_dir, const std::string& dtype,
                                  const std::function<void(uint64_t, uint64_t)>& progress) {
  at::ScalarType out_type;
  models::StDType st_type;
  if (dtype == "float32") out_type = at::kFloat, st_type = models::StDType::kF32;
  else if (dtype == "bfloat16") out_type = at::kBFloat16, st_type = models::StDType::kBF16;
  else if (dtype == "float16") out_type = at::kHalf, st_type = models::StDType::kF16;
  else throw std::invalid_argument("export dtype must be float32, bfloat16 or float16, not '" + dtype + "'");

  const json m = read_manifest(dir);
  const models::ModelConfig mc = models::parse_hf_config(m["model"].dump(), (dir / "manifest.json").string());
  const json& units = m["units"];

  // The master chunks of each unit, sorted, must tile the unit exactly.
  std::vector<std::vector<const json*>> unit_chunks(units.size());
  for (const json& c : m["chunks"]) {
    if (c["kind"] != kKindNames[0]) continue;
    const size_t u = c["unit"].get<size_t>();
    if (u >= units.size()) throw std::runtime_error("checkpoint " + dir.string() + ": chunk of unknown unit");
    unit_chunks[u].push_back(&c);
  }
  for (size_t u = 0; u < units.size(); ++u) {
    auto& cs = unit_chunks[u];
    std::sort(cs.begin(), cs.end(), [](const json* a, const json* b) {
      return (*a)["begin"].get<uint64_t>() < (*b)["begin"].get<uint64_t>();
    });
    uint64_t next = 0;
    for (const json* c : cs) {
      if ((*c)["begin"].get<uint64_t>() != next) break;
      next += (*c)["numel"].get<uint64_t>();
    }
    if (next != units[u]["numel"].get<uint64_t>())
      throw std::runtime_error("checkpoint " + dir.string() + ": the master chunks of unit " +
                               units[u]["name"].get<std::string>() + " do not cover it exactly");
  }

  // Tensors in unit order, packed in their unit as the partition packs them.
  struct Item {
    size_t unit;
    uint64_t offset, numel;
    std::string name;
    std::vector<int64_t> shape;  // Strata's
    bool transposed;
  };
  std::vector<Item> items;
  std::vector<models::SafetensorsWriter::Spec> specs;
  uint64_t total = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    uint64_t offset = 0;
    for (const json& t : units[u]["tensors"]) {
      Item it{u, offset, 1, t["name"].get<std::string>(), t["shape"].get<std::vector<int64_t>>(), false};
      for (int64_t d : it.shape) it.numel *= uint64_t(d);
      it.transposed = models::hf_stores_transposed(mc, it.name);
      std::vector<int64_t> hf_shape = it.shape;
      if (it.transposed) std::swap(hf_shape[0], hf_shape[1]);
      specs.push_back({it.name, st_type, hf_shape});
      total += it.numel * models::st_dtype_bytes(st_type);
      offset += it.numel;
      items.push_back(std::move(it));
    }
    if (offset != units[u]["numel"].get<uint64_t>())
      throw std::runtime_error("checkpoint " + dir.string() + ": the tensors of unit " +
                               units[u]["name"].get<std::string>() + " do not add up to its size");
  }

  fs::create_directories(out_dir);
  models::SafetensorsWriter writer(out_dir / "model.safetensors", specs, {{"format", "pt"}});
  auto io = offload::IoEngine::create();
  std::map<std::string, offload::File> files;
  auto file_of = [&](const json& c) -> offload::File& {
    const std::string fname = c["file"].get<std::string>();
    auto it = files.find(fname);
    if (it == files.end()) {
      if (!fs::exists(dir / fname))
        throw std::runtime_error("checkpoint " + dir.string() + ": data file " + fname + " is missing");
      it = files.emplace(fname, offload::File::open(dir / fname, offload::OpenMode::kRead)).first;
    }
    return it->second;
  };
  // A chunk read and checked; the last one is kept, as it may straddle into the next tensor.
  struct Loaded {
    const json* chunk = nullptr;
    at::Tensor data;
    offload::IoFuture done;
  };
  Loaded kept;
  constexpr size_t kWindow = 16;  // chunks in flight: 64 MiB
  ExportResult result;
  for (const Item& it : items) {
    at::Tensor full = at::empty({int64_t(it.numel)}, at::TensorOptions().dtype(at::kFloat));
    const uint64_t lo = it.offset, hi = it.offset + it.numel;
    std::vector<const json*> need;
    for (const json* c : unit_chunks[it.unit]) {
      const uint64_t b = (*c)["begin"].get<uint64_t>(), e = b + (*c)["numel"].get<uint64_t>();
      if (e > lo && b < hi) need.push_back(c);
    }
    auto place = [&](const Loaded& l) {
      const uint64_t b = (*l.chunk)["begin"].get<uint64_t>(), e = b + (*l.chunk)["numel"].get<uint64_t>();
      const uint64_t from = std::max(b, lo), to = std::min(e, hi);
      full.narrow(0, int64_t(from - lo), int64_t(to - from)).copy_(l.data.narrow(0, int64_t(from - b), int64_t(to - from)));
    };
    std::vector<Loaded> flight;
    try {
      for (size_t i = 0; i < need.size(); i += kWindow) {
        flight.clear();
        for (size_t j = i; j < std::min(need.size(), i + kWindow); ++j) {
          if (kept.chunk == need[j]) {
            place(kept);
            continue;
          }
          const json& c = *need[j];
          Loaded l;
          l.chunk = need[j];
          l.data = aligned_floats(int64_t(c["numel"].get<uint64_t>()));
          l.done = io->read(file_of(c), c["offset"].get<uint64_t>(),
                            {reinterpret_cast<std::byte*>(l.data.data_ptr<float>()), size_t(l.data.numel()) * 4});
          flight.push_back(std::move(l));
        }
        for (Loaded& l : flight) {
          const offload::IoStatus status = l.done.wait();
          if (!status.ok())
            throw std::runtime_error("checkpoint " + dir.string() + ": cannot read chunk " +
                                     chunk_name(*l.chunk, units) + ": " + status.message());
          if (offload::crc32c(l.data.data_ptr<float>(), size_t(l.data.numel()) * 4) !=
              (*l.chunk)["crc32c"].get<uint32_t>())
            throw std::runtime_error("checkpoint " + dir.string() + ": chunk " + chunk_name(*l.chunk, units) +
                                     " is corrupt (CRC32C mismatch)");
          place(l);
        }
        if (!flight.empty()) kept = std::move(flight.back());
      }
    } catch (...) {
      for (Loaded& l : flight) l.done.wait();  // no read may land in a freed buffer
      throw;
    }
    at::Tensor t = full.view(it.shape);
    if (it.transposed) t = t.t();
    t = t.to(out_type).contiguous();
    writer.write(it.name, {static_cast<const std::byte*>(t.data_ptr()), t.nbytes()});
    ++result.tensors;
    result.bytes += t.nbytes();
    if (progress) progress(result.bytes, total);
  }
  writer.finish();
  write_atomically(out_dir / "config.json", mc.to_hf_json(dtype) + "\n");
  return result;
}

}  // namespace strata::engine
