package shim

import (
	"bytes"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl/nixltest"
	"github.com/gonixl/gonixl/shim/kvwire"
	"github.com/gonixl/gonixl/sidechannel"
)

// Who owns a push's blocks, finding by finding (docs/ARCHITECTURE.md,
// "Block ownership"). Each test drives one hand-over with the fake engine
// and the injected clock and checks that vLLM gets no block back while a
// transfer may still touch it.

func fakeAgent(t *testing.T, sd *side) *nixltest.Agent {
	t.Helper()
	a, ok := sd.work.agent.(*nixltest.Agent)
	if !ok {
		t.Fatalf("worker agent is %T", sd.work.agent)
	}
	return a
}

// fill writes a pattern into blocks of a side's KV memory (a "forward").
func fill(sd *side, blocks []int64, tag byte) {
	for l := 0; l < tLayers; l++ {
		for kv := 0; kv < 2; kv++ {
			for _, b := range blocks {
				blk := sd.kv.block(l, kv, int(b))
				for i := range blk {
					blk[i] = tag + byte(l) + byte(kv) + byte(b)
				}
			}
		}
	}
}

// A WRITE that timed out and whose handle the engine will not release may
// still be writing: the decode is not told (and keeps its blocks) until
// the handle is released; then FAILED goes out and both sides let go.
func TestPushTimedOutWriteHeldUntilReleased(t *testing.T) {
	clock := NewFakeClock(100)
	_, p, d := pushPair(t, clock, map[string]any{"transfer_timeout": 5, "kv_lease_duration": 30, "push_registration_timeout": 300},
		nixltest.Script{Polls: 1 << 30, FailStep: nixltest.StepReleaseXfer})
	pid, did := "cmpl-r-0-aaaaaaaa", "cmpl-r-0-bbbbbbbb"
	pushPrefill(t, p, pid, []int64{3, 4}, 8)
	pushDecode(t, d, p, did, "cmpl-r-0", 8, []int64{9, 10}, nil)
	p.waitFinished(t, "WRITE posted", func(Finished) bool { return p.work.Live().TransferHandles == 1 })
	clock.Advance(6) // past transfer_timeout
	for i := 0; i < 20; i++ {
		p.finished(t)
		if f := d.finished(t); len(f.Recving)+len(f.Failed) != 0 {
			t.Fatalf("decode let go while the prefill's WRITE handle is not released: %+v", f)
		}
		time.Sleep(2 * time.Millisecond)
	}
	if l := p.work.Live(); l.StuckHandles != 1 || l.PushSends != 1 {
		t.Fatalf("prefill live %+v: want the stuck WRITE kept", l)
	}
	// The engine can release it now.
	fakeAgent(t, p).SetScript(nixltest.Script{Polls: 1 << 30})
	clock.Advance(stuckRetry)
	f := d.waitFinished(t, "decode fails and lets go", func(f Finished) bool {
		p.finished(t)
		return contains(f.Recving, did)
	})
	if !contains(f.Failed, did) {
		t.Fatalf("decode: %+v, want failed", f)
	}
	if l := p.work.Live(); l.TransferHandles != 0 || l.PushSends != 0 {
		t.Fatalf("prefill live %+v after release", l)
	}
}

// A prompt announced for its early WRITE holds preemption off until its
// request_finished (vLLM's has_pending_block_frees).
func TestPushAnnouncedHoldsPreemptionOff(t *testing.T) {
	clock := NewFakeClock(100)
	_, p, _ := pushPair(t, clock, nil)
	in := mustParams(t, `{"do_remote_decode": true}`)
	if p.sched.PendingBlockFrees() {
		t.Fatal("pending block frees with nothing announced")
	}
	if err := p.sched.PushPromptDone("a", in, BlockIDs{{1, 2}}, 0); err != nil {
		t.Fatal(err)
	}
	if !p.sched.PendingBlockFrees() {
		t.Fatal("an announced request does not hold preemption off")
	}
	if n := p.sched.Live().PreemptionsDeferred; n != 1 {
		t.Fatalf("preemptions deferred %d, want 1 (gonixl_scheduler_preemptions_deferred_total)", n)
	}
	if _, _, err := p.sched.RequestFinished("a", in, true, 8, BlockIDs{{1, 2}}); err != nil {
		t.Fatal(err)
	}
	if p.sched.PendingBlockFrees() {
		t.Fatal("still pending after request_finished")
	}
	// One that never finishes stops holding it off after a while.
	if err := p.sched.PushPromptDone("b", in, BlockIDs{{3}}, 0); err != nil {
		t.Fatal(err)
	}
	clock.Advance(pushAnnounceStale + 1)
	if p.sched.PendingBlockFrees() {
		t.Fatal("a stale announcement holds preemption off for ever")
	}
	if n := p.sched.Live().PreemptionsDeferred; n != 1 {
		t.Fatalf("preemptions deferred %d, want 1: only answers of true count", n)
	}
}

