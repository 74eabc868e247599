package shim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"math/big"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/shim/kvwire"
	"github.com/gonixl/gonixl/sidechannel"
)

// Fuzz targets for what shim does with bytes from the network or from
// Python (through capi); the wire decoders themselves are fuzzed in
// shim/kvwire (step metadata, kv_transfer_params, notifications, push
// registrations):
//
//   - FuzzStartLoadKV: step metadata all the way through a worker's
//     StartLoadKV / GetFinished (block pairing, descriptor ids).
//   - FuzzNotifications: "<req>:<n>" and "HB:<ids>" notifications a remote
//     agent sends to a prefill worker (pollNotifsLocked).
//   - FuzzParseConfig: the connector configuration JSON (gonixl_*_new).
//   - FuzzWorkerInit: register_kv_caches' JSON (gonixl_worker_register_kv_caches).
//   - FuzzRemoteAgentMetadata: a remote engine's handshake metadata
//     (network) against this worker's layout (checkRemoteLayout).
//
// Seeds: f.Add below plus the files in testdata/fuzz/<FuzzName>/. Run one
// with: go test -run '^$' -fuzz '^FuzzX$' -fuzztime 10m -parallel 1 ./shim

// fzConfig builds a configuration through ParseConfig, as capi does.
func fzConfig(tb testing.TB, role Role, kvRole string, extra map[string]any, more map[string]any) *Config {
	tb.Helper()
	raw := map[string]any{
		"role": role, "kv_role": kvRole, "engine_id": "engine-" + kvRole,
		"side_channel_host": "127.0.0.1", "side_channel_port": 5600,
		"block_size": tBlockSize, "kv_connector_extra_config": extra,
		"compat_factors": map[string]any{"model": "tiny", "dtype": "torch.float32", "num_kv_heads": 2},
	}
	for k, v := range more {
		raw[k] = v
	}
	b, err := json.Marshal(raw)
	if err != nil {
		tb.Fatal(err)
	}
	c, err := ParseConfig(b)
	if err != nil {
		tb.Fatal(err)
	}
	return c
}

// fzLayers are FlashAttention-shaped layers at made-up addresses: BuildLayout
// and the fuzz stubs never touch the memory.
func fzLayers(groups []*int, kinds []string, window int64) []LayerTensor {
	per := uint64(2 * tNumBlocks * tBlockLen)
	var out []LayerTensor
	for l := range groups {
		base := uint64(0x10000000) + uint64(l)*0x1000000
		lt := LayerTensor{
			Name: fmt.Sprintf("model.layers.%d.self_attn", l), DataPtr: base, StoragePtr: base, StorageBytes: per,
			ElemSize: tElem, Shape: []int64{2, tNumBlocks, tHeads, tBlockSize, tHeadDim},
			Stride: []int64{tNumBlocks * tHeads * tBlockSize * tHeadDim, tHeads * tBlockSize * tHeadDim, tBlockSize * tHeadDim, tHeadDim, 1},
			Device: "cpu", Group: groups[l], Kind: kinds[l],
		}
		if kinds[l] == LayerKindSlidingWindow {
			lt.SlidingWindow = window
		}
		out = append(out, lt)
	}
	return out
}

func intp(i int) *int { return &i }

// fzQuiet silences the library's logger while fuzzing (millions of
// "scheduler started" lines otherwise), unless a test already set it up.
func fzQuiet() { logOnce.Do(func() { logger = zap.NewNop() }) }

// ---------------------------------------------------------------------------
// Step metadata

// fzStepMetas returns valid metadata, hand-made and from a real scheduler,
// for FuzzStartLoadKV (the decoder's own edge cases are kvwire's:
// FuzzDecodeStepMeta).
func fzStepMetas(tb testing.TB) [][]byte {
	exp := 1234.5
	full := &StepMeta{
		ReqsToRecv: map[string]*RecvReq{
			"req-d": {LocalBlockIDs: BlockIDs{{7, 8, 9}}, LocalNumComputed: []int64{0}, TPSize: 1, DCPSize: 1, PPSize: 1, AwaitingKVs: true,
				Remote: RemoteMeta{BlockIDs: BlockIDs{{3, 4, 5}}, Host: "127.0.0.1", Port: 5600, EngineID: "engine-p", RequestID: "req-p", Expiry: &exp, NumTokens: 12}},
			"notify-only": {TPSize: 1, DCPSize: 1, PPSize: 1, Remote: RemoteMeta{BlockIDs: BlockIDs{{1}}, EngineID: "engine-p", RequestID: "r2"}},
		},
		ReqsToSend:       map[string]float64{"req-p": 1030},
		SchedulerClock:   1000,
		ReqsInBatch:      []string{"req-p"},
		ReqsNotProcessed: []string{"req-x"},
		Heartbeats: map[string]*HeartbeatInfo{"engine-p": {ReqIDs: []string{"req-p"}, Expiry: map[string]float64{"req-p": 1030},
			Host: "127.0.0.1", Port: 5600, TPSize: 1, DCPSize: 1, PPSize: 1}},
	}
	var out [][]byte
	for _, m := range []*StepMeta{full, {}, {ReqsToRecv: map[string]*RecvReq{"a": {LocalBlockIDs: BlockIDs{{}, {1, 2}}, Remote: RemoteMeta{BlockIDs: BlockIDs{{0}, {5, 6}}}}}}} {
		b, err := m.Encode()
		if err != nil {
			tb.Fatal(err)
		}
		out = append(out, b)
	}
	// A scheduler's own output: a decode that loads and one that aborts.
	s, err := NewScheduler(fzConfig(tb, RoleScheduler, "kv_consumer", nil, nil), NewFakeClock(100).Now)
	if err != nil {
		tb.Fatal(err)
	}
	s.log = zap.NewNop()
	p, err := ParseTransferParams([]byte(`{"do_remote_prefill": true, "remote_block_ids": [[1,2,3]], "remote_engine_id": "p",
		"remote_request_id": "rp", "remote_host": "h", "remote_port": 7, "tp_size": 1, "remote_num_tokens": 12, "remote_blocks_expiry_time": 130.5}`))
	if err != nil {
		tb.Fatal(err)
	}
	s.OnNewRequest("rd", p)
	if _, err := s.UpdateStateAfterAlloc("rd", p, BlockIDs{{4, 5, 6}}, []int64{0}, 12); err != nil {
		tb.Fatal(err)
	}
	if _, _, err := s.RequestFinished("gone", p, false, 0, nil); err != nil {
		tb.Fatal(err)
	}
	b, err := s.BuildMeta()
	if err != nil {
		tb.Fatal(err)
	}
	out = append(out, b)
	return out
}

