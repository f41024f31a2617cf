// Package wavekv is a cgo binding of libwavekv, a KV-cache storage engine
// for long-context LLM inference. The C header include/wavekv/wavekv.h is
// the manual; this package maps it as follows.
//
//   - Engine, Sequence and Plan own one handle each and release it in Close,
//     which is idempotent. After Close every method returns an *Error with
//     status ErrInvalidHandle that also matches ErrClosed under errors.Is.
//     Ownership never depends on finalizers: a finalizer only releases a
//     handle that was never closed, as a safety net against leaks.
//   - Sequences and plans keep working after their engine is closed (the
//     header says so), so closing them is independent of the engine.
//   - Failures are *Error values carrying the Status and the library's
//     message; errors.Is(err, wavekv.ErrOutOfRange) tests the status.
//   - Tensors are Go slices in the engine's dtype: F32 ([]float32), F16 and
//     BF16 ([]uint16 holding the bits). Their lengths are checked against
//     the shape and strides (in elements) before the library is called; the
//     library reads or writes them only during the call.
//   - Threads: an Engine may be used from any number of goroutines. A
//     Sequence or a Plan serialises its own calls with a mutex, and a plan's
//     calls lock the sequences of its step, so the header's rule (each
//     sequence and plan used by one thread at a time) holds without care
//     from the caller.
//   - AppendBatch appends to several sequences in one call, locking them
//     as a plan's calls do.
//   - CUDA engines take device pointers and streams as uintptr
//     (AppendDevice, AppendBatchDevice, DecodeDevice); a CPU engine refuses
//     those calls.
package wavekv

/*
#cgo CFLAGS: -I${SRCDIR}/../../include
#cgo LDFLAGS: -lwavekv
#include <wavekv/wavekv.h>
*/
import "C"

import (
	"runtime"
)

// Version returns the run-time library's version.
func Version() (major, minor, patch int) {
	v := int(C.wkv_version())
	return v / 10000, v / 100 % 100, v % 100
}

// VersionString returns the run-time library's version as
// "major.minor.patch".
func VersionString() string {
	return C.GoString(C.wkv_version_string())
}

// call runs one library call and turns its status into an error. The
// message is per OS thread, so the goroutine stays on its thread from the
// call until the message is copied.
func call(f func() C.int) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if rc := f(); rc != C.WKV_OK {
		return &Error{Status: Status(rc), Message: C.GoString(C.wkv_last_error())}
	}
	return nil
}
