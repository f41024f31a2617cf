// Assembly of the execution buffer on the device: the steady zone and the
// retrieval clusters of every run, each unit of a cluster read from the
// device block cache when a frame holds it, straight from its pinned, mapped
// host pages otherwise; a missed unit is admitted into a free frame on the
// way. Plain C++: only the CUDA runtime's type declarations are needed to
// call it.
#pragma once

#include <cstddef>
#include <cstdint>

#include <driver_types.h>  // cudaError_t, cudaStream_t

#include "kernels/device_layout.hpp"
#include "kernels/dtype.hpp"

namespace wkv::kernels {

// Where a gather reads and writes.
//
// Execution buffer (device), K and V each [tokens][row_bytes]; run r owns
// rows [offsets[r], offsets[r + 1]) laid out as
//   sink rows        offsets[r] + t,                      t < sink_tokens
//   tail rows        offsets[r] + sink + t,               t < tail_tokens
//   cluster i rows   offsets[r] + sink + tail + ret_pos[ret_off + i] + m,
//                    m < size[id], id = ret_ids[ret_off + i]
// Member m of cluster id sits in token slot first_slot[id] + m of the run's
// pages: page pages[slot / page_tokens], row slot % page_tokens, K at
// page + row * row_bytes, V at page + (page_tokens + row) * row_bytes.
// It belongs to unit u = unit_begin[id] + m / page_tokens; when the unit map
// holds a frame f for u, the member is read from the cache instead: frame f
// at cache + f * frame_bytes, row m % page_tokens, laid out like a page.
//
// Admission (when `pool` and `admits` are set): a unit missed in the cache
// that has a unit map entry is counted; the first `admit_cap` of them take
// a frame from the pool (FramePool, device_layout.hpp) while it has one,
// are written into it as they are laid out in the execution buffer, and
// are mapped there with a compare-and-swap of the unit map entry from
// kNoCacheFrame, after the frame's rows; a frame whose swap loses (another
// step mapped the unit first) is reported with entry 0 so that the host
// puts it back. The i-th counted miss below admit_cap is reported in
// admits[i] (AdmitEntry), every unit read from the cache in hits[] (its
// frame), and the last CTA writes the number of admission entries and of
// hits logged to record_counts[0] and [1] (at most admit_cap and hit_cap),
// and the units missed that have a unit map entry (what the step could
// have admitted) to record_counts[2], and the pool's taken count to
// pool.seen, before it reports the step's end in `mark`.
struct GatherArgs {
  const DevRun *runs = nullptr;  // device [n_runs]
  uint32_t n_runs = 0;
  DevLookup lookup{};            // device arrays; reads ret_ids, ret_pos, offsets
  uint32_t max_ret = 0;          // >= every run's n_ret; sizes the grid only
  uint32_t row_bytes = 0;        // d * dtype bytes, a multiple of 16
  uint32_t page_tokens = 0;      // token slots per page (and rows per unit)
  // 8-bit pages (WKV_PAGE_FORMAT_INT8): int8_dim is head_dim (0: pages hold
  // rows of row_bytes, copied as they are). Pages and frames then hold K
  // and V rows of int8_dim bytes and, from byte scales_at, page_tokens K
  // scales then page_tokens V scales (f32); each member's rows are
  // dequantized into the execution buffer's rows of `dtype` as
  // dequantize_row does (kernels/dtype.hpp), bit for bit, and an admitted
  // unit's frame gets its 8-bit rows and scales.
  uint32_t int8_dim = 0;
  uint32_t scales_at = 0;
  // WKV_PAGE_FORMAT_INT8_CENTERED: each 8-bit K row is a difference from
  // its cluster's reference (DevRun::centroid rounded to f16, where every
  // component fits f16; centered_reference), added back as
  // dequantize_row_centered does. Not with row_src.
  bool centered = false;
  DType dtype = DType::kF16;
  uint8_t *xk = nullptr;         // device execution buffer, K rows
  uint8_t *xv = nullptr;         // device execution buffer, V rows
  // Where set (a decode that attends from frames), no row is laid out: the
  // gather writes where each row of the execution buffer's order lives,
  // row_src[t] for row t (device_layout.hpp), reads only what it admits (a
  // missed unit it copies into a frame, where its rows then live) and
  // leaves xk and xv alone: hits are not read. 16-byte aligned.
  RowSource *row_src = nullptr;
  // The device block cache: `frames` frames of frame_bytes (>= one page).
  uint8_t *cache = nullptr;
  size_t frame_bytes = 0;
  uint32_t frames = 0;
  // Admissions and the access log: the pool (device memory, its seen word
  // mapped), and the log in memory the host reads after the step (mapped);
  // all null for none.
  FramePool pool{};                 // the free frames (pool.cap 0: none)
  uint32_t admit_cap = 0;
  AdmitEntry *admits = nullptr;     // [admit_cap]
  uint32_t *hits = nullptr;         // [hit_cap]
  uint32_t hit_cap = 0;
  uint32_t *record_counts = nullptr;  // [3]: admission entries, hits logged, units missed
  // Device counters of the gather, zero between launches (the last CTA
  // resets them): [0] units missed (admission entries up to admit_cap),
  // [1] hits, [2] CTAs done. Required with `record_counts`, `admits` or
  // `mark`.
  uint32_t *work = nullptr;
  // Device counters: stats[0] += hits, stats[1] += misses (in units),
  // stats[2] += the tokens gathered (offsets[n_runs]). May be null.
  unsigned long long *stats = nullptr;
  StepMark mark{};  // mark.ctas is unused: work[2] counts the CTAs
  // Where reading.done is set, every CTA writes its step's epoch there
  // (reading.epoch, or *reading.epoch_at) and fences it at system scope
  // before it reads a unit map entry: the tracker's reading word, which
  // the buffer manager reads after it clears entries (a step it does not
  // see there reads the cleared entries). reading.ctas is unused.
  StepMark reading{};
  // Where set (a decode graph), admit_cap, admits, hits, hit_cap and
  // record_counts are read from this device block when the kernel runs,
  // in place of the fields above.
  const StepVars *vars = nullptr;
};

// Enqueues the gather on `stream` (no host wait). Every row pointer (sink,
// tail, pages, frames, xk, xv) must be 16-byte aligned: rows move in 16-byte
// loads and stores. cudaErrorInvalidValue for a null buffer, row_bytes not a
// multiple of 16, page_tokens 0, unaligned xk/xv, admissions without work
// counters, frames smaller than a page slot, int8_dim that is not the
// row's dimension; the launch's error otherwise.
cudaError_t gather_cuda(const GatherArgs &a, cudaStream_t stream);

}  // namespace wkv::kernels
