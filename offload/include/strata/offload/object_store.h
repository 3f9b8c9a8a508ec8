// Object storage: one key-value interface over a local directory and over S3.
//
// A store is opened from a URL: "s3://bucket/prefix" (the S3 driver, s3.h) or a plain path (the
// file driver, a directory). Keys are relative to the store's root: '/'-separated segments, none
// empty, "." or "..", at most 1024 bytes of UTF-8, no NUL. A bad key is an ObjectStoreError of
// kind kInvalidArgument before anything is sent.
//
// What every driver guarantees (the conformance suite, tests/offload/object_store_conformance.cc,
// checks each one):
//   - put and a completed multipart upload replace an object atomically: a reader sees the whole
//     old object or the whole new one, never a mixture or a prefix;
//   - put_if_absent is an atomic create-only write: of several concurrent callers on one key,
//     exactly one gets true, and the object is that caller's bytes;
//   - after put returns, head, get and list by the same client see the new object (read-after-
//     write). Stores that are weaker than this exist (file-system layers over S3, some
//     S3-compatible servers); protocols built on this interface must not depend on it across
//     processes (the checkpoint manifest protocol does not);
//   - errors are never swallowed: every failed operation throws ObjectStoreError naming the
//     operation, the object's URL and the cause (for S3 also the HTTP status, the S3 error code
//     and the request id).
// Thread safety: every method may be called from several threads at once. A MultipartUpload's
// put_part may be called concurrently for different part numbers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "strata/offload/transfer_options.h"

namespace strata::offload {

class ObjectStoreError : public std::runtime_error {
 public:
  enum class Kind {
    kNotFound,            // no such key (or bucket)
    kInvalidArgument,     // a bad key, range or option; retrying cannot help
    kAccessDenied,        // credentials refused or signature wrong
    kNoSpace,             // quota exceeded or the device is full
    kUnavailable,         // network, timeout, 5xx: still failing after the retries
    kPreconditionFailed,  // a conditional request's condition did not hold
    kOther,
  };
  ObjectStoreError(Kind kind, const std::string& message, int http_status = 0,
                   std::string code = {}, std::string request_id = {})
      : std::runtime_error(message), kind_(kind), http_status_(http_status),
        code_(std::move(code)), request_id_(std::move(request_id)) {}
  Kind kind() const { return kind_; }
  int http_status() const { return http_status_; }       // 0 when not an HTTP answer
  const std::string& code() const { return code_; }      // S3 error code, e.g. "SlowDown"
  const std::string& request_id() const { return request_id_; }

 private:
  Kind kind_;
  int http_status_;
  std::string code_;
  std::string request_id_;
};

struct ObjectInfo {
  std::string key;
  uint64_t size = 0;
  std::string etag;  // changes whenever the object is replaced; opaque; empty where not asked for
};

// A multipart upload that was started and neither completed nor aborted: its writer died (a
// process killed mid-upload) or is still writing. The store keeps its parts, and bills for
// them, until it is aborted.
struct PendingUpload {
  std::string key;
  std::string upload_id;
};

class MultipartUpload {
 public:
  virtual ~MultipartUpload() = default;  // aborts the upload unless complete() succeeded
  // Part numbers are 1..10000; every part but the last must hold at least the store's
  // min_part_bytes(). Uploading a number again replaces that part.
  virtual void put_part(int number, std::span<const std::byte> data) = 0;
  // Makes the object from the parts in number order, atomically. Parts 1..N must all be there.
  virtual ObjectInfo complete() = 0;
  // Discards the parts; the object is untouched. Never throws for an already finished upload.
  virtual void abort() = 0;
};

class ObjectStore {
 public:
  virtual ~ObjectStore() = default;

  // The store's root as a URL ("s3://bucket/prefix" or an absolute directory path).
  virtual std::string url() const = 0;
  std::string url_of(const std::string& key) const;  // url() + "/" + key

