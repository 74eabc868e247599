package shim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
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

const (
	tNumBlocks = 16
	tHeads     = 2
	tBlockSize = 4
	tHeadDim   = 8
	tElem      = 4
	tLayers    = 2
	// one block of one K or V region
	tBlockLen = tHeads * tBlockSize * tHeadDim * tElem
)

// freePort returns a free port below the kernel's ephemeral range: a port
// the kernel handed out for ":0" is free again once closed, and the source
// port of the next outgoing connection (a side-channel client, UCX) may take
// it before the test binds it.
func freePort(t *testing.T) int {
	t.Helper()
	return freePortRun(t, 1)
}

// freePortRun returns the first of n consecutive free ports below the
// kernel's ephemeral range (32768 and up by default), so that ports the test
// later binds with port 0 (side channels) cannot land inside the run.
func freePortRun(t testing.TB, n int) int {
	t.Helper()
	for try := 0; try < 200; try++ {
		base := 20000 + rand.IntN(12000-n)
		ok := true
		for i := 0; i < n && ok; i++ {
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", base+i))
			if err != nil {
				ok = false
				break
			}
			l.Close()
		}
		if ok {
			return base
		}
	}
	t.Fatalf("no %d consecutive free ports in 20000-32000", n)
	return 0
}

func testConfig(t testing.TB, role Role, kvRole, engineID string, port int, extra map[string]any) *Config {
	t.Helper()
	raw := map[string]any{
		"role": role, "kv_role": kvRole, "engine_id": engineID,
		"side_channel_host": "127.0.0.1", "side_channel_port": port,
		"block_size":                tBlockSize,
		"kv_connector_extra_config": extra,
		"compat_factors":            map[string]any{"model": "tiny", "dtype": "torch.float32", "num_kv_heads": 2, "speculative_config": nil},
	}
	b, _ := json.Marshal(raw)
	c, err := ParseConfig(b)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// kvMem allocates FlashAttention-shaped caches, [2, num_blocks, heads,
// block_size, head_dim] per layer, in one mapping per layer.
type kvMem struct {
	mems   []*nixltest.Mem
	layers []LayerTensor
}

func newKVMem(t *testing.T, fill byte) *kvMem {
	t.Helper()
	km := &kvMem{}
	per := 2 * tNumBlocks * tBlockLen
	for l := 0; l < tLayers; l++ {
		m, err := nixltest.Alloc(per)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = m.Free() })
		for i := range m.Bytes {
			m.Bytes[i] = fill + byte(l*31+i/tBlockLen)
		}
		km.mems = append(km.mems, m)
		km.layers = append(km.layers, LayerTensor{
			Name: fmt.Sprintf("model.layers.%d.self_attn", l), DataPtr: m.Addr, StoragePtr: m.Addr, StorageBytes: uint64(per),
			ElemSize: tElem, Shape: []int64{2, tNumBlocks, tHeads, tBlockSize, tHeadDim},
			Stride: []int64{tNumBlocks * tHeads * tBlockSize * tHeadDim, tHeads * tBlockSize * tHeadDim, tBlockSize * tHeadDim, tHeadDim, 1},
			Device: "cpu",
		})
	}
	return km
}

// block returns region kv (0=K, 1=V) block b of layer l.
func (km *kvMem) block(l, kv, b int) []byte {
	off := (kv*tNumBlocks + b) * tBlockLen
	return km.mems[l].Bytes[off : off+tBlockLen]
}

func initFor(km *kvMem) *WorkerInit {
	return &WorkerInit{Layers: km.layers, NumBlocks: tNumBlocks, BlockSize: tBlockSize, AttnBackend: "CPU_ATTN", KVCacheLayout: "LBHNC"}
}

type side struct {
	sched *Scheduler
	work  *Worker
	kv    *kvMem
	port  int
}

func newSide(t *testing.T, eng nixl.Engine, kvRole, id string, clock Clock, fill byte, extra map[string]any) *side {
	t.Helper()
	return newSideWith(t, eng, kvRole, id, freePort(t), clock, fill, extra, nil)
}

// newSideWith is newSide at a given side-channel port, with edit (if not
// nil) applied to the worker's registration.
func newSideWith(t *testing.T, eng nixl.Engine, kvRole, id string, port int, clock Clock, fill byte, extra map[string]any, edit func(*WorkerInit)) *side {
	t.Helper()
	s, err := NewScheduler(testConfig(t, RoleScheduler, kvRole, id, port, extra), clock)
	if err != nil {
		t.Fatal(err)
	}
	w, err := NewWorker(testConfig(t, RoleWorker, kvRole, id, port, extra), clock)
	if err != nil {
		t.Fatal(err)
	}
	km := newKVMem(t, fill)
	init := initFor(km)
	if edit != nil {
		edit(init)
	}
	registerAndServe(t, s, w, eng, 0, init)
	return &side{sched: s, work: w, kv: km, port: port}
}

