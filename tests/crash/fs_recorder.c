// A recorder of what a process does to the files under one directory, for the crash-state test
// (tests/crash/crash_states.py). Loaded with LD_PRELOAD into `strata` (and the ranks `strata
// launch` starts); it changes nothing, it only writes down, in order, the operations whose
// durability matters:
//
//   mkdir P | rmdir P | create P | trunc P | unlink P | rename P Q   namespace operations
//   fsync P BLOB | fsyncdir P                                        what was made durable
//   close P BLOB                                                     what the file held then
//   stderr PID HEX                                                   what it wrote to stderr
//
// BLOB names a file under <log>.blobs holding the file's whole content at that moment, read back
// from the file itself (so writes that bypass libc, io_uring's among them, are seen at the next
// fsync or close of the file). Paths are relative to STRATA_FSREC_ROOT; operations elsewhere are
// not recorded. One line per operation, appended with one write(2) to STRATA_FSREC_LOG, opened
// O_APPEND: the ranks of one run share the log, and the kernel orders their lines.
//
// What it does not see: writes through calls it does not interpose (glibc's internal ones, such
// as fopen's open) — the checkpoint code opens its files with open(2) — and operations it
// records after they return, so two threads racing on one file are ordered as they returned.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#define MAX_FDS 65536

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char root[PATH_MAX];
static size_t root_len;
static int log_fd = -1;
static char blob_dir[PATH_MAX];
static char* fd_path[MAX_FDS];  // tracked descriptors: path relative to root
static unsigned char fd_writes[MAX_FDS];
static int ready;

// Raw system calls: the recorder's own I/O must not pass through the functions it interposes.
static int raw_open(const char* p, int flags, int mode) { return (int)syscall(SYS_openat, AT_FDCWD, p, flags, mode); }
static ssize_t raw_write(int fd, const void* b, size_t n) { return syscall(SYS_write, fd, b, n); }
static ssize_t raw_pread(int fd, void* b, size_t n, off_t o) { return syscall(SYS_pread64, fd, b, n, o); }
static int raw_close(int fd) { return (int)syscall(SYS_close, fd); }

static void die(const char* what) {
  char m[512];
  int n = snprintf(m, sizeof m, "fs_recorder: %s: %s\n", what, strerror(errno));
  raw_write(2, m, (size_t)n);
  _exit(97);
}

__attribute__((constructor)) static void init(void) {
  const char* r = getenv("STRATA_FSREC_ROOT");
  const char* l = getenv("STRATA_FSREC_LOG");
  if (!r || !l || !*r || !*l) return;
  if (!realpath(r, root)) die("STRATA_FSREC_ROOT");
  root_len = strlen(root);
  log_fd = raw_open(l, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) die("STRATA_FSREC_LOG");
  snprintf(blob_dir, sizeof blob_dir, "%s.blobs", l);
  if (syscall(SYS_mkdirat, AT_FDCWD, blob_dir, 0755) != 0 && errno != EEXIST) die("blob directory");
  ready = 1;
}

// `p` (relative to `dirfd`) as a path relative to the root, or 0 if outside it. The result is
// lexical (no symlinks resolved beyond the root's own): the program names its files plainly.
static int relative(int dirfd, const char* p, char* out, size_t cap) {
  char abs[PATH_MAX * 2];
  if (p[0] == '/') {
    snprintf(abs, sizeof abs, "%s", p);
  } else if (dirfd == AT_FDCWD) {
    char cwd[PATH_MAX];
    if (!getcwd(cwd, sizeof cwd)) return 0;
    snprintf(abs, sizeof abs, "%s/%s", cwd, p);
  } else {
    if (dirfd < 0 || dirfd >= MAX_FDS || !fd_path[dirfd]) return 0;
    snprintf(abs, sizeof abs, "%s/%s/%s", root, fd_path[dirfd], p);
  }
  // Normalize: drop "." and empty components, resolve "..".
  char norm[PATH_MAX * 2];
  size_t n = 0;
  norm[0] = 0;
  for (char* save = 0, *c = strtok_r(abs, "/", &save); c; c = strtok_r(0, "/", &save)) {
    if (!strcmp(c, ".")) continue;
    if (!strcmp(c, "..")) {
      while (n > 0 && norm[n - 1] != '/') --n;
      if (n > 0) --n;
      norm[n] = 0;
      continue;
    }
    n += (size_t)snprintf(norm + n, sizeof norm - n, "/%s", c);
  }
  if (strncmp(norm, root, root_len) != 0) return 0;
  if (norm[root_len] == 0) {
    snprintf(out, cap, ".");
    return 1;
  }
  if (norm[root_len] != '/') return 0;
  snprintf(out, cap, "%s", norm + root_len + 1);
  return 1;
}

