package shim

import (
	"bytes"
	"encoding/json"
	"net"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/gonixl/gonixl/nixl/nixltest"
)

// remoteOf reads the worker's remote table entry under its lock.
func remoteOf(w *Worker, id string) *remoteEngine {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.remotes[id]
}

// observeInfo replaces the worker's logger with an observer at info level.
func observeInfo(w *Worker) *observer.ObservedLogs {
	core, logs := observer.New(zapcore.InfoLevel)
	w.mu.Lock()
	w.log = zap.New(core)
	w.mu.Unlock()
	return logs
}

// loadAt loads a prefill's kv_transfer_params on the decode without
// heartbeat tracking (no OnNewRequest: a heartbeat would also count as a
// use of the engine), optionally at another side-channel port, and runs one
// step.
func loadAt(t *testing.T, d *side, reqID string, out []byte, local []int64, port int) {
	t.Helper()
	if port != 0 {
		var params map[string]any
		if err := json.Unmarshal(out, &params); err != nil {
			t.Fatal(err)
		}
		params["remote_port"] = port
		out, _ = json.Marshal(params)
	}
	dp := mustParams(t, string(out))
	if _, err := d.sched.UpdateStateAfterAlloc(reqID, dp, BlockIDs{local}, []int64{0}, int64(len(local))*tBlockSize); err != nil {
		t.Fatal(err)
	}
	d.step(t)
}

// readOnce prefills pblocks on p, reads them into dblocks on d and checks
// the bytes.
func readOnce(t *testing.T, p, d *side, preq, dreq string, pblocks, dblocks []int64) {
	t.Helper()
	out := prefill(t, p, preq, pblocks, int64(len(pblocks))*tBlockSize)
	loadAt(t, d, dreq, out, dblocks, 0)
	f := d.waitFinished(t, "read "+dreq, func(f Finished) bool { return contains(f.Recving, dreq) })
	if len(f.Failed) != 0 {
		t.Fatalf("%s failed: %+v", dreq, f)
	}
	for l := 0; l < tLayers; l++ {
		for kv := 0; kv < 2; kv++ {
			for i := range pblocks {
				if !bytes.Equal(d.kv.block(l, kv, int(dblocks[i])), p.kv.block(l, kv, int(pblocks[i]))) {
					t.Fatalf("%s: layer %d kv %d: decode block %d != prefill block %d", dreq, l, kv, dblocks[i], pblocks[i])
				}
			}
		}
	}
}

// An engine idle for more than engine_ttl is evicted on the next
// get_finished (its list released, its agent invalidated, an info line),
// and the next request for it handshakes again and reads correctly.
func TestEngineTTLEvictsIdleEngine(t *testing.T) {
	clock := NewFakeClock(100)
	eng := nixltest.NewEngine("t")
	extra := map[string]any{"engine_ttl": 60}
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, extra)
	d := newSide(t, eng, "kv_consumer", "engine-d", clock.Now, 200, extra)
	logs := observeInfo(d.work)
	agent := eng.Agent(d.work.agent.Name())

	readOnce(t, p, d, "p-1", "d-1", []int64{3, 4, 5}, []int64{7, 8, 9})
	first := remoteOf(d.work, "engine-p")
	if first == nil {
		t.Fatal("no remote engine after the first read")
	}
	lists, _ := agent.Live()
	clock.Advance(60) // exactly engine_ttl: vLLM evicts only past it
	d.finished(t)
	if remoteOf(d.work, "engine-p") != first {
		t.Fatal("evicted at exactly engine_ttl")
	}
	clock.Advance(1)
	d.finished(t)
	if remoteOf(d.work, "engine-p") != nil {
		t.Fatal("an engine idle for 61 s (engine_ttl 60) was not evicted")
	}
	if n := agent.CountCalls("InvalidateRemote"); n != 1 {
		t.Errorf("%d InvalidateRemote calls, want 1", n)
	}
	if now, _ := agent.Live(); now != lists-1 {
		t.Errorf("%d prepared lists after eviction, want %d (the remote one released)", now, lists-1)
	}
	ev := logs.FilterMessage("evicted idle remote engine; it will be re-handshaken on next use").All()
	if len(ev) != 1 || ev[0].Level != zapcore.InfoLevel || ev[0].ContextMap()["remote_engine_id"] != "engine-p" ||
		ev[0].ContextMap()["idle_seconds"] != float64(61) {
		t.Fatalf("eviction log lines %v", ev)
	}

	readOnce(t, p, d, "p-2", "d-2", []int64{10, 11}, []int64{1, 2})
	if n := agent.CountCalls("LoadRemoteMetadata"); n != 2 {
		t.Errorf("%d LoadRemoteMetadata calls, want 2 (a new handshake after the eviction)", n)
	}
	if re := remoteOf(d.work, "engine-p"); re == nil || re == first {
		t.Error("the engine was not handshaken anew")
	}
}

