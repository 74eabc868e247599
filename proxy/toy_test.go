package proxy

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestToyRewrites(t *testing.T) {
	tests := []struct {
		description string
		path        string
		body        map[string]any
		// wantPrefill lists fields the prefill copy must have; absent lists
		// fields it must not have.
		wantPrefill map[string]any
		absent      []string
	}{
		{
			description: "completion with every rewritten field",
			path:        "/v1/completions",
			body: map[string]any{"model": "m", "prompt": "hi", "stream": true, "max_tokens": 50.0,
				"stream_options": map[string]any{"include_usage": true}, "min_tokens": 5.0,
				"min_completion_tokens": 3.0, "max_completion_tokens": 40.0, "temperature": 0.0,
				"kv_transfer_params": map[string]any{"client": "own"}, "extra_field": []any{"kept"}},
			wantPrefill: map[string]any{"model": "m", "prompt": "hi", "stream": false, "max_tokens": 1.0,
				"max_completion_tokens": 1.0, "temperature": 0.0, "extra_field": []any{"kept"}},
			absent: []string{"stream_options", "min_tokens", "min_completion_tokens"},
		},
		{
			description: "chat without max_completion_tokens keeps it absent",
			path:        "/v1/chat/completions",
			body: map[string]any{"model": "m", "messages": []any{map[string]any{"role": "user", "content": "hi"}},
				"stream": false},
			wantPrefill: map[string]any{"model": "m", "stream": false, "max_tokens": 1.0,
				"messages": []any{map[string]any{"role": "user", "content": "hi"}}},
			absent: []string{"max_completion_tokens", "stream_options", "min_tokens", "min_completion_tokens"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.description, func(t *testing.T) {
			pf := newFake(t, "p0", prefillHandler("p0"))
			df := newFake(t, "d0", decodeHandler("d0", false))
			r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, nil)
			status, _, _ := r.post(tc.path, tc.body, nil)
			if status != 200 {
				t.Fatalf("status %d, want 200", status)
			}
			preqs, dreqs := pf.requests(), df.requests()
			if len(preqs) != 1 || len(dreqs) != 1 {
				t.Fatalf("prefill got %d requests, decode %d; want 1 each", len(preqs), len(dreqs))
			}
			wantPath := tc.path
			if preqs[0].Path != wantPath || dreqs[0].Path != wantPath {
				t.Errorf("upstream paths %q, %q; want %q", preqs[0].Path, dreqs[0].Path, wantPath)
			}
			pb := preqs[0].Body
			wantKV := map[string]any{"do_remote_decode": true, "do_remote_prefill": false,
				"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
			if !reflect.DeepEqual(pb["kv_transfer_params"], wantKV) {
				t.Errorf("prefill kv_transfer_params = %v, want %v", pb["kv_transfer_params"], wantKV)
			}
			for k, v := range tc.wantPrefill {
				if !reflect.DeepEqual(pb[k], v) {
					t.Errorf("prefill %s = %#v, want %#v", k, pb[k], v)
				}
			}
			for _, k := range tc.absent {
				if _, ok := pb[k]; ok {
					t.Errorf("prefill body still has %s", k)
				}
			}
			if len(pb) != len(tc.wantPrefill)+1 {
				t.Errorf("prefill body has %d fields, want %d: %v", len(pb), len(tc.wantPrefill)+1, pb)
			}
			// The decode instance gets the client's body with only
			// kv_transfer_params replaced by the prefill's.
			want := map[string]any{}
			for k, v := range tc.body {
				want[k] = v
			}
			want["kv_transfer_params"] = prefillParams("p0")
			if jsonOf(t, dreqs[0].Body) != jsonOf(t, want) {
				t.Errorf("decode body\n got %s\nwant %s", jsonOf(t, dreqs[0].Body), jsonOf(t, want))
			}
		})
	}
}

// When the prefill returns no kv_transfer_params, the decode gets the
// client's body — without the client's own kv_transfer_params (they would
// point the decode at engines, addresses and blocks of the client's choice)
// unless ForwardClientKVParams is set; a body without them passes
// byte-for-byte.
func TestToyNoPrefillParamsClientParamsNotForwarded(t *testing.T) {
	for _, kv := range []string{`absent`, `null`, `{}`} {
		for _, forward := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/forward=%v", kv, forward), func(t *testing.T) {
				pf := newFake(t, "p0", func(w http.ResponseWriter, _ *http.Request, _ received) {
					body := `{"id":"x","choices":[]`
					if kv != "absent" {
						body += `,"kv_transfer_params":` + kv
					}
					w.Header().Set("Content-Type", "application/json")
					fmt.Fprint(w, body+"}")
				})
				df := newFake(t, "d0", decodeHandler("d0", false))
				r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) { c.ForwardClientKVParams = forward })
				client := `{"prompt": "a b",   "model":"m", "max_tokens": 7, "kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": "x", "remote_block_ids": [1]}}`
				if status, _, body := r.post("/v1/completions", client, nil); status != 200 {
					t.Fatalf("status %d: %s", status, body)
				}
				got := df.requests()[0]
				if forward {
					if string(got.Raw) != client {
						t.Errorf("decode got %q, want the client's bytes %q", got.Raw, client)
					}
					return
				}
				if _, ok := got.Body["kv_transfer_params"]; ok {
					t.Errorf("client kv_transfer_params reached the decode: %s", got.Raw)
				}
				if got.Body["prompt"] != "a b" || got.Body["max_tokens"] != float64(7) {
					t.Errorf("decode body %s", got.Raw)
				}
				plain := `{"prompt": "a b",   "model":"m", "max_tokens": 7}`
				if status, _, body := r.post("/v1/completions", plain, nil); status != 200 {
					t.Fatalf("status %d: %s", status, body)
				}
				if got := string(df.requests()[1].Raw); got != plain {
					t.Errorf("decode got %q, want the client's bytes %q", got, plain)
				}
			})
		}
	}
}

