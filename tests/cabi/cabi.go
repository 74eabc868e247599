package cabi

/*
#cgo CFLAGS: -I${SRCDIR}/../../include
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include "gonixl.h"

typedef uint32_t (*abi_fn)(void);
typedef gonixl_status_t (*bytes_fn)(char *, size_t *, gonixl_error_t *);
typedef gonixl_status_t (*new_fn)(char *, size_t, uint64_t *, gonixl_error_t *);
typedef gonixl_status_t (*close_fn)(uint64_t, gonixl_error_t *);
typedef gonixl_status_t (*err_fn)(gonixl_error_t *);

static void *h_open(const char *path, char **msg) {
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) *msg = strdup(dlerror());
	return h;
}
static void *h_sym(void *h, const char *name) { return dlsym(h, name); }
static uint32_t call_abi(void *f) { return ((abi_fn)f)(); }
static gonixl_status_t call_bytes(void *f, char *buf, size_t *len, gonixl_error_t *err) {
	return ((bytes_fn)f)(buf, len, err);
}
static gonixl_status_t call_new(void *f, char *cfg, size_t n, uint64_t *out, gonixl_error_t *err) {
	return ((new_fn)f)(cfg, n, out, err);
}
static gonixl_status_t call_close(void *f, uint64_t h, gonixl_error_t *err) {
	return ((close_fn)f)(h, err);
}
static gonixl_status_t call_err(void *f, gonixl_error_t *err) { return ((err_fn)f)(err); }
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// Status codes from gonixl.h.
const (
	OK             = int32(C.GONIXL_OK)
	ErrInternal    = int32(C.GONIXL_ERR_INTERNAL)
	ErrInvalidArg  = int32(C.GONIXL_ERR_INVALID_ARGUMENT)
	ErrNullPointer = int32(C.GONIXL_ERR_NULL_POINTER)
	ErrInvalid     = int32(C.GONIXL_ERR_INVALID_HANDLE)
	ErrWrongHandle = int32(C.GONIXL_ERR_WRONG_HANDLE)
	ErrTooSmall    = int32(C.GONIXL_ERR_BUFFER_TOO_SMALL)
	ErrPoisoned    = int32(C.GONIXL_ERR_POISONED)
	ErrNotSupp     = int32(C.GONIXL_ERR_NOT_SUPPORTED)
	ABIVersion     = uint32(C.GONIXL_ABI_VERSION)
)

// Lib is a dlopen'ed libgonixl.so.
type Lib struct {
	h    unsafe.Pointer
	syms map[string]unsafe.Pointer
}

// Result is one call's status and error message.
type Result struct {
	Status int32
	Code   int32 // err->code
	Msg    string
}

// Open loads the library at path and resolves every function of the header.
func Open(path string) (*Lib, error) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var msg *C.char
	h := C.h_open(cpath, &msg)
	if h == nil {
		defer C.free(unsafe.Pointer(msg))
		return nil, fmt.Errorf("dlopen %s: %s", path, C.GoString(msg))
	}
	l := &Lib{h: h, syms: map[string]unsafe.Pointer{}}
	for _, name := range []string{"gonixl_abi_version", "gonixl_version", "gonixl_probe", "gonixl_scheduler_new",
		"gonixl_scheduler_close", "gonixl_worker_new", "gonixl_worker_close", "gonixl_debug_panic"} {
		cname := C.CString(name)
		p := C.h_sym(h, cname)
		C.free(unsafe.Pointer(cname))
		if p == nil {
			return nil, fmt.Errorf("dlsym %s: not exported", name)
		}
		l.syms[name] = p
	}
	return l, nil
}

func result(st C.gonixl_status_t, e *C.gonixl_error_t) Result {
	return Result{Status: int32(st), Code: int32(e.code), Msg: C.GoString(&e.message[0])}
}

// ABIVersion calls gonixl_abi_version.
func (l *Lib) ABIVersion() uint32 { return uint32(C.call_abi(l.syms["gonixl_abi_version"])) }

// Bytes calls a size-negotiated function with a caller buffer of bufLen
// bytes (nil when bufLen < 0) and returns the output, *len and the result.
func (l *Lib) Bytes(fn string, bufLen int) ([]byte, int, Result) {
	var e C.gonixl_error_t
	var buf *C.char
	if bufLen >= 0 {
		buf = (*C.char)(C.malloc(C.size_t(bufLen + 1)))
		defer C.free(unsafe.Pointer(buf))
	}
	n := C.size_t(max(bufLen, 0))
	st := C.call_bytes(l.syms[fn], buf, &n, &e)
	var out []byte
	if st == C.GONIXL_OK {
		out = C.GoBytes(unsafe.Pointer(buf), C.int(n))
	}
	return out, int(n), result(st, &e)
}

// BytesNullLen calls a size-negotiated function with a NULL len pointer.
func (l *Lib) BytesNullLen(fn string) Result {
	var e C.gonixl_error_t
	return result(C.call_bytes(l.syms[fn], nil, nil, &e), &e)
}

// New calls gonixl_scheduler_new or gonixl_worker_new. nullCfg passes a NULL
// config pointer with the given length; nullOut passes a NULL out pointer.
func (l *Lib) New(fn string, cfg []byte, nullCfg, nullOut bool) (uint64, Result) {
	var e C.gonixl_error_t
	var out C.uint64_t
	var cp *C.char
	if !nullCfg && len(cfg) > 0 {
		cp = (*C.char)(C.CBytes(cfg))
		defer C.free(unsafe.Pointer(cp))
	}
	outp := &out
	if nullOut {
		outp = nil
	}
	st := C.call_new(l.syms[fn], cp, C.size_t(len(cfg)), outp, &e)
	return uint64(out), result(st, &e)
}

// Close calls gonixl_scheduler_close or gonixl_worker_close.
func (l *Lib) Close(fn string, h uint64) Result {
	var e C.gonixl_error_t
	return result(C.call_close(l.syms[fn], C.uint64_t(h), &e), &e)
}

// CloseNilErr calls a close function with a NULL error struct.
func (l *Lib) CloseNilErr(fn string, h uint64) int32 {
	return int32(C.call_close(l.syms[fn], C.uint64_t(h), nil))
}

// DebugPanic calls gonixl_debug_panic.
func (l *Lib) DebugPanic() Result {
	var e C.gonixl_error_t
	return result(C.call_err(l.syms["gonixl_debug_panic"], &e), &e)
}
