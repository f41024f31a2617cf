package wavekv

/*
#include <stdint.h>
#include <wavekv/wavekv.h>

// Device pointers and streams cross as integers: they are not Go pointers.
static int wkvgo_decode_device(wkv_plan *plan, wkv_seq *const *seqs, uint32_t n_seqs,
                               uint32_t layer, uintptr_t q, int64_t q_seq_stride,
                               int64_t q_head_stride, uintptr_t out, int64_t out_seq_stride,
                               int64_t out_head_stride, uintptr_t stream) {
  return wkv_decode(plan, seqs, n_seqs, layer, (const void *)q, q_seq_stride, q_head_stride,
                    (void *)out, out_seq_stride, out_head_stride, (void *)stream);
}

static int wkvgo_plan_bind(wkv_plan *plan, wkv_seq *const *seqs, uint32_t n_seqs,
                           uint32_t max_steps, uintptr_t stream) {
  return wkv_plan_bind(plan, seqs, n_seqs, max_steps, (void *)stream);
}

static int wkvgo_plan_prepare(wkv_plan *plan, uintptr_t stream) {
  return wkv_plan_prepare(plan, (void *)stream);
}

static int wkvgo_plan_unbind(wkv_plan *plan, uintptr_t stream) {
  return wkv_plan_unbind(plan, (void *)stream);
}
*/
import "C"

import (
	"errors"
	"math"
	"runtime"
	"sort"
	"sync"
	"unsafe"
)

// Plan is the reusable state of decoding steps (wkv_plan). Its calls are
// serialised, and each locks the sequences it uses, so it may be shared
// between goroutines.
//
// Two ways to run a step: Decode (lookup, assemble, attend and update in one
// call), or Lookup, Assemble, then Attend (wavekv's kernel) or Xbuf, your
// own attention and Merge, then Update. On a CUDA engine, Bind readies a
// step that a runtime captures into a CUDA graph of its own (ABI 0.9).
type Plan struct {
	mu     sync.Mutex
	h      *C.wkv_plan
	shape  shape
	batch  []*C.wkv_seq // the handles of a call's batch, reused
	locked []*Sequence  // the batch in lock order, reused
	step   []*Sequence  // the sequences of the last successful lookup
	bound  []*Sequence  // the batch of the binding (Bind), until Unbind
}

// Close destroys the plan (wkv_plan_destroy); a bound plan is unbound
// first, which waits for the whole device. Closing again is a no-op; it
// always returns nil.
func (p *Plan) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.h != nil {
		unlock := p.lockSeqs(p.bound)
		C.wkv_plan_destroy(p.h)
		unlock()
		p.h = nil
		p.step = nil
		p.bound = nil
		runtime.SetFinalizer(p, nil)
	}
	return nil
}

// lockBatch locks the sequences in id order, the one order every plan uses,
// so that two plans never wait on each other; it fills p.batch with their
// handles in the caller's order. Pre: p.mu is held.
func (p *Plan) lockBatch(fn string, seqs []*Sequence) (unlock func(), err error) {
	b := seqBatch{locked: p.locked, handles: p.batch}
	unlock, err = b.lock(fn, seqs)
	p.locked, p.batch = b.locked, b.handles
	return unlock, err
}

// lockStep locks the sequences of the last lookup, which the plan reads
// until its next lookup. Pre: p.mu is held.
func (p *Plan) lockStep() (unlock func()) {
	return p.lockSeqs(p.step)
}

// lockSeqs locks seqs (distinct) in id order. Pre: p.mu is held.
func (p *Plan) lockSeqs(seqs []*Sequence) (unlock func()) {
	p.locked = append(p.locked[:0], seqs...)
	sort.Slice(p.locked, func(i, j int) bool { return p.locked[i].id < p.locked[j].id })
	for _, s := range p.locked {
		s.mu.Lock()
	}
	locked := p.locked
	return func() {
		for _, s := range locked {
			s.mu.Unlock()
		}
	}
}

func (p *Plan) batchPtr() **C.wkv_seq {
	if len(p.batch) == 0 {
		return nil
	}
	return &p.batch[0]
}

func (p *Plan) rows(nSeqs int) uint64 {
	return uint64(nSeqs) * uint64(p.shape.nQHeads) * uint64(p.shape.headDim)
}

