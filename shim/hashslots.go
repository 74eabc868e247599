package shim

import (
	"runtime"
	"sync"
)

// Go code runs only on a P, of which the runtime has GOMAXPROCS (the CPU
// count), and a call from one of vLLM's threads into the library needs one
// too: while the library's goroutines hold every P, the call sleeps until
// the Go scheduler gets round to it. Hashing KV is the library's one
// long CPU work off vLLM's threads (a decode's digest check of a READ, a
// read-back's held digests): milliseconds per request, longer on a busy
// host, and eight requests landing together hashed on more goroutines
// than the host has CPUs. On the 2-vCPU bench host get_finished and
// build_connector_meta then slept 43-162 ms with no CPU used and none
// waited for (docs/BENCHMARKS.md, run 11). So the goroutines that hash at
// once hold a slot each, and there is one slot fewer than Ps: a P stays
// for vLLM's calls.

// hashSlots is the process's budget of hashing goroutines.
type hashSlots struct {
	once sync.Once
	c    chan struct{}
}

var hashers hashSlots

func (h *hashSlots) slots() chan struct{} {
	h.once.Do(func() { h.c = make(chan struct{}, max(1, runtime.GOMAXPROCS(0)-1)) })
	return h.c
}

// take waits for a slot.
func (h *hashSlots) take() { h.slots() <- struct{}{} }

// tryTake takes a slot if one is free.
func (h *hashSlots) tryTake() bool {
	select {
	case h.slots() <- struct{}{}:
		return true
	default:
		return false
	}
}

// give returns n slots.
func (h *hashSlots) give(n int) {
	for range n {
		<-h.slots()
	}
}
