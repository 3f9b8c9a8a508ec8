// Checkpoints in object storage (checkpoint_store.h states the layout and the protocol).
#include "strata/engine/checkpoint_store.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <thread>

#include "checkpoint/commit.h"
#include "checkpoint/format.h"

namespace strata::engine {

using namespace ckpt;
using offload::ObjectStoreError;

namespace {

constexpr const char* kHintKey = "latest";

std::string text_of(const std::vector<std::byte>& bytes) {
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

// The manifest of `name` in the store (read_stored_manifest), checked to be an upload's.
std::optional<json> stored_manifest(offload::ObjectStore& store, const std::string& name) {
  std::optional<json> m = read_stored_manifest(store, name);
  if (m && (!m->contains("store") || !(*m)["store"].contains("save_id")))
    throw std::runtime_error("checkpoint " + store.url_of(stored_manifest_key(name)) +
                             ": a manifest without a save id (not written by an upload)");
  return m;
}

// Names the listing shows with a manifest, and the one the hint names (unchecked).
std::set<std::string> candidate_names(offload::ObjectStore& store) {
  std::set<std::string> names;
  for (const offload::ObjectInfo& o : store.list("")) {
    const size_t slash = o.key.find('/');
    if (slash != std::string::npos && o.key == stored_manifest_key(o.key.substr(0, slash)))
      names.insert(o.key.substr(0, slash));
  }
  try {
    std::string hint = text_of(store.get_all(kHintKey));
    while (!hint.empty() && (hint.back() == '\n' || hint.back() == '\r')) hint.pop_back();
    if (!hint.empty() && hint.find('/') == std::string::npos && hint != "." && hint != "..") names.insert(hint);
  } catch (const ObjectStoreError& e) {
    if (e.kind() != ObjectStoreError::Kind::kNotFound) throw;
  }
  return names;
}

void remove_prefix(offload::ObjectStore& store, const std::string& prefix) {
  for (const offload::ObjectInfo& o : store.list(prefix)) store.remove(o.key);
}

std::string random_save_id(Communicator& comm) {
  // Every rank draws; the largest wins, so all agree without a broadcast.
  std::random_device rd;
  const int64_t mine = int64_t((uint64_t(rd()) << 31 ^ uint64_t(rd())) & 0x7fffffffffffffffull);
  at::Tensor t = at::full({1}, mine, at::kLong);
  comm.all_reduce(t, ReduceOp::kMax);
  char id[24];
  std::snprintf(id, sizeof id, "%016llx", static_cast<unsigned long long>(t.item<int64_t>()));
  return id;
}

}  // namespace

struct CheckpointUploader::Pending {
  fs::path dir;
  std::string name;
  std::string save_id;
  std::string replaced_save_id;  // of the checkpoint of the same name this one replaces
  std::string error;             // this rank's; written by the thread before `done`
  std::atomic<bool> done{false};
  std::thread thread;
  uint64_t bytes = 0;
  double seconds = 0;
};

CheckpointUploader::CheckpointUploader(Communicator& comm, std::string store_url, offload::TransferOptions transfer)
    : comm_(comm), store_url_(std::move(store_url)), transfer_(transfer), store_(offload::open_object_store(store_url_)) {
  store_url_ = store_->url();
  if (comm_.rank() != 0) return;
  try {
    for (const offload::PendingUpload& u : store_->list_multipart_uploads("")) {
      store_->abort_multipart_upload(u);
      aborted_.push_back(u);
    }
  } catch (const offload::ObjectStoreError& e) {
    leftover_error_ = e.what();
  }
}

CheckpointUploader::~CheckpointUploader() {
  if (pending_ && pending_->thread.joinable()) pending_->thread.join();
}

void CheckpointUploader::start(const fs::path& dir_arg) {
  if (pending_) finish();
  fs::path dir = dir_arg;
  if (!dir.has_filename()) dir = dir.parent_path();
  auto p = std::make_unique<Pending>();
  p->dir = dir;
  p->name = dir.filename().string();
  p->save_id = random_save_id(comm_);
  Pending* raw = p.get();
  p->thread = std::thread([this, raw] {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string file = rank_name(comm_.rank()) + ".data";
    const std::string index = rank_name(comm_.rank()) + ".index.json";
    try {
      if (raw->error.empty()) {
        const std::string prefix = raw->name + "/" + raw->save_id + "/";
        const offload::ObjectInfo info = offload::put_file(*store_, prefix + file, (raw->dir / file).string(), transfer_);
        // The index (format 3) beside its data, immutable under the save id like it; the
        // manifest names its size and CRC.
        const std::string text = read_text(raw->dir / index);
        store_->put(prefix + index, std::as_bytes(std::span(text)));
        raw->bytes = info.size + text.size();
      }
    } catch (const std::exception& e) {
      raw->error = e.what();
    }
    raw->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    raw->done = true;
  });
  pending_ = std::move(p);
}

std::optional<std::string> CheckpointUploader::poll() { return complete(/*wait=*/false); }
std::optional<std::string> CheckpointUploader::finish() { return complete(/*wait=*/true); }

std::optional<std::string> CheckpointUploader::complete(bool wait) {
  if (!pending_) return std::nullopt;
  if (wait) pending_->thread.join();
  at::Tensor busy = at::full({1}, pending_->done.load() ? 0 : 1, at::kInt);
  comm_.all_reduce(busy, ReduceOp::kMax);
  if (busy.item<int>() != 0) return std::nullopt;
  if (pending_->thread.joinable()) pending_->thread.join();
  std::unique_ptr<Pending> p = std::move(pending_);
  const std::string where = "upload of " + p->name + " to " + store_url_;
  const std::string intact = "; the local checkpoint " + p->dir.string() + " is intact";

  if (const std::optional<ckpt::RankError> e = ckpt::first_error(comm_, p->error)) {
    last_error_ = where + " failed on rank " + std::to_string(e->rank) + ": " + e->message + intact;
    return std::nullopt;
  }

  std::string commit_error;
  last_warning_.clear();
  if (comm_.rank() == 0) {
    bool committed = false;
    try {
      json m = read_manifest(p->dir);
      m["store"] = {{"save_id", p->save_id}, {"uploaded_from", p->dir.string()}};
      const std::string text = m.dump(1);
      // A stored checkpoint of the same name (a run resumed from an older one) stays committed
      // until now, when its replacement's data is all there: its manifest goes, then the new one
      // comes, then its data objects go.
      if (auto old = stored_manifest(*store_, p->name)) {
        p->replaced_save_id = (*old)["store"]["save_id"].get<std::string>();
        store_->remove(stored_manifest_key(p->name));
      }
      if (!store_->put_if_absent(stored_manifest_key(p->name), std::as_bytes(std::span(text))))
        throw std::runtime_error("a manifest of " + p->name +
                                 " appeared in the store meanwhile (does another run write to it?)");
      committed = true;  // the commit point: what follows only tidies up
      const std::string hint = p->name + "\n";
      store_->put(kHintKey, std::as_bytes(std::span(hint)));
      if (!p->replaced_save_id.empty() && p->replaced_save_id != p->save_id)
        remove_prefix(*store_, p->name + "/" + p->replaced_save_id + "/");
    } catch (const std::exception& e) {
      if (committed)
        last_warning_ = where + " committed, but: " + e.what() +
                        " (the `latest` hint or the replaced data may be stale; the listing still finds it)";
      else
        commit_error = e.what();
    }
  }
  const std::string agreed = broadcast_string(comm_, commit_error, 0);  // rank 0 committed, or not
  if (!agreed.empty()) {
    last_error_ = where + " not committed: " + agreed + intact;
    return std::nullopt;
  }
  last_error_.clear();
  last_bytes_ = p->bytes;
  last_seconds_ = p->seconds;
  return store_url_ + "/" + p->name;
}

std::vector<std::string> stored_checkpoints(const std::string& store_url) {
  auto store = offload::open_object_store(store_url);
  std::vector<std::string> out;
  for (const std::string& name : candidate_names(*store))
    if (stored_manifest(*store, name)) out.push_back(name);
  return out;
}

std::optional<std::string> newest_stored_checkpoint(const std::string& store_url) {
  auto store = offload::open_object_store(store_url);
  const std::set<std::string> names = candidate_names(*store);
  for (auto it = names.rbegin(); it != names.rend(); ++it)
    if (stored_manifest(*store, *it)) return store->url() + "/" + *it;
  return std::nullopt;
}

void prune_stored_checkpoints(Communicator& comm, const std::string& store_url, size_t keep) {
  std::string error;
  if (comm.rank() == 0) {
    try {
      auto store = offload::open_object_store(store_url);
      const std::vector<std::string> names = stored_checkpoints(store_url);
      keep = std::max<size_t>(keep, 1);
      for (size_t i = 0; i + keep < names.size(); ++i) {
        store->remove(stored_manifest_key(names[i]));  // un-committed first
        remove_prefix(*store, names[i] + "/");
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  const std::string agreed = broadcast_string(comm, error, 0);  // rank 0 pruned, or not
  if (!agreed.empty()) throw std::runtime_error("pruning the checkpoints in " + store_url + ": " + agreed);
}

}  // namespace strata::engine