// checkQOut checks q or out of a batch of n sequences: packed, an exact
// length; strided, a length that spans the layout.
func (p *Plan) checkQOut(fn, what string, t Tensor, n int, seqStride, headStride int64, packed bool) error {
	if err := checkTensor(fn, what, t, &p.shape); err != nil {
		return err
	}
	if packed {
		return checkLen(fn, what, t.elems(), p.rows(n), "[n_seqs][n_q_heads][head_dim]")
	}
	return checkSpan(fn, what, t.elems(), uint64(n), uint64(p.shape.nQHeads), uint64(p.shape.headDim),
		seqStride, headStride)
}

// Decode runs one decoding step at one layer for a batch of sequences
// (wkv_decode): q and out are packed [len(seqs)][n_q_heads][head_dim].
func (p *Plan) Decode(seqs []*Sequence, layer uint32, q, out Tensor) error {
	return p.decode(seqs, layer, q, 0, 0, out, 0, 0, true)
}

// DecodeStrided is Decode with explicit strides for q and out, in elements
// (0 = packed).
func (p *Plan) DecodeStrided(seqs []*Sequence, layer uint32, q Tensor, qSeqStride, qHeadStride int64,
	out Tensor, outSeqStride, outHeadStride int64) error {
	return p.decode(seqs, layer, q, qSeqStride, qHeadStride, out, outSeqStride, outHeadStride, false)
}

func (p *Plan) decode(seqs []*Sequence, layer uint32, q Tensor, qs, qh int64, out Tensor, os, oh int64,
	packed bool) error {
	const fn = "wkv_decode"
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.h == nil {
		return closedError(fn, "plan")
	}
	if len(seqs) > math.MaxUint32 {
		return errorf(ErrInvalidArgument, "%s: %d sequences", fn, len(seqs))
	}
	if err := p.checkQOut(fn, "q", q, len(seqs), qs, qh, packed); err != nil {
		return err
	}
	if err := p.checkQOut(fn, "out", out, len(seqs), os, oh, packed); err != nil {
		return err
	}
	unlock, err := p.lockBatch(fn, seqs)
	if err != nil {
		return err
	}
	defer unlock()
	// The lookup inside replaces the plan's step.
	p.step = p.step[:0]
	err = call(func() C.int {
		return C.wkv_decode(p.h, p.batchPtr(), C.uint32_t(len(seqs)), C.uint32_t(layer),
			q.data(), C.int64_t(qs), C.int64_t(qh), out.data(), C.int64_t(os), C.int64_t(oh), nil)
	})
	if err == nil {
		p.step = append(p.step, seqs...)
	}
	return err
}

// DecodeDevice is wkv_decode for CUDA engines: q and out are device
// pointers, stream a cudaStream_t (0: the default stream), strides in
// elements. A CPU engine refuses the call with ErrInvalidArgument.
func (p *Plan) DecodeDevice(seqs []*Sequence, layer uint32, q uintptr, qSeqStride, qHeadStride int64,
	out uintptr, outSeqStride, outHeadStride int64, stream uintptr) error {
	const fn = "wkv_decode"
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.h == nil {
		return closedError(fn, "plan")
	}
	if p.shape.device != DeviceCUDA {
		return errorf(ErrInvalidArgument, "%s: device pointers need a CUDA engine; this one runs on the %s",
			fn, p.shape.device)
	}
	if len(seqs) > math.MaxUint32 {
		return errorf(ErrInvalidArgument, "%s: %d sequences", fn, len(seqs))
	}
	unlock, err := p.lockBatch(fn, seqs)
	if err != nil {
		return err
	}
	defer unlock()
	p.step = p.step[:0]
	err = call(func() C.int {
		return C.wkvgo_decode_device(p.h, p.batchPtr(), C.uint32_t(len(seqs)), C.uint32_t(layer),
			C.uintptr_t(q), C.int64_t(qSeqStride), C.int64_t(qHeadStride), C.uintptr_t(out),
			C.int64_t(outSeqStride), C.int64_t(outHeadStride), C.uintptr_t(stream))
	})
	if err == nil {
		p.step = append(p.step, seqs...)
	}
	return err
}

