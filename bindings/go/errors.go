package wavekv

/*
#include <wavekv/wavekv.h>
*/
import "C"

import (
	"errors"
	"fmt"
)

// Status is a library status code (WKV_ERR_*). Each value is also an error,
// so that errors.Is(err, wavekv.ErrBudget) tests the status of any error
// this package returns.
type Status int32

// The status values of wavekv.h, never renumbered.
const (
	ErrInvalidArgument Status = C.WKV_ERR_INVALID_ARGUMENT // a nil tensor, zero size, bad stride, bad value
	ErrInvalidHandle   Status = C.WKV_ERR_INVALID_HANDLE   // a closed, destroyed or foreign handle
	ErrOutOfRange      Status = C.WKV_ERR_OUT_OF_RANGE     // an index (layer, head, token) past its bound
	ErrUnsupported     Status = C.WKV_ERR_UNSUPPORTED      // a head_dim, dtype or device this build cannot serve
	ErrBudget          Status = C.WKV_ERR_BUDGET           // the configured byte budget would be exceeded
	ErrOutOfMemory     Status = C.WKV_ERR_OUT_OF_MEMORY    // the host or device allocator failed
	ErrDevice          Status = C.WKV_ERR_DEVICE           // the GPU runtime reported an error
	ErrIO              Status = C.WKV_ERR_IO               // a file read or write failed
	ErrCorrupt         Status = C.WKV_ERR_CORRUPT          // a file failed its checksum or structure checks
	ErrState           Status = C.WKV_ERR_STATE            // a call out of order (attend before assemble, ...)
	ErrInternal        Status = C.WKV_ERR_INTERNAL         // a bug in wavekv
	ErrNoDevice        Status = C.WKV_ERR_NO_DEVICE        // a CUDA engine was asked for and no GPU is usable
)

// String returns the C name of the status ("WKV_ERR_BUDGET"), as
// wkv_status_name gives it.
func (s Status) String() string {
	name := C.GoString(C.wkv_status_name(C.int(s)))
	if name == "WKV_ERR_UNKNOWN" {
		return fmt.Sprintf("WKV_ERR_UNKNOWN(%d)", int32(s))
	}
	return name
}

// Error makes a Status an error: the sentinel errors.Is compares with.
func (s Status) Error() string { return s.String() }

// ErrClosed matches, under errors.Is, the error of a call on a closed
// Engine, Sequence or Plan (whose status is ErrInvalidHandle).
var ErrClosed = errors.New("wavekv: use of a closed handle")

// Error is a failed call: its status and the message in words, from the
// library (wkv_last_error, copied at once) or from this package's checks.
type Error struct {
	Status  Status
	Message string
	closed  bool
}

func (e *Error) Error() string { return e.Status.String() + ": " + e.Message }

// Unwrap returns the status, so that errors.Is(err, ErrOutOfRange) works.
func (e *Error) Unwrap() error { return e.Status }

// Is reports whether the error is the use of a closed handle, for ErrClosed.
func (e *Error) Is(target error) bool { return target == ErrClosed && e.closed }

func errorf(s Status, format string, args ...interface{}) error {
	return &Error{Status: s, Message: fmt.Sprintf(format, args...)}
}

func closedError(fn, what string) error {
	return &Error{Status: ErrInvalidHandle, Message: fn + ": the " + what + " is closed", closed: true}
}
