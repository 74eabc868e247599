package shim

import (
	"sync"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl/nixltest"
)

// recordPub records what a worker publishes.
type recordPub struct {
	mu   sync.Mutex
	busy bool
	seq  int
}

func (r *recordPub) Publish(busy, changed bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.busy = busy
	if changed {
		r.seq++
	}
}

func (r *recordPub) get() (bool, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.busy, r.seq
}

// A worker publishes busy while anything is in flight or held, and bumps
// the change counter when a handshake finishes off vLLM's thread; idle
// again once everything is reported.
func TestIdleStatePublished(t *testing.T) {
	eng := nixltest.NewEngine("t")
	eng.SetScript(nixltest.Script{Polls: 2})
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	pub := &recordPub{}
	d.work.SetPublisher(pub)
	d.finished(t)
	if busy, _ := pub.get(); busy {
		t.Fatal("an idle decode publishes busy")
	}
	_, seq0 := pub.get()
	decodeLoad(t, d, "d1", prefill(t, p, "p1", []int64{3, 4}, 8), []int64{9, 10})
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, seq := pub.get(); seq > seq0 {
			break // the handshake finished: the next step must poll
		}
		if time.Now().After(deadline) {
			t.Fatal("the handshake's end did not bump the change counter")
		}
		time.Sleep(time.Millisecond)
	}
	if busy, _ := pub.get(); !busy {
		t.Fatal("a decode with a READ in flight does not publish busy")
	}
	d.waitFinished(t, "recv", func(f Finished) bool {
		p.finished(t)
		return contains(f.Recving, "d1")
	})
	if busy, _ := pub.get(); busy {
		t.Fatalf("busy after everything was reported: %+v", d.work.Live())
	}
}

// A heartbeat that reaches the prefill's worker before the step that
// installs the lease it names extends that lease when it is installed: the
// decode raised its lease floor on it.
func TestEarlyHeartbeatExtendsTheLease(t *testing.T) {
	clock := NewFakeClock(100)
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, map[string]any{"kv_lease_duration": 30})
	in := mustParams(t, `{"do_remote_decode": true}`)
	if _, err := p.sched.UpdateStateAfterAlloc("p1", in, nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	p.step(t)
	if _, _, err := p.sched.RequestFinished("p1", in, true, 8, BlockIDs{{3}}); err != nil {
		t.Fatal(err)
	}
	clock.Advance(20)
	fakeAgent(t, p).Inject("engine-d-agent", []byte("HB:p1")) // before the step with the lease
	p.finished(t)
	p.step(t) // installs the lease: 100+30, extended by the heartbeat to 120+20
	clock.Advance(15)
	if f := p.finished(t); contains(f.Sending, "p1") {
		t.Fatal("the lease ended at its first deadline: the early heartbeat was dropped")
	}
	clock.Advance(10)
	if f := p.finished(t); !contains(f.Sending, "p1") {
		t.Fatalf("the extended lease did not end: %+v", f)
	}
}

// Once this decode's READ told the prefill it is done with a remote
// request's blocks, a heartbeat naming that request (another request with
// the same params) raises no lease floor: the prefill freed them.
func TestHeartbeatAfterReleaseRaisesNoFloor(t *testing.T) {
	clock := NewFakeClock(100)
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, map[string]any{"kv_lease_duration": 30})
	d := newSide(t, eng, "kv_consumer", "engine-d", clock.Now, 200, map[string]any{"kv_lease_duration": 30})
	out := prefill(t, p, "p1", []int64{3}, 8)
	decodeLoad(t, d, "d1", out, []int64{9})
	d.waitFinished(t, "recv", func(f Finished) bool {
		p.finished(t)
		return contains(f.Recving, "d1")
	})
	exp := 129.0
	d.work.mu.Lock()
	d.work.sendHeartbeatsLocked(map[string]*HeartbeatInfo{"engine-p": {ReqIDs: []string{"p1"}, Expiry: map[string]float64{"p1": exp},
		Host: "127.0.0.1", Port: p.port, TPSize: 1}})
	_, floor := d.work.floors.Deadline("p1")
	d.work.mu.Unlock()
	if floor {
		t.Fatal("a heartbeat for released blocks raised the lease floor")
	}
}

// vLLM steps no engine without requests: a push prefill whose engine is
// idle still answers a decode's cancel (its idle poller drains it), so the
// decode gets its blocks back without the prefill's next request.
func TestIdlePrefillAnswersCancel(t *testing.T) {
	old := idlePollAfter
	idlePollAfter = 20 * time.Millisecond
	defer func() { idlePollAfter = old }()
	clock := NewFakeClock(100)
	_, p, d := pushPair(t, clock, map[string]any{"push_registration_timeout": 5})
	did := "cmpl-i-0-bbbbbbbb"
	pushDecode(t, d, p, did, "cmpl-i-0", 8, []int64{9}, nil)
	p.waitFinished(t, "registration stored", func(Finished) bool { return len(p.work.push.regs) == 1 })
	clock.Advance(6) // the decode times out and asks the prefill
	f := d.finished(t)
	if !contains(f.Failed, did) {
		t.Fatalf("no failure after the timeout: %+v", f)
	}
	// From here on nobody calls the prefill's GetFinished.
	deadline := time.Now().Add(10 * time.Second)
	for {
		if f := d.finished(t); contains(f.Recving, did) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("an idle prefill never answered the cancel")
		}
		time.Sleep(5 * time.Millisecond)
	}
}