static void emit(const char* fmt, ...) {
  char line[PATH_MAX * 3];
  va_list a;
  va_start(a, fmt);
  int n = vsnprintf(line, sizeof line - 1, fmt, a);
  va_end(a);
  if (n < 0 || (size_t)n >= sizeof line - 1) die("record too long");
  line[n++] = '\n';
  if (raw_write(log_fd, line, (size_t)n) != n) die("cannot write the log");
}

// The file's whole content, saved as a blob named by its FNV-1a hash and length; its name.
static void snapshot(const char* rel, char* name, size_t cap) {
  char abs[PATH_MAX * 2];
  snprintf(abs, sizeof abs, "%s/%s", root, rel);
  int fd = raw_open(abs, O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) die("cannot read back a recorded file");
  size_t size = 0, cap_bytes = 1 << 16;
  unsigned char* buf = malloc(cap_bytes);
  for (;;) {
    if (size == cap_bytes) buf = realloc(buf, cap_bytes *= 2);
    if (!buf) die("out of memory");
    ssize_t r = raw_pread(fd, buf + size, cap_bytes - size, (off_t)size);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) die("cannot read back a recorded file");
    if (r == 0) break;
    size += (size_t)r;
  }
  raw_close(fd);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < size; ++i) h = (h ^ buf[i]) * 1099511628211ull;
  snprintf(name, cap, "%016llx-%zu", (unsigned long long)h, size);
  char blob[PATH_MAX * 2];
  snprintf(blob, sizeof blob, "%s/%s", blob_dir, name);
  struct stat st;
  if (syscall(SYS_newfstatat, AT_FDCWD, blob, &st, 0) != 0) {
    char tmp[PATH_MAX * 2 + 32];
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", blob, (int)syscall(SYS_gettid));
    int out = raw_open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0) die("cannot write a blob");
    for (size_t done = 0; done < size;) {
      ssize_t w = raw_write(out, buf + done, size - done);
      if (w <= 0) die("cannot write a blob");
      done += (size_t)w;
    }
    raw_close(out);
    if (syscall(SYS_renameat, AT_FDCWD, tmp, AT_FDCWD, blob) != 0) die("cannot name a blob");
  }
  free(buf);
}

static int is_dir_fd(int fd) {
  struct stat st;
  return syscall(SYS_fstat, fd, &st) == 0 && S_ISDIR(st.st_mode);
}