// ---------------------------------------------------------------------------
// A worker on stub transfer objects, for StartLoadKV and notifications.

// fzAgent is a nixl.Agent that records what the worker asks of it and checks
// the descriptor indices of every transfer.
type fzAgent struct {
	t      *testing.T
	inbox  []nixl.Notif
	sent   []string
	xfers  int
	posted [][2][]int32
}

type fzList struct {
	n     int
	agent string
}

func (l *fzList) Len() int       { return l.n }
func (l *fzList) Agent() string  { return l.agent }
func (l *fzList) Release() error { return nil }

type fzXfer struct{ a *fzAgent }

func (x *fzXfer) Post() (nixl.Status, error)  { return nixl.InProgress, nil }
func (x *fzXfer) Check() (nixl.Status, error) { return nixl.Success, nil }
func (x *fzXfer) Telemetry() (nixl.Telemetry, nixl.Status) {
	return nixl.Telemetry{Bytes: 1, DescCount: 1}, nixl.Success
}
func (x *fzXfer) Release() error { x.a.xfers--; return nil }

func (a *fzAgent) Name() string                                  { return "fz-local" }
func (a *fzAgent) Engine() string                                { return "fz" }
func (a *fzAgent) RegisterMem(nixl.MemType, []nixl.Region) error { return nil }
func (a *fzAgent) DeregisterMem(nixl.MemType, []nixl.Region) error {
	return nil
}
func (a *fzAgent) LocalMetadata() ([]byte, error)            { return []byte("fz"), nil }
func (a *fzAgent) LoadRemoteMetadata([]byte) (string, error) { return "fz-remote", nil }
func (a *fzAgent) InvalidateRemote(string) error             { return nil }
func (a *fzAgent) PrepDescList(agent string, _ nixl.MemType, d []nixl.Desc) (nixl.DescList, error) {
	return &fzList{n: len(d), agent: agent}, nil
}
func (a *fzAgent) MakeXfer(op nixl.XferOp, local nixl.DescList, li []int32, remote nixl.DescList, ri []int32, notif []byte) (nixl.Xfer, error) {
	if op != nixl.Read || len(li) == 0 || len(li) != len(ri) {
		a.t.Fatalf("MakeXfer(%v) with %d local and %d remote indices", op, len(li), len(ri))
	}
	for i := range li {
		if li[i] < 0 || int(li[i]) >= local.Len() || ri[i] < 0 || int(ri[i]) >= remote.Len() {
			a.t.Fatalf("descriptor pair %d: local %d of %d, remote %d of %d", i, li[i], local.Len(), ri[i], remote.Len())
		}
	}
	a.posted = append(a.posted, [2][]int32{slices.Clone(li), slices.Clone(ri)})
	a.sent = append(a.sent, string(notif))
	a.xfers++
	return &fzXfer{a: a}, nil
}
func (a *fzAgent) SendNotif(agent string, msg []byte) error {
	if agent != "fz-remote" {
		a.t.Fatalf("notification to unknown agent %q", agent)
	}
	a.sent = append(a.sent, string(msg))
	return nil
}
func (a *fzAgent) GetNotifs() ([]nixl.Notif, error) {
	out := a.inbox
	a.inbox = nil
	return out, nil
}
func (a *fzAgent) Close() error { return nil }

const (
	fzRemoteEngine = "engine-p"
	fzRemoteHost   = "127.0.0.1"
	fzRemotePort   = 5601
	fzRemoteBlocks = 24
)

// fzWorker is a registered worker whose agent is a stub and that already
// knows one remote engine (so no handshake, no network), on a fake clock.
func fzWorker(t *testing.T, cfg *Config, layers []LayerTensor) (*Worker, *fzAgent, *FakeClock) {
	t.Helper()
	clock := NewFakeClock(1000)
	w, err := NewWorker(cfg, clock.Now)
	if err != nil {
		t.Fatal(err)
	}
	w.log = zap.NewNop()
	layout, err := BuildLayout(layers, tNumBlocks)
	if err != nil {
		t.Fatal(err)
	}
	a := &fzAgent{t: t}
	w.agent, w.layout = a, layout
	w.localList = &fzList{n: len(layout.Regions) * tNumBlocks}
	w.remotes[fzRemoteEngine] = &remoteEngine{id: fzRemoteEngine, plan: samePlan(),
		ranks:     []*remoteRank{{agent: "fz-remote", list: &fzList{n: len(layout.Regions) * fzRemoteBlocks, agent: "fz-remote"}}},
		numBlocks: fzRemoteBlocks, regions: len(layout.Regions), host: fzRemoteHost, port: fzRemotePort, lastUsed: 1000}
	return w, a, clock
}

