// Publishes an engine's statistics to a file at an interval, for
// `wavekv top` and any other reader: the file is replaced whole each time
// (a temporary file renamed over it), so a reader never sees half of one.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "lib/common/status.hpp"
#include "lib/store/io.hpp"

namespace wkv {

class StatsPublisher {
 public:
  // `snapshot` gives the file's contents; it runs on the publisher's thread.
  StatsPublisher(FileIO &io, std::string path, uint32_t interval_ms, std::function<std::string()> snapshot)
      : io_(io), path_(std::move(path)), interval_ms_(interval_ms), snapshot_(std::move(snapshot)) {}
  ~StatsPublisher();  // stops the thread
  StatsPublisher(const StatsPublisher &) = delete;
  StatsPublisher &operator=(const StatsPublisher &) = delete;

  // Publishes once (so that a path that cannot be written fails here, with
  // WKV_ERR_IO), then starts the thread.
  Status start();
  // Failed publications since start (the thread keeps trying).
  uint64_t failures() const;

 private:
  void run();
  Status publish();

  FileIO &io_;
  const std::string path_;
  const uint32_t interval_ms_;
  const std::function<std::string()> snapshot_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  uint64_t failures_ = 0;
  std::thread thread_;
};

}  // namespace wkv
