package shim

import (
	"sync"
	"time"
)

// Clock returns monotonic seconds, like Python's time.perf_counter(). Leases
// and deadlines are computed in this unit so that they can be compared with
// the numbers vLLM puts on the wire.
type Clock func() float64

var clockEpoch = time.Now()

// MonotonicClock is the production clock.
func MonotonicClock() float64 { return time.Since(clockEpoch).Seconds() }

// FakeClock is an injectable clock for tests: time moves only when Advance
// is called.
type FakeClock struct {
	mu  sync.Mutex
	now float64
}

// NewFakeClock starts a fake clock at t seconds.
func NewFakeClock(t float64) *FakeClock { return &FakeClock{now: t} }

// Now returns the fake time.
func (c *FakeClock) Now() float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the fake time forward by d seconds.
func (c *FakeClock) Advance(d float64) {
	c.mu.Lock()
	c.now += d
	c.mu.Unlock()
}