// An announced request that vLLM preempts anyway before its WRITE was
// posted is not written from the freed blocks: its registration waits for
// the recomputed request, whose new blocks are written.
func TestPushPreemptedBeforeWrite(t *testing.T) {
	_, p, d := pushPair(t, nil, nil)
	pid, did := "cmpl-p-0-aaaaaaaa", "cmpl-p-0-bbbbbbbb"
	in := mustParams(t, `{"do_remote_decode": true}`)
	if _, err := p.sched.UpdateStateAfterAlloc(pid, in, nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	old, recomputed := []int64{1, 2}, []int64{5, 6}
	if err := p.sched.PushPromptDone(pid, in, BlockIDs{old}, 0); err != nil {
		t.Fatal(err)
	}
	p.step(t)
	fill(p, old, 0x10)
	p.finished(t) // the forward is done
	// vLLM preempts it (freeing old) and another request's forward fills them.
	p.sched.PushPreempted([]string{pid, "not-announced"})
	p.step(t)
	fill(p, old, 0x70)
	if p.sched.PendingBlockFrees() {
		t.Fatal("a preempted request still holds preemption off")
	}
	pushDecode(t, d, p, did, "cmpl-p-0", 8, []int64{9, 10}, nil)
	p.waitFinished(t, "registration kept for the recomputed request", func(Finished) bool { return len(p.work.push.regs) == 1 })
	if f := d.finished(t); len(f.Recving) != 0 {
		t.Fatalf("decode received from a preempted request's freed blocks: %+v", f)
	}
	// Recomputed: new blocks, finished normally.
	fill(p, recomputed, 0x20)
	if delay, _, err := p.sched.RequestFinished(pid, in, true, 8, BlockIDs{recomputed}); err != nil || !delay {
		t.Fatalf("request_finished: %v %v", delay, err)
	}
	p.step(t)
	f := d.waitFinished(t, "decode recv", func(f Finished) bool {
		p.finished(t)
		return contains(f.Recving, did)
	})
	if len(f.Failed) != 0 {
		t.Fatalf("failed: %+v", f)
	}
	checkBlocks(t, d, p, []int64{9, 10}, recomputed)
}

// An announced request preempted while its WRITE is in flight: the
// start_load_kv that carries the preemption returns only once the WRITE
// has read the blocks, before the forward that reuses them.
func TestPushPreemptedWriteFenced(t *testing.T) {
	_, p, d := pushPair(t, nil, nil, nixltest.Script{Polls: 50})
	pid, did := "cmpl-q-0-aaaaaaaa", "cmpl-q-0-bbbbbbbb"
	pushDecode(t, d, p, did, "cmpl-q-0", 8, []int64{9, 10}, nil)
	p.waitFinished(t, "registration stored", func(Finished) bool { return len(p.work.push.regs) == 1 })
	in := mustParams(t, `{"do_remote_decode": true}`)
	if _, err := p.sched.UpdateStateAfterAlloc(pid, in, nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	blocks := []int64{1, 2}
	if err := p.sched.PushPromptDone(pid, in, BlockIDs{blocks}, 0); err != nil {
		t.Fatal(err)
	}
	p.step(t)
	fill(p, blocks, 0x30)
	want := [][]byte{bytes.Clone(p.kv.block(0, 0, 1)), bytes.Clone(p.kv.block(1, 1, 2))}
	// After the forward (and the handshake with the decode): the WRITE is
	// posted, 50 polls from done.
	p.waitFinished(t, "WRITE posted", func(Finished) bool { return p.work.Live().TransferHandles == 1 })
	p.sched.PushPreempted([]string{pid})
	p.step(t) // fences
	if l := p.work.Live(); l.TransferHandles != 0 {
		t.Fatalf("start_load_kv returned with the WRITE in flight: %+v", l)
	}
	fill(p, blocks, 0x90) // the next forward reuses them
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
	// Recomputed and finished: its (new) blocks are freed at once.
	if _, _, err := p.sched.RequestFinished(pid, in, true, 8, BlockIDs{{5, 6}}); err != nil {
		t.Fatal(err)
	}
	p.step(t)
	p.waitFinished(t, "finished_sending", func(f Finished) bool { return contains(f.Sending, pid) })
	if l := p.work.Live(); l.PushSends != 0 {
		t.Fatalf("prefill live %+v", l)
	}
}

// engine_ttl eviction does not end a push wait: the prefill may still
// WRITE.
func TestEngineTTLKeepsPushWait(t *testing.T) {
	clock := NewFakeClock(100)
	_, p, d := pushPair(t, clock, map[string]any{"engine_ttl": 10, "push_registration_timeout": 1000, "kv_lease_duration": 30})
	did := "cmpl-t-0-bbbbbbbb"
	pushDecode(t, d, p, did, "cmpl-t-0", 8, []int64{9, 10}, nil)
	p.waitFinished(t, "registration stored", func(Finished) bool { return len(p.work.push.regs) == 1 })
	clock.Advance(20)
	for i := 0; i < 5; i++ {
		if f := d.finished(t); len(f.Recving)+len(f.Failed) != 0 {
			t.Fatalf("eviction ended the push wait: %+v", f)
		}
	}
	if d.work.Live().RemoteEngines != 1 {
		t.Fatal("the prefill was evicted while a push wait holds blocks it may write")
	}
	// The WRITE still lands.
	pushPrefill(t, p, "cmpl-t-0-aaaaaaaa", []int64{3, 4}, 8)
	d.waitFinished(t, "decode recv", func(f Finished) bool {
		p.finished(t)
		return contains(f.Recving, did)
	})
	checkBlocks(t, d, p, []int64{9, 10}, []int64{3, 4})
}

// A registration is consumed once: a copy that arrives after the match
// (another decode rank's, or a late duplicate) is not kept, so a later
// request with the same client id cannot write into blocks the first
// decode request gave back.
func TestPushRegistrationCopyConsumed(t *testing.T) {
	_, p, d := pushPair(t, nil, nil)
	pid, did := "cmpl-c-0-aaaaaaaa", "cmpl-c-0-bbbbbbbb"
	pushPrefill(t, p, pid, []int64{3, 4}, 8)
	pushDecode(t, d, p, did, "cmpl-c-0", 8, []int64{9, 10}, nil)
	d.waitFinished(t, "decode recv", func(f Finished) bool {
		p.finished(t)
		return contains(f.Recving, did)
	})
	// The copy.
	reg := d.work.pushRegOf(&recvState{id: did, meta: &RecvReq{LocalBlockIDs: BlockIDs{{9, 10}}, TPSize: 1,
		Remote: RemoteMeta{EngineID: "engine-p", Host: "127.0.0.1", Port: p.port}}})
	msg, err := kvwire.EncodePushReg(reg)
	if err != nil {
		t.Fatal(err)
	}
	fakeAgent(t, p).Inject(d.work.agent.Name(), msg)
	p.finished(t)
	if n := len(p.work.push.regs); n != 0 {
		t.Fatalf("a consumed registration's copy was kept (%d)", n)
	}
	// vLLM reuses blocks 9, 10 for another request; a retried prefill
	// request with the same client id must not write them.
	fill(d, []int64{9, 10}, 0x55)
	before := bytes.Clone(d.kv.block(0, 0, 9))
	pushPrefill(t, p, "cmpl-c-0-cccccccc", []int64{5, 6}, 8)
	for i := 0; i < 5; i++ {
		p.finished(t)
		d.finished(t)
	}
	if !bytes.Equal(d.kv.block(0, 0, 9), before) {
		t.Fatal("a retried request wrote into blocks the decode gave back")
	}
}

// A worker reads a remote request's blocks once: the same params again (a
// retry, replayed params) fail instead of reading blocks the prefill freed
// when the first READ's notification came.
func TestReadTwiceRefused(t *testing.T) {
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	out := prefill(t, p, "p1", []int64{3, 4}, 8)
	decodeLoad(t, d, "d1", out, []int64{9, 10})
	d.waitFinished(t, "first read", func(f Finished) bool {
		p.finished(t)
		return contains(f.Recving, "d1")
	})
	p.waitFinished(t, "prefill frees", func(f Finished) bool { return p.work.Live().HeldLeases == 0 })
	posts := fakeAgent(t, d).CountCalls("Post")
	decodeLoad(t, d, "d2", out, []int64{11, 12})
	f := d.waitFinished(t, "second read refused", func(f Finished) bool { return contains(f.Recving, "d2") })
	if !contains(f.Failed, "d2") {
		t.Fatalf("the second READ of one remote request was not refused: %+v", f)
	}
	if n := fakeAgent(t, d).CountCalls("Post"); n != posts {
		t.Fatalf("a second READ was posted (%d posts, %d before)", n, posts)
	}
}

// A decode whose push failed keeps the blocks while the prefill that got
// its registration may exist: not on a timer, only once the prefill's side
// channel refuses connections (the process is gone).
func TestPushHeldUntilPrefillGone(t *testing.T) {
	old := sidechannel.RefusedGrace
	sidechannel.RefusedGrace = 10 * time.Millisecond
	defer func() { sidechannel.RefusedGrace = old }()
	clock := NewFakeClock(100)
	_, p, d := pushPair(t, clock, map[string]any{"push_registration_timeout": 5, "kv_lease_duration": 4})
	did := "cmpl-g-0-bbbbbbbb"
	pushDecode(t, d, p, did, "cmpl-g-0", 8, []int64{9}, nil)
	p.waitFinished(t, "registration stored", func(Finished) bool { return len(p.work.push.regs) == 1 })
	// The prefill stops answering (a hung process): no CANCELLED.
	fakeAgent(t, p).SetScript(nixltest.Script{FailStep: nixltest.StepGetNotifs})
	clock.Advance(6)
	f := d.finished(t)
	if !contains(f.Failed, did) || contains(f.Recving, did) {
		t.Fatalf("after the timeout: %+v (want failed, blocks held)", f)
	}
	for i := 0; i < 10; i++ {
		clock.Advance(5) // well past any lease: no timer gives them back
		p.finished(t)
		if f := d.finished(t); contains(f.Recving, did) {
			t.Fatalf("blocks given back %d s after the timeout without word from a prefill that may write", 5*(i+1))
		}
	}
	if d.work.Live().PushHeldRequests != 1 {
		t.Fatalf("decode live %+v", d.work.Live())
	}
	// The prefill's process is gone: its side channel refuses.
	if err := p.sched.Close(); err != nil {
		t.Fatal(err)
	}
	clock.Advance(pushProbeEvery)
	d.waitFinished(t, "released once the prefill is gone", func(f Finished) bool {
		clock.Advance(1)
		return contains(f.Recving, did)
	})
	if l := d.work.Live(); l.PushHeldRequests != 0 || l.ReceivingRequests != 0 {
		t.Fatalf("decode live %+v", l)
	}
}

// A prefill rank's FAILED ends only that rank's part: a decode that
// expects WRITEs from two prefill ranks keeps its blocks until the other
// rank's WRITE is done too.
func TestPushFailedFromOneRankWaitsForTheOther(t *testing.T) {
	eng := nixltest.NewEngine("t")
	p := newTPEngine(t, eng, "kv_producer", "engine-p", 2, 2, 1, "", "push")
	d := newTPEngine(t, eng, "kv_consumer", "engine-d", 1, 2, 100, "", "push")
	// Rank 1's WRITE stays in flight; rank 0's fails at post.
	for r := range p.workers {
		a := p.workers[r].agent.(*nixltest.Agent)
		if r == 0 {
			a.SetScript(nixltest.Script{FailStep: nixltest.StepPost})
		} else {
			a.SetScript(nixltest.Script{Polls: 1 << 30})
		}
	}
	pushTP(t, p, d, "cmpl-f-0-aaaaaaaa", "cmpl-f-0-bbbbbbbb", []int64{3}, []int64{7})
	dd := d.side(0)
	// Rank 1's WRITE goes out before rank 0 says anything: a cancel that
	// reached rank 1 before its post (the decode's answer to rank 0's
	// FAILED) would rightly end the wait with CANCELLED.
	r1 := p.workers[1].agent.(*nixltest.Agent)
	p.side(1).waitFinished(t, "rank 1's WRITE posted", func(Finished) bool {
		if f := dd.finished(t); len(f.Recving)+len(f.Failed) != 0 {
			t.Fatalf("the decode heard of an end before any rank said its last word: %+v", f)
		}
		return r1.CountCalls("Post") > 0
	})
	sawFailed := false
	for i := 0; i < 50; i++ {
		for r := range p.workers {
			p.side(r).finished(t)
		}
		f := dd.finished(t)
		sawFailed = sawFailed || contains(f.Failed, "cmpl-f-0-bbbbbbbb")
		if contains(f.Recving, "cmpl-f-0-bbbbbbbb") {
			t.Fatalf("decode let go after one rank's FAILED while the other rank's WRITE is in flight (step %d)", i)
		}
		time.Sleep(time.Millisecond)
	}
	if !sawFailed {
		t.Fatal("the decode was not told of the failure")
	}
	// Rank 1's WRITE completes: now both said their last word.
	p.workers[1].agent.(*nixltest.Agent).SetScript(nixltest.Script{})
	dd.waitFinished(t, "decode lets go", func(f Finished) bool {
		for r := range p.workers {
			p.side(r).finished(t)
		}
		return contains(f.Recving, "cmpl-f-0-bbbbbbbb")
	})
}

// A decode request vLLM aborts before its registration went out (the
// handshake with the prefill still running) is never registered, and its
// blocks go back to vLLM at once: no WRITE can land in them. (Held until
// push_registration_timeout, such requests filled a small decode's KV
// pool under abandoned clients.)
func TestPushAbortedBeforeRegistration(t *testing.T) {
	gate := make(chan struct{})
	_, p, d := pushPair(t, nil, map[string]any{"push_registration_timeout": 300})
	fakeAgent(t, d).SetScript(nixltest.Script{PrepHook: func(remote string, _ int) {
		if remote != "" {
			<-gate // the handshake's descriptor preparation waits
		}
	}})
	did := "cmpl-h-0-bbbbbbbb"
	pushDecode(t, d, p, did, "cmpl-h-0", 8, []int64{9, 10}, nil)
	if d.work.Live().PendingHandshakes != 1 {
		t.Fatalf("decode live %+v: want the handshake pending", d.work.Live())
	}
	dp := mustParams(t, `{"do_remote_prefill": false, "remote_engine_id": "engine-p"}`)
	if _, _, err := d.sched.RequestFinished(did, dp, false, 0, BlockIDs{{9, 10}}); err != nil {
		t.Fatal(err)
	}
	d.step(t)
	f := d.finished(t)
	if !contains(f.Recving, did) || !contains(f.Failed, did) {
		close(gate)
		t.Fatalf("an aborted, unregistered request kept its blocks: %+v", f)
	}
	close(gate)
	d.waitFinished(t, "handshake done", func(Finished) bool { return d.work.Live().PendingHandshakes == 0 })
	for i := 0; i < 5; i++ {
		p.finished(t)
	}
	if n := len(p.work.push.regs); n != 0 {
		t.Fatalf("the aborted request was registered after all (%d registrations)", n)
	}
}

// A decode request finished before its READ (an abort) tells the prefill
// to free the blocks: a second request with the same params must not read
// them after that either.
func TestReadAfterNotifyOnlyRefused(t *testing.T) {
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	out := prefill(t, p, "p1", []int64{3, 4}, 8)
	dp := mustParams(t, string(out))
	d.sched.OnNewRequest("d1", dp)
	if _, _, err := d.sched.RequestFinished("d1", dp, false, 0, nil); err != nil { // aborted before allocation
		t.Fatal(err)
	}
	d.step(t)
	p.waitFinished(t, "prefill frees on the notify-only message", func(f Finished) bool {
		d.finished(t)
		return p.work.Live().HeldLeases == 0
	})
	posts := fakeAgent(t, d).CountCalls("Post")
	decodeLoad(t, d, "d2", out, []int64{11, 12})
	f := d.waitFinished(t, "second request refused", func(f Finished) bool { return contains(f.Recving, "d2") })
	if !contains(f.Failed, "d2") || fakeAgent(t, d).CountCalls("Post") != posts {
		t.Fatalf("a request read blocks the prefill freed on this engine's notification: %+v", f)
	}
}

// While a prefill cannot drain its notifications (GetNotifs fails), a
// heartbeat that would extend a lease may be among them: no lease ends
// until the drain works again.
func TestLeasesHeldWhileNotificationsCannotBeDrained(t *testing.T) {
	clock := NewFakeClock(100)
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, map[string]any{"kv_lease_duration": 10})
	prefill(t, p, "p1", []int64{3, 4}, 8)
	fakeAgent(t, p).SetScript(nixltest.Script{FailStep: nixltest.StepGetNotifs})
	clock.Advance(20)
	for i := 0; i < 3; i++ {
		if f := p.finished(t); len(f.Sending) != 0 {
			t.Fatalf("a lease ended while notifications could not be drained: %+v", f)
		}
	}
	fakeAgent(t, p).SetScript(nixltest.Script{})
	if f := p.finished(t); !contains(f.Sending, "p1") {
		t.Fatalf("the lease did not end once draining worked again: %+v", f)
	}
}
