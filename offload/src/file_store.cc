// The file driver: an ObjectStore on a local directory.
//
// Protocol (what makes the guarantees of object_store.h hold on a POSIX file system):
//   - a key is the file at <root>/<key>; its '/' segments are directories, created on demand and
//     removed again when a remove leaves them empty. A key cannot also be a directory of other
//     keys (S3 allows "a" beside "a/b"; here that put fails with an error naming both);
//   - every write goes to a unique file under <root>/.strata-tmp, is fsynced, then renamed onto
//     the key (put: atomic replace) or hard-linked to it (put_if_absent: link fails with EEXIST
//     when the key exists, which makes the create atomic), then the directory is fsynced;
//   - a multipart upload keeps its parts under <root>/.strata-tmp/upload-* (its id), with its key
//     in the file "key" there (list_multipart_uploads reads it); complete concatenates them into
//     a temporary file and renames it onto the key; aborting removes the directory;
//   - ".strata-tmp" is never listed and cannot be a key's first segment. Temporary files left by
//     a killed process stay there until removed by hand; they never become objects.
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>

#include "strata/offload/object_store.h"

namespace strata::offload {

namespace {

namespace fs = std::filesystem;
using Kind = ObjectStoreError::Kind;

constexpr const char* kTmpDir = ".strata-tmp";

Kind kind_of_errno(int error) {
  switch (error) {
    case ENOENT: return Kind::kNotFound;
    case ENOSPC:
    case EDQUOT: return Kind::kNoSpace;
    case EACCES:
    case EPERM:
    case EROFS: return Kind::kAccessDenied;
    case EISDIR:
    case ENOTDIR:
    case ENAMETOOLONG: return Kind::kInvalidArgument;
    default: return Kind::kOther;
  }
}

[[noreturn]] void fail(int error, const std::string& what, const std::string& path) {
  throw ObjectStoreError(kind_of_errno(error), what + " " + path + ": " + std::strerror(error));
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

void write_all(int fd, std::span<const std::byte> data, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(errno, "write", path);
    }
    done += static_cast<size_t>(n);
  }
}

void fsync_dir(const std::string& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) fail(errno, "open directory", dir);
  if (::fsync(fd.get()) != 0) fail(errno, "fsync directory", dir);
}

// Removes a directory tree. nftw, not std::filesystem::remove_all: libtorch.so carries its own
// copy of libstdc++'s filesystem library, and its remove_all crashes when it interposes ours.
void remove_tree(const std::string& path) {
  nftw(path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); },
       16, FTW_DEPTH | FTW_PHYS);
}

std::string unique_suffix() {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  return std::to_string(::getpid()) + "-" + std::to_string(salt % 1000000007) + "-" +
         std::to_string(counter.fetch_add(1));
}

class FileStore;

class FileUpload final : public MultipartUpload {
 public:
  FileUpload(FileStore& store, std::string key, std::string staging)
      : store_(store), key_(std::move(key)), staging_(std::move(staging)) {}
  ~FileUpload() override {
    try {
      abort();
    } catch (...) {
    }
  }
  void put_part(int number, std::span<const std::byte> data) override;
  ObjectInfo complete() override;
  void abort() override {
    std::lock_guard lock(mu_);
    if (finished_) return;
    finished_ = true;
    remove_tree(staging_);
  }

 private:
  FileStore& store_;
  std::string key_;
  std::string staging_;
  std::mutex mu_;
  std::map<int, uint64_t> parts_;  // number -> bytes
  bool finished_ = false;
};

class FileStore final : public ObjectStore {
 public:
  explicit FileStore(std::string root) : root_(std::move(root)) {
    std::error_code ec;
    fs::create_directories(root_ + "/" + kTmpDir, ec);
    if (ec) fail(ec.value(), "create directory", root_ + "/" + kTmpDir);
  }

  std::string url() const override { return root_; }
  uint64_t min_part_bytes() const override { return 1; }

