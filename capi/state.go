package main

/*
#include <stdlib.h>
#include "gonixl.h"
*/
import "C"

import (
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/gonixl/gonixl/shim"
)

// A worker's idle state lives in C memory (gonixl_worker_state_t) that the
// Python connector reads every engine step without a call (shim/idle.go).
// It is allocated on the first gonixl_worker_state of a handle and never
// freed: the caller may still read it after the handle closed, and it is 16
// bytes per worker, one or a few per process.
var (
	statesMu sync.Mutex
	states   = map[uint64]*C.gonixl_worker_state_t{}
)

// statePub publishes into one state struct with atomic stores (the reader
// is another thread).
type statePub struct{ p *C.gonixl_worker_state_t }

func (s statePub) Publish(busy, changed bool) {
	var b uint32
	if busy {
		b = 1
	}
	atomic.StoreUint32((*uint32)(unsafe.Pointer(&s.p.busy)), b)
	if changed {
		atomic.AddUint64((*uint64)(unsafe.Pointer(&s.p.seq)), 1)
	}
}

//export gonixl_worker_state
func gonixl_worker_state(h C.gonixl_worker_t, out **C.gonixl_worker_state_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onWorker(h, cerr, func(w *shim.Worker) error {
		if out == nil {
			return errorf(statusNullPointer, "out pointer is NULL")
		}
		statesMu.Lock()
		st, ok := states[uint64(h)]
		if !ok {
			st = (*C.gonixl_worker_state_t)(C.calloc(1, C.size_t(unsafe.Sizeof(C.gonixl_worker_state_t{}))))
			if st == nil {
				statesMu.Unlock()
				return errorf(statusInternal, "calloc of the worker state failed")
			}
			states[uint64(h)] = st
		}
		statesMu.Unlock()
		if !ok {
			w.SetPublisher(statePub{st})
		}
		*out = st
		return nil
	})
}
