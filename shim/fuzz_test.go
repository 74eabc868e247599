package shim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"math/big"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/sidechannel"
)

// Fuzz targets for every parser in shim that reads bytes from the network
// or from Python (through capi):
//
//   - FuzzDecodeStepMeta, FuzzStepMetaRoundTrip: per-step metadata
//     (gonixl_worker_start_load_kv).
//   - FuzzStartLoadKV: the same bytes all the way through a worker's
//     StartLoadKV / GetFinished (block pairing, descriptor ids).
//   - FuzzNotifications: "<req>:<n>" and "HB:<ids>" notifications a remote
//     agent sends to a prefill worker (pollNotifsLocked).
//   - FuzzParseTransferParams: kv_transfer_params JSON (every scheduler call).
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

// fzStepMetas returns valid metadata: hand-made and from a real scheduler.
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
	mp := func(v any) []byte {
		b, err := msgpack.Marshal(v)
		if err != nil {
			tb.Fatal(err)
		}
		return b
	}
	// Edge cases: nil entries, a newer version, negative ids, wrong types.
	out = append(out,
		mp(map[string]any{"v": 1, "m": map[string]any{"reqs_to_recv": map[string]any{"a": nil}}}),
		mp(map[string]any{"v": 1, "m": map[string]any{"heartbeats": map[string]any{"e": nil}}}),
		mp(map[string]any{"v": 2, "m": map[string]any{}}),
		mp(map[string]any{"v": 1, "m": nil}),
		mp(map[string]any{"v": 1, "m": map[string]any{"reqs_to_recv": map[string]any{"a": map[string]any{"local_block_ids": [][]int64{{-1}}}}}}),
		mp(map[string]any{"v": 1, "m": map[string]any{"reqs_to_recv": map[string]any{"a": map[string]any{"remote": map[string]any{"block_ids": [][]int64{{-5}}}}}}}),
		mp(map[string]any{"v": 1, "m": map[string]any{"reqs_to_recv": "x"}}),
		mp(map[string]any{"v": 1, "m": map[string]any{"reqs_to_recv": map[string]any{"a": map[string]any{"local_num_computed": []int64{-3}}}}}),
		[]byte{0x82, 0xa1, 'v', 0x01, 0xa1, 'm', 0xdf, 0xff, 0xff, 0xff, 0xff},
		[]byte{0x82, 0xa1, 'v', 0x01, 0xa1, 'm', 0x81, 0xac, 'r', 'e', 'q', 's', '_', 'i', 'n', '_', 'b', 'a', 't', 'c', 'h', 0xdd, 0xff, 0xff, 0xff, 0xff},
	)
	return out
}

// checkStepMeta asserts what a worker relies on in accepted metadata: no
// nil entries (it dereferences every one). Block ids are checked per
// request by the worker (FuzzStartLoadKV).
func checkStepMeta(t *testing.T, m *StepMeta) {
	t.Helper()
	for id, rr := range m.ReqsToRecv {
		if rr == nil {
			t.Fatalf("accepted a nil reqs_to_recv entry %q", id)
		}
	}
	for eng, hb := range m.Heartbeats {
		if hb == nil {
			t.Fatalf("accepted a nil heartbeat entry %q", eng)
		}
	}
}

func FuzzDecodeStepMeta(f *testing.F) {
	fzQuiet()
	for _, s := range fzStepMetas(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := DecodeStepMeta(b)
		if (m == nil) == (err == nil) {
			t.Fatalf("value %v with error %v", m, err)
		}
		if err != nil {
			return
		}
		checkStepMeta(t, m)
		enc, err := m.Encode()
		if err != nil {
			t.Fatalf("accepted metadata does not re-encode: %v", err)
		}
		m2, err := DecodeStepMeta(enc)
		if err != nil {
			t.Fatalf("re-encoded metadata does not decode: %v", err)
		}
		if !fzEqual(reflect.ValueOf(m), reflect.ValueOf(m2)) {
			t.Fatalf("re-encoded metadata differs:\n%+v\n%+v", m, m2)
		}
	})
}

