#include "lib/store/spill.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>

#if defined(WKV_WITH_URING)
#include <liburing.h>
#endif

#include "wavekv/wavekv.h"

namespace wkv {

// The io_uring of a spill file, one user at a time.
struct SpillFile::Ring {
#if defined(WKV_WITH_URING)
  io_uring ring{};
#endif
  std::mutex mu;
};

namespace {

size_t round_block(uint64_t n) { return static_cast<size_t>((n + kSpillBlock - 1) / kSpillBlock * kSpillBlock); }

// Staging buffers, aligned for O_DIRECT.
struct Stage {
  std::vector<uint8_t *> bufs;
  ~Stage() {
    for (uint8_t *b : bufs) std::free(b);
  }
  Status make(size_t n, size_t bytes) {
    for (size_t i = 0; i < n; ++i) {
      void *p = std::aligned_alloc(kSpillBlock, bytes);
      if (!p) return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory for the spill file's staging buffers");
      bufs.push_back(static_cast<uint8_t *>(p));
    }
    return Status::ok();
  }
};

// Opens the spill file in dirfd: an anonymous file where the file system
// has O_TMPFILE, else a named one unlinked at once. O_DIRECT where allowed.
int open_anonymous(FileIO &io, int dirfd, bool *direct) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    const int extra = attempt == 0 ? O_DIRECT : 0;
    int fd = io.open_tmp(dirfd, extra);
    if (fd >= 0) {
      *direct = extra != 0;
      return fd;
    }
    if (fd != -EOPNOTSUPP && fd != -EISDIR && fd != -EINVAL && fd != -ENOENT) return fd;
    // No O_TMPFILE here, or not with O_DIRECT: a named file, unlinked.
    std::random_device rd;
    const std::string name = ".wavekv-spill-" + std::to_string((uint64_t(rd()) << 32) | rd());
    fd = io.create_rw(dirfd, name.c_str(), extra);
    if (fd >= 0) {
      const int u = io.unlink_at(dirfd, name.c_str());
      if (u < 0) {
        io.close(fd);
        return u;
      }
      *direct = extra != 0;
      return fd;
    }
    if (fd != -EINVAL) return fd;  // EINVAL: O_DIRECT refused; try without
  }
  return -EINVAL;
}

}  // namespace

Status SpillFile::open(const Options &opts, std::unique_ptr<SpillFile> *out) {
  std::unique_ptr<SpillFile> f(new SpillFile());
  f->opts_ = opts;
  f->io_ = opts.io ? opts.io : &posix_io();
  const int dirfd = f->io_->open_dir(opts.dir.c_str());
  if (dirfd < 0) return io_status(dirfd, "opening the spill directory '" + opts.dir + "'");
  bool direct = false;
  const int fd = open_anonymous(*f->io_, dirfd, &direct);
  f->io_->close(dirfd);
  if (fd < 0) return io_status(fd, "creating the spill file in '" + opts.dir + "'");
  f->fd_ = fd;
  if (direct) f->bits_ |= WKV_SPILL_IO_DIRECT;
#if defined(WKV_WITH_URING)
  // io_uring only over the real system calls: a test's FaultyIO sees every
  // read and write through pread/pwrite.
  if (!opts.no_uring && !opts.io) {
    auto ring = std::make_unique<Ring>();
    if (io_uring_queue_init(kQueueDepth, &ring->ring, 0) == 0) {
      f->ring_ = std::move(ring);
      f->bits_ |= WKV_SPILL_IO_URING;
    }
  }
#endif
  *out = std::move(f);
  return Status::ok();
}

SpillFile::~SpillFile() {
#if defined(WKV_WITH_URING)
  if (ring_) io_uring_queue_exit(&ring_->ring);
#endif
  if (fd_ >= 0) io_->close(fd_);
}

uint64_t SpillFile::bytes_used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}
uint64_t SpillFile::file_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return end_;
}
uint64_t SpillFile::bytes_written() const {
  std::lock_guard<std::mutex> lock(mu_);
  return written_;
}
uint64_t SpillFile::bytes_read() const {
  std::lock_guard<std::mutex> lock(mu_);
  return read_;
}