// The proxy's idle upstream connections close before vLLM's (5 s), so it
// never reuses one the server is closing (a "connection reset by peer" 502).
func TestUpstreamIdleTimeoutBelowVLLMKeepAlive(t *testing.T) {
	const vllmKeepAlive = 5 * time.Second
	if tr := NewTransport(time.Second, time.Second); tr.IdleConnTimeout <= 0 || tr.IdleConnTimeout >= vllmKeepAlive {
		t.Fatalf("default idle timeout %v, want in (0, %v)", tr.IdleConnTimeout, vllmKeepAlive)
	}
	p, err := New(Config{Prefill: []Instance{{"h", 1}}, Decode: []Instance{{"h", 2}}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for in, c := range p.clients {
		if lp := c.(*leanPool); lp.idleTimeout <= 0 || lp.idleTimeout >= vllmKeepAlive {
			t.Errorf("%s: idle timeout %v", in, lp.idleTimeout)
		}
	}
	p2, err := New(Config{Prefill: []Instance{{"h", 1}}, Decode: []Instance{{"h", 2}}, UpstreamIdleTimeout: 1500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer p2.Close()
	for _, c := range p2.clients {
		if lp := c.(*leanPool); lp.idleTimeout != 1500*time.Millisecond {
			t.Errorf("configured idle timeout not applied: %v", lp.idleTimeout)
		}
	}
}

func TestToyHeaders(t *testing.T) {
	tests := []struct {
		description string
		apiKey      string
		clientHdr   map[string]string
		wantAuth    string
		wantReqID   string // "" means generated
	}{
		{"api key set, client id kept", "sk-test", map[string]string{"X-Request-Id": "abc", "Authorization": "Bearer client"}, "Bearer sk-test", "abc"},
		{"no key: client's Authorization forwarded", "", map[string]string{"Authorization": "Bearer client"}, "Bearer client", ""},
		{"no key, no client auth", "", nil, "", ""},
	}
	for _, tc := range tests {
		t.Run(tc.description, func(t *testing.T) {
			pf := newFake(t, "p0", prefillHandler("p0"))
			df := newFake(t, "d0", decodeHandler("d0", false))
			r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) {
				c.APIKey = tc.apiKey
				c.NewRequestID = func() string { return "generated-id" }
			})
			if status, _, _ := r.post("/v1/completions", map[string]any{"prompt": "x"}, tc.clientHdr); status != 200 {
				t.Fatalf("status %d", status)
			}
			want := tc.wantReqID
			if want == "" {
				want = "generated-id"
			}
			for _, rec := range []received{pf.requests()[0], df.requests()[0]} {
				if got := rec.Header.Get("Authorization"); got != tc.wantAuth {
					t.Errorf("Authorization = %q, want %q", got, tc.wantAuth)
				}
				if got := rec.Header.Get("X-Request-Id"); got != want {
					t.Errorf("X-Request-Id = %q, want %q", got, want)
				}
				if got := rec.Header.Get("Content-Type"); got != "application/json" {
					t.Errorf("Content-Type = %q", got)
				}
			}
		})
	}
}

func TestNewUUIDIsVersion4(t *testing.T) {
	seen := map[string]bool{}
	for i := 0; i < 100; i++ {
		u := newUUID()
		if len(u) != 36 || u[14] != '4' || !strings.ContainsRune("89ab", rune(u[19])) || seen[u] {
			t.Fatalf("bad or repeated UUID %q", u)
		}
		seen[u] = true
	}
}

func TestRoundRobinIndependentPerRole(t *testing.T) {
	var ps, ds []*fakeOpenAI
	for i := 0; i < 2; i++ {
		ps = append(ps, newFake(t, fmt.Sprintf("p%d", i), prefillHandler(fmt.Sprintf("p%d", i))))
	}
	for i := 0; i < 3; i++ {
		ds = append(ds, newFake(t, fmt.Sprintf("d%d", i), decodeHandler(fmt.Sprintf("d%d", i), false)))
	}
	for _, mode := range []Mode{ModeToy, ModeMultiturn} {
		t.Run(mode.String(), func(t *testing.T) {
			r := newRig(t, ps, ds, func(c *Config) { c.Mode = mode })
			base := make([]int, 5)
			for i, f := range append(append([]*fakeOpenAI{}, ps...), ds...) {
				base[i] = len(f.requests())
			}
			const n = 7
			for i := 0; i < n; i++ {
				if status, _, _ := r.post("/v1/completions", map[string]any{"prompt": "x", "seq": i}, nil); status != 200 {
					t.Fatalf("request %d: status %d", i, status)
				}
			}
			check := func(role string, fakes []*fakeOpenAI, off int) {
				for idx, f := range fakes {
					var seqs []int
					for _, rec := range f.requests()[base[off+idx]:] {
						seqs = append(seqs, int(rec.Body["seq"].(float64)))
					}
					var want []int
					for i := idx; i < n; i += len(fakes) {
						want = append(want, i)
					}
					if !reflect.DeepEqual(seqs, want) {
						t.Errorf("%s instance %d got requests %v, want %v", role, idx, seqs, want)
					}
				}
			}
			check("prefill", ps, 0)
			check("decode", ds, 2)
		})
	}
}

// TestToyStreamingPassThrough checks that the proxy relays server-sent events
// as they arrive: the fake decode instance does not finish its stream until
// the client has already received the first event through the proxy. A proxy
// that buffered would never deliver it, and the wait would run out.
func TestToyStreamingPassThrough(t *testing.T) {
	release := make(chan struct{})
	upstreamDone := make(chan struct{})
	first := "data: {\"choices\":[{\"text\":\"one\"}]}\n\n"
	rest := "data: {\"choices\":[{\"text\":\"two\"}]}\n\ndata: [DONE]\n\n"
	pf := newFake(t, "p0", prefillHandler("p0"))
	df := newFake(t, "d0", func(w http.ResponseWriter, r *http.Request, _ received) {
		defer close(upstreamDone)
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, first)
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		fmt.Fprint(w, rest)
	})
	r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, nil)

	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.srv.URL+"/v1/completions",
		strings.NewReader(`{"prompt":"x","stream":true}`))
	resp, err := r.srv.Client().Do(req)
	if err != nil {
		t.Fatalf("POST: %v", err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Errorf("Content-Type %q, want the upstream's text/event-stream", ct)
	}
	got := make([]byte, len(first))
	if _, err := io.ReadFull(resp.Body, got); err != nil {
		t.Fatalf("first event never arrived before the upstream finished: %v", err)
	}
	select {
	case <-upstreamDone:
		t.Fatal("upstream finished before the client read the first event")
	default:
	}
	if string(got) != first {
		t.Errorf("first event %q, want %q", got, first)
	}
	close(release)
	tail, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the rest: %v", err)
	}
	if string(tail) != rest {
		t.Errorf("rest of stream %q, want %q", tail, rest)
	}
}

