// The spill file: where evicted pages go when host memory is short
// (wkv_seq_evict). One anonymous file per engine in the configured
// directory, gone when the engine closes or the process dies; extents of
// whole 4 KiB blocks, each written and read in one piece through aligned
// staging buffers (so any page slot size is fine, head_dim 80 and 96
// included), each with an XXH3-64 checksum kept in memory and checked
// before a byte read back is used.
//
// I/O: io_uring (liburing) with up to kQueueDepth requests in flight through
// staging buffers registered with the kernel where it allows it (reads of
// page slots that are 4 KiB-aligned go straight into them, up to
// kRingEntries in flight), else pread/pwrite through the FileIO layer (which
// tests replace with a FaultyIO); O_DIRECT where the file system allows it
// (not tmpfs), else the page cache. Chosen at open, reported by io_bits().
//
// Thread safety: writes and reads of different extents may run from several
// threads; each call is synchronous (it returns once its I/O has ended) and
// uses a staging set of its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "lib/common/status.hpp"
#include "lib/store/io.hpp"

namespace wkv {

// A run of blocks of the spill file and what it holds.
struct SpillExtent {
  uint64_t offset = 0;    // in the file, a multiple of kSpillBlock
  uint64_t span = 0;      // bytes reserved, a multiple of kSpillBlock
  uint64_t bytes = 0;     // payload bytes (<= span)
  uint64_t checksum = 0;  // XXH3-64 of the payload
};

constexpr size_t kSpillBlock = 4096;

// A piece of host memory an extent's payload is gathered from or scattered to.
struct SpillPiece {
  uint8_t *p = nullptr;
  size_t n = 0;
};

class SpillFile {
 public:
  struct Options {
    std::string dir;
    uint64_t budget_bytes = 0;  // 0 = unlimited
    bool no_uring = false;      // pread/pwrite even where io_uring works
    FileIO *io = nullptr;       // the pread/pwrite path's I/O (posix_io() if null)
  };
  // Bits of io_bits(): WKV_SPILL_IO_URING, WKV_SPILL_IO_DIRECT.
  static Status open(const Options &opts, std::unique_ptr<SpillFile> *out);
  ~SpillFile();
  SpillFile(const SpillFile &) = delete;
  SpillFile &operator=(const SpillFile &) = delete;

  // Writes the pieces, concatenated, into a new extent. All or nothing: on
  // any failure no extent is kept. WKV_ERR_BUDGET when the file would grow
  // beyond its budget, WKV_ERR_IO for a failed write.
  Status write(const SpillPiece *pieces, size_t n, SpillExtent *out);
  // Reads an extent's payload into the pieces (their sizes summing to
  // e.bytes) and checks its checksum: WKV_ERR_CORRUPT when it fails (the
  // pieces then hold bytes that must not be used), WKV_ERR_IO for a failed
  // read. The extent stays allocated either way.
  Status read(const SpillExtent &e, const SpillPiece *pieces, size_t n);
  // Writes n items of `bytes` bytes each into n extents of their own (one
  // contiguous run of the file, written at full queue depth), out[i] for
  // items[i]. All or nothing, as write.
  Status write_many(const uint8_t *const *items, size_t n, size_t bytes, SpillExtent *out);
  // Reads n extents into dst[i] (ext[i].bytes each) at full queue depth.
  // A failed read fails the call (WKV_ERR_IO); each[i] says whether extent
  // i passed its checksum (else WKV_ERR_CORRUPT: dst[i] must not be used).
  Status read_many(const SpillExtent *ext, uint8_t *const *dst, size_t n, Status *each);
  // Writes n extents in one pass at full queue depth (one run of the file):
  // extent k holds pieces [first[k], first[k + 1]) concatenated (first has
  // n + 1 entries), out[k] its extent. All or nothing, as write.
  Status write_extents(const SpillPiece *pieces, const size_t *first, size_t n, SpillExtent *out);
  // Reads n extents into their pieces (as write_extents lays them out) in
  // one pass at full queue depth. A failed read fails the call (WKV_ERR_IO);
  // each[k] says whether extent k passed its checksum.
  Status read_extents(const SpillExtent *ext, const SpillPiece *pieces, const size_t *first, size_t n,
                      Status *each);
  // Gives an extent's blocks back. Never fails.
  void release(const SpillExtent &e) noexcept;

  uint32_t io_bits() const { return bits_; }
  // Whether the io_uring's staging buffers are registered with the kernel
  // (the locked-memory limit allowing).
  bool registered_buffers() const;
  uint64_t bytes_used() const;
  uint64_t file_bytes() const;
  uint64_t budget_bytes() const { return opts_.budget_bytes; }
  uint64_t bytes_written() const;
  uint64_t bytes_read() const;
  // The file's descriptor (tests corrupt extents through it).
  int fd() const { return fd_; }

  static constexpr uint32_t kQueueDepth = 8;  // staged requests in flight
  // Staging buffers: twice the depth, so that a request finishing late
  // (they are taken in order, for the checksums) does not hold the queue.
  static constexpr uint32_t kStageBuffers = 2 * kQueueDepth;
  static constexpr size_t kStageBytes = size_t(1) << 20;  // one request's bytes
  // Requests in flight when pages are read straight into their slots
  // (read_many): small random reads need a deeper queue than a stream.
  static constexpr uint32_t kRingEntries = 64;
  // The file's blocks are allocated ahead of its end in steps of this size
  // (within the budget), so that writes land inside the file: O_DIRECT
  // writes that extend a file are serialized by ext4 and xfs.
  static constexpr uint64_t kAllocateStep = uint64_t(64) << 20;

 private:
  struct Ring;
  // One request: `len` bytes (whole blocks, at most kStageBytes) at
  // `offset`, of which the first `payload` are data (the rest padding).
  struct Op {
    uint64_t offset = 0;
    uint32_t len = 0, payload = 0;
  };
  // The requests of `bytes` bytes from `offset`, kStageBytes at a time.
  static std::vector<Op> chunk_ops(uint64_t offset, uint64_t bytes);
  SpillFile() = default;
  Status allocate(uint64_t span, SpillExtent *out);
  // Runs the requests between the file and the staging buffers, up to
  // kQueueDepth in flight: `fill(i, buf, payload)` fills request i's buffer
  // before it is written; `drain(i, buf, payload)` takes it once read, in
  // request order.
  Status transfer(bool write, const std::vector<Op> &ops,
                  const std::function<void(size_t, uint8_t *, size_t)> &fill,
                  const std::function<void(size_t, const uint8_t *, size_t)> &drain);
  // read_many through io_uring straight into dst, without staging, up to
  // kRingEntries requests in flight: where every dst is 4 KiB-aligned and
  // every extent whole blocks. False where it does not apply (nothing done).
  bool read_direct(const SpillExtent *ext, uint8_t *const *dst, size_t n, Status *each, Status *st);

  Options opts_;
  FileIO *io_ = nullptr;
  int fd_ = -1;
  uint32_t bits_ = 0;
  std::unique_ptr<Ring> ring_;  // null: pread/pwrite

  mutable std::mutex mu_;                 // guards what follows
  std::map<uint64_t, uint64_t> free_;     // offset -> span, coalesced
  uint64_t end_ = 0;                      // the file's length in use
  uint64_t allocated_ = 0;                // blocks allocated ahead (fallocate), >= end_ where it works
  bool no_allocate_ = false;              // the file system has no fallocate
  uint64_t used_ = 0;
  uint64_t written_ = 0, read_ = 0;
};

}  // namespace wkv
