package shim

import (
	"bytes"
	"encoding/json"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/nixltest"
)

var _ nixl.PostCopies = (*nixltest.Agent)(nil)

// Posting from the worker's poster (post.go), for an agent whose Post
// copies on the caller's thread (the NIXL engine): tests with the fake
// engine's Script.PostCopies and a PostHook that holds posts.

// postGate holds every post at its start until opened (while disarmed,
// posts pass).
type postGate struct {
	entered  chan uint64
	release  chan struct{}
	once     sync.Once
	disarmed atomic.Bool
}

func newPostGate() *postGate {
	return &postGate{entered: make(chan uint64, 64), release: make(chan struct{})}
}

func (g *postGate) hook(id uint64) {
	if g.disarmed.Load() {
		return
	}
	g.entered <- id
	<-g.release
}

func (g *postGate) open() { g.once.Do(func() { close(g.release) }) }

// wait returns the id of the next post that reached the gate.
func (g *postGate) wait(t *testing.T) uint64 {
	t.Helper()
	select {
	case id := <-g.entered:
		return id
	case <-time.After(10 * time.Second):
		t.Fatal("no post reached the gate")
		return 0
	}
}

// idleNow waits until the worker's poster has no post queued or running.
func idleNow(t *testing.T, w *Worker) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		w.mu.Lock()
		n := len(w.postQueue) + int(w.postsRunning.Load())
		w.mu.Unlock()
		if n == 0 {
			return
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatal("the poster did not finish")
}

// calls returns the number of calls of each op on sd's agent.
func agentCalls(t *testing.T, sd *side, ops ...string) []int {
	t.Helper()
	a := fakeAgent(t, sd)
	out := make([]int, len(ops))
	for i, op := range ops {
		out[i] = a.CountCalls(op)
	}
	return out
}