// registerAndServe registers the worker's KV caches (on eng), serves its
// handshake payload as stage pp through the scheduler's listener, and
// closes both at the end of the test.
func registerAndServe(t *testing.T, s *Scheduler, w *Worker, eng nixl.Engine, pp int, init *WorkerInit) {
	t.Helper()
	t.Cleanup(func() { _ = w.Close(); _ = s.Close() })
	w.engineOverride = eng
	if err := w.RegisterKVCaches(init); err != nil {
		t.Fatal(err)
	}
	payload, err := w.HandshakePayload()
	if err != nil {
		t.Fatal(err)
	}
	if err := s.SetHandshakePayload(pp, 0, payload); err != nil {
		t.Fatal(err)
	}
}

// step runs one engine step: scheduler metadata into the worker.
func (sd *side) step(t *testing.T) {
	t.Helper()
	b, err := sd.sched.BuildMeta()
	if err != nil {
		t.Fatal(err)
	}
	if err := sd.work.StartLoadKV(b); err != nil {
		t.Fatal(err)
	}
}

func (sd *side) finished(t *testing.T) Finished {
	t.Helper()
	// Through the binary form the C ABI returns.
	b, err := sd.work.GetFinished()
	if err != nil {
		t.Fatal(err)
	}
	f, err := kvwire.DecodeFinished(b)
	if err != nil {
		t.Fatal(err)
	}
	return *f
}

