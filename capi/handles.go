package main

import (
	"fmt"
	"sync"
)

// handleKind is stored in the top byte of every handle, so a handle of the
// wrong kind is recognised even after it was closed.
type handleKind uint8

const (
	kindScheduler handleKind = 1
	kindWorker    handleKind = 2
)

func (k handleKind) String() string {
	switch k {
	case kindScheduler:
		return "scheduler"
	case kindWorker:
		return "worker"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

const (
	kindShift = 56
	seqMask   = 1<<kindShift - 1
	// seqBase keeps small integers (a stray fd, a bool, a count) from ever
	// being valid handles.
	seqBase = 0x5a<<24 + 1
)

// handleTable maps handles to objects. Sequence numbers are never reused, so
// a stale handle stays invalid for the life of the process.
type handleTable struct {
	mu   sync.Mutex
	next uint64
	objs map[uint64]any
}

func newHandleTable() *handleTable {
	return &handleTable{next: seqBase, objs: map[uint64]any{}}
}

func (t *handleTable) add(k handleKind, obj any) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	h := uint64(k)<<kindShift | (t.next & seqMask)
	t.next++
	t.objs[h] = obj
	return h
}

// handleError classifies a failed lookup.
type handleError struct {
	status int32
	msg    string
}

func (e *handleError) Error() string { return e.msg }

func (t *handleTable) check(h uint64, want handleKind) error {
	if h == 0 {
		return &handleError{statusInvalidHandle, fmt.Sprintf("%s handle is 0 (invalid)", want)}
	}
	if got := handleKind(h >> kindShift); got != want {
		return &handleError{statusWrongHandle, fmt.Sprintf("handle %#x is a %s handle, expected a %s handle", h, got, want)}
	}
	return &handleError{statusInvalidHandle, fmt.Sprintf("%s handle %#x is unknown or already closed", want, h)}
}

func (t *handleTable) get(h uint64, want handleKind) (any, error) {
	t.mu.Lock()
	obj, ok := t.objs[h]
	t.mu.Unlock()
	if ok && handleKind(h>>kindShift) == want {
		return obj, nil
	}
	return nil, t.check(h, want)
}

// remove deletes a handle and returns its object.
func (t *handleTable) remove(h uint64, want handleKind) (any, error) {
	t.mu.Lock()
	obj, ok := t.objs[h]
	if ok && handleKind(h>>kindShift) == want {
		delete(t.objs, h)
		t.mu.Unlock()
		return obj, nil
	}
	t.mu.Unlock()
	return nil, t.check(h, want)
}

func (t *handleTable) len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.objs)
}

// count returns the number of open handles of kind k.
func (t *handleTable) count(k handleKind) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for h := range t.objs {
		if handleKind(h>>kindShift) == k {
			n++
		}
	}
	return n
}

var handles = newHandleTable()