// Bind binds the plan to a batch for a decoding step that a runtime
// captures into a CUDA graph of its own and replays, each replay after a
// Prepare (wkv_plan_bind, ABI 0.9): seqs are distinct sequences of the
// plan's engine, every layer holding tokens, in the order the captured
// AppendBatchDevice and DecodeDevice calls will list them, for maxSteps more
// tokens each (0: 4096); stream is a cudaStream_t (0: the default stream),
// which Bind waits for. CUDA engines without cold pages only: a CPU engine
// returns ErrUnsupported. While bound, the sequences refuse every other
// append, lookup, prompt end, save and eviction, and the plan every other
// step (ErrState), until Unbind; Prepare and Unbind lock the bound
// sequences as the plan's other calls lock theirs.
func (p *Plan) Bind(seqs []*Sequence, maxSteps uint32, stream uintptr) error {
	const fn = "wkv_plan_bind"
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.h == nil {
		return closedError(fn, "plan")
	}
	if len(seqs) > math.MaxUint32 {
		return errorf(ErrInvalidArgument, "%s: %d sequences", fn, len(seqs))
	}
	unlock, err := p.lockBatch(fn, seqs)
	if err != nil {
		return err
	}
	defer unlock()
	err = call(func() C.int {
		return C.wkvgo_plan_bind(p.h, p.batchPtr(), C.uint32_t(len(seqs)), C.uint32_t(maxSteps),
			C.uintptr_t(stream))
	})
	if err == nil {
		// The binding ends the plan's lookup.
		p.step = p.step[:0]
		p.bound = append(p.bound[:0], seqs...)
	}
	return err
}

// Prepare prepares the next replay of the bound plan's captured step
// (wkv_plan_prepare, ABI 0.9): call it, then launch the graph once on the
// same stream (a cudaStream_t, 0: the default stream). ErrState when the
// plan is not bound, nothing is captured or the device found a fault;
// ErrBudget once maxSteps steps are prepared. After an error the graph must
// not be launched for the step.
func (p *Plan) Prepare(stream uintptr) error {
	const fn = "wkv_plan_prepare"
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.h == nil {
		return closedError(fn, "plan")
	}
	defer p.lockSeqs(p.bound)()
	return call(func() C.int { return C.wkvgo_plan_prepare(p.h, C.uintptr_t(stream)) })
}

// Unbind ends the binding (wkv_plan_unbind, ABI 0.9): waits for stream (the
// replays', 0: the default stream), takes back the tokens of steps prepared
// and never replayed, and frees the sequences and the plan for other use; a
// graph captured under the binding faults if replayed later. ErrState when
// the plan is not bound.
func (p *Plan) Unbind(stream uintptr) error {
	const fn = "wkv_plan_unbind"
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.h == nil {
		return closedError(fn, "plan")
	}
	defer p.lockSeqs(p.bound)()
	err := call(func() C.int { return C.wkvgo_plan_unbind(p.h, C.uintptr_t(stream)) })
	if err == nil || errors.Is(err, ErrState) {
		p.bound = p.bound[:0]
	}
	return err
}

// Lookup selects the zones of each sequence at one layer for the packed
// queries q, [len(seqs)][n_q_heads][head_dim] (wkv_lookup). q is copied. The
// plan's later calls lock these sequences until its next lookup.
func (p *Plan) Lookup(seqs []*Sequence, layer uint32, q Tensor) error {
	return p.lookup(seqs, layer, q, 0, 0, true)
}

// LookupStrided is Lookup with explicit strides for q (0 = packed).
func (p *Plan) LookupStrided(seqs []*Sequence, layer uint32, q Tensor, seqStride, headStride int64) error {
	return p.lookup(seqs, layer, q, seqStride, headStride, false)
}

func (p *Plan) lookup(seqs []*Sequence, layer uint32, q Tensor, qs, qh int64, packed bool) error {
	const fn = "wkv_lookup"
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.h == nil {
		return closedError(fn, "plan")
	}
	if len(seqs) > math.MaxUint32 {
		return errorf(ErrInvalidArgument, "%s: %d sequences", fn, len(seqs))
	}
	if err := p.checkQOut(fn, "q", q, len(seqs), qs, qh, packed); err != nil {
		return err
	}
	unlock, err := p.lockBatch(fn, seqs)
	if err != nil {
		return err
	}
	defer unlock()
	p.step = p.step[:0]
	err = call(func() C.int {
		return C.wkv_lookup(p.h, p.batchPtr(), C.uint32_t(len(seqs)), C.uint32_t(layer), q.data(),
			C.int64_t(qs), C.int64_t(qh), nil)
	})
	if err == nil {
		p.step = append(p.step, seqs...)
	}
	return err
}

// Assemble lays out the exact part of the step in the plan's execution
// buffer (wkv_assemble).
func (p *Plan) Assemble() error {
	const fn = "wkv_assemble"
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.h == nil {
		return closedError(fn, "plan")
	}
	defer p.lockStep()()
	return call(func() C.int { return C.wkv_assemble(p.h, nil) })
}