// waitFinished polls until pred holds, collecting results; bounded.
func (sd *side) waitFinished(t *testing.T, what string, pred func(Finished) bool) Finished {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	var all Finished
	for time.Now().Before(deadline) {
		f := sd.finished(t)
		all.Sending = append(all.Sending, f.Sending...)
		all.Recving = append(all.Recving, f.Recving...)
		all.Failed = append(all.Failed, f.Failed...)
		all.DigestsPending = all.DigestsPending || f.DigestsPending
		all.PushArrivalsPending = all.PushArrivalsPending || f.PushArrivalsPending
		for id, r := range f.Reshape {
			if all.Reshape == nil {
				all.Reshape = map[string][]BlockReshape{}
			}
			all.Reshape[id] = r
		}
		if pred(all) {
			return all
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatalf("timed out waiting for %s; got %+v", what, all)
	return all
}

func contains(xs []string, x string) bool {
	for _, v := range xs {
		if v == x {
			return true
		}
	}
	return false
}

func mustParams(t *testing.T, js string) *TransferParams {
	t.Helper()
	p, err := ParseTransferParams([]byte(js))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// prefill runs a request through the prefill scheduler and worker up to
// request_finished and returns the kv_transfer_params it emits.
func prefill(t *testing.T, p *side, reqID string, blocks []int64, numTokens int64) []byte {
	t.Helper()
	in := mustParams(t, `{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}`)
	if n, async := p.sched.GetNumNewMatchedTokens(in, numTokens, 0); n != 0 || async {
		t.Fatalf("prefill matched %d tokens async=%v, want 0", n, async)
	}
	if _, err := p.sched.UpdateStateAfterAlloc(reqID, in, nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	p.step(t)
	delay, out, err := p.sched.RequestFinished(reqID, in, true, numTokens, BlockIDs{blocks})
	if err != nil || !delay || out == nil {
		t.Fatalf("request_finished: delay=%v out=%s err=%v", delay, out, err)
	}
	p.step(t)
	return out
}

func TestRequestFinishedParamsKeys(t *testing.T) {
	clock := NewFakeClock(1000)
	p := newSide(t, nixltest.NewEngine("t"), "kv_producer", "engine-p", clock.Now, 1, nil)
	out := prefill(t, p, "req-1", []int64{3, 4, 5}, 12)
	var got map[string]any
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatal(err)
	}
	want := []string{"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
		"remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode",
		"gonixl_instance"}
	if len(got) != len(want) {
		t.Errorf("got %d keys %v, want %d", len(got), got, len(want))
	}
	for _, k := range want {
		if _, ok := got[k]; !ok {
			t.Errorf("missing key %s in %s", k, out)
		}
	}
	if got["do_remote_prefill"] != true || got["do_remote_decode"] != false || got["remote_engine_id"] != "engine-p" ||
		got["remote_request_id"] != "req-1" || got["remote_port"] != float64(p.port) || got["remote_num_tokens"] != float64(12) ||
		got["remote_blocks_expiry_time"] != float64(1030) || got["transfer_mode"] != "pull" {
		t.Errorf("unexpected params %s", out)
	}
	if !bytes.Contains(out, []byte(`"remote_block_ids":[[3,4,5]]`)) {
		t.Errorf("remote_block_ids not per group: %s", out)
	}
}

func TestPrefillToDecodeTransfer(t *testing.T) {
	eng := nixltest.NewEngine("t")
	eng.SetScript(nixltest.Script{Polls: 2})
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)

	out := prefill(t, p, "req-p", []int64{3, 4, 5}, 12)
	dp := mustParams(t, string(out))
	d.sched.OnNewRequest("req-d", dp)
	n, async := d.sched.GetNumNewMatchedTokens(dp, 12, 0)
	if n != 12 || !async {
		t.Fatalf("decode matched %d async=%v, want 12 true", n, async)
	}
	mut, err := d.sched.UpdateStateAfterAlloc("req-d", dp, BlockIDs{{7, 8, 9}}, []int64{0}, n)
	if err != nil || !mut {
		t.Fatalf("update_state_after_alloc: mutated=%v err=%v", mut, err)
	}
	d.step(t)
	f := d.waitFinished(t, "decode recv", func(f Finished) bool { return contains(f.Recving, "req-d") })
	if len(f.Failed) != 0 {
		t.Fatalf("failed: %v", f.Failed)
	}
	for l := 0; l < tLayers; l++ {
		for kv := 0; kv < 2; kv++ {
			for i, pb := range []int{3, 4, 5} {
				if !bytes.Equal(d.kv.block(l, kv, 7+i), p.kv.block(l, kv, pb)) {
					t.Fatalf("layer %d kv %d: decode block %d != prefill block %d", l, kv, 7+i, pb)
				}
			}
			if bytes.Equal(d.kv.block(l, kv, 6), p.kv.block(l, kv, 2)) {
				t.Fatalf("block outside the request was overwritten")
			}
		}
	}
	p.waitFinished(t, "prefill send", func(f Finished) bool { return contains(f.Sending, "req-p") })
	var st map[string][]float64
	if err := json.Unmarshal(d.work.Stats(), &st); err != nil {
		t.Fatal(err)
	}
	if len(st["transfer_duration"]) != 1 || st["bytes_transferred"][0] != float64(3*2*tLayers*tBlockLen) {
		t.Errorf("stats %v", st)
	}
	if d.work.Stats() != nil {
		t.Error("stats not reset after retrieval")
	}
	d.sched.UpdateConnectorOutput([]string{"req-d"})
	if len(d.sched.hbByEngine) != 0 {
		t.Error("heartbeat tracking not stopped after the KV arrived")
	}
}

func TestPrefixHitReadsTailAndNotifyOnly(t *testing.T) {
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)

	// Partial local hit: 1 local block for 3 remote -> read only the last.
	out := prefill(t, p, "req-a", []int64{3, 4, 5}, 12)
	dp := mustParams(t, string(out))
	if _, err := d.sched.UpdateStateAfterAlloc("req-a", dp, BlockIDs{{9}}, []int64{2}, 4); err != nil {
		t.Fatal(err)
	}
	d.step(t)
	d.waitFinished(t, "tail read", func(f Finished) bool { return contains(f.Recving, "req-a") })
	if !bytes.Equal(d.kv.block(0, 1, 9), p.kv.block(0, 1, 5)) {
		t.Fatal("tail block not read")
	}
	// Full local hit: no external tokens -> notify only, prefill frees now.
	out = prefill(t, p, "req-b", []int64{6}, 4)
	dp = mustParams(t, string(out))
	before := eng.Agents()
	makes := 0
	for _, a := range before {
		makes += a.CountCalls("MakeXfer")
	}
	if _, err := d.sched.UpdateStateAfterAlloc("req-b", dp, nil, []int64{1}, 0); err != nil {
		t.Fatal(err)
	}
	d.step(t)
	p.waitFinished(t, "notify-only frees prefill", func(f Finished) bool { return contains(f.Sending, "req-b") })
	after := 0
	for _, a := range eng.Agents() {
		after += a.CountCalls("MakeXfer")
	}
	if after != makes {
		t.Errorf("a full prefix hit posted a transfer")
	}
	if f := d.finished(t); contains(f.Recving, "req-b") {
		t.Error("notify-only request reported as received")
	}
}

func TestAbortBeforeScheduleSendsNotify(t *testing.T) {
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	out := prefill(t, p, "req-x", []int64{1, 2}, 8)
	dp := mustParams(t, string(out))
	d.sched.OnNewRequest("req-dx", dp)
	// Aborted while still waiting: request_finished with do_remote_prefill.
	delay, params, err := d.sched.RequestFinished("req-dx", dp, false, 0, BlockIDs{{}})
	if delay || params != nil || err != nil {
		t.Fatalf("abort: %v %s %v", delay, params, err)
	}
	d.step(t)
	p.waitFinished(t, "abort notify", func(f Finished) bool { return contains(f.Sending, "req-x") })
}

func TestTransferFailureReportsInvalidBlocks(t *testing.T) {
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	out := prefill(t, p, "req-f", []int64{3, 4}, 8)
	dp := mustParams(t, string(out))
	eng.Agent(d.work.agent.Name()).SetScript(nixltest.Script{FailStep: nixltest.StepCheck, FailStatus: nixl.ErrRemoteDiscon})
	if _, err := d.sched.UpdateStateAfterAlloc("req-f", dp, BlockIDs{{10, 11}}, []int64{0}, 8); err != nil {
		t.Fatal(err)
	}
	d.step(t)
	f := d.waitFinished(t, "failed recv", func(f Finished) bool { return contains(f.Recving, "req-f") })
	if !contains(f.Failed, "req-f") {
		t.Fatalf("failure not reported: %+v", f)
	}
	if got := d.work.LoadErrors(); len(got) != 2 || got[0] != 10 || got[1] != 11 {
		t.Fatalf("load errors %v, want [10 11]", got)
	}
	if got := d.work.LoadErrors(); len(got) != 0 {
		t.Fatalf("load errors not cleared: %v", got)
	}
	var st map[string][]float64
	_ = json.Unmarshal(d.work.Stats(), &st)
	if len(st["num_failed_transfers"]) != 1 {
		t.Errorf("stats %v", st)
	}
	// The dead peer was dropped: the next request re-handshakes.
	if _, ok := d.work.remotes["engine-p"]; ok {
		t.Error("remote engine kept after ERR_REMOTE_DISCONNECT")
	}
}

func TestOutOfRangeBlocksNeverPosted(t *testing.T) {
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	for name, tc := range map[string]struct {
		remote string
		local  []int64
	}{
		"remote beyond peer":     {`[[3, 99999]]`, []int64{1, 2}},
		"local beyond ours":      {`[[3, 4]]`, []int64{1, tNumBlocks}},
		"more local than remote": {`[[3]]`, []int64{1, 2}},
	} {
		t.Run(name, func(t *testing.T) {
			js := fmt.Sprintf(`{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": %s,
				"remote_engine_id": "engine-p", "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": %d, "tp_size": 1}`, tc.remote, p.port)
			dp := mustParams(t, js)
			makes := 0
			for _, a := range eng.Agents() {
				makes += a.CountCalls("MakeXfer")
			}
			id := "bad-" + strings.ReplaceAll(name, " ", "-")
			if _, err := d.sched.UpdateStateAfterAlloc(id, dp, BlockIDs{tc.local}, []int64{0}, 8); err != nil {
				t.Fatal(err)
			}
			d.step(t)
			f := d.waitFinished(t, "rejection", func(f Finished) bool { return contains(f.Recving, id) })
			if !contains(f.Failed, id) {
				t.Fatalf("not failed: %+v", f)
			}
			after := 0
			for _, a := range eng.Agents() {
				after += a.CountCalls("MakeXfer")
			}
			if after != makes {
				t.Fatal("a transfer was built for out-of-range blocks")
			}
		})
	}
}

func TestUnreachableSideChannelFailsRequest(t *testing.T) {
	eng := nixltest.NewEngine("t")
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, map[string]any{"handshake_timeout": 1})
	dead := freePort(t)
	dp := mustParams(t, fmt.Sprintf(`{"do_remote_prefill": true, "remote_block_ids": [[1]], "remote_engine_id": "gone",
		"remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": %d, "tp_size": 1}`, dead))
	if _, err := d.sched.UpdateStateAfterAlloc("req-u", dp, BlockIDs{{1}}, []int64{0}, 4); err != nil {
		t.Fatal(err)
	}
	d.step(t)
	f := d.waitFinished(t, "handshake failure", func(f Finished) bool { return contains(f.Recving, "req-u") })
	if !contains(f.Failed, "req-u") {
		t.Fatalf("not failed: %+v", f)
	}
	var st map[string][]float64
	_ = json.Unmarshal(d.work.Stats(), &st)
	if len(st["num_failed_handshakes"]) != 1 {
		t.Errorf("stats %v", st)
	}
}

