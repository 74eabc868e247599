//go:build cgo && !gonixl_noucx

package ucx

/*
#include "gxucx.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"time"
)

// waitMs bounds each sleep of the progress thread: UCX can miss an event-fd
// wakeup, so the thread also progresses on this period.
const waitMs = 2

// spinWindow: after the worker last had work, the thread keeps polling this
// long before it sleeps. A target serving software-emulated RMA (UCX 1.13
// over shared memory or tcp) copies every fragment on this thread, and a
// sleep/wake per fragment would cost more than the copy.
const spinWindow = 200 * time.Microsecond

// progressThread progresses one agent's worker on a dedicated, locked OS
// thread: progress and arm under the agent mutex, then poll(2) on the
// worker's event fd and a wake pipe without it.
type progressThread struct {
	wakeR, wakeW *os.File
	done         chan struct{}
}

func startProgress(a *agent, efd int) (*progressThread, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	pt := &progressThread{wakeR: r, wakeW: w, done: make(chan struct{})}
	wakefd := C.int(r.Fd())
	go func() {
		runtime.LockOSThread()
		defer close(pt.done)
		defer func() {
			// A panic here must not kill the host process (vLLM): the
			// thread ends, callers' polls (Check, GetNotifs) keep
			// progressing the worker, and GetNotifs reports it once.
			if p := recover(); p != nil {
				msg := fmt.Sprintf("ucx progress thread of agent %q panicked and stopped (progress continues on callers' polls): %v", a.name, p)
				a.progFault.Store(&msg)
			}
		}()
		last := time.Now()
		for {
			stop, n := a.progressStep(last)
			switch {
			case stop:
				return
			case n > 0:
				last = time.Now()
			case n < 0:
				C.gx_wait(C.int(efd), wakefd, waitMs)
			default:
				runtime.Gosched()
			}
		}
	}()
	return pt, nil
}

// progressStep is one sweep of the progress thread, under the agent mutex
// (released on every exit path, a panic included).
func (a *agent) progressStep(last time.Time) (stop bool, n C.int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closing || a.closed {
		return true, 0
	}
	if progressPanicHook != nil {
		progressPanicHook()
	}
	// Spin only while nobody else progresses this worker: a caller
	// polling Check already does, and on few cores two spinners
	// would steal each other's time slices.
	now := time.Now()
	spin := now.Sub(last) < spinWindow && now.Sub(a.polled) >= spinWindow
	arm := C.int(1)
	if spin {
		arm = 0
	}
	n = C.gx_progress_arm(a.c, arm)
	a.advanceRetiringLocked(now)
	return false, n
}

// progressPanicHook, when set (tests only), runs in every progress sweep.
var progressPanicHook func()

// stop wakes the thread and waits (bounded) for it to exit.
func (pt *progressThread) stop() error {
	_, _ = pt.wakeW.Write([]byte{1})
	select {
	case <-pt.done:
	case <-time.After(5 * time.Second):
		return errors.New("progress thread still running after 5s")
	}
	pt.wakeR.Close()
	pt.wakeW.Close()
	return nil
}
