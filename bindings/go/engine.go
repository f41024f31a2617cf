package wavekv

/*
#include <stdint.h>
#include <stdlib.h>
#include <wavekv/wavekv.h>

// Device pointers and streams cross as integers: they are not Go pointers.
static int wkvgo_seq_append_device(wkv_seq *seq, uint32_t layer, uintptr_t k, uintptr_t v,
                                   uint32_t n_tokens, int64_t token_stride, int64_t head_stride,
                                   uintptr_t stream) {
  return wkv_seq_append(seq, layer, (const void *)k, (const void *)v, n_tokens, token_stride,
                        head_stride, (void *)stream);
}

static int wkvgo_append_batch_device(wkv_seq *const *seqs, uint32_t n_seqs, uint32_t layer,
                                     uintptr_t k, uintptr_t v, uint32_t n_tokens,
                                     int64_t seq_stride, int64_t token_stride,
                                     int64_t head_stride, uintptr_t stream) {
  return wkv_append_batch(seqs, n_seqs, layer, (const void *)k, (const void *)v, n_tokens,
                          seq_stride, token_stride, head_stride, (void *)stream);
}
*/
import "C"

import (
	"fmt"
	"math"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"
)

// Engine is an open engine (wkv_engine). Its methods may be called from any
// number of goroutines at once; Close waits for calls in progress.
type Engine struct {
	mu    sync.RWMutex
	h     *C.wkv_engine
	shape shape
}

// Open opens an engine (wkv_engine_open). Close it when done. A PageFormat
// other than PageFormatStorage needs libwavekv 0.10 or later
// (PageFormatInt8Centered: 0.11): an older one gives ErrUnsupported.
func Open(cfg Config) (*Engine, error) {
	// The minor version that brought the page format: an older library's
	// reserved0 (or its check of the value) would refuse it, naming a field
	// or value the caller may not know.
	since := 0
	switch cfg.PageFormat {
	case PageFormatStorage:
	case PageFormatInt8:
		since = 10
	default:
		since = 11
	}
	if major, minor, _ := Version(); major == 0 && minor < since {
		return nil, errorf(ErrUnsupported, "wkv_engine_open: page_format %v needs libwavekv 0.%d or later; the one loaded is %s",
			cfg.PageFormat, since, VersionString())
	}
	c := cfg.toC()
	if cfg.SpillDir != "" {
		p, err := cPath("wkv_engine_open", cfg.SpillDir)
		if err != nil {
			return nil, err
		}
		defer C.free(unsafe.Pointer(p)) // the engine keeps a copy
		c.spill_dir = p
	}
	var h *C.wkv_engine
	if err := call(func() C.int { return C.wkv_engine_open(&c, &h) }); err != nil {
		return nil, err
	}
	// The effective configuration (an environment variable may have changed
	// a field) gives the shape that tensors are checked against.
	var eff C.wkv_config
	eff.size = C.uint32_t(unsafe.Sizeof(eff))
	var device C.uint32_t
	err := call(func() C.int { return C.wkv_engine_config(h, &eff) })
	if err == nil {
		err = call(func() C.int { return C.wkv_engine_device(h, &device) })
	}
	if err != nil {
		C.wkv_engine_close(h)
		return nil, err
	}
	e := &Engine{h: h, shape: shape{
		nLayers:  uint32(eff.n_layers),
		nQHeads:  uint32(eff.n_q_heads),
		nKVHeads: uint32(eff.n_kv_heads),
		headDim:  uint32(eff.head_dim),
		dtype:    Dtype(eff.dtype),
		device:   Device(device),
	}}
	runtime.SetFinalizer(e, (*Engine).Close)
	return e, nil
}

// Close closes the engine handle (wkv_engine_close). Sequences and plans
// made from it keep working until closed themselves. Closing again is a
// no-op; it always returns nil.
func (e *Engine) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.h != nil {
		C.wkv_engine_close(e.h)
		e.h = nil
		runtime.SetFinalizer(e, nil)
	}
	return nil
}