// fzWorkerKinds: one full-attention group, and a hybrid (full +
// sliding-window) configuration.
func fzWorkers(t *testing.T) []func() (*Worker, *fzAgent, *FakeClock) {
	return []func() (*Worker, *fzAgent, *FakeClock){
		func() (*Worker, *fzAgent, *FakeClock) {
			return fzWorker(t, fzConfig(t, RoleWorker, "kv_consumer", nil, nil), fzLayers([]*int{nil, nil}, []string{"", ""}, 0))
		},
		func() (*Worker, *fzAgent, *FakeClock) {
			cfg := fzConfig(t, RoleWorker, "kv_consumer", nil, map[string]any{"hma_required": true,
				"transfer_groups": []TransferGroup{{Kind: LayerKindFull, BlockSize: tBlockSize}, {Kind: LayerKindSlidingWindow, SlidingWindow: 8, BlockSize: tBlockSize}}})
			return fzWorker(t, cfg, fzLayers([]*int{intp(0), intp(1), intp(-1)}, []string{LayerKindFull, LayerKindSlidingWindow, ""}, 8))
		},
	}
}

func fzFinished(t *testing.T, w *Worker) Finished {
	t.Helper()
	b, err := w.GetFinished()
	if err != nil {
		t.Fatal(err)
	}
	f, err := kvwire.DecodeFinished(b)
	if err != nil {
		t.Fatalf("get_finished output %x: %v", b, err)
	}
	return *f
}

// FuzzStartLoadKV feeds metadata to a worker that knows one remote engine.
// Every request is pointed at that engine (a request for an unknown one
// would start a network handshake). Properties: StartLoadKV fails exactly
// when DecodeStepMeta does; every transfer's descriptor indices are in range
// (checked in fzAgent.MakeXfer); every loaded request is reported once, its
// READs complete and nothing stays in flight; load errors name only blocks
// of failed requests.
func FuzzStartLoadKV(f *testing.F) {
	fzQuiet()
	for _, s := range fzStepMetas(f) {
		f.Add(s)
	}
	exp := 2000.0
	for _, m := range []*StepMeta{
		{ReqsToRecv: map[string]*RecvReq{"r": {LocalBlockIDs: BlockIDs{{1, 2}, {3}}, LocalNumComputed: []int64{1, 0}, TPSize: 1, AwaitingKVs: true,
			Remote: RemoteMeta{BlockIDs: BlockIDs{{5, 6, 7}, {9, 10}}, Expiry: &exp}}}},
		{ReqsToRecv: map[string]*RecvReq{"r": {LocalBlockIDs: BlockIDs{{15}}, LocalNumComputed: []int64{0}, TPSize: 1, AwaitingKVs: true,
			Remote: RemoteMeta{BlockIDs: BlockIDs{{23}}, Expiry: &exp}}}},
		{ReqsToRecv: map[string]*RecvReq{"r": {LocalBlockIDs: BlockIDs{{16}}, TPSize: 1, Remote: RemoteMeta{BlockIDs: BlockIDs{{24}}}}}},
	} {
		b, _ := m.Encode()
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, derr := DecodeStepMeta(b)
		for _, mk := range fzWorkers(t) {
			w, a, clock := mk()
			if derr != nil {
				if err := w.StartLoadKV(b); err == nil {
					t.Fatalf("StartLoadKV accepted what DecodeStepMeta refuses (%v)", derr)
				}
				if len(w.recv) != 0 || len(w.toProcess) != 0 || len(a.sent) != 0 {
					t.Fatal("refused metadata changed the worker's state")
				}
				continue
			}
			// Point every request and heartbeat at the known engine.
			for _, rr := range m.ReqsToRecv {
				if rr != nil && rr.Remote.EngineID != "" {
					rr.Remote.EngineID, rr.Remote.Host, rr.Remote.Port = fzRemoteEngine, fzRemoteHost, fzRemotePort
				}
			}
			if len(m.Heartbeats) > 0 {
				var hb *HeartbeatInfo
				for _, h := range m.Heartbeats {
					hb = h
				}
				m.Heartbeats = map[string]*HeartbeatInfo{fzRemoteEngine: hb}
			}
			enc, err := m.Encode()
			if err != nil {
				t.Fatal(err)
			}
			if err := w.StartLoadKV(enc); err != nil {
				t.Fatalf("StartLoadKV: %v", err)
			}
			for _, s := range a.sent {
				i := strings.LastIndexByte(s, ':')
				if !strings.HasPrefix(s, "HB:") && (i < 0 || s[i+1:] != "1") {
					t.Fatalf("worker sent notification %q", s)
				}
			}
			var fin Finished
			for i := 0; i < 3; i++ {
				f := fzFinished(t, w)
				fin.Recving = append(fin.Recving, f.Recving...)
				fin.Failed = append(fin.Failed, f.Failed...)
				clock.Advance(1)
			}
			seen := map[string]bool{}
			for _, id := range fin.Recving {
				if seen[id] {
					t.Fatalf("request %q reported twice", id)
				}
				seen[id] = true
				if _, ok := m.ReqsToRecv[id]; !ok {
					t.Fatalf("reported request %q that was not loaded", id)
				}
			}
			bad := map[int64]bool{}
			for _, id := range fin.Failed {
				if !seen[id] {
					t.Fatalf("failed request %q not among the finished", id)
				}
				for _, g := range m.ReqsToRecv[id].LocalBlockIDs {
					for _, blk := range g {
						bad[blk] = true
					}
				}
			}
			for _, blk := range w.LoadErrors() {
				if !bad[blk] {
					t.Fatalf("load error for block %d, which no failed request holds", blk)
				}
			}
			if a.xfers != 0 || len(w.recv) != 0 {
				t.Fatalf("%d transfers and %d requests still held", a.xfers, len(w.recv))
			}
		}
	})
}

