//go:build cgo && !gonixl_noucx

package ucx

/*
#include "gxucx.h"
#include "gxcuda.h"
*/
import "C"

import (
	"fmt"
	"time"
	"unsafe"

	"github.com/gonixl/gonixl/nixl"
)

// xfer is a prepared transfer. Its C state (gx_xfer) holds the in-flight
// UCX requests; all access goes through the agent's mutex.
type xfer struct {
	a    *agent
	op   nixl.XferOp
	peer *peer
	gen  uint64
	ops  []op // coalesced; crosses into C as a gx_iov array
	// With data path shm and a peer whose regions are mapped here: ops
	// split into memcpy parts (remote address inside the mapping) and CMA
	// parts, and the peer control pages they depend on (nil otherwise).
	shmOps, cmaOps []op
	ctls           []unsafe.Pointer
	// VRAM (cuda.go): the gather operations (one list, or regions ×
	// blocks), the device that runs them, and a failed gather's message.
	cdev    *C.gx_cuda_dev
	cops    []cop
	cblocks *gatherBlocks
	cudaErr string
	// A regions × blocks DRAM transfer whose operations are not built yet
	// (materialize); nil once they are.
	lazy  *lazyOps
	bytes uint64
	descs int // descriptor pairs before coalescing

	c        *C.gx_xfer
	posted   bool
	copying  bool        // a host copy (cma, shm) of this transfer runs on its own goroutine
	final    nixl.Status // sticky terminal status (Success or an error) once reached
	finalErr error
	start    time.Time
	// landed: closed once this post's bytes have moved (nixl.Lander);
	// a new one for each post.
	landed   chan struct{}
	hasLand  bool // landed was closed
	postDur  time.Duration
	xferDur  time.Duration
	released bool
}

// Ops reports how many UCP operations one post issues, after coalescing,
// and how many descriptor pairs the transfer was built from.
func (x *xfer) Ops() (ops, descs int) {
	x.a.mu.Lock()
	defer x.a.mu.Unlock()
	if !x.copying {
		x.materialize()
	}
	return x.opCount(), x.descs
}

// lazyOps is what MakeXferBlocks keeps of a DRAM transfer until its
// operations are needed.
type lazyOps struct {
	spans  []blockSpan
	lb, rb []int32
}

// materialize builds the operations of a lazily made transfer (by the one
// goroutine that owns x: its copy goroutine while copying, else a caller
// holding the agent mutex).
func (x *xfer) materialize() {
	l := x.lazy
	if l == nil {
		return
	}
	ops := make([]op, 0, len(l.spans)*len(l.lb))
	for _, s := range l.spans {
		for k := range l.lb {
			ops = append(ops, op{laddr: s.laddr + uint64(l.lb[k])*s.lstride, raddr: s.raddr + uint64(l.rb[k])*s.rstride,
				len: s.len, rkey: s.rkey, memh: s.memh})
		}
	}
	x.ops = coalesce(ops)
	x.lazy = nil
}

// opCount is the number of operations one post issues: UCP operations,
// gather operations, or the gather_blocks kernel's items.
func (x *xfer) opCount() int {
	switch {
	case x.cblocks != nil:
		return x.cblocks.nregs * x.cblocks.npairs * int(x.cblocks.nchunks)
	case x.cops != nil:
		return len(x.cops)
	}
	return len(x.ops)
}