// Device returns where the engine runs.
func (e *Engine) Device() Device { return e.shape.device }

// Dtype returns the engine's storage dtype, the type of the tensors passed.
func (e *Engine) Dtype() Dtype { return e.shape.dtype }

// NLayers returns the model's layers.
func (e *Engine) NLayers() uint32 { return e.shape.nLayers }

// NQHeads returns the query heads.
func (e *Engine) NQHeads() uint32 { return e.shape.nQHeads }

// NKVHeads returns the KV heads.
func (e *Engine) NKVHeads() uint32 { return e.shape.nKVHeads }

// HeadDim returns the elements per head.
func (e *Engine) HeadDim() uint32 { return e.shape.headDim }

// Config returns the effective configuration, defaults and environment
// resolved (wkv_engine_config).
func (e *Engine) Config() (Config, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.h == nil {
		return Config{}, closedError("wkv_engine_config", "engine")
	}
	var c C.wkv_config
	c.size = C.uint32_t(unsafe.Sizeof(c))
	if err := call(func() C.int { return C.wkv_engine_config(e.h, &c) }); err != nil {
		return Config{}, err
	}
	return configFromC(&c), nil
}

// Stats returns the engine's statistics (wkv_engine_stats).
func (e *Engine) Stats() (Stats, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.h == nil {
		return Stats{}, closedError("wkv_engine_stats", "engine")
	}
	var s C.wkv_stats
	C.wkv_stats_init(&s)
	if err := call(func() C.int { return C.wkv_engine_stats(e.h, &s) }); err != nil {
		return Stats{}, err
	}
	return statsFromC(&s), nil
}

// StatsJSON returns the configuration and statistics as one JSON object
// (wkv_engine_stats_json).
func (e *Engine) StatsJSON() (string, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.h == nil {
		return "", closedError("wkv_engine_stats_json", "engine")
	}
	var p *C.char
	if err := call(func() C.int { return C.wkv_engine_stats_json(e.h, &p) }); err != nil {
		return "", err
	}
	s := C.GoString(p)
	C.wkv_free(unsafe.Pointer(p))
	return s, nil
}

var lastSeqID uint64

// NewSequence creates an empty sequence (wkv_seq_create). Close it when
// done.
func (e *Engine) NewSequence() (*Sequence, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.h == nil {
		return nil, closedError("wkv_seq_create", "engine")
	}
	var h *C.wkv_seq
	if err := call(func() C.int { return C.wkv_seq_create(e.h, &h) }); err != nil {
		return nil, err
	}
	return e.adopt(h), nil
}

// adopt wraps a sequence handle the library just made for this engine. The
// finalizer only releases one that is never closed (a safety net).
func (e *Engine) adopt(h *C.wkv_seq) *Sequence {
	s := &Sequence{h: h, id: atomic.AddUint64(&lastSeqID, 1), shape: e.shape}
	runtime.SetFinalizer(s, (*Sequence).Close)
	return s
}

// cPath copies a path into C memory, to be released with C.free. A NUL
// inside would cut the path short in C, so that a different file would be
// opened: refused with ErrInvalidArgument instead.
func cPath(fn, path string) (*C.char, error) {
	if i := strings.IndexByte(path, 0); i >= 0 {
		return nil, errorf(ErrInvalidArgument, "%s: the path %q has a NUL byte at %d", fn, path, i)
	}
	return C.CString(path), nil
}

// Load loads a sequence from a file that Sequence.Save wrote (wkv_seq_load),
// as a new sequence of this engine; close it when done. All or nothing:
// after a failure the engine holds nothing of the file. Errors: ErrCorrupt
// for a damaged or truncated file (the message names the section),
// ErrInvalidArgument for a file whose shape or layout differs from the
// engine's (the message names each difference) or a path with a NUL byte,
// ErrIO for a file that cannot be opened or read, ErrUnsupported for a
// newer format version.
func (e *Engine) Load(path string) (*Sequence, error) {
	const fn = "wkv_seq_load"
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.h == nil {
		return nil, closedError(fn, "engine")
	}
	p, err := cPath(fn, path)
	if err != nil {
		return nil, err
	}
	defer C.free(unsafe.Pointer(p))
	var h *C.wkv_seq
	if err := call(func() C.int { return C.wkv_seq_load(e.h, p, &h) }); err != nil {
		return nil, err
	}
	return e.adopt(h), nil
}

