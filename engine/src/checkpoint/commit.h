// The commit protocol of a save (docs/FORMATS.md, "Checkpoints"), the collective steps around a
// rank's own writes. Private to engine/src/checkpoint.
// Thread safety: collectives, called by every rank in the same order on the training thread.
#pragma once

#include <string>
#include <vector>

#include "checkpoint/format.h"
#include "strata/engine/comm.h"

namespace strata::engine::ckpt {

// Every rank's string, in rank order, through the communicator (also a barrier).
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine);

// Rank `root`'s string, on every rank.
std::string broadcast_string(Communicator& comm, const std::string& s, int root);

// Step 0: un-commits an existing checkpoint <root>/<name> (refuses the latest one).
void uncommit_existing(Communicator& comm, const fs::path& root, const std::string& name);
// Between steps 2 and 3: every rank learns whether any rank's writes failed (`error`: this
// rank's, empty if none); all then throw alike, naming the checkpoint directory `dir`.
void agree_written(Communicator& comm, const fs::path& dir, const std::string& error);
// Steps 3-5: every rank's index (this rank's: `index`, JSON) to rank 0, which writes the
// manifest (`manifest` plus every rank's chunks) and then `latest`; a barrier.
void commit(Communicator& comm, const fs::path& root, const std::string& name, json manifest,
            const std::string& index);

}  // namespace strata::engine::ckpt