func TestLeaseExpiryHeartbeatAndFullSweep(t *testing.T) {
	clock := NewFakeClock(500)
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, map[string]any{"kv_lease_duration": 30})
	prefill(t, p, "req-1", []int64{1}, 4)
	clock.Advance(10)
	prefill(t, p, "req-2", []int64{2}, 4) // expires 10 s later than req-1
	agent := eng.Agent(p.work.agent.Name())

	clock.Advance(19) // req-1 at 29 s of 30
	if f := p.finished(t); len(f.Sending) != 0 {
		t.Fatalf("released early: %+v", f)
	}
	// A heartbeat extends req-1 to now + 20 s.
	agent.Inject("decoder", []byte("HB:req-1,unknown"))
	clock.Advance(5) // req-1's original lease has passed
	if f := p.finished(t); len(f.Sending) != 0 {
		t.Fatalf("heartbeat did not extend the lease: %+v", f)
	}
	// The heartbeat was handled at t=534 (the poll after Inject): req-1 now
	// expires at 554, req-2 at 540.
	clock.Advance(21)
	f := p.finished(t)
	if !contains(f.Sending, "req-1") || !contains(f.Sending, "req-2") {
		t.Fatalf("full sweep freed %v, want both", f.Sending)
	}
	// A read that completes after expiry is counted, not trusted.
	agent.Inject("decoder", []byte("req-1:1"))
	if f := p.finished(t); len(f.Sending) != 0 {
		t.Fatalf("late notification freed again: %+v", f)
	}
	var st map[string][]float64
	_ = json.Unmarshal(p.work.Stats(), &st)
	if len(st["num_kv_expired_reqs"]) != 2 || len(st["num_notifications_after_expiry"]) != 1 {
		t.Errorf("stats %v", st)
	}
	text, err := p.work.MetricsText()
	if err != nil || !bytes.Contains(text, []byte(`vllm:nixl_num_kv_expired_reqs{engine_id="engine-p"} 2`)) {
		t.Errorf("prometheus text lacks the expiry counter (err %v):\n%s", err, text)
	}
}

