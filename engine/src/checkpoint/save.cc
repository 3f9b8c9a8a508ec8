// Saving: a snapshot of this rank's state at one instant (take_snapshot), written by the rank
// itself (write_rank_files: steps 1-2 of the commit protocol), then committed (commit.h: steps 0
// and 3-5). Synchronous (save_checkpoint) and asynchronous (AsyncCheckpointer) saves share every
// step; they differ in which thread writes and in what goes through staging.
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <fstream>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <thread>

#include "checkpoint/catalog.h"
#include "checkpoint/commit.h"
#include "checkpoint/format.h"
#include "checkpoint/staging.h"
#include "strata/engine/checkpoint.h"
#include "strata/engine/precision_dtype.h"
#include "strata/models/model_config.h"
#include "strata/models/peft.h"
#include "strata/offload/crc32c.h"
#include "strata/offload/file.h"
#include "strata/offload/io_engine.h"

namespace strata::engine {
using namespace ckpt;

// One (unit, kind) slice of a snapshot: its real elements, written straight from host memory
// (`data`: a synchronous save of host-resident state), copied file to file from where the
// engine keeps it (`in_files`: swap), or else copied out through staging (Engine::read_state).
struct SnapshotSlice {
  size_t unit;  // the engine's unit (the checkpoint's unit is its place in Snapshot::slices)
  int kind;
  uint64_t begin;  // first element in the unit's flat buffer
  uint64_t numel;
  at::Tensor data;
  bool in_files = false;
};

// This rank's part of a save, taken at one instant, and what the manifest will say.
struct Snapshot {
  fs::path root, dir;
  std::string name;
  int rank = 0;
  // Checkpoint-unit-major: slices[i * state::kSavedKinds + k] (Engine::checkpoint_partition;
  // frozen units have no saved state).
  std::vector<SnapshotSlice> slices;
  std::vector<size_t> order;  // the engine's units in the order the writer copies them out
  std::map<size_t, size_t> saved_index;  // engine unit -> its index in the checkpoint
  std::shared_future<void> update_finished;  // before any slice may be read
  std::shared_ptr<StateHold> hold;  // each unit released once copied out
  uint64_t staging_bytes = 0;
  CheckpointOptions options;  // the hooks
  SaveReport report;  // filled by write_rank_files
  json manifest;  // everything but the chunks (used by rank 0)
};

namespace {


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
  const Partition& part = engine.checkpoint_partition();
  uint64_t staged = 0;
  for (size_t i = 0; i < part.num_units(); ++i) {
    const size_t u = engine.checkpoint_units().at(i);
    snap.saved_index[u] = i;
    const UnitLayout& L = part.unit(i);
    const uint64_t valid = L.shard_valid_numel(snap.rank);
    for (int k = 0; k < state::kSavedKinds; ++k) {
      SnapshotSlice s{u, k, L.shard_begin(snap.rank), valid, {},
                      engine.state_copies_to_file(u, state::Kind(k))};
      if (!s.in_files && !async) {
        at::Tensor slice = engine.state_slice(u, state::Kind(k));  // waits for the update
        if (slice.is_cpu()) s.data = slice.narrow(0, 0, int64_t(valid));
      }
      if (!s.in_files && !s.data.defined()) staged += valid * 4;
      snap.slices.push_back(std::move(s));
    }
  }
  snap.order = engine.update_order();
  snap.update_finished = engine.update_finished();
  snap.staging_bytes = staging_limit(options.staging_bytes, staged);
  snap.options = options;
  const Engine::Counters c = engine.counters();
  json shards = json::array();
  for (size_t u = 0; u < part.num_units(); ++u) shards.push_back(part.unit(u).shard_numel);
  snap.manifest = {{"format", kFormatVersion},
                   {"kind", "strata-checkpoint"},
                   {"world_size", comm.world_size()},
                   {"model", json::parse(engine.model_config().to_hf_json("float32"))},
                   {"units", partition_json(part)},
                   {"shards", std::move(shards)},
                   {"chunk_elements", kChunkElements},
                   {"state_kinds", {state::kind_name(0), state::kind_name(1), state::kind_name(2)}},
                   {"counters", {{"optimizer_step", c.step}, {"loss_scale", c.loss_scale},
                                 {"good_steps", c.good_steps}}},
                   {"train_steps", meta.train_steps},
                   {"samples_consumed", meta.samples_consumed},
                   {"global_batch", meta.global_batch},
                   {"data_pack", meta.data_pack}};
  if (part.num_units() < engine.partition().num_units()) {
    // The checkpoint holds the trainable units alone: the rest come from the base it names.
    if (meta.frozen_base.empty())
      throw std::invalid_argument("save_checkpoint: tensors are frozen (model.trainable) but the caller gave no "
                                  "fingerprint of the base they come from (CheckpointMeta::frozen_base)");
    snap.manifest["frozen_base"] = meta.frozen_base;
  }
  // A 4-bit base's settings: what a merge into its dequantized weights repeats.
  if (engine.model_config().quantize.enabled())
    snap.manifest["quantize"] = quantization_json(engine.model_config().quantize, scalar_type(engine.config().compute));
  // What a LoRA checkpoint exports as an adapter directory and resumes only with.
  if (engine.model_config().lora.enabled())
    snap.manifest["lora"] = json::parse(models::peft_adapter_config_json(engine.model_config(), ""));
  // Last, so that nothing above can throw with the engine held: from here on the writer (or the
  // caller, if it cannot start one) owns releasing every unit.
  snap.hold = std::make_shared<StateHold>(engine.partition().num_units());
  for (size_t u = 0; u < engine.partition().num_units(); ++u)
    if (!snap.saved_index.count(u)) snap.hold->release(u);  // frozen: nothing to copy out, never updated
  engine.hold_state(snap.hold);
  return snap;
}

// Steps 1-2 (this rank alone, any thread): the data file and the index; returns their record.
// Unit by unit in snap.order, once the update running behind is over (if it failed, the state
// is half updated and the save fails with its error): slices in files are copied file to file
// inside the kernel (Engine::copy_state_to_file), the others written from the state or from
// staging buffers they are copied into (Engine::read_state); then the unit is released to the
// engine. The CRCs of file-to-file copies are computed by reading the data file back.
class RankFileWriter {
 public:
  RankFileWriter(Engine& engine, Snapshot& snap)
      : engine_(engine), snap_(snap), data_path_(snap.dir / (rank_name(snap.rank) + ".data")) {}

