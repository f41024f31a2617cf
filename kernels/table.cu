#include <algorithm>
#include <type_traits>

#include "kernels/cuda_common.cuh"
#include "kernels/table_cuda.hpp"

namespace wkv::kernels {
namespace {

constexpr uint32_t kWordsPerLaunch = 480;

// A lookup's run table travels by value in one launch up to 144 runs (the
// large kernel parameters of CUDA 12.1 and sm_70 on, up to 32764 bytes),
// in a struct no larger than the runs need: 16, 64 or 144 of them.
template <uint32_t N>
struct RunChunk {
  DevRun runs[N];
  uint32_t n;
};
constexpr uint32_t kRunsPerLaunch = 144;
// The other parameters of stage_lookup_kernel take under 256 bytes.
static_assert(sizeof(RunChunk<kRunsPerLaunch>) + 256 <= 32764, "kernel parameters are limited to 32764 bytes");
// Without large parameters (a driver older than CUDA 12.1, which minor
// version compatibility lets a 12.x program run on): 16 runs a launch.
constexpr uint32_t kRunsPerSmallLaunch = 16;
static_assert(sizeof(RunChunk<kRunsPerSmallLaunch>) + 256 <= 4000, "kernel parameters are limited to 4 KiB");

// Whether launches may carry more than 4 KiB of parameters (asked once).
bool large_params_ok() {
  static const bool ok = [] {
    int v = 0;
    if (cudaDriverGetVersion(&v) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return v >= 12010;
  }();
  return ok;
}

struct WordChunk {
  uint64_t addrs[kWordsPerLaunch];
  uint32_t n, value;
};
static_assert(sizeof(WordChunk) <= 4000, "kernel parameters are limited to 4 KiB");

constexpr uint32_t kPairsPerLaunch = 240;

struct PairChunk {
  uint64_t addrs[kPairsPerLaunch];
  uint64_t values[kPairsPerLaunch];
  uint32_t n;
};
static_assert(sizeof(PairChunk) <= 4000, "kernel parameters are limited to 4 KiB");

struct SpanChunk {
  SpanDesc s[kSpansPerLaunch];
  uint32_t n;
};
static_assert(sizeof(SpanChunk) <= 4000, "kernel parameters are limited to 4 KiB");

constexpr uint32_t kCopiesPerLaunch = 96;
constexpr uint32_t kCopyRowsPerCta = 16;
constexpr uint32_t kMarksPerLaunch = 240;

struct CopyChunk {
  RowCopyDesc c[kCopiesPerLaunch];
  const uint8_t *k, *v;
  uint64_t pitch;
  uint32_t row_bytes, n;
};
static_assert(sizeof(CopyChunk) <= 4000, "kernel parameters are limited to 4 KiB");

// A small append's copies and its steps' ends in one launch of one CTA
// (copy_rows_marked): up to 96 copies, 48 marks and 512 rows, in a block no
// larger than they need (a launch's cost grows with its parameters: the
// largest block, near 4 KiB, took some 8 us of host time to launch): 16
// copies and 16 marks (a sequence or two), 64 and 16, or 96 and 48.
constexpr uint32_t kCopyMarks = 48, kCopyMarkRows = 512;
template <uint32_t C, uint32_t M>
struct CopyMarkChunk {
  RowCopyDesc c[C];
  const uint8_t *k, *v;
  uint64_t pitch;
  uint32_t row_bytes, n;
  unsigned long long *done[M];
  unsigned long long epoch[M];
  uint32_t n_marks;
};
static_assert(sizeof(CopyMarkChunk<kCopiesPerLaunch, kCopyMarks>) <= 4000, "kernel parameters are limited to 4 KiB");

struct MarkChunk {
  unsigned long long *done[kMarksPerLaunch];
  unsigned long long epoch[kMarksPerLaunch];
  uint32_t n;
};
static_assert(sizeof(MarkChunk) <= 4000, "kernel parameters are limited to 4 KiB");

// CTA (x, y) copies rows y * 16 .. of copy x (and every gridDim.y * 16th
// row group after), K and V, word by word.
template <typename W> __global__ void copy_rows_kernel(const __grid_constant__ CopyChunk chunk) {
  const RowCopyDesc &c = chunk.c[blockIdx.x];
  const uint32_t words = chunk.row_bytes / sizeof(W);
  for (uint64_t r0 = uint64_t(blockIdx.y) * kCopyRowsPerCta; r0 < c.rows;
       r0 += uint64_t(gridDim.y) * kCopyRowsPerCta) {
    const uint32_t rows = static_cast<uint32_t>(c.rows - r0 < kCopyRowsPerCta ? c.rows - r0 : kCopyRowsPerCta);
    for (uint32_t i = threadIdx.x; i < rows * words; i += blockDim.x) {
      const uint64_t r = r0 + i / words, w = i % words;
      const uint64_t src = c.src_off + r * chunk.pitch + w * sizeof(W);
      const uint64_t dst = r * chunk.row_bytes + w * sizeof(W);
      *reinterpret_cast<W *>(c.dst_k + dst) = *reinterpret_cast<const W *>(chunk.k + src);
      *reinterpret_cast<W *>(c.dst_v + dst) = *reinterpret_cast<const W *>(chunk.v + src);
    }
  }
}

// One CTA copies every row of every copy (K and V, word by word, the rows
// of all copies numbered in one sequence), then reports the steps' ends.
template <typename W, uint32_t C, uint32_t M>
__global__ void copy_mark_kernel(const __grid_constant__ CopyMarkChunk<C, M> m) {
  __shared__ uint32_t first[C + 1];  // copy x's rows are first[x] .. first[x + 1] - 1
  const CopyMarkChunk<C, M> &chunk = m;
  if (threadIdx.x == 0) {
    first[0] = 0;
    for (uint32_t x = 0; x < chunk.n; ++x) first[x + 1] = first[x] + chunk.c[x].rows;
  }
  __syncthreads();
  const uint32_t words = chunk.row_bytes / sizeof(W), total = first[chunk.n] * words;
  for (uint32_t i = threadIdx.x; i < total; i += blockDim.x) {
    const uint32_t row = i / words, w = i % words;
    uint32_t lo = 0, hi = chunk.n;  // the copy x with first[x] <= row < first[x + 1]
    while (hi - lo > 1) {
      const uint32_t mid = (lo + hi) / 2;
      if (first[mid] <= row) lo = mid;
      else hi = mid;
    }
    const RowCopyDesc &c = chunk.c[lo];
    const uint64_t r = row - first[lo];
    const uint64_t src = c.src_off + r * chunk.pitch + w * sizeof(W);
    const uint64_t dst = r * chunk.row_bytes + w * sizeof(W);
    *reinterpret_cast<W *>(c.dst_k + dst) = *reinterpret_cast<const W *>(chunk.k + src);
    *reinterpret_cast<W *>(c.dst_v + dst) = *reinterpret_cast<const W *>(chunk.v + src);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence_system();
  for (uint32_t i = 0; i < m.n_marks; ++i) *reinterpret_cast<volatile unsigned long long *>(m.done[i]) = m.epoch[i];
}

__global__ void mark_many_kernel(const __grid_constant__ MarkChunk chunk) {
  __threadfence_system();
  for (uint32_t i = threadIdx.x; i < chunk.n; i += blockDim.x)
    *reinterpret_cast<volatile unsigned long long *>(chunk.done[i]) = chunk.epoch[i];
}

__global__ void store_words_kernel(const WordChunk chunk) {
  for (uint32_t i = threadIdx.x; i < chunk.n; i += blockDim.x)
    *reinterpret_cast<volatile uint32_t *>(chunk.addrs[i]) = chunk.value;
}

__global__ void store_words_at_kernel(const uint64_t *__restrict__ addrs, uint32_t n, uint32_t value) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    *reinterpret_cast<volatile uint32_t *>(addrs[i]) = value;
}

__global__ void store_pairs_kernel(const PairChunk chunk) {
  for (uint32_t i = threadIdx.x; i < chunk.n; i += blockDim.x)
    *reinterpret_cast<volatile uint64_t *>(chunk.addrs[i]) = chunk.values[i];
}

__global__ void mark_kernel(unsigned long long *done, unsigned long long epoch) {
  __threadfence_system();
  *reinterpret_cast<volatile unsigned long long *>(done) = epoch;
}

// A lookup's staging in one launch (stage_lookup_kernel, stage_ring_kernel,
// bound_stage_kernel; stage_ctas sizes the grid): the run table's 8-byte
// words spread over the grid (DevRun is 8-byte aligned), the query
// converted to f32, kStageElems elements of the flattened [q_rows][d] a
// CTA, and where vars_dst is set, CTA 0 stores the step's variables there.
// A few CTAs, not one a query row: each CTA of a staging from a slot reads
// the slot's header over PCIe, and small reads of mapped memory from many
// CTAs queue there (a decode of 7 sequences took 23 to 28 us with a CTA a
// query row, 224 of them; an ncu figure).
constexpr uint32_t kStageThreads = 128, kStageVec = 8, kStageElems = kStageThreads * kStageVec;

__device__ __forceinline__ void stage_runs(const DevRun *src, uint32_t n, DevRun *dst) {
  const uint64_t *from = reinterpret_cast<const uint64_t *>(src);
  uint64_t *out = reinterpret_cast<uint64_t *>(dst);
  const uint32_t words = n * static_cast<uint32_t>(sizeof(DevRun) / 8);
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) out[i] = from[i];
}

// Query row r is sequence r / nq's head r % nq. Every load of a thread is
// issued before its stores.
template <typename T>
__device__ __forceinline__ void stage_query(const typename DevType<T>::type *__restrict__ q, int64_t seq_stride,
                                            int64_t head_stride, uint32_t nq, uint32_t d, uint32_t q_rows,
                                            float *__restrict__ q_dst) {
  const uint64_t total = uint64_t(q_rows) * d, base = uint64_t(blockIdx.x) * kStageElems;
  if (base >= total) return;
  float x[kStageVec];
#pragma unroll
  for (uint32_t k = 0; k < kStageVec; ++k) {
    const uint64_t i = base + k * kStageThreads + threadIdx.x;
    if (i < total) {
      const uint32_t row = static_cast<uint32_t>(i / d), col = static_cast<uint32_t>(i % d);
      x[k] = DevType<T>::to_f(q[(row / nq) * seq_stride + (row % nq) * head_stride + col]);
    }
  }
#pragma unroll
  for (uint32_t k = 0; k < kStageVec; ++k) {
    const uint64_t i = base + k * kStageThreads + threadIdx.x;
    if (i < total) q_dst[i] = x[k];
  }
}

template <typename T>
__device__ __forceinline__ void stage_part(const DevRun *src, uint32_t n, DevRun *dst,
                                           const typename DevType<T>::type *q, int64_t seq_stride,
                                           int64_t head_stride, uint32_t nq, uint32_t d, uint32_t q_rows,
                                           float *q_dst) {
  stage_runs(src, n, dst);
  stage_query<T>(q, seq_stride, head_stride, nq, d, q_rows, q_dst);
}

template <typename T, uint32_t N>
__global__ void stage_lookup_kernel(const __grid_constant__ RunChunk<N> chunk, DevRun *dst,
                                    const typename DevType<T>::type *q, int64_t seq_stride, int64_t head_stride,
                                    uint32_t nq, uint32_t d, uint32_t q_rows, float *q_dst,
                                    const __grid_constant__ StepVars vars, StepVars *vars_dst) {
  if (vars_dst && blockIdx.x == 0 && threadIdx.x == 0) *vars_dst = vars;
  stage_part<T>(chunk.runs, chunk.n, dst, q, seq_stride, head_stride, nq, d, q_rows, q_dst);
}

// stage_lookup_kernel's work from a ring's slot (StageRing): every CTA
// reads the counter first; the last CTA to finish moves it on, after every
// CTA has read it and its share of the slot.
template <typename T>
__global__ void stage_ring_kernel(const StageRing ring, uint32_t n_runs, uint32_t nq, uint32_t d, uint32_t q_rows,
                                  float *q_dst, DevRun *dst, StepVars *vars_dst) {
  __shared__ unsigned int taken;
  if (threadIdx.x == 0) taken = *reinterpret_cast<volatile unsigned int *>(ring.taken);
  __syncthreads();
  const uint8_t *slot = ring.slots + size_t(taken % ring.n_slots) * ring.slot_bytes;
  const StageSlot *h = reinterpret_cast<const StageSlot *>(slot);
  if (blockIdx.x == 0 && threadIdx.x == 0) *vars_dst = h->vars;
  stage_part<T>(reinterpret_cast<const DevRun *>(slot + sizeof(StageSlot)), n_runs, dst,
                static_cast<const typename DevType<T>::type *>(h->q), h->q_seq_stride, h->q_head_stride, nq, d,
                q_rows, q_dst);
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(ring.ctas, 1u) != gridDim.x - 1) return;
  *ring.ctas = 0;  // for the next launch (stream order)
  *reinterpret_cast<volatile unsigned int *>(ring.taken) = taken + 1;
}

// A captured call's entry (BoundCall): what the slot its count names
// holds for this replay. Read by warp 0 of each CTA of the entry kernel;
// every CTA finds the same, since nothing it reads changes until the last
// CTA leaves (bound_leave).
struct BoundEntry {
  const uint8_t *slot;
  unsigned int t;   // slots this call consumed before this replay
  uint32_t fault;   // kBind*, 0: none found here
  uint32_t error;   // the binding's, as the call found it
  bool marks;       // the slot was prepared for this replay: its epochs were issued
  bool work;        // ... and no fault: the call does its work
};

// The slots this call consumed before this replay (device memory), in
// every lane of the warp.
__device__ __forceinline__ unsigned int bound_count(const BoundCall &c) {
  return __shfl_sync(0xffffffffu, threadIdx.x % 32 == 0 ? c.taken[c.index] : 0u, 0);
}

__device__ __forceinline__ const uint8_t *bound_slot(const BoundCall &c, unsigned int t) {
  return c.slots + size_t(t % c.n_slots) * c.slot_bytes;
}

// A load with acquire semantics at system scope: what the host wrote
// before its release of this word is seen by the loads that follow (this
// thread's, and after a barrier its CTA's).
__device__ __forceinline__ unsigned long long load_acquire_sys(const unsigned long long *p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Warp 0 of each CTA of an entry kernel reads the call's entry into *out
// (shared memory), given the call's count t (bound_count): lane 0 the
// binding's words and the slot's stamp together (one round trip over
// PCIe), every lane then checking the other calls' counts. The stamp is
// read with acquire semantics, and the slot's body only after the CTA's
// barrier that follows: the host writes the body, then (after a release
// fence) the stamp, so a body read after a stamp of this replay is this
// replay's, even where a runtime prepares while an unprepared replay runs.
// (Loading the body beside the stamp saved a round trip and broke that:
// a stamp of this replay could come with a body of 16 steps before.) The
// words are plain loads: nothing read here changes while the kernel runs
// in a correct program, and the CTAs' loads of one line of mapped memory
// share it. (Volatile loads, one after another in one thread, took 0.9 ms
// for a decode's 224 CTAs on the H100.)
__device__ __forceinline__ void bound_enter(const BoundCall &c, unsigned int t, BoundEntry *out) {
  constexpr unsigned kAll = 0xffffffffu;
  const uint32_t lane = threadIdx.x;
  BoundEntry e{};
  e.t = t;
  e.slot = bound_slot(c, t);
  BindWords w{};
  unsigned long long stamp = 0;
  if (lane == 0) {
    w = *c.words;
    stamp = load_acquire_sys(&reinterpret_cast<const BoundSlotHead *>(e.slot)->stamp);
  }
  e.error = __shfl_sync(kAll, w.error, 0);
  const uint32_t generation = __shfl_sync(kAll, w.generation, 0);
  const uint32_t n_calls = min(__shfl_sync(kAll, w.n_calls, 0), kMaxBoundCalls);
  stamp = __shfl_sync(kAll, stamp, 0);
  if (generation != c.generation) {
    e.fault = kBindStale;
  } else {
    bool bad = false;
    for (uint32_t i = lane; i < n_calls; i += 32)
      bad |= i != c.index && c.taken[i] != (i < c.index ? t + 1 : t);
    bad = __any_sync(kAll, bad);
    if (stamp != static_cast<unsigned long long>(t) + 1) {
      e.fault = kBindUnprepared;
    } else {
      e.marks = true;
      if (bad) e.fault = kBindMissingCall;
      e.work = e.fault == 0 && e.error == 0;
    }
  }
  if (lane == 0) *out = e;
}

// The last CTA of an entry kernel, one thread: the fault where the binding
// had none, and the slot consumed where it was this replay's.
__device__ __forceinline__ void bound_leave(const BoundCall &c, const BoundEntry &e) {
  volatile BindWords *w = c.words;
  if (e.fault && e.error == 0) w->error = e.fault;
  if (e.marks) *reinterpret_cast<volatile unsigned int *>(c.taken + c.index) = e.t + 1;
  if (e.work) {
    volatile unsigned int *worked = c.worked + c.index;
    *worked = *worked + 1;
  }
  __threadfence_system();
}

// An entry kernel's CTA count (BoundCall::ctas) counts the CTAs out in its
// low 16 bits and, above them, those that found the slot prepared for this
// replay (BoundEntry::marks): an entry kernel has fewer than 2^16 CTAs.
constexpr unsigned int kMarkedCta = 1u << 16;
constexpr uint32_t kMaxEntryCtas = kMarkedCta - 1;

// Counts the CTA out with its view of the slot (`marked`); true in the
// last one of the kernel (after every CTA's writes are visible), where
// *torn says whether the CTAs' views differed. Thread 0 only.
__device__ __forceinline__ bool last_cta(unsigned int *ctas, bool marked, bool *torn) {
  *torn = false;
  __threadfence_system();
  if (gridDim.x == 1) return true;
  const unsigned int mine = 1u + (marked ? kMarkedCta : 0u);
  const unsigned int before = atomicAdd(ctas, mine);
  if ((before & (kMarkedCta - 1)) != gridDim.x - 1) return false;
  const unsigned int marked_ctas = (before + mine) / kMarkedCta;
  *torn = marked_ctas != 0 && marked_ctas != gridDim.x;
  *ctas = 0;  // for the next launch (stream order)
  __threadfence_system();
  return true;
}

// The last CTA's entry where the CTAs' views of the slot differed (a torn
// entry): the runtime launched the replay without a prepare and prepared
// while its entry kernel ran, so that the stamp landed between two CTAs'
// reads. Some CTA read this replay's stamp, after the host had written the
// slot whole, and the host writes it again only once the step's ends are
// reported: the slot is this replay's. It is consumed and its step's ends
// reported (marks), the step does no work (what the CTAs that saw the stamp
// did is undone or taken back: see the kernels) and the binding faults, as
// for a replay without prepare. Thread 0; the stamp read again with acquire
// semantics where this CTA had not seen it, so that the CTA's reads of the
// slot after its next barrier are of this replay's body.
__device__ __forceinline__ void bound_torn(BoundEntry *e, bool marked) {
  if (!marked) (void)load_acquire_sys(&reinterpret_cast<const BoundSlotHead *>(e->slot)->stamp);
  e->marks = true;
  e->work = false;
  if (e->fault == 0) e->fault = kBindUnprepared;
}

// A captured append: warp w of CTA b copies copies (b * warps + w), then
// every (gridDim.x * warps)-th (all their rows, K and V, word by word); the
// last CTA writes the steps' ends the slot lists, the last one after a
// fence: once the host sees it, every read of the slot is done (the host
// then writes the slot again: BoundCallState::slot_epoch). After the entry,
// one round trip brings the slot's head and each warp's first copy, and
// each thread's step end is loaded while the copies run.
template <typename W>
__global__ void bound_copy_kernel(const BoundCall c, uint32_t max_copies, const uint8_t *k, const uint8_t *v,
                                  uint64_t pitch, uint32_t row_bytes) {
  __shared__ BoundEntry e;
  __shared__ bool last, torn;
  const uint32_t warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned int t = bound_count(c);
  if (warp == 0) bound_enter(c, t, &e);
  __syncthreads();
  const bool marked = e.marks;  // this CTA's view: nothing of the slot is read unless it is this replay's
  const BoundSlotHead *head = reinterpret_cast<const BoundSlotHead *>(e.slot);
  const RowCopyDesc *copies = reinterpret_cast<const RowCopyDesc *>(e.slot + sizeof(BoundSlotHead));
  uint32_t n = 0, n_marks = 0;
  // The steps' ends, done[n_marks] then epochs[n_marks], after the copies:
  // thread i's (i + 1 < n_marks), and thread 0's the last one too.
  unsigned long long *const *done = nullptr;
  const unsigned long long *epochs = nullptr;
  unsigned long long *my_done = nullptr, *final_done = nullptr;
  unsigned long long my_epoch = 0, final_epoch = 0;
  auto load_ends = [&]() {
    n = min(head->n_copies, max_copies);
    n_marks = head->n_marks;
    const uint8_t *marks = e.slot + sizeof(BoundSlotHead) + size_t(n) * sizeof(RowCopyDesc);
    done = reinterpret_cast<unsigned long long *const *>(marks);
    epochs = reinterpret_cast<const unsigned long long *>(marks + size_t(n_marks) * 8);
    if (threadIdx.x + 1 < n_marks) {
      my_done = done[threadIdx.x];
      my_epoch = epochs[threadIdx.x];
    }
    if (threadIdx.x == 0 && n_marks > 0) {
      final_done = done[n_marks - 1];
      final_epoch = epochs[n_marks - 1];
    }
  };
  if (marked) {
    const uint32_t x0 = blockIdx.x * warps + warp;
    RowCopyDesc first{};
    if (e.work && x0 < max_copies) first = copies[x0];
    load_ends();
    if (e.work) {
      const uint32_t words = row_bytes / sizeof(W);
      for (uint32_t x = x0; x < n; x += gridDim.x * warps) {
        const RowCopyDesc cp = x == x0 ? first : copies[x];
        for (uint64_t i = lane; i < uint64_t(cp.rows) * words; i += 32) {
          const uint64_t r = i / words, wd = i % words;
          const uint64_t src = cp.src_off + r * pitch + wd * sizeof(W);
          const uint64_t dst = r * row_bytes + wd * sizeof(W);
          *reinterpret_cast<W *>(cp.dst_k + dst) = *reinterpret_cast<const W *>(k + src);
          *reinterpret_cast<W *>(cp.dst_v + dst) = *reinterpret_cast<const W *>(v + src);
        }
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bool differed = false;
    last = last_cta(c.ctas, marked, &differed);
    torn = last && differed;
    // A torn entry: the rows some CTAs copied belong to a step that is not
    // counted as worked, which unbind takes back; no reader sees them (the
    // step's decode finds the binding faulted).
    if (torn) bound_torn(&e, marked);
    if (last) bound_leave(c, e);
  }
  __syncthreads();
  if (!last || !e.marks) return;
  if (torn && !marked) load_ends();  // after thread 0's acquire and the barrier
  if (n_marks == 0) return;
  if (my_done) *reinterpret_cast<volatile unsigned long long *>(my_done) = my_epoch;
  for (uint32_t i = threadIdx.x + blockDim.x; i + 1 < n_marks; i += blockDim.x)
    *reinterpret_cast<volatile unsigned long long *>(done[i]) = epochs[i];
  __syncthreads();
  if (threadIdx.x != 0 || !final_done) return;
  __threadfence_system();
  *reinterpret_cast<volatile unsigned long long *>(final_done) = final_epoch;
}

// A captured decode's staging where the call does no work: empty runs
// (every later kernel of the step then does nothing), no access record, no
// output, NaN written to `out` instead, and the step's epoch only where the
// slot was prepared for this replay (its end is then reported as the host
// expects). Elements first, first + stride, ... of the runs and of `out`;
// the step's variables where write_vars.
template <typename T>
__device__ void stage_nothing(const BoundEntry &e, const StageSlot *h, uint32_t n_runs, uint32_t nq, uint32_t d,
                              uint32_t q_rows, DevRun *dst, StepVars *vars_dst, void *out, int64_t out_seq_stride,
                              int64_t out_head_stride, uint64_t first, uint64_t stride, bool write_vars) {
  if (write_vars) {
    StepVars none{};
    none.epoch = e.marks ? h->vars.epoch : 0;
    *vars_dst = none;
  }
  uint64_t *runs = reinterpret_cast<uint64_t *>(dst);
  const uint64_t words = uint64_t(n_runs) * (sizeof(DevRun) / 8);
  for (uint64_t i = first; i < words; i += stride) runs[i] = 0;
  using V = typename DevType<T>::type;
  const uint64_t total = uint64_t(q_rows) * d;
  for (uint64_t i = first; i < total; i += stride) {
    const uint32_t row = static_cast<uint32_t>(i / d), col = static_cast<uint32_t>(i % d);
    V *o = static_cast<V *>(out) + (row / nq) * out_seq_stride + (row % nq) * out_head_stride;
    o[col] = DevType<T>::from_f(__int_as_float(0x7fc00000));
  }
}

// A captured decode's staging: stage_ring_kernel's work from the slot
// where the call works, else stage_nothing. The slot's body is read after
// the entry (BoundEntry). Where the CTAs' views of the slot differ (a torn
// entry, bound_torn), the last CTA stages nothing over the whole step, on
// top of what the others staged.
template <typename T>
__global__ void bound_stage_kernel(const BoundCall c, uint32_t n_runs, uint32_t nq, uint32_t d, uint32_t q_rows,
                                   float *q_dst, DevRun *dst, StepVars *vars_dst, void *out, int64_t out_seq_stride,
                                   int64_t out_head_stride) {
  __shared__ BoundEntry e;
  __shared__ bool last, torn;
  const unsigned int t = bound_count(c);
  if (threadIdx.x < 32) bound_enter(c, t, &e);
  __syncthreads();
  const bool marked = e.marks;
  const StageSlot *h = reinterpret_cast<const StageSlot *>(e.slot + sizeof(BoundSlotHead));
  if (e.work) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *vars_dst = h->vars;
    stage_part<T>(reinterpret_cast<const DevRun *>(e.slot + sizeof(BoundSlotHead) + sizeof(StageSlot)), n_runs, dst,
                  static_cast<const typename DevType<T>::type *>(h->q), h->q_seq_stride, h->q_head_stride, nq, d,
                  q_rows, q_dst);
  } else {
    stage_nothing<T>(e, h, n_runs, nq, d, q_rows, dst, vars_dst, out, out_seq_stride, out_head_stride,
                     uint64_t(blockIdx.x) * blockDim.x + threadIdx.x, uint64_t(gridDim.x) * blockDim.x,
                     blockIdx.x == 0 && threadIdx.x == 0);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bool differed = false;
    last = last_cta(c.ctas, marked, &differed);
    torn = last && differed;
    if (torn) bound_torn(&e, marked);
  }
  __syncthreads();
  if (!last) return;
  if (torn) {
    stage_nothing<T>(e, h, n_runs, nq, d, q_rows, dst, vars_dst, out, out_seq_stride, out_head_stride, threadIdx.x,
                     blockDim.x, threadIdx.x == 0);
    __syncthreads();
  }
  if (threadIdx.x == 0) bound_leave(c, e);
}

// Faults the binding unless *taken is `want` (the slots an append call has
// consumed when a growth's k-means is about to read its rows).
__global__ void bound_expect_kernel(const unsigned int *taken, unsigned int want, BindWords *words) {
  volatile BindWords *w = words;
  if (*reinterpret_cast<const volatile unsigned int *>(taken) != want && w->error == 0) w->error = kBindEarlyPrepare;
  __threadfence_system();
}

// f32 to f16, round to nearest even, elements first, first + stride, ...
// of n; *overflow |= 1 where a value is outside f16's range (NaN
// included), as the CPU engine's compact mirror tests it. Every thread of
// the CTA calls it (the flag is one __syncthreads_or).
__device__ __forceinline__ void narrow_part(const float *__restrict__ src, uint64_t n, __half *__restrict__ dst,
                                            uint32_t *overflow, uint64_t first, uint64_t stride) {
  bool bad = false;
  for (uint64_t i = first; i < n; i += stride) {
    const float x = src[i];
    bad |= !(fabsf(x) <= 65504.0f);
    dst[i] = __float2half_rn(x);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(overflow, 1u);
}

__global__ void narrow_f16_kernel(const float *__restrict__ src, uint64_t n, __half *__restrict__ dst,
                                  uint32_t *overflow) {
  narrow_part(src, n, dst, overflow, blockIdx.x * uint64_t(blockDim.x) + threadIdx.x,
              uint64_t(gridDim.x) * blockDim.x);
}

// Row `row` of rows of d values (d <= 256) at src quantized to 8 bits by
// one warp (every lane calls it): quantize_row's arithmetic (Int8Row), so
// the CPU's bytes. Lane 0 stores the scale and flags *overflow where the
// row is not finite.
__device__ __forceinline__ void quantize_row_warp(const float *__restrict__ src, uint64_t row, uint32_t d,
                                                  int8_t *__restrict__ dst, float *__restrict__ scales,
                                                  uint32_t *overflow) {
  constexpr uint32_t kMax = 256 / 32;
  const uint32_t lane = threadIdx.x % 32;
  const float *x = src + row * d;
  float v[kMax];
  Int8Row r;
#pragma unroll
  for (uint32_t k = 0; k < kMax; ++k) {
    const uint32_t j = lane + 32 * k;
    v[k] = j < d ? x[j] : 0.0f;
    r.take(v[k]);
  }
  const float scale = r.scale_warp();
  int8_t *q = dst + row * d;
#pragma unroll
  for (uint32_t k = 0; k < kMax; ++k) {
    const uint32_t j = lane + 32 * k;
    if (j < d) q[j] = static_cast<int8_t>(Int8Row::level(v[k], scale));
  }
  if (lane == 0) {
    scales[row] = scale;
    if (!r.finite) atomicOr(overflow, 1u);
  }
}

__global__ void quantize_rows8_kernel(const float *__restrict__ src, uint64_t rows, uint32_t d,
                                      int8_t *__restrict__ dst, float *__restrict__ scales, uint32_t *overflow) {
  const uint64_t warps = uint64_t(gridDim.x) * (blockDim.x / 32);
  for (uint64_t r = uint64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps)
    quantize_row_warp(src, r, d, dst, scales, overflow);
}

// The widest word (16, 8, 4, 2 or 1 bytes) that `bits` (addresses, sizes
// and offsets or-ed together) is a multiple of.
__host__ __device__ __forceinline__ uint32_t widest_word(uint64_t bits) {
  return bits % 16 == 0 ? 16 : bits % 8 == 0 ? 8 : bits % 4 == 0 ? 4 : bits % 2 == 0 ? 2 : 1;
}

// A span's unit: an f32 value for a narrowing, else its widest word.
__host__ __device__ __forceinline__ uint32_t span_unit(const SpanDesc &sp) {
  return sp.op == kSpanNarrowF16
             ? 4
             : widest_word(reinterpret_cast<uintptr_t>(sp.dst) | reinterpret_cast<uintptr_t>(sp.src) | sp.n);
}

template <typename W>
__device__ __forceinline__ void copy_words(const SpanDesc &sp, uint64_t first, uint64_t stride) {
  for (uint64_t i = first; i < sp.n / sizeof(W); i += stride)
    reinterpret_cast<W *>(sp.dst)[i] = reinterpret_cast<const W *>(sp.src)[i];
}

// CTA (x, y) writes span x from unit y * blockDim.x + threadIdx.x on, every
// gridDim.y * blockDim.x-th unit. The op is uniform across a CTA.
__global__ void apply_spans_kernel(const __grid_constant__ SpanChunk chunk) {
  const SpanDesc &sp = chunk.s[blockIdx.x];
  const uint64_t first = uint64_t(blockIdx.y) * blockDim.x + threadIdx.x, stride = uint64_t(gridDim.y) * blockDim.x;
  if (sp.op == kSpanNarrowF16) {
    narrow_part(reinterpret_cast<const float *>(sp.src), sp.n, reinterpret_cast<__half *>(sp.dst), sp.overflow, first,
                stride);
    return;
  }
  if (sp.op == kSpanQuantRows8) {  // a warp a row
    for (uint64_t r = first / 32; r < sp.n / sp.row; r += stride / 32)
      quantize_row_warp(reinterpret_cast<const float *>(sp.src), r, sp.row, reinterpret_cast<int8_t *>(sp.dst),
                        sp.scales, sp.overflow);
    return;
  }
  switch (span_unit(sp)) {
    case 16: copy_words<uint4>(sp, first, stride); break;
    case 8: copy_words<uint2>(sp, first, stride); break;
    case 4: copy_words<uint32_t>(sp, first, stride); break;
    case 2: copy_words<uint16_t>(sp, first, stride); break;
    default: copy_words<uint8_t>(sp, first, stride); break;
  }
}

}  // namespace

static_assert(sizeof(DevRun) % 8 == 0, "DevRun is copied in 8-byte words");
static_assert(sizeof(StageSlot) % 8 == 0, "a slot's run table is 8-byte aligned");
static_assert(sizeof(BoundSlotHead) % 16 == 0, "a bound slot's body is 16-byte aligned");
static_assert(sizeof(RowCopyDesc) % 8 == 0, "an append slot's marks are 8-byte aligned");

namespace {
// A staging's grid (stage_part): enough CTAs for a word of the run table a
// thread and for kStageElems elements of the query a CTA, one at least.
uint32_t stage_ctas(uint32_t n_runs, uint32_t q_rows, uint32_t d) {
  const uint64_t word_ctas = (uint64_t(n_runs) * (sizeof(DevRun) / 8) + kStageThreads - 1) / kStageThreads;
  const uint64_t q_ctas = (uint64_t(q_rows) * d + kStageElems - 1) / kStageElems;
  return static_cast<uint32_t>(std::max<uint64_t>({word_ctas, q_ctas, 1u}));
}

template <typename T, uint32_t N>
cudaError_t launch_stage(const DevRun *runs, uint32_t n, DevRun *dst, const void *q, int64_t seq_stride,
                         int64_t head_stride, uint32_t nq, uint32_t d, uint32_t q_rows, float *q_dst,
                         const StepVars &vars, StepVars *vars_dst, cudaStream_t s) {
  RunChunk<N> c;
  c.n = n;
  for (uint32_t i = 0; i < n; ++i) c.runs[i] = runs[i];
  stage_lookup_kernel<T, N><<<stage_ctas(n, q_rows, d), kStageThreads, 0, s>>>(
      c, dst, static_cast<const typename DevType<T>::type *>(q), seq_stride, head_stride, nq, d, q_rows, q_dst, vars,
      vars_dst);
  WKV_CUDA_CHECK_LAUNCH("stage_lookup");
  return cudaSuccess;
}
}  // namespace

cudaError_t stage_from_ring(DType t, const StageRing &ring, uint32_t n_runs, uint32_t n_seqs, uint32_t n_q_heads,
                            uint32_t d, float *q_dst, DevRun *dst, StepVars *vars_dst, void *stream) {
  if (!ring.slots || ring.n_slots == 0 || !ring.taken || !ring.ctas || !vars_dst || (n_runs > 0 && !dst) ||
      (n_seqs > 0 && !q_dst))
    return cudaErrorInvalidValue;
  if (ring.slot_bytes < sizeof(StageSlot) + uint64_t(n_runs) * sizeof(DevRun) || ring.slot_bytes % 8 != 0)
    return cudaErrorInvalidValue;
  if (static_cast<uint64_t>(n_seqs) * n_q_heads > INT32_MAX) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return WKV_DISPATCH_DTYPE(t, T, cudaErrorNotSupported, [&]() -> cudaError_t {
    const uint32_t q_rows = n_seqs * n_q_heads;
    stage_ring_kernel<T><<<stage_ctas(n_runs, q_rows, d), kStageThreads, 0, s>>>(ring, n_runs, n_q_heads, d, q_rows,
                                                                              q_dst, dst, vars_dst);
    WKV_CUDA_CHECK_LAUNCH("stage_from_ring");
    return cudaSuccess;
  });
}

cudaError_t bound_copy(const BoundCall &call, uint32_t max_copies, const uint8_t *k, const uint8_t *v,
                       uint64_t src_pitch, uint32_t row_bytes, uint32_t width, void *stream) {
  if (!call.slots || !call.taken || !call.worked || !call.ctas || !call.words || call.n_slots == 0 || !k || !v ||
      row_bytes == 0 || max_copies == 0 || row_bytes % width != 0 ||
      call.slot_bytes < sizeof(BoundSlotHead) + uint64_t(max_copies) * sizeof(RowCopyDesc))
    return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // A warp a copy for half of max_copies (an append's bound counts a sink
  // copy beside each tail copy, which few appends have); the warps take the
  // rest in turn. Few CTAs: each reads the slot's head over PCIe.
  constexpr uint32_t kThreads = 256, kWarps = kThreads / 32;
  constexpr uint32_t kMaxCopyCtas = 1024;
  static_assert(kMaxCopyCtas <= kMaxEntryCtas, "the CTA count's low bits (last_cta)");
  const uint32_t ctas = std::min<uint32_t>(((max_copies + 1) / 2 + kWarps - 1) / kWarps, kMaxCopyCtas);
  switch (width) {
    case 16: bound_copy_kernel<uint4><<<ctas, kThreads, 0, s>>>(call, max_copies, k, v, src_pitch, row_bytes); break;
    case 8: bound_copy_kernel<uint2><<<ctas, kThreads, 0, s>>>(call, max_copies, k, v, src_pitch, row_bytes); break;
    case 4:
      bound_copy_kernel<uint32_t><<<ctas, kThreads, 0, s>>>(call, max_copies, k, v, src_pitch, row_bytes);
      break;
    case 2:
      bound_copy_kernel<uint16_t><<<ctas, kThreads, 0, s>>>(call, max_copies, k, v, src_pitch, row_bytes);
      break;
    case 1: bound_copy_kernel<uint8_t><<<ctas, kThreads, 0, s>>>(call, max_copies, k, v, src_pitch, row_bytes); break;
    default: return cudaErrorInvalidValue;
  }
  WKV_CUDA_CHECK_LAUNCH("bound_copy");
  return cudaSuccess;
}

uint32_t copy_width(uint64_t bits) { return widest_word(bits); }

cudaError_t bound_stage(DType t, const BoundCall &call, uint32_t n_runs, uint32_t n_seqs, uint32_t n_q_heads,
                        uint32_t d, float *q_dst, DevRun *dst, StepVars *vars_dst, void *out, int64_t out_seq_stride,
                        int64_t out_head_stride, void *stream) {
  if (!call.slots || !call.taken || !call.worked || !call.ctas || !call.words || call.n_slots == 0 || !vars_dst ||
      !out ||
      (n_runs > 0 && !dst) || (n_seqs > 0 && !q_dst))
    return cudaErrorInvalidValue;
  if (call.slot_bytes < sizeof(BoundSlotHead) + sizeof(StageSlot) + uint64_t(n_runs) * sizeof(DevRun) ||
      call.slot_bytes % 8 != 0)
    return cudaErrorInvalidValue;
  if (static_cast<uint64_t>(n_seqs) * n_q_heads > INT32_MAX) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return WKV_DISPATCH_DTYPE(t, T, cudaErrorNotSupported, [&]() -> cudaError_t {
    const uint32_t q_rows = n_seqs * n_q_heads, ctas = stage_ctas(n_runs, q_rows, d);
    // The CTA count's low bits (last_cta): 65535 CTAs of 1024 query elements
    // each, some 67 million query elements, far beyond any batch.
    if (ctas > kMaxEntryCtas) return cudaErrorInvalidValue;
    bound_stage_kernel<T><<<ctas, kStageThreads, 0, s>>>(
        call, n_runs, n_q_heads, d, q_rows, q_dst, dst, vars_dst, out, out_seq_stride, out_head_stride);
    WKV_CUDA_CHECK_LAUNCH("bound_stage");
    return cudaSuccess;
  });
}

cudaError_t bound_load() {
  cudaFuncAttributes a;
  cudaError_t err = cudaFuncGetAttributes(&a, bound_expect_kernel);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&a, bound_copy_kernel<uint4>);
  return err;
}

cudaError_t bound_expect(const unsigned int *taken, unsigned int want, BindWords *words, void *stream) {
  if (!taken || !words) return cudaErrorInvalidValue;
  bound_expect_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(taken, want, words);
  WKV_CUDA_CHECK_LAUNCH("bound_expect");
  return cudaSuccess;
}

cudaError_t stage_lookup(DType t, const void *q, int64_t seq_stride, int64_t head_stride, uint32_t n_seqs,
                         uint32_t n_q_heads, uint32_t d, float *q_dst, const DevRun *host_runs, uint32_t n,
                         DevRun *dst, void *stream, const StepVars *vars, StepVars *vars_dst) {
  if ((n > 0 && (!host_runs || !dst)) || (n_seqs > 0 && (!q || !q_dst))) return cudaErrorInvalidValue;
  if ((vars == nullptr) != (vars_dst == nullptr)) return cudaErrorInvalidValue;
  const StepVars none{};
  const StepVars &v = vars ? *vars : none;
  if (static_cast<uint64_t>(n_seqs) * n_q_heads > INT32_MAX) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return WKV_DISPATCH_DTYPE(t, T, cudaErrorNotSupported, [&]() -> cudaError_t {
    uint32_t q_rows = n_seqs * n_q_heads;  // the first launch converts the query
    const uint32_t per_launch = large_params_ok() ? kRunsPerLaunch : kRunsPerSmallLaunch;
    uint32_t done = 0;
    do {
      const uint32_t m = std::min(n - done, per_launch);
      const DevRun *r = host_runs + done;
      cudaError_t err;
      if (m <= kRunsPerSmallLaunch)
        err = launch_stage<T, kRunsPerSmallLaunch>(r, m, dst + done, q, seq_stride, head_stride, n_q_heads, d,
                                                   q_rows, q_dst, v, vars_dst, s);
      else if (m <= 64)
        err = launch_stage<T, 64>(r, m, dst + done, q, seq_stride, head_stride, n_q_heads, d, q_rows, q_dst, v,
                                  vars_dst, s);
      else
        err = launch_stage<T, kRunsPerLaunch>(r, m, dst + done, q, seq_stride, head_stride, n_q_heads, d, q_rows,
                                              q_dst, v, vars_dst, s);
      if (err != cudaSuccess) return err;
      done += m;
      q_rows = 0;
      vars_dst = nullptr;  // stored by the first launch
    } while (done < n);
    return cudaSuccess;
  });
}

cudaError_t mark_step_end(unsigned long long *done, unsigned long long epoch, void *stream) {
  if (!done) return cudaErrorInvalidValue;
  mark_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(done, epoch);
  WKV_CUDA_CHECK_LAUNCH("mark_kernel");
  return cudaSuccess;
}

cudaError_t copy_rows_marked(const RowCopyDesc *copies, uint32_t n, const uint8_t *k, const uint8_t *v,
                             uint64_t src_pitch, uint32_t row_bytes, unsigned long long *const *done,
                             const unsigned long long *epochs, uint32_t n_marks, void *stream) {
  if (n == 0 || n > kCopiesPerLaunch || n_marks > kCopyMarks) return cudaErrorNotSupported;
  if (!copies || !k || !v || row_bytes == 0 || (n_marks > 0 && (!done || !epochs))) return cudaErrorInvalidValue;
  uint64_t bits = reinterpret_cast<uintptr_t>(k) | reinterpret_cast<uintptr_t>(v) | src_pitch | row_bytes;
  uint64_t rows = 0;
  for (uint32_t i = 0; i < n; ++i) {
    bits |= copies[i].src_off | reinterpret_cast<uintptr_t>(copies[i].dst_k) |
            reinterpret_cast<uintptr_t>(copies[i].dst_v);
    rows += copies[i].rows;
  }
  if (rows > kCopyMarkRows) return cudaErrorNotSupported;
  for (uint32_t i = 0; i < n_marks; ++i)
    if (!done[i]) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const uint32_t word = widest_word(bits);
  auto launch = [&](auto *type) {  // type: a null Chunk *, for the block's type alone
    using Chunk = std::remove_pointer_t<decltype(type)>;
    Chunk m;
    m.n = n;
    for (uint32_t i = 0; i < n; ++i) m.c[i] = copies[i];
    m.k = k;
    m.v = v;
    m.pitch = src_pitch;
    m.row_bytes = row_bytes;
    m.n_marks = n_marks;
    for (uint32_t i = 0; i < n_marks; ++i) {
      m.done[i] = done[i];
      m.epoch[i] = epochs[i];
    }
    constexpr uint32_t threads = 256;
    switch (word) {
      case 16: copy_mark_kernel<uint4><<<1, threads, 0, s>>>(m); break;
      case 8: copy_mark_kernel<uint2><<<1, threads, 0, s>>>(m); break;
      case 4: copy_mark_kernel<uint32_t><<<1, threads, 0, s>>>(m); break;
      case 2: copy_mark_kernel<uint16_t><<<1, threads, 0, s>>>(m); break;
      default: copy_mark_kernel<uint8_t><<<1, threads, 0, s>>>(m); break;
    }
  };
  if (n <= 16 && n_marks <= 16)
    launch(static_cast<CopyMarkChunk<16, 16> *>(nullptr));
  else if (n <= 64 && n_marks <= 16)
    launch(static_cast<CopyMarkChunk<64, 16> *>(nullptr));
  else
    launch(static_cast<CopyMarkChunk<kCopiesPerLaunch, kCopyMarks> *>(nullptr));
  WKV_CUDA_CHECK_LAUNCH("copy_rows_marked");
  return cudaSuccess;
}

cudaError_t copy_rows(const RowCopyDesc *copies, uint32_t n, const uint8_t *k, const uint8_t *v, uint64_t src_pitch,
                      uint32_t row_bytes, void *stream) {
  if (n == 0) return cudaSuccess;
  if (!copies || !k || !v || row_bytes == 0) return cudaErrorInvalidValue;
  // The widest word every address, offset and pitch is a multiple of.
  uint64_t bits = reinterpret_cast<uintptr_t>(k) | reinterpret_cast<uintptr_t>(v) | src_pitch | row_bytes;
  uint64_t max_rows = 0;
  for (uint32_t i = 0; i < n; ++i) {
    bits |= copies[i].src_off | reinterpret_cast<uintptr_t>(copies[i].dst_k) |
            reinterpret_cast<uintptr_t>(copies[i].dst_v);
    if (copies[i].rows > max_rows) max_rows = copies[i].rows;
  }
  const uint32_t width = widest_word(bits);
  const uint32_t threads = 128;
  const uint32_t groups =
      static_cast<uint32_t>(std::min<uint64_t>((max_rows + kCopyRowsPerCta - 1) / kCopyRowsPerCta, 65535));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  for (uint32_t done = 0; done < n; done += kCopiesPerLaunch) {
    CopyChunk c;
    c.n = n - done < kCopiesPerLaunch ? n - done : kCopiesPerLaunch;
    for (uint32_t i = 0; i < c.n; ++i) c.c[i] = copies[done + i];
    c.k = k;
    c.v = v;
    c.pitch = src_pitch;
    c.row_bytes = row_bytes;
    const dim3 grid(c.n, std::max<uint32_t>(groups, 1));
    switch (width) {
      case 16: copy_rows_kernel<uint4><<<grid, threads, 0, s>>>(c); break;
      case 8: copy_rows_kernel<uint2><<<grid, threads, 0, s>>>(c); break;
      case 4: copy_rows_kernel<uint32_t><<<grid, threads, 0, s>>>(c); break;
      case 2: copy_rows_kernel<uint16_t><<<grid, threads, 0, s>>>(c); break;
      default: copy_rows_kernel<uint8_t><<<grid, threads, 0, s>>>(c); break;
    }
    WKV_CUDA_CHECK_LAUNCH("copy_rows");
  }
  return cudaSuccess;
}

cudaError_t check_spans(const SpanDesc *spans, uint32_t n) {
  if (n > 0 && !spans) return cudaErrorInvalidValue;
  for (uint32_t i = 0; i < n; ++i) {
    const SpanDesc &sp = spans[i];
    if (sp.n > 0 && (!sp.dst || !sp.src)) return cudaErrorInvalidValue;
    if (sp.op == kSpanNarrowF16) {
      if (!sp.overflow || reinterpret_cast<uintptr_t>(sp.src) % 4 || reinterpret_cast<uintptr_t>(sp.dst) % 2 ||
          reinterpret_cast<uintptr_t>(sp.overflow) % 4)
        return cudaErrorInvalidValue;
    } else if (sp.op == kSpanQuantRows8) {
      if (!sp.overflow || !sp.scales || sp.row == 0 || sp.row > 256 || sp.n % sp.row ||
          reinterpret_cast<uintptr_t>(sp.src) % 4 || reinterpret_cast<uintptr_t>(sp.scales) % 4 ||
          reinterpret_cast<uintptr_t>(sp.overflow) % 4)
        return cudaErrorInvalidValue;
    } else if (sp.op != kSpanCopy) {
      return cudaErrorInvalidValue;
    }
  }
  return cudaSuccess;
}

cudaError_t apply_spans(const SpanDesc *spans, uint32_t n, void *stream) {
  // Every span checked before the first launch: a refusal enqueues nothing.
  WKV_CUDA_TRY(check_spans(spans, n));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  constexpr uint32_t threads = 256;
  for (uint32_t done = 0; done < n; done += kSpansPerLaunch) {
    SpanChunk c;
    c.n = n - done < kSpansPerLaunch ? n - done : kSpansPerLaunch;
    uint64_t most = 1;  // units of the largest span
    for (uint32_t i = 0; i < c.n; ++i) {
      const SpanDesc &sp = spans[done + i];
      c.s[i] = sp;
      // Threads the span takes: a value, a word, or a warp a row.
      most = std::max<uint64_t>(most, sp.op == kSpanNarrowF16    ? sp.n
                                      : sp.op == kSpanQuantRows8 ? sp.n / sp.row * 32
                                                                 : sp.n / span_unit(sp));
    }
    const uint32_t rows = static_cast<uint32_t>(std::min<uint64_t>((most + threads - 1) / threads, 64));
    apply_spans_kernel<<<dim3(c.n, std::max<uint32_t>(rows, 1)), threads, 0, s>>>(c);
    WKV_CUDA_CHECK_LAUNCH("apply_spans");
  }
  return cudaSuccess;
}

cudaError_t mark_steps_end(unsigned long long *const *done, const unsigned long long *epochs, uint32_t n,
                           void *stream) {
  for (uint32_t i = 0; i < n; ++i)
    if (!done[i]) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  for (uint32_t at = 0; at < n; at += kMarksPerLaunch) {
    MarkChunk c;
    c.n = n - at < kMarksPerLaunch ? n - at : kMarksPerLaunch;
    for (uint32_t i = 0; i < c.n; ++i) {
      c.done[i] = done[at + i];
      c.epoch[i] = epochs[at + i];
    }
    mark_many_kernel<<<1, 256, 0, s>>>(c);
    WKV_CUDA_CHECK_LAUNCH("mark_many");
  }
  return cudaSuccess;
}

__global__ void add_to_word_kernel(unsigned long long *word, unsigned long long n) { atomicAdd(word, n); }

__global__ void publish_slots_kernel(const uint32_t *src, uint32_t *dst, uint64_t first, uint64_t n, uint32_t cap,
                                     unsigned long long *avail) {
  for (uint64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const uint64_t at = (first + i) % cap;
    dst[at] = src[at];
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();  // the slots before the count: a gather that reserves a frame reads its slot
  atomicAdd(avail, static_cast<unsigned long long>(n));
}

cudaError_t publish_slots(const uint32_t *src, uint32_t *dst, uint64_t first, uint64_t n, uint32_t cap,
                          unsigned long long *avail, void *stream) {
  if (!src || !dst || !avail || cap == 0 || n > cap) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  publish_slots_kernel<<<1, 256, 0, static_cast<cudaStream_t>(stream)>>>(src, dst, first, n, cap, avail);
  WKV_CUDA_CHECK_LAUNCH("publish_slots");
  return cudaSuccess;
}

cudaError_t add_to_word(unsigned long long *word, unsigned long long n, void *stream) {
  if (!word) return cudaErrorInvalidValue;
  add_to_word_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(word, n);
  WKV_CUDA_CHECK_LAUNCH("add_to_word");
  return cudaSuccess;
}

cudaError_t store_words(const uint64_t *addrs, uint32_t n, uint32_t value, void *stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  for (uint32_t done = 0; done < n; done += kWordsPerLaunch) {
    WordChunk c;
    c.n = n - done < kWordsPerLaunch ? n - done : kWordsPerLaunch;
    c.value = value;
    for (uint32_t i = 0; i < c.n; ++i) c.addrs[i] = addrs[done + i];
    store_words_kernel<<<1, 256, 0, s>>>(c);
    WKV_CUDA_CHECK_LAUNCH("store_words");
  }
  return cudaSuccess;
}

cudaError_t store_words_at(const uint64_t *addrs, uint32_t n, uint32_t value, void *stream) {
  if (n == 0) return cudaSuccess;
  if (!addrs) return cudaErrorInvalidValue;
  constexpr uint32_t kThreads = 256, kMaxCtas = 64;
  const uint32_t ctas = std::min<uint32_t>(kMaxCtas, (n + kThreads - 1) / kThreads);
  store_words_at_kernel<<<ctas, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(addrs, n, value);
  WKV_CUDA_CHECK_LAUNCH("store_words_at");
  return cudaSuccess;
}

cudaError_t store_pairs(const uint64_t *addrs, const uint64_t *values, uint32_t n, void *stream) {
  if (n > 0 && (!addrs || !values)) return cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  for (uint32_t done = 0; done < n; done += kPairsPerLaunch) {
    PairChunk c;
    c.n = n - done < kPairsPerLaunch ? n - done : kPairsPerLaunch;
    for (uint32_t i = 0; i < c.n; ++i) {
      c.addrs[i] = addrs[done + i];
      c.values[i] = values[done + i];
    }
    store_pairs_kernel<<<1, 256, 0, s>>>(c);
    WKV_CUDA_CHECK_LAUNCH("store_pairs");
  }
  return cudaSuccess;
}

cudaError_t narrow_f16(const float *src, uint64_t n, void *dst, uint32_t *overflow, void *stream) {
  if (n == 0) return cudaSuccess;
  if (!src || !dst || !overflow) return cudaErrorInvalidValue;
  const uint32_t threads = 256;
  const uint32_t blocks = static_cast<uint32_t>(std::min<uint64_t>((n + threads - 1) / threads, 1024));
  narrow_f16_kernel<<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(src, n, static_cast<__half *>(dst),
                                                                               overflow);
  WKV_CUDA_CHECK_LAUNCH("narrow_f16");
  return cudaSuccess;
}

cudaError_t quantize_rows8(const float *src, uint64_t rows, uint32_t d, int8_t *dst, float *scales,
                           uint32_t *overflow, void *stream) {
  if (rows == 0) return cudaSuccess;
  if (!src || !dst || !scales || !overflow || d == 0 || d > 256) return cudaErrorInvalidValue;
  const uint32_t threads = 256;
  const uint32_t blocks = static_cast<uint32_t>(std::min<uint64_t>((rows + 7) / 8, 1024));
  quantize_rows8_kernel<<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(src, rows, d, dst, scales,
                                                                                  overflow);
  WKV_CUDA_CHECK_LAUNCH("quantize_rows8");
  return cudaSuccess;
}

}  // namespace wkv::kernels
