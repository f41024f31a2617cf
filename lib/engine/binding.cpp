// Steps a runtime captures: the engine's side of a binding (binding.hpp).
#include "lib/engine/binding.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <new>
#include <thread>

#include "kernels/kmeans_types.hpp"
#include "lib/engine/engine.hpp"
#include "lib/engine/plan.hpp"
#include "lib/engine/sequence.hpp"

namespace wkv {
namespace {

// A growth commits kGrowthLagTokens after its segment completes: more than
// the steps prepare runs ahead of the device, so that no commit reads a row
// of a step whose fault the host has not seen yet (unbind takes those back).
static_assert(kGrowthLagTokens > kBoundSlots, "a commit's rows are older than the steps in flight");

// Steps a binding reserves for when the caller names none.
constexpr uint32_t kDefaultBoundSteps = 4096;
// How long prepare waits for a slot whose step has not ended.
constexpr auto kSlotWait = std::chrono::seconds(30);

const char *fault_text(uint32_t fault) {
  switch (fault) {
    case kernels::kBindStale: return "a graph captured under an earlier binding of the plan was replayed";
    case kernels::kBindUnprepared: return "a replay ran without wkv_plan_prepare before it";
    case kernels::kBindMissingCall:
      return "a replay did not run every captured call of the step in the order captured (a graph captured "
             "twice, or in part)";
    case kernels::kBindEarlyPrepare:
      return "wkv_plan_prepare came before the previous step's replay was launched on its stream";
    default: return "an unknown fault";
  }
}

// What one layer's runs can reach within `steps` more generated tokens: a
// growth an update segment, each adding the k-means's clusters at most (its
// clusters and outliers) and members of the retrieval zone at most its
// tokens; a tail that commits a segment once it holds the window, the
// segment and the growth lag.
BoundReserve reserve_layer(const Config &cfg, const std::vector<std::shared_ptr<Sequence>> &seqs, uint32_t layer,
                           uint32_t steps, uint32_t lag) {
  const uint32_t seg = cfg.c.update_segment_tokens, window = cfg.c.window_tokens;
  kernels::KMeansSegmentDesc job{};
  job.tokens = seg;
  job.clusters = std::max<uint32_t>(1, (seg + cfg.c.cluster_tokens - 1) / cfg.c.cluster_tokens);
  job.outliers = outlier_cap(cfg.c.method, seg);
  const uint64_t per_growth = kernels::kmeans_out_clusters(job);
  BoundReserve r;
  for (const auto &sq : seqs) {
    const LayerState &L = sq->layer(layer);
    for (const HeadState &hs : L.heads) {
      const uint64_t growths = 1 + (hs.tail.n + steps) / seg;
      const uint64_t clusters64 = hs.clusters() + growths * per_growth;
      const uint32_t clusters = static_cast<uint32_t>(std::min<uint64_t>(clusters64, UINT32_MAX));
      uint32_t n_ret = 0, n_one = 0, n_est = 0;
      zone_sizes(cfg, clusters, 0, &n_ret, &n_one, &n_est);
      // Clusters of one ranked apart take a share of their own, one at
      // least: two more at most.
      n_ret = std::min(clusters, n_ret + 2);
      // The n_ret largest clusters: today's largest, and all new members.
      uint64_t ret_tokens = growths * seg;
      uint32_t left = n_ret;
      for (size_t s = hs.by_size.size(); s-- > 1 && left > 0;) {
        const uint32_t take = std::min(left, hs.by_size[s]);
        ret_tokens += uint64_t(take) * s;
        left -= take;
      }
      const uint64_t clustered = (L.tail_begin - hs.sink.n) + growths * seg;
      const uint64_t tail =
          std::min<uint64_t>(hs.tail.n + steps, std::max<uint64_t>(hs.tail.n, uint64_t(window) + seg + lag) + 1);
      const uint64_t run = hs.sink.n + tail + std::min(ret_tokens, clustered);
      r.max_clusters = std::max(r.max_clusters, clusters);
      r.max_ret = std::max(r.max_ret, n_ret);
      r.max_run = std::max<uint32_t>(r.max_run, static_cast<uint32_t>(std::min<uint64_t>(run, UINT32_MAX)));
      r.xbuf += run;
      r.clusters += clusters;
      r.ret += n_ret;
      r.est += n_est;
    }
  }
  return r;
}

// The tracker whose end frees a call's slot: the plan's for a decode (its
// epoch ends with the step's attention), the last sequence's for an append
// (its copy kernel writes that mark last, fenced after every read of the
// slot).
StepTracker &slot_tracker(Plan &plan, Binding &b, const BoundCallState &c) {
  return c.kind == BoundCallState::Kind::kDecode ? plan.tracker() : b.seqs.back()->tracker();
}

}  // namespace

Status Engine::bind(Plan &plan, const std::shared_ptr<Sequence> *seqs, uint32_t n, uint32_t max_steps,
                    void *stream) {
  if (!backend_->binds() || cold_)
    return WKV_ERROR(WKV_ERR_UNSUPPORTED, "captured steps need a CUDA engine without cold pages");
  if (plan.binding) return WKV_ERROR(WKV_ERR_STATE, "the plan is bound already (wkv_plan_unbind it first)");
  WKV_RETURN_IF_ERROR(backend_->check_stream(stream, "wkv_plan_bind"));
  if (max_steps == 0) max_steps = kDefaultBoundSteps;
  const uint32_t layers = cfg_.c.n_layers;
  for (uint32_t i = 0; i < n; ++i) {
    WKV_RETURN_IF_ERROR(check_unbound(*seqs[i], "wkv_plan_bind"));
    for (uint32_t l = 0; l < layers; ++l)
      if (seqs[i]->layer(l).tokens == 0)
        return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT,
                         "sequence %u has no tokens at layer %u: bind a batch once its prompts are appended", i, l);
  }
  // Every layer generating, as a lookup would leave it.
  for (uint32_t i = 0; i < n; ++i) WKV_RETURN_IF_ERROR(restore(*seqs[i]));
  for (uint32_t i = 0; i < n; ++i)
    for (uint32_t l = 0; l < layers; ++l) WKV_RETURN_IF_ERROR(end_prompt_locked(*seqs[i], l, stream));
  auto b = std::make_unique<Binding>();
  try {
    b->plan = &plan;
    b->seqs.assign(seqs, seqs + n);
    b->max_steps = max_steps;
    b->max_calls = 2 * layers;
    b->calls.reserve(b->max_calls);
    b->reserve.resize(layers);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory binding %u sequences", n);
  }
  for (uint32_t l = 0; l < layers; ++l) b->reserve[l] = reserve_layer(cfg_, b->seqs, l, max_steps, growth_lag_);
  WKV_RETURN_IF_ERROR(backend_->bind(plan, *b));
  for (uint32_t i = 0; i < n; ++i) seqs[i]->set_binding(b.get());
  plan.close_lookups();
  plan.stage = Plan::Stage::kEmpty;
  plan.binding = std::move(b);
  return Status::ok();
}

