package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

func chatBody(conv string, stream bool, extra map[string]any) map[string]any {
	b := map[string]any{"model": "m", "messages": []any{map[string]any{"role": "user", "content": "hi"}},
		"stream": stream, "max_tokens": 16.0}
	if conv != "" {
		b["conversation_id"] = conv
	}
	for k, v := range extra {
		b[k] = v
	}
	return b
}

func multiturnRig(t *testing.T, mod func(*Config)) (*rig, *fakeOpenAI, *fakeOpenAI) {
	pf := newFake(t, "p0", prefillHandler("p0"))
	df := newFake(t, "d0", decodeHandler("d0", true))
	r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) {
		c.Mode = ModeMultiturn
		if mod != nil {
			mod(c)
		}
	})
	return r, pf, df
}

func emptyParams() map[string]any {
	return map[string]any{"do_remote_decode": true, "do_remote_prefill": false,
		"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
}

func TestMultiturnRewrites(t *testing.T) {
	r, pf, df := multiturnRig(t, nil)
	body := chatBody("conv-1", true, map[string]any{"stream_options": map[string]any{"include_usage": true},
		"min_tokens": 2.0, "max_completion_tokens": 9.0, "min_completion_tokens": 1.0, "top_p": 0.5})
	if status, _, b := r.post("/v1/chat/completions", body, nil); status != 200 {
		t.Fatalf("status %d: %s", status, b)
	}
	pb, db := pf.requests()[0].Body, df.requests()[0].Body
	for _, rb := range []map[string]any{pb, db} {
		if _, ok := rb["conversation_id"]; ok {
			t.Errorf("conversation_id forwarded upstream: %v", rb)
		}
	}
	// Prefill: one token, no stream, and the reference's field removals.
	if !reflect.DeepEqual(pb["kv_transfer_params"], emptyParams()) {
		t.Errorf("prefill kv_transfer_params = %v on a first turn", pb["kv_transfer_params"])
	}
	if pb["stream"] != false || pb["max_tokens"] != 1.0 || pb["top_p"] != 0.5 || pb["min_completion_tokens"] != 1.0 {
		t.Errorf("prefill body %v", pb)
	}
	for _, k := range []string{"max_completion_tokens", "min_tokens", "stream_options"} {
		if _, ok := pb[k]; ok {
			t.Errorf("prefill body still has %s", k)
		}
	}
	// Decode: the client's request, streamed, with the prefill's params whose
	// remote_host is the prefill instance's host.
	wantKV := prefillParams("p0")
	wantKV["remote_host"] = "p0.test"
	if !reflect.DeepEqual(db["kv_transfer_params"], wantKV) {
		t.Errorf("decode kv_transfer_params = %v, want %v", db["kv_transfer_params"], wantKV)
	}
	want := chatBody("", true, map[string]any{"stream_options": map[string]any{"include_usage": true},
		"min_tokens": 2.0, "max_completion_tokens": 9.0, "min_completion_tokens": 1.0, "top_p": 0.5,
		"kv_transfer_params": wantKV})
	if jsonOf(t, db) != jsonOf(t, want) {
		t.Errorf("decode body\n got %s\nwant %s", jsonOf(t, db), jsonOf(t, want))
	}

	// A non-streaming client request goes to the decode non-streaming
	// (vLLM returns kv_transfer_params only in a non-streaming body).
	if status, _, b := r.post("/v1/chat/completions", chatBody("conv-2", false, nil), nil); status != 200 {
		t.Fatalf("status %d: %s", status, b)
	}
	if got := df.requests()[1].Body["stream"]; got == true {
		t.Errorf("decode stream = %v for a non-streaming client, want false", got)
	}
}

func TestMultiturnCacheHitMissExpiry(t *testing.T) {
	r, pf, df := multiturnRig(t, nil)
	turn := func(conv string) map[string]any {
		t.Helper()
		if status, _, b := r.post("/v1/chat/completions", chatBody(conv, true, nil), nil); status != 200 {
			t.Fatalf("status %d: %s", status, b)
		}
		reqs := pf.requests()
		return reqs[len(reqs)-1].Body["kv_transfer_params"].(map[string]any)
	}
	cachedForP := decodeParams("d0")
	cachedForP["remote_host"] = "d0.test" // rewritten to the decode instance's host
	cachedForP["do_remote_decode"], cachedForP["do_remote_prefill"] = true, false

	// Turn 1: miss; the decode's final params are cached.
	if kv := turn("c1"); !reflect.DeepEqual(kv, emptyParams()) {
		t.Errorf("turn 1 prefill params %v, want the empty set", kv)
	}
	if n := r.p.Cache().Len(); n != 1 {
		t.Errorf("cache holds %d conversations after turn 1, want 1", n)
	}
	// Turn 2: hit; the prefill gets the decode's params.
	if kv := turn("c1"); !reflect.DeepEqual(kv, cachedForP) {
		t.Errorf("turn 2 prefill params\n got %v\nwant %v", kv, cachedForP)
	}
	// Another conversation does not see c1's entry.
	if kv := turn("c2"); !reflect.DeepEqual(kv, emptyParams()) {
		t.Errorf("other conversation got %v", kv)
	}
	// Expiry: 480 s (decoder_kv_blocks_ttl's default) is still fresh, beyond is stale.
	r.advance(480 * time.Second)
	if kv := turn("c1"); !reflect.DeepEqual(kv, cachedForP) {
		t.Errorf("entry aged exactly the TTL not used: %v", kv)
	}
	r.advance(480*time.Second + time.Millisecond)
	if kv := turn("c1"); !reflect.DeepEqual(kv, emptyParams()) {
		t.Errorf("stale entry used: %v", kv)
	}
	if got := [3]float64{r.metric(MetricCacheHits, nil), r.metric(MetricCacheMisses, nil), r.metric(MetricCacheStale, nil)}; got != [3]float64{2, 3, 1} {
		t.Errorf("hits, misses, stale = %v, want [2 3 1]", got)
	}
	_ = df
}

func TestMultiturnSingleUse(t *testing.T) {
	// The decode instance returns params only on the first turn: the second
	// turn consumes them, the third finds nothing.
	pf := newFake(t, "p0", prefillHandler("p0"))
	var calls atomic.Int32
	df := newFake(t, "d0", func(w http.ResponseWriter, r *http.Request, rec received) {
		decodeHandler("d0", calls.Add(1) == 1)(w, r, rec)
	})
	r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) { c.Mode = ModeMultiturn })
	for i := 0; i < 3; i++ {
		if status, _, _ := r.post("/v1/completions", map[string]any{"prompt": "p", "conversation_id": "c", "stream": true}, nil); status != 200 {
			t.Fatalf("turn %d: status %d", i, status)
		}
	}
	hits := []bool{}
	for _, rec := range pf.requests() {
		kv := rec.Body["kv_transfer_params"].(map[string]any)
		hits = append(hits, kv["remote_engine_id"] == "engine-d0")
	}
	if !reflect.DeepEqual(hits, []bool{false, true, false}) {
		t.Errorf("turns that pulled decode blocks: %v, want [false true false]", hits)
	}
}