// A READ is posted from the poster, without the worker's lock: vLLM's
// start_load_kv returns at once, get_finished meanwhile makes no call on
// the agent (the NIXL engine's one lock would make it wait behind the
// post), a READ for another request is put off, and both complete once
// the post returned.
func TestPostOffTheModelThread(t *testing.T) {
	eng := nixltest.NewEngine("t")
	g := newPostGate()
	var d *side
	var unlocked atomic.Bool
	eng.SetScript(nixltest.Script{Polls: 2, PostCopies: true, PostHook: func(id uint64) {
		// The worker's lock is not held across the post (other
		// goroutines may hold it a moment: tried for a while).
		for i := 0; i < 1000 && !unlocked.Load(); i++ {
			if d.work.mu.TryLock() {
				d.work.mu.Unlock()
				unlocked.Store(true)
				break
			}
			time.Sleep(time.Millisecond)
		}
		g.hook(id)
	}})
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d = newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	defer g.open()
	// The engine known first (its first READ is posted at the end of the
	// handshake): req-a's READ is then made in start_load_kv.
	g.disarmed.Store(true)
	loadFrom(t, d, p, "req-0", "req-z", []int64{1}, []int64{2})
	d.waitFinished(t, "first READ", func(f Finished) bool { return contains(f.Recving, "req-z") })
	g.disarmed.Store(false)
	unlocked.Store(false)

	loaded := make(chan struct{})
	go func() {
		defer close(loaded)
		loadFrom(t, d, p, "req-1", "req-a", []int64{1, 2, 3}, []int64{4, 5, 6})
	}()
	select {
	case <-loaded:
	case <-time.After(10 * time.Second):
		t.Fatal("start_load_kv waited for the post")
	}
	g.wait(t) // the poster posts req-a's READ
	if !unlocked.Load() {
		t.Fatal("the worker's lock was held across the post")
	}
	if l := d.work.Live(); l.TransferHandles != 1 || l.ReceivingRequests != 1 {
		t.Fatalf("live while posting: %+v, want the READ in flight", l)
	}
	before := agentCalls(t, d, "Check", "GetNotifs", "MakeXfer", "ReleaseXfer")
	for i := 0; i < 3; i++ {
		if f := d.finished(t); len(f.Recving)+len(f.Failed) != 0 {
			t.Fatalf("get_finished while posting reported %+v", f)
		}
		d.work.IdlePoll()
	}
	// Another request for the same (known) engine: put off, not made.
	loadFrom(t, d, p, "req-2", "req-b", []int64{7, 8, 9}, []int64{10, 11, 12})
	d.work.mu.Lock()
	st := d.work.recv["req-b"]
	deferred := st != nil && st.waiting && len(st.xfers) == 0 && len(d.work.deferred) == 1
	d.work.mu.Unlock()
	if !deferred {
		t.Fatalf("req-b's READ was not put off while a post ran: %+v", st)
	}
	if after := agentCalls(t, d, "Check", "GetNotifs", "MakeXfer", "ReleaseXfer"); !equalInts(after, before) {
		t.Fatalf("calls on the agent while it posted (Check, GetNotifs, MakeXfer, ReleaseXfer): %v -> %v", before, after)
	}

	g.open()
	d.waitFinished(t, "both READs", func(f Finished) bool {
		return contains(f.Recving, "req-a") && contains(f.Recving, "req-b") && len(f.Failed) == 0
	})
	for i := 0; i < 3; i++ {
		if !bytes.Equal(d.kv.block(0, 0, 4+i), p.kv.block(0, 0, 1+i)) || !bytes.Equal(d.kv.block(1, 1, 10+i), p.kv.block(1, 1, 7+i)) {
			t.Fatalf("block %d not transferred", i)
		}
	}
	if n := agentCalls(t, d, "Post")[0]; n != 3 {
		t.Fatalf("%d posts, want 3", n)
	}
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// An agent whose Post does not copy (the ucx engine) is posted in place,
// from the caller's call, as before; so is one whose Post copies when
// post_off_model_thread is false.
func TestPostInPlace(t *testing.T) {
	for _, c := range []struct {
		name       string
		postCopies bool
		extra      map[string]any
	}{
		{"Post does not copy", false, nil},
		{"post_off_model_thread false", true, map[string]any{"post_off_model_thread": "false"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			eng := nixltest.NewEngine("t")
			var d *side
			var inPlace, posts atomic.Int32
			eng.SetScript(nixltest.Script{PostCopies: c.postCopies, PostHook: func(uint64) {
				posts.Add(1)
				if !d.work.mu.TryLock() {
					inPlace.Add(1) // the caller holds the worker's lock
				} else {
					d.work.mu.Unlock()
				}
			}})
			p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, c.extra)
			d = newSide(t, eng, "kv_consumer", "engine-d", nil, 200, c.extra)
			loadFrom(t, d, p, "req-1", "req-a", []int64{1, 2}, []int64{4, 5})
			d.waitFinished(t, "READ", func(f Finished) bool { return contains(f.Recving, "req-a") })
			if posts.Load() != 1 || inPlace.Load() != 1 {
				t.Fatalf("%d posts, %d under the worker's lock: want 1 in place", posts.Load(), inPlace.Load())
			}
			d.work.mu.Lock()
			on := d.work.posterOn
			d.work.mu.Unlock()
			if on {
				t.Fatal("a poster runs")
			}
		})
	}
}

