// The plain types of segmented k-means batches, shared by the device
// k-means (kernels/kmeans_cuda.hpp), the CPU backend that lays out its own
// results the same way, and the engine's growth path. No CUDA header.
#pragma once

#include <algorithm>
#include <cstdint>

namespace wkv::kernels {

// Largest segment the device k-means takes (tokens).
constexpr uint32_t kKMeansMaxTokens = 65536;

// One segment to cluster; a host-side descriptor whose pointers are in the
// memory of the device that clusters it.
struct KMeansSegmentDesc {
  const void *keys = nullptr;    // device [tokens][d], storage dtype, contiguous
  const void *values = nullptr;  // device [tokens][d], only feed value_sum
  uint32_t tokens = 0;           // T, 1 .. kKMeansMaxTokens
  uint32_t clusters = 0;         // k requested; clamped to [1, T]
  uint64_t seed = 0;             // same seed and input, same clusters
  uint32_t outliers = 0;         // most members split off as clusters of one
  float outlier_ratio = 0.f;     // split_outliers's ratio
};

// Bounds of a batch, for sizing its workspace: a workspace sized for a shape
// serves every batch within it.
struct KMeansBatchShape {
  uint32_t segments = 0;      // S
  uint32_t max_tokens = 0;    // largest T
  uint32_t max_clusters = 0;  // largest clamped k (min(k, T), at least 1)
  uint32_t max_out = 0;       // largest K (kmeans_out_clusters)
  uint64_t total_tokens = 0;  // sum of T
};

// The batch's outputs, in the clustering device's memory, packed by segment.
// With K_s = kmeans_out_clusters(segment s) (its clamped k plus its outlier
// cap) and
//   tok_off[s] = sum of T over segments before s,
//   clu_off[s] = sum of K over segments before s,
// segment s owns
//   n_clusters[s]                          clusters kept (no empty one), C_s
//   n_outliers[s]                          of them, the last ones, outliers
//                                          split off (clusters of one)
//   order[tok_off[s] .. + T)               segment-local token indices,
//                                          grouped by cluster, ascending within
//                                          but for the outliers, which follow
//                                          in the order of the clusters they
//                                          left
//   begin[clu_off[s] + s .. + K + 1)       begin[c] for c <= C_s as in
//                                          SegmentClusters; entries past C_s = T
//   size[clu_off[s] .. + K)                members of cluster c; 0 past C_s
//   centroid[(clu_off[s] + c) * d + i]     plain mean of the members' original
//                                          keys (f32); 0 past C_s
//   value_sum[(clu_off[s] + c) * d + i]    sum of the members' values (f32)
//   spread[clu_off[s] + c]                 mean squared distance of the
//                                          members' keys to the centroid
//   value_total[s * d + i]                 sum over c < C_s of value_sum, in
//                                          order of c, in double
// Sizes: order sum T; begin sum K + S; size, spread sum K; centroid and
// value_sum sum K * d; value_total S * d. kmeans_batch_offsets gives tok_off
// and clu_off. The clusters are kmeans_segment's followed by split_outliers
// (kernels/cpu_kernels.hpp) with the segment's outliers and outlier_ratio.
struct KMeansBatchOut {
  uint32_t *n_clusters = nullptr;
  uint32_t *n_outliers = nullptr;
  uint32_t *begin = nullptr;
  uint32_t *order = nullptr;
  float *centroid = nullptr;
  float *value_sum = nullptr;
  uint32_t *size = nullptr;
  float *spread = nullptr;
  double *value_total = nullptr;
};

// k clamped to [1, T] (a segment of T tokens has at most T clusters).
inline uint32_t kmeans_clamp_k(uint32_t k, uint32_t T) { return std::clamp<uint32_t>(k, 1, std::max<uint32_t>(T, 1)); }

// Cluster slots a segment's outputs take: k clamped, plus its outliers.
inline uint32_t kmeans_out_clusters(const KMeansSegmentDesc &s) {
  return kmeans_clamp_k(s.clusters, s.tokens) + std::min(s.outliers, s.tokens);
}

// The tight shape of a batch of n host descriptors.
inline KMeansBatchShape kmeans_batch_shape(const KMeansSegmentDesc *segs, uint32_t n) {
  KMeansBatchShape sh;
  sh.segments = n;
  for (uint32_t s = 0; s < n; ++s) {
    sh.max_tokens = std::max(sh.max_tokens, segs[s].tokens);
    sh.max_clusters = std::max(sh.max_clusters, kmeans_clamp_k(segs[s].clusters, segs[s].tokens));
    sh.max_out = std::max(sh.max_out, kmeans_out_clusters(segs[s]));
    sh.total_tokens += segs[s].tokens;
  }
  return sh;
}

// tok_off[s] and clu_off[s] of a batch (host arrays of n entries each; either
// may be null), as KMeansBatchOut describes them.
inline void kmeans_batch_offsets(const KMeansSegmentDesc *segs, uint32_t n, uint64_t *tok_off, uint64_t *clu_off) {
  uint64_t t = 0, c = 0;
  for (uint32_t s = 0; s < n; ++s) {
    if (tok_off) tok_off[s] = t;
    if (clu_off) clu_off[s] = c;
    t += segs[s].tokens;
    c += kmeans_out_clusters(segs[s]);
  }
}

}  // namespace wkv::kernels