func TestMultiturnHealthEvicts(t *testing.T) {
	r, _, _ := multiturnRig(t, func(c *Config) { c.CacheTTL = 10 * time.Second })
	for _, c := range []string{"a", "b"} {
		r.post("/v1/chat/completions", chatBody(c, true, nil), nil)
	}
	r.advance(5 * time.Second)
	r.post("/v1/chat/completions", chatBody("c", true, nil), nil)
	status, h := r.get("/health")
	if want := map[string]any{"status": "ok", "cached_conversations": 3.0, "evicted_stale": 0.0}; status != 200 || !reflect.DeepEqual(h, want) {
		t.Errorf("/health = %d %v, want %v", status, h, want)
	}
	r.advance(6 * time.Second) // a and b are 11 s old, c 6 s
	if _, h = r.get("/health"); !reflect.DeepEqual(h, map[string]any{"status": "ok", "cached_conversations": 1.0, "evicted_stale": 2.0}) {
		t.Errorf("/health after expiry = %v", h)
	}
	if got := r.metric(MetricCacheEntries, nil); got != 1 {
		t.Errorf("%s = %v, want 1", MetricCacheEntries, got)
	}
}

func TestMultiturnNoConversationID(t *testing.T) {
	r, pf, _ := multiturnRig(t, nil)
	for i := 0; i < 2; i++ {
		if status, _, _ := r.post("/v1/chat/completions", chatBody("", true, nil), nil); status != 200 {
			t.Fatalf("status %d", status)
		}
	}
	if n := r.p.Cache().Len(); n != 0 {
		t.Errorf("cache holds %d entries without conversation ids", n)
	}
	if kv := pf.requests()[1].Body["kv_transfer_params"]; !reflect.DeepEqual(kv, emptyParams()) {
		t.Errorf("second request without id pulled %v", kv)
	}
	if got := r.metric(MetricCacheMisses, nil); got != 2 {
		t.Errorf("misses = %v, want 2", got)
	}

	strict, spf, sdf := multiturnRig(t, func(c *Config) { c.RequireConversationID = true })
	status, _, body := strict.post("/v1/chat/completions", chatBody("", true, nil), nil)
	if status != 400 || errorOf(t, body)["code"] != "missing_conversation_id" {
		t.Errorf("strict proxy answered %d %s, want 400 missing_conversation_id", status, body)
	}
	if n := len(spf.requests()) + len(sdf.requests()); n != 0 {
		t.Errorf("upstreams contacted %d times for a rejected request", n)
	}
	if status, _, _ := strict.post("/v1/chat/completions", chatBody("x", true, nil), nil); status != 200 {
		t.Errorf("strict proxy rejected a request with conversation_id: %d", status)
	}
}