// READs, notify-only completions, heartbeats and handshakes count as uses:
// an engine used within engine_ttl stays, whatever its age.
func TestEngineTTLUsedEngineStays(t *testing.T) {
	clock := NewFakeClock(100)
	eng := nixltest.NewEngine("t")
	extra := map[string]any{"engine_ttl": 60, "kv_lease_duration": 30}
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, extra)
	d := newSide(t, eng, "kv_consumer", "engine-d", clock.Now, 200, extra)
	present := func(when string) {
		t.Helper()
		d.finished(t)
		if remoteOf(d.work, "engine-p") == nil {
			t.Fatalf("%s: evicted, but used within engine_ttl", when)
		}
	}

	t.Run("read", func(t *testing.T) {
		readOnce(t, p, d, "p-1", "d-1", []int64{3}, []int64{7}) // handshake + READ at 100
		clock.Advance(40)
		readOnce(t, p, d, "p-2", "d-2", []int64{4}, []int64{8}) // READ at 140
		clock.Advance(40)
		present("80 s after the handshake, 40 s after the last READ")
	})
	t.Run("notify-only", func(t *testing.T) {
		// A full local prefix hit only notifies the prefill (at 190).
		clock.Advance(10)
		dp := mustParams(t, string(prefill(t, p, "p-3", []int64{5}, 4)))
		if _, err := d.sched.UpdateStateAfterAlloc("d-3", dp, nil, []int64{1}, 0); err != nil {
			t.Fatal(err)
		}
		d.step(t)
		p.waitFinished(t, "notify-only frees prefill", func(f Finished) bool { return contains(f.Sending, "p-3") })
		clock.Advance(55)
		present("105 s after the last READ, 55 s after a notification")
		clock.Advance(6)
		d.finished(t)
		if remoteOf(d.work, "engine-p") != nil {
			t.Fatal("not evicted 61 s after the last use")
		}
	})
	t.Run("heartbeat and handshake", func(t *testing.T) {
		// A request waiting in the decode's queue: its heartbeats handshake
		// with the (evicted) engine, then keep it alive.
		dp := mustParams(t, string(prefill(t, p, "p-4", []int64{6}, 4)))
		d.sched.OnNewRequest("d-4", dp)
		d.step(t)
		deadline := time.Now().Add(10 * time.Second)
		for remoteOf(d.work, "engine-p") == nil && time.Now().Before(deadline) {
			time.Sleep(2 * time.Millisecond)
		}
		clock.Advance(59)
		present("59 s after a handshake")
		for i := 0; i < 5; i++ { // a heartbeat every 20 s (interval 5 s)
			clock.Advance(20)
			d.step(t)
			present("159 s after the handshake, heartbeats since")
		}
		d.sched.UpdateConnectorOutput([]string{"d-4"}) // heartbeats stop
		clock.Advance(61)
		d.step(t)
		d.finished(t)
		if remoteOf(d.work, "engine-p") != nil {
			t.Fatal("not evicted 61 s after the last heartbeat")
		}
	})
}

