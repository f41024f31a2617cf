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
};

// Bounds of a batch, for sizing its workspace: a workspace sized for a shape
// serves every batch within it.
struct KMeansBatchShape {
  uint32_t segments = 0;      // S
  uint32_t max_tokens = 0;    // largest T
  uint32_t max_clusters = 0;  // largest clamped k (min(k, T), at least 1)
  uint64_t total_tokens = 0;  // sum of T
};

// The batch's outputs, in the clustering device's memory, packed by segment. With
//   tok_off[s] = sum of T over segments before s,
//   clu_off[s] = sum of clamped k over segments before s,
// segment s owns
//   n_clusters[s]                          clusters kept (no empty one), C_s
//   order[tok_off[s] .. + T)               segment-local token indices,
//                                          grouped by cluster, ascending within
//   begin[clu_off[s] + s .. + k + 1)       begin[c] for c <= C_s as in
//                                          SegmentClusters; entries past C_s = T
//   size[clu_off[s] .. + k)                members of cluster c; 0 past C_s
//   centroid[(clu_off[s] + c) * d + i]     plain mean of the members' original
//                                          keys (f32); 0 past C_s
//   value_sum[(clu_off[s] + c) * d + i]    sum of the members' values (f32)
// Sizes: order sum T; begin sum k + S; size sum k; centroid and value_sum
// sum k * d. kmeans_batch_offsets gives tok_off and clu_off.
struct KMeansBatchOut {
  uint32_t *n_clusters = nullptr;
  uint32_t *begin = nullptr;
  uint32_t *order = nullptr;
  float *centroid = nullptr;
  float *value_sum = nullptr;
  uint32_t *size = nullptr;
};

// k clamped to [1, T] (a segment of T tokens has at most T clusters).
inline uint32_t kmeans_clamp_k(uint32_t k, uint32_t T) { return std::clamp<uint32_t>(k, 1, std::max<uint32_t>(T, 1)); }

// The tight shape of a batch of n host descriptors.
inline KMeansBatchShape kmeans_batch_shape(const KMeansSegmentDesc *segs, uint32_t n) {
  KMeansBatchShape sh;
  sh.segments = n;
  for (uint32_t s = 0; s < n; ++s) {
    sh.max_tokens = std::max(sh.max_tokens, segs[s].tokens);
    sh.max_clusters = std::max(sh.max_clusters, kmeans_clamp_k(segs[s].clusters, segs[s].tokens));
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
    c += kmeans_clamp_k(segs[s].clusters, segs[s].tokens);
  }
}

}  // namespace wkv::kernels
