package shim

import (
	"encoding/json"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/nixltest"
	"github.com/gonixl/gonixl/shim/kvwire"
)

// newDigestSide is newSide with the token order of the test layout known
// ([heads][tokens][head_size] per block: "head_major").
func newDigestSide(t *testing.T, eng nixl.Engine, kvRole, id string, fill byte, extra map[string]any) *side {
	return newDigestSideClock(t, eng, kvRole, id, fill, extra, nil)
}

func newDigestSideClock(t *testing.T, eng nixl.Engine, kvRole, id string, fill byte, extra map[string]any, clock Clock) *side {
	t.Helper()
	return newSideWith(t, eng, kvRole, id, freePort(t), clock, fill, extra, func(init *WorkerInit) {
		init.BlockReshape, init.HeadSize = "head_major", tHeadDim
	})
}

// withDigests is what the Python prefill does with the worker's digests:
// params gain gonixl_kv_digest for the blocks they name (the whole list).
func withDigests(t *testing.T, p *side, reqID string, blocks []int64, tokens int64, out []byte) []byte {
	t.Helper()
	in, _ := json.Marshal([]DigestReq{{ID: reqID, Tokens: tokens, Blocks: BlockIDs{blocks}}})
	raw, err := p.work.KVDigests(in)
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]DigestOut
	if err := json.Unmarshal(raw, &got); err != nil {
		t.Fatal(err)
	}
	d, ok := got[reqID]
	if !ok || len(d.Blocks) != 1 || len(d.Blocks[0]) != len(blocks) {
		t.Fatalf("digests %s", raw)
	}
	for j, v := range d.Blocks[0] {
		if v == 0 {
			t.Fatalf("block %d not digested: %s", j, raw)
		}
	}
	var params map[string]any
	if err := json.Unmarshal(out, &params); err != nil {
		t.Fatal(err)
	}
	params[kvwire.KeyKVDigest] = kvwire.KVDigest{Alg: kvwire.KVDigestAlg, Tokens: tokens, First: []int64{0},
		Ranks: []kvwire.RankDigest{{Blocks: d.Blocks, Regions: d.Regions}}}
	b, err := json.Marshal(params)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// slot returns token t of head h in block b of region kv of layer l.
func (km *kvMem) slot(l, kv, b, h, tok int) []byte {
	blk := km.block(l, kv, b)
	off := (h*tBlockSize + tok) * tHeadDim * tElem
	return blk[off : off+tHeadDim*tElem]
}

type digestRun struct {
	p, d *side
	logs *observer.ObservedLogs
}

func newDigestRun(t *testing.T, mode string) *digestRun {
	return newDigestRunClock(t, mode, nil)
}

func newDigestRunClock(t *testing.T, mode string, clock Clock) *digestRun {
	return newDigestRunEngine(t, mode, clock, nixltest.NewEngine("t"))
}

func newDigestRunEngine(t *testing.T, mode string, clock Clock, eng *nixltest.Engine) *digestRun {
	extra := map[string]any{"kv_digest": mode}
	r := &digestRun{p: newDigestSideClock(t, eng, "kv_producer", "engine-p", 1, extra, clock), d: newDigestSideClock(t, eng, "kv_consumer", "engine-d", 200, extra, clock)}
	core, logs := observer.New(zapcore.InfoLevel)
	r.d.work.mu.Lock()
	r.d.work.log = zap.New(core)
	r.d.work.mu.Unlock()
	r.logs = logs
	return r
}

// read loads reqID's params into the decode's blocks local (a prefix hit of
// cached blocks when local is shorter than the prefill's list) and returns
// the results.
func (r *digestRun) read(t *testing.T, reqID string, out []byte, local []int64, cached int64) Finished {
	t.Helper()
	dp := mustParams(t, string(out))
	r.d.sched.OnNewRequest(reqID, dp)
	if _, err := r.d.sched.UpdateStateAfterAlloc(reqID, dp, BlockIDs{local}, []int64{cached}, int64(len(local))*tBlockSize); err != nil {
		t.Fatal(err)
	}
	r.d.step(t)
	return r.d.waitFinished(t, "recv "+reqID, func(f Finished) bool { return contains(f.Recving, reqID) })
}

func (r *digestRun) mismatchLines() []observer.LoggedEntry {
	var out []observer.LoggedEntry
	for _, e := range r.logs.All() {
		if strings.Contains(e.Message, "kv_digest_mismatch") {
			out = append(out, e)
		}
	}
	return out
}