Status Engine::capture_append(Sequence *const *seqs, uint32_t n, uint32_t layer, const uint8_t *k, const uint8_t *v,
                              uint32_t n_tokens, int64_t seq_stride, int64_t token_stride, int64_t head_stride,
                              void *stream, const char *verb) {
  Binding &b = *seqs[0]->binding();
  if (n != b.seqs.size())
    return WKV_ERROR(WKV_ERR_STATE, "%s: a captured append takes the bound batch (%zu sequences), not %u", verb,
                     b.seqs.size(), n);
  for (uint32_t i = 0; i < n; ++i)
    if (seqs[i] != b.seqs[i].get())
      return WKV_ERROR(WKV_ERR_STATE, "%s: sequence %u is not the bound batch's sequence %u", verb, i, i);
  if (n_tokens != 1)
    return WKV_ERROR(WKV_ERR_INVALID_ARGUMENT, "%s: a captured append takes one token a sequence, not %u", verb,
                     n_tokens);
  if (b.sealed)
    return WKV_ERROR(WKV_ERR_STATE,
                     "%s: the binding's step is captured and prepared already (unbind and bind again to capture "
                     "another)",
                     verb);
  for (const BoundCallState &c : b.calls)
    if (c.kind == BoundCallState::Kind::kAppend && c.layer == layer)
      return WKV_ERROR(WKV_ERR_STATE, "%s: layer %u's append is captured already in this step", verb, layer);
  if (b.calls.size() >= b.max_calls) return WKV_ERROR(WKV_ERR_STATE, "%s: the step holds too many calls", verb);
  const size_t esz = dtype_bytes(cfg_.dtype());
  const void *dk = nullptr, *dv = nullptr;
  WKV_RETURN_IF_ERROR(backend_->check_pointer(k, "k", esz, &dk));
  WKV_RETURN_IF_ERROR(backend_->check_pointer(v, "v", esz, &dv));
  BoundCallState c;
  try {
    c.staged.resize(n);
    c.tail_begin.resize(n);
    c.pages_before.resize(n);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "%s: out of host memory", verb);
  }
  c.kind = BoundCallState::Kind::kAppend;
  c.layer = layer;
  c.k = static_cast<const uint8_t *>(dk);
  c.v = static_cast<const uint8_t *>(dv);
  c.seq_pitch = static_cast<uint64_t>(seq_stride) * esz;
  c.token_pitch = static_cast<uint64_t>(token_stride) * esz;
  c.head_pitch = static_cast<uint64_t>(head_stride) * esz;
  const uint32_t i = static_cast<uint32_t>(b.calls.size());
  backend_->bound_ring(*b.plan, i, &c.ring);
  b.calls.push_back(std::move(c));  // reserved at bind
  Status st = backend_->capture_bound(*b.plan, b, i, stream);
  if (!st.is_ok()) b.calls.pop_back();
  return st;
}