  virtual void put(const std::string& key, std::span<const std::byte> data) = 0;
  // Create-only: true if this call created the object, false if the key already existed (then
  // the object is unchanged). Where a retried request cannot tell its own earlier success from
  // another writer's object, the driver compares the bytes.
  virtual bool put_if_absent(const std::string& key, std::span<const std::byte> data) = 0;
  // nullopt when the key does not exist.
  virtual std::optional<ObjectInfo> head(const std::string& key) = 0;
  // Reads exactly out.size() bytes at `offset`; a range past the end is kInvalidArgument.
  virtual void get(const std::string& key, uint64_t offset, std::span<std::byte> out) = 0;
  // Every object whose key starts with `prefix` (plain string prefix), sorted by key.
  virtual std::vector<ObjectInfo> list(const std::string& prefix) = 0;
  // Deleting a missing key is not an error.
  virtual void remove(const std::string& key) = 0;
  virtual std::unique_ptr<MultipartUpload> start_multipart(const std::string& key) = 0;
  // The multipart uploads in progress whose key starts with `prefix`, sorted by key.
  virtual std::vector<PendingUpload> list_multipart_uploads(const std::string& prefix) = 0;
  // Discards such an upload's parts (the object is untouched). One already gone is not an error;
  // its writer, if alive, fails at its next part or at complete().
  virtual void abort_multipart_upload(const PendingUpload& upload) = 0;
  // The smallest part a multipart upload accepts, except for its last part.
  virtual uint64_t min_part_bytes() const = 0;

  // The whole object (head, then get).
  std::vector<std::byte> get_all(const std::string& key);
};

// Uploads `data` as one object: one put when it fits in one part, else a multipart upload of
// part_bytes (raised to the store's minimum) parts, `concurrency` at a time. On failure the
// upload is aborted and the error rethrown; the key is then unchanged. The etag is filled in for
// multipart uploads only (a single put does not ask for it).
ObjectInfo put_object(ObjectStore& store, const std::string& key, std::span<const std::byte> data,
                      const TransferOptions& options = {});
// Reads [offset, offset + out.size()) with ranged gets of part_bytes, `concurrency` at a time.
void get_object(ObjectStore& store, const std::string& key, uint64_t offset,
                std::span<std::byte> out, const TransferOptions& options = {});

// Uploads the file at `path` as one object in parts read from the file as they go (memory:
// concurrency x part_bytes), like put_object. `progress`, if set, is called (from any of the
// transfer threads, serialized) with the bytes uploaded so far. A file that cannot be read is an
// ObjectStoreError naming it.
ObjectInfo put_file(ObjectStore& store, const std::string& key, const std::string& path,
                    const TransferOptions& options = {},
                    const std::function<void(uint64_t)>& progress = {});

// Downloads one object into the file at `path` with ranged gets of part_bytes, `concurrency` at a
// time, written at their offsets (memory: concurrency x part_bytes), into `path`.tmp-PID first,
// renamed onto `path` once complete. Returns the object's size.
uint64_t get_file(ObjectStore& store, const std::string& key, const std::string& path,
                  const TransferOptions& options = {},
                  const std::function<void(uint64_t)>& progress = {});

// Copies the objects directly under the store's root (keys without '/') into `directory`, as
// files of the same names, skipping those whose size and etag match the last copy (recorded in
// `directory`/.strata-mirror.json). For a Hugging Face model directory in a bucket. Returns the
// bytes downloaded. `progress` gets (name, bytes of that object) before each download.
uint64_t mirror_to_directory(ObjectStore& store, const std::string& directory,
                             const TransferOptions& options = {},
                             const std::function<void(const std::string&, uint64_t)>& progress = {});
// Uploads the regular files directly in `directory` (not its subdirectories) under the store's
// root, `last` (if present there) after all the others, so that a reader that waits for it sees
// the rest. Returns the bytes uploaded.
uint64_t upload_directory(ObjectStore& store, const std::string& directory, const std::string& last,
                          const TransferOptions& options = {},
                          const std::function<void(const std::string&, uint64_t)>& progress = {});

// Throws ObjectStoreError(kInvalidArgument) naming the key and the rule it breaks.
void check_object_key(std::string_view key);

bool is_s3_url(std::string_view url);  // starts with "s3://"
// True for an s3:// URL and for a URL of a registered scheme (below); false for a plain path.
bool is_object_store_url(std::string_view url);
// Opens the store a URL names: "s3://bucket[/prefix]" with the S3 options resolved from the
// environment and ~/.aws (s3.h), a URL of a registered scheme, or a directory path (created if
// missing).
std::unique_ptr<ObjectStore> open_object_store(const std::string& url);
// Makes open_object_store hand URLs that start with `scheme` ("lagging://") to `open`: how tests
// put a store with injected faults under code that opens stores by URL. Thread safe.
void register_object_store_scheme(const std::string& scheme,
                                  std::function<std::unique_ptr<ObjectStore>(const std::string& url)> open);
// The file driver on `directory` (created if missing). Its protocol is written in file_store.cc.
std::unique_ptr<ObjectStore> open_file_store(const std::string& directory);

}  // namespace strata::offload
