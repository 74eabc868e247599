package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// waitLimit bounds every wait in these tests: a wait that runs out is a
// failure ("never happened"), not a measurement.
const waitLimit = 10 * time.Second

// received is one request a fake OpenAI server got.
type received struct {
	Path   string
	Header http.Header
	Raw    []byte
	Body   map[string]any
}

// fakeOpenAI is an httptest server standing in for a vLLM OpenAI server. It
// records every request; handle decides the answer (nil: the default
// prefill or decode behaviour).
type fakeOpenAI struct {
	name   string
	srv    *httptest.Server
	handle func(w http.ResponseWriter, r *http.Request, rec received)

	mu   sync.Mutex
	reqs []received
}

func newFake(t *testing.T, name string, handle func(w http.ResponseWriter, r *http.Request, rec received)) *fakeOpenAI {
	t.Helper()
	f := &fakeOpenAI{name: name, handle: handle}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		raw, _ := io.ReadAll(r.Body)
		rec := received{Path: r.URL.Path, Header: r.Header.Clone(), Raw: raw}
		_ = json.Unmarshal(raw, &rec.Body)
		f.mu.Lock()
		f.reqs = append(f.reqs, rec)
		f.mu.Unlock()
		f.handle(w, r, rec)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeOpenAI) port() int {
	_, p, _ := net.SplitHostPort(f.srv.Listener.Addr().String())
	n, _ := strconv.Atoi(p)
	return n
}

// instance names the fake by a host name of its own ("<name>.test"), which
// testTransport resolves to loopback, so that remote_host rewrites can be told
// apart.
func (f *fakeOpenAI) instance() Instance { return Instance{Host: f.name + ".test", Port: f.port()} }

func (f *fakeOpenAI) requests() []received {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]received(nil), f.reqs...)
}

// testDial dials "*.test" host names on 127.0.0.1.
func testDial(ctx context.Context, network, addr string) (net.Conn, error) {
	host, port, err := net.SplitHostPort(addr)
	if err == nil && strings.HasSuffix(host, ".test") {
		addr = net.JoinHostPort("127.0.0.1", port)
	}
	return (&net.Dialer{Timeout: 2 * time.Second}).DialContext(ctx, network, addr)
}

// testTransport is net/http's transport over testDial.
func testTransport() *http.Transport {
	tr := NewTransport(2*time.Second, 0)
	tr.DialContext = testDial
	return tr
}

// rigTransport, when set, makes newRig's proxies use net/http with it
// instead of the lean upstream client (TestNetHTTPUpstream).
var rigTransport func() http.RoundTripper

// prefillParams are the kv_transfer_params a fake prefill instance returns.
func prefillParams(name string) map[string]any {
	return map[string]any{
		"do_remote_prefill": true,
		"do_remote_decode":  false,
		"remote_block_ids":  []any{1.0, 2.0, 3.0},
		"remote_engine_id":  "engine-" + name,
		"remote_request_id": "req-" + name,
		"remote_host":       "10.0.0.99",
		"remote_port":       5600.0,
		"tp_size":           1.0,
	}
}

// decodeParams are the kv_transfer_params a fake decode instance returns at
// the end of a turn (bidirectional mode).
func decodeParams(name string) map[string]any {
	return map[string]any{
		"do_remote_prefill":         false,
		"do_remote_decode":          true,
		"remote_block_ids":          []any{7.0, 8.0},
		"remote_engine_id":          "engine-" + name,
		"remote_request_id":         "req-" + name,
		"remote_host":               "10.0.0.98",
		"remote_port":               5700.0,
		"remote_num_tokens":         20.0,
		"remote_blocks_expiry_time": 1234.5,
	}
}

// prefillHandler answers like a vLLM prefill instance with kv_transfer_params.
func prefillHandler(name string) func(http.ResponseWriter, *http.Request, received) {
	return func(w http.ResponseWriter, _ *http.Request, rec received) {
		writeTestJSON(w, 200, map[string]any{
			"id": "cmpl-" + name, "object": "text_completion", "model": rec.Body["model"],
			"choices":            []any{map[string]any{"index": 0, "text": "x", "finish_reason": "length"}},
			"kv_transfer_params": prefillParams(name),
		})
	}
}