// NewPlan creates a plan, the reusable state of decoding steps
// (wkv_plan_create). Close it when done.
func (e *Engine) NewPlan() (*Plan, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.h == nil {
		return nil, closedError("wkv_plan_create", "engine")
	}
	var h *C.wkv_plan
	if err := call(func() C.int { return C.wkv_plan_create(e.h, &h) }); err != nil {
		return nil, err
	}
	p := &Plan{h: h, shape: e.shape}
	runtime.SetFinalizer(p, (*Plan).Close)
	return p, nil
}

// Sequence is one sequence's KV cache (wkv_seq). Its calls are serialised,
// so it may be shared between goroutines.
type Sequence struct {
	mu    sync.Mutex
	h     *C.wkv_seq
	id    uint64 // the order in which plans lock sequences
	shape shape
}

// Close destroys the sequence (wkv_seq_destroy). A plan that still refers to
// it keeps its data alive until the plan's next lookup. Closing again is a
// no-op; it always returns nil.
func (s *Sequence) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.h != nil {
		C.wkv_seq_destroy(s.h)
		s.h = nil
		runtime.SetFinalizer(s, nil)
	}
	return nil
}

// Append appends tokens' keys and values to one layer (wkv_seq_append): k
// and v are packed [n_tokens][n_kv_heads][head_dim], and n_tokens is their
// length over n_kv_heads * head_dim.
func (s *Sequence) Append(layer uint32, k, v Tensor) error {
	const fn = "wkv_seq_append"
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.h == nil {
		return closedError(fn, "sequence")
	}
	if err := checkTensor(fn, "k", k, &s.shape); err != nil {
		return err
	}
	if err := checkTensor(fn, "v", v, &s.shape); err != nil {
		return err
	}
	row := uint64(s.shape.nKVHeads) * uint64(s.shape.headDim)
	n := uint64(k.elems())
	if n == 0 || n%row != 0 {
		return errorf(ErrInvalidArgument,
			"%s: k has %d elements, not a positive multiple of a token's n_kv_heads x head_dim (%d elements)",
			fn, n, row)
	}
	if uint64(v.elems()) != n {
		return errorf(ErrInvalidArgument, "%s: v has %d elements, k has %d", fn, v.elems(), n)
	}
	if n/row > math.MaxUint32 {
		return errorf(ErrInvalidArgument, "%s: %d tokens in one call", fn, n/row)
	}
	return call(func() C.int {
		return C.wkv_seq_append(s.h, C.uint32_t(layer), k.data(), v.data(), C.uint32_t(n/row), 0, 0, nil)
	})
}

// AppendStrided appends nTokens tokens from [nTokens][n_kv_heads][head_dim]
// tensors with explicit strides in elements (0 = packed).
func (s *Sequence) AppendStrided(layer uint32, k, v Tensor, nTokens uint32, tokenStride, headStride int64) error {
	const fn = "wkv_seq_append"
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.h == nil {
		return closedError(fn, "sequence")
	}
	kv, d := uint64(s.shape.nKVHeads), uint64(s.shape.headDim)
	for _, t := range []struct {
		name string
		t    Tensor
	}{{"k", k}, {"v", v}} {
		if err := checkTensor(fn, t.name, t.t, &s.shape); err != nil {
			return err
		}
		if err := checkSpan(fn, t.name, t.t.elems(), uint64(nTokens), kv, d, tokenStride, headStride); err != nil {
			return err
		}
	}
	return call(func() C.int {
		return C.wkv_seq_append(s.h, C.uint32_t(layer), k.data(), v.data(), C.uint32_t(nTokens),
			C.int64_t(tokenStride), C.int64_t(headStride), nil)
	})
}