func (x *xfer) Post() (nixl.Status, error) {
	const fn = "Post"
	a := x.a
	a.mu.Lock()
	defer a.mu.Unlock()
	if x.released {
		return nixl.ErrInvalidParam, nixl.Errorf(nixl.ErrInvalidParam, fn, "transfer already released")
	}
	if err := a.checkOpen(fn); err != nil {
		return nixl.ErrInvalidParam, err
	}
	if x.posted && x.final == nixl.InProgress {
		// Re-check before refusing, as NIXL does.
		if st, _ := x.checkLocked(fn); st == nixl.InProgress {
			return nixl.ErrRepostActive, nixl.Errorf(nixl.ErrRepostActive, fn, "previous post still in progress")
		}
	}
	// This post's landed channel (nixl.Lander), closed only if its bytes move.
	x.landed, x.hasLand = make(chan struct{}), false
	p := x.peer
	if a.peers[p.name] != p || p.gen != x.gen {
		return nixl.ErrNotFound, nixl.Errorf(nixl.ErrNotFound, fn, "metadata of agent %q was invalidated or reloaded after MakeXfer", p.name)
	}
	if p.dead {
		return nixl.ErrRemoteDiscon, nixl.Errorf(nixl.ErrRemoteDiscon, fn, "transfer to %s: %s", p.name, p.deadWhy)
	}
	x.posted = true
	x.final = nixl.InProgress
	x.finalErr = nil
	x.start = time.Now()
	if copyFn, mapped := x.hostCopy(); copyFn != nil {
		x.startHostCopy(fn, copyFn, mapped)
		return nixl.InProgress, nil
	}
	return x.postUCP(fn)
}

// postUCP posts x's operations through UCX (agent mutex held).
func (x *xfer) postUCP(fn string) (nixl.Status, error) {
	a, p := x.a, x.peer
	x.materialize()
	rc := C.gx_post(a.c, p.ep, C.int(x.op),
		(*C.gx_iov)(unsafe.Pointer(&x.ops[0])), C.size_t(len(x.ops)),
		rkeyPtr(p.rkeys), C.size_t(len(p.rkeys)),
		memhPtr(a.memhs), C.size_t(len(a.memhs)), x.c)
	x.postDur = time.Since(x.start)
	return x.settle(rc, fn)
}

// hostCopy returns the data path's way of moving x's bytes in this process
// (shm where the peer's regions are mapped, else CMA), or nil when UCP
// moves them (data path ucp, a peer on another host, or one the kernel
// refused CMA to). It runs without the agent mutex and returns the copy's
// result code; mapped is true when it reads or writes a peer's mapping.
func (x *xfer) hostCopy() (copyFn func() C.int, mapped bool) {
	p := x.peer
	switch {
	case x.cops != nil || x.cblocks != nil:
		return x.cudaCopy(), true // reads or writes through the peer's CUDA IPC mappings
	case !x.a.set.path.copiesHere() || !p.local || !p.sameNet || p.noCMA:
		return nil, false
	case x.ctls != nil:
		return x.copyShm, true
	}
	pid, op := C.int(p.proc.Pid), C.int(x.op)
	return func() C.int {
		x.materialize() // on the copy goroutine, which owns x until it settles
		return C.gx_cma(pid, op, (*C.gx_iov)(unsafe.Pointer(&x.ops[0])), C.size_t(len(x.ops)))
	}, false
}

// startHostCopy runs a host copy on its own goroutine, so that Post returns
// at once (vLLM posts from its model thread; a copy of a large request's
// blocks takes tens of milliseconds) and the READ needs no CPU of the peer's.
// Called with the agent mutex held. While the copy runs the transfer is in
// progress, Release refuses it (its memory is being written) and Close
// waits for it; a copy through a peer's mapping holds copyMu for reading,
// so the mapping is not detached under it. The goroutine settles the transfer under the mutex: the
// notification goes out through UCX, or, when the kernel denied CMA before
// any byte moved, the whole transfer is posted through UCX.
func (x *xfer) startHostCopy(fn string, copyFn func() C.int, mapped bool) {
	a := x.a
	x.copying = true
	a.copies.Add(1)
	if mapped {
		a.copyMu.RLock() // no writer is pending: writers hold a.mu, which the caller holds
	}
	go func() {
		defer a.copies.Done()
		readLocked := mapped
		defer func() {
			// A panic here must not kill vLLM's process: the transfer
			// fails (Release still refuses while UCX operations of it are
			// in flight), the locks are given back.
			p := recover()
			if p == nil {
				return
			}
			if readLocked {
				a.copyMu.RUnlock()
			}
			a.mu.Lock()
			defer a.mu.Unlock()
			x.copying = false
			x.final, x.finalErr = nixl.ErrBackend, nixl.Errorf(nixl.ErrBackend, fn, "internal error in the host copy to %s: panic: %v", x.peer.name, p)
		}()
		if hostCopyHook != nil {
			hostCopyHook()
		}
		rc := copyFn()
		if mapped {
			a.copyMu.RUnlock()
			readLocked = false
		}
		a.mu.Lock()
		defer a.mu.Unlock()
		x.copying = false
		if _, _, done := x.afterHostCopy(fn, rc); !done {
			_, _ = x.postUCP(fn)
		}
	}()
}

