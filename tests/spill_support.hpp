// Tests of the spill file's contents (test_spill, test_cold): its
// descriptor found through /proc, and single bytes flipped in it.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace wkvtest {

// The descriptor of this process's open file in `dir` (the anonymous spill
// file), opened again for writing: tests flip its bits through it.
inline int reopen_spill_file(const std::string &dir) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  int found = -1;
  while (dirent *e = readdir(d)) {
    char link[4096];
    const std::string at = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t n = readlink(at.c_str(), link, sizeof link - 1);
    if (n <= 0) continue;
    link[n] = 0;
    if (std::string(link).rfind(dir + "/", 0) == 0) {
      found = ::open(at.c_str(), O_RDWR);
      break;
    }
  }
  closedir(d);
  return found;
}

// Flips a bit of the file behind `fd` through a descriptor of its own
// (without O_DIRECT, which takes no single bytes).
inline void flip_byte(int fd, uint64_t at) {
  const int own = ::open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDWR);
  ASSERT_GE(own, 0);
  uint8_t b = 0;
  EXPECT_EQ(::pread(own, &b, 1, static_cast<off_t>(at)), 1);
  b ^= 0x10;
  EXPECT_EQ(::pwrite(own, &b, 1, static_cast<off_t>(at)), 1);
  ::close(own);
}

}  // namespace wkvtest