// AppendDevice is wkv_seq_append for CUDA engines: k and v are device
// pointers, stream a cudaStream_t (0: the default stream). The memory must
// stay valid until the copy on the stream completes. A CPU engine refuses
// the call with ErrInvalidArgument.
func (s *Sequence) AppendDevice(layer uint32, k, v uintptr, nTokens uint32, tokenStride, headStride int64, stream uintptr) error {
	const fn = "wkv_seq_append"
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.h == nil {
		return closedError(fn, "sequence")
	}
	if s.shape.device != DeviceCUDA {
		return errorf(ErrInvalidArgument, "%s: device pointers need a CUDA engine; this one runs on the %s",
			fn, s.shape.device)
	}
	return call(func() C.int {
		return C.wkvgo_seq_append_device(s.h, C.uint32_t(layer), C.uintptr_t(k), C.uintptr_t(v),
			C.uint32_t(nTokens), C.int64_t(tokenStride), C.int64_t(headStride), C.uintptr_t(stream))
	})
}

// seqBatch locks the sequences of one call that takes several: in id
// order, the one order every caller uses, so that two calls never wait on
// each other. Its slices are reused from call to call.
type seqBatch struct {
	locked  []*Sequence  // the batch in lock order
	handles []*C.wkv_seq // the handles in the caller's order
}

// lock checks the sequences (none nil, none listed twice, none closed),
// locks them and fills b.handles; on success unlock releases them.
func (b *seqBatch) lock(fn string, seqs []*Sequence) (unlock func(), err error) {
	b.locked = append(b.locked[:0], seqs...)
	for i, s := range b.locked {
		if s == nil {
			return nil, errorf(ErrInvalidHandle, "%s: sequence %d of the batch is nil", fn, i)
		}
	}
	sort.Slice(b.locked, func(i, j int) bool { return b.locked[i].id < b.locked[j].id })
	for i := 1; i < len(b.locked); i++ {
		if b.locked[i] == b.locked[i-1] {
			return nil, errorf(ErrInvalidArgument, "%s: a sequence is listed twice", fn)
		}
	}
	for _, s := range b.locked {
		s.mu.Lock()
	}
	locked := b.locked
	unlock = func() {
		for _, s := range locked {
			s.mu.Unlock()
		}
	}
	b.handles = b.handles[:0]
	for i, s := range seqs {
		if s.h == nil {
			unlock()
			return nil, &Error{Status: ErrInvalidHandle, closed: true,
				Message: fmt.Sprintf("%s: sequence %d of the batch is closed", fn, i)}
		}
		b.handles = append(b.handles, s.h)
	}
	return unlock, nil
}

func (b *seqBatch) ptr() **C.wkv_seq {
	if len(b.handles) == 0 {
		return nil
	}
	return &b.handles[0]
}

// The scratch of AppendBatch calls, so that steady decoding does not
// allocate.
var seqBatches = sync.Pool{New: func() interface{} { return new(seqBatch) }}