// hostCopyHook, when set (tests only), runs on the copy's goroutine before
// the copy.
var hostCopyHook func()

// afterHostCopy settles a transfer whose data this process moved itself
// (CMA or shm; rc is the copy's result), with the agent mutex held: on
// success the notification goes out through UCX.
func (x *xfer) afterHostCopy(fn string, rc C.int) (st nixl.Status, err error, done bool) {
	a, p := x.a, x.peer
	if err := a.checkOpen(fn); err != nil {
		x.final, x.finalErr = nixl.ErrInvalidParam, err
		return nixl.ErrInvalidParam, err, true
	}
	switch rc {
	case 0:
		x.landLocked() // the copy is done; the notification goes out now
		rc = C.gx_data_done(a.c, p.ep, x.c)
	case gxErrCMADenied:
		p.noCMA = true
		return 0, nil, false
	case gxErrCUDA:
		err := nixl.Errorf(nixl.ErrBackend, fn, "transfer to %s: %s", p.name, x.cudaErr)
		x.final, x.finalErr = nixl.ErrBackend, err
		return x.final, err, true
	case gxErrEpFailed:
		p.dead, p.deadWhy = true, fmt.Sprintf("peer process %d has exited", p.proc.Pid)
		err := nixl.Errorf(nixl.ErrRemoteDiscon, fn, "transfer to %s: %s", p.name, p.deadWhy)
		x.final, x.finalErr = nixl.ErrRemoteDiscon, err
		return x.final, err, true
	}
	x.postDur = time.Since(x.start)
	st, err = x.settle(rc, fn)
	return st, err, true
}

func rkeyPtr(r []C.ucp_rkey_h) *C.ucp_rkey_h {
	if len(r) == 0 {
		return nil
	}
	return &r[0]
}

func memhPtr(m []C.ucp_mem_h) *C.ucp_mem_h {
	if len(m) == 0 {
		return nil
	}
	return &m[0]
}

// settle records a C return code as the transfer's state.
func (x *xfer) settle(rc C.int, fn string) (nixl.Status, error) {
	st := statusOf(rc)
	switch {
	case st == nixl.InProgress:
		return st, nil
	case st == nixl.Success:
		x.xferDur = time.Since(x.start)
		x.final = nixl.Success
		x.landLocked()
		x.peer.established = true
		return st, nil
	}
	what := "transfer to " + x.peer.name
	var ust C.int
	if x.peer.ep != nil && C.gx_ep_failed(x.peer.ep, &ust) != 0 {
		st = nixl.ErrRemoteDiscon
		what += " (endpoint failed: " + C.GoString(C.gx_status_string(ust)) + ")"
	}
	err := rcError(rc, fn, what)
	err.(*nixl.Error).Status = st
	x.final, x.finalErr = st, err
	return st, err
}

// Landed is nixl.Lander's channel of the last post (nil before a post).
func (x *xfer) Landed() <-chan struct{} {
	x.a.mu.Lock()
	defer x.a.mu.Unlock()
	return x.landed
}

// landLocked closes the post's landed channel (agent mutex held), once.
func (x *xfer) landLocked() {
	if x.landed != nil && !x.hasLand {
		x.hasLand = true
		close(x.landed)
	}
}

