#include "checkpoint/catalog.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <thread>

#include "strata/offload/crc32c.h"

namespace strata::engine::ckpt {

struct ChunkCatalog::RankIndex {
  // [unit * kSavedKinds + kind]: the slice's first chunk's offset and where its CRCs start in crc.
  std::vector<uint64_t> offset, first_crc;
  std::vector<uint32_t> crc;
};

namespace {

const char kHex[] = "0123456789abcdef";

uint32_t parse_hex8(const char* p, bool& ok) {
  uint32_t v = 0;
  for (int i = 0; i < 8; ++i) {
    const char c = p[i];
    const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) ok = false;
    v = v << 4 | uint32_t(d & 15);
  }
  return v;
}

}  // namespace

std::string index_text(int rank, uint64_t chunk_elements, const std::vector<SliceRecord>& slices) {
  json list = json::array();
  for (const SliceRecord& s : slices) {
    std::string crcs(s.crc32c.size() * 8, '0');
    for (size_t i = 0; i < s.crc32c.size(); ++i)
      for (int d = 0; d < 8; ++d) crcs[i * 8 + size_t(d)] = kHex[(s.crc32c[i] >> (28 - 4 * d)) & 15];
    list.push_back(json::array({s.unit, s.kind, s.offset, std::move(crcs)}));
  }
  // One slice a line: small, and still readable.
  std::string out = "{\"format\": " + std::to_string(kFormatWithIndexes) + ", \"rank\": " + std::to_string(rank) +
                    ", \"chunk_elements\": " + std::to_string(chunk_elements) + ", \"slices\": [";
  for (size_t i = 0; i < list.size(); ++i) out += (i ? ",\n " : "\n ") + list[i].dump();
  return out + "\n]}\n";
}

ChunkCatalog::ChunkCatalog(fs::path location, const json& m) : location_(std::move(location)) {
  where_ = "checkpoint " + location_.string();
  try {
    format_ = m.at("format").get<int>();
    saved_world_ = m.at("world_size").get<int>();
    prefix_ = data_prefix(m);
    for (const json& u : m.at("units")) {
      unit_names_.push_back(u.at("name").get<std::string>());
      numel_.push_back(u.at("numel").get<uint64_t>());
    }
    if (saved_world_ < 1) throw std::runtime_error("world_size " + std::to_string(saved_world_));
    if (format_ >= kFormatWithIndexes) {
      chunk_elements_ = m.at("chunk_elements").get<uint64_t>();
      shard_ = m.at("shards").get<std::vector<uint64_t>>();
      if (chunk_elements_ == 0 || shard_.size() != numel_.size())
        throw std::runtime_error("chunk_elements and shards do not describe the units");
      for (size_t u = 0; u < numel_.size(); ++u)
        if (shard_[u] * uint64_t(saved_world_) < numel_[u])
          throw std::runtime_error("the shards of unit " + unit_names_[u] + " do not hold it");
      const json& ranks = m.at("ranks");
      if (ranks.size() != size_t(saved_world_)) throw std::runtime_error("ranks lists another world size");
      for (const json& r : ranks)
        ranks_.push_back({r.at("index_bytes").get<uint64_t>(), r.at("data_bytes").get<uint64_t>(),
                          r.at("index_crc32c").get<uint32_t>()});
      return;
    }
    listed_.assign(numel_.size(), std::vector<std::vector<Chunk>>(state::kSavedKinds));
    listed_reach_.assign(size_t(saved_world_), 0);
    for (const json& j : m.at("chunks")) {
      Chunk c;
      c.rank = j.at("rank").get<int>();
      c.unit = j.at("unit").get<size_t>();
      c.kind = -1;
      for (int k = 0; k < state::kSavedKinds; ++k)
        if (j.at("kind") == state::kind_name(k)) c.kind = k;
      c.begin = j.at("begin").get<uint64_t>();
      c.numel = j.at("numel").get<uint64_t>();
      c.offset = j.at("offset").get<uint64_t>();
      c.crc32c = j.at("crc32c").get<uint32_t>();
      c.placed = true;
      if (c.kind < 0) throw std::runtime_error("unknown state kind " + j["kind"].dump());
      if (c.unit >= numel_.size()) throw std::runtime_error("a chunk of unknown unit " + std::to_string(c.unit));
      if (c.rank < 0 || c.rank >= saved_world_)
        throw std::runtime_error("a chunk of rank " + std::to_string(c.rank) + " in a save of " +
                                 std::to_string(saved_world_) + " ranks");
      if (j.at("file").get<std::string>() != rank_name(c.rank) + ".data")
        throw std::runtime_error("a chunk of rank " + std::to_string(c.rank) + " in file " + j["file"].dump());
      listed_reach_[size_t(c.rank)] = std::max(listed_reach_[size_t(c.rank)], c.offset + c.numel * 4);
      listed_[c.unit][size_t(c.kind)].push_back(c);
    }
  } catch (const json::exception& e) {
    throw std::runtime_error(where_ + ": manifest.json: " + e.what());
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(where_ + ": manifest.json: " + e.what());
  }
  // Each (unit, kind)'s chunks cover its elements exactly once: so every rank's slices are
  // covered too, and an exchange writes each chunk at its own place in a buffer.
  for (size_t u = 0; u < numel_.size(); ++u)
    for (int k = 0; k < state::kSavedKinds; ++k) {
      std::vector<Chunk>& cs = listed_[u][size_t(k)];
      std::sort(cs.begin(), cs.end());
      uint64_t next = 0;
      for (const Chunk& c : cs) next = c.begin == next ? c.end() : ~0ull;
      if (next != numel_[u])
        throw std::runtime_error(where_ + ": the manifest's chunks do not cover " + state::kind_name(k) + " of unit " +
                                 unit_names_[u] + " exactly once");
    }
}

