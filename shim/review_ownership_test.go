package shim

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl/nixltest"
	"github.com/gonixl/gonixl/sidechannel"
)

// Block-ownership cases found in review, each failing on the code it was
// written against. The hand-over table is docs/ARCHITECTURE.md, "Block
// ownership".

// pushDecodeAt is pushDecode with the prefill named at another address.
func pushDecodeAt(t *testing.T, d *side, reqID, remoteReqID string, port int, prompt int64, local []int64) {
	t.Helper()
	params := map[string]any{"do_remote_prefill": true, "remote_engine_id": "engine-p", "remote_host": "127.0.0.1",
		"remote_port": port, "tp_size": 1, "remote_request_id": remoteReqID}
	js, _ := json.Marshal(params)
	dp := mustParams(t, string(js))
	n, async := d.sched.GetNumNewMatchedTokens(dp, prompt, 0)
	if n != prompt || !async {
		t.Fatalf("decode matched %d async=%v", n, async)
	}
	if mut, err := d.sched.UpdateStateAfterAlloc(reqID, dp, BlockIDs{local}, []int64{0}, n); err != nil || !mut {
		t.Fatalf("update_state_after_alloc: %v %v", mut, err)
	}
	d.step(t)
}

// A handshake with the prefill's engine id at another address that
// nothing listens at (a request whose params name a wrong, stale or forged
// remote_port) says nothing of the prefill at its real address. The
// decode must not take it as "the agents the registration reached are
// gone" (pushHandshakeSeenLocked filters by engine id only): the live
// prefill still holds the registration and WRITEs into the blocks after
// vLLM got them back.
func TestPushWaitSurvivesRefusedHandshakeAtAnotherAddress(t *testing.T) {
	old := sidechannel.RefusedGrace
	sidechannel.RefusedGrace = 10 * time.Millisecond
	defer func() { sidechannel.RefusedGrace = old }()
	_, p, d := pushPair(t, nil, map[string]any{"push_registration_timeout": 300})
	did := "cmpl-w-0-bbbbbbbb"
	pushDecode(t, d, p, did, "cmpl-w-0", 8, []int64{9, 10}, nil)
	p.waitFinished(t, "registration stored", func(Finished) bool { return len(p.work.push.regs) == 1 })

	// Another request names engine-p at a port nothing listens at.
	pushDecodeAt(t, d, "cmpl-x-0-bbbbbbbb", "cmpl-x-0", freePort(t), 8, []int64{11, 12})
	f := d.waitFinished(t, "the request at the wrong address fails", func(f Finished) bool {
		return contains(f.Recving, "cmpl-x-0-bbbbbbbb")
	})
	if contains(f.Recving, did) {
		// vLLM reuses blocks 9, 10; the prefill, alive at its address,
		// still holds the registration and writes them.
		fill(d, []int64{9, 10}, 0x55)
		reused := bytes.Clone(d.kv.block(0, 0, 9))
		pid := "cmpl-w-0-aaaaaaaa"
		pushPrefill(t, p, pid, []int64{3, 4}, 8)
		p.waitFinished(t, "the prefill's WRITE", func(f Finished) bool {
			d.finished(t)
			return contains(f.Sending, pid)
		})
		overwritten := !bytes.Equal(d.kv.block(0, 0, 9), reused)
		t.Fatalf("the decode gave request %s's blocks back after a refused handshake at another address, while engine-p "+
			"(alive, registration held) may still WRITE them; overwritten after reuse: %v", did, overwritten)
	}
}