  void put(const std::string& key, std::span<const std::byte> data) override {
    const std::string path = path_of(key);
    const std::string tmp = write_temporary(data);
    // A concurrent remove may take the parent directory away between making it and the rename:
    // make it again.
    for (int attempt = 0;; ++attempt) {
      make_parents(key);
      if (::rename(tmp.c_str(), path.c_str()) == 0) break;
      const int error = errno;
      if (error == ENOENT && attempt < 3) continue;
      ::unlink(tmp.c_str());
      fail(error, "put (rename onto)", path);
    }
    fsync_dir(fs::path(path).parent_path());
  }

  bool put_if_absent(const std::string& key, std::span<const std::byte> data) override {
    const std::string path = path_of(key);
    const std::string tmp = write_temporary(data);
    int rc = -1, error = 0;
    for (int attempt = 0; attempt < 4; ++attempt) {  // as in put: a concurrent remove's rmdir
      make_parents(key);
      rc = ::link(tmp.c_str(), path.c_str());
      error = errno;
      if (rc == 0 || error != ENOENT) break;
    }
    ::unlink(tmp.c_str());
    if (rc != 0) {
      if (error == EEXIST) return false;
      fail(error, "put_if_absent (link to)", path);
    }
    fsync_dir(fs::path(path).parent_path());
    return true;
  }