func (x *xfer) Check() (nixl.Status, error) {
	x.a.mu.Lock()
	defer x.a.mu.Unlock()
	return x.checkLocked("Check")
}

// TryCheck is nixl.TryChecker's: Check, unless the agent mutex is held
// (the progress thread's sweep, a post, a copy settling).
func (x *xfer) TryCheck() (nixl.Status, error, bool) {
	if !x.a.mu.TryLock() {
		return nixl.InProgress, nil, false
	}
	defer x.a.mu.Unlock()
	st, err := x.checkLocked("Check")
	return st, err, true
}

func (x *xfer) checkLocked(fn string) (nixl.Status, error) {
	if x.released {
		return nixl.ErrInvalidParam, nixl.Errorf(nixl.ErrInvalidParam, fn, "transfer already released")
	}
	if !x.posted {
		return nixl.ErrNotPosted, nixl.Errorf(nixl.ErrNotPosted, fn, "transfer was never posted")
	}
	if x.final != nixl.InProgress {
		return x.final, x.finalErr
	}
	if err := x.a.checkOpen(fn); err != nil {
		return nixl.ErrInvalidParam, err
	}
	if x.copying {
		return nixl.InProgress, nil
	}
	rc := C.gx_check(x.a.c, x.peer.ep, x.c, 1)
	x.a.advanceRetiringLocked(time.Now())
	if x.a.prog != nil {
		x.a.polled = time.Now()
	}
	if rc == 1 && x.peer.checkDead(time.Now()) {
		err := nixl.Errorf(nixl.ErrRemoteDiscon, fn, "transfer to %s: %s", x.peer.name, x.peer.deadWhy)
		x.final, x.finalErr = nixl.ErrRemoteDiscon, err
		return x.final, err
	}
	return x.settle(rc, fn)
}

func (x *xfer) Telemetry() (nixl.Telemetry, nixl.Status) {
	x.a.mu.Lock()
	defer x.a.mu.Unlock()
	if !x.a.telemetry {
		return nixl.Telemetry{}, nixl.ErrNoTelemetry
	}
	if !x.posted {
		return nixl.Telemetry{}, nixl.ErrNotPosted
	}
	if x.final != nixl.Success {
		return nixl.Telemetry{}, x.final
	}
	return nixl.Telemetry{
		Start:     x.start,
		PostDur:   x.postDur,
		XferDur:   x.xferDur,
		Bytes:     x.bytes,
		DescCount: x.opCount(),
	}, nixl.Success
}

func (x *xfer) Release() error {
	a := x.a
	a.mu.Lock()
	defer a.mu.Unlock()
	if x.released {
		return nixl.Errorf(nixl.ErrInvalidParam, "ReleaseXfer", "transfer released twice")
	}
	if x.c != nil && !a.closed {
		a.advanceRetiringLocked(time.Now())
	}
	if x.copying {
		return nixl.Errorf(nixl.ErrRepostActive, "ReleaseXfer",
			"the transfer's data is still being copied in this process; release it after Check reports it done")
	}
	if x.c != nil && !a.closed && !x.peer.dead && C.gx_xfer_busy(a.c, x.c) != 0 {
		// Its GETs may still land in local memory, and UCX cannot cancel
		// them: the caller must keep the memory from reuse and try again
		// (the data phase ends when the ops complete, when the peer is
		// found dead, or, in error mode peer, once the peer is
		// invalidated: InvalidateRemote force-closes an endpoint whose
		// flush does not complete).
		return nixl.Errorf(nixl.ErrRepostActive, "ReleaseXfer",
			"the transfer's operations are still in flight and cannot be cancelled; release it after they complete or after InvalidateRemote of its peer")
	}
	x.released = true
	if x.c != nil { // nil once the agent closed
		C.gx_xfer_free(a.c, x.c)
		x.c = nil
		delete(a.xfers, x)
	}
	x.ops = nil
	return nil
}
