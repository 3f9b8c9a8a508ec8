// Checkpoints in object storage: committed local checkpoints uploaded in the background (tiered
// saves), found again and loaded from there at any world size.
//
// Layout under a store (an s3://bucket/prefix URL, or a directory through the file driver):
//   <name>/<save id>/rank-RRRRR.data   rank R's data file, uploaded by rank R from its own disk;
//                                      the save id (16 hex digits) is new for every upload, so
//                                      these objects are immutable and never overwritten
//   <name>/manifest.json               the local manifest plus {"store": {"save_id", "uploaded_from"}},
//                                      written last, by rank 0, create-only: the commit point
//   latest                             a hint: the name rank 0 committed last
// A checkpoint there is addressed as "<store URL>/<name>"; load_checkpoint, verify_checkpoint,
// describe_checkpoint, read_checkpoint_meta and export_checkpoint_hf (checkpoint.h) take such
// a URL as well as a directory, and read only the chunks they need, with ranged GETs.
//
// What a reader may see and what it does (the protocol, docs/FORMATS.md):
//   - a manifest is there only once every rank's data object was completed, so a checkpoint with
//     a manifest is whole; a name without one is never loaded;
//   - manifests are never overwritten in place: a name saved again stays committed while the new
//     data goes up; at the commit its manifest is deleted, then the new one (naming its own save
//     id) is created, then the old data goes, so a stale read shows either the old checkpoint
//     whole (its own data, checked by CRC), the new one whole, or none;
//   - the newest checkpoint is the newest name among those the listing shows and the one the
//     `latest` hint names, whose manifest reads back: a listing that misses new keys or a stale
//     hint can make it an older committed checkpoint, never an uncommitted or mixed one;
//   - pruning deletes a checkpoint's manifest first, then its data;
//   - a data upload that a killed rank left incomplete is never an object; the next uploader
//     aborts it, so that the store drops its parts.
// Errors: ObjectStoreError (offload/object_store.h) from the store, std::runtime_error for a bad
// checkpoint, each naming the checkpoint and the object. A failed upload leaves the local
// checkpoint, and every committed one in the store, as they were.
// Thread safety: the uploader's methods are collectives called by every rank on the training
// thread in the same order; each rank's upload runs on a thread of its own.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "strata/engine/comm.h"
#include "strata/offload/object_store.h"

namespace strata::engine {

class CheckpointUploader {
 public:
  // On rank 0 it first aborts the multipart uploads in progress under the store: what a run
  // killed mid-upload left (parts the store keeps, and bills, until aborted). Before this run
  // uploads anything; a second run uploading into the same store at once is not supported.
  CheckpointUploader(Communicator& comm, std::string store_url, offload::TransferOptions transfer = {});
  ~CheckpointUploader();  // waits for this rank's upload thread; commits nothing

  // Collective: starts uploading the committed local checkpoint directory `dir` (every rank its
  // own data file), finishing an upload in flight first. Blocks only to agree on a save id.
  void start(const std::filesystem::path& dir);
  // Collective, at the same point of every step: when every rank's upload is done, rank 0 writes
  // the manifest and the hint; returns the committed checkpoint's URL then. A failed upload
  // returns nullopt with last_error() set on every rank (the local checkpoint is intact).
  std::optional<std::string> poll();
  // Collective: waits for the upload in flight and commits it (or fails as poll does).
  std::optional<std::string> finish();
  bool in_flight() const { return pending_ != nullptr; }
  const std::string& last_error() const { return last_error_; }
  // Rank 0, after a commit: what failed after the manifest was in (the hint, the deletion of a
  // replaced checkpoint's data); the checkpoint is committed all the same. Empty if nothing.
  const std::string& last_warning() const { return last_warning_; }
  const std::string& store_url() const { return store_url_; }
  // Rank 0: the uploads the constructor aborted, and why it could not look if it could not
  // (empty otherwise; training goes on either way).
  const std::vector<offload::PendingUpload>& aborted_leftovers() const { return aborted_; }
  const std::string& leftover_error() const { return leftover_error_; }
  // This rank's bytes uploaded and seconds taken by the last committed upload.
  uint64_t last_bytes() const { return last_bytes_; }
  double last_seconds() const { return last_seconds_; }

 private:
  struct Pending;
  std::optional<std::string> complete(bool wait);
  Communicator& comm_;
  std::string store_url_;
  offload::TransferOptions transfer_;
  std::unique_ptr<offload::ObjectStore> store_;
  std::unique_ptr<Pending> pending_;
  std::string last_error_;
  std::string last_warning_;
  std::vector<offload::PendingUpload> aborted_;
  std::string leftover_error_;
  uint64_t last_bytes_ = 0;
  double last_seconds_ = 0;
};

// The committed checkpoints a store shows (names whose manifest reads back), sorted by name.
std::vector<std::string> stored_checkpoints(const std::string& store_url);
// The URL of the newest committed checkpoint in the store (listing and hint, as above), if any.
std::optional<std::string> newest_stored_checkpoint(const std::string& store_url);
// Collective: deletes all but the `keep` newest committed checkpoints in the store (rank 0:
// each manifest first, then its data objects).
void prune_stored_checkpoints(Communicator& comm, const std::string& store_url, size_t keep);

}  // namespace strata::engine
