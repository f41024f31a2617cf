// Small device-side table updates of the CUDA backend. Every value travels
// as a kernel parameter, never through a host staging buffer, so that the
// host may reuse its memory at once: no host wait, no staging hazard. The
// one exception is stage_from_ring, a decode graph's staging, whose ring
// the caller reuses only once the step that read a slot has ended.
#pragma once

#include <cstdint>

#include <driver_types.h>  // cudaError_t, cudaStream_t

#include "kernels/device_layout.hpp"
#include "kernels/dtype.hpp"

namespace wkv::kernels {

// A lookup's staging, in one launch up to 144 runs (16 where the driver is
// older than CUDA 12.1 and takes no large kernel parameters): q [n_seqs][n_q_heads][d]
// of storage type t (strides in elements) converted to q_dst, f32
// [n_seqs][n_q_heads][d] contiguous, and n DevRun structs copied from host
// memory into dst (device), passed by value (host_runs may be reused at
// once). Where vars is set, *vars is stored at vars_dst (device) too: the
// step's variables, which a decode graph's kernels read (StepVars).
cudaError_t stage_lookup(DType t, const void *q, int64_t seq_stride, int64_t head_stride, uint32_t n_seqs,
                         uint32_t n_q_heads, uint32_t d, float *q_dst, const DevRun *host_runs, uint32_t n,
                         DevRun *dst, void *stream, const StepVars *vars = nullptr, StepVars *vars_dst = nullptr);

// A decode graph's staging from its ring (StageRing, device_layout.hpp):
// what stage_lookup does with values a launch carries, from the slot the
// ring's counter names (n_runs runs, n_seqs sequences of n_q_heads query
// rows, as the slot says too); its last CTA moves the counter on. For
// capture in a graph whose launches each follow the host's write of the
// next slot.
cudaError_t stage_from_ring(DType t, const StageRing &ring, uint32_t n_runs, uint32_t n_seqs, uint32_t n_q_heads,
                            uint32_t d, float *q_dst, DevRun *dst, StepVars *vars_dst, void *stream);

// Steps a runtime captures (BoundCall, device_layout.hpp; wkv_plan_bind).
// bound_copy: a captured append, the copies and steps' ends of the slot its
// call's count names (at most max_copies copies, the slot's n_copies; rows
// from k and v at src_off + r * src_pitch, in words of `width` bytes, which
// every source address, offset and pitch and row_bytes are multiples of:
// copy_width of them or-ed together; destinations are engine memory,
// 256-byte aligned). bound_stage: a captured decode's staging, as
// stage_from_ring, with NaN written to out ([n_seqs][n_q_heads][d] of type
// t, strides in elements) and empty runs staged where the replay may not
// work (BoundEntry in table.cu). bound_expect: faults the binding unless
// *taken == want, in stream order.
cudaError_t bound_copy(const BoundCall &call, uint32_t max_copies, const uint8_t *k, const uint8_t *v,
                       uint64_t src_pitch, uint32_t row_bytes, uint32_t width, void *stream);
uint32_t copy_width(uint64_t bits);
cudaError_t bound_stage(DType t, const BoundCall &call, uint32_t n_runs, uint32_t n_seqs, uint32_t n_q_heads,
                        uint32_t d, float *q_dst, DevRun *dst, StepVars *vars_dst, void *out, int64_t out_seq_stride,
                        int64_t out_head_stride, void *stream);
cudaError_t bound_expect(const unsigned int *taken, unsigned int want, BindWords *words, void *stream);
// Loads bound_expect's kernel now (CUDA's lazy loading may synchronize the
// context at a kernel's first launch; a prepare must never wait).
cudaError_t bound_load();

// Writes `epoch` to *done once the work enqueued on `stream` before it has
// ended (StepMark without a kernel of its own to carry it).
cudaError_t mark_step_end(unsigned long long *done, unsigned long long epoch, void *stream);

// The copies of an append (one sequence's or a batch's) from k and v
// (device-readable), in launches of up to 96 copies passed by value, 16
// rows per CTA, in the widest word that every address, offset and pitch
// allows.
cudaError_t copy_rows(const RowCopyDesc *copies, uint32_t n, const uint8_t *k, const uint8_t *v, uint64_t src_pitch,
                      uint32_t row_bytes, void *stream);

// copy_rows and then mark_steps_end of n_marks steps, in one launch of one
// CTA: for a small append (at most 96 copies, 512 rows and 48 marks;
// cudaErrorNotSupported otherwise, nothing enqueued).
cudaError_t copy_rows_marked(const RowCopyDesc *copies, uint32_t n, const uint8_t *k, const uint8_t *v,
                             uint64_t src_pitch, uint32_t row_bytes, unsigned long long *const *done,
                             const unsigned long long *epochs, uint32_t n_marks, void *stream);

// mark_step_end for n trackers: *done[i] = epochs[i] once the work
// enqueued before has ended, in launches of up to 240 pairs.
cudaError_t mark_steps_end(unsigned long long *const *done, const unsigned long long *epochs, uint32_t n,
                           void *stream);

// Adds n to the 8-byte word at device address `word` (in stream order).
cudaError_t add_to_word(unsigned long long *word, unsigned long long n, void *stream);

// Publishes n frames to the device cache's pool (the buffer manager's
// publish): src[i % cap] to dst[i % cap] for i in [first, first + n), src
// being the device address of the manager's host copy (mapped memory), then
// n added to *avail once those stores are visible: one launch of one CTA.
cudaError_t publish_slots(const uint32_t *src, uint32_t *dst, uint64_t first, uint64_t n, uint32_t cap,
                          unsigned long long *avail, void *stream);

// Stores `value` into n 4-byte words at the device addresses in addrs (a
// host array), in launches of up to 480 addresses passed by value.
cudaError_t store_words(const uint64_t *addrs, uint32_t n, uint32_t value, void *stream);

// The same in one launch whatever n: addrs is device-visible memory (a
// mapped host array: each thread reads its addresses across the bus).
cudaError_t store_words_at(const uint64_t *addrs, uint32_t n, uint32_t value, void *stream);

// Stores values[i] into the 8-byte word at device address addrs[i] (host
// arrays), i < n, in launches of up to 240 pairs passed by value.
cudaError_t store_pairs(const uint64_t *addrs, const uint64_t *values, uint32_t n, void *stream);

// One write of apply_spans: n bytes from src to dst (op kSpanCopy); n f32
// values from src to f16 at dst (kSpanNarrowF16, as narrow_f16, with
// *overflow set nonzero where a value lies outside f16's range); or n f32
// values, rows of `row`, from src to 8 bits at dst with a scale a row at
// scales (kSpanQuantRows8, as quantize_rows8). Every address is
// device-accessible: device memory or mapped pinned memory.
enum : uint32_t { kSpanCopy = 0, kSpanNarrowF16 = 1, kSpanQuantRows8 = 2 };
// The spans one launch of apply_spans carries (its kernel parameters).
constexpr uint32_t kSpansPerLaunch = 80;
struct SpanDesc {
  uint8_t *dst;
  const uint8_t *src;
  uint32_t *overflow;  // kSpanNarrowF16 and kSpanQuantRows8
  uint32_t n, op;
  float *scales = nullptr;  // kSpanQuantRows8 only
  uint32_t row = 0;         // kSpanQuantRows8 only: values a row (n a multiple of it)
};

// The spans in launches of up to 80 passed by value (so `spans` may be
// reused at once), one CTA column per span, each in the widest word its
// addresses and size allow (a warp a row for kSpanQuantRows8). The spans
// of one launch run in no order: none may overlap another's destination or
// read it. Every span is checked before the first launch
// (cudaErrorInvalidValue: a null address, an unknown op, a narrowing
// without its flag or misaligned, a quantization whose rows are not whole
// or longer than 256), so a refusal enqueues nothing.
cudaError_t apply_spans(const SpanDesc *spans, uint32_t n, void *stream);
// apply_spans's checks alone: launches nothing.
cudaError_t check_spans(const SpanDesc *spans, uint32_t n);


// dst[i] = f16(src[i]) for i < n (device arrays), round to nearest even;
// sets *overflow (device) to nonzero when a value lies outside f16's range.
cudaError_t narrow_f16(const float *src, uint64_t n, void *dst, uint32_t *overflow, void *stream);

// Each of `rows` f32 rows of d values (d <= 256) at src to 8 bits at dst
// ([rows][d]) with its scale at scales[row]: kernels/dtype.hpp's
// quantize_row, the same bytes; sets *overflow (device) to nonzero where a
// row holds a NaN or an infinity (its scale NaN, its values zero).
cudaError_t quantize_rows8(const float *src, uint64_t rows, uint32_t d, int8_t *dst, float *scales,
                           uint32_t *overflow, void *stream);

}  // namespace wkv::kernels
