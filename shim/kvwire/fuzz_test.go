package kvwire

import (
	"encoding/hex"
	"encoding/json"
	"math"
	"reflect"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// Fuzz targets of the decoders that read peer or client input (step
// metadata comes from this engine's own scheduler, but through vLLM's
// pickling; kv_transfer_params from HTTP clients; notifications and push
// registrations from peers), each with a committed corpus in testdata/fuzz.
// ./build.sh fuzz runs each for GONIXL_FUZZTIME.

// fzStepMetas returns valid metadata and edge cases.
func fzStepMetas(tb testing.TB) [][]byte {
	exp := 1234.5
	full := &StepMeta{
		ReqsToRecv: map[string]*RecvReq{
			"req-d": {LocalBlockIDs: BlockIDs{{7, 8, 9}}, LocalNumComputed: []int64{0}, TPSize: 1, DCPSize: 1, PPSize: 1, AwaitingKVs: true,
				Remote: RemoteMeta{BlockIDs: BlockIDs{{3, 4, 5}}, Host: "127.0.0.1", Port: 5600, EngineID: "engine-p", RequestID: "req-p", Expiry: &exp, NumTokens: 12}},
			"notify-only": {TPSize: 1, DCPSize: 1, PPSize: 1, Remote: RemoteMeta{BlockIDs: BlockIDs{{1}}, EngineID: "engine-p", RequestID: "r2"}},
			"push":        {LocalBlockIDs: BlockIDs{{2}}, TPSize: 1, Push: true, PromptDigest: "blake2b-128:00", Remote: RemoteMeta{EngineID: "p", RequestID: "c-1"}},
		},
		ReqsToSend:       map[string]float64{"req-p": 1030},
		SchedulerClock:   1000,
		ReqsInBatch:      []string{"req-p"},
		ReqsNotProcessed: []string{"req-x"},
		Heartbeats: map[string]*HeartbeatInfo{"engine-p": {ReqIDs: []string{"req-p"}, Expiry: map[string]float64{"req-p": 1030},
			Host: "127.0.0.1", Port: 5600, TPSize: 1, DCPSize: 1, PPSize: 1}},
		PushFinished:  map[string]*PushFinished{"f": {Blocks: BlockIDs{{1, 2}}, PromptDigest: "d"}},
		PushEarly:     map[string]*PushFinished{"e": {Blocks: BlockIDs{{3}}}},
		PushAborted:   []string{"a"},
		PushPreempted: []string{"q"},
	}
	var out [][]byte
	for _, m := range []*StepMeta{full, {}, {ReqsToRecv: map[string]*RecvReq{"a": {LocalBlockIDs: BlockIDs{{}, {1, 2}}, Remote: RemoteMeta{BlockIDs: BlockIDs{{0}, {5, 6}}}}}}} {
		b, err := m.Encode()
		if err != nil {
			tb.Fatal(err)
		}
		out = append(out, b)
	}
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
	exp := 1030.5
	own, err := json.Marshal(OutParams{DoRemotePrefill: true, RemoteBlockIDs: BlockIDs{{3, 4, 5}}, RemoteEngineID: "p", RemoteRequestID: "req-1",
		RemoteHost: "127.0.0.1", RemotePort: 5600, TPSize: 1, DCPSize: 1, PPSize: 1, RemoteNumTokens: 12, RemoteExpiry: &exp, TransferMode: "pull"})
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
		`{"do_remote_decode": true, "gonixl_expiry_unix": 1.7e9, "gonixl_readback_tokens": 64, "gonixl_prompt_digest": "blake2b-128:00"}`,
		`{"gonixl_expiry_unix": -1}`, `{"gonixl_expiry_unix": "x"}`, `{"gonixl_readback_tokens": -2}`, `{"gonixl_prompt_digest": 7}`,
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
		out := OutParams{DoRemotePrefill: p.DoRemotePrefill, DoRemoteDecode: p.DoRemoteDecode, RemoteBlockIDs: p.RemoteBlockIDs,
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

// fzDigestParams is a pull decode's params with KV digests of n blocks in
// the form the Python connector sends them (compact, keys in its order).
func fzDigestParams(tb testing.TB, n int) []byte {
	tb.Helper()
	ids := make([]int64, n)
	blocks := make([]uint64, n)
	for i := range ids {
		ids[i] = int64(5 * i)
		blocks[i] = uint64(i+1) * 0x9e3779b97f4a7c15
	}
	d, err := json.Marshal(KVDigest{Alg: KVDigestAlg, Tokens: int64(16*n - 3), First: []int64{0},
		Ranks: []RankDigest{{Blocks: [][]uint64{blocks}, Regions: [][]uint64{{1, 2, 3}}}}})
	if err != nil {
		tb.Fatal(err)
	}
	idj, _ := json.Marshal([][]int64{ids})
	return []byte(`{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":` + string(idj) +
		`,"remote_engine_id":"engine-p","remote_request_id":"cmpl-7-0","remote_host":"127.0.0.1","remote_port":5600,` +
		`"tp_size":1,"remote_num_tokens":` + strconv.Itoa(16*n-3) + `,"remote_blocks_expiry_time":1764990000.25,` +
		`"gonixl_prompt_digest":"blake2b-128:00ff","gonixl_instance":"a1b2","gonixl_kv_digest":` + string(d) + `}`)
}

// FuzzParseTransferParamsScan holds the scanner (params_scan.go) to
// encoding/json: every input parses to the same params, or fails with the
// same error, whichever path read it.
func FuzzParseTransferParamsScan(f *testing.F) {
	full := string(fzDigestParams(f, 4))
	for _, seed := range []string{
		full, strings.ReplaceAll(full, ",", " ,\n\t "), strings.ReplaceAll(full, `"alg"`, `"ALG"`),
		strings.ReplaceAll(full, `"blocks"`, `"Blocks"`), strings.Replace(full, `"tokens"`, `"x":[{"y":null}],"tokens"`, 1),
		strings.Replace(full, `"first":[0]`, `"first":[-1]`, 1), strings.Replace(full, `"first":[0]`, `"first":null`, 1),
		strings.Replace(full, `"first":[0]`, `"first":[]`, 1), strings.Replace(full, `"ranks":[`, `"ranks":[{},`, 1),
		strings.Replace(full, `"regions":[`, `"regions":["=",`, 1), strings.Replace(full, `"tokens":61`, `"tokens":61.0`, 1),
		strings.Replace(full, `"alg":"xxh3-64"`, `"alg":"xxh3\u002d64"`, 1), strings.Replace(full, `"alg":"xxh3-64",`, ``, 1),
		strings.Replace(full, `"ranks":[{`, `"ranks":[{"blocks":[],`, 1), full[:len(full)-1],
		full + " ", full + "x", " " + full, `{"remote_engine_id":"e\u0041"}`, `{"remote_engine_id":"\u00e9\ud800"}`,
		"{\"remote_engine_id\":\"\xff\"}", "{\"remote_engine_id\":\"h\u00e9\"}", "{\"\xc3\xa9\":1}", `{"remote_\u0065ngine_id":"e"}`,
		`{"remote_engine_id":"a","remote_engine_id":"b"}`, `{"x":1,"x":2}`, `{"remote_port":5600.0}`, `{"remote_port":-0}`,
		`{"remote_port":"5600"}`, `{"remote_port":1e2}`, `{"remote_port":01}`, `{"remote_port":-}`, `{"remote_port":9223372036854775808}`,
		`{"remote_blocks_expiry_time":1e999}`, `{"remote_blocks_expiry_time":-0.0}`, `{"remote_blocks_expiry_time":"1"}`,
		`{"gonixl_expiry_unix":1.5E+9}`, `{"remote_block_ids":[[1,2],[],[3]]}`, `{"remote_block_ids":[]}`, `{"remote_block_ids":[[]]}`,
		`{"remote_block_ids":[[1],null]}`, `{"remote_block_ids":[[1],2]}`, `{"remote_block_ids":[1,[2]]}`, `{"remote_block_ids":[ [ 1 , 2 ] ]}`,
		`{"remote_block_ids":[1.0]}`, `{"remote_block_ids":[-0]}`, `{"remote_block_ids":[-1]}`, `{"do_remote_prefill":tru}`,
		`{"do_remote_prefill":null,"tp_size":null,"dcp_size":null,"gonixl_readback_tokens":null}`, `{"a":[1,{"b":[true,false,null,"\\"]}]}`,
		`{"a":"\x"}`, `{"a":"` + "\x01" + `"}`, `{"a":` + strings.Repeat("[", 80) + strings.Repeat("]", 80) + `}`, `{}`, ` {}`, `{"a":1,}`,
		`{,}`, `{"a" 1}`, `[1]`, `null`, ` null`, `{"a":{"b":1,}}`, `{"a":[1,]}`, `{"a":"\u12"}`, `{"a":1}{}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got, gotErr := parseParams(data, true)
		want, wantErr := parseParams(data, false)
		if (gotErr == nil) != (wantErr == nil) || (gotErr != nil && gotErr.Error() != wantErr.Error()) {
			t.Fatalf("%q: scanned error %v, encoding/json's %v", data, gotErr, wantErr)
		}
		if (got == nil) != (want == nil) {
			t.Fatalf("%q: scanned %+v, encoding/json's %+v", data, got, want)
		}
		if got == nil {
			return
		}
		if (got.KVDigestErr == nil) != (want.KVDigestErr == nil) ||
			(got.KVDigestErr != nil && got.KVDigestErr.Error() != want.KVDigestErr.Error()) {
			t.Fatalf("%q: digest error %v, encoding/json's %v", data, got.KVDigestErr, want.KVDigestErr)
		}
		g, w := *got, *want
		g.KVDigestErr, w.KVDigestErr = nil, nil
		if !reflect.DeepEqual(g, w) {
			t.Fatalf("%q:\nscanned        %+v\nencoding/json  %+v", data, g, w)
		}
	})
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

// FuzzDecodePushReg: a registration (PUSH_REG:, and GONIXL_PUSH_CANCEL:'s
// body) from a decode is accepted only within its bounds, and an accepted
// one re-encodes to a registration that decodes to itself.
func FuzzDecodePushReg(f *testing.F) {
	good, _ := hex.DecodeString(vllmPushReg)
	f.Add(good[len(PushRegPrefix):])
	f.Add(mustMsgpack(f, map[string]any{"request_id": "r", "decode_engine_id": "D", "decode_host": "h", "decode_port": 1, "decode_tp_size": 1,
		"local_block_ids": []any{5, 6}, KeyPromptDigest: "blake2b-128:00"}))
	f.Add(mustMsgpack(f, map[string]any{"request_id": "r", "decode_engine_id": "D", "decode_host": "h", "decode_port": 70000, "decode_tp_size": 1, "local_block_ids": []any{}}))
	f.Add([]byte{0x8b, 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodePushReg(b)
		if (r == nil) == (err == nil) {
			t.Fatalf("value %v with error %v", r, err)
		}
		if err != nil {
			return
		}
		switch {
		case r.RequestID == "" || r.DecodeEngineID == "" || r.DecodeHost == "":
			t.Fatalf("empty identity accepted: %+v", r)
		case r.DecodePort < 1 || r.DecodePort > 65535 || r.DecodeTPSize < 1:
			t.Fatalf("out-of-range port or tp_size accepted: %+v", r)
		case len(r.PromptDigest) > 256:
			t.Fatalf("digest of %d bytes accepted", len(r.PromptDigest))
		}
		for _, g := range r.LocalBlockIDs {
			for _, id := range g {
				if id < 0 || id > math.MaxInt32 {
					t.Fatalf("block id %d accepted", id)
				}
			}
		}
		enc, err := EncodePushReg(r)
		if err != nil {
			t.Fatalf("accepted registration does not re-encode: %v", err)
		}
		r2, err := DecodePushReg(enc[len(PushRegPrefix):])
		if err != nil {
			t.Fatalf("re-encoded registration does not decode: %v", err)
		}
		if r2.RequestID != r.RequestID || r2.DecodeEngineID != r.DecodeEngineID || r2.DecodeHost != r.DecodeHost || r2.DecodePort != r.DecodePort ||
			r2.PromptDigest != r.PromptDigest || !reflect.DeepEqual(fzNormIDs(r2.LocalBlockIDs), fzNormIDs(r.LocalBlockIDs)) {
			t.Fatalf("registration does not round-trip:\n%+v\n%+v", r, r2)
		}
	})
}

// FuzzParseNotif: every notification a worker receives goes through
// ParseNotif and ParsePushWord; what they accept is what the formatters
// write.
func FuzzParseNotif(f *testing.F) {
	for _, s := range []string{"cmpl-1:x:2", "HB:a,b", "HB:", "req:0", "req:-1", "r:1.5", ":3", "GONIXL_PUSH_FAILED:r-1", "GONIXL_PUSH_CANCELLED:",
		"PUSH_REG:\x8b", "req:99999999999999999999", "a:b:c:1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, msg string) {
		if n, ok := ParseNotif(msg); ok {
			var back string
			if n.Heartbeat {
				back = string(HeartbeatNotif(n.IDs))
			} else {
				if n.Consumers <= 0 {
					t.Fatalf("%q: %d consumers accepted", msg, n.Consumers)
				}
				back = string(DoneNotif(n.ReqID, n.Consumers))
			}
			if n2, ok := ParseNotif(back); !ok || !reflect.DeepEqual(n, n2) {
				t.Fatalf("%q parsed as %+v, formatted as %q, parsed back as %+v %v", msg, n, back, n2, ok)
			}
		}
		id, w := ParsePushWord(msg)
		switch w {
		case PushFailed:
			if PushFailedPrefix+id != msg {
				t.Fatalf("%q: FAILED for %q", msg, id)
			}
		case PushCancelled:
			if PushCancelledPrefix+id != msg {
				t.Fatalf("%q: CANCELLED for %q", msg, id)
			}
		case PushCompleted:
			if id == "" || !strings.HasPrefix(msg, id+":") {
				t.Fatalf("%q: completion of %q", msg, id)
			}
		}
	})
}

// The params the Python connector sends are read by the scanner, digest
// and block lists included: were they left to encoding/json, nothing
// would fail but the first parse of every request would be slow again.
func TestParamsScanReadsThePlainForm(t *testing.T) {
	data := fzDigestParams(t, 32)
	fields, ok := scanObject(data)
	if !ok {
		t.Fatal("the plain form was not scanned")
	}
	raw := rawParams{fields: fields, scanned: true}
	ids, _ := raw.get("remote_block_ids")
	if _, ok := plainBlockIDs(ids); !ok {
		t.Fatalf("block ids %s not read by the scanner", ids)
	}
	d, _ := raw.get(KeyKVDigest)
	var kd kvDigestJSON
	if !plainKVDigest(d, &kd) || len(kd.Ranks) != 1 || len(kd.Ranks[0].Blocks) != 1 {
		t.Fatalf("digest %s not read by the scanner: %+v", d, kd)
	}
	p, err := ParseTransferParams(data)
	if err != nil || p.KVDigest == nil || p.KVDigestErr != nil || len(p.RemoteBlockIDs[0]) != 32 || p.RemotePort != 5600 {
		t.Fatalf("%+v %v", p, err)
	}
}
