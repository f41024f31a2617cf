#include "lib/engine/stats_publisher.hpp"

#include <chrono>
#include <system_error>

#include "lib/common/thread_name.hpp"

namespace wkv {

Status StatsPublisher::publish() {
  const std::string text = snapshot_();
  // Not durable: a reader wants the latest figures, not ones that survive a
  // power loss, and an fsync per interval would cost the disk.
  return replace_file(io_, path_, false, [&](int fd) {
    const int r = write_full(io_, fd, text.data(), text.size(), 0);
    return r < 0 ? io_status(r, "writing the statistics file") : Status::ok();
  });
}

Status StatsPublisher::start() {
  WKV_RETURN_IF_ERROR(publish());
  try {
    thread_ = std::thread([this] { run(); });
    name_thread(thread_, "wkv-stats");
  } catch (const std::system_error &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "cannot start the statistics thread");
  }
  return Status::ok();
}

void StatsPublisher::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, std::chrono::milliseconds(interval_ms_), [&] { return stop_; })) {
    lock.unlock();
    bool ok = false;
    try {
      ok = publish().is_ok();
    } catch (...) {
      // Out of memory for the text: the next interval tries again.
    }
    lock.lock();
    if (!ok) ++failures_;
  }
}

uint64_t StatsPublisher::failures() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failures_;
}

StatsPublisher::~StatsPublisher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

}  // namespace wkv
