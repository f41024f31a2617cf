// What every GPU test program shares: whether a CUDA device exists, and the
// visible skip where none does.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
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

// Whether compute-sanitizer runs the test: WKV_TEST_UNDER_SANITIZER set
// (tools/gpu-check.sh sets it to the tool's name) or the sanitizer's
// injection library.
inline bool under_sanitizer() {
  const char *inject = std::getenv("CUDA_INJECTION64_PATH");
  return std::getenv("WKV_TEST_UNDER_SANITIZER") || (inject && std::strstr(inject, "sanitizer"));
}

// Whether racecheck runs the test: WKV_TEST_UNDER_SANITIZER=racecheck.
inline bool under_racecheck() {
  const char *tool = std::getenv("WKV_TEST_UNDER_SANITIZER");
  return tool && std::strcmp(tool, "racecheck") == 0;
}

// Whether a test runs case (a, b) of its grid of cases, a and b counting
// the values of two axes: every case, except under racecheck (minutes a
// case of the larger kernels), where only the cases with (a + b) % n == 0
// run, n being the length of one axis: each value of the other axis runs
// once, and where that axis is the longer, each value of both. Memcheck
// runs every case.
inline bool sanitized_case(uint32_t a, uint32_t b, uint32_t n) { return !under_racecheck() || (a + b) % n == 0; }

// Under compute-sanitizer, a line for each phase a long test passes, with
// the seconds since the test began: a run stopped at its limit still shows
// where its time went. Silent otherwise.
class SanitizerPhases {
 public:
  void mark(const std::string &what) const {
    if (!on_) return;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    std::printf("[sanitizer] %s after %.1f s\n", what.c_str(), s);
    std::fflush(stdout);
  }

 private:
  bool on_ = under_sanitizer();
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

// A gate on a stream: the work enqueued after close() waits until open()
// (a host function that blocks the stream, not the caller). A watchdog
// opens it after `limit` should the caller itself wait for the stream.
class Gate {
 public:
  void close(cudaStream_t s) { ASSERT_EQ(cudaLaunchHostFunc(s, &Gate::wait, this), cudaSuccess); }
  void open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  // Runs body with the gate closed on s; true if body returned before the
  // watchdog had to open the gate.
  template <typename Fn> bool run_closed(cudaStream_t s, Fn &&body, std::chrono::seconds limit) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = false;
    }
    close(s);
    std::atomic<bool> done{false}, forced{false};
    std::thread watchdog([&] {
      const auto until = std::chrono::steady_clock::now() + limit;
      while (!done.load() && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      if (!done.load()) {
        forced = true;
        if (on_force) on_force();
      }
      open();
    });
    body();
    done = true;
    watchdog.join();
    return !forced.load();
  }
  std::function<void()> on_force;  // called by the watchdog before it opens the gate

 private:
  static void CUDART_CB wait(void *p) {
    Gate *g = static_cast<Gate *>(p);
    std::unique_lock<std::mutex> lock(g->mu_);
    g->cv_.wait(lock, [g] { return g->open_; });
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = true;
};


}  // namespace wkvtest

#define REQUIRE_GPU() \
  if (!::wkvtest::have_gpu()) GTEST_SKIP() << "no CUDA device"
