// What every GPU test program shares: whether a CUDA device exists, and the
// visible skip where none does.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

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

// Sets (value not null) or unsets an environment variable for its scope,
// then restores it: the engine reads its switches (WKV_DECODE_GRAPHS, ...)
// when it opens.
class ScopedEnv {
 public:
  ScopedEnv(const char *name, const char *value) : name_(name) {
    const char *was = std::getenv(name);
    had_ = was != nullptr;
    if (had_) saved_ = was;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), saved_.c_str(), 1);
    else unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv &) = delete;
  ScopedEnv &operator=(const ScopedEnv &) = delete;

 private:
  std::string name_, saved_;
  bool had_ = false;
};

// Bytes on the engine's device (or host memory for a CPU engine).
struct Buf {
  bool device;
  void *p = nullptr;
  size_t n;
  Buf(bool dev, const std::vector<uint8_t> &h) : device(dev), n(h.size()) {
    if (device) {
      EXPECT_EQ(cudaMalloc(&p, n), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(p, h.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
    } else {
      p = std::malloc(n);
      std::memcpy(p, h.data(), n);
    }
  }
  ~Buf() {
    if (device) {
      cudaFree(p);
    } else {
      std::free(p);
    }
  }
  std::vector<uint8_t> host() const {
    std::vector<uint8_t> h(n);
    if (device) {
      EXPECT_EQ(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
    } else {
      std::memcpy(h.data(), p, n);
    }
    return h;
  }
};

}  // namespace wkvtest

#define REQUIRE_GPU() \
  if (!::wkvtest::have_gpu()) GTEST_SKIP() << "no CUDA device"
