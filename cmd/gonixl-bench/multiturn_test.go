package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gonixl/gonixl/proxy"
)

// fakeVLLM is a recording stand-in for a vLLM OpenAI server, prefill or
// decode: a request with max_tokens 1 gets a prefill answer with
// kv_transfer_params; any other gets an answer of three tokens ("tok0 tok1
// tok2"), streamed when asked, whose final chunk carries kv_transfer_params.
type fakeVLLM struct {
	srv    *httptest.Server
	status int // non-zero: answer every completion with this status

	mu     sync.Mutex
	bodies []map[string]any
	hdrs   []http.Header
}

func newFakeVLLM(t *testing.T) *fakeVLLM {
	f := &fakeVLLM{}
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeVLLM) serve(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/v1/models" {
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"fake-model"}]}`)
		return
	}
	if !strings.HasSuffix(r.URL.Path, "completions") {
		http.NotFound(w, r)
		return
	}
	raw, _ := io.ReadAll(r.Body)
	var b map[string]any
	_ = json.Unmarshal(raw, &b)
	f.mu.Lock()
	f.bodies = append(f.bodies, b)
	f.hdrs = append(f.hdrs, r.Header.Clone())
	f.mu.Unlock()
	if f.status != 0 {
		http.Error(w, "injected failure", f.status)
		return
	}
	kv := map[string]any{"remote_block_ids": []int{1, 2}, "remote_engine_id": "e", "remote_host": "h", "remote_port": 1}
	if b["max_tokens"] == 1.0 {
		_ = json.NewEncoder(w).Encode(map[string]any{"choices": []any{map[string]any{"text": "x"}}, "kv_transfer_params": kv})
		return
	}
	if b["stream"] != true {
		_ = json.NewEncoder(w).Encode(map[string]any{
			"choices": []any{map[string]any{"message": map[string]any{"role": "assistant", "content": "tok0 tok1 tok2"}}},
			"usage":   map[string]any{"completion_tokens": 3}})
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	_, chat := b["messages"]
	for i := 0; i < 3; i++ {
		s := fmt.Sprintf("tok%d", i)
		if i > 0 {
			s = " " + s
		}
		c := map[string]any{"text": s}
		if chat {
			c = map[string]any{"delta": map[string]any{"content": s}}
		}
		writeSSE(w, map[string]any{"id": "x", "choices": []any{c}})
	}
	writeSSE(w, map[string]any{"id": "x", "choices": []any{map[string]any{"delta": map[string]any{}, "finish_reason": "length"}},
		"kv_transfer_params": kv})
	if so, _ := b["stream_options"].(map[string]any); so["include_usage"] == true {
		writeSSE(w, map[string]any{"id": "x", "choices": []any{}, "usage": map[string]any{"completion_tokens": 3}})
	}
	_, _ = io.WriteString(w, "data: [DONE]\n\n")
}

func writeSSE(w http.ResponseWriter, v any) {
	b, _ := json.Marshal(v)
	_, _ = fmt.Fprintf(w, "data: %s\n\n", b)
	w.(http.Flusher).Flush()
}

func (f *fakeVLLM) requests() ([]map[string]any, []http.Header) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]map[string]any(nil), f.bodies...), append([]http.Header(nil), f.hdrs...)
}

func (f *fakeVLLM) instance(t *testing.T) proxy.Instance {
	u, _ := url.Parse(f.srv.URL)
	port, err := strconv.Atoi(u.Port())
	if err != nil {
		t.Fatal(err)
	}
	return proxy.Instance{Host: u.Hostname(), Port: port}
}

// startProxy runs a multi-turn gonixl proxy in front of a fake prefill and a
// fake decode instance.
func startProxy(t *testing.T) (url string, p, d *fakeVLLM) {
	p, d = newFakeVLLM(t), newFakeVLLM(t)
	px, err := proxy.New(proxy.Config{Mode: proxy.ModeMultiturn, Prefill: []proxy.Instance{p.instance(t)},
		Decode: []proxy.Instance{d.instance(t)}, UpstreamTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(px)
	t.Cleanup(func() { srv.Close(); px.Close() })
	return srv.URL, p, d
}

func runBench(t *testing.T, args ...string) (*mtReport, string, error) {
	t.Helper()
	cfg, err := parseMultiturnFlags(args, io.Discard)
	if err != nil {
		t.Fatalf("flags %v: %v", args, err)
	}
	rep, err := benchMultiturn(context.Background(), cfg)
	if err != nil {
		return nil, "", err
	}
	var out bytes.Buffer
	mtPrintReport(&out, rep)
	return rep, out.String(), nil
}

func TestMultiturnBenchThroughProxy(t *testing.T) {
	const convs, turns = 5, 3
	for _, send := range []bool{true, false} {
		t.Run(fmt.Sprintf("send-conversation-id=%v", send), func(t *testing.T) {
			u, _, d := startProxy(t)
			args := []string{"--url", u, "--num-clients", "2", "--num-conversations", strconv.Itoa(convs),
				"--turns", strconv.Itoa(turns), "--prompt-tokens", "7", "--output-tokens", "3"}
			if send {
				args = append(args, "--send-conversation-id")
			}
			rep, out, err := runBench(t, args...)
			if err != nil {
				t.Fatal(err)
			}
			if rep.Requests != convs*turns || rep.Failed != 0 {
				t.Fatalf("requests %d failed %d (%v), want %d and 0", rep.Requests, rep.Failed, rep.FirstErrors, convs*turns)
			}
			if rep.OutputTokens != 3*convs*turns || !rep.TokensFromUsage {
				t.Errorf("output tokens %d (from usage %v), want %d from usage", rep.OutputTokens, rep.TokensFromUsage, 3*convs*turns)
			}
			if rep.CacheHitRate == nil {
				t.Fatalf("no cache hit rate: %s", rep.CacheNote)
			}
			want := 0.0
			if send {
				want = float64(turns-1) / turns
			}
			if *rep.CacheHitRate != want {
				t.Errorf("cache hit rate %v, want %v", *rep.CacheHitRate, want)
			}
			if rep.TTFTms.P50 <= 0 || rep.E2Ems.P99 < rep.E2Ems.P50 || rep.OutputTokPerSec <= 0 {
				t.Errorf("implausible summary %+v", rep)
			}
			for _, s := range []string{"TTFT", "E2E", "p99", "hit rate"} {
				if !strings.Contains(out, s) {
					t.Errorf("report lacks %q:\n%s", s, out)
				}
			}
			// The decode instance saw every conversation grow turn by turn,
			// each turn carrying the previous answer; the model was found
			// through GET /v1/models.
			bodies, _ := d.requests()
			lengths := map[int]int{}
			for _, b := range bodies {
				msgs := b["messages"].([]any)
				lengths[len(msgs)]++
				if b["model"] != "fake-model" {
					t.Errorf("model %v, want fake-model", b["model"])
				}
				if len(msgs) >= 3 {
					if a := msgs[len(msgs)-2].(map[string]any); a["role"] != "assistant" || a["content"] != "tok0 tok1 tok2" {
						t.Errorf("previous answer not in history: %v", a)
					}
				}
			}
			for k := 0; k < turns; k++ {
				if lengths[2*k+1] != convs {
					t.Errorf("%d requests with %d messages, want %d", lengths[2*k+1], 2*k+1, convs)
				}
			}
		})
	}
}

func TestMultiturnBenchDirect(t *testing.T) {
	for _, tc := range []struct {
		description string
		args        []string
		wantConvID  bool
	}{
		{"default sends plain OpenAI payloads", nil, false},
		{"send-conversation-id adds the field and X-Session-ID", []string{"--send-conversation-id"}, true},
		{"completions api without streaming", []string{"--api", "completions", "--stream=false"}, false},
	} {
		t.Run(tc.description, func(t *testing.T) {
			f := newFakeVLLM(t)
			args := append([]string{"--url", f.srv.URL, "--num-clients", "3", "--num-conversations", "3", "--turns", "2",
				"--model", "m"}, tc.args...)
			rep, out, err := runBench(t, args...)
			if err != nil || rep.Failed != 0 || rep.Requests != 6 {
				t.Fatalf("err %v, report %+v", err, rep)
			}
			if rep.CacheHitRate != nil || !strings.Contains(out, "unavailable") {
				t.Errorf("a server without proxy metrics gave a hit rate: %s", out)
			}
			bodies, hdrs := f.requests()
			ids := map[string]bool{}
			for i, b := range bodies {
				id, has := b["conversation_id"].(string)
				if has != tc.wantConvID || (hdrs[i].Get("X-Session-ID") != "") != tc.wantConvID {
					t.Errorf("request %d: conversation_id %q, X-Session-ID %q; want present=%v", i, id, hdrs[i].Get("X-Session-ID"), tc.wantConvID)
				}
				if has && hdrs[i].Get("X-Session-ID") != id {
					t.Errorf("X-Session-ID %q != conversation_id %q", hdrs[i].Get("X-Session-ID"), id)
				}
				ids[id] = true
				if b["max_tokens"] != 32.0 {
					t.Errorf("max_tokens %v", b["max_tokens"])
				}
			}
			if tc.wantConvID && len(ids) != 3 {
				t.Errorf("%d distinct conversation ids, want 3", len(ids))
			}
		})
	}
}

func TestMultiturnBenchFailures(t *testing.T) {
	f := newFakeVLLM(t)
	f.status = http.StatusServiceUnavailable
	var out bytes.Buffer
	err := runMultiturn([]string{"--url", f.srv.URL, "--num-conversations", "2", "--turns", "3", "--metrics-url", "none"}, &out, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "2 of 2 requests failed") {
		t.Errorf("error %v, want 2 of 2 requests failed (a failed turn ends its conversation)", err)
	}
	if !strings.Contains(out.String(), "HTTP 503") {
		t.Errorf("report does not show the failure:\n%s", out.String())
	}
	for _, bad := range [][]string{{"--turns", "0"}, {"--api", "x"}, {"--timeout", "0s"}, {"stray"}} {
		if _, err := parseMultiturnFlags(bad, io.Discard); err == nil {
			t.Errorf("flags %v accepted", bad)
		}
	}
}

func TestMtPercentile(t *testing.T) {
	var ds []time.Duration
	for i := 1; i <= 100; i++ {
		ds = append(ds, time.Duration(i)*time.Millisecond)
	}
	s := mtSummarize(ds)
	if s.P50 != 50 || s.P90 != 90 || s.P99 != 99 || s.Max != 100 || s.Mean != 50.5 {
		t.Errorf("summary %+v", s)
	}
	if got := mtSummarize(nil); got != (mtLatency{}) {
		t.Errorf("empty summary %+v", got)
	}
}