func TestMultiturnOnewayNeverCaches(t *testing.T) {
	r, pf, _ := multiturnRig(t, func(c *Config) { c.ReuseMode = ReuseOneway })
	for i := 0; i < 2; i++ {
		r.post("/v1/chat/completions", chatBody("c", true, nil), nil)
	}
	if n := r.p.Cache().Len(); n != 0 {
		t.Errorf("oneway cache holds %d entries", n)
	}
	if kv := pf.requests()[1].Body["kv_transfer_params"]; !reflect.DeepEqual(kv, emptyParams()) {
		t.Errorf("oneway second turn pulled %v", kv)
	}
}

func TestMultiturnStreamRelayedUnchanged(t *testing.T) {
	for _, chat := range []bool{true, false} {
		t.Run(fmt.Sprintf("chat=%v", chat), func(t *testing.T) {
			r, _, _ := multiturnRig(t, nil)
			path, body := "/v1/completions", map[string]any{"prompt": "p", "stream": true, "conversation_id": "c"}
			if chat {
				path, body = "/v1/chat/completions", chatBody("c", true, nil)
			}
			status, hdr, got := r.post(path, body, nil)
			want := ""
			for _, c := range sseChunks("d0", chat, true) {
				want += "data: " + c + "\n\n"
			}
			want += "data: [DONE]\n\n"
			if status != 200 || string(got) != want {
				t.Errorf("stream = %d %q\nwant %q", status, got, want)
			}
			if ct := hdr.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
				t.Errorf("Content-Type %q", ct)
			}
		})
	}
}

func TestMultiturnNonStreamingRelaysDecodeBody(t *testing.T) {
	r, _, df := multiturnRig(t, nil)
	status, _, got := r.post("/v1/completions", map[string]any{"model": "m", "prompt": "p", "conversation_id": "c"}, nil)
	want := map[string]any{"id": "cmpl-d0", "object": "text_completion", "model": "m-d0",
		"choices": []any{map[string]any{"index": 0.0, "text": "hello world", "finish_reason": "stop"}}}
	var m map[string]any
	_ = json.Unmarshal(got, &m)
	if status != 200 || !reflect.DeepEqual(m, want) {
		t.Errorf("response %d %s\nwant %v (the decode's body without kv_transfer_params)", status, got, want)
	}
	if df.requests()[0].Body["stream"] == true {
		t.Errorf("decode asked to stream for a non-streaming client: %v", df.requests()[0].Body)
	}
	cached, res := r.p.Cache().Take("c")
	if res != Hit {
		t.Fatalf("non-streaming turn did not cache the decode params (%v)", res)
	}
	var kv map[string]any
	_ = json.Unmarshal(cached, &kv)
	wantKV := decodeParams("d0")
	wantKV["remote_host"] = "d0.test"
	if !reflect.DeepEqual(kv, wantKV) {
		t.Errorf("cached %v, want %v", kv, wantKV)
	}
}

func TestMultiturnAssemblesNonStreaming(t *testing.T) {
	// A decode that streams although asked not to: the proxy reads the
	// stream to the end and builds one response, as the reference does.
	// Completions, with a decode stream lacking id/model/created: the
	// request id, the request's model and the clock fill in.
	pf := newFake(t, "p1", prefillHandler("p1"))
	df := newFake(t, "d1", func(w http.ResponseWriter, _ *http.Request, _ received) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"text\":\"a\"}]}\n\nnot data\n\ndata: {bad json}\n\n"+
			"data: {\"choices\":[{\"text\":\"b\",\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\ndata: {\"choices\":[{\"text\":\"after\"}]}\n\n")
	})
	r2 := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) {
		c.Mode = ModeMultiturn
		c.NewRequestID = func() string { return "rid" }
	})
	status, _, got := r2.post("/v1/completions", map[string]any{"model": "mm", "prompt": "p"}, nil)
	want := map[string]any{"id": "rid", "object": "text_completion", "created": float64(r2.clock().Unix()), "model": "mm",
		"choices": []any{map[string]any{"index": 0.0, "text": "ab", "logprobs": nil, "finish_reason": "stop"}}, "usage": nil}
	var m map[string]any
	_ = json.Unmarshal(got, &m)
	if status != 200 || !reflect.DeepEqual(m, want) {
		t.Errorf("completion response %d %s\nwant %v", status, got, want)
	}
}