// AppendBatch appends tokens to one layer of each of several sequences of
// one engine in one call (wkv_append_batch, ABI 0.5): k and v are packed
// [len(seqs)][n_tokens][n_kv_heads][head_dim] (the decoding layout, new K of
// shape [batch][n_kv_heads][head_dim], is one token), and n_tokens is their
// length over len(seqs) * n_kv_heads * head_dim. Each sequence gets what
// Append would give it. The sequences are locked for the call.
//
// A sequence listed twice is refused with ErrInvalidArgument, sequences of
// two engines with ErrInvalidHandle. An error found before the copy appends
// nothing to any sequence; an error in the growth of sequence i (ErrBudget,
// ErrOutOfMemory; the message names i) leaves the sequences before i with
// their new tokens and i and those after it without (wavekv.h).
func AppendBatch(seqs []*Sequence, layer uint32, k, v Tensor) error {
	const fn = "wkv_append_batch"
	sh, err := batchShape(fn, seqs)
	if err != nil {
		return err
	}
	if err := checkTensor(fn, "k", k, sh); err != nil {
		return err
	}
	if err := checkTensor(fn, "v", v, sh); err != nil {
		return err
	}
	row := uint64(len(seqs)) * uint64(sh.nKVHeads) * uint64(sh.headDim)
	n := uint64(k.elems())
	if n == 0 || n%row != 0 {
		return errorf(ErrInvalidArgument,
			"%s: k has %d elements, not a positive multiple of n_seqs x n_kv_heads x head_dim (%d elements)",
			fn, n, row)
	}
	if uint64(v.elems()) != n {
		return errorf(ErrInvalidArgument, "%s: v has %d elements, k has %d", fn, v.elems(), n)
	}
	if n/row > math.MaxUint32 {
		return errorf(ErrInvalidArgument, "%s: %d tokens in one call", fn, n/row)
	}
	return appendBatch(fn, seqs, func(b *seqBatch) C.int {
		return C.wkv_append_batch(b.ptr(), C.uint32_t(len(seqs)), C.uint32_t(layer), k.data(), v.data(),
			C.uint32_t(n/row), 0, 0, 0, nil)
	})
}

// AppendBatchStrided is AppendBatch of nTokens tokens with explicit strides
// in elements: sequence i's [nTokens][n_kv_heads][head_dim] begins
// i * seqStride elements into k and v (0: one after another, packed; any
// other value is fine, sequences interleaved by token for instance), with
// tokenStride and headStride as in AppendStrided (0 = packed).
func AppendBatchStrided(seqs []*Sequence, layer uint32, k, v Tensor, nTokens uint32,
	seqStride, tokenStride, headStride int64) error {
	const fn = "wkv_append_batch"
	sh, err := batchShape(fn, seqs)
	if err != nil {
		return err
	}
	kv, d := uint64(sh.nKVHeads), uint64(sh.headDim)
	for _, t := range []struct {
		name string
		t    Tensor
	}{{"k", k}, {"v", v}} {
		if err := checkTensor(fn, t.name, t.t, sh); err != nil {
			return err
		}
		if err := checkBatchSpan(fn, t.name, t.t.elems(), uint64(len(seqs)), uint64(nTokens), kv, d,
			seqStride, tokenStride, headStride); err != nil {
			return err
		}
	}
	return appendBatch(fn, seqs, func(b *seqBatch) C.int {
		return C.wkv_append_batch(b.ptr(), C.uint32_t(len(seqs)), C.uint32_t(layer), k.data(), v.data(),
			C.uint32_t(nTokens), C.int64_t(seqStride), C.int64_t(tokenStride), C.int64_t(headStride), nil)
	})
}

// AppendBatchDevice is wkv_append_batch for CUDA engines: k and v are device
// pointers, stream a cudaStream_t (0: the default stream), strides as in
// AppendBatchStrided; one kernel writes every sequence's rows. The memory
// must stay valid until the copy on the stream completes. A CPU engine
// refuses the call with ErrInvalidArgument.
func AppendBatchDevice(seqs []*Sequence, layer uint32, k, v uintptr, nTokens uint32,
	seqStride, tokenStride, headStride int64, stream uintptr) error {
	const fn = "wkv_append_batch"
	sh, err := batchShape(fn, seqs)
	if err != nil {
		return err
	}
	if sh.device != DeviceCUDA {
		return errorf(ErrInvalidArgument, "%s: device pointers need a CUDA engine; this one runs on the %s",
			fn, sh.device)
	}
	return appendBatch(fn, seqs, func(b *seqBatch) C.int {
		return C.wkvgo_append_batch_device(b.ptr(), C.uint32_t(len(seqs)), C.uint32_t(layer),
			C.uintptr_t(k), C.uintptr_t(v), C.uint32_t(nTokens), C.int64_t(seqStride),
			C.int64_t(tokenStride), C.int64_t(headStride), C.uintptr_t(stream))
	})
}