// vLLM 0.32 starts a step's asynchronous loads after the forward is
// launched (kv_connector_model_runner_mixin.py _get_kv_connector_output:
// start_load_kv runs in the finally block unless the step has a
// synchronous load, which gonixl never asks for), and offers
// handle_preemptions, called before the forward, for exactly this. So
// the start_load_kv that carries PushPreempted runs after the forward
// that may refill the preempted request's blocks: the fence in
// pushPreemptedLocked comes too late, and the WRITE in flight reads the
// reusing request's KV. (TestPushPreemptedWriteFenced runs start_load_kv
// before the fill, an order vLLM never uses.)
func TestPushPreemptedWriteFencedBeforeTheForward(t *testing.T) {
	_, p, d := pushPair(t, nil, nil, nixltest.Script{Polls: 50})
	pid, did := "cmpl-v-0-aaaaaaaa", "cmpl-v-0-bbbbbbbb"
	pushDecode(t, d, p, did, "cmpl-v-0", 8, []int64{9, 10}, nil)
	p.waitFinished(t, "registration stored", func(Finished) bool { return len(p.work.push.regs) == 1 })
	in := mustParams(t, `{"do_remote_decode": true}`)
	if _, err := p.sched.UpdateStateAfterAlloc(pid, in, nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	blocks := []int64{1, 2}
	if err := p.sched.PushPromptDone(pid, in, BlockIDs{blocks}, 0); err != nil {
		t.Fatal(err)
	}
	// Step N: its forward computes the prompt, then start_load_kv, then
	// get_finished (which posts the WRITE once the decode is handshaken).
	fill(p, blocks, 0x30)
	want := bytes.Clone(p.kv.block(0, 0, 1))
	p.step(t)
	p.waitFinished(t, "WRITE posted", func(Finished) bool { return p.work.Live().TransferHandles == 1 })
	// reset_prefix_cache preempts the request (async scheduling: step N's
	// output not processed yet); step N+1 gives its blocks to another
	// request. vLLM's order for step N+1: handle_preemptions, the forward
	// (fills the blocks), start_load_kv.
	p.sched.PushPreempted([]string{pid})
	meta, err := p.sched.BuildMeta()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.work.HandlePreemptions(meta); err != nil { // vLLM's handle_preemptions, before the forward
		t.Fatal(err)
	}
	fill(p, blocks, 0x90)
	if err := p.work.StartLoadKV(meta); err != nil {
		t.Fatal(err)
	}
	d.waitFinished(t, "decode recv", func(f Finished) bool {
		p.finished(t)
		return contains(f.Recving, did)
	})
	if !bytes.Equal(d.kv.block(0, 0, 9), want) {
		t.Fatal("the decode received the KV that step N+1's forward wrote into the preempted request's blocks")
	}
}

// ppEngine is one engine of pp_size 2, tp_size 1: a scheduler and a
// worker per stage.
type ppEngine struct {
	sched   *Scheduler
	workers []*Worker
	kv      []*kvMem
	port    int
}

func newPPEngine(t *testing.T, eng *nixltest.Engine, kvRole, id string, fill byte) *ppEngine {
	t.Helper()
	port := freePort(t)
	cfg := func(role Role, rank int) *Config {
		c := testConfig(t, role, kvRole, id, port, nil)
		c.PPSize, c.PPRank, c.TransferMode = 2, rank, "push"
		if err := c.applyDefaults(); err != nil {
			t.Fatal(err)
		}
		return c
	}
	s, err := NewScheduler(cfg(RoleScheduler, 0), nil)
	if err != nil {
		t.Fatal(err)
	}
	pe := &ppEngine{sched: s, port: port}
	for r := 0; r < 2; r++ {
		w, err := NewWorker(cfg(RoleWorker, r), nil)
		if err != nil {
			t.Fatal(err)
		}
		km := newKVMem(t, fill+byte(r))
		registerAndServe(t, s, w, eng, r, initFor(km))
		pe.workers, pe.kv = append(pe.workers, w), append(pe.kv, km)
	}
	return pe
}

func pollWorker(t *testing.T, w *Worker) Finished {
	t.Helper()
	return w.Poll()
}

func (pe *ppEngine) step(t *testing.T) {
	t.Helper()
	b, err := pe.sched.BuildMeta()
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range pe.workers {
		if err := w.StartLoadKV(b); err != nil {
			t.Fatal(err)
		}
	}
}

// Push between two engines of pp_size 2: each stage of the decode
// registers with the same stage of the prefill (startHandshakeLocked
// handshakes only its own stage), so each decode stage receives one
// WRITE; registerPushLocked waits for pp_size of them (vLLM's count for a
// decode that registered with every stage). The first completion then
// ends the wait as "1 of 2 WRITEs completed": every push request fails.
func TestPushAcrossPipelineStages(t *testing.T) {
	eng := nixltest.NewEngine("t")
	p := newPPEngine(t, eng, "kv_producer", "engine-p", 1)
	d := newPPEngine(t, eng, "kv_consumer", "engine-d", 200)
	pid, did := "cmpl-pp-0-aaaaaaaa", "cmpl-pp-0-bbbbbbbb"
	js, _ := json.Marshal(map[string]any{"do_remote_prefill": true, "remote_engine_id": "engine-p", "remote_host": "127.0.0.1",
		"remote_port": p.port, "tp_size": 1, "pp_size": 2, "remote_request_id": "cmpl-pp-0"})
	dp := mustParams(t, string(js))
	n, async := d.sched.GetNumNewMatchedTokens(dp, 8, 0)
	if n != 8 || !async {
		t.Fatalf("decode matched %d async=%v", n, async)
	}
	if mut, err := d.sched.UpdateStateAfterAlloc(did, dp, BlockIDs{{9, 10}}, []int64{0}, n); err != nil || !mut {
		t.Fatalf("update_state_after_alloc: %v %v", mut, err)
	}
	d.step(t)
	in := mustParams(t, `{"do_remote_decode": true}`)
	if _, err := p.sched.UpdateStateAfterAlloc(pid, in, nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	p.step(t)
	if delay, _, err := p.sched.RequestFinished(pid, in, true, 8, BlockIDs{{3, 4}}); err != nil || !delay {
		t.Fatalf("request_finished: %v %v", delay, err)
	}
	p.step(t)
	deadline := time.Now().Add(10 * time.Second)
	done := map[int]Finished{}
	for len(done) < 2 && time.Now().Before(deadline) {
		for _, w := range p.workers {
			pollWorker(t, w)
		}
		for r, w := range d.workers {
			if f := pollWorker(t, w); contains(f.Recving, did) {
				done[r] = f
			}
		}
		time.Sleep(2 * time.Millisecond)
	}
	for r := 0; r < 2; r++ {
		f, ok := done[r]
		if !ok {
			t.Fatalf("decode stage %d never finished receiving", r)
		}
		if contains(f.Failed, did) {
			t.Fatalf("decode stage %d failed a push whose one WRITE (its stage's) completed", r)
		}
		for l := 0; l < tLayers; l++ {
			if !bytes.Equal(d.kv[r].block(l, 0, 9), p.kv[r].block(l, 0, 3)) {
				t.Fatalf("stage %d layer %d: not written", r, l)
			}
		}
	}
}

// newPushSideAt is newPushSide at a given side-channel port (an engine
// restarted at its address).
func newPushSideAt(t *testing.T, eng *nixltest.Engine, kvRole, id string, port int, fill byte) *side {
	t.Helper()
	mk := func(role Role) *Config {
		c := testConfig(t, role, kvRole, id, port, nil)
		c.TransferMode = "push"
		if err := c.applyDefaults(); err != nil {
			t.Fatal(err)
		}
		return c
	}
	s, err := NewScheduler(mk(RoleScheduler), nil)
	if err != nil {
		t.Fatal(err)
	}
	w, err := NewWorker(mk(RoleWorker), nil)
	if err != nil {
		t.Fatal(err)
	}
	km := newKVMem(t, fill)
	registerAndServe(t, s, w, eng, 0, initFor(km))
	return &side{sched: s, work: w, kv: km, port: port}
}

// A registration names the decode by engine id and address, not by the
// process (agent) that sent it. A decode that dies and comes back with the
// same engine_id at the same address (a configured engine_id, a restarted
// pod) is another process whose blocks hold other requests; a prefill
// request that then takes the dead process's stored registration
// handshakes with the new process and WRITEs into its blocks.
func TestPushRegistrationOfADeadDecodeNotWrittenToItsSuccessor(t *testing.T) {
	eng, p, d := pushPair(t, nil, map[string]any{"push_registration_timeout": 300})
	pushDecode(t, d, p, "cmpl-r-0-bbbbbbbb", "cmpl-r-0", 8, []int64{9, 10}, nil)
	p.waitFinished(t, "registration stored", func(Finished) bool { return len(p.work.push.regs) == 1 })
	// The decode dies; a new process takes its engine id and address.
	port := d.port
	_ = d.work.Close()
	_ = d.sched.Close()
	d2 := newPushSideAt(t, eng, "kv_consumer", "engine-d", port, 200)
	// Blocks 9, 10 hold a request of the new process.
	fill(d2, []int64{9, 10}, 0x55)
	before := bytes.Clone(d2.kv.block(0, 0, 9))
	pid := "cmpl-r-0-aaaaaaaa"
	pushPrefill(t, p, pid, []int64{3, 4}, 8)
	p.waitFinished(t, "the prefill ends its push", func(f Finished) bool {
		d2.finished(t)
		return contains(f.Sending, pid)
	})
	if !bytes.Equal(d2.kv.block(0, 0, 9), before) {
		t.Fatal("the prefill wrote a dead decode's registration into the blocks of the process that took its engine id and address")
	}
}

// newSideAt is newSide (pull mode) at a given side-channel port.
func newSideAt(t *testing.T, eng *nixltest.Engine, kvRole, id string, port int, fill byte) *side {
	t.Helper()
	return newSideWith(t, eng, kvRole, id, port, nil, fill, nil, nil)
}

// The pull twin: a prefill's params name its blocks by engine id and
// address; a prefill that died and came back with the same engine_id at
// the same address, inside the lease the params state, holds other KV in
// those blocks. A decode that has not handshaken the old process yet
// handshakes the new one and READs them: HTTP 200 from another prompt's
// KV (the prompt digest compares prompts, not what the blocks hold now).
func TestReadFromARestartedPrefillRefused(t *testing.T) {
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	out := prefill(t, p, "p1", []int64{3, 4}, 8)
	port := p.port
	_ = p.work.Close()
	_ = p.sched.Close()
	p2 := newSideAt(t, eng, "kv_producer", "engine-p", port, 1)
	fill(p2, []int64{3, 4}, 0x66) // another request's KV in the new process
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	decodeLoad(t, d, "d1", out, []int64{9, 10})
	f := d.waitFinished(t, "decode recv", func(f Finished) bool {
		p2.finished(t)
		return contains(f.Recving, "d1")
	})
	if !contains(f.Failed, "d1") {
		t.Fatalf("the decode read a restarted prefill's blocks as request p1's KV: %+v (block 9 == new process's block 3: %v)",
			f, bytes.Equal(d.kv.block(0, 0, 9), p2.kv.block(0, 0, 3)))
	}
}

// A push prefill whose request ran past its prompt (max_tokens > 1 from a
// client or a third-party proxy) finishes with blocks for its output
// tokens too. pairPush pairs the tail of that list with the decode's
// prompt blocks, shifted by the output's blocks; vllm.py sends no prompt
// digest then (prompt_digest is None for more tokens than the prompt), so
// nothing checks. Pull refuses the same request (remote_num_tokens differs
// from the prompt's length; pairBlocks' count check).
func TestPushPrefillPastItsPromptNotWrittenShifted(t *testing.T) {
	_, p, d := pushPair(t, nil, nil)
	pid, did := "cmpl-m-0-aaaaaaaa", "cmpl-m-0-bbbbbbbb"
	// Decode: an 8-token prompt, two blocks (tBlockSize 4), its digest.
	pushDecode(t, d, p, did, "cmpl-m-0", 8, []int64{9, 10}, nil, "blake2b-128:00112233445566778899aabbccddeeff")
	// Prefill: the same prompt plus 3 generated tokens, 11 computed: blocks
	// 3, 4 hold the prompt, 5 the output; no digest (vllm.py's _with_digest
	// over 11 tokens of an 8-token prompt is None).
	pushPrefill(t, p, pid, []int64{3, 4, 5}, 11)
	f := d.waitFinished(t, "decode ends its wait", func(f Finished) bool {
		p.finished(t)
		return contains(f.Recving, did)
	})
	if !contains(f.Failed, did) && !bytes.Equal(d.kv.block(0, 0, 9), p.kv.block(0, 0, 3)) {
		t.Fatalf("the decode received its prompt's KV shifted by one block (block 9 holds prefill block 4: %v), reported as success",
			bytes.Equal(d.kv.block(0, 0, 9), p.kv.block(0, 0, 4)))
	}
}

// The notify-only message (a decode request with nothing to read: aborted
// before allocation, or a full local prefix hit) counts as a reader's
// "done" at the prefill. readLocked sends it before its check that this
// engine already read (or is reading) the same remote blocks, so a second
// request with the same params (a router's retry the client abandoned)
// makes the prefill free the blocks while the first request's READ is in
// flight; that READ completes inside the lease and reads reused blocks.
func TestNotifyOnlyDuringAReadOfTheSameBlocks(t *testing.T) {
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	out := prefill(t, p, "p1", []int64{3, 4}, 8)
	want := bytes.Clone(p.kv.block(0, 0, 3))
	fakeAgent(t, d).SetScript(nixltest.Script{Polls: 1 << 30}) // d1's READ stays in flight
	decodeLoad(t, d, "d1", out, []int64{9, 10})
	d.waitFinished(t, "READ posted", func(Finished) bool { return d.work.Live().TransferHandles == 1 })
	// d2: the same params, aborted before allocation.
	dp := mustParams(t, string(out))
	d.sched.OnNewRequest("d2", dp)
	if _, _, err := d.sched.RequestFinished("d2", dp, false, 0, nil); err != nil {
		t.Fatal(err)
	}
	d.step(t)
	freed := false
	for i := 0; i < 50 && !freed; i++ {
		d.finished(t)
		freed = contains(p.finished(t).Sending, "p1")
		time.Sleep(time.Millisecond)
	}
	if freed {
		fill(p, []int64{3, 4}, 0x77) // the prefill reuses them
	}
	fakeAgent(t, d).SetScript(nixltest.Script{})
	f := d.waitFinished(t, "d1 done", func(f Finished) bool { return contains(f.Recving, "d1") })
	if !contains(f.Failed, "d1") && !bytes.Equal(d.kv.block(0, 0, 9), want) {
		t.Fatalf("the prefill freed p1 on a second request's notify-only message while d1's READ was in flight (freed: %v); d1 reported success with the reusing request's KV", freed)
	}
}

// An announcement that goes stale (request_finished not seen within
// pushAnnounceStale: an engine paused between steps, vLLM's
// pause_generation keep mode, or a very long step) stops holding
// preemption off and is forgotten by the scheduler, but the worker keeps
// the early push. A preemption then is not reported (PushPreempted skips
// ids not announced), and a registration that arrives after the blocks
// were reused gets them WRITTEN.
func TestPushStaleAnnouncementPreemptedNotWritten(t *testing.T) {
	clock := NewFakeClock(100)
	_, p, d := pushPair(t, clock, map[string]any{"kv_lease_duration": 60, "push_registration_timeout": 300})
	pid, did := "cmpl-s-0-aaaaaaaa", "cmpl-s-0-bbbbbbbb"
	in := mustParams(t, `{"do_remote_decode": true}`)
	if _, err := p.sched.UpdateStateAfterAlloc(pid, in, nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	blocks := []int64{1, 2}
	if err := p.sched.PushPromptDone(pid, in, BlockIDs{blocks}, 0); err != nil {
		t.Fatal(err)
	}
	fill(p, blocks, 0x30)
	want := bytes.Clone(p.kv.block(0, 0, 1))
	p.step(t)
	p.finished(t) // the forward is done; no registration yet
	clock.Advance(pushAnnounceStale + 1)
	if p.sched.PendingBlockFrees() {
		t.Fatal("stale announcement still holds preemption off")
	}
	// vLLM preempts it now (nothing holds it off) and reuses its blocks.
	p.sched.PushPreempted([]string{pid})
	p.step(t)
	fill(p, blocks, 0x90)
	// The decode's registration arrives only now.
	pushDecode(t, d, p, did, "cmpl-s-0", 8, []int64{9, 10}, nil)
	for i := 0; i < 200; i++ {
		p.finished(t)
		if f := d.finished(t); contains(f.Recving, did) {
			if !contains(f.Failed, did) && !bytes.Equal(d.kv.block(0, 0, 9), want) {
				t.Fatal("the worker wrote a stale announced request's blocks after vLLM preempted it and reused them")
			}
			return
		}
		time.Sleep(time.Millisecond)
	}
}