// Update hands the step's access record to the buffer manager (wkv_update).
func (p *Plan) Update() error {
	const fn = "wkv_update"
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.h == nil {
		return closedError(fn, "plan")
	}
	defer p.lockStep()()
	return call(func() C.int { return C.wkv_update(p.h, nil) })
}

// stepOut checks the out and lse of Attend and Merge against the step.
// Pre: p.mu is held.
func (p *Plan) stepOut(fn string, out Tensor, seqStride, headStride int64, packed bool, lse []float32,
	lseSeqStride int64, lseRequired bool) error {
	if p.h == nil {
		return closedError(fn, "plan")
	}
	n := len(p.step)
	if n == 0 {
		return errorf(ErrState, "%s: the plan has no step: call Lookup first", fn)
	}
	if err := p.checkQOut(fn, "out", out, n, seqStride, headStride, packed); err != nil {
		return err
	}
	if lse == nil {
		if lseRequired {
			return errorf(ErrInvalidArgument, "%s: lse is nil", fn)
		}
		return nil
	}
	if lseSeqStride < 0 {
		return errorf(ErrInvalidArgument, "%s: lse_seq_stride %d must not be negative", fn, lseSeqStride)
	}
	nq := uint64(p.shape.nQHeads)
	if lseSeqStride == 0 {
		return checkLen(fn, "lse", len(lse), uint64(n)*nq, "[n_seqs][n_q_heads]")
	}
	if need := uint64(n-1)*uint64(lseSeqStride) + nq; uint64(len(lse)) < need {
		return errorf(ErrInvalidArgument, "%s: lse has %d floats, fewer than the %d it spans", fn, len(lse), need)
	}
	return nil
}

func floatPtr(lse []float32) *C.float {
	if len(lse) == 0 {
		return nil
	}
	return (*C.float)(unsafe.Pointer(&lse[0]))
}

// Attend runs exact attention over the execution buffer merged with the
// estimate (wkv_attend): out is packed [n_seqs][n_q_heads][head_dim]; lse,
// if not nil, receives [n_seqs][n_q_heads] log-sum-exps.
func (p *Plan) Attend(out Tensor, lse []float32) error {
	return p.attend(out, 0, 0, true, lse)
}

// AttendStrided is Attend with explicit strides for out (0 = packed).
func (p *Plan) AttendStrided(out Tensor, seqStride, headStride int64, lse []float32) error {
	return p.attend(out, seqStride, headStride, false, lse)
}

func (p *Plan) attend(out Tensor, os, oh int64, packed bool, lse []float32) error {
	const fn = "wkv_attend"
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.stepOut(fn, out, os, oh, packed, lse, 0, false); err != nil {
		return err
	}
	defer p.lockStep()()
	return call(func() C.int {
		return C.wkv_attend(p.h, out.data(), C.int64_t(os), C.int64_t(oh), floatPtr(lse), nil)
	})
}

// Merge folds the estimate into an output you attended yourself over the
// execution buffer (wkv_merge): out packed as in Attend and lse its
// [n_seqs][n_q_heads] natural log-sum-exps of scaled scores, both updated in
// place.
func (p *Plan) Merge(out Tensor, lse []float32) error {
	return p.merge(out, 0, 0, true, lse, 0)
}

// MergeStrided is Merge with explicit strides for out and lseSeqStride
// floats between sequences in lse (0 = packed).
func (p *Plan) MergeStrided(out Tensor, seqStride, headStride int64, lse []float32, lseSeqStride int64) error {
	return p.merge(out, seqStride, headStride, false, lse, lseSeqStride)
}

func (p *Plan) merge(out Tensor, os, oh int64, packed bool, lse []float32, lseSeqStride int64) error {
	const fn = "wkv_merge"
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.stepOut(fn, out, os, oh, packed, lse, lseSeqStride, true); err != nil {
		return err
	}
	defer p.lockStep()()
	return call(func() C.int {
		return C.wkv_merge(p.h, out.data(), C.int64_t(os), C.int64_t(oh), floatPtr(lse),
			C.int64_t(lseSeqStride), nil)
	})
}