// Many concurrent streams through one proxy all complete intact.
func TestToyConcurrentStreams(t *testing.T) {
	pf := newFake(t, "p0", prefillHandler("p0"))
	df := newFake(t, "d0", decodeHandler("d0", false))
	r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, nil)
	want := ""
	for _, c := range sseChunks("d0", false, false) {
		want += "data: " + c + "\n\n"
	}
	want += "data: [DONE]\n\n"
	const n = 64
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		go func() {
			resp, err := r.srv.Client().Post(r.srv.URL+"/v1/completions", "application/json",
				strings.NewReader(`{"prompt":"x","stream":true}`))
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			b, err := io.ReadAll(bufio.NewReader(resp.Body))
			if err == nil && (resp.StatusCode != 200 || string(b) != want) {
				err = fmt.Errorf("status %d body %q", resp.StatusCode, b)
			}
			errs <- err
		}()
	}
	for i := 0; i < n; i++ {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	if got := r.metric(MetricRequests, map[string]string{"route": "completions", "code": "200"}); got != n {
		t.Errorf("%s{code=200} = %v, want %d", MetricRequests, got, n)
	}
}

func TestHealthcheckAndModels(t *testing.T) {
	pf := newFake(t, "p0", prefillHandler("p0"))
	df := newFake(t, "d0", func(w http.ResponseWriter, r *http.Request, _ received) {
		writeTestJSON(w, 200, map[string]any{"object": "list", "data": []any{map[string]any{"id": "m"}}})
	})
	r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df, df}, nil)
	status, body := r.get("/healthcheck")
	want := map[string]any{"status": "ok", "prefill_instances": 1.0, "decode_instances": 2.0}
	if status != 200 || !reflect.DeepEqual(body, want) {
		t.Errorf("/healthcheck = %d %v, want 200 %v", status, body, want)
	}
	status, body = r.get("/v1/models")
	if status != 200 || body["object"] != "list" {
		t.Errorf("/v1/models = %d %v", status, body)
	}
	if got := df.requests(); len(got) != 1 || got[0].Path != "/v1/models" {
		t.Errorf("decode got %v, want one GET /v1/models", got)
	}
	resp, err := r.srv.Client().Get(r.srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, name := range []string{MetricUpstreamLatency, MetricInflight, MetricCacheEntries} {
		if !strings.Contains(string(b), name) {
			t.Errorf("/metrics lacks %s", name)
		}
	}
	// Only POST is routed for completions.
	if status, _ := r.get("/v1/completions"); status != http.StatusMethodNotAllowed {
		t.Errorf("GET /v1/completions = %d, want 405", status)
	}
}

