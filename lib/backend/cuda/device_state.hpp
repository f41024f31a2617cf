// Small pieces of the CUDA backend's host side: CUDA errors as statuses, the
// caller's device set and restored around every entry point, and pinned
// host memory that lives as long as the backend.
#pragma once

#if defined(WKV_WITH_CUDA)

#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>
#include <vector>

#include "lib/common/status.hpp"

namespace wkv {

// A CUDA error as a status naming the statement, file and line; the error is
// consumed, so that a later launch check does not report it again.
Status cuda_error(cudaError_t err, const char *stmt, const char *file, int line);

#define WKV_CU(stmt)                                                                              \
  do {                                                                                            \
    cudaError_t wkv_cu_err_ = (stmt);                                                             \
    if (wkv_cu_err_ != cudaSuccess) return ::wkv::cuda_error(wkv_cu_err_, #stmt, __FILE__, __LINE__); \
  } while (0)

// Makes `device` current for a scope and restores the caller's device after
// it: the engine's verbs never leave the caller's thread on another device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard &) = delete;
  DeviceGuard &operator=(const DeviceGuard &) = delete;
  // Whether the device is current (false: setting it failed).
  bool ok() const { return ok_; }

 private:
  int prev_ = -1;
  bool ok_ = true, changed_ = false;
};

// Pinned, mapped host blocks, freed with the owner (at engine close: freeing
// pinned memory synchronizes the device, which only close may do).
class PinnedBlocks {
 public:
  PinnedBlocks() = default;
  ~PinnedBlocks();
  PinnedBlocks(const PinnedBlocks &) = delete;
  PinnedBlocks &operator=(const PinnedBlocks &) = delete;
  // A zeroed block of `bytes`; *dev its device address. Any thread.
  Status alloc(size_t bytes, void **host, void **dev);

 private:
  std::mutex mu_;  // blocks_: the buffer manager, growths and plans allocate from their own threads
  std::vector<void *> blocks_;
};

}  // namespace wkv

#endif  // WKV_WITH_CUDA
