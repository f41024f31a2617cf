// The I/O layer under all file code (sequence files, the stats file, the
// spill tier to come): a small interface over file descriptors, a POSIX
// implementation, and a fault-injecting one for tests.
//
// Every function returns 0, a descriptor or a byte count on success and
// -errno on failure, as liburing does; none reads or writes the global
// errno. pread and pwrite may return fewer bytes than asked, as the system
// calls may: read_full and write_full loop over them.
//
// Paths are only ever opened, never interpreted: no ~, no environment, no
// realpath. A file is replaced by writing a temporary file beside it and
// renaming it over (replace_file).
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include "lib/common/status.hpp"

namespace wkv {

class FileIO {
 public:
  virtual ~FileIO() = default;
  // A directory, for the *_at calls and fsync (O_RDONLY | O_DIRECTORY).
  virtual int open_dir(const char *path) = 0;
  // A file for reading. The open never blocks (a FIFO opens at once); it
  // may name anything, and open_to_read refuses what is not a regular file.
  virtual int open_read(const char *path) = 0;
  // Creates `name` in directory `dirfd` for writing, mode 0600; fails with
  // -EEXIST if it exists.
  virtual int create_excl(int dirfd, const char *name) = 0;
  // An anonymous file in directory `dirfd` for reading and writing, mode
  // 0600 (O_TMPFILE; -EOPNOTSUPP or -EISDIR where the file system has none),
  // with `flags` (e.g. O_DIRECT: -EINVAL where it is refused) added.
  virtual int open_tmp(int dirfd, int flags) = 0;
  // Creates `name` for reading and writing, mode 0600, with `flags` added;
  // -EEXIST if it exists.
  virtual int create_rw(int dirfd, const char *name, int flags) = 0;
  virtual int64_t pread(int fd, void *buf, size_t n, uint64_t offset) = 0;  // 0 at the end of the file
  virtual int64_t pwrite(int fd, const void *buf, size_t n, uint64_t offset) = 0;
  virtual int fsync(int fd) = 0;
  virtual int truncate(int fd, uint64_t bytes) = 0;
  // Allocates the file's blocks in [offset, offset + bytes), growing its
  // size to cover them (fallocate mode 0); -EOPNOTSUPP where the file
  // system or the layer has no such call.
  virtual int allocate(int fd, uint64_t offset, uint64_t bytes) {
    (void)fd, (void)offset, (void)bytes;
    return -EOPNOTSUPP;
  }
  // The size of a regular file (-EINVAL for anything else: a pipe has none).
  virtual int size(int fd, uint64_t *bytes) = 0;
  // Renames within one directory, replacing `to` atomically.
  virtual int rename_at(int dirfd, const char *from, const char *to) = 0;
  virtual int unlink_at(int dirfd, const char *name) = 0;
  virtual int close(int fd) = 0;
};

// The system's calls.
class PosixIO final : public FileIO {
 public:
  int open_dir(const char *path) override;
  int open_read(const char *path) override;
  int create_excl(int dirfd, const char *name) override;
  int open_tmp(int dirfd, int flags) override;
  int create_rw(int dirfd, const char *name, int flags) override;
  int64_t pread(int fd, void *buf, size_t n, uint64_t offset) override;
  int64_t pwrite(int fd, const void *buf, size_t n, uint64_t offset) override;
  int fsync(int fd) override;
  int truncate(int fd, uint64_t bytes) override;
  int allocate(int fd, uint64_t offset, uint64_t bytes) override;
  int size(int fd, uint64_t *bytes) override;
  int rename_at(int dirfd, const char *from, const char *to) override;
  int unlink_at(int dirfd, const char *name) override;
  int close(int fd) override;
};

// Another FileIO with faults injected, for tests (SQLite's *fault.test).
// Calls are counted per operation; a fault fires on the n-th call (from 1)
// of its operation, or on every call from the n-th on if `sticky`.
class FaultyIO final : public FileIO {
 public:
  enum class Op { kOpenDir, kOpenRead, kCreate, kRead, kWrite, kFsync, kTruncate, kSize, kRename, kUnlink, kCount };
  enum class Kind {
    kFail,   // return -err, doing nothing
    kShort,  // move at most `bytes` bytes (reads and writes; the caller must loop)
    kTorn,   // write the first `bytes` bytes, then return -err
  };
  struct Fault {
    Op op = Op::kWrite;
    Kind kind = Kind::kFail;
    uint64_t nth = 1;
    bool sticky = false;
    int err = 5;  // EIO
    size_t bytes = 0;
  };

