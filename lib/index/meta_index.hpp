// The meta index of one (sequence, layer, KV head): per cluster its centroid
// (the plain mean of its member keys), its value sum (f32) and its size.
// Scoring and estimation read only this; it never leaves memory. On a CUDA
// engine the centroids and value sums live on the device only (the step
// reads them there): centroid and value_sum stay empty here, and size is
// kept on both sides.
#pragma once

#include <cstdint>

#include "lib/buffer/mapping_table.hpp"
#include "lib/common/dtype.hpp"
#include "lib/common/meta_alloc.hpp"
#include "lib/store/host_arena.hpp"

namespace wkv {

struct MetaIndex {
  MetaVector<float> centroid;   // [clusters][d]
  MetaVector<float> value_sum;  // [clusters][d]
  MetaVector<uint32_t> size;    // [clusters]
  // A compact mirror for the decoding step, in f16: the centroids, and the
  // value means VS / size. Scoring streams every centroid at every step and
  // estimation a quarter of the value rows, both bound by memory bandwidth,
  // so half the bytes is about half the time. Filled when segments are
  // committed, only where K and V are stored in 16 bits (they are rounded as
  // much already). Empty for good once a value falls outside f16's range;
  // the step then reads the f32 arrays.
  MetaVector<f16> centroid_f16;    // [clusters][d] or empty
  MetaVector<f16> value_mean_f16;  // [clusters][d] or empty

  uint32_t clusters() const { return static_cast<uint32_t>(size.size()); }
  // Whether the f16 mirror holds every cluster.
  bool has_f16() const { return !centroid.empty() && centroid_f16.size() == centroid.size(); }
  size_t bytes() const {
    return (centroid.capacity() + value_sum.capacity()) * sizeof(float) +
           (centroid_f16.capacity() + value_mean_f16.capacity()) * sizeof(f16) +
           size.capacity() * sizeof(uint32_t);
  }
};

// Everything clustered of one (sequence, layer, KV head): meta index,
// mapping table, page list and segments. Clusters are numbered densely in
// the order their segments were built.
struct HeadIndex {
  MetaIndex meta;
  MappingTable map;               // [clusters]
  MetaVector<PageId> pages;       // the head's page list
  MetaVector<SegmentDesc> segments;
};

// A queue of K and V rows: appended at the back, consumed at the front.
// Holds the sink and the unclustered tail of one (sequence, layer, KV head).
class RowQueue {
 public:
  void init(size_t row_bytes) { row_bytes_ = row_bytes; }
  size_t rows() const { return end_ - begin_; }
  size_t row_bytes() const { return row_bytes_; }
  const uint8_t *k_row(size_t i) const { return k_.data() + (begin_ + i) * row_bytes_; }
  const uint8_t *v_row(size_t i) const { return v_.data() + (begin_ + i) * row_bytes_; }
  // Contiguous K (V) rows [0, rows()).
  const uint8_t *k_data() const { return k_.data() + begin_ * row_bytes_; }
  const uint8_t *v_data() const { return v_.data() + begin_ * row_bytes_; }

  // Makes room for n more rows; may throw std::bad_alloc, changes nothing
  // visible then. Growth is geometric.
  void reserve_more(size_t n);
  // Pre: reserve_more(n) succeeded. Appends one row; never throws.
  void push(const void *k_row, const void *v_row);
  // Drops the n newest rows (rollback of a failed append).
  void pop_back(size_t n) { end_ -= n; }
  // Drops the n oldest rows.
  void pop_front(size_t n);
  size_t bytes() const { return k_.capacity() + v_.capacity(); }

 private:
  size_t row_bytes_ = 0;
  size_t begin_ = 0, end_ = 0;  // in rows
  MetaVector<uint8_t> k_, v_;
};

}  // namespace wkv
