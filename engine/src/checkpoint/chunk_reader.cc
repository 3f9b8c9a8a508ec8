#include "checkpoint/chunk_reader.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <span>
#include <stdexcept>
#include <thread>

#include "strata/offload/crc32c.h"
#include "strata/offload/parallel.h"

namespace strata::engine::ckpt {

ChunkReader::ChunkReader(fs::path location, ChunkCatalog& catalog, offload::TransferOptions transfer)
    : dir_(std::move(location)), catalog_(catalog), transfer_(transfer) {
  if (is_object_location(dir_)) {
    ObjectLocation at = open_object_location(dir_);
    store_ = std::move(at.store);
    object_name_ = std::move(at.name);
  } else {
    io_ = offload::IoEngine::create();
  }
}

offload::File& ChunkReader::file(const Chunk& chunk) {
  const std::string name = catalog_.data_file(chunk.rank);
  auto it = files_.find(name);
  if (it == files_.end()) {
    if (!fs::exists(dir_ / name))
      throw std::runtime_error("checkpoint " + dir_.string() + ": data file " + name + " is missing");
    it = files_.emplace(name, offload::File::open(dir_ / name, offload::OpenMode::kRead)).first;
  }
  return it->second;
}

void ChunkReader::read_objects(const std::vector<Request>& batch, size_t window) {
  // Requests adjacent both in one data object and in memory (a slice's consecutive chunks) go as
  // one ranged GET of up to the transfer's part size: each request costs the store a round of
  // authentication and lookup, so fewer, larger ones move more. At most the transfer's
  // concurrency in flight.
  const uint64_t get_bytes = std::max<uint64_t>(transfer_.part_bytes, 1);
  struct Run {
    std::string key;
    uint64_t offset = 0, bytes = 0;
    std::byte* dst = nullptr;
    std::vector<const Request*> requests;
  };
  std::vector<Run> runs;  // one per request, then sorted by (object, offset) and merged
  for (const Request& r : batch)
    runs.push_back({object_name_ + "/" + catalog_.data_file(r.chunk.rank), r.chunk.offset, r.chunk.numel * 4,
                    reinterpret_cast<std::byte*>(r.dst), {&r}});
  std::stable_sort(runs.begin(), runs.end(),
                   [](const Run& a, const Run& b) { return a.key != b.key ? a.key < b.key : a.offset < b.offset; });
  std::vector<Run> merged;
  for (Run& r : runs) {
    if (!merged.empty()) {
      Run& last = merged.back();
      if (last.key == r.key && last.offset + last.bytes == r.offset && last.dst + last.bytes == r.dst &&
          last.bytes + r.bytes <= get_bytes) {
        last.bytes += r.bytes;
        last.requests.push_back(r.requests.front());
        continue;
      }
    }
    merged.push_back(std::move(r));
  }
  runs = std::move(merged);
  const int threads = int(std::min<size_t>(std::max<size_t>(window, 1), size_t(std::max(transfer_.concurrency, 1))));
  offload::run_parallel(runs.size(), threads, [&](size_t i) {
    const Run& run = runs[i];
    const auto name = [&] {  // the run's chunks, for an error
      std::string n = catalog_.name(run.requests.front()->chunk);
      if (run.requests.size() > 1)
        n += " and the " + std::to_string(run.requests.size() - 1) + " chunk" + (run.requests.size() > 2 ? "s" : "") +
             " after it";
      return n;
    };
    try {
      for (int attempt = 0;; ++attempt) {
        try {
          store_->get(run.key, run.offset, {run.dst, run.bytes});
          break;
        } catch (const offload::ObjectStoreError& e) {
          // The manifest commits only after every data object was uploaded: a missing one is a
          // store that lags (retried), or data deleted since (an error after the retries).
          if (e.kind() != offload::ObjectStoreError::Kind::kNotFound || attempt >= 4) throw;
          std::this_thread::sleep_for(std::chrono::milliseconds(250 << attempt));
        }
      }
    } catch (const offload::ObjectStoreError& e) {
      throw std::runtime_error("checkpoint " + dir_.string() + ": cannot read chunk " + name() + ": " + e.what());
    }
    for (const Request* r : run.requests)
      if (offload::crc32c(r->dst, r->chunk.numel * 4) != r->chunk.crc32c)
        throw std::runtime_error("checkpoint " + dir_.string() + ": chunk " + catalog_.name(r->chunk) +
                                 " is corrupt (CRC32C mismatch)");
  });
}

void ChunkReader::read(const std::vector<Request>& asked, size_t window) {
  // Placed here, on the caller's thread: the catalog reads an index file at its rank's first chunk.
  std::vector<Request> batch = asked;
  for (Request& r : batch) r.chunk = catalog_.place(r.chunk);
  if (store_) {
    read_objects(batch, window);
    return;
  }
  struct InFlight {
    const Request* request;
    offload::IoFuture done;
  };
  std::deque<InFlight> flight;
  std::string error;  // the first failure; the reads in flight are still waited for
  const auto finish_one = [&] {
    InFlight f = std::move(flight.front());
    flight.pop_front();
    const offload::IoStatus st = f.done.wait();
    if (!error.empty()) return;
    const Chunk& c = f.request->chunk;
    if (!st.ok())
      error = "checkpoint " + dir_.string() + ": cannot read chunk " + catalog_.name(c) + ": " + st.message();
    else if (offload::crc32c(f.request->dst, c.numel * 4) != c.crc32c)
      error = "checkpoint " + dir_.string() + ": chunk " + catalog_.name(c) + " is corrupt (CRC32C mismatch)";
  };
  for (const Request& r : batch) {
    while (flight.size() >= std::max<size_t>(window, 1)) finish_one();
    if (!error.empty()) break;
    const Chunk& c = r.chunk;
    offload::IoFuture done;
    try {
      done = io_->read(file(c), c.offset, {reinterpret_cast<std::byte*>(r.dst), c.numel * 4});
    } catch (...) {
      while (!flight.empty()) flight.front().done.wait(), flight.pop_front();
      throw;
    }
    flight.push_back({&r, std::move(done)});
  }
  while (!flight.empty()) finish_one();
  if (!error.empty()) throw std::runtime_error(error);
}

}  // namespace strata::engine::ckpt