// decodeHandler answers like a vLLM decode instance: JSON unless asked to
// stream, with kv_transfer_params when withKV (vLLM 0.32 sends them only
// there); SSE when asked to stream, whose final chunk carries
// kv_transfer_params when withKV (as a vLLM that sends them in streams would).
func decodeHandler(name string, withKV bool) func(http.ResponseWriter, *http.Request, received) {
	return func(w http.ResponseWriter, _ *http.Request, rec received) {
		_, chat := rec.Body["messages"]
		if rec.Body["stream"] != true {
			body := map[string]any{"id": "cmpl-" + name, "object": "text_completion", "model": "m-" + name, "choices": []any{
				map[string]any{"index": 0, "text": "hello world", "finish_reason": "stop"}}}
			if withKV {
				body["kv_transfer_params"] = decodeParams(name)
			}
			writeTestJSON(w, 200, body)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
		for _, c := range sseChunks(name, chat, withKV) {
			fmt.Fprintf(w, "data: %s\n\n", c)
			w.(http.Flusher).Flush()
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	}
}

// sseChunks is the stream a fake decode instance sends: "hello", " world",
// then a finish chunk.
func sseChunks(name string, chat, withKV bool) []string {
	piece := func(s string) map[string]any {
		if chat {
			return map[string]any{"index": 0, "delta": map[string]any{"content": s}, "finish_reason": nil}
		}
		return map[string]any{"index": 0, "text": s, "finish_reason": nil}
	}
	var out []string
	for _, s := range []string{"hello", " world"} {
		b, _ := json.Marshal(map[string]any{"id": "chatcmpl-" + name, "model": "m-" + name, "created": 1700000000,
			"choices": []any{piece(s)}})
		out = append(out, string(b))
	}
	last := map[string]any{"id": "chatcmpl-" + name, "model": "m-" + name, "created": 1700000000,
		"choices": []any{map[string]any{"index": 0, "text": "", "delta": map[string]any{}, "finish_reason": "length"}}}
	if withKV {
		last["kv_transfer_params"] = decodeParams(name)
	}
	b, _ := json.Marshal(last)
	return append(out, string(b))
}

func writeTestJSON(w http.ResponseWriter, status int, v any) {
	b, _ := json.Marshal(v)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// rig is a proxy in front of fake instances.
type rig struct {
	t       *testing.T
	p       *Proxy
	srv     *httptest.Server
	prefill []*fakeOpenAI
	decode  []*fakeOpenAI
	reg     *prometheus.Registry
	now     time.Time
	nowMu   sync.Mutex
}

func (r *rig) clock() time.Time { r.nowMu.Lock(); defer r.nowMu.Unlock(); return r.now }

func (r *rig) advance(d time.Duration) { r.nowMu.Lock(); r.now = r.now.Add(d); r.nowMu.Unlock() }

// newRig starts a proxy over the given fakes; mod adjusts the config.
func newRig(t *testing.T, prefill, decode []*fakeOpenAI, mod func(*Config)) *rig {
	t.Helper()
	r := &rig{t: t, prefill: prefill, decode: decode, reg: prometheus.NewRegistry(),
		now: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	cfg := Config{DialContext: testDial, Registry: r.reg, Clock: r.clock, UpstreamTimeout: waitLimit}
	if rigTransport != nil {
		cfg.Transport = rigTransport()
	}
	for _, f := range prefill {
		cfg.Prefill = append(cfg.Prefill, f.instance())
	}
	for _, f := range decode {
		cfg.Decode = append(cfg.Decode, f.instance())
	}
	if mod != nil {
		mod(&cfg)
	}
	p, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	r.p = p
	r.srv = httptest.NewServer(p)
	t.Cleanup(func() { r.srv.Close(); p.Close() })
	return r
}

// post sends body to the proxy and returns status, headers and body.
func (r *rig) post(path string, body any, hdr map[string]string) (int, http.Header, []byte) {
	r.t.Helper()
	var raw []byte
	switch b := body.(type) {
	case []byte:
		raw = b
	case string:
		raw = []byte(b)
	default:
		raw, _ = json.Marshal(b)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.srv.URL+path, strings.NewReader(string(raw)))
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := r.srv.Client().Do(req)
	if err != nil {
		r.t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		r.t.Fatalf("POST %s: reading body: %v", path, err)
	}
	return resp.StatusCode, resp.Header, out
}

func (r *rig) get(path string) (int, map[string]any) {
	r.t.Helper()
	resp, err := r.srv.Client().Get(r.srv.URL + path)
	if err != nil {
		r.t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	var m map[string]any
	b, _ := io.ReadAll(resp.Body)
	_ = json.Unmarshal(b, &m)
	return resp.StatusCode, m
}

// metric returns the value of a counter or gauge series (0 when absent).
func (r *rig) metric(name string, labels map[string]string) float64 {
	r.t.Helper()
	mfs, err := r.reg.Gather()
	if err != nil {
		r.t.Fatalf("gather: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, lp := range m.GetLabel() {
				got[lp.GetName()] = lp.GetValue()
			}
			if !labelsMatch(got, labels) {
				continue
			}
			switch {
			case m.Counter != nil:
				return m.Counter.GetValue()
			case m.Gauge != nil:
				return m.Gauge.GetValue()
			case m.Histogram != nil:
				return float64(m.Histogram.GetSampleCount())
			}
		}
	}
	return 0
}

func labelsMatch(got, want map[string]string) bool {
	for k, v := range want {
		if got[k] != v {
			return false
		}
	}
	return true
}

// jsonOf re-encodes v canonically, for comparing JSON values.
func jsonOf(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatalf("marshal: %v", err)
	}
	return string(b)
}

// errorCode returns the "code" of an OpenAI-style error body.
func errorOf(t *testing.T, body []byte) map[string]any {
	t.Helper()
	var e struct {
		Error map[string]any `json:"error"`
	}
	if err := json.Unmarshal(body, &e); err != nil || e.Error == nil {
		t.Fatalf("body %q is not an OpenAI-style JSON error: %v", body, err)
	}
	return e.Error
}