#define REAL(ret, name, ...)                                    \
  static ret (*real_##name)(__VA_ARGS__);                       \
  static ret (*get_##name(void))(__VA_ARGS__) {                 \
    if (!real_##name) real_##name = dlsym(RTLD_NEXT, #name);    \
    return real_##name;                                         \
  }

REAL(int, open, const char*, int, ...)
REAL(int, open64, const char*, int, ...)
REAL(int, openat, int, const char*, int, ...)
REAL(int, openat64, int, const char*, int, ...)
REAL(int, creat, const char*, mode_t)
REAL(int, close, int)
REAL(int, fsync, int)
REAL(int, fdatasync, int)
REAL(int, rename, const char*, const char*)
REAL(int, renameat, int, const char*, int, const char*)
REAL(int, unlink, const char*)
REAL(int, unlinkat, int, const char*, int)
REAL(int, mkdir, const char*, mode_t)
REAL(int, mkdirat, int, const char*, mode_t)
REAL(int, rmdir, const char*)
REAL(ssize_t, write, int, const void*, size_t)

// Around every open: whether it creates or truncates a file under the root, then tracking.
static int opened(int flags, int fd_or_err, int existed, const char* rel) {
  if (fd_or_err < 0 || !rel) return fd_or_err;
  pthread_mutex_lock(&lock);
  if ((flags & O_CREAT) && !existed) emit("create %s", rel);
  else if ((flags & O_TRUNC) && (flags & O_ACCMODE) != O_RDONLY) emit("trunc %s", rel);
  if (fd_or_err < MAX_FDS) {
    free(fd_path[fd_or_err]);
    fd_path[fd_or_err] = strdup(rel);
    fd_writes[fd_or_err] = (flags & O_ACCMODE) != O_RDONLY;
  }
  pthread_mutex_unlock(&lock);
  return fd_or_err;
}

#define OPEN_BODY(DIRFD, REALCALL)                                                          \
  mode_t mode = 0;                                                                          \
  if (flags & (O_CREAT | __O_TMPFILE)) {                                                    \
    va_list a;                                                                              \
    va_start(a, flags);                                                                     \
    mode = va_arg(a, mode_t);                                                               \
    va_end(a);                                                                              \
  }                                                                                         \
  char relbuf[PATH_MAX];                                                                    \
  const char* rel = ready && relative(DIRFD, p, relbuf, sizeof relbuf) ? relbuf : 0;        \
  int existed = 1;                                                                          \
  if (rel) {                                                                                \
    struct stat st;                                                                         \
    existed = syscall(SYS_newfstatat, DIRFD, p, &st, 0) == 0;                               \
  }                                                                                         \
  return opened(flags, REALCALL, existed, rel);

int open(const char* p, int flags, ...) { OPEN_BODY(AT_FDCWD, get_open()(p, flags, mode)) }
int open64(const char* p, int flags, ...) { OPEN_BODY(AT_FDCWD, get_open64()(p, flags, mode)) }
int openat(int dirfd, const char* p, int flags, ...) { OPEN_BODY(dirfd, get_openat()(dirfd, p, flags, mode)) }
int openat64(int dirfd, const char* p, int flags, ...) { OPEN_BODY(dirfd, get_openat64()(dirfd, p, flags, mode)) }
int creat(const char* p, mode_t mode) {
  const int flags = O_CREAT | O_WRONLY | O_TRUNC;
  char relbuf[PATH_MAX];
  const char* rel = ready && relative(AT_FDCWD, p, relbuf, sizeof relbuf) ? relbuf : 0;
  struct stat st;
  const int existed = rel ? syscall(SYS_newfstatat, AT_FDCWD, p, &st, 0) == 0 : 1;
  return opened(flags, get_creat()(p, mode), existed, rel);
}

int close(int fd) {
  if (ready && fd >= 0 && fd < MAX_FDS) {
    pthread_mutex_lock(&lock);
    char* rel = fd_path[fd];
    fd_path[fd] = 0;
    if (rel && fd_writes[fd] && !is_dir_fd(fd)) {
      char blob[64];
      snapshot(rel, blob, sizeof blob);
      emit("close %s %s", rel, blob);
    }
    pthread_mutex_unlock(&lock);
    free(rel);
  }
  return get_close()(fd);
}

static int synced(int fd, int r) {
  if (r != 0 || !ready || fd < 0 || fd >= MAX_FDS) return r;
  pthread_mutex_lock(&lock);
  if (fd_path[fd]) {
    if (is_dir_fd(fd)) {
      emit("fsyncdir %s", fd_path[fd]);
    } else {
      char blob[64];
      snapshot(fd_path[fd], blob, sizeof blob);
      emit("fsync %s %s", fd_path[fd], blob);
    }
  }
  pthread_mutex_unlock(&lock);
  return r;
}
int fsync(int fd) { return synced(fd, get_fsync()(fd)); }
int fdatasync(int fd) { return synced(fd, get_fdatasync()(fd)); }

// A namespace operation on `p` (and `q`), recorded once it succeeded.
static int named(int r, const char* op, int dfd, const char* p, int dfd2, const char* q) {
  if (r != 0 || !ready) return r;
  char a[PATH_MAX], b[PATH_MAX];
  const int in_a = relative(dfd, p, a, sizeof a);
  const int in_b = q ? relative(dfd2, q, b, sizeof b) : 0;
  if (!in_a && !in_b) return r;
  pthread_mutex_lock(&lock);
  if (q && in_a && in_b) emit("%s %s %s", op, a, b);
  else if (q && in_b) emit("create %s", b);  // moved in from outside: appears, new
  else if (q) emit("unlink %s", a);          // moved out
  else emit("%s %s", op, a);
  pthread_mutex_unlock(&lock);
  return r;
}
int rename(const char* p, const char* q) { return named(get_rename()(p, q), "rename", AT_FDCWD, p, AT_FDCWD, q); }
int renameat(int d, const char* p, int d2, const char* q) {
  return named(get_renameat()(d, p, d2, q), "rename", d, p, d2, q);
}
int unlink(const char* p) { return named(get_unlink()(p), "unlink", AT_FDCWD, p, 0, 0); }
int unlinkat(int d, const char* p, int flags) {
  return named(get_unlinkat()(d, p, flags), (flags & AT_REMOVEDIR) ? "rmdir" : "unlink", d, p, 0, 0);
}
int mkdir(const char* p, mode_t m) { return named(get_mkdir()(p, m), "mkdir", AT_FDCWD, p, 0, 0); }
int mkdirat(int d, const char* p, mode_t m) { return named(get_mkdirat()(d, p, m), "mkdir", d, p, 0, 0); }
int rmdir(const char* p) { return named(get_rmdir()(p), "rmdir", AT_FDCWD, p, 0, 0); }

// What the program says (its "committed ..." lines) in order with what it did: std::cerr writes
// through stdio (fwrite, putc), other code may write(2) to descriptor 2 itself.
static void said(const void* b, size_t n) {
  static const char hex[] = "0123456789abcdef";
  while (n > 0) {
    const size_t len = n > 2048 ? 2048 : n;
    char text[2 * 2048 + 1];
    for (size_t i = 0; i < len; ++i) {
      text[2 * i] = hex[((const unsigned char*)b)[i] >> 4];
      text[2 * i + 1] = hex[((const unsigned char*)b)[i] & 15];
    }
    text[2 * len] = 0;
    pthread_mutex_lock(&lock);
    emit("stderr %d %s", (int)getpid(), text);
    pthread_mutex_unlock(&lock);
    b = (const char*)b + len;
    n -= len;
  }
}

REAL(size_t, fwrite, const void*, size_t, size_t, FILE*)
REAL(int, putc, int, FILE*)
REAL(int, fputc, int, FILE*)
REAL(int, _IO_putc, int, FILE*)

ssize_t write(int fd, const void* b, size_t n) {
  const ssize_t r = get_write()(fd, b, n);
  if (ready && fd == 2 && r > 0) said(b, (size_t)r);
  return r;
}
size_t fwrite(const void* b, size_t size, size_t n, FILE* f) {
  const size_t r = get_fwrite()(b, size, n, f);
  if (ready && f == stderr && r > 0) said(b, r * size);
  return r;
}
static int put_char(int r, FILE* f) {
  if (ready && f == stderr && r != EOF) {
    const char c = (char)r;
    said(&c, 1);
  }
  return r;
}
int putc(int c, FILE* f) { return put_char(get_putc()(c, f), f); }
int fputc(int c, FILE* f) { return put_char(get_fputc()(c, f), f); }
int _IO_putc(int c, FILE* f) { return put_char(get__IO_putc()(c, f), f); }