func TestNotificationBeforeLeaseMetadata(t *testing.T) {
	// Async scheduling: the decode's completion can arrive after
	// reqs_in_batch but before the step that carries the lease.
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	in := mustParams(t, `{"do_remote_decode": true}`)
	if _, err := p.sched.UpdateStateAfterAlloc("req-early", in, nil, nil, 0); err != nil {
		t.Fatal(err)
	}
	p.step(t)
	eng.Agent(p.work.agent.Name()).Inject("decoder", []byte("req-early:1"))
	f := p.finished(t)
	if !contains(f.Sending, "req-early") {
		t.Fatalf("early notification lost: %+v", f)
	}
	if _, _, err := p.sched.RequestFinished("req-early", in, true, 4, BlockIDs{{1}}); err != nil {
		t.Fatal(err)
	}
}

func TestHeartbeatSchedule(t *testing.T) {
	clock := NewFakeClock(100)
	s, err := NewScheduler(testConfig(t, RoleScheduler, "kv_consumer", "d", 1, map[string]any{"kv_lease_duration": 30}), clock.Now)
	if err != nil {
		t.Fatal(err)
	}
	dp := mustParams(t, `{"do_remote_prefill": true, "remote_block_ids": [[1]], "remote_engine_id": "p",
		"remote_request_id": "rp", "remote_host": "h", "remote_port": 7, "tp_size": 1}`)
	s.OnNewRequest("rd", dp)
	hb := func() map[string]*HeartbeatInfo {
		b, err := s.BuildMeta()
		if err != nil {
			t.Fatal(err)
		}
		m, err := DecodeStepMeta(b)
		if err != nil {
			t.Fatal(err)
		}
		return m.Heartbeats
	}
	if h := hb(); h["p"] == nil || h["p"].ReqIDs[0] != "rp" || h["p"].Port != 7 {
		t.Fatalf("first step heartbeats %v", h)
	}
	clock.Advance(4.9)
	if h := hb(); h != nil {
		t.Fatalf("heartbeat before the interval (lease/6 = 5 s): %v", h)
	}
	clock.Advance(0.2)
	if h := hb(); h == nil {
		t.Fatal("no heartbeat after 5 s")
	}
	s.UpdateConnectorOutput([]string{"rd"})
	clock.Advance(10)
	if h := hb(); h != nil {
		t.Fatalf("heartbeat after the KV arrived: %v", h)
	}
}

func TestAbortedPrefillNotProcessed(t *testing.T) {
	s, err := NewScheduler(testConfig(t, RoleScheduler, "kv_producer", "p", 1, nil), nil)
	if err != nil {
		t.Fatal(err)
	}
	in := mustParams(t, `{"do_remote_decode": true}`)
	delay, out, err := s.RequestFinished("r", in, false, 4, BlockIDs{{1}})
	if delay || out != nil || err != nil {
		t.Fatalf("aborted prefill: %v %s %v", delay, out, err)
	}
	b, _ := s.BuildMeta()
	m, _ := DecodeStepMeta(b)
	if len(m.ReqsNotProcessed) != 1 || m.ReqsNotProcessed[0] != "r" || len(m.ReqsToSend) != 0 {
		t.Fatalf("meta %+v", m)
	}
}

func TestStepMetaGarbage(t *testing.T) {
	for _, b := range [][]byte{nil, {0xc1}, []byte("not msgpack"), {0x81, 0xa1, 'v', 0x63}} {
		if _, err := DecodeStepMeta(b); err == nil {
			t.Errorf("DecodeStepMeta(%x) accepted garbage", b)
		}
	}
}

// decodeLoad sends a prefill's params to the decode and runs one step.
func decodeLoad(t *testing.T, d *side, reqID string, out []byte, local []int64) {
	t.Helper()
	dp := mustParams(t, string(out))
	d.sched.OnNewRequest(reqID, dp)
	if _, err := d.sched.UpdateStateAfterAlloc(reqID, dp, BlockIDs{local}, []int64{0}, int64(len(local))*tBlockSize); err != nil {
		t.Fatal(err)
	}
	d.step(t)
}

func makeCalls(eng *nixltest.Engine) int {
	n := 0
	for _, a := range eng.Agents() {
		n += a.CountCalls("MakeXfer")
	}
	return n
}

