package shim

import (
	"slices"
	"testing"
)

// Leases on the injected clock: Extend never creates or shortens, Raise
// never lowers, Expired removes exactly the passed ones, in order.
func TestLeases(t *testing.T) {
	clock := NewFakeClock(0)
	l := newLeases(clock.Now)
	l.Hold("b", 10)
	l.Hold("a", 5)
	l.Extend("a", 4)
	l.Extend("c", 20)
	if d, _ := l.Deadline("a"); d != 5 {
		t.Fatalf("Extend shortened a lease: %v", d)
	}
	if _, ok := l.Deadline("c"); ok {
		t.Fatal("Extend created a lease")
	}
	l.Raise("c", 3)
	l.Raise("c", 2)
	if d, _ := l.Deadline("c"); d != 3 {
		t.Fatalf("Raise lowered a lease: %v", d)
	}
	clock.Advance(5)
	if got := l.Expired(); !slices.Equal(got, []string{"a", "c"}) {
		t.Fatalf("expired %v", got)
	}
	if l.Len() != 1 || !slices.Equal(l.IDs(), []string{"b"}) {
		t.Fatalf("left %v", l.IDs())
	}
	l.Drop("b")
	if l.Len() != 0 {
		t.Fatal("Drop")
	}
}