// XbufView is the execution buffer as wkv_plan_xbuf describes it, with its
// pointers as integers: on a CUDA engine device pointers, on a CPU engine
// host memory that the plan owns until its next Lookup or Assemble.
type XbufView struct {
	NRuns   uint32  // n_seqs * n_kv_heads
	NTokens uint64  // offsets[NRuns] (CPU); a bound on it (CUDA)
	HeadDim uint32  // elements per token row
	Dtype   Dtype   // of K and V
	K, V    uintptr // [NTokens][HeadDim]
	Offsets uintptr // [NRuns + 1] int32
}

func (p *Plan) xbufView() (C.wkv_xbuf_view, error) {
	var v C.wkv_xbuf_view
	C.wkv_xbuf_view_init(&v)
	err := call(func() C.int { return C.wkv_plan_xbuf(p.h, &v) })
	return v, err
}

// XbufDevice describes the execution buffer after Assemble without copying
// it (wkv_plan_xbuf), for kernels that read device memory.
func (p *Plan) XbufDevice() (XbufView, error) {
	const fn = "wkv_plan_xbuf"
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.h == nil {
		return XbufView{}, closedError(fn, "plan")
	}
	v, err := p.xbufView()
	if err != nil {
		return XbufView{}, err
	}
	return XbufView{
		NRuns:   uint32(v.n_runs),
		NTokens: uint64(v.n_tokens),
		HeadDim: uint32(v.head_dim),
		Dtype:   Dtype(v.dtype),
		K:       uintptr(v.k),
		V:       uintptr(v.v),
		Offsets: uintptr(unsafe.Pointer(v.offsets)),
	}, nil
}

// Xbuf is a copy of the execution buffer of a CPU engine: one run of tokens
// per (sequence, KV head), run r = s*n_kv_heads + h, K and V each
// [tokens][HeadDim] (wavekv.h, wkv_xbuf_view).
type Xbuf struct {
	NRuns   int
	HeadDim int
	Offsets []int32 // run r holds tokens Offsets[r] .. Offsets[r+1]
	K, V    Tensor  // F32, F16 or BF16 as the engine's dtype
}

// Run returns the token range [lo, hi) of run r; ok is false for a run past
// the last (or offsets out of order).
func (x *Xbuf) Run(r int) (lo, hi int, ok bool) {
	if r < 0 || r+1 >= len(x.Offsets) {
		return 0, 0, false
	}
	lo, hi = int(x.Offsets[r]), int(x.Offsets[r+1])
	return lo, hi, 0 <= lo && lo <= hi
}

// Xbuf copies the execution buffer after Assemble, on a CPU engine (a CUDA
// engine refuses with ErrUnsupported: use XbufDevice).
func (p *Plan) Xbuf() (*Xbuf, error) {
	const fn = "wkv_plan_xbuf"
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.h == nil {
		return nil, closedError(fn, "plan")
	}
	if p.shape.device != DeviceCPU {
		return nil, errorf(ErrUnsupported, "%s: a copy needs a CPU engine; use XbufDevice", fn)
	}
	v, err := p.xbufView()
	if err != nil {
		return nil, err
	}
	nRuns := int(v.n_runs)
	n := int(v.n_tokens) * int(v.head_dim)
	x := &Xbuf{NRuns: nRuns, HeadDim: int(v.head_dim), Offsets: make([]int32, nRuns+1)}
	// The view's memory is the plan's (host memory on a CPU engine), valid
	// while p.mu is held: no lookup or assemble can run.
	if v.offsets != nil {
		copy(x.Offsets, unsafe.Slice((*int32)(unsafe.Pointer(v.offsets)), nRuns+1))
	}
	switch Dtype(v.dtype) {
	case DtypeF32:
		k, vv := make(F32, n), make(F32, n)
		if n > 0 {
			copy(k, unsafe.Slice((*float32)(v.k), n))
			copy(vv, unsafe.Slice((*float32)(v.v), n))
		}
		x.K, x.V = k, vv
	case DtypeF16, DtypeBF16:
		k, vv := make([]uint16, n), make([]uint16, n)
		if n > 0 {
			copy(k, unsafe.Slice((*uint16)(v.k), n))
			copy(vv, unsafe.Slice((*uint16)(v.v), n))
		}
		if Dtype(v.dtype) == DtypeF16 {
			x.K, x.V = F16(k), F16(vv)
		} else {
			x.K, x.V = BF16(k), BF16(vv)
		}
	default:
		return nil, errorf(ErrUnsupported, "%s: dtype %d is unknown to this binding", fn, uint32(v.dtype))
	}
	return x, nil
}
