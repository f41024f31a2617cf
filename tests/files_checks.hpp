// Checks of the sequence-file tests that need GoogleTest (files_support.hpp
// serves the fuzz targets too, which have none). Header-only.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "files_support.hpp"

namespace wkvtest {

// Layer `layer` of an intact file, as the reader gives it (empty heads
// where the file cannot be read: the caller's expectations then fail).
inline wkv::LayerSnapshot layer_of(const std::string &path, uint32_t layer) {
  wkv::FileIO &io = wkv::posix_io();
  const int fd = io.open_read(path.c_str());
  wkv::SeqFileReader r(io, fd);
  wkv::LayerSnapshot snap;
  const wkv::Status st = r.open().is_ok() ? r.read_layer(layer, &snap) : WKV_ERROR(WKV_ERR_IO, "cannot read");
  EXPECT_TRUE(st.is_ok()) << st.message();
  io.close(fd);
  return snap;
}

// Decodes `steps` queries of ctx with sequence b of engine eb and sequence
// a of engine ea, expecting the same outputs, each step followed by the
// same 40 tokens appended to both (growths after a load match too).
inline void expect_same_decodes(const wavekv::Engine &eb, wavekv::Sequence &b, const wavekv::Engine &ea,
                                wavekv::Sequence &a, const Shape &s, Context &ctx, int steps) {
  for (int step = 0; step < steps; ++step) {
    const std::vector<uint8_t> q = ctx.query();
    EXPECT_EQ(decode_all(eb, b.get(), s, q), decode_all(ea, a.get(), s, q)) << "step " << step;
    std::vector<uint8_t> k, v;
    ctx.tokens(40, &k, &v);
    for (uint32_t l = 0; l < s.layers; ++l) {
      a.append(l, k.data(), v.data(), 40);
      b.append(l, k.data(), v.data(), 40);
    }
  }
}

}  // namespace wkvtest