Status Engine::capture_decode(Plan &plan, const std::shared_ptr<Sequence> *seqs, uint32_t n, uint32_t layer,
                              const void *q, int64_t seq_stride, int64_t head_stride, const DecodeOut &out,
                              void *stream) {
  Binding &b = *plan.binding;
  if (n != b.seqs.size())
    return WKV_ERROR(WKV_ERR_STATE, "a bound plan decodes its batch (%zu sequences), not %u", b.seqs.size(), n);
  for (uint32_t i = 0; i < n; ++i)
    if (seqs[i] != b.seqs[i])
      return WKV_ERROR(WKV_ERR_STATE, "sequence %u is not the bound batch's sequence %u", i, i);
  if (b.sealed)
    return WKV_ERROR(WKV_ERR_STATE,
                     "the binding's step is captured and prepared already (unbind and bind again to capture another)");
  for (const BoundCallState &c : b.calls)
    if (c.kind == BoundCallState::Kind::kDecode && c.layer == layer)
      return WKV_ERROR(WKV_ERR_STATE, "layer %u's decode is captured already in this step", layer);
  if (b.calls.size() >= b.max_calls) return WKV_ERROR(WKV_ERR_STATE, "the step holds too many calls");
  const size_t esz = dtype_bytes(cfg_.dtype());
  const void *dq = nullptr, *dout = nullptr;
  WKV_RETURN_IF_ERROR(backend_->check_pointer(q, "q", esz, &dq));
  WKV_RETURN_IF_ERROR(backend_->check_pointer(out.out, "out", esz, &dout));
  BoundCallState c;
  c.kind = BoundCallState::Kind::kDecode;
  c.layer = layer;
  c.q = dq;
  c.q_seq_stride = seq_stride;
  c.q_head_stride = head_stride;
  c.out = const_cast<void *>(dout);
  c.out_seq_stride = out.seq_stride;
  c.out_head_stride = out.head_stride;
  const uint32_t i = static_cast<uint32_t>(b.calls.size());
  backend_->bound_ring(plan, i, &c.ring);
  b.calls.push_back(std::move(c));
  Status st = backend_->capture_bound(plan, b, i, stream);
  if (!st.is_ok()) b.calls.pop_back();
  return st;
}

