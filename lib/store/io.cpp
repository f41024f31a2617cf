#include "lib/store/io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

namespace wkv {
namespace {

// Runs a system call and turns -1 into -errno, leaving errno as it was.
template <typename Fn> auto sys(Fn &&call) -> decltype(call()) {
  const int saved = errno;
  auto r = call();
  if (r < 0) r = -errno;
  errno = saved;
  return r;
}

// The GNU strerror_r returns its text (maybe static), the XSI one fills buf.
[[maybe_unused]] std::string strerror_text(const char *r, const char *) { return r; }
[[maybe_unused]] std::string strerror_text(int, const char *buf) { return buf; }

}  // namespace

int PosixIO::open_dir(const char *path) {
  return sys([&] { return ::open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC); });
}

int PosixIO::open_read(const char *path) {
  // O_NONBLOCK: a FIFO without a writer would block the open forever (and
  // open_to_read refuses it); cleared after, for the reads of a file.
  int fd = sys([&] { return ::open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY); });
  // A regular file under a lease (another process's, or a file server's
  // delegation) answers a non-blocking open so: wait for it as a plain
  // open does (a FIFO never answers so).
  struct stat st;
  if (fd == -EWOULDBLOCK && ::stat(path, &st) == 0 && S_ISREG(st.st_mode))
    fd = sys([&] { return ::open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY); });
  if (fd < 0) return fd;
  const int flags = sys([&] { return ::fcntl(fd, F_GETFL); });
  const int r = flags < 0 ? flags : sys([&] { return ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK); });
  if (r < 0) {
    ::close(fd);
    return r;
  }
  return fd;
}

int PosixIO::create_excl(int dirfd, const char *name) {
  return sys([&] { return ::openat(dirfd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600); });
}

int PosixIO::open_tmp(int dirfd, int flags) {
  return sys([&] { return ::openat(dirfd, ".", O_TMPFILE | O_RDWR | O_CLOEXEC | flags, 0600); });
}

int PosixIO::create_rw(int dirfd, const char *name, int flags) {
  return sys([&] { return ::openat(dirfd, name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | flags, 0600); });
}

int64_t PosixIO::pread(int fd, void *buf, size_t n, uint64_t offset) {
  return sys([&] { return static_cast<int64_t>(::pread(fd, buf, n, static_cast<off_t>(offset))); });
}

int64_t PosixIO::pwrite(int fd, const void *buf, size_t n, uint64_t offset) {
  return sys([&] { return static_cast<int64_t>(::pwrite(fd, buf, n, static_cast<off_t>(offset))); });
}

int PosixIO::fsync(int fd) { return sys([&] { return ::fsync(fd); }); }

int PosixIO::truncate(int fd, uint64_t bytes) {
  return sys([&] { return ::ftruncate(fd, static_cast<off_t>(bytes)); });
}

int PosixIO::allocate(int fd, uint64_t offset, uint64_t bytes) {
  return sys([&] { return ::fallocate(fd, 0, static_cast<off_t>(offset), static_cast<off_t>(bytes)); });
}

int PosixIO::size(int fd, uint64_t *bytes) {
  struct stat st;
  const int r = sys([&] { return ::fstat(fd, &st); });
  if (r < 0) return r;
  if (!S_ISREG(st.st_mode)) return -EINVAL;
  *bytes = static_cast<uint64_t>(st.st_size);
  return 0;
}

int PosixIO::rename_at(int dirfd, const char *from, const char *to) {
  return sys([&] { return ::renameat(dirfd, from, dirfd, to); });
}

int PosixIO::unlink_at(int dirfd, const char *name) { return sys([&] { return ::unlinkat(dirfd, name, 0); }); }

int PosixIO::close(int fd) { return sys([&] { return ::close(fd); }); }

FileIO &posix_io() {
  static PosixIO io;
  return io;
}

void FaultyIO::inject(const Fault &f) {
  std::lock_guard<std::mutex> lock(mu_);
  fault_ = f;
  armed_ = true;
  std::fill(std::begin(calls_), std::end(calls_), 0);
}

void FaultyIO::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
  std::fill(std::begin(calls_), std::end(calls_), 0);
}

uint64_t FaultyIO::calls(Op op) const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_[static_cast<int>(op)];
}