func TestDecodeRefusesLapsedLease(t *testing.T) {
	clock := NewFakeClock(100)
	eng := nixltest.NewEngine("t")
	extra := map[string]any{"kv_lease_duration": 30}
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, extra)
	d := newSide(t, eng, "kv_consumer", "engine-d", clock.Now, 200, extra)
	out := prefill(t, p, "req-late", []int64{3}, 8)
	clock.Advance(27) // 3 s of lease left: below the 5 s safety margin
	before := makeCalls(eng)
	decodeLoad(t, d, "req-dl", out, []int64{9})
	f := d.waitFinished(t, "refusal", func(f Finished) bool { return contains(f.Recving, "req-dl") })
	if !contains(f.Failed, "req-dl") {
		t.Fatalf("lapsed lease not refused: %+v", f)
	}
	if makeCalls(eng) != before {
		t.Fatal("a READ was built against a lapsed lease")
	}
	var st map[string][]float64
	_ = json.Unmarshal(d.work.Stats(), &st)
	if len(st["num_kv_expired_reqs"]) != 1 {
		t.Errorf("stats %v", st)
	}
}

// stuckRead starts a prefill and a decode on a fake clock (lease seconds,
// transfer_timeout 1000 s), prefills preq, loads it as dreq and returns once
// the decode's READ is posted (after the background handshake). The READ
// stays in flight until the test sets the decode agent's script to Polls: 0.
func stuckRead(t *testing.T, lease float64, preq, dreq string) (*FakeClock, *nixltest.Engine, *side, *side) {
	t.Helper()
	clock := NewFakeClock(100)
	eng := nixltest.NewEngine("t")
	eng.SetScript(nixltest.Script{Polls: 1000000})
	extra := map[string]any{"kv_lease_duration": lease, "transfer_timeout": 1000}
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, extra)
	d := newSide(t, eng, "kv_consumer", "engine-d", clock.Now, 200, extra)
	out := prefill(t, p, preq, []int64{3}, 8)
	decodeLoad(t, d, dreq, out, []int64{9})
	deadline := time.Now().Add(10 * time.Second)
	for makeCalls(eng) == 0 && time.Now().Before(deadline) {
		time.Sleep(2 * time.Millisecond)
	}
	return clock, eng, p, d
}

func TestDecodeFailsReadCompletingAfterLease(t *testing.T) {
	clock, eng, _, d := stuckRead(t, 30, "req-slow", "req-ds") // in flight until we let it finish
	clock.Advance(31)                                          // the prefill's lease lapses while the READ is in flight
	eng.Agent(d.work.agent.Name()).SetScript(nixltest.Script{Polls: 0})
	f := d.waitFinished(t, "late completion", func(f Finished) bool { return contains(f.Recving, "req-ds") })
	if !contains(f.Failed, "req-ds") {
		t.Fatalf("a READ that completed after the lease was trusted: %+v", f)
	}
	if got := d.work.LoadErrors(); len(got) != 1 || got[0] != 9 {
		t.Fatalf("load errors %v", got)
	}
}

func TestHeartbeatsKeepLeaseForDecode(t *testing.T) {
	clock, eng, p, d := stuckRead(t, 30, "req-hb", "req-dh")
	// Heartbeats every 5 s keep both sides' view of the lease alive well
	// past the original 30 s.
	for i := 0; i < 8; i++ {
		clock.Advance(5)
		d.step(t)
		p.finished(t)
	}
	eng.Agent(d.work.agent.Name()).SetScript(nixltest.Script{Polls: 0})
	f := d.waitFinished(t, "completion", func(f Finished) bool { return contains(f.Recving, "req-dh") })
	if contains(f.Failed, "req-dh") {
		t.Fatalf("heartbeat-extended lease treated as lapsed: %+v", f)
	}
	p.waitFinished(t, "prefill release", func(f Finished) bool { return contains(f.Sending, "req-hb") })
}

func TestBlockIDsJSONNeverNull(t *testing.T) {
	b, err := json.Marshal(BlockIDs{nil, {1, 2}})
	if err != nil || string(b) != `[[],[1,2]]` {
		t.Fatalf("%s %v", b, err)
	}
	if b, _ := json.Marshal(BlockIDs(nil)); string(b) != `[]` {
		t.Fatalf("nil: %s", b)
	}
}

func TestHeartbeatAfterExpiryDoesNotReviveLease(t *testing.T) {
	clock := NewFakeClock(100)
	eng := nixltest.NewEngine("t")
	extra := map[string]any{"kv_lease_duration": 30}
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, extra)
	d := newSide(t, eng, "kv_consumer", "engine-d", clock.Now, 200, extra)
	out := prefill(t, p, "req-gone", []int64{3}, 8)
	clock.Advance(31)
	p.waitFinished(t, "prefill lease expiry", func(f Finished) bool { return contains(f.Sending, "req-gone") })
	dp := mustParams(t, string(out))
	d.sched.OnNewRequest("req-dg", dp)
	// Heartbeats sent after the lease ended (the first one handshakes).
	deadline := time.Now().Add(10 * time.Second)
	for numRemotes(d.work) == 0 && time.Now().Before(deadline) {
		d.step(t)
		time.Sleep(2 * time.Millisecond)
	}
	for i := 0; i < 3; i++ {
		clock.Advance(5)
		d.step(t)
	}
	before := makeCalls(eng)
	if _, err := d.sched.UpdateStateAfterAlloc("req-dg", dp, BlockIDs{{9}}, []int64{0}, 8); err != nil {
		t.Fatal(err)
	}
	d.step(t)
	f := d.waitFinished(t, "refusal", func(f Finished) bool { return contains(f.Recving, "req-dg") })
	if !contains(f.Failed, "req-dg") || makeCalls(eng) != before {
		t.Fatalf("a heartbeat revived an ended lease: %+v", f)
	}
}