Status SpillFile::allocate(uint64_t span, SpillExtent *out) {
  std::lock_guard<std::mutex> lock(mu_);
  // First fit among the holes, else the end of the file.
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < span) continue;
    out->offset = it->first;
    out->span = span;
    const uint64_t rest = it->second - span, at = it->first + span;
    free_.erase(it);
    if (rest) free_.emplace(at, rest);
    used_ += span;
    return Status::ok();
  }
  // A hole at the end is extended rather than left behind.
  uint64_t at = end_;
  auto last = free_.empty() ? free_.end() : std::prev(free_.end());
  if (last != free_.end() && last->first + last->second == end_) at = last->first;
  const uint64_t new_end = at + span;
  if (opts_.budget_bytes && new_end > opts_.budget_bytes)
    return WKV_ERROR(WKV_ERR_BUDGET,
                     "the spill file would grow to %llu bytes, beyond its budget of %llu (%llu in use)",
                     static_cast<unsigned long long>(new_end), static_cast<unsigned long long>(opts_.budget_bytes),
                     static_cast<unsigned long long>(used_));
  if (at != end_) free_.erase(last);
  end_ = new_end;
  out->offset = at;
  out->span = span;
  used_ += span;
  return Status::ok();
}

void SpillFile::release(const SpillExtent &e) noexcept {
  if (e.span == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  used_ -= e.span;
  uint64_t at = e.offset, span = e.span;
  try {
    auto next = free_.lower_bound(at);
    if (next != free_.end() && at + span == next->first) {
      span += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == at) {
        at = prev->first;
        span += prev->second;
        free_.erase(prev);
      }
    }
    free_.emplace(at, span);
  } catch (...) {
    // Out of memory for the free list: the blocks are lost to reuse (the
    // file keeps them) rather than risk a wrong map.
  }
}

Status SpillFile::transfer(bool write, uint64_t offset, uint64_t bytes,
                           const std::function<void(size_t, uint8_t *, size_t)> &fill,
                           const std::function<void(size_t, const uint8_t *, size_t)> &drain) {
  const size_t span = round_block(bytes);
  const size_t chunks = (span + kStageBytes - 1) / kStageBytes;
  auto chunk_len = [&](size_t i) { return std::min(kStageBytes, span - i * kStageBytes); };
  // Payload bytes of chunk i (the rest of the last block is padding).
  auto chunk_payload = [&](size_t i) {
    const uint64_t b = uint64_t(i) * kStageBytes;
    return static_cast<size_t>(std::min<uint64_t>(chunk_len(i), bytes > b ? bytes - b : 0));
  };
  const char *what = write ? "writing the spill file" : "reading the spill file";
  Stage stage;
#if defined(WKV_WITH_URING)
  if (ring_) {
    const size_t depth = std::min<size_t>(kQueueDepth, chunks);
    WKV_RETURN_IF_ERROR(stage.make(depth, kStageBytes));
    std::lock_guard<std::mutex> lock(ring_->mu);
    io_uring *ring = &ring_->ring;
    // Chunk i uses buffer i % depth; at most `depth` in flight, drained (for
    // reads) in order, so that the checksum streams.
    std::vector<int> result(chunks, 0);
    std::vector<char> done(chunks, 0);
    size_t next_submit = 0, next_drain = 0, in_flight = 0;
    int failure = 0;
    size_t failed_len = 0, failed_res = 0;
    auto submit = [&](size_t i) -> bool {
      io_uring_sqe *sqe = io_uring_get_sqe(ring);
      if (!sqe) return false;
      uint8_t *buf = stage.bufs[i % depth];
      const size_t len = chunk_len(i);
      if (write) {
        const size_t pay = chunk_payload(i);
        fill(i, buf, pay);
        if (pay < len) std::memset(buf + pay, 0, len - pay);
        io_uring_prep_write(sqe, fd_, buf, static_cast<unsigned>(len), offset + uint64_t(i) * kStageBytes);
      } else {
        io_uring_prep_read(sqe, fd_, buf, static_cast<unsigned>(len), offset + uint64_t(i) * kStageBytes);
      }
      io_uring_sqe_set_data64(sqe, i);
      return true;
    };
    while (next_drain < chunks && failure == 0) {
      // Fill the queue: a chunk may go once the one that last used its
      // buffer has been drained.
      size_t queued = 0;
      while (next_submit < chunks && next_submit < next_drain + depth && submit(next_submit)) {
        ++next_submit;
        ++queued;
      }
      if (queued) {
        const int r = io_uring_submit(ring);
        if (r < 0) {
          failure = r;
          break;
        }
        in_flight += queued;
      }
      io_uring_cqe *cqe = nullptr;
      const int w = io_uring_wait_cqe(ring, &cqe);
      if (w < 0) {
        if (w == -EINTR) continue;
        failure = w;
        break;
      }
      const size_t i = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
      result[i] = cqe->res;
      done[i] = 1;
      io_uring_cqe_seen(ring, cqe);
      --in_flight;
      while (next_drain < chunks && done[next_drain]) {
        const size_t j = next_drain;
        if (result[j] < 0) {
          failure = result[j];
          break;
        }
        if (static_cast<size_t>(result[j]) != chunk_len(j)) {
          failure = -EIO;
          failed_len = chunk_len(j);
          failed_res = static_cast<size_t>(result[j]);
          break;
        }
        if (!write) drain(j, stage.bufs[j % depth], chunk_payload(j));
        ++next_drain;
      }
    }
    // Nothing may still write a staging buffer once they are freed.
    while (in_flight > 0) {
      io_uring_cqe *cqe = nullptr;
      const int w = io_uring_wait_cqe(ring, &cqe);
      if (w == -EINTR) continue;
      if (w < 0) break;  // the ring is unusable; the buffers leak below
      io_uring_cqe_seen(ring, cqe);
      --in_flight;
    }
    if (in_flight > 0) stage.bufs.clear();  // kept: the kernel may still use them
    if (failure == -EIO && failed_len)
      return WKV_ERROR(WKV_ERR_IO, "%s: %zu of %zu bytes moved (short I/O)", what, failed_res, failed_len);
    if (failure < 0) return io_status(failure, what);
    return Status::ok();
  }
#endif
  WKV_RETURN_IF_ERROR(stage.make(1, std::min(kStageBytes, span)));
  uint8_t *buf = stage.bufs[0];
  for (size_t i = 0; i < chunks; ++i) {
    const size_t len = chunk_len(i), pay = chunk_payload(i);
    const uint64_t at = offset + uint64_t(i) * kStageBytes;
    if (write) {
      fill(i, buf, pay);
      if (pay < len) std::memset(buf + pay, 0, len - pay);
      const int r = write_full(*io_, fd_, buf, len, at);
      if (r < 0) return io_status(r, what);
    } else {
      const int r = read_full(*io_, fd_, buf, len, at);
      if (r < 0) return r == -ENODATA ? WKV_ERROR(WKV_ERR_IO, "%s: the file ends early", what) : io_status(r, what);
      drain(i, buf, pay);
    }
  }
  return Status::ok();
}

