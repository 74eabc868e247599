package shim

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/nixltest"
	"github.com/gonixl/gonixl/shim/kvwire"
)

// readbackRun is a bidirectional pair: d, a decode that holds a finished
// request's blocks (serving their digests when serve), and p, the prefill
// of the next turn that reads them back.
type readbackRun struct {
	p, d *side
	logs *observer.ObservedLogs // p's worker
}

func newReadbackSide(t *testing.T, eng nixl.Engine, kvRole, id string, fill byte, extra map[string]any, serve bool) *side {
	t.Helper()
	port := freePort(t)
	sc := testConfig(t, RoleScheduler, kvRole, id, port, extra)
	sc.KVDigestReadback = serve && sc.KVDigest != KVDigestOff // what the Python connector sets
	s, err := NewScheduler(sc, nil)
	if err != nil {
		t.Fatal(err)
	}
	w, err := NewWorker(testConfig(t, RoleWorker, kvRole, id, port, extra), nil)
	if err != nil {
		t.Fatal(err)
	}
	km := newKVMem(t, fill)
	init := initFor(km)
	init.BlockReshape, init.HeadSize = "head_major", tHeadDim
	registerAndServe(t, s, w, eng, 0, init)
	return &side{sched: s, work: w, kv: km, port: port}
}

func newReadbackRun(t *testing.T, mode string, serve bool) *readbackRun {
	eng := nixltest.NewEngine("t")
	extra := map[string]any{"kv_digest": mode, "bidirectional_kv_xfer": true, "kv_recompute_threshold": 1, "handshake_timeout": 3}
	r := &readbackRun{
		d: newReadbackSide(t, eng, "kv_consumer", "engine-d", 200, extra, serve),
		p: newReadbackSide(t, eng, "kv_producer", "engine-p", 1, extra, false),
	}
	core, logs := observer.New(zapcore.InfoLevel)
	r.p.work.mu.Lock()
	r.p.work.log = zap.New(core)
	r.p.work.mu.Unlock()
	r.logs = logs
	return r
}

// hold finishes decode request id, its KV in blocks (tokens of them
// written): the params the next turn's prefill gets.
func (r *readbackRun) hold(t *testing.T, id string, blocks []int64, tokens int64) []byte {
	t.Helper()
	delay, out, err := r.d.sched.RequestFinished(id, mustParams(t, `{"do_remote_prefill": false, "do_remote_decode": false}`), true, tokens, BlockIDs{blocks})
	if err != nil || !delay {
		t.Fatalf("request_finished: delay=%v err=%v", delay, err)
	}
	r.d.step(t)
	return out
}

// digest is the decode's next step: its worker digests the held blocks and
// the scheduler takes the digests (what the Python connector does with the
// step's worker metadata).
func (r *readbackRun) digest(t *testing.T, id string, blocks []int64, tokens int64) {
	t.Helper()
	in, _ := json.Marshal([]DigestReq{{ID: id, Tokens: tokens, Blocks: BlockIDs{blocks}}})
	if err := r.d.work.KVDigestsHeld(in); err != nil {
		t.Fatal(err)
	}
	r.d.waitFinished(t, "held digests of "+id, func(f Finished) bool { return f.DigestsPending })
	r.serve(t, id, tokens, r.takeHeld(t))
}

// takeHeld takes the decode worker's finished held digests.
func (r *readbackRun) takeHeld(t *testing.T) map[string]DigestOut {
	t.Helper()
	raw, err := r.d.work.TakeHeldDigests()
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]DigestOut
	if err := json.Unmarshal(raw, &got); err != nil {
		t.Fatal(err)
	}
	return got
}

// serve hands id's digests to the decode's scheduler (what the Python
// connector does with the step's worker metadata).
func (r *readbackRun) serve(t *testing.T, id string, tokens int64, got map[string]DigestOut) {
	t.Helper()
	d, ok := got[id]
	if !ok {
		t.Fatalf("no digests of %s in %v", id, got)
	}
	kd := kvwire.KVDigest{Alg: kvwire.KVDigestAlg, Tokens: tokens, First: []int64{0}, Ranks: []kvwire.RankDigest{{Blocks: d.Blocks, Regions: d.Regions}}}
	b, _ := json.Marshal(map[string]any{id: kd})
	if err := r.d.sched.SetKVDigests(b); err != nil {
		t.Fatal(err)
	}
}