// batchShape is the shape a batch's tensors are checked against: its first
// sequence's (the library refuses sequences of two engines before it reads
// k or v). An empty batch, or one too large for the ABI, is refused.
func batchShape(fn string, seqs []*Sequence) (*shape, error) {
	if len(seqs) == 0 {
		return nil, errorf(ErrInvalidArgument, "%s: n_seqs is 0", fn)
	}
	if len(seqs) > math.MaxUint32 {
		return nil, errorf(ErrInvalidArgument, "%s: %d sequences", fn, len(seqs))
	}
	if seqs[0] == nil {
		return nil, errorf(ErrInvalidHandle, "%s: sequence 0 of the batch is nil", fn)
	}
	return &seqs[0].shape, nil
}

// appendBatch locks the batch and runs f on its handles.
func appendBatch(fn string, seqs []*Sequence, f func(b *seqBatch) C.int) error {
	b := seqBatches.Get().(*seqBatch)
	defer seqBatches.Put(b)
	unlock, err := b.lock(fn, seqs)
	if err != nil {
		return err
	}
	defer unlock()
	return call(func() C.int { return f(b) })
}

// EndPrompt ends the prompt of one layer now, so that its index is built
// with the prefill (wkv_seq_end_prompt, on the default stream).
func (s *Sequence) EndPrompt(layer uint32) error {
	const fn = "wkv_seq_end_prompt"
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.h == nil {
		return closedError(fn, "sequence")
	}
	return call(func() C.int { return C.wkv_seq_end_prompt(s.h, C.uint32_t(layer), nil) })
}

// Evict writes the sequence's pages to the engine's spill file and gives
// their host memory back (wkv_seq_evict; needs Config.SpillDir). Its next
// use, or Restore, reads them back, checking every checksum.
func (s *Sequence) Evict() error {
	const fn = "wkv_seq_evict"
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.h == nil {
		return closedError(fn, "sequence")
	}
	return call(func() C.int { return C.wkv_seq_evict(s.h) })
}

// Restore reads an evicted sequence's pages back (wkv_seq_restore); a
// sequence in memory is left as it is.
func (s *Sequence) Restore() error {
	const fn = "wkv_seq_restore"
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.h == nil {
		return closedError(fn, "sequence")
	}
	return call(func() C.int { return C.wkv_seq_restore(s.h) })
}

// Save saves the sequence to the file at path (wkv_seq_save), whole or not
// at all: it is written under a temporary name in the same directory,
// fsynced, renamed over path, and the directory fsynced. fsync false skips
// the fsyncs (WKV_SAVE_NO_FSYNC; tests, benchmarks): other processes still
// see the old file or the whole new one, but after a power loss the new one
// may be refused as corrupt. Engine.Load reads it back. Errors: ErrIO with
// the system's words (path is then untouched), ErrInvalidArgument for a path
// ending in '/' or holding a NUL byte.
func (s *Sequence) Save(path string, fsync bool) error {
	const fn = "wkv_seq_save"
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.h == nil {
		return closedError(fn, "sequence")
	}
	p, err := cPath(fn, path)
	if err != nil {
		return err
	}
	defer C.free(unsafe.Pointer(p))
	var flags C.uint32_t
	if !fsync {
		flags = C.WKV_SAVE_NO_FSYNC
	}
	return call(func() C.int { return C.wkv_seq_save(s.h, p, flags) })
}

// Info describes one layer of the sequence (wkv_seq_info_get).
func (s *Sequence) Info(layer uint32) (SeqInfo, error) {
	const fn = "wkv_seq_info_get"
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.h == nil {
		return SeqInfo{}, closedError(fn, "sequence")
	}
	var info C.wkv_seq_info
	C.wkv_seq_info_init(&info)
	if err := call(func() C.int { return C.wkv_seq_info_get(s.h, C.uint32_t(layer), &info) }); err != nil {
		return SeqInfo{}, err
	}
	return seqInfoFromC(&info), nil
}