// ---------------------------------------------------------------------------
// Notifications

// FuzzNotifications delivers the input, split at '\n', as notifications to
// a prefill worker holding leases for "req-a" and "req:b" and processing
// "req-a" and "req-c". Properties: only those requests are ever released,
// each once, exactly when a well-formed "<id>:<n>" count reaches n (the
// reference model below); heartbeats only extend existing leases; the
// worker's tables never grow past the known requests.
func FuzzNotifications(f *testing.F) {
	fzQuiet()
	for _, s := range []string{
		"req-a:1", "req:b:1", "req-c:2\nreq-c:2", "HB:req-a,unknown", "HB:", "HB:req:b\nreq:b:1",
		"unknown:1", "req-a", "req-a:0", "req-a:-1", "req-a:+1", "req-a:99999999999999999999", ":1", "req-a:1\nreq-a:1",
		"req-a:3\nreq-a:2\nreq-a:1", "\n\n", "req-c:1\x00", "HB:" + strings.Repeat("req-a,", 100),
	} {
		f.Add([]byte(s))
	}
	known := []string{"req-a", "req:b", "req-c"}
	f.Fuzz(func(t *testing.T, b []byte) {
		msgs := bytes.Split(b, []byte{'\n'})
		if len(msgs) > 256 {
			msgs = msgs[:256]
		}
		w, a, _ := fzWorker(t, fzConfig(t, RoleWorker, "kv_producer", nil, nil), fzLayers([]*int{nil}, []string{""}, 0))
		now := w.clock()
		w.held = newLeases(w.clock)
		w.held.Hold("req-a", now+30)
		w.held.Hold("req:b", now+30)
		w.toProcess = map[string]struct{}{"req-a": {}, "req-c": {}}
		before := map[string]float64{"req-a": now + 30, "req:b": now + 30}
		for _, m := range msgs {
			a.inbox = append(a.inbox, nixl.Notif{Agent: "decoder", Msg: m})
		}
		// Reference model of "<req>:<n>": the n-th notification for a
		// request being sent or processed releases it.
		count, want := map[string]int{}, map[string]bool{}
		for _, m := range msgs {
			s := string(m)
			if strings.HasPrefix(s, "HB:") {
				continue
			}
			i := strings.LastIndexByte(s, ':')
			if i < 0 {
				continue
			}
			n, err := strconv.Atoi(s[i+1:])
			id := s[:i]
			if err != nil || n <= 0 || want[id] || !slices.Contains(known, id) {
				continue
			}
			count[id]++
			if count[id] >= n {
				want[id] = true
			}
		}
		fin := fzFinished(t, w)
		got := map[string]bool{}
		for _, id := range fin.Sending {
			if got[id] {
				t.Fatalf("%q released twice", id)
			}
			got[id] = true
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("released %v, want %v", got, want)
		}
		for _, id := range w.held.IDs() {
			exp, _ := w.held.Deadline(id)
			if exp < before[id] {
				t.Fatalf("lease of %q shortened from %v to %v", id, before[id], exp)
			}
			if _, ok := before[id]; !ok {
				t.Fatalf("a notification created lease %q", id)
			}
		}
		for id := range w.toProcess {
			if !slices.Contains(known, id) {
				t.Fatalf("a notification added %q to the processing set", id)
			}
		}
		for id := range w.consumers {
			if !slices.Contains(known, id) || got[id] {
				t.Fatalf("consumer count kept for %q", id)
			}
		}
		_ = w.Stats()
	})
}

// ---------------------------------------------------------------------------
// kv_transfer_params

// ---------------------------------------------------------------------------
// Configuration