  std::optional<ObjectInfo> head(const std::string& key) override {
    const std::string path = path_of(key);
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return std::nullopt;
      fail(errno, "head (stat)", path);
    }
    if (!S_ISREG(st.st_mode)) return std::nullopt;
    return info_of(key, st);
  }

  void get(const std::string& key, uint64_t offset, std::span<std::byte> out) override {
    const std::string path = path_of(key);
    Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) fail(errno, "get (open)", path);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) fail(errno, "get (fstat)", path);
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    if (offset > size || out.size() > size - offset) {
      throw ObjectStoreError(Kind::kInvalidArgument,
                             "get " + path + ": bytes [" + std::to_string(offset) + ", " +
                                 std::to_string(offset + out.size()) + ") are past the end of a " +
                                 std::to_string(size) + "-byte object");
    }
    size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = ::pread(fd.get(), out.data() + done, out.size() - done,
                                static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        fail(errno, "get (pread)", path);
      }
      if (n == 0) fail(EIO, "get (the file shrank while being read)", path);
      done += static_cast<size_t>(n);
    }
  }

  std::vector<ObjectInfo> list(const std::string& prefix) override {
    // Walk only the deepest directory the prefix names in full.
    const size_t slash = prefix.rfind('/');
    const std::string dir_key = slash == std::string::npos ? "" : prefix.substr(0, slash);
    std::vector<ObjectInfo> out;
    walk(dir_key.empty() ? root_ : root_ + "/" + dir_key, dir_key, prefix, out);
    std::sort(out.begin(), out.end(),
              [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
    return out;
  }

  void remove(const std::string& key) override {
    const std::string path = path_of(key);
    if (::unlink(path.c_str()) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return;
      fail(errno, "remove", path);
    }
    // Directories the key made are removed once empty (rmdir refuses a non-empty one).
    fs::path dir = fs::path(path).parent_path();
    while (dir.string().size() > root_.size() && ::rmdir(dir.c_str()) == 0) dir = dir.parent_path();
  }

  std::unique_ptr<MultipartUpload> start_multipart(const std::string& key) override {
    path_of(key);  // checks the key
    const std::string staging = root_ + "/" + kTmpDir + "/upload-" + unique_suffix();
    if (::mkdir(staging.c_str(), 0755) != 0) fail(errno, "start_multipart (mkdir)", staging);
    // The key beside the parts, for list_multipart_uploads.
    const std::string tmp = write_temporary(std::as_bytes(std::span(key)), staging);
    if (::rename(tmp.c_str(), (staging + "/key").c_str()) != 0) {
      const int error = errno;
      remove_tree(staging);
      fail(error, "start_multipart (rename onto)", staging + "/key");
    }
    return std::make_unique<FileUpload>(*this, key, staging);
  }

  std::vector<PendingUpload> list_multipart_uploads(const std::string& prefix) override {
    std::vector<PendingUpload> out;
    const std::string tmp_dir = root_ + "/" + kTmpDir;
    // opendir, not std::filesystem: see remove_tree.
    DIR* d = ::opendir(tmp_dir.c_str());
    if (!d) {
      if (errno == ENOENT) return out;
      fail(errno, "list_multipart_uploads (opendir)", tmp_dir);
    }
    std::vector<std::string> ids;
    while (const dirent* entry = ::readdir(d))
      if (std::string(entry->d_name).starts_with("upload-")) ids.push_back(entry->d_name);
    ::closedir(d);
    for (const std::string& id : ids) {
      const std::string path = tmp_dir + "/" + id + "/key";
      Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
      if (fd.get() < 0) continue;  // finished, or being started, meanwhile
      std::string key(4096, '\0');
      const ssize_t n = ::read(fd.get(), key.data(), key.size());
      if (n <= 0) continue;
      key.resize(size_t(n));
      if (key.starts_with(prefix)) out.push_back({key, id});
    }
    std::sort(out.begin(), out.end(), [](const PendingUpload& a, const PendingUpload& b) {
      return a.key != b.key ? a.key < b.key : a.upload_id < b.upload_id;
    });
    return out;
  }

  void abort_multipart_upload(const PendingUpload& upload) override {
    if (!upload.upload_id.starts_with("upload-") || upload.upload_id.find('/') != std::string::npos)
      throw ObjectStoreError(Kind::kInvalidArgument, "abort_multipart_upload " + url_of(upload.key) +
                                                         ": '" + upload.upload_id + "' is not an upload of this store");
    remove_tree(root_ + "/" + kTmpDir + "/" + upload.upload_id);
  }

  // Shared with FileUpload.
  std::string write_temporary(std::span<const std::byte> data, const std::string& dir = {}) {
    const std::string tmp = (dir.empty() ? root_ + "/" + kTmpDir : dir) + "/tmp-" + unique_suffix();
    Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (fd.get() < 0) fail(errno, "create", tmp);
    try {
      write_all(fd.get(), data, tmp);
      if (::fsync(fd.get()) != 0) fail(errno, "fsync", tmp);
    } catch (...) {
      ::unlink(tmp.c_str());
      throw;
    }
    return tmp;
  }

  std::string path_of(const std::string& key) const {
    check_object_key(key);
    if (key == kTmpDir || key.starts_with(std::string(kTmpDir) + "/")) {
      throw ObjectStoreError(Kind::kInvalidArgument,
                             "bad object key '" + key + "': '" + kTmpDir +
                                 "' is the file store's own directory");
    }
    return root_ + "/" + key;
  }

  void make_parents(const std::string& key) const {
    const size_t slash = key.rfind('/');
    if (slash == std::string::npos) return;
    const std::string dir = root_ + "/" + key.substr(0, slash);
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) {
      throw ObjectStoreError(kind_of_errno(ec.value()),
                             "put " + root_ + "/" + key + ": cannot create directory " + dir + ": " +
                                 ec.message() + " (in a file store a key cannot also be a " +
                                 "directory of other keys)");
    }
  }

  static ObjectInfo info_of(const std::string& key, const struct stat& st) {
    char etag[64];
    std::snprintf(etag, sizeof etag, "%llx-%llx-%llx", static_cast<unsigned long long>(st.st_ino),
                  static_cast<unsigned long long>(st.st_mtim.tv_sec * 1000000000ll +
                                                  st.st_mtim.tv_nsec),
                  static_cast<unsigned long long>(st.st_size));
    return ObjectInfo{key, static_cast<uint64_t>(st.st_size), etag};
  }

 private:
  void walk(const std::string& dir, const std::string& dir_key, const std::string& prefix,
            std::vector<ObjectInfo>& out) const {
    DIR* d = ::opendir(dir.c_str());
    if (!d) {
      if (errno == ENOENT || errno == ENOTDIR) return;
      fail(errno, "list (opendir)", dir);
    }
    std::vector<std::string> names;
    while (const dirent* entry = ::readdir(d)) {
      const std::string name = entry->d_name;
      if (name == "." || name == "..") continue;
      if (dir_key.empty() && name == kTmpDir) continue;
      names.push_back(name);
    }
    ::closedir(d);
    for (const std::string& name : names) {
      const std::string key = dir_key.empty() ? name : dir_key + "/" + name;
      // Prune subtrees that cannot hold a key with the prefix.
      const size_t common = std::min(key.size(), prefix.size());
      if (key.compare(0, common, prefix, 0, common) != 0) continue;
      const std::string path = dir + "/" + name;
      struct stat st {};
      if (::stat(path.c_str(), &st) != 0) continue;  // removed meanwhile
      if (S_ISDIR(st.st_mode)) {
        walk(path, key, prefix, out);
      } else if (S_ISREG(st.st_mode) && key.starts_with(prefix)) {
        out.push_back(info_of(key, st));
      }
    }
  }

  std::string root_;
};