// A post that fails on the poster is reported at the next poll as one in
// place is: failed_recving and finished_recving once, load errors, the
// handle released, a disconnected engine dropped.
func TestPostErrorReportedOnce(t *testing.T) {
	eng := nixltest.NewEngine("t")
	eng.SetScript(nixltest.Script{PostCopies: true})
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	fakeAgent(t, d).FailNext(nixltest.StepPost, nixl.ErrRemoteDiscon)
	loadFrom(t, d, p, "req-1", "req-f", []int64{3, 4}, []int64{10, 11})
	f := d.waitFinished(t, "failed READ", func(f Finished) bool { return contains(f.Recving, "req-f") })
	idleNow(t, d.work)
	for i := 0; i < 5; i++ {
		g := d.finished(t)
		f.Recving, f.Failed = append(f.Recving, g.Recving...), append(f.Failed, g.Failed...)
	}
	if len(f.Recving) != 1 || len(f.Failed) != 1 || f.Failed[0] != "req-f" {
		t.Fatalf("reported %+v, want req-f failed and received once", f)
	}
	if got := d.work.LoadErrors(); len(got) != 2 || got[0] != 10 || got[1] != 11 {
		t.Fatalf("load errors %v, want [10 11]", got)
	}
	if _, xs := fakeAgent(t, d).Live(); xs != 0 {
		t.Fatalf("%d transfer handles left", xs)
	}
	var st map[string][]float64
	_ = json.Unmarshal(d.work.Stats(), &st)
	if len(st["num_failed_transfers"]) != 1 {
		t.Errorf("stats %v", st)
	}
	d.work.mu.Lock()
	_, kept := d.work.remotes["engine-p"]
	d.work.mu.Unlock()
	if kept {
		t.Error("remote engine kept after ERR_REMOTE_DISCONNECT from the post")
	}
}

// A READ still being posted when its transfer_timeout and the remote
// lease pass is neither failed nor released until its Post returned; then
// it times out, and its blocks are given back only once the engine could
// release the handle (here: after the transfer ended).
func TestPostOutlivesTimeoutHeldUntilReleased(t *testing.T) {
	clock := NewFakeClock(100)
	eng := nixltest.NewEngine("t")
	g := newPostGate()
	eng.SetScript(nixltest.Script{Polls: 1 << 30, PostCopies: true, PostHook: g.hook,
		RefuseReleaseInFlight: true, InFlightSurvivesInvalidate: true})
	extra := map[string]any{"kv_lease_duration": 30, "transfer_timeout": 5}
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, extra)
	d := newSide(t, eng, "kv_consumer", "engine-d", clock.Now, 200, extra)
	defer g.open()
	loadFrom(t, d, p, "req-1", "req-t", []int64{3}, []int64{9})
	id := g.wait(t)
	clock.Advance(40) // past transfer_timeout and the lease
	for i := 0; i < 3; i++ {
		if f := d.finished(t); len(f.Recving)+len(f.Failed) != 0 {
			t.Fatalf("reported while posting: %+v", f)
		}
	}
	if n := agentCalls(t, d, "ReleaseXfer")[0]; n != 0 {
		t.Fatalf("%d releases of a transfer being posted", n)
	}
	g.open()
	idleNow(t, d.work)
	f := d.waitFinished(t, "timeout", func(f Finished) bool { return contains(f.Failed, "req-t") })
	for i := 0; i < 5; i++ {
		f.Recving = append(f.Recving, d.finished(t).Recving...)
	}
	if contains(f.Recving, "req-t") {
		t.Fatalf("blocks given back with the READ's handle unreleased: %+v", f)
	}
	if l := d.work.Live(); l.StuckHandles != 1 {
		t.Fatalf("live %+v, want the handle held", l)
	}
	eng.Settle(id, true) // the transfer ends: the handle can go
	clock.Advance(stuckRetry)
	d.waitFinished(t, "released", func(f Finished) bool { return contains(f.Recving, "req-t") })
}

// Close waits for a post in progress before it releases the handles.
func TestCloseWaitsForPost(t *testing.T) {
	eng := nixltest.NewEngine("t")
	g := newPostGate()
	eng.SetScript(nixltest.Script{Polls: 1 << 30, PostCopies: true, PostHook: g.hook})
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	defer g.open()
	loadFrom(t, d, p, "req-1", "req-c", []int64{3}, []int64{9})
	g.wait(t)
	closed := make(chan error, 1)
	go func() { closed <- d.work.Close() }()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) with a post in progress", err)
	case <-time.After(50 * time.Millisecond):
	}
	if n := agentCalls(t, d, "ReleaseXfer")[0]; n != 0 {
		t.Fatalf("%d releases while the post ran", n)
	}
	g.open()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return after the post")
	}
	if n := agentCalls(t, d, "ReleaseXfer")[0]; n != 1 {
		t.Fatalf("%d releases at Close, want 1", n)
	}
}

