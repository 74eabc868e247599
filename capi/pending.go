package main

/*
#cgo CFLAGS: -I${SRCDIR}/../include
#include "gonixl.h"
*/
import "C"

import "sync"

// Calls that consume state (per-step metadata, finished sets, stats) must
// not lose their result when the caller's buffer is too small. The result
// is parked here, keyed by handle and call, and handed out by the retry
// without running the call again.
type pendingKey struct {
	handle uint64
	call   string
	id     string
}

var (
	pendingMu sync.Mutex
	pending   = map[pendingKey][]byte{}
)

// consume writes produce()'s output to (buf, lenp), or the parked output of
// an earlier call with the same key.
func consume(key pendingKey, buf *C.char, lenp *C.size_t, produce func() ([]byte, error)) error {
	if lenp == nil {
		return errorf(statusNullPointer, "len pointer is NULL")
	}
	pendingMu.Lock()
	out, parked := pending[key]
	pendingMu.Unlock()
	if !parked {
		var err error
		if out, err = produce(); err != nil {
			return err
		}
		if out == nil {
			out = []byte{}
		}
	}
	err := writeOut(buf, lenp, out)
	pendingMu.Lock()
	if err != nil {
		pending[key] = out
	} else {
		delete(pending, key)
	}
	pendingMu.Unlock()
	return err
}

// pendingCount is the number of parked results.
func pendingCount() int {
	pendingMu.Lock()
	defer pendingMu.Unlock()
	return len(pending)
}

// dropPending forgets parked results of a closed handle.
func dropPending(handle uint64) {
	pendingMu.Lock()
	for k := range pending {
		if k.handle == handle {
			delete(pending, k)
		}
	}
	pendingMu.Unlock()
}
