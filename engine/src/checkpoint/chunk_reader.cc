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

ChunkReader::ChunkReader(fs::path location, const json& manifest)
    : dir_(std::move(location)), units_(manifest["units"]), data_prefix_(data_prefix(manifest)) {
  if (is_object_location(dir_)) {
    ObjectLocation at = open_object_location(dir_);
    store_ = std::move(at.store);
    object_name_ = std::move(at.name);
  } else {
    io_ = offload::IoEngine::create();
  }
}

offload::File& ChunkReader::file(const json& chunk) {
  const std::string name = data_prefix_ + chunk["file"].get<std::string>();
  auto it = files_.find(name);
  if (it == files_.end()) {
    if (!fs::exists(dir_ / name))
      throw std::runtime_error("checkpoint " + dir_.string() + ": data file " + name + " is missing");
    it = files_.emplace(name, offload::File::open(dir_ / name, offload::OpenMode::kRead)).first;
  }
  return it->second;
}

void ChunkReader::read_objects(const std::vector<Request>& batch, size_t window) {
  const int threads = int(std::min<size_t>(std::max<size_t>(window, 1), 16));
  offload::run_parallel(batch.size(), threads, [&](size_t i) {
    const json& c = *batch[i].chunk;
    try {
      const uint64_t bytes = c["numel"].get<uint64_t>() * 4;
      const std::string key = object_name_ + "/" + data_prefix_ + c["file"].get<std::string>();
      for (int attempt = 0;; ++attempt) {
        try {
          store_->get(key, c["offset"].get<uint64_t>(), {reinterpret_cast<std::byte*>(batch[i].dst), bytes});
          break;
        } catch (const offload::ObjectStoreError& e) {
          // The manifest commits only after every data object was uploaded: a missing one is a
          // store that lags (retried), or data deleted since (an error after the retries).
          if (e.kind() != offload::ObjectStoreError::Kind::kNotFound || attempt >= 4) throw;
          std::this_thread::sleep_for(std::chrono::milliseconds(250 << attempt));
        }
      }
      if (offload::crc32c(batch[i].dst, bytes) != c["crc32c"].get<uint32_t>())
        throw std::runtime_error("checkpoint " + dir_.string() + ": chunk " + chunk_name(c, units_) +
                                 " is corrupt (CRC32C mismatch)");
    } catch (const offload::ObjectStoreError& e) {
      throw std::runtime_error("checkpoint " + dir_.string() + ": cannot read chunk " + chunk_name(c, units_) + ": " +
                               e.what());
    } catch (const json::exception& e) {  // a malformed chunk entry
      throw std::runtime_error("checkpoint " + dir_.string() + ": " + e.what());
    }
  });
}

void ChunkReader::read(const std::vector<Request>& batch, size_t window) {
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
    const json& c = *f.request->chunk;
    const uint64_t bytes = c["numel"].get<uint64_t>() * 4;
    if (!st.ok())
      error = "checkpoint " + dir_.string() + ": cannot read chunk " + chunk_name(c, units_) + ": " + st.message();
    else if (offload::crc32c(f.request->dst, bytes) != c["crc32c"].get<uint32_t>())
      error = "checkpoint " + dir_.string() + ": chunk " + chunk_name(c, units_) + " is corrupt (CRC32C mismatch)";
  };
  for (const Request& r : batch) {
    while (flight.size() >= std::max<size_t>(window, 1)) finish_one();
    if (!error.empty()) break;
    const json& c = *r.chunk;
    offload::IoFuture done;
    try {
      done = io_->read(file(c), c["offset"].get<uint64_t>(),
                       {reinterpret_cast<std::byte*>(r.dst), c["numel"].get<uint64_t>() * 4});
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
