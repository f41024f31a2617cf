package wavekv

import (
	"math/bits"
	"unsafe"
)

// Tensor is a host tensor in an engine's dtype: F32, F16 or BF16. Its
// layout (shape and strides) is given by the call it is passed to. The
// library reads or writes it only during that call.
type Tensor interface {
	dtype() Dtype
	elems() int
	data() unsafe.Pointer
}

// F32 is a tensor of an engine of dtype DtypeF32.
type F32 []float32

// F16 is a tensor of an engine of dtype DtypeF16: IEEE half values as bits.
type F16 []uint16

// BF16 is a tensor of an engine of dtype DtypeBF16: bfloat16 values as bits.
type BF16 []uint16

func (t F32) dtype() Dtype  { return DtypeF32 }
func (t F16) dtype() Dtype  { return DtypeF16 }
func (t BF16) dtype() Dtype { return DtypeBF16 }
func (t F32) elems() int    { return len(t) }
func (t F16) elems() int    { return len(t) }
func (t BF16) elems() int   { return len(t) }

func (t F32) data() unsafe.Pointer {
	if len(t) == 0 {
		return nil
	}
	return unsafe.Pointer(&t[0])
}

func (t F16) data() unsafe.Pointer {
	if len(t) == 0 {
		return nil
	}
	return unsafe.Pointer(&t[0])
}

func (t BF16) data() unsafe.Pointer {
	if len(t) == 0 {
		return nil
	}
	return unsafe.Pointer(&t[0])
}

// shape is what every length check needs, copied from the engine into its
// sequences and plans, which outlive it.
type shape struct {
	nLayers, nQHeads, nKVHeads, headDim uint32
	dtype                               Dtype
	device                              Device
}

func checkTensor(fn, what string, t Tensor, sh *shape) error {
	if t == nil {
		return errorf(ErrInvalidArgument, "%s: %s is nil", fn, what)
	}
	if t.dtype() != sh.dtype {
		return errorf(ErrInvalidArgument, "%s: %s holds %s elements but the engine's dtype is %s",
			fn, what, t.dtype(), sh.dtype)
	}
	return nil
}

// overflowMath is uint64 arithmetic that remembers whether any step
// overflowed.
type overflowMath struct{ overflow bool }

func (m *overflowMath) mul(a, b uint64) uint64 {
	hi, lo := bits.Mul64(a, b)
	m.overflow = m.overflow || hi != 0
	return lo
}

func (m *overflowMath) add(a, b uint64) uint64 {
	s, c := bits.Add64(a, b, 0)
	m.overflow = m.overflow || c != 0
	return s
}

// extent is the number of elements an [nOuter][nInner][d] layout with these
// non-negative strides (0 = packed) reaches, from its first element to the
// end of its last row.
func (m *overflowMath) extent(nOuter, nInner, d uint64, outer, inner int64) uint64 {
	in, out := uint64(inner), uint64(outer)
	if in == 0 {
		in = d
	}
	if out == 0 {
		out = m.mul(nInner, in)
	}
	if nOuter == 0 || nInner == 0 {
		return 0
	}
	return m.add(m.add(m.mul(nOuter-1, out), m.mul(nInner-1, in)), d)
}

// checkSpan checks that a tensor of n elements holds every row of an
// [nOuter][nInner][d] layout with these strides (0 = packed), so that the
// library never reads or writes past it. Negative strides are refused here
// (the library refuses them too); overlapping rows stay inside the slice and
// are left to the library, which refuses them.
func checkSpan(fn, what string, n int, nOuter, nInner, d uint64, outer, inner int64) error {
	if outer < 0 || inner < 0 {
		return errorf(ErrInvalidArgument, "%s: %s strides (%d, %d elements) must not be negative",
			fn, what, outer, inner)
	}
	var m overflowMath
	need := m.extent(nOuter, nInner, d, outer, inner)
	if m.overflow || uint64(n) < need {
		return errorf(ErrInvalidArgument,
			"%s: %s has %d elements, fewer than [%d][%d][%d] with strides (%d, %d) spans",
			fn, what, n, nOuter, nInner, d, outer, inner)
	}
	return nil
}

// checkBatchSpan is checkSpan for a batch: nSeqs tensors [nOuter][nInner][d]
// with these strides, sequence i's beginning i * seqStride elements in (0:
// one sequence's extent, the sequences one after another, as the library
// reads it). Any other seqStride is fine, one smaller than a sequence's rows
// too (sequences interleaved by token): the tensors are only read.
func checkBatchSpan(fn, what string, n int, nSeqs, nOuter, nInner, d uint64, seqStride, outer, inner int64) error {
	if seqStride < 0 || outer < 0 || inner < 0 {
		return errorf(ErrInvalidArgument, "%s: %s strides (%d, %d, %d elements) must not be negative",
			fn, what, seqStride, outer, inner)
	}
	var m overflowMath
	one := m.extent(nOuter, nInner, d, outer, inner)
	between := uint64(seqStride)
	if between == 0 {
		between = one
	}
	var need uint64
	if nSeqs > 0 && one > 0 {
		need = m.add(m.mul(nSeqs-1, between), one)
	}
	if m.overflow || uint64(n) < need {
		return errorf(ErrInvalidArgument,
			"%s: %s has %d elements, fewer than [%d][%d][%d][%d] with strides (%d, %d, %d) spans",
			fn, what, n, nSeqs, nOuter, nInner, d, seqStride, outer, inner)
	}
	return nil
}

// checkLen checks a packed tensor's length against an exact count.
func checkLen(fn, what string, n int, want uint64, layout string) error {
	if uint64(n) != want {
		return errorf(ErrInvalidArgument, "%s: %s has %d elements, not the %d of %s", fn, what, n, want, layout)
	}
	return nil
}