// An engine a READ is still in flight from is never evicted, however long
// the READ takes; once it completes (and its stamp is older than
// engine_ttl) it is.
func TestEngineTTLKeepsEngineWithReadInFlight(t *testing.T) {
	clock := NewFakeClock(100)
	eng := nixltest.NewEngine("t")
	eng.SetScript(nixltest.Script{Polls: 1000000})
	extra := map[string]any{"engine_ttl": 60, "transfer_timeout": 1000, "kv_lease_duration": 300}
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, extra)
	d := newSide(t, eng, "kv_consumer", "engine-d", clock.Now, 200, extra)
	loadAt(t, d, "d-1", prefill(t, p, "p-1", []int64{3}, 4), []int64{9}, 0)
	deadline := time.Now().Add(10 * time.Second)
	for makeCalls(eng) == 0 && time.Now().Before(deadline) {
		time.Sleep(2 * time.Millisecond)
	}
	if makeCalls(eng) == 0 {
		t.Fatal("READ not posted")
	}
	re := remoteOf(d.work, "engine-p")
	for _, adv := range []float64{61, 100} {
		clock.Advance(adv)
		if f := d.finished(t); contains(f.Recving, "d-1") {
			t.Fatalf("READ ended early: %+v", f)
		}
		if remoteOf(d.work, "engine-p") != re {
			t.Fatalf("evicted with a READ in flight")
		}
	}
	eng.Agent(d.work.agent.Name()).SetScript(nixltest.Script{Polls: 0})
	f := d.waitFinished(t, "completion", func(f Finished) bool { return contains(f.Recving, "d-1") })
	if contains(f.Failed, "d-1") {
		t.Fatalf("READ failed: %+v", f)
	}
	d.finished(t)
	if remoteOf(d.work, "engine-p") != nil {
		t.Fatal("not evicted after its READ completed (last use 161 s ago)")
	}
}

// An engine a request waits on (a handshake with it at another address is
// under way) is not evicted; when that request has failed, it is.
func TestEngineTTLKeepsEngineWithRequestWaiting(t *testing.T) {
	clock := NewFakeClock(100)
	eng := nixltest.NewEngine("t")
	extra := map[string]any{"engine_ttl": 60, "handshake_timeout": 2}
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, extra)
	d := newSide(t, eng, "kv_consumer", "engine-d", clock.Now, 200, extra)
	readOnce(t, p, d, "p-1", "d-1", []int64{3}, []int64{7})
	re := remoteOf(d.work, "engine-p")

	// A listener that never answers: the handshake there runs until
	// handshake_timeout (real time), and the request waits on it.
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = silent.Close() })
	clock.Advance(30)
	loadAt(t, d, "d-2", prefill(t, p, "p-2", []int64{4}, 4), []int64{8}, silent.Addr().(*net.TCPAddr).Port)
	clock.Advance(61)
	d.finished(t)
	if remoteOf(d.work, "engine-p") != re {
		t.Fatal("evicted while a request waits on it")
	}
	f := d.waitFinished(t, "handshake failure", func(f Finished) bool { return contains(f.Failed, "d-2") })
	if !contains(f.Recving, "d-2") {
		t.Fatalf("not reported: %+v", f)
	}
	d.finished(t)
	if remoteOf(d.work, "engine-p") != nil {
		t.Fatal("not evicted once no request waited on it")
	}
}

// engine_ttl <= 0 turns eviction off, as in vLLM.
func TestEngineTTLZeroNeverEvicts(t *testing.T) {
	for _, ttl := range []any{0, -1, "0"} {
		clock := NewFakeClock(100)
		eng := nixltest.NewEngine("t")
		extra := map[string]any{"engine_ttl": ttl}
		p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, extra)
		d := newSide(t, eng, "kv_consumer", "engine-d", clock.Now, 200, extra)
		readOnce(t, p, d, "p-1", "d-1", []int64{3}, []int64{7})
		clock.Advance(1e6)
		d.finished(t)
		if remoteOf(d.work, "engine-p") == nil {
			t.Fatalf("engine_ttl %v: evicted", ttl)
		}
	}
}

