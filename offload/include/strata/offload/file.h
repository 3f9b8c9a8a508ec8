// A file opened for direct I/O, with a buffered twin for what direct I/O cannot do.
//
// O_DIRECT requires the file offset, the length and the memory address to be multiples of the
// device's alignment. Requests that are not (a tail of 1000 bytes, an odd offset) go through the
// second, buffered descriptor of the same file instead of being rounded or dropped, so no byte is
// ever lost. On file systems that refuse O_DIRECT (tmpfs on old kernels, some FUSE mounts) both
// descriptors are buffered and direct() is false.
//
// Ownership: File owns its descriptors and closes them on destruction; it is movable, not
// copyable. An I/O engine refers to a File by reference: the File must outlive every request
// submitted on it. Thread safety: const members are safe from any thread; truncate/reserve/sync
// may run concurrently with I/O on other ranges.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace strata::offload {

enum class OpenMode {
  kRead,       // existing file, read only
  kReadWrite,  // existing file
  kCreate,     // create if missing, keep contents
  kTruncate,   // create if missing, truncate to zero
};

class File {
 public:
  // Throws IoError naming the path and errno text on failure (e.g. a missing directory).
  static File open(const std::filesystem::path& path, OpenMode mode, bool try_direct = true);

  File() = default;
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  bool is_open() const { return buffered_fd_ >= 0; }
  const std::string& path() const { return path_; }
  bool direct() const { return direct_fd_ >= 0; }
  // Descriptor for aligned direct transfers (== buffered_fd() when !direct()).
  int direct_fd() const { return direct() ? direct_fd_ : buffered_fd_; }
  int buffered_fd() const { return buffered_fd_; }
  // Alignment of offsets and lengths sent through O_DIRECT (the device's, at least a page), and
  // of memory addresses (bytes).
  uint32_t offset_align() const { return offset_align_; }
  uint32_t memory_align() const { return memory_align_; }

  uint64_t size() const;
  void truncate(uint64_t size) const;
  // Reserves disk blocks for [offset, offset + length) so that a later write cannot fail with
  // ENOSPC; falls back to extending the size where fallocate is unsupported.
  void reserve(uint64_t offset, uint64_t length) const;
  // fsync: data and metadata durable (the buffered tail writes included).
  void sync() const;

 private:
  void close() noexcept;

  std::string path_;
  int direct_fd_ = -1;
  int buffered_fd_ = -1;
  uint32_t offset_align_ = 4096;
  uint32_t memory_align_ = 4096;
};

// Copies [src_offset, src_offset + length) of `src` to `dst` at `dst_offset` inside the kernel
// (copy_file_range: a reflink or server-side copy where the file system has one, else a page
// cache copy), never through this process's memory; where copy_file_range is refused (EXDEV,
// EINVAL, EOPNOTSUPP, ENOSYS) it falls back to pread/pwrite through a 1 MiB buffer. Throws
// IoError naming both paths (ENOSPC included). Returns true if the kernel copy was used.
bool copy_range(const File& src, uint64_t src_offset, const File& dst, uint64_t dst_offset, uint64_t length);

// Directory entries and power cuts. Under strict POSIX rules a created, renamed or removed entry
// is durable only once the directory holding it is fsynced: an fsync of the file is not enough.
// Both throw IoError naming the directory and the errno text; both are thread-safe.
//
// fsyncs the directory `dir` (its entries made durable).
void sync_directory(const std::filesystem::path& dir);
// mkdir -p that survives a power cut: creates `dir` and its missing parents, fsyncing the parent
// of every level it found missing, and the parent of `dir` itself when it existed (another
// process may have just created it, unsynced). Once it returns, `dir`'s entry and those of the
// levels it created are durable; levels that existed before are taken to be (they are the
// caller's: a checkpoint root's parents). A `dir` that exists but is not a directory is an error
// (ENOTDIR).
void create_directories_durably(const std::filesystem::path& dir);

}  // namespace strata::offload
