// Status: the error type of the engine's inside. A code from wavekv.h and a
// message in words; the C ABI turns it into a return code plus the per-thread
// message. Cheap when OK (no allocation).
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "wavekv/wavekv.h"

namespace wkv {

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(int code, std::string msg)
      : code_(code), msg_(code == WKV_OK ? nullptr : std::make_shared<std::string>(std::move(msg))) {}

  static Status ok() { return Status(); }
  bool is_ok() const { return code_ == WKV_OK; }
  int code() const { return code_; }
  const std::string &message() const {
    static const std::string empty;
    return msg_ ? *msg_ : empty;
  }

 private:
  int code_ = WKV_OK;
  std::shared_ptr<std::string> msg_;
};

// printf-style message formatting for errors.
std::string format(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#define WKV_ERROR(code, ...) ::wkv::Status((code), ::wkv::format(__VA_ARGS__))

#define WKV_RETURN_IF_ERROR(expr)            \
  do {                                       \
    ::wkv::Status wkv_status_ = (expr);      \
    if (!wkv_status_.is_ok()) return wkv_status_; \
  } while (0)

}  // namespace wkv