// A READ of the blocks the prefill digested passes; the same READ after one
// byte of one block changed (a block reassigned under the lease, a partial
// write) fails the load under "fail", naming group, block and layer.
func TestKVDigestCatchesAChangedBlock(t *testing.T) {
	r := newDigestRun(t, KVDigestFail)
	const tokens = 3*tBlockSize - 1 // the last block partly filled
	out := withDigests(t, r.p, "req-1", []int64{3, 4, 5}, tokens, prefill(t, r.p, "req-1", []int64{3, 4, 5}, tokens))
	f := r.read(t, "dreq-1", out, []int64{7, 8, 9}, 0)
	if contains(f.Failed, "dreq-1") || len(r.mismatchLines()) != 0 {
		t.Fatalf("clean READ failed: %+v %v", f, r.mismatchLines())
	}

	out = withDigests(t, r.p, "req-2", []int64{10, 11, 12}, tokens, prefill(t, r.p, "req-2", []int64{10, 11, 12}, tokens))
	r.p.kv.slot(1, 1, 11, 1, 2)[5] ^= 0x40 // layer 1, V, block position 1, head 1, token 2
	f = r.read(t, "dreq-2", out, []int64{13, 14, 15}, 0)
	if !contains(f.Failed, "dreq-2") {
		t.Fatalf("a changed byte was not caught: %+v", f)
	}
	lines := r.mismatchLines()
	if len(lines) != 1 {
		t.Fatalf("%d mismatch lines, want 1", len(lines))
	}
	msg := lines[0].Message
	for _, want := range []string{"group 0 block 1 (local id 14, remote id 11", "model.layers.1.self_attn (region 3)", "dreq-2"} {
		if !strings.Contains(msg, want) {
			t.Errorf("mismatch line lacks %q: %s", want, msg)
		}
	}
}

// Only the prompt's token slots count: bytes past the prompt in its last
// block (a step still in flight writes the next slot) are not a mismatch,
// a byte of the last prompt token is.
func TestKVDigestCoversPromptSlotsOnly(t *testing.T) {
	r := newDigestRun(t, KVDigestFail)
	const tokens = 2*tBlockSize + 2
	out := withDigests(t, r.p, "req-1", []int64{3, 4, 5}, tokens, prefill(t, r.p, "req-1", []int64{3, 4, 5}, tokens))
	for h := 0; h < tHeads; h++ {
		for tok := 2; tok < tBlockSize; tok++ {
			r.p.kv.slot(0, 0, 5, h, tok)[0] ^= 0xff
		}
	}
	if f := r.read(t, "dreq-1", out, []int64{7, 8, 9}, 0); contains(f.Failed, "dreq-1") {
		t.Fatalf("bytes past the prompt were taken for a mismatch: %v", r.mismatchLines())
	}
	out = withDigests(t, r.p, "req-2", []int64{10, 11, 12}, tokens, prefill(t, r.p, "req-2", []int64{10, 11, 12}, tokens))
	r.p.kv.slot(0, 0, 12, 1, 1)[tHeadDim*tElem-1] ^= 1
	if f := r.read(t, "dreq-2", out, []int64{13, 14, 15}, 0); !contains(f.Failed, "dreq-2") {
		t.Fatal("a changed byte of the last prompt token was not caught")
	}
}

// A prefix hit on the decode reads the tail: the blocks read are checked
// (a change there fails, one in the cached head does not matter), and the
// layer is not located.
func TestKVDigestPartialRead(t *testing.T) {
	r := newDigestRun(t, KVDigestFail)
	const tokens = 3 * tBlockSize
	out := withDigests(t, r.p, "req-1", []int64{3, 4, 5}, tokens, prefill(t, r.p, "req-1", []int64{3, 4, 5}, tokens))
	r.p.kv.block(0, 0, 3)[0] ^= 1 // not read: cached on the decode
	if f := r.read(t, "dreq-1", out, []int64{9}, 2); contains(f.Failed, "dreq-1") {
		t.Fatalf("a change outside the blocks read failed the load: %v", r.mismatchLines())
	}
	out = withDigests(t, r.p, "req-2", []int64{10, 11, 12}, tokens, prefill(t, r.p, "req-2", []int64{10, 11, 12}, tokens))
	r.p.kv.block(1, 0, 12)[7] ^= 1
	if f := r.read(t, "dreq-2", out, []int64{9}, 2); !contains(f.Failed, "dreq-2") {
		t.Fatal("a change in the block read was not caught")
	}
	if l := r.mismatchLines(); len(l) != 1 || !strings.Contains(l[0].Message, "group 0 block 2 (local id 9, remote id 12") || !strings.Contains(l[0].Message, "not located") {
		t.Fatalf("mismatch lines %v", l)
	}
}