// The default engine_ttl is vLLM's 3600 s.
func TestEngineTTLDefault(t *testing.T) {
	clock := NewFakeClock(100)
	eng := nixltest.NewEngine("t")
	p := newSide(t, eng, "kv_producer", "engine-p", clock.Now, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", clock.Now, 200, nil)
	readOnce(t, p, d, "p-1", "d-1", []int64{3}, []int64{7})
	clock.Advance(3600)
	d.finished(t)
	if remoteOf(d.work, "engine-p") == nil {
		t.Fatal("evicted at 3600 s")
	}
	clock.Advance(1)
	d.finished(t)
	if remoteOf(d.work, "engine-p") != nil {
		t.Fatal("not evicted after 3601 s idle")
	}
}

// kv_buffer_device against the KV cache's placement, at register_kv_caches.
func TestKVBufferDevicePlacement(t *testing.T) {
	cpu := newKVMem(t, 1).layers
	onGPU := func(dev string) []LayerTensor {
		out := make([]LayerTensor, len(cpu))
		for i, l := range cpu {
			l.Device, l.DeviceIndex = dev, 0
			out[i] = l
		}
		return out
	}
	for _, tc := range []struct {
		setting string
		layers  []LayerTensor
		want    string // "" accepted, else a substring of the error
	}{
		{"cpu", cpu, ""},
		{"", cpu, ""},
		{"cuda", cpu, `set kv_buffer_device to "cpu"`},
		{"xpu", cpu, `set kv_buffer_device to "cpu"`},
		{"cuda", onGPU("cuda"), ""},
		{"", onGPU("cuda"), ""},
		{"xpu", onGPU("xpu"), ""},
		{"cpu", onGPU("cuda"), `host-buffer staging`},
		{"cpu", onGPU("xpu"), `set kv_buffer_device to "xpu"`},
		{"xpu", onGPU("cuda"), `set kv_buffer_device to "cuda"`},
	} {
		cfg := testConfig(t, RoleWorker, "kv_consumer", "e", freePort(t), nil)
		cfg.KVBufferDevice = tc.setting
		w, err := NewWorker(cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		eng := nixltest.NewEngine("t")
		eng.SetScript(nixltest.Script{NoCopy: true})
		w.engineOverride = eng
		err = w.RegisterKVCaches(&WorkerInit{Layers: tc.layers, NumBlocks: tNumBlocks, BlockSize: tBlockSize, AttnBackend: "CPU_ATTN", KVCacheLayout: "LBHNC"})
		_ = w.Close()
		name := tc.setting + " on " + tc.layers[0].Device
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: refused: %v", name, err)
		case tc.want != "" && err == nil:
			t.Errorf("%s: accepted", name)
		case tc.want != "" && (!strings.Contains(err.Error(), "kv_buffer_device") || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: error %q does not name kv_buffer_device and say %q", name, err, tc.want)
		case tc.want != "" && len(eng.Agents()) != 0:
			t.Errorf("%s: an agent was created before the refusal", name)
		}
	}
}

// enable_permute_local_kv is accepted (it changes nothing for the engines
// gonixl connects: same kv_cache_layout on both sides) and says so.
func TestEnablePermuteLocalKVAcceptedAndLogged(t *testing.T) {
	for _, on := range []bool{false, true} {
		cfg := testConfig(t, RoleWorker, "kv_consumer", "e", freePort(t), nil)
		cfg.EnablePermuteLocalKV = on
		w, err := NewWorker(cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		logs := observeInfo(w)
		w.engineOverride = nixltest.NewEngine("t")
		if err := w.RegisterKVCaches(initFor(newKVMem(t, 1))); err != nil {
			t.Fatalf("enable_permute_local_kv=%v: %v", on, err)
		}
		_ = w.Close()
		n := 0
		for _, e := range logs.All() {
			if strings.HasPrefix(e.Message, "enable_permute_local_kv has no effect in gonixl") && e.ContextMap()["kv_cache_layout"] == "LBHNC" {
				n++
			}
		}
		if want := map[bool]int{false: 0, true: 1}[on]; n != want {
			t.Errorf("enable_permute_local_kv=%v: %d notes, want %d", on, n, want)
		}
	}
}