// A panic in a post fails that READ (reported once), is counted, and the
// worker keeps posting.
func TestPostPanicFailsTheTransfer(t *testing.T) {
	eng := nixltest.NewEngine("t")
	var n atomic.Int32
	eng.SetScript(nixltest.Script{PostCopies: true, PostHook: func(uint64) {
		if n.Add(1) == 1 {
			panic("injected")
		}
	}})
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	loadFrom(t, d, p, "req-1", "req-x", []int64{3}, []int64{9})
	f := d.waitFinished(t, "failed", func(f Finished) bool { return contains(f.Recving, "req-x") })
	if !contains(f.Failed, "req-x") {
		t.Fatalf("%+v, want req-x failed", f)
	}
	if l := d.work.Live(); l.Panics != 1 || l.TransferHandles != 0 {
		t.Fatalf("live %+v", l)
	}
	loadFrom(t, d, p, "req-2", "req-y", []int64{4}, []int64{10})
	if f := d.waitFinished(t, "next READ", func(f Finished) bool { return contains(f.Recving, "req-y") }); len(f.Failed) != 0 {
		t.Fatalf("%+v", f)
	}
}

// A panic in the poster outside a post fails every post it had not made:
// each is reported once, released, never posted.
func TestPosterPanicFailsItsQueue(t *testing.T) {
	eng := nixltest.NewEngine("t")
	eng.SetScript(nixltest.Script{PostCopies: true})
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	var once atomic.Bool
	testPanicHook = func(what string) {
		if what == "transfer poster" && once.CompareAndSwap(false, true) {
			panic("injected")
		}
	}
	t.Cleanup(func() { testPanicHook = nil })
	loadFrom(t, d, p, "req-1", "req-x", []int64{3}, []int64{9})
	f := d.waitFinished(t, "failed", func(f Finished) bool { return contains(f.Recving, "req-x") })
	if !contains(f.Failed, "req-x") || agentCalls(t, d, "Post")[0] != 0 {
		t.Fatalf("%+v, %d posts: want req-x failed, never posted", f, agentCalls(t, d, "Post")[0])
	}
	if l := d.work.Live(); l.Panics != 1 || l.TransferHandles != 0 {
		t.Fatalf("live %+v", l)
	}
	loadFrom(t, d, p, "req-2", "req-y", []int64{4}, []int64{10})
	if f := d.waitFinished(t, "next READ", func(f Finished) bool { return contains(f.Recving, "req-y") }); len(f.Failed) != 0 {
		t.Fatalf("%+v", f)
	}
}

