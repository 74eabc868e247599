package shim

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl/nixltest"
)

// A request that names a known prefill engine at a wrong address (nothing
// listens there) fails fast, and the working connection to that engine is
// kept: the next correct request reads without a new handshake.
func TestWrongAddressKeepsWorkingConnection(t *testing.T) {
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)

	load := func(reqID string, out []byte, port int) {
		t.Helper()
		var params map[string]any
		if err := json.Unmarshal(out, &params); err != nil {
			t.Fatal(err)
		}
		params["remote_port"] = port
		b, _ := json.Marshal(params)
		dp := mustParams(t, string(b))
		if _, err := d.sched.UpdateStateAfterAlloc(reqID, dp, BlockIDs{{7, 8, 9}}, []int64{0}, 12); err != nil {
			t.Fatal(err)
		}
		d.step(t)
	}
	load("ok-1", prefill(t, p, "p-1", []int64{3, 4, 5}, 12), p.port)
	if f := d.waitFinished(t, "first read", func(f Finished) bool { return contains(f.Recving, "ok-1") }); len(f.Failed) != 0 {
		t.Fatalf("first read failed: %+v", f)
	}
	d.work.mu.Lock()
	known := d.work.remotes["engine-p"]
	d.work.mu.Unlock()

	start := time.Now()
	load("bogus", prefill(t, p, "p-2", []int64{3, 4, 5}, 12), freePort(t))
	f := d.waitFinished(t, "bogus request fails", func(f Finished) bool { return contains(f.Failed, "bogus") })
	if el := time.Since(start); el > 5*time.Second {
		t.Fatalf("a refused address took %v to fail (handshake_timeout is 30 s)", el)
	}
	if !contains(f.Recving, "bogus") {
		t.Fatalf("bogus request not reported: %+v", f)
	}
	d.work.mu.Lock()
	still := d.work.remotes["engine-p"]
	d.work.mu.Unlock()
	if still != known {
		t.Fatal("the working connection was dropped for a wrong address")
	}
	load("ok-2", prefill(t, p, "p-3", []int64{3, 4, 5}, 12), p.port)
	if f := d.waitFinished(t, "read after the bogus request", func(f Finished) bool { return contains(f.Recving, "ok-2") }); len(f.Failed) != 0 {
		t.Fatalf("legitimate request failed after a bogus one: %+v", f)
	}
}

// A lease shorter than the old fixed 5 s margin still lets READs through
// (the margin scales with the lease), and a READ refused for lack of lease
// tells the prefill to free its blocks at once.
func TestShortLeaseReadsAndRefusalNotifies(t *testing.T) {
	clock := NewFakeClock(1000)
	eng := nixltest.NewEngine("t")
	extra := map[string]any{"kv_lease_duration": 4}
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, extra)
	d := newSide(t, eng, "kv_consumer", "engine-d", clock.Now, 200, extra)
	if d.work.leaseMargin != 1 {
		t.Fatalf("margin %v for a 4 s lease", d.work.leaseMargin)
	}
	load := func(reqID string, out []byte) {
		t.Helper()
		if _, err := d.sched.UpdateStateAfterAlloc(reqID, mustParams(t, string(out)), BlockIDs{{7, 8, 9}}, []int64{0}, 12); err != nil {
			t.Fatal(err)
		}
		d.step(t)
	}
	out := prefill(t, p, "p-1", []int64{3, 4, 5}, 12)
	clock.Advance(2.5) // 1.5 s of the 4 s lease left: more than the 1 s margin
	load("d-1", out)
	if f := d.waitFinished(t, "read under a 4 s lease", func(f Finished) bool { return contains(f.Recving, "d-1") }); len(f.Failed) != 0 {
		t.Fatalf("READ refused under a 4 s lease: %+v", f)
	}
	out = prefill(t, p, "p-2", []int64{3, 4, 5}, 12)
	clock.Advance(3.5) // 0.5 s left: refused
	load("d-2", out)
	d.waitFinished(t, "refused", func(f Finished) bool { return contains(f.Failed, "d-2") })
	// The prefill frees on the notification, before its lease would end.
	p.waitFinished(t, "prefill freed by the refusal's notification", func(f Finished) bool { return contains(f.Sending, "p-2") })
}