ChunkCatalog::~ChunkCatalog() = default;

uint64_t ChunkCatalog::valid_of(size_t u, int q) const {
  const uint64_t b = uint64_t(q) * shard_[u];
  return b >= numel_[u] ? 0 : std::min(shard_[u], numel_[u] - b);
}

std::vector<Chunk> ChunkCatalog::overlapping(size_t u, int k, uint64_t b, uint64_t e) const {
  std::vector<Chunk> out;
  e = std::min(e, unit_numel(u));
  if (b >= e) return out;
  if (format_ < kFormatWithIndexes) {
    const std::vector<Chunk>& cs = listed_[u][size_t(k)];
    auto it = std::upper_bound(cs.begin(), cs.end(), b, [](uint64_t x, const Chunk& c) { return x < c.begin; });
    if (it != cs.begin()) --it;
    for (; it != cs.end() && it->begin < e; ++it)
      if (it->end() > b) out.push_back(*it);
    return out;
  }
  const uint64_t shard = shard_[u];
  for (int q = int(b / shard); q < saved_world_ && uint64_t(q) * shard < e; ++q) {
    const uint64_t sb = uint64_t(q) * shard, valid = valid_of(u, q);
    if (valid == 0) break;
    const uint64_t lo = std::max(b, sb), hi = std::min(e, sb + valid);
    if (lo >= hi) continue;
    const SliceChunks cut{valid, chunk_elements_};
    for (uint64_t i = cut.chunk_at(lo - sb); cut.first(i) < hi - sb; ++i) {
      Chunk c;
      c.rank = q;
      c.unit = u;
      c.kind = k;
      c.begin = sb + cut.first(i);
      c.numel = cut.numel_of(i);
      out.push_back(c);
    }
  }
  return out;
}

uint64_t ChunkCatalog::chunk_count() const {
  uint64_t n = 0;
  for (size_t u = 0; u < numel_.size(); ++u)
    for (int k = 0; k < state::kSavedKinds; ++k) {
      if (format_ < kFormatWithIndexes) {
        n += listed_[u][size_t(k)].size();
        continue;
      }
      for (int q = 0; q < saved_world_; ++q) n += SliceChunks{valid_of(u, q), chunk_elements_}.count();
    }
  return n;
}

uint64_t ChunkCatalog::data_bytes(int q) const {
  if (format_ < kFormatWithIndexes) return listed_reach_.at(size_t(q));
  return ranks_.at(size_t(q)).data_bytes;
}

std::string ChunkCatalog::data_file(int q) const { return prefix_ + rank_name(q) + ".data"; }
std::string ChunkCatalog::index_file(int q) const { return prefix_ + rank_name(q) + ".index.json"; }

std::string ChunkCatalog::name(const Chunk& c) const {
  return rank_name(c.rank) + ".data" + (c.placed ? " at offset " + std::to_string(c.offset) : std::string()) +
         " (unit " + (c.unit < unit_names_.size() ? unit_names_[c.unit] : std::to_string(c.unit)) + ", " +
         state::kind_name(c.kind) + ", elements " + std::to_string(c.begin) + "+" + std::to_string(c.numel) + ")";
}

std::string ChunkCatalog::read_index_text(int q) {
  const std::string file = index_file(q);
  if (!is_object_location(location_)) {
    if (!fs::exists(location_ / file)) throw std::runtime_error(where_ + ": index file " + file + " is missing");
    return read_text(location_ / file);
  }
  if (!store_) {
    ObjectLocation at = open_object_location(location_);
    store_ = std::move(at.store);
    object_name_ = std::move(at.name);
  }
  // Index objects are written before the manifest that names them; a missing one is a store that
  // lags (asked again for about 4 s, as data objects are), or one deleted since.
  for (int attempt = 0;; ++attempt) {
    try {
      const std::vector<std::byte> bytes = store_->get_all(object_name_ + "/" + file);
      return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    } catch (const offload::ObjectStoreError& e) {
      if (e.kind() != offload::ObjectStoreError::Kind::kNotFound || attempt >= 4)
        throw std::runtime_error(where_ + ": cannot read index " + file + ": " + e.what());
      std::this_thread::sleep_for(std::chrono::milliseconds(250 << attempt));
    }
  }
}