void FileUpload::put_part(int number, std::span<const std::byte> data) {
  if (number < 1 || number > 10000) {
    throw ObjectStoreError(Kind::kInvalidArgument, "put_part " + store_.url_of(key_) +
                                                       ": part number " + std::to_string(number) +
                                                       " is outside 1..10000");
  }
  const std::string tmp = store_.write_temporary(data, staging_);
  const std::string part = staging_ + "/part-" + std::to_string(number);
  if (::rename(tmp.c_str(), part.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    fail(error, "put_part (rename onto)", part);
  }
  std::lock_guard lock(mu_);
  parts_[number] = data.size();
}

ObjectInfo FileUpload::complete() {
  std::lock_guard lock(mu_);
  if (finished_) {
    throw ObjectStoreError(Kind::kInvalidArgument,
                           "complete " + store_.url_of(key_) + ": the upload was already finished");
  }
  if (parts_.empty() || parts_.begin()->first != 1 || parts_.rbegin()->first != int(parts_.size())) {
    throw ObjectStoreError(Kind::kInvalidArgument,
                           "complete " + store_.url_of(key_) + ": parts 1.." +
                               std::to_string(parts_.empty() ? 0 : parts_.rbegin()->first) +
                               " are not all there (" + std::to_string(parts_.size()) + " uploaded)");
  }
  const std::string path = store_.path_of(key_);
  const std::string joined = staging_ + "/joined";
  {
    Fd out(::open(joined.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (out.get() < 0) fail(errno, "complete (create)", joined);
    std::vector<std::byte> buffer(1 << 20);
    for (const auto& [number, bytes] : parts_) {
      const std::string part = staging_ + "/part-" + std::to_string(number);
      Fd in(::open(part.c_str(), O_RDONLY | O_CLOEXEC));
      if (in.get() < 0) fail(errno, "complete (open)", part);
      for (;;) {
        const ssize_t n = ::read(in.get(), buffer.data(), buffer.size());
        if (n < 0) {
          if (errno == EINTR) continue;
          fail(errno, "complete (read)", part);
        }
        if (n == 0) break;
        write_all(out.get(), std::span(buffer).first(static_cast<size_t>(n)), joined);
      }
    }
    if (::fsync(out.get()) != 0) fail(errno, "complete (fsync)", joined);
  }
  store_.make_parents(key_);
  if (::rename(joined.c_str(), path.c_str()) != 0) fail(errno, "complete (rename onto)", path);
  fsync_dir(fs::path(path).parent_path());
  finished_ = true;
  remove_tree(staging_);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) fail(errno, "complete (stat)", path);
  return FileStore::info_of(key_, st);
}

}  // namespace

std::unique_ptr<ObjectStore> open_file_store(const std::string& directory) {
  if (directory.empty()) {
    throw ObjectStoreError(Kind::kInvalidArgument, "open_file_store: empty directory path");
  }
  std::error_code ec;
  fs::create_directories(directory, ec);
  if (ec) fail(ec.value(), "create directory", directory);
  std::string root = fs::absolute(directory).lexically_normal().string();
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  return std::make_unique<FileStore>(root);
}

}  // namespace strata::offload