// The worker creates its agent with a progress thread that sleeps between
// events (progress_thread_delay_us, default 1 ms), not NIXL-Python's busy one.
func TestWorkerAgentProgressDelay(t *testing.T) {
	for _, tc := range []struct {
		extra map[string]any
		want  time.Duration
	}{
		{nil, time.Millisecond},
		{map[string]any{"progress_thread_delay_us": 250}, 250 * time.Microsecond},
		{map[string]any{"progress_thread_delay_us": 0}, 0},
	} {
		eng := nixltest.NewEngine("t")
		newSide(t, eng, "kv_producer", "engine-p", nil, 1, tc.extra)
		ags := eng.Agents()
		if len(ags) != 1 {
			t.Fatalf("%v: %d agents", tc.extra, len(ags))
		}
		if cfg := ags[0].Config(); !cfg.ProgressThread || cfg.ProgressDelay != tc.want {
			t.Errorf("%v: agent config progress thread %v delay %v, want true %v", tc.extra, cfg.ProgressThread, cfg.ProgressDelay, tc.want)
		}
	}
}

// A READ in flight for slowReadAfter seconds is logged once, and again
// when it completes, so that a stall is visible before transfer_timeout.
func TestSlowReadLogged(t *testing.T) {
	clock, eng, _, d := stuckRead(t, 60, "req-slow", "req-dslow")
	core, logs := observer.New(zapcore.InfoLevel)
	d.work.mu.Lock()
	d.work.log = zap.New(core)
	d.work.mu.Unlock()
	d.finished(t)
	clock.Advance(slowReadAfter - 1)
	d.finished(t)
	if n := logs.FilterMessage("READ still in flight").Len(); n != 0 {
		t.Fatalf("logged after %gs in flight", slowReadAfter-1)
	}
	clock.Advance(2)
	d.finished(t)
	d.finished(t)
	if n := logs.FilterMessage("READ still in flight").Len(); n != 1 {
		t.Fatalf("%d 'still in flight' lines after %gs, want 1", n, slowReadAfter+1)
	}
	eng.Agent(d.work.agent.Name()).SetScript(nixltest.Script{Polls: 0})
	f := d.waitFinished(t, "completion", func(f Finished) bool { return contains(f.Recving, "req-dslow") })
	if contains(f.Failed, "req-dslow") {
		t.Fatalf("slow READ failed: %+v", f)
	}
	done := logs.FilterMessage("slow READ completed").All()
	if len(done) != 1 || done[0].ContextMap()["request_id"] != "req-dslow" {
		t.Fatalf("completion lines %v", done)
	}
}

// numRemotes reads the worker's remote table under its lock (the handshake
// goroutine writes it).
func numRemotes(w *Worker) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.remotes)
}

// A decode request whose remote_port is null or 0 names no reachable side
// channel: it is computed locally (no remote tokens matched), never dialled
// as port 0. vLLM checks only that the key is present.
func TestRemotePortNullOrZeroComputedLocally(t *testing.T) {
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	out := prefill(t, p, "req-p", []int64{3, 4, 5}, 12)
	var m map[string]any
	if err := json.Unmarshal(out, &m); err != nil {
		t.Fatal(err)
	}
	for _, port := range []any{nil, 0} {
		m["remote_port"] = port
		b, _ := json.Marshal(m)
		dp := mustParams(t, string(b))
		if n, async := d.sched.GetNumNewMatchedTokens(dp, 12, 0); n != 0 || async {
			t.Fatalf("remote_port %v: matched %d async=%v, want 0 false", port, n, async)
		}
	}
}