ChunkCatalog::RankIndex ChunkCatalog::parse_index(int q, const std::string& text) const {
  const std::string file = rank_name(q) + ".index.json";
  const RankRecord& want = ranks_.at(size_t(q));
  if (text.size() != want.index_bytes || offload::crc32c(text.data(), text.size()) != want.index_crc32c)
    throw std::runtime_error(where_ + ": index file " + file + " is not the one saved (" + std::to_string(text.size()) +
                             " bytes, the manifest says " + std::to_string(want.index_bytes) + "; or CRC32C mismatch)");
  const auto bad = [&](const std::string& why) { return std::runtime_error(where_ + ": index file " + file + ": " + why); };
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw bad(e.what());
  }
  RankIndex ix;
  const size_t slots = numel_.size() * state::kSavedKinds;
  ix.offset.assign(slots, ~0ull);
  ix.first_crc.assign(slots, 0);
  try {
    if (j.at("format").get<int>() != kFormatWithIndexes || j.at("rank").get<int>() != q ||
        j.at("chunk_elements").get<uint64_t>() != chunk_elements_)
      throw bad("another format, rank or chunk size than the manifest's");
    for (const json& s : j.at("slices")) {
      const size_t u = s.at(0).get<size_t>();
      const int k = s.at(1).get<int>();
      const uint64_t offset = s.at(2).get<uint64_t>();
      const std::string& crcs = s.at(3).get_ref<const std::string&>();
      if (u >= numel_.size() || k < 0 || k >= state::kSavedKinds || ix.offset[u * state::kSavedKinds + size_t(k)] != ~0ull)
        throw bad("a slice of unknown or repeated unit and kind");
      const uint64_t valid = valid_of(u, q);
      const SliceChunks cut{valid, chunk_elements_};
      const uint64_t n = cut.count();
      if (n == 0) throw bad("a slice of unit " + unit_names_[u] + ", of which rank " + std::to_string(q) + " holds nothing");
      if (crcs.size() != n * 8)
        throw bad("unit " + unit_names_[u] + " " + state::kind_name(k) + " has " + std::to_string(crcs.size() / 8) +
                  " chunk CRCs, its " + std::to_string(valid) + " elements make " + std::to_string(n));
      if (offset % kAlign != 0 || offset + cut.file_bytes() > ranks_[size_t(q)].data_bytes)
        throw bad("unit " + unit_names_[u] + " " + state::kind_name(k) + " lies outside the data file");
      ix.offset[u * state::kSavedKinds + size_t(k)] = offset;
      ix.first_crc[u * state::kSavedKinds + size_t(k)] = ix.crc.size();
      bool ok = true;
      for (uint64_t i = 0; i < n; ++i) ix.crc.push_back(parse_hex8(crcs.data() + i * 8, ok));
      if (!ok) throw bad("a CRC that is not 8 hex digits");
    }
  } catch (const json::exception& e) {
    throw bad(e.what());
  }
  for (size_t u = 0; u < numel_.size(); ++u)
    for (int k = 0; k < state::kSavedKinds; ++k)
      if (valid_of(u, q) > 0 && ix.offset[u * state::kSavedKinds + size_t(k)] == ~0ull)
        throw bad("no slice of unit " + unit_names_[u] + " " + state::kind_name(k));
  return ix;
}

const ChunkCatalog::RankIndex& ChunkCatalog::index_of(int q) {
  auto it = indexes_.find(q);
  if (it != indexes_.end()) return it->second;
  const std::string text = read_index_text(q);
  index_bytes_read_ += text.size();
  return indexes_.emplace(q, parse_index(q, text)).first->second;
}

Chunk ChunkCatalog::place(const Chunk& c) {
  if (c.placed) return c;
  if (format_ < kFormatWithIndexes) {
    for (const Chunk& l : overlapping(c.unit, c.kind, c.begin, c.begin + 1))
      if (l.begin == c.begin) return l;
    throw std::runtime_error(where_ + ": no chunk " + name(c));
  }
  const RankIndex& ix = index_of(c.rank);
  const size_t slot = c.unit * state::kSavedKinds + size_t(c.kind);
  const SliceChunks cut{valid_of(c.unit, c.rank), chunk_elements_};
  const uint64_t i = cut.chunk_at(c.begin - uint64_t(c.rank) * shard_[c.unit]);
  Chunk out = c;
  out.offset = ix.offset[slot] + cut.offset(i);
  out.crc32c = ix.crc[ix.first_crc[slot] + i];
  out.placed = true;
  return out;
}

std::vector<Chunk> ChunkCatalog::of_rank(int q) {
  std::vector<Chunk> out;
  for (size_t u = 0; u < numel_.size(); ++u)
    for (int k = 0; k < state::kSavedKinds; ++k) {
      if (format_ < kFormatWithIndexes) {
        for (const Chunk& c : listed_[u][size_t(k)])
          if (c.rank == q) out.push_back(c);
        continue;
      }
      const uint64_t sb = uint64_t(q) * shard_[u];
      for (const Chunk& c : overlapping(u, k, sb, sb + valid_of(u, q)))
        if (c.rank == q) out.push_back(place(c));
    }
  std::sort(out.begin(), out.end(), [](const Chunk& a, const Chunk& b) { return a.offset < b.offset; });
  return out;
}

}  // namespace strata::engine::ckpt
