#include "strata/offload/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>
#include <utility>
#include <vector>

#include "strata/offload/io_status.h"

namespace strata::offload {

namespace {

int open_flags(OpenMode mode) {
  switch (mode) {
    case OpenMode::kRead: return O_RDONLY;
    case OpenMode::kReadWrite: return O_RDWR;
    case OpenMode::kCreate: return O_RDWR | O_CREAT;
    case OpenMode::kTruncate: return O_RDWR | O_CREAT | O_TRUNC;
  }
  return O_RDONLY;
}

// Direct-I/O alignment: statx(STATX_DIOALIGN) where the kernel reports it (Linux >= 6.1), else
// 4096, which satisfies every device with logical blocks <= 4 KiB. Offsets are never aligned to
// less than a page: a buffered write of part of a page and a concurrent direct write of the rest
// of the same page can lose the direct data when the page cache writes the page back, so direct
// transfers only ever cover whole pages. Returns false if the file system reports that this file
// cannot do direct I/O at all.
bool dio_alignment(int fd, uint32_t* offset_align, uint32_t* memory_align) {
  const uint32_t page = static_cast<uint32_t>(sysconf(_SC_PAGESIZE));
  *offset_align = std::max<uint32_t>(4096, page);
  *memory_align = 4096;
#if defined(STATX_DIOALIGN)
  struct statx stx {};
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 && (stx.stx_mask & STATX_DIOALIGN)) {
    if (stx.stx_dio_offset_align == 0 || stx.stx_dio_mem_align == 0) return false;
    *offset_align = std::max(*offset_align, stx.stx_dio_offset_align);
    *memory_align = std::max<uint32_t>(stx.stx_dio_mem_align, 64);
  }
#else
  (void)fd;
#endif
  return true;
}

}  // namespace

File File::open(const std::filesystem::path& path, OpenMode mode, bool try_direct) {
  File f;
  f.path_ = path.string();
  const int flags = open_flags(mode) | O_CLOEXEC;
  f.buffered_fd_ = ::open(f.path_.c_str(), flags, 0644);
  if (f.buffered_fd_ < 0) {
    const int err = errno;
    throw_errno(err, "open", f.path_ + (err == ENOENT ? " (missing file or directory)" : ""));
  }
  if (try_direct) {
    // O_TRUNC was already applied by the first open; never truncate twice.
    const int dflags = (open_flags(mode) & ~(O_CREAT | O_TRUNC)) | O_CLOEXEC | O_DIRECT;
    f.direct_fd_ = ::open(f.path_.c_str(), dflags);
    if (f.direct_fd_ < 0 && errno != EINVAL) {
      const int err = errno;
      throw_errno(err, "open (O_DIRECT)", f.path_);
    }
    // EINVAL: the file system refuses O_DIRECT; stay buffered.
    if (f.direct_fd_ >= 0 && !dio_alignment(f.direct_fd_, &f.offset_align_, &f.memory_align_)) {
      ::close(f.direct_fd_);
      f.direct_fd_ = -1;
    }
  }
  return f;
}

File::File(File&& other) noexcept { *this = std::move(other); }

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    close();
    path_ = std::move(other.path_);
    direct_fd_ = std::exchange(other.direct_fd_, -1);
    buffered_fd_ = std::exchange(other.buffered_fd_, -1);
    offset_align_ = other.offset_align_;
    memory_align_ = other.memory_align_;
  }
  return *this;
}

File::~File() { close(); }

void File::close() noexcept {
  if (direct_fd_ >= 0) ::close(direct_fd_);
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
  direct_fd_ = buffered_fd_ = -1;
}

uint64_t File::size() const {
  struct stat st {};
  if (fstat(buffered_fd_, &st) != 0) throw_errno(errno, "fstat", path_);
  return static_cast<uint64_t>(st.st_size);
}