func FuzzParseConfig(f *testing.F) {
	fzQuiet()
	base := func(role Role, kvRole string, extra map[string]any, more map[string]any) []byte {
		raw := map[string]any{"role": role, "kv_role": kvRole, "engine_id": "e", "kv_connector_extra_config": extra,
			"compat_factors": map[string]any{"model": "m", "num_kv_heads": 2, "x": []any{1, "a", nil, 1.5}}}
		for k, v := range more {
			raw[k] = v
		}
		b, _ := json.Marshal(raw)
		return b
	}
	f.Add(base(RoleScheduler, "kv_producer", nil, nil))
	f.Add(base(RoleWorker, "kv_consumer", map[string]any{"backends": []string{"UCX"}, "num_threads": "8", "kv_lease_duration": 30,
		"decoder_kv_blocks_ttl": "480", "bidirectional_kv_xfer": "true", "kv_recompute_threshold": 64, "enforce_handshake_compat": false,
		"engine_ttl": 3600, "transfer_engine": "ucx", "side_channel_secret": "s", "transfer_timeout": 60, "handshake_timeout": 30,
		"progress_thread_delay_us": 0, "post_off_model_thread": "false"}, map[string]any{"tp_size": 2, "tp_rank": 1, "pp_size": 2, "pp_rank": 1, "dp_index": 3,
		"block_size": 16, "side_channel_port": 5600, "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute",
		"transfer_groups": []TransferGroup{{Kind: "full"}, {Kind: "sliding_window", SlidingWindow: 4096, BlockSize: 16}}, "hma_required": true}))
	for _, extra := range []map[string]any{
		{"kv_lease_duration": "NaN"}, {"kv_lease_duration": "inf"}, {"kv_lease_duration": 1e300}, {"transfer_timeout": "nan"},
		{"handshake_timeout": "+Inf"}, {"handshake_timeout": 1e12}, {"decoder_kv_blocks_ttl": "NaN"}, {"decoder_kv_blocks_ttl": "-inf"},
		{"engine_ttl": "inf"}, {"engine_ttl": "nan"}, {"num_threads": 1.5}, {"num_threads": 1e30}, {"progress_thread_delay_us": 1e18},
		{"backends": []any{}}, {"backends": []any{1}}, {"bidirectional_kv_xfer": 2}, {"transfer_engine": 5},
		{"post_off_model_thread": "maybe"},
	} {
		f.Add(base(RoleWorker, "kv_producer", extra, nil))
	}
	for _, more := range []map[string]any{
		{"dp_index": 1 << 40}, {"dp_index": 65000}, {"side_channel_port": 65535, "dp_index": 1}, {"tp_size": 1 << 40}, {"tp_rank": -1},
		{"pp_size": 1 << 30}, {"block_size": -1}, {"side_channel_port": 70000},
		{"transfer_groups": []any{map[string]any{"kind": "mamba"}}}, {"transfer_groups": []any{map[string]any{"kind": "sliding_window"}}},
	} {
		f.Add(base(RoleScheduler, "kv_consumer", nil, more))
	}
	f.Add([]byte(`{"role": "worker", "kv_role": "kv_both", "engine_id": "e"} trailing`))
	f.Add([]byte(`{"role": "worker", "kv_role": "kv_both", "engine_id": "e", "compat_factors": {"a": {"b": {"c": [[[[[[1]]]]]]}}}}`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseConfig(data)
		if (c == nil) == (err == nil) {
			t.Fatalf("value %v with error %v", c, err)
		}
		if err != nil {
			return
		}
		finite := func(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }
		durationOK := func(sec float64) bool { return finite(sec) && sec > 0 && sec*1e9 < math.MaxInt64 }
		switch {
		case c.Role != RoleScheduler && c.Role != RoleWorker:
			t.Fatalf("role %q", c.Role)
		case c.EngineID == "":
			t.Fatal("empty engine_id")
		case c.TPSize < 1 || c.TPSize > 1<<16 || c.TPRank < 0 || c.TPRank >= c.TPSize:
			t.Fatalf("tp %d/%d (kv_transfer_params carry tp_size <= 65536)", c.TPRank, c.TPSize)
		case c.PPSize < 1 || c.PPSize > 1<<20 || c.PPRank < 0 || c.PPRank >= c.PPSize:
			t.Fatalf("pp %d/%d (kv_transfer_params carry pp_size <= 2^20)", c.PPRank, c.PPSize)
		case c.DPIndex < 0 || c.SideChannelPort < 1 || c.SideChannelPort+c.DPIndex > 65535 || c.SideChannelPort+c.DPIndex < c.SideChannelPort:
			t.Fatalf("side channel port %d + dp_index %d is no TCP port", c.SideChannelPort, c.DPIndex)
		case c.BlockSize < 0:
			t.Fatalf("block_size %d", c.BlockSize)
		case c.KVLoadFailurePolicy != "fail" && c.KVLoadFailurePolicy != "recompute":
			t.Fatalf("kv_load_failure_policy %q", c.KVLoadFailurePolicy)
		case len(c.Backends) == 0:
			t.Fatal("no backends")
		case !durationOK(c.KVLeaseDuration):
			t.Fatalf("kv_lease_duration %v", c.KVLeaseDuration)
		case !durationOK(c.TransferTimeout), !durationOK(c.HandshakeTimeout):
			t.Fatalf("transfer_timeout %v handshake_timeout %v (must be a positive finite time.Duration)", c.TransferTimeout, c.HandshakeTimeout)
		case !finite(c.DecoderKVBlocksTTL):
			t.Fatalf("decoder_kv_blocks_ttl %v (expiries are written to kv_transfer_params JSON)", c.DecoderKVBlocksTTL)
		case math.IsNaN(c.EngineTTL):
			t.Fatal("engine_ttl NaN")
		case c.ProgressDelayUs < 0 || int64(c.ProgressDelayUs) > math.MaxInt64/1000:
			t.Fatalf("progress_thread_delay_us %d", c.ProgressDelayUs)
		}
		switch c.TransferEngine {
		case "auto", "nixl", "ucx":
		default:
			t.Fatalf("transfer_engine %q", c.TransferEngine)
		}
		for i, g := range c.TransferGroups {
			if g.Kind == LayerKindSlidingWindow && (g.SlidingWindow <= 0 || g.BlockSize <= 0) {
				t.Fatalf("group %d: %+v", i, g)
			}
		}
		// The scheduler's output params must parse on the other side.
		if c.Role == RoleScheduler {
			s, err := NewScheduler(c, NewFakeClock(100).Now)
			if err != nil {
				t.Fatal(err)
			}
			s.log = zap.NewNop()
			in, _ := ParseTransferParams([]byte(`{"do_remote_decode": true}`))
			_, out, err := s.RequestFinished("r", in, true, 4, BlockIDs{{1}})
			if err != nil {
				t.Fatalf("request_finished with an accepted config: %v", err)
			}
			if _, err := ParseTransferParams(out); err != nil {
				t.Fatalf("params %s from an accepted config do not parse: %v", out, err)
			}
		}
		factors := map[string]any{}
		for k, v := range c.CompatFactors {
			factors[k] = plainJSON(v)
		}
		_, _, _ = compatHashes(factors, "ucx") // must not panic
	})
}

