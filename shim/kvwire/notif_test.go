package kvwire

import (
	"slices"
	"testing"
)

// The notification formats are vLLM's, byte for byte, and parse back.
func TestNotificationFormats(t *testing.T) {
	if got := string(DoneNotif("cmpl-1:x", 2)); got != "cmpl-1:x:2" {
		t.Fatalf("done notification %q", got)
	}
	if got := string(HeartbeatNotif([]string{"a", "b"})); got != "HB:a,b" {
		t.Fatalf("heartbeat %q", got)
	}
	n, ok := ParseNotif("cmpl-1:x:2")
	if !ok || n.Heartbeat || n.ReqID != "cmpl-1:x" || n.Consumers != 2 {
		t.Fatalf("parse done: %+v %v", n, ok)
	}
	n, ok = ParseNotif("HB:a,b")
	if !ok || !n.Heartbeat || !slices.Equal(n.IDs, []string{"a", "b"}) {
		t.Fatalf("parse heartbeat: %+v %v", n, ok)
	}
	for _, bad := range []string{"", "req", "req:", "req:0", "req:-1", "req:x", "req:1.5"} {
		if n, ok := ParseNotif(bad); ok {
			t.Errorf("%q parsed as %+v", bad, n)
		}
	}
}