// FuzzStepMetaRoundTrip builds metadata from the fuzzer's values: every
// value the scheduler can produce decodes to itself.
func FuzzStepMetaRoundTrip(f *testing.F) {
	fzQuiet()
	f.Add("req-d", []byte{7, 8, 9}, []byte{3, 4, 5}, uint8(1), "127.0.0.1", 5600, "engine-p", 1234.5, true, 1000.0, int64(12))
	f.Add("", []byte{}, []byte{}, uint8(0), "", 0, "", math.NaN(), false, math.Inf(-1), int64(0))
	f.Add("a:b", []byte{0, 255}, []byte{1}, uint8(3), "::1", 65535, "e\x00", -0.0, true, 1e308, int64(math.MaxInt64))
	f.Fuzz(func(t *testing.T, id string, local, remote []byte, groups uint8, host string, port int, engine string, exp float64, awaiting bool, clock float64, tokens int64) {
		ng := int(groups%4) + 1
		split := func(b []byte) BlockIDs {
			out := make(BlockIDs, ng)
			for i, v := range b {
				out[i%ng] = append(out[i%ng], int64(v)*int64(i+1))
			}
			return out
		}
		var e *float64
		if awaiting {
			e = &exp
		}
		comp := make([]int64, ng)
		for i := range comp {
			comp[i] = int64(len(local) * i)
		}
		m := &StepMeta{
			ReqsToRecv: map[string]*RecvReq{id: {LocalBlockIDs: split(local), LocalNumComputed: comp, TPSize: ng, DCPSize: 1, PPSize: ng,
				RemoteBlockSize: port, AwaitingKVs: awaiting,
				Remote: RemoteMeta{BlockIDs: split(remote), Host: host, Port: port, EngineID: engine, RequestID: id + "-p", Expiry: e, NumTokens: tokens}}},
			ReqsToSend:       map[string]float64{id: exp},
			SchedulerClock:   clock,
			ReqsInBatch:      []string{id, engine},
			ReqsNotProcessed: []string{host},
			Heartbeats: map[string]*HeartbeatInfo{engine: {ReqIDs: []string{id}, Expiry: map[string]float64{id: exp}, Host: host, Port: port,
				TPSize: 1, DCPSize: 1, PPSize: 1}},
		}
		b, err := m.Encode()
		if err != nil {
			t.Fatal(err)
		}
		m2, err := DecodeStepMeta(b)
		if err != nil {
			t.Fatalf("valid metadata does not decode: %v", err)
		}
		if !fzEqual(reflect.ValueOf(m), reflect.ValueOf(m2)) {
			t.Fatalf("metadata does not round-trip:\n%+v\n%+v", m, m2)
		}
	})
}

// fzEqual is reflect.DeepEqual with NaN equal to NaN, and nil equal to empty
// for slices and maps (msgpack writes both as an empty container or nil).
func fzEqual(a, b reflect.Value) bool {
	if a.Kind() != b.Kind() {
		return false
	}
	switch a.Kind() {
	case reflect.Pointer, reflect.Interface:
		if a.IsNil() || b.IsNil() {
			return a.IsNil() == b.IsNil()
		}
		return fzEqual(a.Elem(), b.Elem())
	case reflect.Struct:
		for i := 0; i < a.NumField(); i++ {
			if !fzEqual(a.Field(i), b.Field(i)) {
				return false
			}
		}
		return true
	case reflect.Slice, reflect.Array:
		if a.Len() != b.Len() {
			return false
		}
		for i := 0; i < a.Len(); i++ {
			if !fzEqual(a.Index(i), b.Index(i)) {
				return false
			}
		}
		return true
	case reflect.Map:
		if a.Len() != b.Len() {
			return false
		}
		for _, k := range a.MapKeys() {
			bv := b.MapIndex(k)
			if !bv.IsValid() || !fzEqual(a.MapIndex(k), bv) {
				return false
			}
		}
		return true
	case reflect.Float32, reflect.Float64:
		x, y := a.Float(), b.Float()
		return x == y || (math.IsNaN(x) && math.IsNaN(y))
	case reflect.String:
		return a.String() == b.String()
	case reflect.Bool:
		return a.Bool() == b.Bool()
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return a.Int() == b.Int()
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return a.Uint() == b.Uint()
	}
	return reflect.DeepEqual(a.Interface(), b.Interface())
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
	var f Finished
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatalf("get_finished output %q: %v", b, err)
	}
	return f
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