  RankFiles write() {
    struct ReleaseAll {  // on every way out: nothing may wait on this save for ever
      StateHold* h;
      ~ReleaseAll() { if (h) h->release_all(); }
    } release_all{snap_.hold.get()};
    if (snap_.update_finished.valid()) snap_.update_finished.get();
    open_data_file();
    write_units();
    read_back_copied_crcs();
    file_->sync();
    snap_.report.data_bytes = offset_;
    const std::string index = index_text(snap_.rank, kChunkElements, slices_);
    write_atomically(snap_.dir / (rank_name(snap_.rank) + ".index.json"), index);
    return {offset_, index.size(), offload::crc32c(index.data(), index.size())};
  }

 private:
  // The step's directory (the root's and the step's entries durable) and the data file, its
  // extents allocated up front: no allocating direct writes.
  void open_data_file() {
    offload::create_directories_durably(snap_.dir);
    offload::IoEngineConfig io_config;
    io_config.fault_injector = snap_.options.io_fault_injector;
    io_ = offload::IoEngine::create(io_config);
    file_.emplace(offload::File::open(data_path_, offload::OpenMode::kTruncate));
    uint64_t total = 0;
    for (const SnapshotSlice& s : snap_.slices) total += SliceChunks{s.numel}.file_bytes();
    if (total > 0) file_->reserve(0, total);
  }

