package libnixl

/*
#include <stdlib.h>
#include "gxnixl.h"
*/
import "C"

import (
	"fmt"
	"time"
	"unsafe"

	"github.com/gonixl/gonixl/nixl"
)

// xfer is a prepared transfer request.
type xfer struct {
	a        *agent
	h        unsafe.Pointer
	op       nixl.XferOp
	remote   string
	n        int
	released bool
}

func (x *xfer) stale(op string) error {
	if x.released {
		return nixl.Errorf(nixl.ErrInvalidParam, op, "transfer request already released")
	}
	return x.a.check(op)
}

func (x *xfer) result(op string, s C.int) (nixl.Status, error) {
	st := nixl.Status(s)
	if st.IsError() {
		x.a.tainted = true
		return st, &nixl.Error{Status: st, Op: op, Msg: fmt.Sprintf("%v of %d descriptors with agent %q", x.op, x.n, x.remote)}
	}
	return st, nil
}

func (x *xfer) Post() (nixl.Status, error) {
	a := x.a
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := x.stale("Post"); err != nil {
		return nixl.ErrInvalidParam, err
	}
	return x.result("Post", C.gxnixl_post(a.h, x.h))
}

func (x *xfer) Check() (nixl.Status, error) {
	a := x.a
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := x.stale("Check"); err != nil {
		return nixl.ErrInvalidParam, err
	}
	return x.result("Check", C.gxnixl_check(a.h, x.h))
}

func (x *xfer) Telemetry() (nixl.Telemetry, nixl.Status) {
	a := x.a
	a.mu.Lock()
	defer a.mu.Unlock()
	if x.stale("Telemetry") != nil {
		return nixl.Telemetry{}, nixl.ErrInvalidParam
	}
	var out [6]C.uint64_t
	s := nixl.Status(C.gxnixl_telemetry(a.h, x.h, &out[0]))
	if s != nixl.Success {
		return nixl.Telemetry{}, s
	}
	ago := time.Duration(int64(out[5])-int64(out[0])) * time.Microsecond
	return nixl.Telemetry{
		Start:     time.Now().Add(-ago),
		PostDur:   time.Duration(out[1]) * time.Microsecond,
		XferDur:   time.Duration(out[2]) * time.Microsecond,
		Bytes:     uint64(out[3]),
		DescCount: int(out[4]),
	}, nixl.Success
}

// Release frees the request, cancelling it if it is in flight. If NIXL
// cannot cancel it (ERR_REPOST_ACTIVE) the request stays valid.
func (x *xfer) Release() error {
	a := x.a
	a.mu.Lock()
	defer a.mu.Unlock()
	if x.released {
		return nixl.Errorf(nixl.ErrInvalidParam, "Xfer.Release", "transfer request already released")
	}
	if a.closed {
		x.released = true // freed with the agent
		return nil
	}
	if s := C.gxnixl_release_xfer(a.h, x.h); s != 0 {
		return statusErr("Xfer.Release", s, "%v with agent %q", x.op, x.remote)
	}
	x.released = true
	delete(a.xfers, x)
	return nil
}