// checkParams asserts the bounds ParseTransferParams documents.
func checkParams(t *testing.T, p *TransferParams) {
	t.Helper()
	switch {
	case p.RemotePort < 0 || p.RemotePort > 65535:
		t.Fatalf("remote_port %d", p.RemotePort)
	case p.TPSize < 1 || p.TPSize > 1<<16:
		t.Fatalf("tp_size %d", p.TPSize)
	case p.DCPSize < 1 || p.DCPSize > 1<<20, p.PPSize < 1 || p.PPSize > 1<<20:
		t.Fatalf("dcp_size %d pp_size %d", p.DCPSize, p.PPSize)
	case p.RemoteBlockSize < 0 || p.RemoteBlockSize > 1<<20:
		t.Fatalf("remote_block_size %d", p.RemoteBlockSize)
	case p.RemoteNumTokens < 0:
		t.Fatalf("remote_num_tokens %d", p.RemoteNumTokens)
	case p.RemoteExpiry != nil && (math.IsNaN(*p.RemoteExpiry) || math.IsInf(*p.RemoteExpiry, 0)):
		t.Fatalf("remote_blocks_expiry_time %v", *p.RemoteExpiry)
	case p.HasRemoteBlocks != !p.RemoteBlockIDs.Empty():
		t.Fatalf("HasRemoteBlocks %v with %v", p.HasRemoteBlocks, p.RemoteBlockIDs)
	case p.HasHeartbeatTarget() && !p.HasRemoteEndpoint():
		t.Fatal("heartbeat target without endpoint")
	}
	for _, g := range p.RemoteBlockIDs {
		for _, b := range g {
			if b < 0 {
				t.Fatalf("negative block id %d", b)
			}
		}
	}
}

func fzNormIDs(b BlockIDs) [][]int64 {
	out := [][]int64{}
	for _, g := range b {
		if g == nil {
			g = []int64{}
		}
		out = append(out, g)
	}
	return out
}

