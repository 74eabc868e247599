package ucx

/*
#include "gxucx.h"
*/
import "C"

import (
	"errors"
	"os"
	"runtime"
	"time"
)

// waitMs bounds each sleep of the progress thread: UCX can miss an event-fd
// wakeup, so the thread also progresses on this period.
const waitMs = 2

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
		for {
			a.mu.Lock()
			if a.closing || a.closed {
				a.mu.Unlock()
				return
			}
			armed := C.gx_progress_arm(a.c)
			a.mu.Unlock()
			if armed == 1 {
				C.gx_wait(C.int(efd), wakefd, waitMs)
			}
		}
	}()
	return pt, nil
}

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
