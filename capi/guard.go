package main

/*
#cgo CFLAGS: -I${SRCDIR}/../include
#include "gonixl.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/shim"
)

// Status codes, mirrored from include/gonixl.h (tests/abi_check.py keeps the
// two in step).
const (
	statusOK             int32 = C.GONIXL_OK
	statusInProgress     int32 = C.GONIXL_IN_PROGRESS
	statusInternal       int32 = C.GONIXL_ERR_INTERNAL
	statusInvalidArg     int32 = C.GONIXL_ERR_INVALID_ARGUMENT
	statusNullPointer    int32 = C.GONIXL_ERR_NULL_POINTER
	statusInvalidHandle  int32 = C.GONIXL_ERR_INVALID_HANDLE
	statusWrongHandle    int32 = C.GONIXL_ERR_WRONG_HANDLE
	statusBufferTooSmall int32 = C.GONIXL_ERR_BUFFER_TOO_SMALL
	statusPoisoned       int32 = C.GONIXL_ERR_POISONED
	statusUnavailable    int32 = C.GONIXL_ERR_UNAVAILABLE
	statusNotSupported   int32 = C.GONIXL_ERR_NOT_SUPPORTED
	statusTransfer       int32 = C.GONIXL_ERR_TRANSFER
	statusTimeout        int32 = C.GONIXL_ERR_TIMEOUT
	statusState          int32 = C.GONIXL_ERR_STATE
)

const errPrefix = "[gonixl] "

// poisoned is set once a panic was recovered; the library's state is then
// unknown and every later call fails fast.
var poisoned atomic.Bool

// callError is an error with a C status code.
type callError struct {
	status int32
	msg    string
}

func (e *callError) Error() string { return e.msg }

func errorf(status int32, format string, args ...any) error {
	return &callError{status: status, msg: fmt.Sprintf(format, args...)}
}

// statusOf maps an error to its status code, the one place that does: the
// C boundary's own argument errors (callError, handleError) carry theirs;
// shim errors carry a class (shim.ErrInvalidInput, ...); transfer-engine
// errors carry a NIXL status. Anything else is a bug: internal.
func statusOf(err error) int32 {
	var ce *callError
	if errors.As(err, &ce) {
		return ce.status
	}
	var he *handleError
	if errors.As(err, &he) {
		return he.status
	}
	switch {
	case errors.Is(err, shim.ErrInvalidInput):
		return statusInvalidArg
	case errors.Is(err, shim.ErrState):
		return statusState
	case errors.Is(err, shim.ErrNotSupported):
		return statusNotSupported
	case errors.Is(err, nixl.ErrUnavailable):
		return statusUnavailable
	}
	var ne *nixl.Error
	if errors.As(err, &ne) {
		switch ne.Status {
		case nixl.ErrInvalidParam:
			return statusInvalidArg
		case nixl.ErrNotSupported:
			return statusNotSupported
		default:
			// The engine failed to do what was asked (register,
			// connect, transfer).
			return statusTransfer
		}
	}
	return statusInternal
}

// setErr fills the caller's error struct (if any) and returns the status.
func setErr(cerr *C.gonixl_error_t, status int32, msg string) C.gonixl_status_t {
	if cerr != nil {
		cerr.code = C.int32_t(status)
		buf := unsafe.Slice((*byte)(unsafe.Pointer(&cerr.message[0])), C.GONIXL_ERROR_MESSAGE_SIZE)
		n := copy(buf[:len(buf)-1], errPrefix+msg)
		buf[n] = 0
	}
	return C.gonixl_status_t(status)
}

// finish turns a Go error into the C return value.
func finish(cerr *C.gonixl_error_t, err error) C.gonixl_status_t {
	if err == nil {
		if cerr != nil {
			cerr.code = 0
			cerr.message[0] = 0
		}
		return C.GONIXL_OK
	}
	return setErr(cerr, statusOf(err), err.Error())
}

// guard runs fn with the panic guard: a poisoned library refuses, and a
// panic poisons it and becomes GONIXL_ERR_INTERNAL. Every export goes
// through guard.
func guard(cerr *C.gonixl_error_t, fn func() error) (ret C.gonixl_status_t) {
	if poisoned.Load() {
		return setErr(cerr, statusPoisoned, "library is poisoned by an earlier internal error (Go panic); restart the process")
	}
	t0 := time.Now()
	defer func() {
		// From the moment the call runs Go code: a caller that measured
		// more waited outside it (for a P, for the GIL).
		if d := time.Since(t0); d >= shim.SlowCallWarn() {
			call := "?"
			if pc, _, _, ok := runtime.Caller(2); ok {
				if f := runtime.FuncForPC(pc); f != nil {
					call = f.Name()
				}
			}
			shim.LogSlowCall(call, d)
		}
	}()
	defer func() {
		if r := recover(); r != nil {
			if poisoned.CompareAndSwap(false, true) {
				fmt.Fprintf(os.Stderr, "%sGo panic, library poisoned: %v\n%s", errPrefix, r, debug.Stack())
			}
			ret = setErr(cerr, statusInternal, fmt.Sprintf("Go panic: %v (library poisoned)", r))
		}
	}()
	return finish(cerr, fn())
}

// writeOut copies data into a caller buffer with size negotiation.
func writeOut(buf *C.char, lenp *C.size_t, data []byte) error {
	if lenp == nil {
		return errorf(statusNullPointer, "len pointer is NULL")
	}
	need := C.size_t(len(data))
	if buf == nil || *lenp < need {
		have := *lenp
		*lenp = need
		if buf == nil {
			return errorf(statusBufferTooSmall, "buffer is NULL; %d bytes needed", len(data))
		}
		return errorf(statusBufferTooSmall, "buffer of %d bytes is too small; %d bytes needed", have, len(data))
	}
	copy(unsafe.Slice((*byte)(unsafe.Pointer(buf)), len(data)), data)
	*lenp = need
	return nil
}

// readIn copies caller bytes into Go memory. A NULL pointer with length 0
// is an empty input.
func readIn(p *C.char, n C.size_t, what string) ([]byte, error) {
	if n == 0 {
		return []byte{}, nil
	}
	if p == nil {
		return nil, errorf(statusNullPointer, "%s is NULL but its length is %d", what, n)
	}
	if n > 1<<30 {
		return nil, errorf(statusInvalidArg, "%s length %d is larger than 1 GiB", what, n)
	}
	return C.GoBytes(unsafe.Pointer(p), C.int(n)), nil
}

// readString copies a (pointer, length) UTF-8 string.
func readString(p *C.char, n C.size_t, what string) (string, error) {
	b, err := readIn(p, n, what)
	if err != nil {
		return "", err
	}
	return string(b), nil
}

// maxArray bounds caller-provided array lengths.
const maxArray = 1 << 28

// readInt64s copies a caller int64 array.
func readInt64s(p *C.int64_t, n C.int64_t, what string) ([]int64, error) {
	if n < 0 || n > maxArray {
		return nil, errorf(statusInvalidArg, "%s length %d out of range", what, n)
	}
	if n == 0 {
		return nil, nil
	}
	if p == nil {
		return nil, errorf(statusNullPointer, "%s is NULL but its length is %d", what, n)
	}
	src := unsafe.Slice((*int64)(unsafe.Pointer(p)), int(n))
	return append([]int64(nil), src...), nil
}