Status Engine::prepare(Plan &plan, void *stream) {
  Binding *bp = plan.binding.get();
  if (!bp) return WKV_ERROR(WKV_ERR_STATE, "the plan is not bound (wkv_plan_bind)");
  Binding &b = *bp;
  WKV_RETURN_IF_ERROR(backend_->check_stream(stream, "wkv_plan_prepare"));
  if (b.calls.empty())
    return WKV_ERROR(WKV_ERR_STATE,
                     "nothing is captured: capture the step (wkv_append_batch and wkv_decode on a stream being "
                     "captured) before preparing its replays");
  if (const uint32_t fault = backend_->bound_fault(plan))
    return WKV_ERROR(WKV_ERR_STATE, "the binding is broken: %s; its replays do no work and write NaN (unbind it)",
                     fault_text(fault));
  if (b.steps >= b.max_steps)
    return WKV_ERROR(WKV_ERR_BUDGET, "the binding's %u steps are prepared: unbind and bind again", b.max_steps);
  if (!b.sealed) {
    backend_->bound_seal(plan, static_cast<uint32_t>(b.calls.size()));
    b.sealed = true;
  }
  b.stream = stream;
  const uint32_t slot = static_cast<uint32_t>(b.steps % kBoundSlots);
  // 1. The slots, once the step that last used them has ended (the host
  //    may run kBoundSlots steps ahead of the device).
  const auto until = std::chrono::steady_clock::now() + kSlotWait;
  for (BoundCallState &c : b.calls) {
    StepTracker &t = slot_tracker(plan, b, c);
    while (t.done() < c.slot_epoch[slot]) {
      if (backend_->bound_fault(plan) || std::chrono::steady_clock::now() > until)
        return WKV_ERROR(WKV_ERR_STATE,
                         "the step prepared %u steps ago has not ended (was each prepared step's graph launched, on "
                         "this stream?)",
                         kBoundSlots);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  // A fault found by the steps just waited for.
  if (const uint32_t fault = backend_->bound_fault(plan))
    return WKV_ERROR(WKV_ERR_STATE, "the binding is broken: %s; its replays do no work and write NaN (unbind it)",
                     fault_text(fault));
  // 2. Growths whose segments the step before completed begin now, after
  //    its replay on `stream` (checked on the device: had the replay not
  //    been launched, the k-means would read rows not yet written).
  bool checked = false;
  for (uint32_t j = 0; j < b.calls.size(); ++j) {
    const BoundCallState &c = b.calls[j];
    if (c.kind != BoundCallState::Kind::kAppend) continue;
    for (const auto &sq : b.seqs) {
      LayerState &L = sq->layer(c.layer);
      const IndexContext ix = index_for(*sq);
      if (!growth_due(ix, L)) continue;
      if (!checked) {
        WKV_RETURN_IF_ERROR(backend_->bound_expect(plan, j, static_cast<uint32_t>(b.steps), stream));
        checked = true;
      }
      bool began = false;
      WKV_RETURN_IF_ERROR(begin_due(ix, L, c.layer, stream, &began));
    }
  }
  // 3. Each call's host part; a failure takes back what the step's calls
  //    before it counted (nothing is stamped, so no replay runs them).
  uint32_t done = 0;
  Status st = prepare_calls(plan, b, stream, &done);
  if (!st.is_ok()) {
    unprepare_calls(b, done);
    return st;
  }
  // 4. Epochs, access records and stamps (nothing fails from here).
  const uint32_t n = static_cast<uint32_t>(b.seqs.size());
  for (BoundCallState &c : b.calls) {
    uint8_t *at = c.ring.host + size_t(slot) * c.ring.slot_bytes;
    auto *head = reinterpret_cast<kernels::BoundSlotHead *>(at);
    uint8_t *body = at + sizeof(kernels::BoundSlotHead);
    if (c.kind == BoundCallState::Kind::kAppend) {
      uint8_t *marks = body + size_t(head->n_copies) * sizeof(kernels::RowCopyDesc);
      auto *done_at = reinterpret_cast<unsigned long long **>(marks);
      auto *epochs = reinterpret_cast<unsigned long long *>(marks + size_t(n) * 8);
      for (uint32_t i = 0; i < n; ++i) {
        Sequence &sq = *b.seqs[i];
        const uint64_t epoch = buffers_->begin(sq.tracker());
        done_at[i] = reinterpret_cast<unsigned long long *>(sq.tracker().done_device());
        epochs[i] = epoch;
        LayerState &L = sq.layer(c.layer);
        if (L.pages() != c.pages_before[i]) L.grown_epoch = epoch;
        if (i + 1 == n) c.slot_epoch[slot] = epoch;
      }
      head->n_marks = n;
    } else {
      const uint64_t epoch = buffers_->begin(plan.tracker());
      backend_->seal_decode(plan, c, epoch, body);
      c.slot_epoch[slot] = epoch;
      counters_.retrieved_clusters.fetch_add(c.retrieved);
      counters_.estimated_clusters.fetch_add(c.estimated);
      counters_.lookups.fetch_add(n);
    }
    // A release store: the body above is seen by a kernel that loads this
    // stamp with acquire semantics (bound_enter) and reads the body after.
    __atomic_store_n(&head->stamp, static_cast<unsigned long long>(b.steps + 1), __ATOMIC_RELEASE);
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
  b.steps++;
  return Status::ok();
}

Status Engine::prepare_calls(Plan &plan, Binding &b, void *stream, uint32_t *done) {
  const uint32_t n = static_cast<uint32_t>(b.seqs.size());
  const uint32_t slot = static_cast<uint32_t>(b.steps % kBoundSlots);
  thread_local std::vector<RowCopy> copies;
  for (uint32_t j = 0; j < b.calls.size(); ++j) {
    *done = j;
    BoundCallState &c = b.calls[j];
    uint8_t *at = c.ring.host + size_t(slot) * c.ring.slot_bytes;
    auto *head = reinterpret_cast<kernels::BoundSlotHead *>(at);
    uint8_t *body = at + sizeof(kernels::BoundSlotHead);
    if (c.kind == BoundCallState::Kind::kDecode) {
      WKV_RETURN_IF_ERROR(plan_runs(plan, b.seqs.data(), n, c.layer));
      WKV_RETURN_IF_ERROR(backend_->prepare_decode(plan, b, j, body));
      continue;
    }
    // An append: the growth due commits (before the rows are staged: its
    // trim may move the tail), room for the row, the row counted; any
    // failure takes back this call's rows counted so far.
    try {
      copies.clear();
      copies.reserve(static_cast<size_t>(2) * n * cfg_.c.n_kv_heads);
    } catch (const std::bad_alloc &) {
      return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory preparing a step");
    }
    Status st = Status::ok();
    uint32_t i = 0;
    for (; i < n && st.is_ok(); ++i) {
      Sequence &sq = *b.seqs[i];
      LayerState &L = sq.layer(c.layer);
      const IndexContext ix = index_for(sq);
      st = commit_due(ix, L, 1, stream);
      if (st.is_ok()) {
        c.pages_before[i] = L.pages();
        st = stage_append(ix, L, 1, &c.staged[i], stream);
      }
      if (st.is_ok())
        st = append_copies(ix, L, c.staged[i], static_cast<uint64_t>(i) * c.seq_pitch, c.token_pitch, c.head_pitch,
                           &copies);
      if (st.is_ok()) {
        c.tail_begin[i] = L.tail_begin;
        st = commit_append(ix, L, c.layer, c.staged[i], stream, false);
      }
    }
    if (!st.is_ok()) {
      // Sequences before i counted their row.
      for (uint32_t r = i - 1; r-- > 0;) uncount_append(index_for(*b.seqs[r]), b.seqs[r]->layer(c.layer), c.staged[r],
                                                        c.tail_begin[r]);
      return Status(st.code(), format("layer %u, sequence %u: %s", c.layer, i - 1, st.message().c_str()));
    }
    auto *desc = reinterpret_cast<kernels::RowCopyDesc *>(body);
    for (size_t x = 0; x < copies.size(); ++x)
      desc[x] = kernels::RowCopyDesc{copies[x].dst_k, copies[x].dst_v, copies[x].src_off, copies[x].rows, 0};
    head->n_copies = static_cast<uint32_t>(copies.size());
    head->n_marks = 0;
  }
  *done = static_cast<uint32_t>(b.calls.size());
  return Status::ok();
}

void Engine::unprepare_calls(Binding &b, uint32_t done) {
  for (uint32_t j = done; j-- > 0;) {
    const BoundCallState &c = b.calls[j];
    if (c.kind != BoundCallState::Kind::kAppend) continue;
    for (uint32_t i = static_cast<uint32_t>(b.seqs.size()); i-- > 0;)
      uncount_append(index_for(*b.seqs[i]), b.seqs[i]->layer(c.layer), c.staged[i], c.tail_begin[i]);
  }
}

Status Engine::unbind(Plan &plan, void *stream, bool whole_device) {
  Binding *bp = plan.binding.get();
  if (!bp) return WKV_ERROR(WKV_ERR_STATE, "the plan is not bound (wkv_plan_bind)");
  Binding &b = *bp;
  // 1. The replays have run.
  if (whole_device) {
    WKV_RETURN_IF_ERROR(backend_->device_sync());
  } else {
    WKV_RETURN_IF_ERROR(backend_->check_stream(stream, "wkv_plan_unbind"));
    WKV_RETURN_IF_ERROR(backend_->mem_sync(stream));
  }
  const uint32_t calls = static_cast<uint32_t>(b.calls.size());
  std::vector<uint32_t> worked;
  try {
    worked.resize(calls);
  } catch (const std::bad_alloc &) {
    return WKV_ERROR(WKV_ERR_OUT_OF_MEMORY, "out of host memory unbinding a plan");
  }
  WKV_RETURN_IF_ERROR(backend_->bound_counts(plan, calls, worked.data()));
  // 2. Growths begun after a fault may have read rows never written: they
  //    are dropped (their segments stay in the tails and grow again).
  if (backend_->bound_fault(plan)) {
    for (const auto &sq : b.seqs)
      for (uint32_t l = 0; l < sq->n_layers(); ++l) {
        LayerState &L = sq->layer(l);
        if (!L.pending) continue;
        backend_->cluster_end(L.pending->batch, nullptr);
        L.pending.reset();
      }
  }
  // 3. Rows of steps prepared and never run, or run after a fault (which
  //    did no work), were never written: taken back, newest first (the
  //    tail's end: a call's work stops for good at a fault, so the steps
  //    it wrote are a prefix; a growth begun without a fault read only rows
  //    of steps that ran, and none commits a row of the last kBoundSlots
  //    steps).
  for (uint32_t j = 0; j < calls; ++j) {
    const BoundCallState &c = b.calls[j];
    if (c.kind != BoundCallState::Kind::kAppend || worked[j] >= b.steps) continue;
    const uint64_t missing = b.steps - worked[j];
    for (const auto &sq : b.seqs) {
      LayerState &L = sq->layer(c.layer);
      const IndexContext ix = index_for(*sq);
      StagedAppend sa;
      sa.n = static_cast<uint32_t>(missing);
      sa.to_tail = std::min<uint64_t>(missing, L.heads.empty() ? 0 : L.heads[0].tail.n);
      sa.to_sink = missing - sa.to_tail;
      uncount_append(ix, L, sa, std::min<uint64_t>(L.tail_begin, L.tokens - missing));
    }
  }
  // 4. Steps prepared and never run left their epochs unended (the stream
  //    is idle: every step that ran has ended).
  auto end_all = [this](StepTracker &t) {
    const uint64_t issued = t.issued();
    if (t.done() < issued) buffers_->end_on_host(t, issued);
  };
  end_all(plan.tracker());
  for (const auto &sq : b.seqs) end_all(sq->tracker());
  backend_->unbind(plan);
  for (const auto &sq : b.seqs) sq->set_binding(nullptr);
  plan.binding.reset();
  return Status::ok();
}

}  // namespace wkv