// Push: a WRITE being posted when its request's lease ends keeps the
// blocks; polls are put off meanwhile; finished_sending comes once the
// WRITE completed.
func TestPushWriteBeingPostedKeepsBlocks(t *testing.T) {
	clock := NewFakeClock(100)
	g := newPostGate()
	_, p, d := pushPair(t, clock, map[string]any{"kv_lease_duration": 30, "transfer_timeout": 1000, "push_registration_timeout": 1000},
		nixltest.Script{Polls: 3, PostCopies: true, PostHook: g.hook})
	defer g.open()
	pid, did := "cmpl-w-0-aaaaaaaa", "cmpl-w-0-bbbbbbbb"
	pushPrefill(t, p, pid, []int64{3, 4}, 8)
	pushDecode(t, d, p, did, "cmpl-w-0", 8, []int64{9, 10}, nil)
	// The registration arrives after the decode's handshake: matched, a
	// handshake with the decode, the WRITE made and handed to the poster.
	waitPosting(t, p, g)
	clock.Advance(40) // past the lease
	before := agentCalls(t, p, "Check", "GetNotifs", "ReleaseXfer")
	for i := 0; i < 3; i++ {
		if f := p.finished(t); len(f.Sending) != 0 {
			t.Fatalf("finished_sending while the WRITE is being posted: %+v", f)
		}
	}
	if after := agentCalls(t, p, "Check", "GetNotifs", "ReleaseXfer"); !equalInts(after, before) {
		t.Fatalf("calls on the agent while it posted: %v -> %v", before, after)
	}
	if l := p.work.Live(); l.TransferHandles != 1 || l.PushSends != 1 {
		t.Fatalf("prefill live %+v", l)
	}
	g.open()
	var sent bool
	d.waitFinished(t, "decode recv", func(f Finished) bool {
		sent = sent || contains(p.finished(t).Sending, pid)
		return contains(f.Recving, did) && len(f.Failed) == 0
	})
	checkBlocks(t, d, p, []int64{9, 10}, []int64{3, 4})
	if !sent {
		p.waitFinished(t, "prefill frees", func(f Finished) bool { return contains(f.Sending, pid) })
	}
}

// waitPosting polls sd until a post reaches the gate.
func waitPosting(t *testing.T, sd *side, g *postGate) uint64 {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case id := <-g.entered:
			return id
		default:
		}
		sd.finished(t)
		time.Sleep(time.Millisecond)
	}
	t.Fatal("no post reached the gate")
	return 0
}

// Push: a WRITE that fails on the poster is reported once: the decode is
// told (FAILED) after the handle was released, and the prefill frees the
// blocks once.
func TestPushPostErrorReportedOnce(t *testing.T) {
	_, p, d := pushPair(t, nil, nil, nixltest.Script{PostCopies: true})
	pid, did := "cmpl-e-0-aaaaaaaa", "cmpl-e-0-bbbbbbbb"
	fakeAgent(t, p).FailNext(nixltest.StepPost, nixl.ErrBackend)
	pushPrefill(t, p, pid, []int64{3, 4}, 8)
	pushDecode(t, d, p, did, "cmpl-e-0", 8, []int64{9, 10}, nil)
	var sending []string
	f := d.waitFinished(t, "decode fails", func(f Finished) bool {
		sending = append(sending, p.finished(t).Sending...)
		return contains(f.Failed, did) && contains(f.Recving, did)
	})
	for i := 0; i < 5; i++ {
		sending = append(sending, p.finished(t).Sending...)
		g := d.finished(t)
		f.Failed = append(f.Failed, g.Failed...)
	}
	if len(f.Failed) != 1 {
		t.Fatalf("decode failures %v, want one", f.Failed)
	}
	if len(sending) != 1 || sending[0] != pid {
		t.Fatalf("prefill finished_sending %v, want %s once", sending, pid)
	}
	if _, xs := fakeAgent(t, p).Live(); xs != 0 {
		t.Fatalf("%d WRITE handles left", xs)
	}
}