const FaultyIO::Fault *FaultyIO::hit(Op op) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t n = ++calls_[static_cast<int>(op)];
  if (!armed_ || fault_.op != op) return nullptr;
  return n == fault_.nth || (fault_.sticky && n > fault_.nth) ? &fault_ : nullptr;
}

int FaultyIO::open_dir(const char *path) {
  if (const Fault *f = hit(Op::kOpenDir)) return -f->err;
  return base_.open_dir(path);
}

int FaultyIO::open_read(const char *path) {
  if (const Fault *f = hit(Op::kOpenRead)) return -f->err;
  return base_.open_read(path);
}

int FaultyIO::create_excl(int dirfd, const char *name) {
  if (const Fault *f = hit(Op::kCreate)) return -f->err;
  return base_.create_excl(dirfd, name);
}

int FaultyIO::open_tmp(int dirfd, int flags) {
  if (const Fault *f = hit(Op::kCreate)) return -f->err;
  return base_.open_tmp(dirfd, flags);
}

int FaultyIO::create_rw(int dirfd, const char *name, int flags) {
  if (const Fault *f = hit(Op::kCreate)) return -f->err;
  return base_.create_rw(dirfd, name, flags);
}

int64_t FaultyIO::pread(int fd, void *buf, size_t n, uint64_t offset) {
  if (const Fault *f = hit(Op::kRead)) {
    if (f->kind != Kind::kShort) return -f->err;
    n = std::min(n, std::max<size_t>(f->bytes, 1));
  }
  return base_.pread(fd, buf, n, offset);
}

int64_t FaultyIO::pwrite(int fd, const void *buf, size_t n, uint64_t offset) {
  if (on_write) on_write(offset, n);
  if (const Fault *f = hit(Op::kWrite)) {
    switch (f->kind) {
      case Kind::kFail: return -f->err;
      case Kind::kShort: n = std::min(n, std::max<size_t>(f->bytes, 1)); break;
      case Kind::kTorn: {
        const int64_t w = base_.pwrite(fd, buf, std::min(n, f->bytes), offset);
        return w < 0 ? w : -f->err;
      }
    }
  }
  return base_.pwrite(fd, buf, n, offset);
}

int FaultyIO::fsync(int fd) {
  if (const Fault *f = hit(Op::kFsync)) return -f->err;
  return base_.fsync(fd);
}

int FaultyIO::truncate(int fd, uint64_t bytes) {
  if (const Fault *f = hit(Op::kTruncate)) return -f->err;
  return base_.truncate(fd, bytes);
}

int FaultyIO::allocate(int fd, uint64_t offset, uint64_t bytes) { return base_.allocate(fd, offset, bytes); }

int FaultyIO::size(int fd, uint64_t *bytes) {
  if (const Fault *f = hit(Op::kSize)) return -f->err;
  return base_.size(fd, bytes);
}

int FaultyIO::rename_at(int dirfd, const char *from, const char *to) {
  if (const Fault *f = hit(Op::kRename)) return -f->err;
  return base_.rename_at(dirfd, from, to);
}

int FaultyIO::unlink_at(int dirfd, const char *name) {
  if (const Fault *f = hit(Op::kUnlink)) return -f->err;
  return base_.unlink_at(dirfd, name);
}

int read_full(FileIO &io, int fd, void *buf, size_t n, uint64_t offset) {
  uint8_t *p = static_cast<uint8_t *>(buf);
  while (n > 0) {
    const int64_t r = io.pread(fd, p, n, offset);
    if (r == -EINTR) continue;
    if (r < 0) return static_cast<int>(r);
    if (r == 0) return -ENODATA;
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return 0;
}

int write_full(FileIO &io, int fd, const void *buf, size_t n, uint64_t offset) {
  const uint8_t *p = static_cast<const uint8_t *>(buf);
  while (n > 0) {
    const int64_t r = io.pwrite(fd, p, n, offset);
    if (r == -EINTR) continue;
    if (r < 0) return static_cast<int>(r);
    if (r == 0) return -EIO;  // no progress: never loop forever
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return 0;
}

std::string errno_text(int err) {
  if (err < 0) err = -err;
  char buf[128] = "";
  return strerror_text(strerror_r(err, buf, sizeof buf), buf);
}

bool split_path(const std::string &path, std::string *dir, std::string *name) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) {
    *dir = ".";
    *name = path;
  } else {
    *dir = slash == 0 ? "/" : path.substr(0, slash);
    *name = path.substr(slash + 1);
  }
  return !name->empty() && *name != "." && *name != "..";
}

