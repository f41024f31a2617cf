// The lookup of a decoding step on the GPU: score every cluster of every run,
// select the retrieval and estimation zones, estimate the estimation zone,
// and lay out the execution buffer's ragged offsets. The CUDA counterpart of
// score_clusters + select_zones + estimate_zone (kernels/cpu_kernels.hpp),
// over the device layout of kernels/device_layout.hpp. Plain C++: no CUDA
// header is needed to call it.
#pragma once

#include <cstddef>
#include <cstdint>

#include <driver_types.h>  // cudaError_t, cudaStream_t

#include "kernels/device_layout.hpp"

namespace wkv::kernels {

// A run's selection is split over up to 8 CTAs (a thread-block cluster on
// sm_90); slices of at most this many clusters keep their scores in shared
// memory (80 KiB with a class byte each); larger ones need the global
// `scores` scratch of lookup_zones (required past this many clusters in a
// run, whatever the split).
constexpr uint32_t kLookupSmemClusters = 16384;
// Query heads per KV head (G) that lookup_zones and attend_ragged accept.
constexpr uint32_t kMaxGroup = 32;

// Scores, selects and estimates R runs (one per (sequence, KV head),
// r = s * H + h) in four kernels on `stream`; no host synchronization.
//
//   runs       [R] DevRun, device memory. Read: centroid, centroid8,
//              centroid8_scale, centroid16, value_sum, value_sum8,
//              value_sum8_scale, value_sum16, spread, value_mean, size,
//              clusters, n_ret, n_one, n_est, sink_tokens, tail_tokens,
//              ret_off, est_off, scratch_off. centroid, centroid8,
//              centroid16, value_sum, value_sum8 and value_sum16 16-byte
//              aligned (the copies' rows then are, after their 16-byte
//              header), the scales 4-byte aligned; the 8-bit copies are
//              read only where d is a multiple of 32.
//   q          [R][G][d] f32, device, 16-byte aligned: the query heads of each
//              run's group.
//   out        DevLookup: every field is written for every run (see
//              device_layout.hpp), out.logits [G][clusters] at scratch_off
//              (scratch_off must be a multiple of G, as the sum of G *
//              clusters of the runs before is). offsets [R + 1].
//   scores     optional f32 scratch, [clusters] per run at scratch_off / G
//              (so sized like out.logits / G). When given, every run's
//              scores are written there (handy for checks). Required (else
//              cudaErrorInvalidValue) when max_clusters > kLookupSmemClusters:
//              larger runs select over it instead of shared memory.
//   max_clusters  host-known upper bound of clusters over the runs: sizes
//              the grid. A run with more clusters is a caller bug; the
//              kernels then select nothing for it rather than fault.
//
// Pre: n_ret + n_est <= clusters for each run (clamped on the device if not);
// 1 <= G <= kMaxGroup; d in {64, 80, 96, 128, 256}.
// `mark`: where the last kernel reports the step's end (StepMark). With
// mark.ctas (a device word, zero between launches) and R > 0, the estimate's
// last CTA lays out the offsets and reports the end, one launch fewer.
// Logits are score_clusters's, spread-corrected (spread_logits) where a
// run has spreads. Selection is exact: ret_ids and est_ids are the ids
// select_zones (n_one == 0) or select_zones_split (n_one > 0, n_ret - n_one
// larger clusters) returns for the scores this kernel computed (score
// descending, ties to the lower id, NaN as -inf, both sorted ascending);
// out.zones says each cluster's zone. est_out/est_lse follow estimate_zone
// (zeros and -inf when a run has no estimation cluster), then, where a run
// has a value mean, estimate_tail. Pre with n_one > 0: the run has at least
// n_one clusters of one member and n_ret - n_one others.
// `split_clusters` (0: max_clusters) decides over how many CTAs each run's
// selection is split (select_split): a caller that passes a bound above
// the real largest run (a decode graph) passes the real one here, so that
// the selection, and its rounding, is the same as with the real bound.
cudaError_t lookup_zones(const DevRun *runs, uint32_t R, uint32_t G, uint32_t d, float scale,
                    const float *q, const DevLookup &out, float *scores, uint32_t max_clusters,
                    void *stream, const StepMark &mark = StepMark{}, uint32_t split_clusters = 0);

// The same lookup in two parts, for a caller that runs the estimate beside
// the work that does not need it (a decode graph forks after the selection:
// the gather and the exact attention read the selection and the offsets;
// only the attention's combine reads est_out and est_lse). lookup_select
// enqueues the logits and the selection on `stream`, the selection's last
// CTA laying out the offsets (no mark: a caller ends the step later); ctas
// is a device word, zero before the first call, that each call leaves
// zero. lookup_estimate enqueues the estimate alone, which must follow
// lookup_select's selection (an event between the streams) and end before
// anything reads est_out or est_lse, or writes the runs, est_ids, the zones
// or the logits again. Together they write what lookup_zones writes.
// lookup_select checks its arguments as lookup_zones does (and ctas);
// lookup_estimate the ones it reads (the runs, est_ids, est_out, est_lse,
// logits, zones).
cudaError_t lookup_select(const DevRun *runs, uint32_t R, uint32_t G, uint32_t d, float scale, const float *q,
                          const DevLookup &out, float *scores, uint32_t max_clusters, unsigned int *ctas,
                          void *stream, uint32_t split_clusters = 0);
cudaError_t lookup_estimate(const DevRun *runs, uint32_t R, uint32_t G, uint32_t d, const DevLookup &out,
                            void *stream);

// The CTAs a selection of R runs of up to `clusters` clusters is split over:
// what the lookup launches, a split taken only where the device holds such
// a cluster (1 from then on where a split launch was refused on it).
uint32_t select_split(uint32_t R, uint32_t clusters);

}  // namespace wkv::kernels
