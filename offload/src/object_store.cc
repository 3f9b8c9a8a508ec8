#include "strata/offload/object_store.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>

#include "strata/offload/s3.h"

namespace strata::offload {

namespace {

[[noreturn]] void bad_key(std::string_view key, const char* rule) {
  throw ObjectStoreError(ObjectStoreError::Kind::kInvalidArgument,
                         "bad object key '" + std::string(key) + "': " + rule);
}

// Runs body(i) for i in [0, count) on up to `concurrency` threads (the caller's among them);
// the first exception stops the others from taking new work and is rethrown.
template <class Body>
void run_parallel(size_t count, int concurrency, Body body) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mu;
  auto worker = [&] {
    for (;;) {
      const size_t i = next.fetch_add(1);
      if (i >= count || failed.load()) return;
      try {
        body(i);
      } catch (...) {
        std::lock_guard lock(error_mu);
        if (!error) error = std::current_exception();
        failed = true;
        return;
      }
    }
  };
  const size_t threads = std::min<size_t>(count, static_cast<size_t>(std::max(1, concurrency)));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace

void check_object_key(std::string_view key) {
  if (key.empty()) bad_key(key, "empty");
  if (key.size() > 1024) bad_key(key.substr(0, 64), "longer than 1024 bytes");
  if (key.find('\0') != std::string_view::npos) bad_key(key, "contains a NUL byte");
  if (key.front() == '/' || key.back() == '/') bad_key(key, "starts or ends with '/'");
  size_t begin = 0;
  while (begin <= key.size()) {
    size_t end = key.find('/', begin);
    if (end == std::string_view::npos) end = key.size();
    const std::string_view segment = key.substr(begin, end - begin);
    if (segment.empty()) bad_key(key, "has an empty segment ('//')");
    if (segment == "." || segment == "..") bad_key(key, "has a '.' or '..' segment");
    begin = end + 1;
  }
}

std::string ObjectStore::url_of(const std::string& key) const { return url() + "/" + key; }

std::vector<std::byte> ObjectStore::get_all(const std::string& key) {
  const auto info = head(key);
  if (!info) {
    throw ObjectStoreError(ObjectStoreError::Kind::kNotFound, "get " + url_of(key) + ": no such key",
                           404, "NoSuchKey");
  }
  std::vector<std::byte> bytes(info->size);
  get(key, 0, bytes);
  return bytes;
}

ObjectInfo put_object(ObjectStore& store, const std::string& key, std::span<const std::byte> data,
                      const TransferOptions& options) {
  const uint64_t part = std::max<uint64_t>({options.part_bytes, store.min_part_bytes(), 1});
  if (data.size() <= part) {
    store.put(key, data);
    return ObjectInfo{key, data.size(), {}};
  }
  const size_t parts = (data.size() + part - 1) / part;
  if (parts > 10000) {
    throw ObjectStoreError(ObjectStoreError::Kind::kInvalidArgument,
                           "put " + store.url_of(key) + ": " + std::to_string(data.size()) +
                               " bytes need " + std::to_string(parts) +
                               " parts of " + std::to_string(part) + " bytes; at most 10000");
  }
  auto upload = store.start_multipart(key);
  try {
    run_parallel(parts, options.concurrency, [&](size_t i) {
      const uint64_t begin = i * part;
      const uint64_t size = std::min<uint64_t>(part, data.size() - begin);
      upload->put_part(static_cast<int>(i + 1), data.subspan(begin, size));
    });
    return upload->complete();
  } catch (...) {
    try {
      upload->abort();
    } catch (...) {
      // The first error is the one to report; an abort that fails leaves parts the store's
      // lifecycle rules (or a later abort) remove, never a visible object.
    }
    throw;
  }
}

void get_object(ObjectStore& store, const std::string& key, uint64_t offset,
                std::span<std::byte> out, const TransferOptions& options) {
  const uint64_t part = std::max<uint64_t>(options.part_bytes, 1);
  const size_t pieces = (out.size() + part - 1) / part;
  if (pieces <= 1) {
    store.get(key, offset, out);
    return;
  }
  run_parallel(pieces, options.concurrency, [&](size_t i) {
    const uint64_t begin = i * part;
    const uint64_t size = std::min<uint64_t>(part, out.size() - begin);
    store.get(key, offset + begin, out.subspan(begin, size));
  });
}

bool is_s3_url(std::string_view url) { return url.starts_with("s3://"); }

std::unique_ptr<ObjectStore> open_object_store(const std::string& url) {
  if (!is_s3_url(url)) return open_file_store(url);
  std::string rest = url.substr(5);
  while (!rest.empty() && rest.back() == '/') rest.pop_back();
  const size_t slash = rest.find('/');
  const std::string bucket = rest.substr(0, slash);
  const std::string prefix = slash == std::string::npos ? "" : rest.substr(slash + 1);
  if (bucket.empty()) {
    throw ObjectStoreError(ObjectStoreError::Kind::kInvalidArgument,
                           "bad S3 URL '" + url + "': expected s3://bucket[/prefix]");
  }
  if (!prefix.empty()) check_object_key(prefix);
  return open_s3_store(bucket, prefix, s3_options_from_environment());
}

}  // namespace strata::offload