func TestConfigErrors(t *testing.T) {
	ok := []Instance{{Host: "h", Port: 1}}
	tests := []struct {
		description string
		cfg         Config
		want        string
	}{
		{"no prefill", Config{Decode: ok}, "prefill instance is required"},
		{"no decode", Config{Prefill: ok}, "decode instance is required"},
		{"bad port", Config{Prefill: []Instance{{Host: "h", Port: 70000}}, Decode: ok}, "out of range"},
		{"empty host", Config{Prefill: ok, Decode: []Instance{{Port: 1}}}, "empty host"},
		{"bad reuse mode", Config{Prefill: ok, Decode: ok, ReuseMode: "sideways"}, "reuse mode"},
		{"negative ttl", Config{Prefill: ok, Decode: ok, CacheTTL: -1}, "negative"},
	}
	for _, tc := range tests {
		t.Run(tc.description, func(t *testing.T) {
			_, err := New(tc.cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("New error %v, want one containing %q", err, tc.want)
			}
		})
	}
	if _, err := Pair("prefiller", []string{"a", "b"}, []int{1}); err == nil ||
		!strings.Contains(err.Error(), "number of prefiller hosts (2) must match number of prefiller ports (1)") {
		t.Errorf("Pair mismatch error = %v", err)
	}
}

func TestBadClientBodies(t *testing.T) {
	pf := newFake(t, "p0", prefillHandler("p0"))
	df := newFake(t, "d0", decodeHandler("d0", false))
	r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) { c.MaxBodyBytes = 1024 })
	for _, tc := range []struct {
		body string
		want int
	}{
		{"not json", 400},
		{"null", 400},
		{"[1,2]", 400},
		{`{"prompt":"` + strings.Repeat("x", 2000) + `"}`, 413},
	} {
		status, _, body := r.post("/v1/completions", tc.body, nil)
		if status != tc.want {
			t.Errorf("body %.20q: status %d, want %d", tc.body, status, tc.want)
			continue
		}
		errorOf(t, body)
	}
	if n := len(pf.requests()) + len(df.requests()); n != 0 {
		t.Errorf("upstreams got %d requests for bad bodies, want 0", n)
	}

}
