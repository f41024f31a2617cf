// What every GPU test program shares: whether a CUDA device exists, and the
// visible skip where none does.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

namespace wkvtest {

inline bool have_gpu() {
  static const bool ok = [] {
    int n = 0;
    const bool any = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
    (void)cudaGetLastError();  // no device is not an error for the tests after
    return any;
  }();
  return ok;
}

}  // namespace wkvtest

#define REQUIRE_GPU() \
  if (!::wkvtest::have_gpu()) GTEST_SKIP() << "no CUDA device"