  explicit FaultyIO(FileIO &base) : base_(base) {}
  // Replaces the fault (one at a time) and resets the counters.
  void inject(const Fault &f);
  void clear();
  uint64_t calls(Op op) const;
  // Called before each write with its offset and size (tests block here).
  std::function<void(uint64_t offset, size_t n)> on_write;

  int open_dir(const char *path) override;
  int open_read(const char *path) override;
  int create_excl(int dirfd, const char *name) override;
  int open_tmp(int dirfd, int flags) override;
  int create_rw(int dirfd, const char *name, int flags) override;
  int64_t pread(int fd, void *buf, size_t n, uint64_t offset) override;
  int64_t pwrite(int fd, const void *buf, size_t n, uint64_t offset) override;
  int fsync(int fd) override;
  int truncate(int fd, uint64_t bytes) override;
  int allocate(int fd, uint64_t offset, uint64_t bytes) override;  // no faults: passed through
  int size(int fd, uint64_t *bytes) override;
  int rename_at(int dirfd, const char *from, const char *to) override;
  int unlink_at(int dirfd, const char *name) override;
  int close(int fd) override { return base_.close(fd); }

 private:
  // Counts a call of `op`; the fault to apply to it, or nullptr.
  const Fault *hit(Op op);

  FileIO &base_;
  mutable std::mutex mu_;
  Fault fault_;
  bool armed_ = false;
  uint64_t calls_[static_cast<int>(Op::kCount)] = {};
};

// The process's POSIX I/O layer (stateless, shared).
FileIO &posix_io();

// Reads exactly n bytes at `offset`: 0, -errno, or -ENODATA when the file
// ends first.
int read_full(FileIO &io, int fd, void *buf, size_t n, uint64_t offset);
// Writes exactly n bytes at `offset`: 0 or -errno.
int write_full(FileIO &io, int fd, const void *buf, size_t n, uint64_t offset);

// The text of an error number (negative or positive).
std::string errno_text(int err);

// Splits a path at its last '/' into the directory that holds the file ("."
// without a slash, "/" for a file at the root) and the file's name. False
// when the name is empty (the path ends in '/') or is "." or "..".
bool split_path(const std::string &path, std::string *dir, std::string *name);

// Replaces the file at `path` whole or not at all: creates a temporary file
// beside it (mode 0600), has `fill` write it (from offset 0), fsyncs it if
// `durable`, renames it over `path` and fsyncs the directory if `durable`.
// On any failure the temporary file is removed and `path` is untouched.
// A symbolic link at `path` is replaced itself, never followed (in a
// shared directory another user's link would else send the file wherever it
// points); a target that is not a regular file (a directory, device, FIFO
// or socket) is refused (WKV_ERR_INVALID_ARGUMENT) before anything is
// written: renaming over it would put a regular file in its place.
// Errors: WKV_ERR_IO with the step and the system's words; fill's own.
Status replace_file(FileIO &io, const std::string &path, bool durable, const std::function<Status(int fd)> &fill);

// Opens `path` to read a file of ours (io.open_read): a regular file only,
// else WKV_ERR_INVALID_ARGUMENT naming it; *fd is the caller's to close,
// and *bytes (if given) the file's size.
Status open_to_read(FileIO &io, const std::string &path, int *fd, uint64_t *bytes = nullptr);

// An I/O failure as a Status: "<what>: <errno text>", WKV_ERR_IO, or
// WKV_ERR_CORRUPT for -ENODATA (a file that ends early).
Status io_status(int err, const std::string &what);

}  // namespace wkv