// kv_digest verify serves the KV and counts; off reads unchecked; params
// without digests (a stock prefill) are read unchecked and said once.
func TestKVDigestModes(t *testing.T) {
	const tokens = 3 * tBlockSize
	for _, mode := range []string{KVDigestVerify, KVDigestOff} {
		r := newDigestRun(t, mode)
		out := withDigests(t, r.p, "req-1", []int64{3, 4, 5}, tokens, prefill(t, r.p, "req-1", []int64{3, 4, 5}, tokens))
		r.p.kv.block(0, 1, 4)[0] ^= 1
		if f := r.read(t, "dreq-1", out, []int64{7, 8, 9}, 0); contains(f.Failed, "dreq-1") {
			t.Fatalf("%s: the load failed", mode)
		}
		want := map[string]int{KVDigestVerify: 1, KVDigestOff: 0}[mode]
		if n := len(r.mismatchLines()); n != want {
			t.Fatalf("%s: %d mismatch lines, want %d", mode, n, want)
		}
		text, _ := r.d.work.MetricsText()
		if mode == KVDigestVerify && !strings.Contains(string(text), `gonixl_kv_digest_mismatches_total{engine_id="engine-d"} 1`) {
			t.Fatalf("verify: mismatch not counted:\n%s", text)
		}
	}
	r := newDigestRun(t, KVDigestFail)
	for i, id := range []string{"a", "b"} {
		out := prefill(t, r.p, "req-"+id, []int64{int64(3 + i)}, tBlockSize)
		if f := r.read(t, "dreq-"+id, out, []int64{int64(7 + i)}, 0); contains(f.Failed, "dreq-"+id) {
			t.Fatal("params without digests failed the load")
		}
	}
	if n := r.logs.FilterMessageSnippet("reading KV unchecked").Len(); n != 1 {
		t.Fatalf("%d 'unchecked' lines for two requests, want 1", n)
	}
	text, _ := r.d.work.MetricsText()
	if !strings.Contains(string(text), `gonixl_kv_digest_unchecked_total{engine_id="engine-d"} 2`) {
		t.Fatalf("unchecked reads not counted:\n%s", text)
	}
}

