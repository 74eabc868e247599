package shim

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/nixltest"
)

var _ nixl.ControlBusy = (*nixltest.Agent)(nil)

// countCalls counts the recorded calls named op on the agent of engine id.
func countCalls(eng *nixltest.Engine, id, op string) int {
	n := 0
	for _, a := range eng.Agents() {
		if !strings.HasPrefix(a.Name(), id+"-") {
			continue
		}
		for _, c := range a.Calls() {
			if c.Op == op {
				n++
			}
		}
	}
	return n
}

// loadFrom runs prefill request preq on p (blocks pb, 12 tokens) and hands
// its KV to decode request dreq on d (blocks db), one decode step: the READ
// is posted, or queued behind a handshake.
func loadFrom(t *testing.T, d, p *side, preq, dreq string, pb, db []int64) {
	t.Helper()
	out := prefill(t, p, preq, pb, 12)
	dp := mustParams(t, string(out))
	d.sched.OnNewRequest(dreq, dp)
	d.sched.GetNumNewMatchedTokens(dp, 12, 0)
	if _, err := d.sched.UpdateStateAfterAlloc(dreq, dp, BlockIDs{db}, []int64{0}, 12); err != nil {
		t.Fatal(err)
	}
	d.step(t)
}

// An agent that serialises its calls (the NIXL engine) reports a control
// call in progress; while it does, the decode's polls and posts from vLLM's
// model thread are put off rather than made to wait behind it, and resume
// once it ends: nothing is lost.
func TestPollsAndPostsWaitOutAControlCall(t *testing.T) {
	eng := nixltest.NewEngine("t")
	gate, entered := make(chan struct{}), make(chan struct{}, 1)
	eng.SetScript(nixltest.Script{Polls: 2, ControlBusy: true, PrepHook: func(remote string, n int) {
		if strings.HasPrefix(remote, "engine-p2-") {
			entered <- struct{}{}
			<-gate
		}
	}})
	p1 := newSide(t, eng, "kv_producer", "engine-p1", nil, 1, nil)
	p2 := newSide(t, eng, "kv_producer", "engine-p2", nil, 50, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	defer func() {
		select {
		case <-gate:
		default:
			close(gate)
		}
	}()
	load := func(p *side, preq, dreq string, pb, db []int64) { loadFrom(t, d, p, preq, dreq, pb, db) }
	// Engine p1 known: its first request completes as usual.
	load(p1, "req-1", "req-a", []int64{1, 2, 3}, []int64{4, 5, 6})
	d.waitFinished(t, "req-a", func(f Finished) bool { return contains(f.Recving, "req-a") })

	// First contact with p2, its preparation held: the agent is busy.
	load(p2, "req-2", "req-b", []int64{7, 8, 9}, []int64{10, 11, 12})
	select {
	case <-entered:
	case <-time.After(5 * time.Second):
		t.Fatal("engine-p2's descriptor preparation never started")
	}
	// A request for the known engine p1 arrives meanwhile: put off.
	load(p1, "req-3", "req-c", []int64{7, 8, 9}, []int64{13, 14, 15})
	d.work.mu.Lock()
	st := d.work.recv["req-c"]
	deferred := st != nil && st.waiting && len(st.xfers) == 0 && len(d.work.deferred) == 1
	d.work.mu.Unlock()
	if !deferred {
		t.Fatalf("req-c's READ was not put off while the agent was busy: %+v", st)
	}
	checks, notifs := countCalls(eng, "engine-d", "Check"), countCalls(eng, "engine-d", "GetNotifs")
	for i := 0; i < 3; i++ {
		if f := d.finished(t); len(f.Recving)+len(f.Failed) != 0 {
			t.Fatalf("get_finished while busy reported %+v", f)
		}
	}
	if c, n := countCalls(eng, "engine-d", "Check"), countCalls(eng, "engine-d", "GetNotifs"); c != checks || n != notifs {
		t.Fatalf("get_finished called the busy agent: Check %d->%d, GetNotifs %d->%d", checks, c, notifs, n)
	}

	// The preparation ends: both requests complete, with the right bytes.
	close(gate)
	d.waitFinished(t, "req-b and req-c after the control call", func(f Finished) bool {
		return contains(f.Recving, "req-b") && contains(f.Recving, "req-c")
	})
	for i := 0; i < 3; i++ {
		if !bytes.Equal(d.kv.block(0, 0, 13+i), p1.kv.block(0, 0, 7+i)) {
			t.Fatalf("req-c block %d not transferred", i)
		}
	}
	for i := 0; i < 3; i++ {
		if !bytes.Equal(d.kv.block(0, 0, 10+i), p2.kv.block(0, 0, 7+i)) {
			t.Fatalf("req-b block %d not transferred", i)
		}
	}
}

// The C ABI's build_meta answers nil for an idle step, and only then: a
// step with work, or with a heartbeat due, gets real metadata.
func TestBuildMetaOrIdle(t *testing.T) {
	eng := nixltest.NewEngine("t")
	// The schedulers' clock starts less than one heartbeat interval after
	// zero, the time of the last heartbeat of a scheduler that sent none
	// (the process clock would make the first one due in a test binary
	// that ran longer than the interval already).
	clock := NewFakeClock(1)
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", clock.Now, 200, nil)
	idle := func(sd *side, want bool, when string) {
		t.Helper()
		b, err := sd.sched.BuildMetaOrIdle()
		if err != nil {
			t.Fatal(err)
		}
		if (b == nil) != want {
			t.Fatalf("%s: idle %v, want %v (%d bytes)", when, b == nil, want, len(b))
		}
		if b != nil {
			if err := sd.work.StartLoadKV(b); err != nil {
				t.Fatal(err)
			}
		}
	}
	idle(p, true, "fresh prefill")
	idle(d, true, "fresh decode")
	out := prefill(t, p, "req-1", []int64{1, 2, 3}, 12)
	// prefill() handed req-1's held blocks to the worker in its last step:
	// their lease is the worker's (polled by get_finished), the scheduler
	// has nothing left.
	idle(p, true, "prefill after handing req-1 to its worker")
	dp := mustParams(t, string(out))
	d.sched.OnNewRequest("req-a", dp)
	// A heartbeat scheduled but not due (this scheduler's clock started
	// less than one interval ago) is no work for this step.
	idle(d, true, "decode with a heartbeat scheduled for req-a, not due")
	d.sched.GetNumNewMatchedTokens(dp, 12, 0)
	if _, err := d.sched.UpdateStateAfterAlloc("req-a", dp, BlockIDs{{4, 5, 6}}, []int64{0}, 12); err != nil {
		t.Fatal(err)
	}
	idle(d, false, "decode with req-a to read")
	d.waitFinished(t, "req-a", func(f Finished) bool { return contains(f.Recving, "req-a") })
	d.sched.UpdateConnectorOutput([]string{"req-a"})
	if _, _, err := d.sched.RequestFinished("req-a", dp, true, 12, BlockIDs{{4, 5, 6}}); err != nil {
		t.Fatal(err)
	}
	// These params were never marked processed (vLLM's scheduler does that
	// on the request's own copy): the finish looks like an abort before the
	// load, and one step tells the prefill to free req-1.
	idle(d, false, "decode finishing req-a")
	idle(d, true, "decode after req-a")
	p.waitFinished(t, "req-1 sent", func(f Finished) bool { return contains(f.Sending, "req-1") })
	p.sched.UpdateConnectorOutput(nil)
}

// A decode whose only pending work is heartbeats is idle between them:
// build_meta answers nil until the next one is due, IdleFor says when, and
// the step at that time carries the heartbeat. Nothing timed: -1.
func TestBuildMetaOrIdleBetweenHeartbeats(t *testing.T) {
	eng := nixltest.NewEngine("t")
	clock := NewFakeClock(1000)
	lease := map[string]any{"kv_lease_duration": 60} // heartbeats every 10 s
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, lease)
	d := newSide(t, eng, "kv_consumer", "engine-d", clock.Now, 200, lease)
	if got := d.sched.IdleFor(); got != -1 {
		t.Fatalf("fresh decode: IdleFor %v, want -1", got)
	}
	out := prefill(t, p, "req-1", []int64{1, 2, 3}, 12)
	dp := mustParams(t, string(out))
	d.sched.OnNewRequest("req-a", dp) // waiting for blocks: heartbeats keep req-1's lease
	meta := func(when string) *StepMeta {
		t.Helper()
		b, err := d.sched.BuildMetaOrIdle()
		if err != nil {
			t.Fatal(err)
		}
		if b == nil {
			return nil
		}
		m, err := DecodeStepMeta(b)
		if err != nil {
			t.Fatalf("%s: %v", when, err)
		}
		return m
	}
	if m := meta("first step"); m == nil || len(m.Heartbeats) != 1 {
		t.Fatalf("first step: %+v, want one heartbeat", m)
	}
	at := 0.0
	for _, dt := range []float64{0, 4, 9.5} {
		clock.Advance(dt - at)
		at = dt
		if m := meta("between heartbeats"); m != nil {
			t.Fatalf("%v s after a heartbeat: metadata %+v, want an idle step", dt, m)
		}
		if got, want := d.sched.IdleFor(), 10-dt; got < want-1e-9 || got > want+1e-9 {
			t.Fatalf("%v s after a heartbeat: IdleFor %v, want %v", dt, got, want)
		}
	}
	clock.Advance(10 - at)
	if got := d.sched.IdleFor(); got != 0 {
		t.Fatalf("heartbeat due: IdleFor %v, want 0", got)
	}
	if m := meta("heartbeat due"); m == nil || len(m.Heartbeats) != 1 || len(m.Heartbeats["engine-p"].ReqIDs) != 1 {
		t.Fatalf("heartbeat due: %+v, want req-1's heartbeat", m)
	}
	// New work is never held back by the heartbeat timer.
	d.sched.GetNumNewMatchedTokens(dp, 12, 0)
	if _, err := d.sched.UpdateStateAfterAlloc("req-a", dp, BlockIDs{{4, 5, 6}}, []int64{0}, 12); err != nil {
		t.Fatal(err)
	}
	if d.sched.IdleFor() != 0 {
		t.Fatal("IdleFor with a read to hand to the worker")
	}
	if m := meta("read scheduled"); m == nil || len(m.ReqsToRecv) != 1 {
		t.Fatalf("read scheduled: %+v, want req-a to receive", m)
	}
}