Status SpillFile::write(const SpillPiece *pieces, size_t n, SpillExtent *out) {
  uint64_t bytes = 0;
  for (size_t i = 0; i < n; ++i) bytes += pieces[i].n;
  SpillExtent e;
  if (bytes == 0) {
    *out = e;
    return Status::ok();
  }
  WKV_RETURN_IF_ERROR(allocate(round_block(bytes), &e));
  e.bytes = bytes;
  XXH3_state_t h;
  XXH3_64bits_reset(&h);
  size_t piece = 0, at = 0;  // the gather's cursor
  auto fill = [&](size_t, uint8_t *buf, size_t len) {
    size_t done = 0;
    while (done < len) {
      const size_t m = std::min(len - done, pieces[piece].n - at);
      std::memcpy(buf + done, pieces[piece].p + at, m);
      done += m;
      at += m;
      if (at == pieces[piece].n) {
        ++piece;
        at = 0;
      }
    }
    XXH3_64bits_update(&h, buf, len);
  };
  Status st = transfer(true, e.offset, bytes, fill, nullptr);
  if (!st.is_ok()) {
    release(e);
    return st;
  }
  e.checksum = XXH3_64bits_digest(&h);
  {
    std::lock_guard<std::mutex> lock(mu_);
    written_ += e.span;
  }
  *out = e;
  return Status::ok();
}

Status SpillFile::read(const SpillExtent &e, const SpillPiece *pieces, size_t n) {
  if (e.bytes == 0) return Status::ok();
  XXH3_state_t h;
  XXH3_64bits_reset(&h);
  size_t piece = 0, at = 0;  // the scatter's cursor
  auto drain = [&](size_t, const uint8_t *buf, size_t len) {
    XXH3_64bits_update(&h, buf, len);
    size_t done = 0;
    while (done < len && piece < n) {
      const size_t m = std::min(len - done, pieces[piece].n - at);
      std::memcpy(pieces[piece].p + at, buf + done, m);
      done += m;
      at += m;
      if (at == pieces[piece].n) {
        ++piece;
        at = 0;
      }
    }
  };
  WKV_RETURN_IF_ERROR(transfer(false, e.offset, e.bytes, nullptr, drain));
  {
    std::lock_guard<std::mutex> lock(mu_);
    read_ += e.span;
  }
  if (XXH3_64bits_digest(&h) != e.checksum)
    return WKV_ERROR(WKV_ERR_CORRUPT, "a spilled extent (%llu bytes at offset %llu) fails its checksum",
                     static_cast<unsigned long long>(e.bytes), static_cast<unsigned long long>(e.offset));
  return Status::ok();
}

}  // namespace wkv
