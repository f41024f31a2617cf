#include "lib/index/meta_index.hpp"

#include <algorithm>
#include <cstring>

namespace wkv {

void RowQueue::reserve_more(size_t n) {
  size_t need = (end_ + n) * row_bytes_;
  if (need <= k_.size()) return;
  // Compact first when the consumed front is at least half of what we hold.
  if (begin_ > 0 && begin_ * 2 >= end_) {
    size_t live = (end_ - begin_) * row_bytes_;
    std::memmove(k_.data(), k_.data() + begin_ * row_bytes_, live);
    std::memmove(v_.data(), v_.data() + begin_ * row_bytes_, live);
    end_ -= begin_;
    begin_ = 0;
    need = (end_ + n) * row_bytes_;
    if (need <= k_.size()) return;
  }
  size_t grow = std::max(need, k_.size() + k_.size() / 2);
  // Strong guarantee: resize the copy that may fail first.
  MetaVector<uint8_t> nk(grow), nv(grow);
  if (end_ > 0) {
    std::memcpy(nk.data(), k_.data(), end_ * row_bytes_);
    std::memcpy(nv.data(), v_.data(), end_ * row_bytes_);
  }
  k_.swap(nk);
  v_.swap(nv);
}

void RowQueue::push(const void *k_row, const void *v_row) {
  std::memcpy(k_.data() + end_ * row_bytes_, k_row, row_bytes_);
  std::memcpy(v_.data() + end_ * row_bytes_, v_row, row_bytes_);
  ++end_;
}

void RowQueue::pop_front(size_t n) {
  begin_ += n;
  if (begin_ == end_) begin_ = end_ = 0;
}

}  // namespace wkv
