// The kernels of wavekv on the CPU: the CPU backend runs them, and every CUDA
// kernel is tested against them. Each kernel is one pure function over raw
// pointers and sizes; none allocates except where its output is a container,
// none throws except std::bad_alloc from such a container.
//
// Conventions: d is head_dim; `scale` is 1/sqrt(d); logits are q.k * scale;
// log-sum-exp values (lse) are natural logs. Vectors are f32 unless said.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/dtype.hpp"

namespace wkv::kernels {

// k-means ---------------------------------------------------------------

// Parameters of segmented spherical k-means for one segment.
struct KMeansParams {
  uint32_t n_clusters = 0;  // k requested (>= 1); empty clusters are dropped
  uint32_t iters = 10;      // assignment/update rounds
  uint64_t seed = 0;        // initialisation seed; same seed, same result
  uint32_t outliers = 0;    // most members split off as singletons (0: none)
  float outlier_ratio = 0;  // split members whose squared distance to their
                            // centroid exceeds this times the segment's mean
};

// The clusters of one segment of T tokens, compacted (no empty cluster),
// ordered by cluster id.
//
//   order[begin[c] .. begin[c+1])   segment-local token indices of cluster c,
//                                   ascending
//   centroid[c*d .. c*d+d)          plain mean of member keys (not centered,
//                                   not normalised)
//   value_sum[c*d .. c*d+d)         sum of member values, f32
//   size[c]                         member count (= begin[c+1] - begin[c])
struct SegmentClusters {
  uint32_t n_clusters = 0;
  std::vector<uint32_t> order;      // [T]
  std::vector<uint32_t> begin;      // [n_clusters + 1]
  std::vector<float> centroid;      // [n_clusters][d]
  std::vector<float> value_sum;     // [n_clusters][d]
  std::vector<uint32_t> size;       // [n_clusters]
  uint32_t n_outliers = 0;          // the last n_outliers clusters are
                                    // outliers split off (split_outliers)
  std::vector<float> spread;        // [n_clusters] mean squared distance of
                                    // member keys to the centroid
  std::vector<double> value_total;  // [d] sum over c of value_sum[c], in
                                    // order of c
};

// Clusters T keys [T][d] (values [T][d] only feed value_sum): subtracts the
// segment's mean key, normalises, runs `iters` rounds of spherical k-means
// (assign by max cosine, update to the normalised member sum) from k distinct
// seeded initial points (seeded_perm, kernels/kmeans_init.hpp: the device
// k-means's), then fills *out. k is clamped to [1, T]. T >= 1. Points and
// directions are rounded to f16 as on the device, so that both build the
// same clusters but for near-ties.
void kmeans_segment(const KMeansParams &p, const float *keys,
                    const float *values, uint32_t T, uint32_t d,
                    SegmentClusters *out);

// The last pass of kmeans_segment, on its compacted clusters (keys and
// values as given to it): fills spread, and with cap > 0 and ratio > 0
// splits outliers off as singleton clusters. With r[p] the squared
// distance of the member at position p of `order` to its cluster's
// centroid (differences and squares exact in double) and mean_r the mean
// of r over the segment, the outliers are the members with
// r[p] > ratio * mean_r in clusters of two or more, but for each cluster's
// member nearest its centroid (the first on ties): at most cap of them, the
// largest r first (the lower position on ties). Each cluster keeps its
// other members in order; the outliers follow as clusters of one, in
// position order, with their key as centroid and their value as value sum.
// A cluster that lost members gets its sums and spread computed afresh.
// The device k-means's split (kernels/kmeans_cuda.hpp) is the same.
void split_outliers(uint32_t cap, float ratio, const float *keys,
                    const float *values, uint32_t d, SegmentClusters *sc);

// Scoring and selection ---------------------------------------------------

// Scores C clusters for a query group of G heads.
//   q        [G][d]
//   centroid [C][d]
//   spread   [C] or null: the clusters' spread (SegmentClusters)
//   logits   [G][C]  out: q_g . centroid_c * scale, plus with a spread
//                    0.5 * scale^2 * |q_g|^2 * spread_c / d (spread_logits)
//   score    [C]     out: sum over g of softmax_c(logits[g][.])[c]
void score_clusters(const float *q, uint32_t G, const float *centroid,
                    uint32_t C, uint32_t d, float scale, float *logits,
                    float *score, const float *spread = nullptr);

// The same from centroids stored as `t`: f32, or the meta index's compact
// 16-bit mirror (f16 or bf16), converted as they are read; the dot products
// accumulate in f32. Logits and scores mean the same as above, computed from
// the rounded centroids. False (nothing written) for an unknown dtype.
bool score_clusters(DType t, const float *q, uint32_t G, const void *centroid,
                    uint32_t C, uint32_t d, float scale, float *logits,
                    float *score, const float *spread = nullptr);

// The same from centroids kept in 8 bits a component with one f32 scale a
// row (quantize_row's rows): rows [C][d] int8, row_scale [C]. The dot
// product q_g . rows[c] accumulates in f32 over the integers (exact as
// floats); logits[g][c] = (dot * row_scale[c]) * scale, two roundings, then
// the spread term and the scores as above. A NaN row scale (a row that held
// a NaN or an infinity) gives that cluster NaN logits, and so, as any NaN
// logit does here, every cluster a NaN score.
void score_clusters_q8(const float *q, uint32_t G, const int8_t *rows,
                       const float *row_scale, uint32_t C, uint32_t d,
                       float scale, float *logits, float *score,
                       const float *spread = nullptr);

// Adds to each logit [G][C] half the logit's variance over the cluster's
// members, were their offsets from the centroid isotropic with the
// cluster's spread: 0.5 * scale^2 * |q_g|^2 * spread_c / d. exp of the sum
// is then the mean of exp(logit) over the cluster for Gaussian offsets
// (Jensen's lower bound, exp of the centroid's logit, when spread is 0).
void spread_logits(const float *q, uint32_t G, const float *spread,
                   uint32_t C, uint32_t d, float scale, float *logits);

// Picks the n_ret highest scores (retrieval) and the next n_est (estimation)
// among C. Ties break to the lower id. ret and est are sorted ascending by id.
// Pre: n_ret + n_est <= C. `scratch` holds at least C entries.
void select_zones(const float *score, uint32_t C, uint32_t n_ret,
                  uint32_t n_est, uint32_t *ret, uint32_t *est,
                  uint32_t *scratch);

// select_zones with clusters of one ranked apart: the retrieval zone is the
// n_reg highest scores among clusters of size != 1 and the n_one highest
// among clusters of size 1 (ret, ascending, n_reg + n_one ids); the
// estimation zone the n_est highest of the others (est, ascending). Ties
// break to the lower id. Pre: n_reg <= clusters of size != 1, n_one <=
// clusters of size 1, n_reg + n_one + n_est <= C. `scratch` holds at
// least 4 C entries. With n_one == 0 and no cluster of size 1 this is
// select_zones.
void select_zones_split(const float *score, const uint32_t *size, uint32_t C,
                        uint32_t n_reg, uint32_t n_one, uint32_t n_est,
                        uint32_t *ret, uint32_t *est, uint32_t *scratch);

// Estimation and merge ----------------------------------------------------

// Estimate of the estimation zone for one query head, from the meta index.
//   logits    [C] this head's logits of all clusters (from score_clusters)
//   ids       [n] the estimation-zone cluster ids
//   value_sum [C][d], size [C]
// Writes out[d] = sum_i exp(l_i) VS_i / sum_i s_i exp(l_i) and returns the
// natural log of the denominator sum_i s_i exp(l_i), computed with one
// max-shift. With n == 0 writes zeros and returns -infinity.
float estimate_zone(const float *logits, const uint32_t *ids, uint32_t n,
                    const float *value_sum, const uint32_t *size, uint32_t d,
                    float *out);

// estimate_zone for all G heads of a query group at once: each value-sum
// row is read once for the group rather than once per head.
//   logits [G][ld] the heads' logits (row g at logits + g * ld)
//   out    [G][d], lse [G]: what G calls of estimate_zone would give, up to
//          rounding (the same terms in the same order per head)
void estimate_zone_group(const float *logits, uint32_t G, size_t ld,
                         const uint32_t *ids, uint32_t n,
                         const float *value_sum, const uint32_t *size,
                         uint32_t d, float *out, float *lse);

// estimate_zone_group from the meta index's compact mirror: value means
// VS_i / s_i stored in 8 bits with a scale a row (quantize_row's format:
// value_mean [n][d], value_mean_scale [n]) rather than value sums in f32, a
// quarter of the bytes of the rows estimation reads. The weights become
// s_i exp(l_i) (each value weighed by its row's scale too); out and lse
// mean the same, computed from the quantized means.
void estimate_zone_group_means(const float *logits, uint32_t G, size_t ld,
                               const uint32_t *ids, uint32_t n,
                               const int8_t *value_mean, const float *value_mean_scale,
                               const uint32_t *size, uint32_t d, float *out, float *lse);

// Folds the tail (the clusters of neither zone: ids < C in neither list
// ret nor est) into each head's estimate, its value taken as value_mean [d]:
// with m_g the largest of logits[g][0, C) and
// T_g = sum over the tail of size_c exp(logits[g][c] - m_g), out[g] and
// lse[g] become the merge (merge_partials) of (out[g], lse[g]) and
// (value_mean, m_g + log T_g). A head whose T_g is 0 (no tail, or its
// weight underflows against m_g) is left as it was. `scratch` holds C
// floats.
void estimate_tail(const float *logits, uint32_t G, size_t ld, uint32_t C,
                   const uint32_t *ret, uint32_t n_ret, const uint32_t *est,
                   uint32_t n_est, const uint32_t *size,
                   const float *value_mean, uint32_t d, float *out,
                   float *lse, float *scratch);

// Merges two partial attentions (o_a, lse_a) and (o_b, lse_b) over disjoint
// token sets into out[d] and returns the merged lse. Either side may be
// empty (lse = -infinity); both empty gives zeros and -infinity. out may
// alias o_a.
float merge_partials(const float *o_a, float lse_a, const float *o_b,
                     float lse_b, uint32_t d, float *out);

// Exact attention ----------------------------------------------------------

// Attends G query heads q [G][d] over n tokens k, v [n][d] of storage type
// `t` (rows contiguous, row stride d). Writes out [G][d] (normalised) and
// lse [G]. With n == 0 writes zeros and -infinity. Accumulates in f32 with
// an online softmax. False (nothing written) for an unknown dtype.
bool attend_exact(DType t, const float *q, uint32_t G, const void *k,
                  const void *v, uint32_t n, uint32_t d, float scale,
                  float *out, float *lse);

// Reference exact attention in double over rows given by pointer lists
// (tests only): out [G][d] and lse [G] in double. False for an unknown dtype.
bool attend_reference_f64(DType t, const float *q, uint32_t G,
                          const void *const *k_rows, const void *const *v_rows,
                          uint32_t n, uint32_t d, double scale, double *out,
                          double *lse);

// Dot product of two f32 vectors, vectorised.
float dot(const float *a, const float *b, uint32_t d);

}  // namespace wkv::kernels