// Malformed digests are refused by the parser with a reason, never taken.
func TestParseKVDigestRefusesMisshapen(t *testing.T) {
	good := kvwire.KVDigest{Alg: kvwire.KVDigestAlg, Tokens: 8, First: []int64{0}, Ranks: []kvwire.RankDigest{{Blocks: [][]uint64{{1, 2}}, Regions: [][]uint64{{3}}}}}
	b, _ := json.Marshal(good)
	if _, err := kvwire.ParseKVDigest(b, BlockIDs{{5, 6}}); err != nil {
		t.Fatalf("good digest refused: %v", err)
	}
	for name, ids := range map[string]BlockIDs{"one block too many": {{5, 6, 7}}, "two groups": {{5, 6}, {1, 2}}} {
		if _, err := kvwire.ParseKVDigest(b, ids); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	for _, bad := range []string{`{"alg":"md5","tokens":8,"first":[0],"ranks":[{"blocks":["AQAAAAAAAAACAAAAAAAAAA=="],"regions":[""]}]}`,
		`{"alg":"xxh3-64","tokens":8,"first":[0],"ranks":[{"blocks":["AQAAAAAAAAACAAAAAAAA"],"regions":[""]}]}`,
		`{"alg":"xxh3-64","tokens":-1,"first":[0],"ranks":[]}`, `[]`} {
		if _, err := kvwire.ParseKVDigest([]byte(bad), BlockIDs{{5, 6}}); err == nil {
			t.Errorf("accepted %s", bad)
		}
	}
}

// The test faults of GONIXL_TEST_KV_FAULT (the end-to-end test's) are each
// caught; requests not named for a fault are read intact.
func TestKVFaultsAreCaught(t *testing.T) {
	t.Setenv(EnvKVFault, "1")
	// lands: an engine that says when a READ landed, so the check starts
	// then (watchLandingLocked) and a flip happens there.
	for _, lands := range []bool{false, true} {
		t.Run(fmt.Sprintf("lands=%v", lands), func(t *testing.T) { testKVFaultsAreCaught(t, lands) })
	}
}

func testKVFaultsAreCaught(t *testing.T, lands bool) {
	clock := NewFakeClock(1000)
	eng := nixltest.NewEngine("t")
	eng.SetScript(nixltest.Script{Lands: lands})
	r := newDigestRunEngine(t, KVDigestFail, clock.Now, eng)
	const tokens = 3 * tBlockSize
	blocks := func(i int64) []int64 { return []int64{3 * i, 3*i + 1, 3*i + 2} }
	for i, id := range []string{"plain", "kvfault-flip", "kvfault-tail"} {
		out := withDigests(t, r.p, id, blocks(int64(i)), tokens, prefill(t, r.p, id, blocks(int64(i)), tokens))
		f := r.read(t, "d-"+id, out, []int64{12, 13, 14}, 0)
		if got, want := contains(f.Failed, "d-"+id), id != "plain"; got != want {
			t.Fatalf("%s: failed=%v, want %v (%v)", id, got, want, r.mismatchLines())
		}
	}
	// kvfault-late: the prefill frees the blocks at once and another
	// request's KV goes there before the READ.
	out := withDigests(t, r.p, "kvfault-late", blocks(3), tokens, prefill(t, r.p, "kvfault-late", blocks(3), tokens))
	dp := mustParams(t, string(out))
	r.d.sched.OnNewRequest("d-kvfault-late", dp)
	if _, err := r.d.sched.UpdateStateAfterAlloc("d-kvfault-late", dp, BlockIDs{{12, 13, 14}}, []int64{0}, tokens); err != nil {
		t.Fatal(err)
	}
	r.d.step(t)
	r.p.waitFinished(t, "the early notification frees the prefill's blocks", func(f Finished) bool { return contains(f.Sending, "kvfault-late") })
	copy(r.p.kv.block(0, 0, 10), r.p.kv.block(0, 0, 0)) // reassigned
	if f := r.d.finished(t); contains(f.Recving, "d-kvfault-late") {
		t.Fatal("the late READ did not wait")
	}
	clock.Advance(lateFaultDelay + 0.1)
	f := r.d.waitFinished(t, "the late READ", func(f Finished) bool { return contains(f.Recving, "d-kvfault-late") })
	if !contains(f.Failed, "d-kvfault-late") {
		t.Fatalf("a READ of reassigned blocks was not caught: %+v", f)
	}
}

// BenchmarkKVDigests: a prefill's digest of one 1,000-token prompt of the
// bench fixture (28 layers, 2 KV heads of 32, float32, block size 32, the
// CPU backend's vec layout: 14 MB of KV); MB/s is KV hashed per second
// (issue 33's target: at least 5,000, 0.2 ms per MB).
func BenchmarkKVDigests(b *testing.B) {
	w, in := benchDigestWorker(b)
	for b.Loop() {
		if _, err := w.KVDigests(in); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkKVDigestsHeld: a bidirectional decode's read-back hold of the
// same KV, the time vLLM's thread spends in the call (the hashing runs on
// a goroutine; each iteration waits for it outside the timer).
func BenchmarkKVDigestsHeld(b *testing.B) {
	w, in := benchDigestWorker(b)
	b.SetBytes(0)
	for b.Loop() {
		if err := w.KVDigestsHeld(in); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		for {
			if f := w.Poll(); f.DigestsPending {
				break
			}
			runtime.Gosched()
		}
		if _, err := w.TakeHeldDigests(); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}

// benchDigestWorker is a worker with the fixture's KV registered and the
// digest request of one 1,000-token prompt.
func benchDigestWorker(b *testing.B) (*Worker, []byte) {
	const layers, heads, hd, bs, elem, nBlocks, tokens = 28, 2, 32, 32, 4, 64, 1000
	w, err := NewWorker(testConfig(b, RoleWorker, "kv_producer", "bench", 0, nil), nil)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { w.Close() })
	blockLen := heads * bs * 2 * hd * elem
	var ls []LayerTensor
	for l := 0; l < layers; l++ {
		m, err := nixltest.Alloc(nBlocks * blockLen)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { m.Free() })
		for i := range m.Bytes {
			m.Bytes[i] = byte(i*7 + l)
		}
		ls = append(ls, LayerTensor{Name: fmt.Sprintf("model.layers.%d.self_attn.attn", l), DataPtr: m.Addr, StoragePtr: m.Addr, StorageBytes: uint64(nBlocks * blockLen),
			ElemSize: elem, Shape: []int64{nBlocks, heads, bs, 2 * hd}, Stride: []int64{heads * bs * 2 * hd, bs * 2 * hd, 2 * hd, 1}, Device: "cpu"})
	}
	if w.layout, err = BuildLayout(ls, nBlocks); err != nil {
		b.Fatal(err)
	}
	w.blockSize, w.blockReshape, w.headSize = bs, "cpu_vec", hd
	ids := make([]int64, (tokens+bs-1)/bs)
	for i := range ids {
		ids[i] = int64(2 * i)
	}
	in, _ := json.Marshal([]DigestReq{{ID: "r", Tokens: tokens, Blocks: BlockIDs{ids}}})
	b.SetBytes(int64(tokens * layers * heads * 2 * hd * elem))
	return w, in
}

// flipAt flips a bit of the byte at addr in km's memory; false if addr is
// not in it.
func (km *kvMem) flipAt(addr uint64) bool {
	for _, m := range km.mems {
		if addr >= m.Addr && addr < m.Addr+uint64(len(m.Bytes)) {
			m.Bytes[addr-m.Addr] ^= 1
			return true
		}
	}
	return false
}

// Push: the prefill sends its digests of the blocks it WRITEs in the
// WRITE's completion notification (to a decode that asks, in its
// registration); the decode checks the filled blocks when it comes. Bytes
// that change between the digest and the copy fail the load.
func TestPushKVDigest(t *testing.T) {
	eng, p, d := pushPair(t, nil, nil)
	run := func(n int) Finished {
		pid, did := fmt.Sprintf("cmpl-k%d-0-aaaaaaaa", n), fmt.Sprintf("cmpl-k%d-0-bbbbbbbb", n)
		pushDecode(t, d, p, did, fmt.Sprintf("cmpl-k%d-0", n), 12, []int64{9, 10}, []int64{8})
		pushPrefill(t, p, pid, []int64{3, 4, 5}, 12)
		return d.waitFinished(t, "decode recv", func(f Finished) bool { p.finished(t); return contains(f.Recving, did) })
	}
	var digests int
	eng.SetNotifHook(func(_, _ string, msg []byte) bool {
		if strings.Contains(string(msg), "\x00"+kvwire.PushDigestPrefix) {
			digests++ // in the WRITE's completion notification
		}
		return false
	})
	if f := run(1); len(f.Failed) != 0 {
		t.Fatalf("clean push failed: %+v", f)
	}
	text, _ := d.work.MetricsText()
	if digests != 1 || !strings.Contains(string(text), `gonixl_kv_digest_checked_blocks_total{engine_id="engine-d"} 2`) {
		t.Fatalf("%d digest messages; decode metrics:\n%s", digests, text)
	}
	eng.SetMoveHook(func(m nixltest.Move) {
		if m.Op == nixl.Write && len(m.Local) > 0 && !p.kv.flipAt(m.Local[0].Addr+3) {
			t.Errorf("WRITE source %#x not in the prefill's memory", m.Local[0].Addr)
		}
	})
	if f := run(2); len(f.Failed) != 1 {
		t.Fatalf("a byte changed on the way was not caught: %+v", f)
	}
}

// A check whose hashing goroutine panics fails the load under fail (it
// was not checked) and leaves nothing waiting: the worker still closes.
func TestKVDigestCheckPanicFailsTheLoad(t *testing.T) {
	r := newDigestRun(t, KVDigestFail)
	const tokens = 3 * tBlockSize
	out := withDigests(t, r.p, "req-1", []int64{3, 4, 5}, tokens, prefill(t, r.p, "req-1", []int64{3, 4, 5}, tokens))
	testPanicHook = func(what string) {
		if what == "kv digest check" {
			panic("test: the check's goroutine")
		}
	}
	defer func() { testPanicHook = nil }()
	if f := r.read(t, "dreq-1", out, []int64{7, 8, 9}, 0); !contains(f.Failed, "dreq-1") {
		t.Fatalf("a check that never ran served the load: %+v", f)
	}
	closed := make(chan error, 1)
	go func() { closed <- r.d.work.Close() }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close waits for a check that panicked")
	}
}

// readInFlight loads reqID's params into local and runs the step that
// posts the READ (which the engine's script keeps in flight); it returns
// the READ's transfer id.
func (r *digestRun) readInFlight(t *testing.T, eng *nixltest.Engine, reqID string, out []byte, local []int64) uint64 {
	t.Helper()
	dp := mustParams(t, string(out))
	r.d.sched.OnNewRequest(reqID, dp)
	if _, err := r.d.sched.UpdateStateAfterAlloc(reqID, dp, BlockIDs{local}, []int64{0}, int64(len(local))*tBlockSize); err != nil {
		t.Fatal(err)
	}
	r.d.step(t)
	deadline := time.Now().Add(10 * time.Second)
	for {
		var ids []uint64
		for _, x := range eng.Transfers() {
			if x.Op == nixl.Read && x.Posted && x.Status == nixl.InProgress {
				ids = append(ids, x.ID)
			}
		}
		if len(ids) == 1 {
			return ids[0]
		}
		if len(ids) > 1 || time.Now().After(deadline) {
			t.Fatalf("%d READs in flight, want 1", len(ids))
		}
		// The READ waits for the handshake; polls post it.
		if f := r.d.finished(t); len(f.Recving) > 0 || len(f.Failed) > 0 {
			t.Fatalf("finished before its READ was posted: %+v", f)
		}
		time.Sleep(time.Millisecond)
	}
}

// checkReady is whether reqID's check has its result waiting.
func (r *digestRun) checkReady(reqID string) bool {
	w := r.d.work
	w.mu.Lock()
	defer w.mu.Unlock()
	st := w.recv[reqID]
	return st != nil && st.checking != nil && len(st.checking) == 1
}

// An engine that says when a READ's bytes landed (nixl.Lander; the ucx
// engine's own copies) has the check hashed from that moment: the poll that
// sees the READ complete reports the request, checked, without a poll of
// its own for the check (one step sooner). A damaged block is still caught
// that way, and the decode's blocks are hashed only after they landed.
func TestKVDigestCheckStartsWhenTheBytesLand(t *testing.T) {
	old := idlePollAfter
	idlePollAfter = 0 // only this test's polls: the idle poller would start the check too
	defer func() { idlePollAfter = old }()
	for _, damage := range []bool{false, true} {
		t.Run(fmt.Sprintf("damaged=%v", damage), func(t *testing.T) {
			eng := nixltest.NewEngine("t")
			eng.SetScript(nixltest.Script{Polls: 1 << 30, Lands: true}) // completes only when settled
			r := newDigestRunEngine(t, KVDigestFail, nil, eng)
			const tokens = 3*tBlockSize - 1
			out := withDigests(t, r.p, "req-1", []int64{3, 4, 5}, tokens, prefill(t, r.p, "req-1", []int64{3, 4, 5}, tokens))
			if damage {
				r.p.kv.slot(0, 0, 4, 0, 1)[0] ^= 1
			}
			id := r.readInFlight(t, eng, "dreq-1", out, []int64{7, 8, 9})
			if f := r.d.finished(t); contains(f.Recving, "dreq-1") {
				t.Fatalf("reported before the READ landed: %+v", f)
			}
			time.Sleep(20 * time.Millisecond)
			if r.checkReady("dreq-1") {
				t.Fatal("a check result before the READ's bytes landed")
			}
			if !eng.Settle(id, true) {
				t.Fatal("could not settle the READ")
			}
			deadline := time.Now().Add(10 * time.Second)
			for !r.checkReady("dreq-1") {
				if time.Now().After(deadline) {
					t.Fatal("the check did not run after the READ landed")
				}
				time.Sleep(time.Millisecond)
			}
			f := r.d.finished(t) // the first poll that sees the READ complete
			if !contains(f.Recving, "dreq-1") {
				t.Fatalf("the poll that saw the READ complete did not report it: %+v", f)
			}
			if got := contains(f.Failed, "dreq-1"); got != damage {
				t.Fatalf("failed=%v, want %v (%v)", got, damage, r.mismatchLines())
			}
		})
	}
}

// A READ that never lands (its peer frozen) keeps a landing watch, which
// a timeout ends, and Close ends too: Close waits for checks, so a watch it
// could not end would hang the worker's Close.
func TestKVDigestLandingWatchEndsWithTheRead(t *testing.T) {
	// stuck: the timed-out READ's release is refused and its request stays
	// (holdStuckLocked): failLocked must end the watch, not the removal.
	for _, how := range []string{"timeout", "stuck", "close"} {
		t.Run(how, func(t *testing.T) {
			eng := nixltest.NewEngine("t")
			eng.SetScript(nixltest.Script{Polls: 1 << 30, Lands: true, RefuseReleaseInFlight: how == "stuck", InFlightSurvivesInvalidate: how == "stuck"})
			clock := NewFakeClock(1000)
			r := newDigestRunEngine(t, KVDigestFail, clock.Now, eng)
			const tokens = 2 * tBlockSize
			out := withDigests(t, r.p, "req-1", []int64{3, 4}, tokens, prefill(t, r.p, "req-1", []int64{3, 4}, tokens))
			r.readInFlight(t, eng, "dreq-1", out, []int64{7, 8})
			w := r.d.work
			w.mu.Lock()
			watched := w.recv["dreq-1"] != nil && w.recv["dreq-1"].unwatch != nil
			w.mu.Unlock()
			if !watched {
				t.Fatal("no landing watch for a READ of an engine that says when bytes land")
			}
			if how != "close" {
				clock.Advance(w.cfg.TransferTimeout + 1)
				f := r.d.finished(t)
				if !contains(f.Failed, "dreq-1") {
					t.Fatalf("the READ did not time out: %+v", f)
				}
				w.mu.Lock()
				st := w.recv["dreq-1"]
				stuck := st != nil && len(st.xfers) > 0 && st.xfers[0].stuck > 0
				w.mu.Unlock()
				if stuck != (how == "stuck") {
					t.Fatalf("stuck=%v, want %v", stuck, how == "stuck")
				}
				ended := make(chan struct{})
				go func() { w.checks.Wait(); close(ended) }()
				select {
				case <-ended:
				case <-time.After(5 * time.Second):
					t.Fatal("the landing watch outlived the failed READ")
				}
			}
			done := make(chan error, 1)
			go func() { done <- w.Close() }()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("Close hung on a landing watch")
			}
		})
	}
}