  // Every saved unit's slices, chunk by chunk, each unit released once its chunks are out; then
  // every write waited for. The first failure is thrown after the staging and the direct writes
  // are drained (nothing may still write into buffers or state that change).
  void write_units() {
    std::exception_ptr first;
    {
      Staging staging(snap_.staging_bytes);
      try {
        for (size_t u : snap_.order) {
          const size_t i = snap_.saved_index.at(u);
          for (int k = 0; k < state::kSavedKinds; ++k) write_slice(u, i, k, staging);
          if (snap_.options.before_release) snap_.options.before_release(u, *snap_.hold);
          snap_.hold->release(u);
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
      snap_.report.staging_peak_bytes = staging.allocated_bytes();
    }
    for (auto& w : direct_writes_) {  // every write finishes before the state may change
      const offload::IoStatus st = w.wait();
      if (!st.ok() && !first) first = std::make_exception_ptr(std::runtime_error(st.message()));
    }
    if (first) std::rethrow_exception(first);
  }

  // Unit u's kind k (its saved slot i): its chunks at the end of the file, their CRCs recorded.
  void write_slice(size_t u, size_t i, int k, Staging& staging) {
    const SnapshotSlice& s = snap_.slices.at(i * state::kSavedKinds + size_t(k));
    if (s.numel > 0) slices_.push_back({i, k, offset_, {}});
    const SliceChunks cut{s.numel};
    const uint64_t start = offset_;
    for (uint64_t c = 0; c < cut.count(); ++c) {
      const uint64_t e = cut.first(c), n = cut.numel_of(c);
      offset_ = start + cut.offset(c);
      std::vector<uint32_t>& crcs = slices_.back().crc32c;
      if (s.in_files) {
        engine_.copy_state_to_file(u, state::Kind(k), e, n, *file_, offset_);
        copied_chunks_.push_back({slices_.size() - 1, crcs.size(), offset_, n});
        crcs.push_back(0);
      } else {
        const float* from = nullptr;
        if (s.data.defined()) {
          from = s.data.data_ptr<float>() + e;
        } else {
          float* buf = staging.take();
          engine_.read_state(u, state::Kind(k), e, n, buf);
          from = buf;
        }
        std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(from), n * 4);
        offload::IoFuture w = io_->write(*file_, offset_, bytes);  // first: the CRC overlaps the write
        if (s.data.defined()) direct_writes_.push_back(std::move(w));
        else staging.writing(std::move(w));
        crcs.push_back(offload::crc32c(bytes.data(), bytes.size()));
      }
    }
    offset_ = start + cut.file_bytes();
  }

  // The CRCs of the chunks copied file to file, read back through the page cache the copy went
  // through (the buffered descriptor).
  void read_back_copied_crcs() {
    std::vector<unsigned char> buf;
    for (const Copied& c : copied_chunks_) {
      const uint64_t n = c.numel * 4;
      buf.resize(n);
      for (uint64_t got = 0; got < n;) {
        const ssize_t r = ::pread(file_->buffered_fd(), buf.data() + got, n - got, off_t(c.offset + got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) fail_errno("cannot read back", data_path_);
        got += uint64_t(r);
      }
      slices_[c.slice].crc32c[c.chunk] = offload::crc32c(buf.data(), n);
    }
  }

  struct Copied {  // a chunk copied file to file: its CRC is computed from the file
    size_t slice, chunk;
    uint64_t offset, numel;
  };
  Engine& engine_;
  Snapshot& snap_;
  const fs::path data_path_;
  std::unique_ptr<offload::IoEngine> io_;
  std::optional<offload::File> file_;
  std::vector<SliceRecord> slices_;  // the index: where each slice's chunks are, and their CRCs
  // Writes straight from the state: a synchronous save only, whose caller (the training thread)
  // is blocked until they are done, so the state cannot change under them although their units
  // are released before.
  std::vector<offload::IoFuture> direct_writes_;
  std::vector<Copied> copied_chunks_;
  uint64_t offset_ = 0;  // the data file's end
};

RankFiles write_rank_files(Engine& engine, Snapshot& snap) { return RankFileWriter(engine, snap).write(); }

}  // namespace

fs::path save_checkpoint(Engine& engine, Communicator& comm, const fs::path& root,
                         const std::string& name, const CheckpointMeta& meta, const CheckpointOptions& options) {
  uncommit_existing(comm, root, name);
  Snapshot snap = take_snapshot(engine, comm, root, name, meta, /*async=*/false, options);
  // A rank whose writes failed must still take part in the collectives, then all ranks fail.
  RankFiles written;
  std::string error;
  try {
    written = write_rank_files(engine, snap);
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree_written(comm, snap.dir, error);
  commit(comm, snap.root, snap.name, snap.manifest, written);
  return snap.dir;
}

// --- AsyncCheckpointer -------------------------------------------------------------------------

struct AsyncCheckpointer::Pending {
  Snapshot snap;
  std::thread writer;
  std::atomic<bool> done{false};
  RankFiles written;
  std::string error;
};

AsyncCheckpointer::AsyncCheckpointer(Communicator& comm, CheckpointOptions options)
    : comm_(comm), options_(std::move(options)) {}

AsyncCheckpointer::~AsyncCheckpointer() {
  if (pending_ && pending_->writer.joinable()) pending_->writer.join();  // never committed
}

double AsyncCheckpointer::start(Engine& engine, const fs::path& root, const std::string& name,
                                const CheckpointMeta& meta) {
  const auto t0 = std::chrono::steady_clock::now();
  if (pending_)
    throw std::logic_error("AsyncCheckpointer::start(" + name + "): the save of " + pending_->snap.name +
                           " is still in flight; finish() it first (its commit must be reported)");
  uncommit_existing(comm_, root, name);
  // pending_ is set only once a writer runs: a throw before leaves no save in flight, and a
  // writer that cannot start releases the hold so that training does not wait forever.
  auto pending = std::make_unique<Pending>();
  pending->snap = take_snapshot(engine, comm_, root, name, meta, /*async=*/true, options_);
  Pending* p = pending.get();
  try {
    p->writer = std::thread([p, &engine] {
      try {
        p->written = write_rank_files(engine, p->snap);
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
  // Ranks agree on whether a save is in flight: they started it at the same step.
  if (!pending_) return std::nullopt;
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
  agree_written(comm_, p->snap.dir, p->error);
  commit(comm_, p->snap.root, p->snap.name, p->snap.manifest, p->written);
  last_report_ = p->snap.report;
  return p->snap.dir;
}

}  // namespace strata::engine