// ---------------------------------------------------------------------------
// register_kv_caches

func FuzzWorkerInit(f *testing.F) {
	fzQuiet()
	add := func(init WorkerInit) {
		b, err := json.Marshal(init)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	add(WorkerInit{Layers: fzLayers([]*int{nil, nil}, []string{"", ""}, 0), NumBlocks: tNumBlocks, BlockSize: tBlockSize, AttnBackend: "CPU_ATTN", KVCacheLayout: "NHD"})
	add(WorkerInit{Layers: fzLayers([]*int{intp(0), intp(1), intp(-1)}, []string{LayerKindFull, LayerKindSlidingWindow, ""}, 8), NumBlocks: tNumBlocks})
	// MLA: [num_blocks, block_size, head], one region per layer.
	add(WorkerInit{NumBlocks: 10, Layers: []LayerTensor{{Name: "model.layers.0.attn", DataPtr: 4096, StoragePtr: 4096, StorageBytes: 10 * 16 * 64 * 2,
		ElemSize: 2, Shape: []int64{10, 16, 64}, Stride: []int64{16 * 64, 64, 1}, Device: "cpu", Kind: LayerKindMLA}}})
	// Two layers of different groups sharing one tensor (hybrid allocator).
	shared := fzLayers([]*int{intp(0), intp(1)}, []string{LayerKindFull, LayerKindFull}, 0)
	shared[1].DataPtr, shared[1].StoragePtr = shared[0].DataPtr, shared[0].StoragePtr
	add(WorkerInit{Layers: shared, NumBlocks: tNumBlocks})
	// Overflowing geometry.
	for _, l := range []LayerTensor{
		{Name: "a", DataPtr: 4096, StoragePtr: 4096, StorageBytes: 4096, ElemSize: 1, Shape: []int64{3}, Stride: []int64{math.MaxInt64}},
		{Name: "a", DataPtr: 4096, StoragePtr: 4096, StorageBytes: 1 << 62, ElemSize: 1 << 40, Shape: []int64{3, 1 << 30}, Stride: []int64{1 << 30, 1}},
		{Name: "a", DataPtr: 4096, StoragePtr: 4096, StorageBytes: 1 << 62, ElemSize: 1, Shape: []int64{1 << 40, 3}, Stride: []int64{3, 1}},
		{Name: "a", DataPtr: 1, StoragePtr: math.MaxUint64 - 10, StorageBytes: 100, ElemSize: 1, Shape: []int64{3}, Stride: []int64{1}},
		{Name: "a", DataPtr: 4096, StoragePtr: 4096, StorageBytes: 1 << 40, ElemSize: 1, Shape: []int64{1 << 35}, Stride: []int64{1}},
	} {
		n := int64(3)
		if l.Shape[0] == 1<<35 {
			n = 1 << 35
		}
		add(WorkerInit{Layers: []LayerTensor{l}, NumBlocks: n})
	}
	f.Add([]byte(`{"layers": [{"name": "x", "shape": [2, 2], "stride": [2]}], "num_blocks": 2}`))
	f.Add([]byte(`{"layers": null, "num_blocks": -1}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		var init WorkerInit
		if err := json.Unmarshal(data, &init); err != nil {
			return
		}
		layout, err := BuildLayout(init.Layers, init.NumBlocks)
		if (layout == nil) == (err == nil) {
			t.Fatalf("value %v with error %v", layout, err)
		}
		if err != nil {
			return
		}
		checkLayout(t, layout)
	})
}

// checkLayout asserts what registration and descriptor ids rely on.
func checkLayout(t *testing.T, l *KVLayout) {
	t.Helper()
	if l.NumBlocks <= 0 || len(l.Regions) == 0 || len(l.Storage) == 0 {
		t.Fatalf("layout with %d blocks, %d regions, %d storages", l.NumBlocks, len(l.Regions), len(l.Storage))
	}
	// Descriptor ids (region*num_blocks + block) are int32, and every
	// descriptor is allocated at registration.
	if big.NewInt(0).Mul(big.NewInt(int64(len(l.Regions))), big.NewInt(l.NumBlocks)).Cmp(big.NewInt(math.MaxInt32)) > 0 {
		t.Fatalf("%d regions x %d blocks exceed int32 descriptor ids", len(l.Regions), l.NumBlocks)
	}
	u := func(v uint64) *big.Int { return new(big.Int).SetUint64(v) }
	for i := 1; i < len(l.Storage); i++ {
		prevEnd := new(big.Int).Add(u(l.Storage[i-1].Addr), u(l.Storage[i-1].Len))
		if l.Storage[i-1].Addr >= l.Storage[i].Addr || prevEnd.Cmp(u(l.Storage[i].Addr)) > 0 {
			t.Fatalf("storages %+v and %+v overlap or are unsorted", l.Storage[i-1], l.Storage[i])
		}
	}
	bases := map[uint64]bool{}
	for i, r := range l.Regions {
		if r.Len == 0 || (l.NumBlocks > 1 && r.Stride < r.Len) {
			t.Fatalf("region %d: block length %d stride %d", i, r.Len, r.Stride)
		}
		if r.Group < 0 && r.Group != SharedGroup {
			t.Fatalf("region %d: group %d", i, r.Group)
		}
		if bases[r.Base] {
			t.Fatalf("two regions at %#x", r.Base)
		}
		bases[r.Base] = true
		if i > 0 && RegionLess(r.Layer, l.Regions[i-1].Layer) {
			t.Fatalf("region %d (%s) before %s", i, r.Layer, l.Regions[i-1].Layer)
		}
		end := new(big.Int).Mul(u(uint64(l.NumBlocks-1)), u(r.Stride))
		end.Add(end, u(r.Base)).Add(end, u(r.Len))
		inside := false
		for _, s := range l.Storage {
			if r.Base >= s.Addr && end.Cmp(new(big.Int).Add(u(s.Addr), u(s.Len))) <= 0 {
				inside = true
			}
		}
		if !inside {
			t.Fatalf("region %d [%#x, %#x) lies outside every registered storage %+v", i, r.Base, end, l.Storage)
		}
	}
}

// ---------------------------------------------------------------------------
// Remote agent metadata (handshake reply)

// FuzzRemoteAgentMetadata decodes a handshake's agent metadata as the worker
// does and checks it against this worker's layout. Accepted metadata must
// describe exactly this worker's regions (prepareRemote indexes them by
// the local region list).
func FuzzRemoteAgentMetadata(f *testing.F) {
	fzQuiet()
	mk := func() (*Worker, *KVLayout) {
		cfg := fzConfig(f, RoleWorker, "kv_consumer", nil, nil)
		w, err := NewWorker(cfg, nil)
		if err != nil {
			f.Fatal(err)
		}
		l, err := BuildLayout(fzLayers([]*int{nil, nil}, []string{"", ""}, 0), tNumBlocks)
		if err != nil {
			f.Fatal(err)
		}
		return w, l
	}
	w, local := mk()
	mine := w.geometryOf(local)
	good := func() *sidechannel.AgentMetadata {
		am := sidechannel.NewAgentMetadata()
		am.EngineID, am.AgentMetadata, am.NumBlocks = "engine-p", []byte("md"), fzRemoteBlocks
		am.KVCacheLayout, am.BlockSize, am.AttnBackendName, am.PhysicalBlocksPerLogicalKVBlock = "NHD", tBlockSize, "CPU_ATTN", 1
		fillRegionIdentity(am, local)
		g, _ := json.Marshal(mine)
		am.Geometry = string(g)
		return am
	}
	f.Add(good().Encode())
	for _, mod := range []func(*sidechannel.AgentMetadata){
		func(am *sidechannel.AgentMetadata) { am.Geometry = "{" },
		func(am *sidechannel.AgentMetadata) { am.Geometry = `{"tp_size": 2}` },
		func(am *sidechannel.AgentMetadata) { am.BlockLens = am.BlockLens[:1] },
		func(am *sidechannel.AgentMetadata) { am.RegionNames = nil },
		func(am *sidechannel.AgentMetadata) { am.BlockStrides[0] = 1 },
		func(am *sidechannel.AgentMetadata) { am.BlockLens[0] = -int64(local.Regions[0].Len) },
		func(am *sidechannel.AgentMetadata) { am.NumBlocks = 1 << 31 },
		func(am *sidechannel.AgentMetadata) { am.RegionNumBlocks[1] = 7 },
	} {
		am := good()
		mod(am)
		f.Add(am.Encode())
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		md, err := sidechannel.DecodeAgentMetadata(b)
		if err != nil {
			return
		}
		ratio, err := checkRemoteLayout(local, tBlockSize, "NHD", "CPU_ATTN", "head_major", mine, samePlan(), md)
		if err != nil {
			return
		}
		if ratio < 1 || md.BlockSize*int64(ratio) != tBlockSize {
			t.Fatalf("accepted block_size %d (ratio %d) for a local block size %d", md.BlockSize, ratio, tBlockSize)
		}
		n := len(local.Regions)
		if len(md.KVCachesBaseAddr) != n || len(md.BlockLens) != n || len(md.BlockStrides) != n || len(md.RegionNames) != n {
			t.Fatalf("accepted %d/%d/%d/%d regions for %d local ones", len(md.KVCachesBaseAddr), len(md.BlockLens), len(md.BlockStrides), len(md.RegionNames), n)
		}
		for i, r := range local.Regions {
			if md.BlockLens[i] <= 0 || uint64(md.BlockLens[i])*uint64(ratio) != r.Len || md.BlockStrides[i] < md.BlockLens[i] || md.RegionNames[i] != r.Layer {
				t.Fatalf("accepted region %d: len %d stride %d name %q for local %+v", i, md.BlockLens[i], md.BlockStrides[i], md.RegionNames[i], r)
			}
		}
	})
}

// TestRemoteNumBlocksBound: a remote engine that advertises num_blocks =
// 2^31 (with this engine's layer names, block lengths and strides, which
// are public) passed checkRemoteLayout and the num_blocks check, and the
// worker then built len(regions) x 2^31 descriptors: 206 GB here, "fatal
// error: out of memory" (not a recoverable panic). Any client can point a
// decode at such a peer through remote_host/remote_port. prepareRemote now
// bounds the descriptors a peer may make it build (maxRemoteDescs).
func TestRemoteNumBlocksBound(t *testing.T) {
	fzQuiet()
	w, _, _ := fzWorker(t, fzConfig(t, RoleWorker, "kv_consumer", nil, nil), fzLayers([]*int{nil, nil}, []string{"", ""}, 0))
	am := sidechannel.NewAgentMetadata()
	am.EngineID, am.AgentMetadata, am.NumBlocks = "evil", []byte("md"), 1<<31
	am.KVCacheLayout, am.BlockSize, am.AttnBackendName, am.PhysicalBlocksPerLogicalKVBlock = "NHD", tBlockSize, "CPU_ATTN", 1
	fillRegionIdentity(am, w.layout)
	am.RegionNumBlocks = nil
	g, _ := json.Marshal(w.geometryOf(w.layout))
	am.Geometry = string(g)
	md, err := sidechannel.DecodeAgentMetadata(am.Encode())
	if err != nil {
		t.Fatal(err)
	}
	w.blockSize, w.kvLayout, w.attnBackend = tBlockSize, "NHD", "CPU_ATTN"
	res := &sidechannel.Result{Agents: map[sidechannel.Rank]*sidechannel.AgentMetadata{{}: md}}
	if _, err := w.prepareRemote("evil", "127.0.0.1", 1, samePlan(), res); err == nil || !strings.Contains(err.Error(), "more descriptors") {
		t.Fatalf("a remote engine with 2^31 blocks x 4 regions: %v", err)
	}
}

// TestSchedulerNoNilRecvEntry: request_finished for a do_remote_prefill
// request whose params lack a usable endpoint (here remote_engine_id) adds
// a notify-only entry with addRecvLocked, then deletes it from reqsNeedRecv
// but not from reqsNeedRecvOrder, so BuildMeta writes reqs_to_recv[id] =
// nil. The worker's StartLoadKV dereferenced it (panic: library poisoned)
// until DecodeStepMeta dropped nil entries. Found by
// tests/python/test_fuzz_scheduler.py (a request aborted before
// allocation); fixed by adding the entry only with a usable endpoint.
func TestSchedulerNoNilRecvEntry(t *testing.T) {
	fzQuiet()
	s, err := NewScheduler(fzConfig(t, RoleScheduler, "kv_consumer", nil, nil), nil)
	if err != nil {
		t.Fatal(err)
	}
	p, err := ParseTransferParams([]byte(`{"do_remote_prefill": true, "remote_block_ids": [[1]], "remote_request_id": "r", "remote_host": "h", "remote_port": 1}`))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.RequestFinished("aborted", p, false, 0, nil); err != nil {
		t.Fatal(err)
	}
	b, err := s.BuildMeta()
	if err != nil {
		t.Fatal(err)
	}
	var raw struct {
		M struct {
			Recv map[string]any `msgpack:"reqs_to_recv"`
		} `msgpack:"m"`
	}
	if err := msgpack.Unmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	for id, rr := range raw.M.Recv {
		if rr == nil {
			t.Errorf("reqs_to_recv[%q] is nil", id)
		}
	}
}

// TestSchedulerAsyncImpliesRead: whenever GetNumNewMatchedTokens answers
// (n > 0, async), UpdateStateAfterAlloc must schedule a READ: otherwise the
// request waits in WAITING_FOR_REMOTE_KVS forever, holding its blocks.
// GetNum does not check remote_request_id (missing, null or "" pass), nor,
// for do_remote_decode params (the pull-back branch), bidirectional_kv_xfer
// or _remote_blocks_processed, which UpdateStateAfterAlloc requires. Found
// by tests/python/test_fuzz_scheduler.py; fixed by one predicate for both
// (readable, Scheduler.readbackable).
func TestSchedulerAsyncImpliesRead(t *testing.T) {
	fzQuiet()
	for _, c := range []struct{ kvRole, params string }{
		{"kv_consumer", `{"do_remote_prefill": true, "remote_block_ids": [[1,2]], "remote_engine_id": "e", "remote_request_id": "", "remote_host": "h", "remote_port": 1}`},
		{"kv_consumer", `{"do_remote_prefill": true, "remote_block_ids": [[1,2]], "remote_engine_id": "e", "remote_request_id": null, "remote_host": "h", "remote_port": 1}`},
		{"kv_producer", `{"do_remote_decode": true, "remote_block_ids": [[1,2]], "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h", "remote_port": 1, "remote_num_tokens": 64}`},
		{"kv_producer", `{"do_remote_decode": true, "_remote_blocks_processed": true, "remote_block_ids": [[1,2]], "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h", "remote_port": 1, "remote_num_tokens": 64}`},
	} {
		extra := map[string]any{}
		if strings.Contains(c.params, "_remote_blocks_processed") {
			extra["bidirectional_kv_xfer"] = true
		}
		s, err := NewScheduler(fzConfig(t, RoleScheduler, c.kvRole, extra, nil), nil)
		if err != nil {
			t.Fatal(err)
		}
		p, err := ParseTransferParams([]byte(c.params))
		if err != nil {
			t.Fatal(err)
		}
		n, async := s.GetNumNewMatchedTokens(p, 64, 0)
		if !async {
			continue
		}
		if _, err := s.UpdateStateAfterAlloc("req", p, BlockIDs{{3, 4}}, []int64{0}, n); err != nil {
			t.Fatal(err)
		}
		if s.reqsNeedRecv["req"] == nil {
			t.Errorf("%s %s: %d tokens async, but no READ scheduled", c.kvRole, c.params, n)
		}
	}
}
