#include "checkpoint/chunk_reader.h"

#include <algorithm>
#include <deque>
#include <span>
#include <stdexcept>

#include "strata/offload/crc32c.h"

namespace strata::engine::ckpt {

ChunkReader::ChunkReader(fs::path dir, const json& units)
    : dir_(std::move(dir)), units_(units), io_(offload::IoEngine::create()) {}

offload::File& ChunkReader::file(const json& chunk) {
  const std::string name = chunk["file"].get<std::string>();
  auto it = files_.find(name);
  if (it == files_.end()) {
    if (!fs::exists(dir_ / name))
      throw std::runtime_error("checkpoint " + dir_.string() + ": data file " + name + " is missing");
    it = files_.emplace(name, offload::File::open(dir_ / name, offload::OpenMode::kRead)).first;
  }
  return it->second;
}

void ChunkReader::read(const std::vector<Request>& batch, size_t window) {
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