// readBack runs the next turn's prefill request pid over the decode's
// params out into blocks local (cached: a local prefix hit) and returns
// whether its load failed.
func (r *readbackRun) readBack(t *testing.T, pid string, out []byte, prompt int64, local []int64, cached int64) bool {
	t.Helper()
	pp := mustParams(t, string(out))
	n, async := r.p.sched.GetNumNewMatchedTokens(pp, prompt, cached*tBlockSize)
	if n <= 0 || !async {
		t.Fatalf("read-back matched %d async=%v", n, async)
	}
	if _, err := r.p.sched.UpdateStateAfterAlloc(pid, pp, BlockIDs{local}, []int64{cached}, n); err != nil {
		t.Fatal(err)
	}
	r.p.step(t)
	f := r.p.waitFinished(t, "read-back "+pid, func(f Finished) bool { return contains(f.Recving, pid) })
	return contains(f.Failed, pid)
}

func (r *readbackRun) count(t *testing.T, metric string) string {
	t.Helper()
	text, _ := r.p.work.MetricsText()
	for _, l := range strings.Split(string(text), "\n") {
		if strings.HasPrefix(l, metric+"{") {
			return l[strings.LastIndex(l, " ")+1:]
		}
	}
	return "0"
}

// A read-back is checked against the digests the decode's side channel
// serves: clean blocks pass (every block read counted checked), a byte of
// a held block changed after the decode digested it fails the load, naming
// the block; a prefix hit on the prefill checks the blocks read only.
func TestReadbackKVDigestChecked(t *testing.T) {
	r := newReadbackRun(t, KVDigestFail, true)
	const tokens = 3*tBlockSize - 1 // the decode's last block partly written
	out := r.hold(t, "d-1", []int64{7, 8, 9}, tokens)
	if !strings.Contains(string(out), `"gonixl_kv_digest_served":true`) {
		t.Fatalf("params %s lack gonixl_kv_digest_served", out)
	}
	r.digest(t, "d-1", []int64{7, 8, 9}, tokens)
	r.d.kv.slot(0, 0, 9, 0, tokens%tBlockSize)[0] ^= 0xff // past the written tokens: not covered
	if r.readBack(t, "p-1", out, tokens+5, []int64{3, 4, 5}, 0) {
		t.Fatalf("clean read-back failed: %v", r.logs.All())
	}
	if got := r.count(t, "gonixl_kv_digest_checked_blocks_total"); got != "3" {
		t.Fatalf("checked blocks %s, want 3", got)
	}
	if got := r.count(t, "gonixl_kv_digest_unchecked_total"); got != "0" {
		t.Fatalf("unchecked %s, want 0: %v", got, r.logs.All())
	}

	out = r.hold(t, "d-2", []int64{10, 11, 12}, tokens)
	r.digest(t, "d-2", []int64{10, 11, 12}, tokens)
	r.d.kv.slot(1, 0, 11, 1, 2)[3] ^= 1 // reused under the hold, say
	if !r.readBack(t, "p-2", out, tokens+5, []int64{13, 14, 15}, 0) {
		t.Fatal("a changed byte of a held block was not caught")
	}
	lines := r.logs.FilterMessageSnippet("kv_digest_mismatch").All()
	if len(lines) != 1 || !strings.Contains(lines[0].Message, "group 0 block 1 (local id 14, remote id 11") {
		t.Fatalf("mismatch lines %v", lines)
	}

	// A prefix hit: blocks 0 and 1 cached on the prefill, block 2 read.
	out = r.hold(t, "d-3", []int64{0, 1, 2}, tokens)
	r.digest(t, "d-3", []int64{0, 1, 2}, tokens)
	r.d.kv.block(0, 0, 0)[0] ^= 1 // not read
	if r.readBack(t, "p-3", out, tokens+5, []int64{6}, 2) {
		t.Fatalf("a change outside the blocks read failed the load: %v", r.logs.All())
	}
	if got := r.count(t, "gonixl_kv_digest_checked_blocks_total"); got != "7" {
		t.Fatalf("checked blocks %s, want 7 (3 + 3 + 1)", got)
	}
}