func TestMultiturnStreamingPassThrough(t *testing.T) {
	release := make(chan struct{})
	pf := newFake(t, "p0", prefillHandler("p0"))
	df := newFake(t, "d0", func(w http.ResponseWriter, r *http.Request, _ received) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"delta\":{\"content\":\"one\"}}]}\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	})
	r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) { c.Mode = ModeMultiturn })
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	b, _ := json.Marshal(chatBody("c", true, nil))
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.srv.URL+"/v1/chat/completions", strings.NewReader(string(b)))
	resp, err := r.srv.Client().Do(req)
	if err != nil {
		t.Fatalf("POST: %v", err)
	}
	defer resp.Body.Close()
	first := "data: {\"choices\":[{\"delta\":{\"content\":\"one\"}}]}\n\n"
	got := make([]byte, len(first))
	if _, err := io.ReadFull(resp.Body, got); err != nil || string(got) != first {
		t.Fatalf("first event %q before the upstream finished: %v", got, err)
	}
	close(release)
	if tail, _ := io.ReadAll(resp.Body); string(tail) != "data: [DONE]\n\n" {
		t.Errorf("tail %q", tail)
	}
}

// When the prefill instance returns no kv_transfer_params, the decode
// instance gets the client's request without the params meant for the
// prefill (it then prefills locally).
func TestMultiturnNoPrefillParams(t *testing.T) {
	pf := newFake(t, "p0", func(w http.ResponseWriter, _ *http.Request, _ received) {
		writeTestJSON(w, 200, map[string]any{"choices": []any{}})
	})
	df := newFake(t, "d0", decodeHandler("d0", true))
	r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) { c.Mode = ModeMultiturn })
	if status, _, _ := r.post("/v1/chat/completions", chatBody("c", true, nil), nil); status != 200 {
		t.Fatalf("status %d", status)
	}
	if kv, ok := df.requests()[0].Body["kv_transfer_params"]; ok {
		t.Errorf("decode got kv_transfer_params %v though the prefill returned none", kv)
	}
}

// A client's own kv_transfer_params never reach the decode in multi-turn
// mode either (unless ForwardClientKVParams), also when the prefill returns
// none.
func TestMultiturnClientParamsNotForwarded(t *testing.T) {
	for _, forward := range []bool{false, true} {
		pf := newFake(t, "p0", func(w http.ResponseWriter, _ *http.Request, _ received) {
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprint(w, `{"id":"x","choices":[]}`)
		})
		df := newFake(t, "d0", decodeHandler("d0", true))
		r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) {
			c.Mode, c.ForwardClientKVParams = ModeMultiturn, forward
		})
		client := map[string]any{"do_remote_prefill": true, "remote_engine_id": "x", "remote_block_ids": []any{1.0}}
		if status, _, b := r.post("/v1/chat/completions", chatBody("conv-1", true, map[string]any{"kv_transfer_params": client}), nil); status != 200 {
			t.Fatalf("status %d: %s", status, b)
		}
		got, ok := df.requests()[0].Body["kv_transfer_params"]
		if forward != ok || (ok && !reflect.DeepEqual(got, client)) {
			t.Errorf("forward=%v: decode kv_transfer_params %v (present %v)", forward, got, ok)
		}
	}
}

func TestServerTimingReportsThePrefillLeg(t *testing.T) {
	// Every answered request, toy or multi-turn, streamed or not, tells the
	// client how long the prefill leg took; the prefill here sleeps 30 ms.
	slowPrefill := func(name string) func(http.ResponseWriter, *http.Request, received) {
		h := prefillHandler(name)
		return func(w http.ResponseWriter, r *http.Request, rec received) {
			time.Sleep(30 * time.Millisecond)
			h(w, r, rec)
		}
	}
	for _, tc := range []struct {
		name   string
		mode   Mode
		stream bool
	}{{"toy", ModeToy, false}, {"toy stream", ModeToy, true}, {"multiturn", ModeMultiturn, false}, {"multiturn stream", ModeMultiturn, true}} {
		t.Run(tc.name, func(t *testing.T) {
			pf := newFake(t, "p0", slowPrefill("p0"))
			df := newFake(t, "d0", decodeHandler("d0", tc.stream))
			r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) { c.Mode = tc.mode })
			status, hdr, _ := r.post("/v1/completions", map[string]any{"prompt": "x", "stream": tc.stream, "conversation_id": "c"}, nil)
			if status != 200 {
				t.Fatalf("status %d", status)
			}
			st := hdr.Get("Server-Timing")
			ms, ok := strings.CutPrefix(st, "prefill;dur=")
			v, err := strconv.ParseFloat(ms, 64)
			if !ok || err != nil || v < 30 || v > 5000 {
				t.Errorf("Server-Timing %q: want prefill;dur=<ms> of at least the prefill's 30 ms", st)
			}
		})
	}
}
