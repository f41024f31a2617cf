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
*/
import "C"

import (
	"math"
	"runtime"
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

// Open opens an engine (wkv_engine_open). Close it when done.
func Open(cfg Config) (*Engine, error) {
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