Status io_status(int err, const std::string &what) {
  if (err == -ENODATA) return WKV_ERROR(WKV_ERR_CORRUPT, "%s: the file ends early", what.c_str());
  return WKV_ERROR(WKV_ERR_IO, "%s: %s", what.c_str(), errno_text(err).c_str());
}

namespace {

const char *file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// Whether replace_file may rename over `path` (its header comment): nothing
// there, a regular file, or a symbolic link (the link itself is replaced,
// never followed: in a shared directory, another user's link would else
// send the file wherever it points).
Status check_replaceable(const std::string &path) {
  struct stat st;
  if (sys([&] { return ::lstat(path.c_str(), &st); }) < 0) return Status::ok();  // new, or the directory's error
  if (S_ISREG(st.st_mode) || S_ISLNK(st.st_mode)) return Status::ok();
  return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                   "'%s' is %s, not a regular file: a file is saved whole by renaming a new one over it, which would "
                   "put a regular file in its place",
                   path.c_str(), file_kind(st.st_mode));
}

}  // namespace

Status open_to_read(FileIO &io, const std::string &path, int *fd, uint64_t *bytes) {
  *fd = io.open_read(path.c_str());
  if (*fd < 0) return io_status(*fd, "opening '" + path + "'");
  uint64_t size = 0;
  const int r = io.size(*fd, &size);
  if (bytes) *bytes = size;
  if (r == 0) return Status::ok();
  io.close(*fd);
  *fd = -1;
  if (r == -EINVAL)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "not a regular file (a directory, device, FIFO or socket)");
  return io_status(r, "the size of '" + path + "'");
}

Status replace_file(FileIO &io, const std::string &path, bool durable, const std::function<Status(int fd)> &fill) {
  std::string dir, name;
  WKV_RETURN_IF_ERROR(check_replaceable(path));
  if (!split_path(path, &dir, &name))
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "'%s' does not name a file", path.c_str());
  // 1. The directory, which the temporary file, the rename and its fsync use.
  const int dirfd = io.open_dir(dir.c_str());
  if (dirfd < 0) return io_status(dirfd, "opening the directory '" + dir + "'");
  struct CloseDir {
    FileIO &io;
    int fd;
    ~CloseDir() { io.close(fd); }
  } close_dir{io, dirfd};

  // 2. A temporary file beside the target, under a name no other writer
  //    uses (this process, a counter; O_EXCL settles the rest).
  static std::atomic<uint64_t> counter{0};
  std::string tmp;
  int fd = -EEXIST;
  for (int attempt = 0; attempt < 100 && fd == -EEXIST; ++attempt) {
    tmp = format(".%.64s.%ld.%llu.tmp", name.c_str(), static_cast<long>(getpid()),
                 static_cast<unsigned long long>(counter.fetch_add(1)));
    fd = io.create_excl(dirfd, tmp.c_str());
  }
  if (fd < 0) return io_status(fd, "creating a temporary file in '" + dir + "'");

  // 3. Fill, fsync, close; 4. rename over the target, fsync the directory.
  Status st = fill(fd);
  if (st.is_ok() && durable) {
    const int r = io.fsync(fd);
    if (r < 0) st = io_status(r, "fsync of '" + path + "'");
  }
  const int closed = io.close(fd);
  if (st.is_ok() && closed < 0) st = io_status(closed, "closing '" + path + "'");
  if (st.is_ok()) {
    const int r = io.rename_at(dirfd, tmp.c_str(), name.c_str());
    if (r < 0) st = io_status(r, "renaming the temporary file to '" + path + "'");
  }
  if (!st.is_ok()) {
    io.unlink_at(dirfd, tmp.c_str());
    return st;
  }
  if (durable) {
    const int r = io.fsync(dirfd);
    if (r < 0) return io_status(r, "fsync of the directory '" + dir + "'");
  }
  return Status::ok();
}

}  // namespace wkv
