package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// charTokenizer is a vLLM tokenizer endpoint stand-in whose tokens are bytes:
// /tokenize returns one id per byte, /detokenize the bytes back. It serves
// the bench's real HTTP tokenizer client.
func charTokenizer(t *testing.T) (*mtHTTPTokenizer, *int) {
	calls := new(int)
	var mu sync.Mutex
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		*calls++
		mu.Unlock()
		var b map[string]any
		_ = json.NewDecoder(r.Body).Decode(&b)
		switch r.URL.Path {
		case "/tokenize":
			if b["add_special_tokens"] != false {
				http.Error(w, "want add_special_tokens false", http.StatusBadRequest)
				return
			}
			s, _ := b["prompt"].(string)
			ids := make([]int, len(s))
			for i := range s {
				ids[i] = int(s[i])
			}
			_ = json.NewEncoder(w).Encode(map[string]any{"tokens": ids, "count": len(ids)})
		case "/detokenize":
			raw, _ := b["tokens"].([]any)
			out := make([]byte, len(raw))
			for i, v := range raw {
				out[i] = byte(v.(float64))
			}
			_ = json.NewEncoder(w).Encode(map[string]any{"prompt": string(out)})
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	return &mtHTTPTokenizer{client: srv.Client(), base: srv.URL, model: "m"}, calls
}

func TestMtDistributions(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	mean := func(xs []int) float64 {
		s := 0
		for _, x := range xs {
			s += x
		}
		return float64(s) / float64(len(xs))
	}
	parse := func(js string) mtDistribution {
		t.Helper()
		var m map[string]any
		if err := json.Unmarshal([]byte(js), &m); err != nil {
			t.Fatal(err)
		}
		d, err := mtParseDistribution(m, "x")
		if err != nil {
			t.Fatalf("%s: %v", js, err)
		}
		return d
	}
	const n = 20000
	for _, tc := range []struct {
		spec     string
		lo, hi   int     // every sample in [lo, hi]
		wantMean float64 // 0: not checked
		tol      float64
	}{
		{`{"distribution":"constant","value":500}`, 500, 500, 500, 0},
		{`{"distribution":"uniform","min":12,"max":18}`, 12, 18, 15, 0.02},
		{`{"distribution":"uniform","min":1.5,"max":2.5}`, 2, 3, 2, 0.03},
		{`{"distribution":"poisson","alpha":300}`, 0, 1 << 30, 300, 0.01},
		{`{"distribution":"poisson","alpha":3,"max":5}`, 0, 5, 0, 0},
		{`{"distribution":"zipf","alpha":2.0,"max":20}`, 1, 20, 0, 0},
		{`{"distribution":"lognormal","average":1000}`, 0, 1 << 30, 1000, 0.001},
		{`{"distribution":"lognormal","average":1000,"max":5000}`, 0, 5000, 0, 0},
		{`{"distribution":"lognormal","mean":3.0,"sigma":0.0}`, 20, 20, 20, 0},
	} {
		xs := parse(tc.spec).sample(r, n)
		for _, x := range xs {
			if x < tc.lo || x > tc.hi {
				t.Fatalf("%s: sample %d outside [%d, %d]", tc.spec, x, tc.lo, tc.hi)
			}
		}
		if m := mean(xs); tc.wantMean != 0 && math.Abs(m-tc.wantMean) > tc.tol*tc.wantMean+0.5 {
			t.Errorf("%s: mean %.2f, want %.2f", tc.spec, m, tc.wantMean)
		}
	}
	// zipf(2): P(1) = 1/ζ(2) ≈ 0.61.
	ones := 0
	for _, x := range parse(`{"distribution":"zipf","alpha":2.0}`).sample(r, n) {
		if x == 1 {
			ones++
		}
	}
	if f := float64(ones) / n; math.Abs(f-6/(math.Pi*math.Pi)) > 0.02 {
		t.Errorf("zipf(2): P(1) = %.3f, want 0.608", f)
	}
	// lognormal by average: median ≈ median_ratio × average.
	xs := parse(`{"distribution":"lognormal","average":1000,"median_ratio":0.5}`).sample(r, n)
	below := 0
	for _, x := range xs {
		if x < 500 {
			below++
		}
	}
	if f := float64(below) / n; math.Abs(f-0.5) > 0.03 {
		t.Errorf("lognormal average 1000 median_ratio 0.5: %.3f of samples below 500, want 0.5", f)
	}

	for _, bad := range []string{
		`{}`, `{"distribution":"gauss"}`, `{"distribution":"constant"}`,
		`{"distribution":"uniform","min":0,"max":3}`, `{"distribution":"uniform","min":5,"max":3}`,
		`{"distribution":"zipf","alpha":1.0}`, `{"distribution":"poisson"}`,
		`{"distribution":"lognormal"}`, `{"distribution":"lognormal","average":10,"sigma":1}`,
		`{"distribution":"lognormal","average":10,"median_ratio":1.2}`, `{"distribution":"lognormal","mean":-1,"sigma":1}`,
		`{"distribution":"uniform","min":"1","max":3}`,
	} {
		var m map[string]any
		_ = json.Unmarshal([]byte(bad), &m)
		if _, err := mtParseDistribution(m, "x"); err == nil {
			t.Errorf("%s: accepted", bad)
		}
	}
}

// writeWorkload writes a generate_conversations file with constant counts and
// a text file of distinct words.
func writeWorkload(t *testing.T, convs, turns, common, prefix, userTokens, answerTokens, textBytes int) string {
	t.Helper()
	dir := t.TempDir()
	var text strings.Builder
	for i := 0; text.Len() < textBytes; i++ {
		fmt.Fprintf(&text, "w%d ", i)
	}
	if err := os.WriteFile(filepath.Join(dir, "text.txt"), []byte(text.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	spec := map[string]any{
		"filetype": "generate_conversations", "num_conversations": convs, "text_files": []string{"text.txt"},
		"prompt_input": map[string]any{
			"num_turns":                map[string]any{"distribution": "constant", "value": turns},
			"common_prefix_num_tokens": map[string]any{"distribution": "constant", "value": common},
			"prefix_num_tokens":        map[string]any{"distribution": "constant", "value": prefix},
			"num_tokens":               map[string]any{"distribution": "constant", "value": userTokens},
		},
		"prompt_output": map[string]any{"num_tokens": map[string]any{"distribution": "constant", "value": answerTokens}},
	}
	b, _ := json.Marshal(spec)
	p := filepath.Join(dir, "workload.json")
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestMtGenerateFollowsTheFile(t *testing.T) {
	tok, _ := charTokenizer(t)
	// 5 turns rounds up to 6 messages: 3 user turns a conversation.
	path := writeWorkload(t, 4, 5, 40, 120, 150, 9, 50000)
	convs, err := mtLoadWorkload(context.Background(), path, tok, 7)
	if err != nil {
		t.Fatal(err)
	}
	if len(convs) != 4 {
		t.Fatalf("%d conversations, want 4", len(convs))
	}
	var common string
	seen := map[string]string{}
	for c, conv := range convs {
		if conv.id != fmt.Sprintf("CONV_ID_%d", c) || len(conv.turns) != 3 {
			t.Fatalf("conversation %d: id %q, %d turns; want CONV_ID_%d, 3", c, conv.id, len(conv.turns), c)
		}
		for k, turn := range conv.turns {
			intro := fmt.Sprintf("%d is a nice number... ", c)
			want := 150 // the turn's token count, the tokenizer's bytes
			if k == 0 {
				want += 120 + len(fmt.Sprintf("%d, ", c)) // the conversation's context comes on top
				i := strings.Index(turn.user, intro)
				if i != 38+1 || !strings.HasSuffix(turn.user[:i], ".") {
					t.Fatalf("conversation %d: first turn does not start with the common prefix (38 tokens and a period): %q", c, turn.user[:min(60, len(turn.user))])
				}
				if common == "" {
					common = turn.user[:i]
				} else if turn.user[:i] != common {
					t.Errorf("conversation %d: common prefix differs", c)
				}
			} else if !strings.HasPrefix(turn.user, intro) {
				t.Errorf("conversation %d turn %d does not start with %q", c, k, intro)
			}
			if len(turn.user) != want {
				t.Errorf("conversation %d turn %d: %d tokens, want %d", c, k, len(turn.user), want)
			}
			if !strings.Contains(turn.user, mtBasePrompt) {
				t.Errorf("conversation %d turn %d lacks the base prompt", c, k)
			}
			if turn.maxTokens != 9 || len(turn.answer) != 9 {
				t.Errorf("conversation %d turn %d: max_tokens %d, answer %q; want 9 and 9 tokens", c, k, turn.maxTokens, turn.answer)
			}
			// The text after the base prompt is the turn's own: no two
			// turns of any conversation share it.
			tail := turn.user[strings.Index(turn.user, mtBasePrompt)+len(mtBasePrompt):]
			if prev, dup := seen[tail]; dup {
				t.Errorf("conversation %d turn %d repeats the text of %s", c, k, prev)
			}
			seen[tail] = fmt.Sprintf("conversation %d turn %d", c, k)
		}
	}

	// Too little text: a clear error, not a panic or a short prompt.
	short := writeWorkload(t, 4, 5, 40, 120, 150, 9, 600)
	if _, err := mtLoadWorkload(context.Background(), short, tok, 7); err == nil || !strings.Contains(err.Error(), "not enough text") {
		t.Errorf("short text file: err %v, want \"not enough text\"", err)
	}
}

func TestMtFromListAndSaveRoundTrip(t *testing.T) {
	tok, _ := charTokenizer(t)
	dir := t.TempDir()
	list := `[{"id":"a","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"},
	  {"role":"assistant","content":"hello there"},{"role":"user","content":"more"}]},
	 {"id":"b","messages":[{"role":"user","content":"q1"},{"role":"assistant","content":"a1"}]}]`
	p := filepath.Join(dir, "list.json")
	_ = os.WriteFile(p, []byte(list), 0o644)
	convs, err := mtLoadWorkload(context.Background(), p, tok, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(convs) != 2 || convs[0].system != "be brief" || len(convs[0].turns) != 2 ||
		convs[0].turns[0].maxTokens != len("hello there") || convs[0].turns[1].maxTokens != 0 ||
		convs[1].turns[0].maxTokens != 2 {
		t.Fatalf("parsed %+v", convs)
	}
	// Saved and read back (the file vLLM's benchmark would read): the same
	// workload.
	saved := filepath.Join(dir, "saved.json")
	if err := mtSaveConversations(saved, convs); err != nil {
		t.Fatal(err)
	}
	again, err := mtLoadWorkload(context.Background(), saved, tok, 0)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(again) != fmt.Sprint(convs) {
		t.Errorf("round trip:\n%+v\nwant\n%+v", again, convs)
	}

	for _, bad := range []string{
		`[]`, `{"filetype":"other"}`, `[{"id":"a"}]`, `[{"id":"a","messages":[]}]`,
		`[{"id":"a","messages":[{"role":"user","content":"x"}]},{"id":"a","messages":[{"role":"user","content":"y"}]}]`,
		`[{"id":"a","messages":[{"role":"assistant","content":"x"}]}]`,
		`[{"id":"a","messages":[{"role":"user","content":"x"},{"role":"user","content":"y"}]}]`,
		`[{"id":"a","messages":[{"role":"tool","content":"x"}]}]`,
		`[{"id":"a","messages":[{"role":"user","content":1}]}]`,
		`{"filetype":"generate_conversations","num_conversations":2,"text_files":[],"prompt_input":{},"prompt_output":{}}`,
		`not json`,
	} {
		_ = os.WriteFile(p, []byte(bad), 0o644)
		if _, err := mtLoadWorkload(context.Background(), p, tok, 0); err == nil {
			t.Errorf("%s: accepted", bad)
		}
	}
}

func TestMtServerTiming(t *testing.T) {
	for h, want := range map[string]float64{
		"prefill;dur=12.5":                  12.5,
		"cache;desc=x, prefill;dur=3":       3,
		"prefill;desc=\"p\";dur=40, decode": 40,
		"decode;dur=5":                      -1,
		"prefill;dur=abc":                   -1,
		"":                                  -1,
	} {
		got := mtServerTiming(h, "prefill")
		if (want < 0 && got >= 0) || (want >= 0 && math.Abs(got.Seconds()*1000-want) > 1e-6) {
			t.Errorf("%q: %v, want %v ms", h, got, want)
		}
	}
}

// TestMultiturnBenchLockstepPerTurn drives the bench against a fake server
// that counts "computed" prompt tokens like a prefill's vLLM metrics, and
// checks the per-turn report: lockstep order, the workload's max_tokens, the
// prefill leg from Server-Timing, and per-turn counter deltas.
func TestMultiturnBenchLockstepPerTurn(t *testing.T) {
	tok, _ := charTokenizer(t)
	var (
		mu       sync.Mutex
		computed float64
		order    []int // number of messages of each request, in arrival order
		maxToks  []float64
	)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/metrics":
			mu.Lock()
			fmt.Fprintf(w, "# TYPE vllm:prompt_tokens_by_source_total counter\n"+
				"vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"m\",source=\"local_compute\"} %g\n"+
				"vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"m\",source=\"external_kv_transfer\"} 0\n", computed)
			mu.Unlock()
		case "/v1/chat/completions":
			var b struct {
				Messages  []mtMessage `json:"messages"`
				MaxTokens float64     `json:"max_tokens"`
			}
			_ = json.NewDecoder(r.Body).Decode(&b)
			n := 0
			for _, m := range b.Messages {
				n += len(m.Content)
			}
			mu.Lock()
			computed += float64(n)
			order = append(order, len(b.Messages))
			maxToks = append(maxToks, b.MaxTokens)
			mu.Unlock()
			w.Header().Set("Server-Timing", "prefill;dur=7.5")
			_ = json.NewEncoder(w).Encode(map[string]any{
				"choices": []any{map[string]any{"message": map[string]any{"content": "ok"}}},
				"usage":   map[string]any{"prompt_tokens": n, "completion_tokens": 1}})
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	path := writeWorkload(t, 5, 6, 0, 30, 80, 4, 50000)
	rep, out, err := runBench(t, "--url", srv.URL, "--tokenizer-url", tok.base, "--input-file", path, "--lockstep",
		"--prefill-metrics", srv.URL+"/metrics", "--stream=false", "--num-clients", "3", "--metrics-url", "none")
	if err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + out)
	if rep.Requests != 15 || rep.Failed != 0 || len(rep.PerTurn) != 3 {
		t.Fatalf("%d requests, %d failed, %d turns; want 15, 0, 3", rep.Requests, rep.Failed, len(rep.PerTurn))
	}
	// Lockstep: every first turn (1 message) before any second (3), before
	// any third (5).
	for i := 1; i < len(order); i++ {
		if order[i] < order[i-1] {
			t.Fatalf("requests out of lockstep: %v", order)
		}
	}
	for _, m := range maxToks {
		if m != 4 {
			t.Fatalf("max_tokens %v, want the workload's 4", maxToks)
		}
	}
	for _, pt := range rep.PerTurn {
		if pt.Requests != 5 || pt.PrefillMs == nil || pt.PrefillMs.P50 != 7.5 {
			t.Errorf("turn %d: %d requests, prefill %v; want 5 and 7.5 ms", pt.Turn, pt.Requests, pt.PrefillMs)
		}
		if pt.PrefillComputed == nil || *pt.PrefillComputed != float64(pt.PromptTokens) || pt.PromptTokens == 0 {
			t.Errorf("turn %d: computed %v, prompt tokens %d; want equal and non-zero", pt.Turn, pt.PrefillComputed, pt.PromptTokens)
		}
	}
	if !strings.Contains(out, "P-compute") {
		t.Errorf("report lacks the per-turn table:\n%s", out)
	}

	// --output-tokens overrides the workload's answer lengths.
	maxToks = nil
	if _, _, err := runBench(t, "--url", srv.URL, "--tokenizer-url", tok.base, "--input-file", path, "--max-turns", "1",
		"--output-tokens", "11", "--stream=false", "--metrics-url", "none"); err != nil {
		t.Fatal(err)
	}
	if len(maxToks) != 5 || maxToks[0] != 11 {
		t.Errorf("with --output-tokens 11 and --max-turns 1: max_tokens %v, want five 11s", maxToks)
	}
	// --prefill-metrics without --lockstep is refused.
	if _, err := parseMultiturnFlags([]string{"--prefill-metrics", "http://x/metrics"}, io.Discard); err == nil {
		t.Error("--prefill-metrics without --lockstep accepted")
	}
}