void File::truncate(uint64_t size) const {
  if (ftruncate(buffered_fd_, static_cast<off_t>(size)) != 0) {
    throw_errno(errno, "ftruncate to " + std::to_string(size) + " bytes", path_);
  }
}

void File::reserve(uint64_t offset, uint64_t length) const {
  if (length == 0) return;
  if (fallocate(buffered_fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(length)) == 0) {
    return;
  }
  const int err = errno;
  if (err == EOPNOTSUPP || err == ENOSYS) {
    if (size() < offset + length) truncate(offset + length);
    return;
  }
  throw_errno(err, "fallocate offset " + std::to_string(offset) + " length " +
                       std::to_string(length), path_);
}

void File::sync() const {
  if (fsync(buffered_fd_) != 0) throw_errno(errno, "fsync", path_);
}

void sync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw_errno(errno, "open directory", dir.string());
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    throw_errno(err, "fsync directory", dir.string());
  }
  ::close(fd);
}

void create_directories_durably(const std::filesystem::path& dir) {
  // The levels that are missing, outermost first.
  std::vector<std::filesystem::path> missing;
  std::filesystem::path at = dir.lexically_normal();
  if (at.has_filename() == false && at.has_parent_path()) at = at.parent_path();  // "a/b/" -> "a/b"
  struct stat st {};
  while (!at.empty() && ::stat(at.c_str(), &st) != 0) {
    if (errno != ENOENT) throw_errno(errno, "stat", at.string());
    missing.push_back(at);
    if (at == at.parent_path()) break;
    at = at.parent_path();
  }
  if (missing.empty() && !S_ISDIR(st.st_mode)) throw_errno(ENOTDIR, "create directory", dir.string());
  const auto parent_of = [](const std::filesystem::path& p) {
    return p.has_parent_path() ? p.parent_path() : std::filesystem::path(".");
  };
  for (auto level = missing.rbegin(); level != missing.rend(); ++level) {
    if (::mkdir(level->c_str(), 0755) != 0 && errno != EEXIST) throw_errno(errno, "create directory", level->string());
    sync_directory(parent_of(*level));
  }
  // The last level's entry even when it existed: another process may have just made it and not
  // synced it yet (ranks sharing a disk), or a killed run left it unsynced.
  if (missing.empty()) sync_directory(parent_of(at));
}

bool copy_range(const File& src, uint64_t src_offset, const File& dst, uint64_t dst_offset, uint64_t length) {
  const std::string what = src.path() + " -> " + dst.path();
  loff_t in = static_cast<loff_t>(src_offset), out = static_cast<loff_t>(dst_offset);
  uint64_t left = length;
  bool kernel = true;
  while (left > 0 && kernel) {
    const ssize_t n = ::copy_file_range(src.buffered_fd(), &in, dst.buffered_fd(), &out, left, 0);
    if (n > 0) {
      left -= uint64_t(n);
    } else if (n == 0) {
      throw IoError(EIO, "copy_file_range " + what + ": source ends before the range does");
    } else if (errno == EINTR) {
      continue;
    } else if (errno == EXDEV || errno == EINVAL || errno == EOPNOTSUPP || errno == ENOSYS) {
      kernel = false;
    } else {
      throw_errno(errno, "copy_file_range", what);
    }
  }
  if (left == 0) return kernel;
  std::vector<char> buf(std::min<uint64_t>(left, 1u << 20));
  while (left > 0) {
    const ssize_t r = ::pread(src.buffered_fd(), buf.data(), std::min<uint64_t>(left, buf.size()), in);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw_errno(errno, "pread", src.path());
    if (r == 0) throw IoError(EIO, "copy " + what + ": source ends before the range does");
    ssize_t done = 0;
    while (done < r) {
      const ssize_t w = ::pwrite(dst.buffered_fd(), buf.data() + done, size_t(r - done), out + done);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) throw_errno(errno, "pwrite", dst.path());
      done += w;
    }
    in += r;
    out += r;
    left -= uint64_t(r);
  }
  return false;
}

}  // namespace strata::offload