// A decode hashes its read-back holds off vLLM's thread: KVDigestsHeld
// returns while the hashing runs, the hold's finished_sending waits for it
// (the reader's READ, and its notification, may come first: the blocks are
// still being read by the hash), and the digests, taken once get_finished
// says they are pending, are those the synchronous call takes.
func TestReadbackHeldDigestsOffTheThread(t *testing.T) {
	r := newReadbackRun(t, KVDigestFail, true)
	const tokens = 3*tBlockSize - 1
	blocks := []int64{7, 8, 9}
	// d-1 ran in one of the decode's batches: its worker takes the reader's
	// notification as the end of the hold.
	if _, err := r.d.sched.UpdateStateAfterAlloc("d-1", mustParams(t, `{"do_remote_decode": true, "_remote_blocks_processed": true}`), nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	r.d.step(t)
	out := r.hold(t, "d-1", blocks, tokens)
	in, _ := json.Marshal([]DigestReq{{ID: "d-1", Tokens: tokens, Blocks: BlockIDs{blocks}}})
	want, err := r.d.work.KVDigests(in)
	if err != nil {
		t.Fatal(err)
	}
	gate := make(chan struct{})
	var hashing sync.WaitGroup
	hashing.Add(1)
	w := r.d.work
	w.mu.Lock()
	w.heldDigest.hook = func([]DigestReq) { hashing.Done(); <-gate }
	w.mu.Unlock()
	if err := w.KVDigestsHeld(in); err != nil {
		t.Fatal(err)
	}
	hashing.Wait()
	defer func() {
		select {
		case <-gate:
		default:
			close(gate)
		}
	}()
	// The next turn's prefill reads the blocks; its notification reaches
	// the decode while the hash still runs.
	pp := mustParams(t, string(out))
	n, _ := r.p.sched.GetNumNewMatchedTokens(pp, tokens+5, 0)
	if _, err := r.p.sched.UpdateStateAfterAlloc("p-1", pp, BlockIDs{{3, 4, 5}}, []int64{0}, n); err != nil {
		t.Fatal(err)
	}
	r.p.step(t)
	r.d.waitFinished(t, "the reader's notification", func(f Finished) bool {
		r.p.finished(t)
		if contains(f.Sending, "d-1") {
			t.Fatalf("finished_sending reported while the held blocks are being hashed: %+v", f)
		}
		if f.DigestsPending {
			t.Fatal("digests pending before the hashing ended")
		}
		w.mu.Lock()
		defer w.mu.Unlock()
		return w.heldDigest.sendLater["d-1"]
	})
	for i := 0; i < 20; i++ {
		if f := r.d.finished(t); contains(f.Sending, "d-1") {
			t.Fatalf("finished_sending reported while the held blocks are being hashed (poll %d)", i)
		}
	}
	close(gate)
	f := r.d.waitFinished(t, "the hashing's end", func(f Finished) bool { return contains(f.Sending, "d-1") && f.DigestsPending })
	if len(f.Sending) != 1 {
		t.Fatalf("sending %v, want d-1 once", f.Sending)
	}
	got := r.takeHeld(t)
	if b, _ := json.Marshal(got); string(b) != string(want) {
		t.Fatalf("held digests %s, want %s", b, want)
	}
	if again := r.takeHeld(t); len(again) != 0 {
		t.Fatalf("digests taken twice: %v", again)
	}
	r.serve(t, "d-1", tokens, got)
	if f := r.p.waitFinished(t, "p-1", func(f Finished) bool { return contains(f.Recving, "p-1") }); contains(f.Failed, "p-1") {
		t.Fatalf("read-back failed: %v", r.logs.All())
	}
	if got := r.count(t, "gonixl_kv_digest_checked_blocks_total"); got != "3" {
		t.Fatalf("checked blocks %s, want 3", got)
	}
}

// Under async scheduling a hold can end (its reader's notification
// reported in finished_sending, after which vLLM may reuse the blocks)
// before the step that asks for its digests: those blocks are not hashed,
// the digests are ready as none at once, and the reader reads unchecked —
// never a hash of reused blocks, which would fail a good READ.
func TestReadbackHoldEndedBeforeItsDigests(t *testing.T) {
	r := newReadbackRun(t, KVDigestFail, true)
	const tokens = 2 * tBlockSize
	if _, err := r.d.sched.UpdateStateAfterAlloc("d-1", mustParams(t, `{"do_remote_decode": true, "_remote_blocks_processed": true}`), nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	r.d.step(t)
	out := r.hold(t, "d-1", []int64{7, 8}, tokens)
	pp := mustParams(t, string(out))
	n, _ := r.p.sched.GetNumNewMatchedTokens(pp, tokens+5, 0)
	if _, err := r.p.sched.UpdateStateAfterAlloc("p-1", pp, BlockIDs{{3, 4}}, []int64{0}, n); err != nil {
		t.Fatal(err)
	}
	r.p.step(t)
	r.d.waitFinished(t, "d-1's hold ended", func(f Finished) bool {
		r.p.finished(t)
		return contains(f.Sending, "d-1")
	})
	var hashed atomic.Bool
	w := r.d.work
	w.mu.Lock()
	w.heldDigest.hook = func([]DigestReq) { hashed.Store(true) }
	w.mu.Unlock()
	in, _ := json.Marshal([]DigestReq{{ID: "d-1", Tokens: tokens, Blocks: BlockIDs{{7, 8}}}})
	if err := w.KVDigestsHeld(in); err != nil {
		t.Fatal(err)
	}
	if f := r.d.finished(t); !f.DigestsPending {
		t.Fatalf("no digests pending after the ask: %+v", f)
	}
	raw, err := w.TakeHeldDigests()
	if err != nil {
		t.Fatal(err)
	}
	if string(raw) != `{"d-1":null}` || hashed.Load() {
		t.Fatalf("held digests %s (hashed %v), want d-1 as none without hashing", raw, hashed.Load())
	}
	if err := r.d.sched.SetKVDigests([]byte(`{"d-1": null}`)); err != nil {
		t.Fatal(err)
	}
	if f := r.p.waitFinished(t, "p-1", func(f Finished) bool { return contains(f.Recving, "p-1") }); contains(f.Failed, "p-1") {
		t.Fatalf("read-back failed: %v", r.logs.All())
	}
	if got := r.count(t, "gonixl_kv_digest_unchecked_total"); got != "1" {
		t.Fatalf("unchecked %s, want 1", got)
	}

	// The id reused for a new hold (vLLM's id randomisation off): that
	// hold is installed, so it is hashed, not served as none.
	if _, err := r.d.sched.UpdateStateAfterAlloc("d-1", mustParams(t, `{"do_remote_decode": true, "_remote_blocks_processed": true}`), nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	r.d.step(t)
	r.hold(t, "d-1", []int64{9, 10}, tokens)
	in, _ = json.Marshal([]DigestReq{{ID: "d-1", Tokens: tokens, Blocks: BlockIDs{{9, 10}}}})
	if err := w.KVDigestsHeld(in); err != nil {
		t.Fatal(err)
	}
	r.d.waitFinished(t, "the new hold's digests", func(f Finished) bool { return f.DigestsPending })
	if got := r.takeHeld(t); !hashed.Load() || len(got["d-1"].Blocks) != 1 || len(got["d-1"].Blocks[0]) != 2 {
		t.Fatalf("a new hold of a reused id was not hashed (hashed %v): %v", hashed.Load(), got)
	}
}

// A reader can be done before the decode's next step installs the hold
// (the params leave with the request's last output; the hold, and the ask
// for its digests, come in the next step's metadata, under async
// scheduling two steps on). Its notification does not end the hold then:
// the end waits for that step, whose hashing runs on blocks still the
// connector's, and the reader's read is checked, not read unchecked (the
// multi-turn suite's concurrent conversations caught it: 1 of 66 read-backs
// unchecked on a loaded host).
func TestReadbackReaderDoneBeforeTheHold(t *testing.T) {
	r, tokens, blocks := readerDoneEarly(t)
	w := r.d.work
	for i := 0; i < 10; i++ {
		if f := r.d.finished(t); contains(f.Sending, "d-1") {
			t.Fatalf("the hold ended before the step that installs it (poll %d)", i)
		}
	}
	// That step: the hold is installed with its readers done, and its
	// digests are asked for after the forward, before get_finished.
	r.d.step(t)
	var hashed atomic.Bool
	w.mu.Lock()
	w.heldDigest.hook = func([]DigestReq) { hashed.Store(true) }
	w.mu.Unlock()
	in, _ := json.Marshal([]DigestReq{{ID: "d-1", Tokens: tokens, Blocks: BlockIDs{blocks}}})
	if err := w.KVDigestsHeld(in); err != nil {
		t.Fatal(err)
	}
	f := r.d.waitFinished(t, "the hold's end after its hashing", func(f Finished) bool { return contains(f.Sending, "d-1") && f.DigestsPending })
	if len(f.Sending) != 1 || !hashed.Load() {
		t.Fatalf("sending %v (hashed %v), want d-1 once, after hashing", f.Sending, hashed.Load())
	}
	r.serve(t, "d-1", tokens, r.takeHeld(t))
	if f := r.p.waitFinished(t, "p-1", func(f Finished) bool { return contains(f.Recving, "p-1") }); contains(f.Failed, "p-1") {
		t.Fatalf("read-back failed: %v", r.logs.All())
	}
	if got := r.count(t, "gonixl_kv_digest_checked_blocks_total"); got != "2" {
		t.Fatalf("checked blocks %s, want 2 (unchecked %s)", got, r.count(t, "gonixl_kv_digest_unchecked_total"))
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.readEarly.Len() != 0 {
		t.Fatal("a kept end stayed after its hold")
	}
}

// readerDoneEarly: a bidirectional decode's request d-1 finished (its KV
// in blocks 7 and 8), and the next turn's prefill read it back and
// notified before the decode's next step installed the hold; the decode's
// worker keeps that end (readEarly). Returns the run, d-1's tokens and
// blocks.
func readerDoneEarly(t *testing.T) (*readbackRun, int64, []int64) {
	t.Helper()
	r := newReadbackRun(t, KVDigestFail, true)
	const tokens = 2 * tBlockSize
	blocks := []int64{7, 8}
	if _, err := r.d.sched.UpdateStateAfterAlloc("d-1", mustParams(t, `{"do_remote_decode": true, "_remote_blocks_processed": true}`), nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	r.d.step(t)
	// request_finished, and the decode's next step not come yet.
	delay, out, err := r.d.sched.RequestFinished("d-1", mustParams(t, `{"do_remote_prefill": false, "do_remote_decode": false}`), true, tokens, BlockIDs{blocks})
	if err != nil || !delay {
		t.Fatalf("request_finished: delay=%v err=%v", delay, err)
	}
	pp := mustParams(t, string(out))
	n, _ := r.p.sched.GetNumNewMatchedTokens(pp, tokens+5, 0)
	if _, err := r.p.sched.UpdateStateAfterAlloc("p-1", pp, BlockIDs{{3, 4}}, []int64{0}, n); err != nil {
		t.Fatal(err)
	}
	r.p.step(t)
	w := r.d.work
	r.d.waitFinished(t, "the reader's notification", func(f Finished) bool {
		r.p.finished(t)
		if contains(f.Sending, "d-1") {
			t.Fatalf("the hold ended before the step that installs it: %+v", f)
		}
		w.mu.Lock()
		defer w.mu.Unlock()
		_, kept := w.readEarly.Deadline("d-1")
		return kept
	})
	return r, tokens, blocks
}

// sendingCount polls side d n times and counts the polls that reported id
// finished sending.
func sendingCount(t *testing.T, d *side, id string, n int) int {
	t.Helper()
	got := 0
	for i := 0; i < n; i++ {
		if contains(d.finished(t).Sending, id) {
			got++
		}
	}
	return got
}

// The reader's notification again (a duplicate, or a second reader of the
// same params), before and after the step that installs the hold: the
// hold still ends once, in that step, and vLLM hears finished_sending for
// d-1 once (it asserts on a second).
func TestReadbackEarlyEndDuplicated(t *testing.T) {
	r, _, _ := readerDoneEarly(t)
	w := r.d.work
	again := func() {
		t.Helper()
		if err := r.p.work.agent.SendNotif(w.agent.Name(), kvwire.DoneNotif("d-1", 1)); err != nil {
			t.Fatal(err)
		}
	}
	w.mu.Lock()
	until0, _ := w.readEarly.Deadline("d-1")
	w.mu.Unlock()
	again()
	if n := sendingCount(t, r.d, "d-1", 10); n != 0 {
		t.Fatalf("a duplicate ended the hold before the step that installs it (%d times)", n)
	}
	w.mu.Lock()
	until1, kept := w.readEarly.Deadline("d-1")
	w.mu.Unlock()
	if !kept || until1 <= until0 {
		// Kept, and kept again from the duplicate's arrival: it was seen.
		t.Fatalf("after a duplicate: kept %v, until %v -> %v", kept, until0, until1)
	}
	r.d.step(t)
	if n := sendingCount(t, r.d, "d-1", 10); n != 1 {
		t.Fatalf("finished_sending for d-1 %d times after the step that installs its hold, want 1", n)
	}
	again()
	if n := sendingCount(t, r.d, "d-1", 10); n != 0 {
		t.Fatalf("a duplicate after the hold's end reported it again (%d times)", n)
	}
	var st map[string][]float64
	_ = json.Unmarshal(w.Stats(), &st)
	if len(st["num_notifications_after_expiry"]) != 1 {
		t.Fatalf("the duplicate after the end was not seen as one for a request gone: stats %v", st)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.readEarly.Len() != 0 || w.held.Len() != 0 {
		t.Fatalf("left behind: %d kept ends, %d holds", w.readEarly.Len(), w.held.Len())
	}
}

// A kept end whose hold did not come within twice the lease expires; a
// hold installed after that waits for its lease (its reader will not
// notify again), and ends once, at the lease: never before the step that
// installs it, never twice.
func TestReadbackEarlyEndExpired(t *testing.T) {
	r, _, _ := readerDoneEarly(t)
	w := r.d.work
	w.mu.Lock()
	w.readEarly.Hold("d-1", w.clock()-1) // twice the lease passed
	w.mu.Unlock()
	if n := sendingCount(t, r.d, "d-1", 3); n != 0 {
		t.Fatalf("an expired kept end was reported (%d times)", n)
	}
	w.mu.Lock()
	left := w.readEarly.Len()
	w.mu.Unlock()
	if left != 0 {
		t.Fatal("the sweep kept an expired end")
	}
	r.d.step(t)
	if n := sendingCount(t, r.d, "d-1", 10); n != 0 {
		t.Fatalf("the hold ended before its lease with no reader left to notify (%d times)", n)
	}
	w.mu.Lock()
	_, held := w.held.Deadline("d-1")
	if held {
		w.held.Hold("d-1", w.clock()-1) // its lease passes
	}
	w.mu.Unlock()
	if !held {
		t.Fatal("the step did not install the hold")
	}
	if n := sendingCount(t, r.d, "d-1", 10); n != 1 {
		t.Fatalf("finished_sending for d-1 %d times after its lease, want 1", n)
	}
}

// A held hashing that panics still ends: the hold's finished_sending is
// reported and its digests are ready as none (the reader reads unchecked
// at once instead of waiting for digests that will not come).
func TestReadbackHeldDigestsPanic(t *testing.T) {
	r := newReadbackRun(t, KVDigestFail, true)
	if _, err := r.d.sched.UpdateStateAfterAlloc("d-1", mustParams(t, `{"do_remote_decode": true, "_remote_blocks_processed": true}`), nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	r.d.step(t)
	r.hold(t, "d-1", []int64{7, 8}, 2*tBlockSize)
	w := r.d.work
	w.mu.Lock()
	w.heldDigest.hook = func([]DigestReq) { panic("injected") }
	w.mu.Unlock()
	in, _ := json.Marshal([]DigestReq{{ID: "d-1", Tokens: 2 * tBlockSize, Blocks: BlockIDs{{7, 8}}}})
	if err := w.KVDigestsHeld(in); err != nil {
		t.Fatal(err)
	}
	r.d.waitFinished(t, "digests after the panic", func(f Finished) bool { return f.DigestsPending })
	raw, err := w.TakeHeldDigests()
	if err != nil || string(raw) != `{"d-1":null}` {
		t.Fatalf("held digests %s (%v), want d-1 as none", raw, err)
	}
	w.mu.Lock()
	left := len(w.heldDigest.hashing)
	w.mu.Unlock()
	if left != 0 {
		t.Fatalf("%d holds still hashing after the panic", left)
	}
}

// Close waits for a held hashing (it reads memory the caller frees after
// Close) and reports nothing after it.
func TestReadbackHeldDigestsCloseWaits(t *testing.T) {
	r := newReadbackRun(t, KVDigestFail, true)
	r.hold(t, "d-1", []int64{7, 8}, 2*tBlockSize)
	in, _ := json.Marshal([]DigestReq{{ID: "d-1", Tokens: 2 * tBlockSize, Blocks: BlockIDs{{7, 8}}}})
	gate := make(chan struct{})
	var hashed atomic.Bool
	w := r.d.work
	w.mu.Lock()
	w.heldDigest.hook = func([]DigestReq) { <-gate; time.Sleep(20 * time.Millisecond); hashed.Store(true) }
	w.mu.Unlock()
	if err := w.KVDigestsHeld(in); err != nil {
		t.Fatal(err)
	}
	closed := make(chan error, 1)
	go func() { closed <- w.Close() }()
	select {
	case err := <-closed:
		t.Fatalf("Close returned while a held hashing ran (err %v)", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(gate)
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return after the hashing ended")
	}
	if !hashed.Load() {
		t.Fatal("Close returned before the hashing ended")
	}
	if err := w.KVDigestsHeld(in); err == nil {
		t.Fatal("a closed worker started hashing")
	}
}

// The digests may come after the READ: the reader waits for them
// ("pending"), bounded; a hold its workers did not digest ("none") and a
// decode that serves none are read unchecked and served.
func TestReadbackKVDigestPendingAndNone(t *testing.T) {
	r := newReadbackRun(t, KVDigestFail, true)
	const tokens = 2 * tBlockSize
	out := r.hold(t, "d-1", []int64{7, 8}, tokens)
	pp := mustParams(t, string(out))
	n, _ := r.p.sched.GetNumNewMatchedTokens(pp, tokens, 0)
	if _, err := r.p.sched.UpdateStateAfterAlloc("p-1", pp, BlockIDs{{3, 4}}, []int64{0}, n); err != nil {
		t.Fatal(err)
	}
	r.p.step(t)
	for i := 0; i < 50; i++ { // the READ completes; the check waits
		if f := r.p.finished(t); contains(f.Recving, "p-1") {
			t.Fatalf("finished before the decode's digests came: %+v", f)
		}
		time.Sleep(2 * time.Millisecond)
	}
	r.digest(t, "d-1", []int64{7, 8}, tokens)
	if f := r.p.waitFinished(t, "p-1", func(f Finished) bool { return contains(f.Recving, "p-1") }); contains(f.Failed, "p-1") {
		t.Fatalf("read-back with late digests failed: %v", r.logs.All())
	}
	if got := r.count(t, "gonixl_kv_digest_checked_blocks_total"); got != "2" {
		t.Fatalf("checked blocks %s, want 2", got)
	}

	out = r.hold(t, "d-2", []int64{9, 10}, tokens)
	if err := r.d.sched.SetKVDigests([]byte(`{"d-2": null}`)); err != nil {
		t.Fatal(err)
	}
	if r.readBack(t, "p-2", out, tokens, []int64{11, 12}, 0) {
		t.Fatal("a read-back without digests failed")
	}
	if got := r.count(t, "gonixl_kv_digest_unchecked_total"); got != "1" {
		t.Fatalf("unchecked %s, want 1", got)
	}

	s := newReadbackRun(t, KVDigestFail, false)
	out = s.hold(t, "d-3", []int64{7, 8}, tokens)
	if strings.Contains(string(out), kvwire.KeyKVDigestServed) {
		t.Fatalf("a decode that serves no digests says it does: %s", out)
	}
	if s.readBack(t, "p-3", out, tokens, []int64{3, 4}, 0) {
		t.Fatal("a read-back from a decode without digests failed")
	}
	if n := s.logs.FilterMessageSnippet("serves no KV digests").Len(); n != 1 {
		t.Fatalf("%d 'serves no KV digests' lines, want 1", n)
	}
}

// A decode that finished with a step in flight (async scheduling) has a
// block allocated past the tokens it advertises when their count is a
// multiple of the block size: its params name only the blocks of those
// tokens, so that a sliding-window group's window (the list's tail) is not
// one block late.
func TestFinishedParamsNameOnlyTheAdvertisedTokensBlocks(t *testing.T) {
	cfg := testConfig(t, RoleScheduler, "kv_consumer", "engine-d", freePort(t), map[string]any{"bidirectional_kv_xfer": true})
	cfg.TransferGroups = []TransferGroup{{Kind: "full_attention", BlockSize: tBlockSize}, {Kind: "sliding_window", SlidingWindow: 2 * tBlockSize, BlockSize: tBlockSize}}
	cfg.HMARequired = true
	s, err := NewScheduler(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	in := mustParams(t, `{"do_remote_prefill": false, "do_remote_decode": false}`)
	_, out, err := s.RequestFinished("d-1", in, true, 4*tBlockSize, BlockIDs{{1, 2, 3, 4, 9}, {0, 0, 7, 8, 10}})
	if err != nil {
		t.Fatal(err)
	}
	p := mustParams(t, string(out))
	if fmt.Sprint(p.RemoteBlockIDs) != "[[1 2 3 4] [0 7 8]]" {
		t.Fatalf("remote_block_ids %v, want [[1 2 3 4] [0 7 8]] (the in-flight step's blocks 9 and 10 left out)", p.RemoteBlockIDs)
	}
}

// Params that claim served digests from an engine whose handshake shows a
// stock engine are read unchecked and the engine is never sent the query
// (vLLM's listener would take it for a malformed handshake and stop).
func TestReadbackDigestQueryOnlyToGonixlEngines(t *testing.T) {
	r := newReadbackRun(t, KVDigestFail, true)
	const tokens = 2 * tBlockSize
	out := r.hold(t, "d-1", []int64{7, 8}, tokens)
	r.digest(t, "d-1", []int64{7, 8}, tokens)
	if r.readBack(t, "p-1", out, tokens, []int64{3, 4}, 0) {
		t.Fatal("clean read-back failed")
	}
	served, _ := r.d.sched.listener.Counts()
	r.p.work.mu.Lock()
	for _, re := range r.p.work.remotes {
		re.gonixl = false // as a stock engine's handshake leaves it
	}
	r.p.work.mu.Unlock()
	out = r.hold(t, "d-2", []int64{9, 10}, tokens)
	r.digest(t, "d-2", []int64{9, 10}, tokens)
	if r.readBack(t, "p-2", out, tokens, []int64{11, 12}, 0) {
		t.Fatal("the read-back failed")
	}
	if after, _ := r.d.sched.listener.Counts(); after != served {
		t.Fatalf("the engine was queried: served %d -> %d", served, after)
	}
	if n := r.logs.FilterMessageSnippet("the engine is not gonixl").Len(); n != 1 {
		t.Fatalf("%d 'not gonixl' lines, want 1", n)
	}
}
