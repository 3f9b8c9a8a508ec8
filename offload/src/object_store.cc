#include "strata/offload/object_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>

#include "strata/offload/parallel.h"
#include "strata/offload/s3.h"

namespace strata::offload {

namespace {

[[noreturn]] void bad_key(std::string_view key, const char* rule) {
  throw ObjectStoreError(ObjectStoreError::Kind::kInvalidArgument,
                         "bad object key '" + std::string(key) + "': " + rule);
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

namespace {

// The size of an upload's parts: the options', raised to what the store accepts.
uint64_t part_bytes(const ObjectStore& store, const TransferOptions& options) {
  return std::max<uint64_t>({options.part_bytes, store.min_part_bytes(), 1});
}

// The one upload loop of put_object and put_file: `total` bytes as one put when they fit in a
// part, else a multipart upload; `bytes(begin, size, scratch)` gives a piece's bytes (a view of
// the caller's memory, or read into `scratch`), and `report(size)` counts each piece sent.
using PieceSource = std::function<std::span<const std::byte>(uint64_t begin, uint64_t size,
                                                             std::vector<std::byte>& scratch)>;
ObjectInfo upload(ObjectStore& store, const std::string& key, uint64_t total, const TransferOptions& options,
                  const PieceSource& bytes, const std::function<void(uint64_t)>& report) {
  const uint64_t part = part_bytes(store, options);
  if (total <= part) {
    std::vector<std::byte> scratch;
    store.put(key, bytes(0, total, scratch));
    report(total);
    return ObjectInfo{key, total, {}};
  }
  const size_t parts = (total + part - 1) / part;
  if (parts > 10000) {
    throw ObjectStoreError(ObjectStoreError::Kind::kInvalidArgument,
                           "put " + store.url_of(key) + ": " + std::to_string(total) + " bytes need " +
                               std::to_string(parts) + " parts of " + std::to_string(part) +
                               " bytes; at most 10000 (raise the part size)");
  }
  auto multipart = store.start_multipart(key);
  // One scratch buffer a thread, kept across its parts: a fresh one a part would be zeroed and
  // faulted in again each time, CPU that a store on the same machine could use.
  std::vector<std::vector<std::byte>> scratch(parallel_workers(parts, options.concurrency));
  try {
    run_parallel(parts, options.concurrency, [&](size_t i, size_t worker) {
      const uint64_t begin = i * part;
      const uint64_t size = std::min<uint64_t>(part, total - begin);
      multipart->put_part(static_cast<int>(i + 1), bytes(begin, size, scratch[worker]));
      report(size);
    });
    return multipart->complete();
  } catch (...) {
    try {
      multipart->abort();
    } catch (...) {
      // The first error is the one to report; an abort that fails leaves parts the store's
      // lifecycle rules (or a later abort) remove, never a visible object.
    }
    throw;
  }
}

}  // namespace

ObjectInfo put_object(ObjectStore& store, const std::string& key, std::span<const std::byte> data,
                      const TransferOptions& options) {
  return upload(
      store, key, data.size(), options,
      [&](uint64_t begin, uint64_t size, std::vector<std::byte>&) { return data.subspan(begin, size); },
      [](uint64_t) {});
}

namespace {

class ReadOnlyFile {
 public:
  explicit ReadOnlyFile(const std::string& path) : path_(path), fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    if (fd_ < 0) fail("open");
    struct stat st {};
    if (::fstat(fd_, &st) != 0) fail("fstat");
    size_ = static_cast<uint64_t>(st.st_size);
  }
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;
  ~ReadOnlyFile() { ::close(fd_); }
  uint64_t size() const { return size_; }
  // Asks the kernel to read [offset, offset + bytes) into the page cache in the background (a
  // hint: nothing fails if it does not).
  void will_need(uint64_t offset, uint64_t bytes) const {
    if (offset < size_) ::posix_fadvise(fd_, off_t(offset), off_t(std::min(bytes, size_ - offset)), POSIX_FADV_WILLNEED);
  }
  void read(uint64_t offset, std::span<std::byte> out) const {
    size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = ::pread(fd_, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("pread");
      if (n == 0) {
        errno = EIO;
        fail("pread (the file shrank while being uploaded)");
      }
      done += static_cast<size_t>(n);
    }
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    throw ObjectStoreError(errno == ENOENT ? ObjectStoreError::Kind::kNotFound : ObjectStoreError::Kind::kOther,
                           std::string("upload: ") + what + " " + path_ + ": " + std::strerror(errno));
  }
  std::string path_;
  int fd_;
  uint64_t size_ = 0;
};

}  // namespace

ObjectInfo put_file(ObjectStore& store, const std::string& key, const std::string& path,
                    const TransferOptions& options, const std::function<void(uint64_t)>& progress) {
  const ReadOnlyFile file(path);
  std::mutex progress_mu;
  uint64_t uploaded = 0;
  // A checkpoint's data file was written with direct I/O, so its bytes come from the disk: each
  // thread, having read its part, has the kernel fetch the part it will likely take next (the
  // threads take parts in order) while it sends this one, so disk reads overlap the network.
  const uint64_t threads = uint64_t(std::max(options.concurrency, 1));
  // The first parts in order, before the threads ask for them all at once: the first part is
  // then on its way while the disk still reads the others.
  const uint64_t part = part_bytes(store, options);
  for (uint64_t k = 0; k < threads; ++k) file.will_need(k * part, part);
  return upload(
      store, key, file.size(), options,
      [&](uint64_t begin, uint64_t size, std::vector<std::byte>& scratch) {
        scratch.resize(size);
        file.read(begin, scratch);
        file.will_need(begin + size * threads, size);
        return std::span<const std::byte>(scratch);
      },
      [&](uint64_t size) {
        if (!progress) return;
        std::lock_guard lock(progress_mu);
        uploaded += size;
        progress(uploaded);
      });
}

uint64_t get_file(ObjectStore& store, const std::string& key, const std::string& path,
                  const TransferOptions& options, const std::function<void(uint64_t)>& progress) {
  const auto info = store.head(key);
  if (!info) {
    throw ObjectStoreError(ObjectStoreError::Kind::kNotFound, "get " + store.url_of(key) + ": no such key", 404,
                           "NoSuchKey");
  }
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw ObjectStoreError(ObjectStoreError::Kind::kOther, "download to " + tmp + ": " + std::strerror(errno));
  }
  const auto fail = [&](const std::string& what) {
    const int error = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    throw ObjectStoreError(error == ENOSPC ? ObjectStoreError::Kind::kNoSpace : ObjectStoreError::Kind::kOther,
                           what + " " + tmp + ": " + std::strerror(error));
  };
  const uint64_t part = std::max<uint64_t>(options.part_bytes, 1);
  const size_t pieces = (info->size + part - 1) / part;
  std::mutex progress_mu;
  uint64_t done = 0;
  try {
    run_parallel(pieces, options.concurrency, [&](size_t i) {
      const uint64_t begin = i * part;
      std::vector<std::byte> buffer(std::min<uint64_t>(part, info->size - begin));
      store.get(key, begin, buffer);
      size_t written = 0;
      while (written < buffer.size()) {
        const ssize_t n = ::pwrite(fd, buffer.data() + written, buffer.size() - written, off_t(begin + written));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) throw ObjectStoreError(errno == ENOSPC ? ObjectStoreError::Kind::kNoSpace : ObjectStoreError::Kind::kOther,
                                          "download to " + tmp + ": " + std::strerror(errno));
        written += size_t(n);
      }
      if (progress) {
        std::lock_guard lock(progress_mu);
        done += buffer.size();
        progress(done);
      }
    });
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::fsync(fd) != 0) fail("fsync");
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw ObjectStoreError(ObjectStoreError::Kind::kOther, "close " + tmp + ": " + std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    throw ObjectStoreError(ObjectStoreError::Kind::kOther, "rename onto " + path + ": " + std::strerror(error));
  }
  return info->size;
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

namespace {

using Opener = std::function<std::unique_ptr<ObjectStore>(const std::string&)>;

struct Schemes {
  std::mutex mu;
  std::vector<std::pair<std::string, Opener>> openers;
};
Schemes& schemes() {
  static Schemes s;
  return s;
}

const Opener* registered(std::string_view url) {
  std::lock_guard lock(schemes().mu);
  for (const auto& [scheme, open] : schemes().openers)
    if (url.starts_with(scheme)) return &open;
  return nullptr;
}

}  // namespace

void register_object_store_scheme(const std::string& scheme, Opener open) {
  std::lock_guard lock(schemes().mu);
  schemes().openers.emplace_back(scheme, std::move(open));
}

bool is_object_store_url(std::string_view url) { return is_s3_url(url) || registered(url) != nullptr; }

std::unique_ptr<ObjectStore> open_object_store(const std::string& url) {
  if (const Opener* open = registered(url)) return (*open)(url);
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

uint64_t mirror_to_directory(ObjectStore& store, const std::string& directory, const TransferOptions& options,
                             const std::function<void(const std::string&, uint64_t)>& progress) {
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec) {
    throw ObjectStoreError(ObjectStoreError::Kind::kOther, "create directory " + directory + ": " + ec.message());
  }
  // What the last copy took: name -> {size, etag}.
  const std::string record_path = directory + "/.strata-mirror.json";
  nlohmann::json record = nlohmann::json::object();
  {
    std::ifstream in(record_path);
    if (in) {
      try {
        in >> record;
      } catch (const std::exception&) {
        record = nlohmann::json::object();  // unreadable: copy everything again
      }
    }
  }
  uint64_t downloaded = 0;
  for (const ObjectInfo& o : store.list("")) {
    if (o.key.find('/') != std::string::npos || o.key.starts_with(".strata-")) continue;
    const std::string path = directory + "/" + o.key;
    struct stat st {};
    const bool same = record.contains(o.key) && record[o.key].value("size", uint64_t(0)) == o.size &&
                      record[o.key].value("etag", std::string()) == o.etag && ::stat(path.c_str(), &st) == 0 &&
                      uint64_t(st.st_size) == o.size;
    if (same) continue;
    if (progress) progress(o.key, o.size);
    downloaded += get_file(store, o.key, path, options);
    record[o.key] = {{"size", o.size}, {"etag", o.etag}};
    std::ofstream out(record_path + ".tmp");
    out << record.dump(1);
    out.close();
    if (!out || ::rename((record_path + ".tmp").c_str(), record_path.c_str()) != 0) {
      throw ObjectStoreError(ObjectStoreError::Kind::kOther, "cannot write " + record_path);
    }
  }
  return downloaded;
}

uint64_t upload_directory(ObjectStore& store, const std::string& directory, const std::string& last,
                          const TransferOptions& options,
                          const std::function<void(const std::string&, uint64_t)>& progress) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(directory, ec))
    if (e.is_regular_file()) names.push_back(e.path().filename().string());
  if (ec) throw ObjectStoreError(ObjectStoreError::Kind::kOther, "list " + directory + ": " + ec.message());
  std::sort(names.begin(), names.end(), [&](const std::string& a, const std::string& b) {
    return (a == last) != (b == last) ? b == last : a < b;  // `last` at the end
  });
  uint64_t bytes = 0;
  for (const std::string& name : names) {
    struct stat st {};
    ::stat((directory + "/" + name).c_str(), &st);
    if (progress) progress(name, uint64_t(st.st_size));
    bytes += put_file(store, name, directory + "/" + name, options).size;
  }
  return bytes;
}

}  // namespace strata::offload
