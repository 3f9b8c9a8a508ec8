// Which rank of a load sees which saving rank's data file, the error naming the files none sees,
// and the end of every load (load_support.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>

#include "checkpoint/commit.h"
#include "checkpoint/format.h"
#include "checkpoint/load_support.h"
#include "strata/engine/checkpoint.h"

namespace strata::engine::ckpt {

namespace {

// Per saving rank: whether this process sees its data file in the checkpoint, as long as the save
// wrote it. An object store is one place every rank reads.
std::vector<int32_t> files_seen(const fs::path& dir, const ChunkCatalog& catalog) {
  std::vector<int32_t> seen(size_t(catalog.saved_world()), 1);
  if (is_object_location(dir)) return seen;
  for (int q = 0; q < catalog.saved_world(); ++q) {
    const uint64_t reach = catalog.data_bytes(q);
    if (reach == 0) continue;
    std::error_code ec;
    const uintmax_t size = fs::file_size(dir / catalog.data_file(q), ec);
    // Format 3 reads where the chunks are from the index file beside the data.
    const bool index = catalog.format() < kFormatWithIndexes || fs::exists(dir / catalog.index_file(q), ec);
    seen[size_t(q)] = !ec && size >= reach && index;
  }
  return seen;
}

// "node 1 (host h1)": where this rank runs, for errors about node-local files.
std::string where_this_rank_runs() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const int node = DistEnv::from_env().node;
  return node >= 0 ? "node " + std::to_string(node) + " (host " + host + ")" : "host " + std::string(host);
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(ranks[i]) + (j > i ? "-" + std::to_string(ranks[j]) : "");
    i = j + 1;
  }
  return out;
}

}  // namespace

FilesSeen files_seen_by_all(Communicator& comm, const fs::path& dir, const ChunkCatalog& catalog) {
  FilesSeen f;
  const int world = comm.world_size();
  f.saved = catalog.saved_world();
  f.words = (size_t(f.saved) + 31) / 32;
  const std::vector<int32_t> here = files_seen(dir, catalog);
  std::vector<uint32_t> mine(f.words, 0);
  for (int q = 0; q < f.saved; ++q)
    if (here[size_t(q)]) mine[size_t(q) / 32] |= 1u << (q % 32);
  // FNV-1a over the words: ranks with the same digest are taken to see the same files.
  uint64_t digest = 1469598103934665603ull;
  for (uint32_t w : mine)
    for (int byte = 0; byte < 4; ++byte) digest = (digest ^ ((w >> (8 * byte)) & 0xffu)) * 1099511628211ull;
  at::Tensor digests = at::empty({world}, at::kLong);
  comm.all_gather(digests, at::full({1}, int64_t(digest), at::kLong))->wait();
  std::vector<int64_t> group_digest;
  f.group.resize(size_t(world));
  const int64_t* digest_of = digests.data_ptr<int64_t>();
  for (int r = 0; r < world; ++r) {
    const int64_t d = digest_of[r];
    const auto it = std::find(group_digest.begin(), group_digest.end(), d);
    f.group[size_t(r)] = int(it - group_digest.begin());
    if (it == group_digest.end()) {
      group_digest.push_back(d);
      f.leader.push_back(r);
    }
  }
  const size_t groups = f.leader.size(), g = size_t(f.group[size_t(comm.rank())]);
  at::Tensor table = at::zeros({int64_t(groups * f.words)}, at::kInt);
  if (f.leader[g] == comm.rank()) std::memcpy(table.data_ptr<int32_t>() + g * f.words, mine.data(), f.words * 4);
  comm.all_reduce(table, ReduceOp::kSum);  // one row a group, only its leader's non-zero: exact
  f.bits.assign(reinterpret_cast<const uint32_t*>(table.data_ptr<int32_t>()),
                reinterpret_cast<const uint32_t*>(table.data_ptr<int32_t>()) + table.numel());
  at::Tensor differs = at::full({1}, int32_t(!std::equal(mine.begin(), mine.end(), f.bits.begin() + long(g * f.words))),
                                at::kInt);
  comm.all_reduce(differs, ReduceOp::kMax);
  if (differs.item<int32_t>() != 0) {
    // Two pictures with one digest: every rank its own group.
    at::Tensor all = at::empty({int64_t(world) * int64_t(f.words)}, at::kInt);
    comm.all_gather(all, at::from_blob(mine.data(), {int64_t(f.words)}, at::kInt).clone())->wait();
    f.bits.assign(reinterpret_cast<const uint32_t*>(all.data_ptr<int32_t>()),
                  reinterpret_cast<const uint32_t*>(all.data_ptr<int32_t>()) + all.numel());
    f.leader.resize(size_t(world));
    for (int r = 0; r < world; ++r) f.group[size_t(r)] = f.leader[size_t(r)] = r;
  }
  f.all = true;
  for (size_t k = 0; k < f.leader.size() && f.all; ++k)
    for (int q = 0; q < f.saved && f.all; ++q) f.all = (f.bits[k * f.words + size_t(q) / 32] >> (q % 32) & 1u) != 0;
  return f;
}

[[noreturn]] void throw_missing_files(Communicator& comm, const fs::path& dir, const json& m,
                                      std::map<int, std::vector<int>> missing) {
  const int world = comm.world_size(), saved = m["world_size"].get<int>();
  const std::vector<std::string> places =
      all_gather_strings(comm, where_this_rank_runs() + "\t" + fs::absolute(dir).string());
  std::vector<std::pair<std::string, std::vector<int>>> ranks_at;
  for (int r = 0; r < world; ++r) {
    auto it = std::find_if(ranks_at.begin(), ranks_at.end(), [&](const auto& p) { return p.first == places[size_t(r)]; });
    if (it == ranks_at.end()) ranks_at.push_back({places[size_t(r)], {r}});
    else it->second.push_back(r);
  }
  std::string files, looked;
  for (auto& [q, needers] : missing) {
    std::sort(needers.begin(), needers.end());
    files += std::string(files.empty() ? "" : "; ") + data_prefix(m) + rank_name(q) + ".data is missing (saved by rank " +
             std::to_string(q) + " of " + std::to_string(saved) + ", needed by rank" + (needers.size() > 1 ? "s " : " ") +
             rank_list(needers) + ")";
  }
  for (const auto& [place, ranks] : ranks_at) {
    const size_t tab = place.find('\t');
    looked += std::string(looked.empty() ? "" : "; ") + place.substr(0, tab) + ", rank" +
              (ranks.size() > 1 ? "s " : " ") + rank_list(ranks) + ": " + place.substr(tab + 1);
  }
  if (world == 1) throw std::runtime_error("checkpoint " + dir.string() + ": " + files + ". Looked in " + looked);
  throw std::runtime_error("checkpoint " + dir.string() + ": " + files + "; no rank of this run sees " +
                           (missing.size() > 1 ? "them" : "it") + ". Where each node looked: " + looked +
                           ". Copy " + (missing.size() > 1 ? "them" : "it") +
                           " (with the .index.json beside it) into that directory on any node (each rank reads what its "
                           "node sees; the rest travels over the network)");
}

CheckpointMeta finish_load(Engine& engine, Communicator& comm, const fs::path& dir, const json& m) {
  engine.refresh_compute_copies();
  const json& c = m["counters"];
  engine.set_counters({c["optimizer_step"].get<int64_t>(), c["loss_scale"].get<double>(),
                       c["good_steps"].get<int64_t>()});
  comm.barrier();
  return checkpoint_meta(m, dir);
}

}  // namespace strata::engine::ckpt