// earlyPushPosting announces push pid (blocks) on p after the decode
// registered, runs its forward (filled with 0x30) and returns the bytes the
// decode must get; the WRITE's post is then in the poster's hands.
func earlyPushPosting(t *testing.T, p, d *side, pid, did string, blocks []int64) [][]byte {
	t.Helper()
	pushDecode(t, d, p, did, "cmpl-q-0", 8, []int64{9, 10}, nil)
	p.waitFinished(t, "registration stored", func(Finished) bool { return len(p.work.push.regs) == 1 })
	in := mustParams(t, `{"do_remote_decode": true}`)
	if _, err := p.sched.UpdateStateAfterAlloc(pid, in, nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	if err := p.sched.PushPromptDone(pid, in, BlockIDs{blocks}, 0); err != nil {
		t.Fatal(err)
	}
	p.step(t)
	fill(p, blocks, 0x30)
	// The handshake with the decode ends on its goroutine: matched.
	deadline := time.Now().Add(10 * time.Second)
	for {
		p.work.mu.Lock()
		ps := p.work.push.sends[pid]
		ready := ps != nil && ps.state == sendComputing
		p.work.mu.Unlock()
		if ready {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the push was not matched")
		}
		time.Sleep(time.Millisecond)
	}
	return [][]byte{bytes.Clone(p.kv.block(0, 0, int(blocks[0]))), bytes.Clone(p.kv.block(1, 1, int(blocks[1])))}
}

// afterPreemption finishes the test of a preempted early push: the next
// forward reuses the blocks, the decode got the announcing step's KV, and
// the recomputed request is freed.
func afterPreemption(t *testing.T, p, d *side, pid, did string, blocks []int64, want [][]byte) {
	t.Helper()
	fill(p, blocks, 0x90)
	f := d.waitFinished(t, "decode recv", func(f Finished) bool {
		p.finished(t)
		return contains(f.Recving, did)
	})
	if len(f.Failed) != 0 {
		t.Fatalf("failed: %+v", f)
	}
	if !bytes.Equal(d.kv.block(0, 0, 9), want[0]) || !bytes.Equal(d.kv.block(1, 1, 10), want[1]) {
		t.Fatal("the decode got the reusing request's KV")
	}
	in := mustParams(t, `{"do_remote_decode": true}`)
	if _, _, err := p.sched.RequestFinished(pid, in, true, 8, BlockIDs{{5, 6}}); err != nil {
		t.Fatal(err)
	}
	p.step(t)
	p.waitFinished(t, "finished_sending", func(f Finished) bool { return contains(f.Sending, pid) })
}

// An announced push preempted while the poster posts its WRITE: vLLM's
// handle_preemptions returns only once the post returned and the WRITE
// completed, before the forward that reuses the blocks.
func TestPushPreemptedWhileWriteIsPosted(t *testing.T) {
	g := newPostGate()
	_, p, d := pushPair(t, nil, nil, nixltest.Script{Polls: 5, PostCopies: true, PostHook: g.hook})
	defer g.open()
	pid, did := "cmpl-q-0-aaaaaaaa", "cmpl-q-0-bbbbbbbb"
	blocks := []int64{1, 2}
	want := earlyPushPosting(t, p, d, pid, did, blocks)
	p.finished(t) // after the forward: the WRITE goes to the poster
	g.wait(t)
	p.sched.PushPreempted([]string{pid})
	b, err := p.sched.BuildMeta()
	if err != nil {
		t.Fatal(err)
	}
	fenced := make(chan error, 1)
	go func() { fenced <- p.work.HandlePreemptions(b) }()
	select {
	case err := <-fenced:
		t.Fatalf("handle_preemptions returned (%v) with the WRITE still being posted", err)
	case <-time.After(50 * time.Millisecond):
	}
	g.open()
	select {
	case err := <-fenced:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the fence did not end after the post")
	}
	if l := p.work.Live(); l.TransferHandles != 0 {
		t.Fatalf("handle_preemptions returned with the WRITE in flight: %+v", l)
	}
	if err := p.work.StartLoadKV(b); err != nil {
		t.Fatal(err)
	}
	afterPreemption(t, p, d, pid, did, blocks, want)
}

// The fence of a preempted push whose WRITE is still queued (made in this
// call, not yet taken by the poster): the fence posts it itself and waits
// for it.
func TestPushPreemptedWriteQueuedFenced(t *testing.T) {
	_, p, d := pushPair(t, nil, nil, nixltest.Script{Polls: 5, PostCopies: true})
	pid, did := "cmpl-q-0-aaaaaaaa", "cmpl-q-0-bbbbbbbb"
	blocks := []int64{1, 2}
	want := earlyPushPosting(t, p, d, pid, did, blocks)
	w := p.work
	w.mu.Lock()
	w.pushComputedLocked() // the forward is done: the WRITE is made and queued
	queued := len(w.postQueue)
	w.pushPreemptedLocked([]string{pid})
	left, handles := len(w.postQueue), 0
	if ps := w.push.sends[pid]; ps != nil {
		handles = len(ps.xfers)
	}
	w.mu.Unlock()
	if queued != 1 || left != 0 || handles != 0 {
		t.Fatalf("queued %d, left in the queue %d, handles after the fence %d: want 1, 0, 0", queued, left, handles)
	}
	if n := agentCalls(t, p, "Post")[0]; n != 1 {
		t.Fatalf("%d posts, want the fence's one", n)
	}
	afterPreemption(t, p, d, pid, did, blocks, want)
}

// stubXfer counts the calls on a transfer handle.
type stubXfer struct{ posts, checks, releases int }

func (x *stubXfer) Post() (nixl.Status, error)  { x.posts++; return nixl.InProgress, nil }
func (x *stubXfer) Check() (nixl.Status, error) { x.checks++; return nixl.InProgress, nil }
func (x *stubXfer) Telemetry() (nixl.Telemetry, nixl.Status) {
	return nixl.Telemetry{}, nixl.ErrNoTelemetry
}
func (x *stubXfer) Release() error { x.releases++; return nil }

// A push that fails while some of its WRITEs are with the poster (one
// rank's make failed, or a fence saw another fail): a WRITE still queued
// is dropped, never posted; one being posted is released only once its
// Post returned; the push ends (FAILED, blocks freed) only then.
func TestPushFailedWaitsForItsPosts(t *testing.T) {
	_, p, _ := pushPair(t, nil, nil, nixltest.Script{PostCopies: true})
	w := p.work
	queued, running, plain := &stubXfer{}, &stubXfer{}, &stubXfer{}
	fq := &inflight{x: queued, post: &postState{x: queued, done: make(chan struct{})}}
	fr := &inflight{x: running, post: &postState{x: running, done: make(chan struct{}), taken: true}}
	fp := &inflight{x: plain}
	reg := &pushReg{}
	reg.RequestID, reg.DecodeEngineID = "cmpl-s-0-bbbbbbbb", "engine-d"
	ps := &pushSend{id: "cmpl-s-0-aaaaaaaa", state: sendWriting, reg: reg, computed: true, xfers: []*inflight{fq, fr, fp}}

	w.mu.Lock()
	w.push.sends[ps.id] = ps
	w.push.order = append(w.push.order, ps.id)
	w.toProcess[ps.id] = struct{}{}
	w.postQueue = append(w.postQueue, fq.post)
	w.pushFailedLocked(ps)
	state, left, queue := ps.state, len(ps.xfers), len(w.postQueue)
	w.mu.Unlock()
	if queued.posts != 0 || queued.releases != 1 || queue != 0 {
		t.Fatalf("queued WRITE: %d posts, %d releases, queue %d: want dropped and released", queued.posts, queued.releases, queue)
	}
	if running.releases != 0 || plain.releases != 1 {
		t.Fatalf("releases: being posted %d (want 0), posted %d (want 1)", running.releases, plain.releases)
	}
	if state != sendReleasing || left != 1 {
		t.Fatalf("push %v with %d handles, want releasing with the one being posted", state, left)
	}
	if f := p.finished(t); contains(f.Sending, ps.id) {
		t.Fatalf("blocks freed with a WRITE being posted: %+v", f)
	}
	close(fr.post.done) // its Post returned
	f := p.waitFinished(t, "freed", func(f Finished) bool { return contains(f.Sending, ps.id) })
	if running.releases != 1 || running.checks != 0 {
		t.Fatalf("the WRITE whose post returned: %d releases, %d checks; want released once", running.releases, running.checks)
	}
	_ = f
}
