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
#include <sys/uio.h>
#endif

#include "wavekv/wavekv.h"

namespace wkv {

// The io_uring of a spill file, one user at a time.
// Its staging buffers (kStageBuffers of kStageBytes, aligned for O_DIRECT)
// live as long as it does, registered with the kernel where it allows
// (`fixed`: the reads and writes through them skip the page pinning of each
// request). `broken`: a request could not be reaped, so the kernel may still
// use a buffer: the ring is left alone from then on (pread/pwrite).
struct SpillFile::Ring {
#if defined(WKV_WITH_URING)
  io_uring ring{};
#endif
  std::mutex mu;
  std::vector<uint8_t *> bufs;
  bool fixed = false;
  bool broken = false;
  ~Ring() {
    for (uint8_t *b : bufs) std::free(b);
  }
};

namespace {

size_t round_block(uint64_t n) { return static_cast<size_t>((n + kSpillBlock - 1) / kSpillBlock * kSpillBlock); }

#if defined(WKV_WITH_URING)
// Waits for the requests still in flight (after a failure), so that nothing
// the kernel writes lands in memory given back. False where the ring could
// not reap them all (the caller must leave the ring and its buffers alone).
bool reap_all(io_uring *ring, size_t *in_flight) {
  while (*in_flight > 0) {
    io_uring_cqe *cqe = nullptr;
    const int w = io_uring_wait_cqe(ring, &cqe);
    if (w == -EINTR) continue;
    if (w < 0) return false;
    io_uring_cqe_seen(ring, cqe);
    --*in_flight;
  }
  return true;
}

// Submits the `queued` requests prepared in the ring and counts those the
// kernel took in *in_flight. 0, or an error when it took fewer: the rest
// stay prepared in the ring, which the caller must then leave alone.
int submit_prepared(io_uring *ring, size_t queued, size_t *in_flight) {
  const int r = io_uring_submit(ring);
  if (r >= 0) *in_flight += static_cast<size_t>(r);
  if (r < 0) return r;
  return static_cast<size_t>(r) == queued ? 0 : -EIO;
}
#endif

// What a transfer's failure says: a short request (-EIO with its sizes), an
// errno, or none.
Status transfer_status(int failure, size_t failed_len, size_t failed_res, const char *what) {
  if (failure == -EIO && failed_len)
    return WKV_ERROR(WKV_ERR_IO, "%s: %zu of %zu bytes moved (short I/O)", what, failed_res, failed_len);
  if (failure < 0) return io_status(failure, what);
  return Status::ok();
}

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
    bool bufs = true;
    for (uint32_t i = 0; i < kStageBuffers && bufs; ++i) {
      void *p = std::aligned_alloc(kSpillBlock, kStageBytes);
      bufs = p != nullptr;
      if (p) ring->bufs.push_back(static_cast<uint8_t *>(p));
    }
    if (bufs && io_uring_queue_init(kRingEntries, &ring->ring, 0) == 0) {
      // Registered where the locked-memory limit allows; plain requests
      // through the same buffers otherwise.
      iovec iov[kStageBuffers];
      for (uint32_t i = 0; i < kStageBuffers; ++i) iov[i] = iovec{ring->bufs[i], kStageBytes};
      ring->fixed = io_uring_register_buffers(&ring->ring, iov, kStageBuffers) == 0;
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
  if (ring_) io_uring_queue_exit(&ring_->ring);  // before its buffers go
#endif
  if (fd_ >= 0) io_->close(fd_);
}

bool SpillFile::registered_buffers() const { return ring_ && ring_->fixed; }

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
  if (new_end > allocated_ && !no_allocate_) {
    uint64_t target = (new_end + kAllocateStep - 1) / kAllocateStep * kAllocateStep;
    if (opts_.budget_bytes) target = std::max(new_end, std::min(target, opts_.budget_bytes));
    const int r = io_->allocate(fd_, allocated_, target - allocated_);
    if (r == 0)
      allocated_ = target;
    else if (r == -EOPNOTSUPP || r == -ENOSYS)
      no_allocate_ = true;  // the writes extend the file instead
    // Other failures (ENOSPC): the write reports what the disk says.
  }
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

std::vector<SpillFile::Op> SpillFile::chunk_ops(uint64_t offset, uint64_t bytes) {
  std::vector<Op> ops;
  const uint64_t span = round_block(bytes);
  for (uint64_t b = 0; b < span; b += kStageBytes) {
    Op o;
    o.offset = offset + b;
    o.len = static_cast<uint32_t>(std::min<uint64_t>(kStageBytes, span - b));
    o.payload = static_cast<uint32_t>(std::min<uint64_t>(o.len, bytes > b ? bytes - b : 0));
    ops.push_back(o);
  }
  return ops;
}

Status SpillFile::transfer(bool write, const std::vector<Op> &ops,
                           const std::function<void(size_t, uint8_t *, size_t)> &fill,
                           const std::function<void(size_t, const uint8_t *, size_t)> &drain) {
  const size_t n_ops = ops.size();
  if (n_ops == 0) return Status::ok();
  const char *what = write ? "writing the spill file" : "reading the spill file";
  Stage stage;
#if defined(WKV_WITH_URING)
  std::unique_lock<std::mutex> lock;
  if (ring_) lock = std::unique_lock<std::mutex>(ring_->mu);
  if (ring_ && !ring_->broken) {
    const size_t depth = std::min<size_t>(kQueueDepth, n_ops), nbuf = kStageBuffers;
    io_uring *ring = &ring_->ring;
    const bool fixed = ring_->fixed;
    // Op i uses buffer i % nbuf; at most `depth` in flight, drained (for
    // reads) in order, so that checksums stream; an op may go once the one
    // that last used its buffer has been drained.
    std::vector<int> result(n_ops, 0);
    std::vector<char> done(n_ops, 0);
    size_t next_submit = 0, next_drain = 0, in_flight = 0;
    int failure = 0;
    size_t failed_len = 0, failed_res = 0;
    auto submit = [&](size_t i) -> bool {
      io_uring_sqe *sqe = io_uring_get_sqe(ring);
      if (!sqe) return false;
      const int b = static_cast<int>(i % nbuf);
      uint8_t *buf = ring_->bufs[b];
      const Op &o = ops[i];
      if (write) {
        fill(i, buf, o.payload);
        if (o.payload < o.len) std::memset(buf + o.payload, 0, o.len - o.payload);
        if (fixed)
          io_uring_prep_write_fixed(sqe, fd_, buf, o.len, o.offset, b);
        else
          io_uring_prep_write(sqe, fd_, buf, o.len, o.offset);
      } else if (fixed) {
        io_uring_prep_read_fixed(sqe, fd_, buf, o.len, o.offset, b);
      } else {
        io_uring_prep_read(sqe, fd_, buf, o.len, o.offset);
      }
      io_uring_sqe_set_data64(sqe, i);
      return true;
    };
    // A completion's result, recorded for the in-order drain.
    auto reap = [&](io_uring_cqe *cqe) {
      const size_t i = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
      result[i] = cqe->res;
      done[i] = 1;
      io_uring_cqe_seen(ring, cqe);
      --in_flight;
    };
    // Tops the queue up: the completions already there reaped, then up to
    // `depth` in flight, an op once the one that last used its buffer has
    // been drained. Called after every drained op, so that the disk never
    // waits for the gather, the scatter or the checksum of a burst.
    auto top_up = [&]() -> int {
      io_uring_cqe *cqe = nullptr;
      while (in_flight > 0 && io_uring_peek_cqe(ring, &cqe) == 0 && cqe) reap(cqe);
      size_t queued = 0;
      while (next_submit < n_ops && in_flight + queued < depth && next_submit < next_drain + nbuf &&
             submit(next_submit)) {
        ++next_submit;
        ++queued;
      }
      if (!queued) return 0;
      const int r = submit_prepared(ring, queued, &in_flight);
      if (r) ring_->broken = true;
      return r;
    };
    while (next_drain < n_ops && failure == 0) {
      if (const int r = top_up()) {
        failure = r;
        break;
      }
      if (!done[next_drain]) {
        io_uring_cqe *cqe = nullptr;
        const int w = io_uring_wait_cqe(ring, &cqe);
        if (w < 0) {
          if (w == -EINTR) continue;
          failure = w;
          break;
        }
        reap(cqe);
      }
      while (next_drain < n_ops && done[next_drain] && failure == 0) {
        const size_t j = next_drain;
        if (result[j] < 0) {
          failure = result[j];
          break;
        }
        if (static_cast<size_t>(result[j]) != ops[j].len) {
          failure = -EIO;
          failed_len = ops[j].len;
          failed_res = static_cast<size_t>(result[j]);
          break;
        }
        if (!write) drain(j, ring_->bufs[j % nbuf], ops[j].payload);
        ++next_drain;
        if (const int r = top_up()) failure = r;
      }
    }
    // Nothing may still use a staging buffer once the next call takes it.
    if (!reap_all(ring, &in_flight)) ring_->broken = true;  // the buffers stay the kernel's
    return transfer_status(failure, failed_len, failed_res, what);
  }
#endif
  size_t largest = 0;
  for (const Op &o : ops) largest = std::max<size_t>(largest, o.len);
  WKV_RETURN_IF_ERROR(stage.make(1, largest));
  uint8_t *buf = stage.bufs[0];
  for (size_t i = 0; i < n_ops; ++i) {
    const Op &o = ops[i];
    if (write) {
      fill(i, buf, o.payload);
      if (o.payload < o.len) std::memset(buf + o.payload, 0, o.len - o.payload);
      const int r = write_full(*io_, fd_, buf, o.len, o.offset);
      if (r < 0) return io_status(r, what);
    } else {
      const int r = read_full(*io_, fd_, buf, o.len, o.offset);
      if (r < 0) return r == -ENODATA ? WKV_ERROR(WKV_ERR_IO, "%s: the file ends early", what) : io_status(r, what);
      drain(i, buf, o.payload);
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
  std::vector<Op> ops;
  Status st = Status::ok();
  try {
    ops = chunk_ops(e.offset, bytes);
  } catch (const std::bad_alloc &) {
    st = WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory writing the spill file");
  }
  if (st.is_ok()) st = transfer(true, ops, fill, nullptr);
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
  std::vector<Op> ops;
  try {
    ops = chunk_ops(e.offset, e.bytes);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory reading the spill file");
  }
  WKV_RETURN_IF_ERROR(transfer(false, ops, nullptr, drain));
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

namespace wkv {

Status SpillFile::write_many(const uint8_t *const *items, size_t n, size_t bytes, SpillExtent *out) {
  if (n == 0 || bytes == 0) return Status::ok();
  const uint64_t span = round_block(bytes);
  SpillExtent all;
  WKV_RETURN_IF_ERROR(allocate(span * n, &all));
  std::vector<Op> ops;
  Status st = Status::ok();
  try {
    ops = chunk_ops(all.offset, span * n);
  } catch (const std::bad_alloc &) {
    st = WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory writing the spill file");
  }
  // Op i covers bytes [i * kStageBytes, + len) of the run of extents.
  auto fill = [&](size_t i, uint8_t *buf, size_t len) {
    uint64_t pos = uint64_t(i) * kStageBytes;
    const uint64_t end = pos + len;
    while (pos < end) {
      const size_t k = static_cast<size_t>(pos / span);
      const uint64_t within = pos % span;
      const size_t m = static_cast<size_t>(std::min(span - within, end - pos));
      const size_t data = within < bytes ? static_cast<size_t>(std::min<uint64_t>(m, bytes - within)) : 0;
      uint8_t *dst = buf + (pos - uint64_t(i) * kStageBytes);
      if (data) std::memcpy(dst, items[k] + within, data);
      if (data < m) std::memset(dst + data, 0, m - data);
      pos += m;
    }
  };
  if (st.is_ok()) st = transfer(true, ops, fill, nullptr);
  if (!st.is_ok()) {
    release(all);
    return st;
  }
  for (size_t k = 0; k < n; ++k)
    out[k] = SpillExtent{all.offset + k * span, span, bytes, XXH3_64bits(items[k], bytes)};
  std::lock_guard<std::mutex> lock(mu_);
  written_ += span * n;
  return Status::ok();
}

bool SpillFile::read_direct(const SpillExtent *ext, uint8_t *const *dst, size_t n, Status *each, Status *st) {
#if defined(WKV_WITH_URING)
  if (!ring_ || n == 0) return false;
  for (size_t k = 0; k < n; ++k)
    if (reinterpret_cast<uintptr_t>(dst[k]) % kSpillBlock != 0 || ext[k].bytes % kSpillBlock != 0 ||
        ext[k].bytes == 0 || ext[k].bytes > kStageBytes)
      return false;
  std::lock_guard<std::mutex> lock(ring_->mu);
  if (ring_->broken) return false;
  io_uring *ring = &ring_->ring;
  size_t next = 0, in_flight = 0, done = 0;
  int failure = 0;
  size_t failed_len = 0, failed_res = 0;
  uint64_t spans = 0;
  while (done < n && failure == 0) {
    size_t queued = 0;
    while (next < n && in_flight + queued < kRingEntries) {
      io_uring_sqe *sqe = io_uring_get_sqe(ring);
      if (!sqe) break;
      io_uring_prep_read(sqe, fd_, dst[next], static_cast<unsigned>(ext[next].bytes), ext[next].offset);
      io_uring_sqe_set_data64(sqe, next);
      ++next;
      ++queued;
    }
    if (queued) {
      if (const int r = submit_prepared(ring, queued, &in_flight)) {
        ring_->broken = true;
        failure = r;
        break;
      }
    }
    io_uring_cqe *cqe = nullptr;
    const int w = io_uring_wait_cqe(ring, &cqe);
    if (w < 0) {
      if (w == -EINTR) continue;
      failure = w;
      break;
    }
    const size_t k = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
    const int res = cqe->res;
    io_uring_cqe_seen(ring, cqe);
    --in_flight;
    ++done;
    if (res < 0) {
      failure = res;
    } else if (static_cast<uint64_t>(res) != ext[k].bytes) {
      failure = -EIO;
      failed_len = ext[k].bytes;
      failed_res = static_cast<size_t>(res);
    } else {
      spans += ext[k].span;
      each[k] = XXH3_64bits(dst[k], ext[k].bytes) == ext[k].checksum
                    ? Status::ok()
                    : WKV_ERROR(WKV_ERR_CORRUPT, "a spilled extent (%llu bytes at offset %llu) fails its checksum",
                                static_cast<unsigned long long>(ext[k].bytes),
                                static_cast<unsigned long long>(ext[k].offset));
    }
  }
  if (!reap_all(ring, &in_flight)) ring_->broken = true;  // nothing may still write a slot
  {
    std::lock_guard<std::mutex> counters(mu_);
    read_ += spans;
  }
  *st = transfer_status(failure, failed_len, failed_res, "reading the spill file");
  return true;
#else
  (void)ext, (void)dst, (void)n, (void)each, (void)st;
  return false;
#endif
}

Status SpillFile::read_many(const SpillExtent *ext, uint8_t *const *dst, size_t n, Status *each) {
  for (size_t k = 0; k < n; ++k) each[k] = Status::ok();
  Status direct;
  if (read_direct(ext, dst, n, each, &direct)) return direct;
  std::vector<Op> ops;
  std::vector<std::pair<size_t, uint64_t>> where;  // per op: item, offset in it
  uint64_t spans = 0;
  try {
    for (size_t k = 0; k < n; ++k) {
      each[k] = Status::ok();
      std::vector<Op> o = chunk_ops(ext[k].offset, ext[k].bytes);
      for (const Op &x : o) {
        where.emplace_back(k, x.offset - ext[k].offset);
        ops.push_back(x);
      }
      spans += ext[k].span;
    }
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory reading the spill file");
  }
  // Ops of one item are consecutive and drained in order: one hash state.
  XXH3_state_t h;
  size_t item = n;
  auto drain = [&](size_t j, const uint8_t *buf, size_t len) {
    const size_t k = where[j].first;
    if (k != item) {
      XXH3_64bits_reset(&h);
      item = k;
    }
    XXH3_64bits_update(&h, buf, len);
    std::memcpy(dst[k] + where[j].second, buf, len);
    if (where[j].second + len == ext[k].bytes && XXH3_64bits_digest(&h) != ext[k].checksum)
      each[k] = WKV_ERROR(WKV_ERR_CORRUPT, "a spilled extent (%llu bytes at offset %llu) fails its checksum",
                          static_cast<unsigned long long>(ext[k].bytes),
                          static_cast<unsigned long long>(ext[k].offset));
  };
  WKV_RETURN_IF_ERROR(transfer(false, ops, nullptr, drain));
  std::lock_guard<std::mutex> lock(mu_);
  read_ += spans;
  return Status::ok();
}

// Several extents in one pass: a cursor over each extent's pieces, in op
// order (fill and drain see the ops in order).
namespace {
struct ExtentCursor {
  ExtentCursor(const SpillPiece *p, const size_t *f) : pieces(p), first(f) {}
  const SpillPiece *pieces;
  const size_t *first;
  size_t k = SIZE_MAX, piece = 0, at = 0;
  XXH3_state_t h{};
  // Moves to extent k (its first byte) when it is not there already.
  bool enter(size_t next) {
    if (next == k) return false;
    k = next;
    piece = first[k];
    at = 0;
    XXH3_64bits_reset(&h);
    return true;
  }
  // Copies len bytes between the extent's pieces and buf (to buf when
  // `out`), from where the cursor is.
  void move(uint8_t *buf, size_t len, bool out) {
    size_t done = 0;
    while (done < len && piece < first[k + 1]) {
      const size_t m = std::min(len - done, pieces[piece].n - at);
      if (out)
        std::memcpy(buf + done, pieces[piece].p + at, m);
      else
        std::memcpy(pieces[piece].p + at, buf + done, m);
      done += m;
      at += m;
      if (at == pieces[piece].n) {
        ++piece;
        at = 0;
      }
    }
  }
};
}  // namespace

Status SpillFile::write_extents(const SpillPiece *pieces, const size_t *first, size_t n, SpillExtent *out) {
  std::vector<Op> ops;
  std::vector<size_t> owner;  // per op: its extent
  std::vector<SpillExtent> ext(n);
  SpillExtent all;
  try {
    uint64_t total = 0;
    for (size_t k = 0; k < n; ++k) {
      for (size_t i = first[k]; i < first[k + 1]; ++i) ext[k].bytes += pieces[i].n;
      ext[k].span = round_block(ext[k].bytes);
      total += ext[k].span;
    }
    if (total > 0) WKV_RETURN_IF_ERROR(allocate(total, &all));
    uint64_t at = all.offset;
    for (size_t k = 0; k < n; ++k) {
      ext[k].offset = ext[k].bytes ? at : 0;
      at += ext[k].span;
      for (const Op &o : chunk_ops(ext[k].offset, ext[k].bytes)) {
        ops.push_back(o);
        owner.push_back(k);
      }
    }
  } catch (const std::bad_alloc &) {
    if (all.span) release(all);
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory writing the spill file");
  }
  ExtentCursor cur(pieces, first);
  auto fill = [&](size_t i, uint8_t *buf, size_t len) {
    const size_t k = owner[i];
    if (cur.k != k && cur.k != SIZE_MAX) ext[cur.k].checksum = XXH3_64bits_digest(&cur.h);
    cur.enter(k);
    cur.move(buf, len, true);
    XXH3_64bits_update(&cur.h, buf, len);
  };
  Status st = transfer(true, ops, fill, nullptr);
  if (!st.is_ok()) {
    if (all.span) release(all);
    return st;
  }
  if (cur.k != SIZE_MAX) ext[cur.k].checksum = XXH3_64bits_digest(&cur.h);
  for (size_t k = 0; k < n; ++k) {
    if (ext[k].bytes == 0) ext[k] = SpillExtent{};
    out[k] = ext[k];
  }
  std::lock_guard<std::mutex> lock(mu_);
  written_ += all.span;
  return Status::ok();
}

Status SpillFile::read_extents(const SpillExtent *ext, const SpillPiece *pieces, const size_t *first, size_t n,
                               Status *each) {
  std::vector<Op> ops;
  std::vector<size_t> owner;
  uint64_t spans = 0;
  try {
    for (size_t k = 0; k < n; ++k) {
      each[k] = Status::ok();
      for (const Op &o : chunk_ops(ext[k].offset, ext[k].bytes)) {
        ops.push_back(o);
        owner.push_back(k);
      }
      spans += ext[k].span;
    }
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory reading the spill file");
  }
  ExtentCursor cur(pieces, first);
  auto check = [&] {
    if (cur.k != SIZE_MAX && XXH3_64bits_digest(&cur.h) != ext[cur.k].checksum)
      each[cur.k] = WKV_ERROR(WKV_ERR_CORRUPT, "a spilled extent (%llu bytes at offset %llu) fails its checksum",
                              static_cast<unsigned long long>(ext[cur.k].bytes),
                              static_cast<unsigned long long>(ext[cur.k].offset));
  };
  auto drain = [&](size_t i, const uint8_t *buf, size_t len) {
    if (cur.k != owner[i]) check();
    cur.enter(owner[i]);
    XXH3_64bits_update(&cur.h, buf, len);
    cur.move(const_cast<uint8_t *>(buf), len, false);
  };
  WKV_RETURN_IF_ERROR(transfer(false, ops, nullptr, drain));
  check();
  std::lock_guard<std::mutex> lock(mu_);
  read_ += spans;
  return Status::ok();
}

}  // namespace wkv
