package shim

import (
	"slices"
	"testing"
)

// The notification formats are vLLM's, byte for byte, and parse back.
func TestNotificationFormats(t *testing.T) {
	if got := string(doneNotif("cmpl-1:x", 2)); got != "cmpl-1:x:2" {
		t.Fatalf("done notification %q", got)
	}
	if got := string(heartbeatNotif([]string{"a", "b"})); got != "HB:a,b" {
		t.Fatalf("heartbeat %q", got)
	}
	n, ok := parseNotif("cmpl-1:x:2")
	if !ok || n.heartbeat || n.reqID != "cmpl-1:x" || n.consumers != 2 {
		t.Fatalf("parse done: %+v %v", n, ok)
	}
	n, ok = parseNotif("HB:a,b")
	if !ok || !n.heartbeat || !slices.Equal(n.ids, []string{"a", "b"}) {
		t.Fatalf("parse heartbeat: %+v %v", n, ok)
	}
	for _, bad := range []string{"", "req", "req:", "req:0", "req:-1", "req:x", "req:1.5"} {
		if n, ok := parseNotif(bad); ok {
			t.Errorf("%q parsed as %+v", bad, n)
		}
	}
}

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
