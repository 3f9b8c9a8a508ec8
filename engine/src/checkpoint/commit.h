// The commit protocol of a save (docs/FORMATS.md, "Checkpoints"), the collective steps around a
// rank's own writes. Private to engine/src/checkpoint.
// Thread safety: collectives, called by every rank in the same order on the training thread.
#pragma once

#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/format.h"
#include "strata/engine/comm.h"

namespace strata::engine::ckpt {

// Every rank's string, in rank order, through the communicator (also a barrier).
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine);

// Rank `root`'s string, on every rank.
std::string broadcast_string(Communicator& comm, const std::string& s, int root);

// How ranks agree on a failure: the lowest rank whose `mine` is not empty, with its message, on
// every rank; nullopt when no rank failed. One all-reduce of one number, then one broadcast of
// that rank's message: O(1) messages and bytes a rank at any world size (gathering every rank's
// string was O(world x length) on every rank).
struct RankError {
  int rank;
  std::string message;
};
std::optional<RankError> first_error(Communicator& comm, const std::string& mine);

// A rank's first failure in work that must not leave the collectives around it: attempt(f) runs f
// unless something failed already and keeps the message of the first exception; the ranks then
// agree on it (first_error(comm, message())) once every collective is done.
// Thread safety: none; one thread.
class FirstFailure {
 public:
  // Whether f ran and returned (false: it threw, or an earlier failure skipped it).
  template <class F>
  bool attempt(F&& f) {
    if (failed_) return false;
    try {
      f();
      return true;
    } catch (const std::exception& e) {
      keep(*e.what() ? e.what() : "an error without a message");
      return false;
    }
  }
  // Keeps `message` unless a failure is kept already ("" keeps nothing).
  void keep(const std::string& message) {
    if (failed_ || message.empty()) return;
    failed_ = true;
    message_ = message;
  }
  bool failed() const { return failed_; }
  const std::string& message() const { return message_; }  // "" when none

 private:
  bool failed_ = false;
  std::string message_;
};

// Step 0: un-commits an existing checkpoint <root>/<name> (refuses the latest one unless it is
// incomplete: incomplete_checkpoint).
void uncommit_existing(Communicator& comm, const fs::path& root, const std::string& name);
// Between steps 2 and 3: every rank learns whether any rank's writes failed (`error`: this
// rank's, empty if none); all then throw alike, naming the checkpoint directory `dir`.
void agree_written(Communicator& comm, const fs::path& dir, const std::string& error);
// What a rank wrote (steps 1-2): its data file's and index file's sizes and the index's CRC32C.
struct RankFiles {
  uint64_t data_bytes = 0, index_bytes = 0;
  uint32_t index_crc32c = 0;
};
// Steps 3-5: every rank's RankFiles (this rank's: `mine`) to rank 0, which writes the manifest
// (`manifest` plus "ranks") and then `latest`; a barrier. Three numbers a rank: O(world) bytes.
void commit(Communicator& comm, const fs::path& root, const std::string& name, json manifest, const RankFiles& mine);

}  // namespace strata::engine::ckpt
