// Exact attention over the execution buffer on the GPU, merged with the
// estimate: the CUDA counterpart of attend_exact + merge_partials
// (kernels/cpu_kernels.hpp). Plain C++: no CUDA header is needed to call it.
#pragma once

#include <cstddef>
#include <cstdint>

#include <driver_types.h>  // cudaError_t, cudaStream_t

#include "kernels/device_layout.hpp"
#include "kernels/dtype.hpp"

namespace wkv::kernels {

// Floats of scratch that attend_ragged needs for R runs of at most
// max_tokens tokens each: the partial outputs and log-sum-exps of its
// token splits. At most max(R, 2048) * G * (d + 1) floats.
size_t attend_ragged_scratch_floats(uint32_t R, uint32_t G, uint32_t d, uint32_t max_tokens);

// Where attend_ragged reads rows that are not laid out in an execution
// buffer (a decode that attends from frames): row t of the buffer's order
// (offsets) at src[t] (RowSource, device_layout.hpp, as the gather wrote
// them: GatherArgs::row_src); an 8-bit row's V row v_bytes after its K row
// (page_tokens * d) and its V scale vs_floats floats after its K scale
// (page_tokens). Each row gives the same floats as the gather's laid-out
// row would, so the outputs are the same bits.
struct AttendRows {
  const RowSource *src = nullptr;
  uint32_t v_bytes = 0, vs_floats = 0;
};

// Flash-decoding over R ragged runs (r = s * H + h, n_seqs = R / H), merged
// with the estimate, in two kernels on `stream`; no host synchronization.
//
//   t            storage dtype of xk, xv and out
//   offsets      [R + 1] int32, device: run r is tokens offsets[r] ..
//                offsets[r + 1] of the execution buffer
//   xk, xv       [tokens][d] rows in t, device, 16-byte aligned
//   q            [R][G][d] f32, device: the query heads of each run's group
//   scale        logit scale (1/sqrt(d))
//   max_tokens   host-known upper bound of tokens per run: sizes the split
//                grid. Each run is split by its real length (offsets), in
//                slices of at least 64 tokens; a run longer than the bound
//                is attended in full all the same, in longer slices.
//   est_out      [R][G][d] f32 and est_lse [R][G], device: the estimate to
//                merge in as merge_partials does; both NULL for none
//   out          head g of run r = s * H + h goes to element
//                s * seq_stride + (h * G + g) * head_stride, d contiguous
//                elements in t
//   lse          optional f32 [n_seqs][H * G], the merged log-sum-exps
//   scratch      device, at least attend_ragged_scratch_floats(...) floats
//   vars         where set (a decode graph), out, its strides and lse are
//                read from this device block when the step runs instead
//   rows         where rows.src is set, rows are read where they live
//                (AttendRows) and xk, xv are not read (may be null)
//
// A run with no token and no estimate gives zeros and lse -inf. Requires
// 1 <= G <= kMaxGroup (32) and d in {64, 80, 96, 128, 256}.
cudaError_t attend_ragged(DType t, const int32_t *offsets, const void *xk, const void *xv, const float *q,
                     uint32_t R, uint32_t H, uint32_t G, uint32_t d, float scale, uint32_t max_tokens,
                     const float *est_out, const float *est_lse, void *out, int64_t seq_stride,
                     int64_t head_stride, float *lse, float *scratch, size_t scratch_floats,
                     void *stream, const StepMark &mark = StepMark{}, const StepVars *vars = nullptr,
                     const AttendRows &rows = AttendRows{});

// Folds the estimate into an attention output the caller computed itself
// (the wkv merge verb), in place, as merge_partials does:
//   out      [n_seqs] x [n_q_heads] rows of d elements in t at
//            s * seq_stride + h * head_stride (elements)
//   lse      f32, s * lse_seq_stride + h: the caller's log-sum-exps (natural
//            log; -inf for an empty row), replaced by the merged ones
//   est_out  [n_seqs][n_q_heads][d] f32, est_lse [n_seqs][n_q_heads]
cudaError_t merge_estimate(DType t, void *out, int64_t seq_stride, int64_t head_stride, float *lse,
                      int64_t lse_seq_stride, const float *est_out, const float *est_lse,
                      uint32_t n_seqs, uint32_t n_q_heads, uint32_t d, void *stream,
                      const StepMark &mark = StepMark{});

}  // namespace wkv::kernels