// A bidirectional turn pulls min(decode's tokens, prompt), capped by the
// prefix the decode's token digest vouches for (gonixl_readback_tokens), and
// nothing below kv_recompute_threshold; with a sliding-window group a pull
// that would end before the decode's last token is not made at all.
func TestReadbackPullsOnlyTheMatchedPrefix(t *testing.T) {
	extra := map[string]any{"bidirectional_kv_xfer": true}
	s, err := NewScheduler(fzConfig(t, RoleScheduler, "kv_producer", extra, nil), nil)
	if err != nil {
		t.Fatal(err)
	}
	params := func(more string) *TransferParams {
		return mustParams(t, `{"do_remote_decode":true,"do_remote_prefill":false,"remote_block_ids":[[1,2,3,4,5,6,7,8,9,10]],`+
			`"remote_engine_id":"d","remote_request_id":"r","remote_host":"127.0.0.1","remote_port":5601,"remote_num_tokens":300`+more+`}`)
	}
	for _, c := range []struct {
		name             string
		more             string
		prompt, computed int64
		want             int64
	}{
		{"whole history", "", 400, 0, 300},
		{"shorter prompt", "", 200, 0, 200},
		{"local prefix hit", "", 400, 128, 172},
		{"edited after 256", `,"gonixl_readback_tokens":256`, 400, 0, 256},
		{"edited at the start", `,"gonixl_readback_tokens":0`, 400, 0, 0},
		{"match below the threshold", `,"gonixl_readback_tokens":32`, 400, 0, 0},
		{"digest covers all", `,"gonixl_readback_tokens":300`, 400, 0, 300},
	} {
		n, async := s.GetNumNewMatchedTokens(params(c.more), c.prompt, c.computed)
		if n != c.want || async != (c.want > 0) {
			t.Errorf("%s: matched %d (async %v), want %d", c.name, n, async, c.want)
		}
	}
	if _, err := ParseTransferParams([]byte(`{"do_remote_decode":true,"gonixl_readback_tokens":-1}`)); err == nil {
		t.Error("a negative gonixl_readback_tokens was accepted")
	}
	// The decode's TTL (gonixl_expiry_unix, wall clock): blocks that are
	// gone, or would be before a READ may be trusted (5 s), are not pulled.
	s.wall = func() float64 { return 1_000_000 }
	for _, c := range []struct {
		expiry float64
		want   int64
	}{{999_990, 0}, {1_000_004, 0}, {1_000_006, 300}} {
		if n, _ := s.GetNumNewMatchedTokens(params(fmt.Sprintf(`,"gonixl_expiry_unix":%v`, c.expiry)), 400, 0); n != c.want {
			t.Errorf("decode blocks expiring at %v (now 1000000): matched %d, want %d", c.expiry, n, c.want)
		}
	}

	more := map[string]any{"transfer_groups": []map[string]any{
		{"kind": "full", "block_size": tBlockSize}, {"kind": "sliding_window", "sliding_window": 64, "block_size": tBlockSize}}}
	sw, err := NewScheduler(fzConfig(t, RoleScheduler, "kv_producer", extra, more), nil)
	if err != nil {
		t.Fatal(err)
	}
	if n, _ := sw.GetNumNewMatchedTokens(params(`,"gonixl_readback_tokens":256`), 400, 0); n != 0 {
		t.Errorf("sliding-window model: a pull ending before the decode's last token matched %d tokens", n)
	}
	if n, _ := sw.GetNumNewMatchedTokens(params(""), 400, 0); n != 300 {
		t.Errorf("sliding-window model, whole history: matched %d, want 300", n)
	}
}

// A poll from vLLM's model thread does not wait for the engine's own
// thread (nixl.TryChecker, nixl.TryNotifier): while the engine is busy a
// READ counts as in flight, notifications stay undrained and no lease is
// swept (a heartbeat may be among them); the first poll after sees both.
func TestBusyEngineDefersChecksAndNotifications(t *testing.T) {
	clock := NewFakeClock(100)
	eng := nixltest.NewEngine("t")
	// No KV digests: a READ seen complete is reported by the same poll.
	extra := map[string]any{"kv_lease_duration": 30, "transfer_timeout": 1000, "kv_digest": "off"}
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, extra)
	d := newSide(t, eng, "kv_consumer", "engine-d", clock.Now, 200, extra)
	out := prefill(t, p, "req-p", []int64{3, 4, 5}, 12)
	release := eng.Hold()
	defer release()
	decodeLoad(t, d, "req-d", out, []int64{7, 8, 9})
	for end := time.Now().Add(200 * time.Millisecond); time.Now().Before(end); time.Sleep(2 * time.Millisecond) {
		if f := d.finished(t); contains(f.Recving, "req-d") || contains(f.Failed, "req-d") {
			t.Fatalf("a READ was checked while the engine was busy: %+v", f)
		}
	}
	release()
	d.waitFinished(t, "the READ after the engine's busy spell", func(f Finished) bool { return contains(f.Recving, "req-d") })
	// The decode's notification is in the prefill's inbox now; the lease
	// lapses while the engine is busy.
	release = eng.Hold()
	clock.Advance(31)
	for i := 0; i < 20; i++ {
		if f := p.finished(t); contains(f.Sending, "req-p") {
			t.Fatalf("notifications drained or a lease swept while the engine was busy (poll %d): %+v", i, f)
		}
	}
	release()
	if f := p.waitFinished(t, "the notification after the busy spell", func(f Finished) bool { return contains(f.Sending, "req-p") }); len(f.Sending) != 1 {
		t.Fatalf("sending %v, want req-p once", f.Sending)
	}
}