func FuzzParseTransferParams(f *testing.F) {
	fzQuiet()
	s, err := NewScheduler(fzConfig(f, RoleScheduler, "kv_producer", nil, nil), NewFakeClock(100).Now)
	if err != nil {
		f.Fatal(err)
	}
	s.log = zap.NewNop()
	in, _ := ParseTransferParams([]byte(`{"do_remote_decode": true}`))
	_, own, err := s.RequestFinished("req-1", in, true, 12, BlockIDs{{3, 4, 5}})
	if err != nil {
		f.Fatal(err)
	}
	for _, seed := range []string{
		string(own),
		`{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}`,
		`{"do_remote_prefill": true, "remote_block_ids": [1, 2, 3], "remote_engine_id": "p", "remote_request_id": "r", "remote_host": "h", "remote_port": 7, "tp_size": 1}`,
		`{"do_remote_prefill": true, "remote_block_ids": [[1, 2], [], [3]], "remote_blocks_expiry_time": 1e3, "remote_num_tokens": 12, "dcp_size": 0, "pp_size": 2, "remote_block_size": 16}`,
		``, `null`, `{}`, `[]`, `"x"`, `{"remote_block_ids": [[1], 2]}`, `{"remote_block_ids": [1, [2]]}`, `{"remote_block_ids": [-1]}`,
		`{"remote_block_ids": [1.5]}`, `{"remote_block_ids": [1e3]}`, `{"remote_block_ids": [99999999999999999999]}`, `{"remote_block_ids": [[1], null]}`,
		`{"remote_block_ids": [null]}`, `{"remote_block_ids": [[[1]]]}`, `{"remote_block_ids": "1,2"}`, `{"remote_block_ids": {"a": 1}}`,
		`{"tp_size": null}`, `{"tp_size": 0}`, `{"tp_size": 65537}`, `{"remote_port": 70000}`, `{"remote_port": -1}`, `{"remote_port": "7"}`,
		`{"remote_port": 7.0}`, `{"remote_blocks_expiry_time": 1e400}`, `{"remote_blocks_expiry_time": "soon"}`, `{"remote_num_tokens": -1}`,
		`{"do_remote_prefill": "yes"}`, `{"do_remote_prefill": 1}`, `{"remote_engine_id": 5}`, `{"remote_host": ["h"]}`, `{"a": 1, "a": 2}`,
		`{"remote_block_ids": [` + strings.Repeat("[", 200) + `]`, `{"remote_block_ids": [[0,0,0]], "remote_block_ids": [1]}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := ParseTransferParams(data)
		if err != nil {
			if p != nil {
				t.Fatalf("value with error %v", err)
			}
			return
		}
		if p == nil {
			return // no transfer
		}
		checkParams(t, p)
		// Through the package's own encoder (request_finished's params).
		out := outParams{DoRemotePrefill: p.DoRemotePrefill, DoRemoteDecode: p.DoRemoteDecode, RemoteBlockIDs: p.RemoteBlockIDs,
			RemoteEngineID: p.RemoteEngineID, RemoteRequestID: p.RemoteRequestID, RemoteHost: p.RemoteHost, RemotePort: p.RemotePort,
			TPSize: p.TPSize, DCPSize: p.DCPSize, PPSize: p.PPSize, RemoteNumTokens: p.RemoteNumTokens, RemoteExpiry: p.RemoteExpiry}
		b, err := json.Marshal(out)
		if err != nil {
			t.Fatalf("accepted params do not re-encode: %v", err)
		}
		p2, err := ParseTransferParams(b)
		if err != nil || p2 == nil {
			t.Fatalf("re-encoded params %s: %v", b, err)
		}
		checkParams(t, p2)
		same := p2.DoRemotePrefill == p.DoRemotePrefill && p2.DoRemoteDecode == p.DoRemoteDecode &&
			reflect.DeepEqual(fzNormIDs(p2.RemoteBlockIDs), fzNormIDs(p.RemoteBlockIDs)) && p2.HasRemoteBlocks == p.HasRemoteBlocks &&
			p2.RemoteEngineID == p.RemoteEngineID && p2.RemoteRequestID == p.RemoteRequestID && p2.RemoteHost == p.RemoteHost &&
			p2.RemotePort == p.RemotePort && p2.TPSize == p.TPSize && p2.DCPSize == p.DCPSize && p2.PPSize == p.PPSize &&
			p2.RemoteNumTokens == p.RemoteNumTokens && (p.RemoteExpiry == nil) == (p2.RemoteExpiry == nil) &&
			(p.RemoteExpiry == nil || *p.RemoteExpiry == *p2.RemoteExpiry)
		if !same {
			t.Fatalf("params do not round-trip:\n%+v\n%+v (%s)", p, p2, b)
		}
	})
}

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
		"progress_thread_delay_us": 0}, map[string]any{"tp_size": 2, "tp_rank": 1, "pp_size": 2, "pp_rank": 1, "dp_index": 3,
		"block_size": 16, "side_channel_port": 5600, "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute",
		"transfer_groups": []TransferGroup{{Kind: "full"}, {Kind: "sliding_window", SlidingWindow: 4096, BlockSize: 16}}, "hma_required": true}))
	for _, extra := range []map[string]any{
		{"kv_lease_duration": "NaN"}, {"kv_lease_duration": "inf"}, {"kv_lease_duration": 1e300}, {"transfer_timeout": "nan"},
		{"handshake_timeout": "+Inf"}, {"handshake_timeout": 1e12}, {"decoder_kv_blocks_ttl": "NaN"}, {"decoder_kv_blocks_ttl": "-inf"},
		{"engine_ttl": "inf"}, {"engine_ttl": "nan"}, {"num_threads": 1.5}, {"num_threads": 1e30}, {"progress_thread_delay_us": 1e18},
		{"backends": []any{}}, {"backends": []any{1}}, {"bidirectional_kv_xfer": 2}, {"transfer_engine": 5},
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
// (TransferParams.readable, Scheduler.readbackable).
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

// Step metadata that announces more than it holds, or nests without end,
// is refused before the msgpack library sees it: it would allocate what a
// header announces (4 GiB from 5 bytes) and recurse into unknown fields
// without a depth limit (a fatal stack overflow). Found by
// FuzzDecodeStepMeta (its worker hung allocating).
func TestStepMetaBoundedDecode(t *testing.T) {
	deep := []byte{0x82, 0xa1, 'v', 0x01, 0xa1, 'x'}
	for i := 0; i < 200000; i++ {
		deep = append(deep, 0x91)
	}
	deep = append(deep, 0xc0)
	// {"v": 1, "m": {"<field>": <header>}}: a known field, so the library
	// decodes (and sizes) it rather than skipping it.
	field := func(name string, header ...byte) []byte {
		b := []byte{0x82, 0xa1, 'v', 0x01, 0xa1, 'm', 0x81, byte(0xa0 | len(name))}
		return append(append(b, name...), header...)
	}
	cases := map[string][]byte{
		"reqs_in_batch: array32 of 4G strings": field("reqs_in_batch", 0xdd, 0xff, 0xff, 0xff, 0xff),
		"reqs_to_send: map32 of 2G pairs":      field("reqs_to_send", 0xdf, 0x7f, 0xff, 0xff, 0xff),
		"reqs_to_recv: array16 header":         field("reqs_to_recv", 0xdc, 0xff, 0xff),
		"array32 of 4G entries":                {0x82, 0xa1, 'v', 0x01, 0xa1, 'x', 0xdd, 0xff, 0xff, 0xff, 0xff},
		"bin32 of 4 GiB":                       {0x82, 0xa1, 'v', 0x01, 0xa1, 'x', 0xc6, 0xff, 0xff, 0xff, 0xf0},
		"ext32 of 3.4 GB":                      {0x82, 0xa1, 'v', 0x01, 0xa1, 'x', 0xc9, 0xc9, 0xc9, 0xc9, 0xc9, 0x01},
		"map32 of 2G pairs":                    {0x82, 0xa1, 'v', 0x01, 0xa1, 'x', 0xdf, 0x7f, 0xff, 0xff, 0xff},
		"200,000 nested arrays":                deep,
		"truncated":                            {0x82, 0xa1, 'v'},
		"trailing bytes":                       append(fzValidStepMeta(t), 0xc0),
	}
	for name, b := range cases {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		m, err := DecodeStepMeta(b)
		runtime.ReadMemStats(&after)
		if err == nil || m != nil {
			t.Errorf("%s: accepted (%v)", name, m)
		}
		if d := after.TotalAlloc - before.TotalAlloc; d > 8<<20 {
			t.Errorf("%s: decoding allocated %d bytes", name, d)
		}
	}
	if _, err := DecodeStepMeta(fzValidStepMeta(t)); err != nil {
		t.Fatalf("valid metadata refused: %v", err)
	}
}

func fzValidStepMeta(t *testing.T) []byte {
	t.Helper()
	m := &StepMeta{ReqsToRecv: map[string]*RecvReq{"r": {LocalBlockIDs: BlockIDs{{1, 2}}, Remote: RemoteMeta{EngineID: "e", BlockIDs: BlockIDs{{3, 4}}}}}}
	b, err := m.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return b
}
