// Commit protocol (docs/FORMATS.md, "Checkpoints"). Written for a power cut under strict POSIX
// rules: a file's data is durable only after its fsync, and a created, renamed or removed
// directory entry only after an fsync of the directory holding it. A step counts as saved
// ("committed" printed and logged, retention run) only once every step below has returned.
//  0. Saving over an existing name first un-commits it: rank 0 removes its manifest and fsyncs
//     the step directory, then a barrier; so a crash while rewriting never leaves a manifest over
//     half-written data.
//  1. Each rank creates <root>/<name>/ itself (offload::create_directories_durably: mkdir -p
//     with the parent of every level it created fsynced, the root's own parents included when
//     the run creates the root), so it depends on no directory another rank made; it writes
//     rank-R.data with the I/O engine and fsyncs it.
//  2. Each rank writes rank-R.index.json atomically (temporary file, fsync, rename, fsync of the
//     step directory, which also makes the data file's entry durable).
//  3. Each rank's file sizes and index CRC travel to rank 0 over the communicator (an all-gather
//     of three numbers a rank, which is also the barrier): no rank reads a file another rank
//     wrote, and the manifest names each index with its size and CRC.
//  4. Rank 0 writes manifest.json atomically (its rename fsynced in the step directory). This is
//     the commit point: a directory without a manifest is never loaded, whatever else it holds.
//  5. Rank 0 replaces <root>/latest atomically (its rename fsynced in the root); then every rank
//     passes a barrier, and the caller may report the commit.
// A crash before 4 leaves an uncommitted directory that load refuses and `latest` still names
// the previous checkpoint; a crash between 4 and 5 leaves a committed checkpoint that `latest`
// does not name yet. Either way `--resume` finds a complete checkpoint (find_resume_point in
// inspect.cc). Retention (prune_checkpoints, below) runs only after 5, removes a checkpoint's
// manifest durably before any of its files, and removes the half-written directories a crash
// left, so no manifest ever outlives the files it names.
#include "checkpoint/commit.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <vector>

#include "strata/engine/checkpoint.h"
#include "strata/offload/file.h"