// A second load of a request whose check is still hashing replaces it
// (startReadsLocked): the replaced request's watch ends then, not at Close.
func TestKVDigestDuplicateLoadEndsTheOldWatch(t *testing.T) {
	old := idlePollAfter
	idlePollAfter = 0
	defer func() { idlePollAfter = old }()
	hold := make(chan struct{})
	testPanicHook = func(what string) {
		if what == "kv digest check" {
			<-hold // the check is still hashing
		}
	}
	// Registered before the engines' own clean-ups: reset after they closed.
	t.Cleanup(func() { testPanicHook = nil })
	eng := nixltest.NewEngine("t")
	eng.SetScript(nixltest.Script{Polls: 1 << 30, Lands: true})
	r := newDigestRunEngine(t, KVDigestFail, nil, eng)
	const tokens = 2 * tBlockSize
	out := withDigests(t, r.p, "req-1", []int64{3, 4}, tokens, prefill(t, r.p, "req-1", []int64{3, 4}, tokens))
	id := r.readInFlight(t, eng, "dreq-1", out, []int64{7, 8})
	eng.Settle(id, true)
	if f := r.d.finished(t); contains(f.Recving, "dreq-1") {
		t.Fatal("reported while its check was held")
	}
	w := r.d.work
	w.mu.Lock()
	oldSt := w.recv["dreq-1"]
	if oldSt == nil || len(oldSt.xfers) != 0 || oldSt.unwatch == nil {
		w.mu.Unlock()
		close(hold)
		t.Fatalf("set-up: %+v", oldSt)
	}
	w.startReadsLocked(&StepMeta{ReqsToRecv: map[string]*RecvReq{"dreq-1": oldSt.meta}})
	replaced := w.recv["dreq-1"] != oldSt
	ended := oldSt.unwatch == nil
	w.mu.Unlock()
	close(hold)
	if !replaced || !ended {
		t.Fatalf("replaced=%v, old watch ended=%v", replaced, ended)
	}
}