namespace strata::engine {
namespace ckpt {

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

std::string broadcast_string(Communicator& comm, const std::string& s, int root) {
  at::Tensor len = at::full({1}, int64_t(s.size()), at::kLong);
  comm.broadcast(len, root);
  const int64_t n = len.item<int64_t>();
  // Whole int32 words: the byte type is not one every backend reduces or moves.
  at::Tensor words = at::zeros({(n + 3) / 4 + 1}, at::kInt);
  if (comm.rank() == root) std::memcpy(words.data_ptr<int32_t>(), s.data(), s.size());
  comm.broadcast(words, root);
  return std::string(reinterpret_cast<const char*>(words.data_ptr<int32_t>()), size_t(n));
}

std::optional<RankError> first_error(Communicator& comm, const std::string& mine) {
  // The maximum of (world - rank) over the failed ranks names the lowest of them.
  at::Tensor flag = at::full({1}, mine.empty() ? int64_t(0) : int64_t(comm.world_size() - comm.rank()), at::kLong);
  comm.all_reduce(flag, ReduceOp::kMax);
  const int64_t v = flag.item<int64_t>();
  if (v == 0) return std::nullopt;
  const int rank = comm.world_size() - int(v);
  return RankError{rank, broadcast_string(comm, mine, rank)};
}

// Step 0 (collective): un-commit an existing checkpoint of this name. Rank 0's failure reaches
// every rank (first_error), so that no rank waits in a collective for one that threw.
void uncommit_existing(Communicator& comm, const fs::path& root, const std::string& name) {
  const fs::path dir = root / name;
  std::string error;
  if (comm.rank() == 0 && fs::exists(dir / "manifest.json")) {
    try {
      std::ifstream in(root / "latest");
      std::string latest;
      std::getline(in, latest);
      // The checkpoint `latest` names is the run's newest good state, never saved over; unless
      // it is incomplete (damaged: a resume took an older one instead, find_resume_point).
      if (latest == name && incomplete_checkpoint(dir).empty())
        throw std::runtime_error("cannot save over " + dir.string() +
                                 ": it is the latest checkpoint; save under another name");
      if (::unlink((dir / "manifest.json").c_str()) != 0 && errno != ENOENT)
        fail_errno("cannot un-commit (remove the manifest of)", dir);
      offload::sync_directory(dir);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (const auto failed = first_error(comm, error)) throw std::runtime_error(failed->message);
}

// Every rank learns whether any rank's writes failed; all then throw alike.
void agree_written(Communicator& comm, const fs::path& dir, const std::string& error) {
  at::Tensor failed = at::full({1}, error.empty() ? 0 : 1, at::kInt);
  comm.all_reduce(failed, ReduceOp::kMax);
  if (failed.item<int>() != 0)
    throw std::runtime_error("checkpoint " + dir.string() + " not saved" +
                             (error.empty() ? " (another rank failed)" : ": " + error) +
                             "; the previous checkpoint is intact");
}

// Steps 3-5 (collective): the ranks' file records to rank 0, manifest, latest, barrier.
void commit(Communicator& comm, const fs::path& root, const std::string& name, json manifest, const RankFiles& mine) {
  at::Tensor record = at::empty({3}, at::kLong);
  record[0] = int64_t(mine.data_bytes);
  record[1] = int64_t(mine.index_bytes);
  record[2] = int64_t(mine.index_crc32c);
  at::Tensor all = at::empty({3 * int64_t(comm.world_size())}, at::kLong);
  comm.all_gather(all, record)->wait();
  if (comm.rank() == 0) {
    json ranks = json::array();
    const int64_t* r = all.data_ptr<int64_t>();
    for (int q = 0; q < comm.world_size(); ++q, r += 3)
      ranks.push_back({{"data_bytes", r[0]}, {"index_bytes", r[1]}, {"index_crc32c", uint32_t(r[2])}});
    manifest["ranks"] = std::move(ranks);
    write_atomically((root / name) / "manifest.json", manifest.dump(1));
    write_atomically(root / "latest", name + "\n");
  }
  comm.barrier();
}

}  // namespace ckpt

using namespace ckpt;

void prune_checkpoints(Communicator& comm, const fs::path& root, size_t keep) {
  // Rank 0 decides from its root (with node-local disks only its holds `latest` and every name):
  // committed checkpoints beyond the `keep` newest (never the latest), and every step directory
  // without a manifest (a crash's half-written save: no save is in flight while this runs). The
  // list, a line "c NAME" or "u NAME" each, reaches every rank.
  std::string doomed_list;
  if (comm.rank() == 0) {
    std::string latest;
    {
      std::ifstream in(root / "latest");
      std::getline(in, latest);
    }
    const StepDirectories steps = step_directories(root);
    const std::vector<std::string>& committed = steps.committed;
    for (const std::string& n : steps.half_written)
      if (n != latest) doomed_list += "u " + n + "\n";
    if (keep > 0 && committed.size() > keep)
      for (size_t i = 0; i + keep < committed.size(); ++i)
        if (committed[i] != latest) doomed_list += "c " + committed[i] + "\n";
  }
  doomed_list = broadcast_string(comm, doomed_list, 0);
  std::vector<std::string> doomed;
  std::string error;  // rank 0's: an un-commit that failed stops the retention before any file goes
  for (size_t at = 0, nl; (nl = doomed_list.find('\n', at)) != std::string::npos; at = nl + 1) {
    doomed.push_back(doomed_list.substr(at + 2, nl - at - 2));
    if (doomed_list[at] != 'c' || comm.rank() != 0 || !error.empty()) continue;
    try {  // un-committed durably before any file it names goes
      const fs::path dir = root / doomed.back();
      if (::unlink((dir / "manifest.json").c_str()) != 0 && errno != ENOENT)
        fail_errno("retention: cannot un-commit (remove the manifest of)", dir);
      offload::sync_directory(dir);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (doomed.empty()) return;
  if (const auto failed = first_error(comm, error))  // also the barrier before any removal
    throw std::runtime_error(failed->message + " (no checkpoint files were removed)");
  // Each rank removes its own files; then a directory that is not empty yet holds files of ranks
  // no longer in the run (a world that shrank) or a crash's leftovers, which whoever sees them
  // removes (on node-local disks no other node could; ranks sharing a disk race harmlessly, a
  // file already gone skipped).
  const std::string mine = rank_name(comm.rank());
  for (const auto& n : doomed) {
    ::unlink((root / n / (mine + ".data")).c_str());
    ::unlink((root / n / (mine + ".index.json")).c_str());
    ::unlink((root / n / (mine + ".index.json.tmp")).c_str());
  }
  comm.barrier();
  bool removed = false;
  for (const auto& n : doomed) {
    if (::rmdir((root / n).c_str()) != 0 && errno == ENOTEMPTY) {
      std::error_code ec;
      for (fs::directory_iterator it(root / n, ec), end; !ec && it != end; it.increment(ec))
        ::unlink(it->path().c_str());
      ::rmdir((root / n).c_str());
    }
    removed = removed || !fs::exists(root / n);
  }
  // The removals made durable, so that a removed directory does not come back after a cut (it
  // would come back without a manifest, and the next retention would remove it again). What is
  // left undone here is harmless (no manifest remains): each rank reports its own failure, and
  // every rank leaves together.
  error.clear();
  try {
    if (removed && fs::exists(root)) offload::sync_directory(root);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (const auto failed = first_error(comm, error)) throw std::runtime_error("retention: " + failed->message);
}

}  // namespace strata::engine
