package main

// gonixl-bench multiturn: a multi-turn chat client for P/D proxies, after
// vLLM's benchmarks/multi_turn/benchmark_serving_multi_turn.py. N clients
// work through M synthetic conversations of K turns each; every turn resends
// the whole history plus a new user message, so each turn's prompt extends
// the previous turn's prompt and answer (what KV reuse across turns serves).

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

func init() {
	register("multiturn", "multi-turn chat client against a P/D proxy (TTFT, latency, tokens/s, cache hit rate)", runMultiturn)
}

type mtConfig struct {
	url                string
	model              string
	numClients         int
	numConversations   int
	turns              int
	promptTokens       int
	outputTokens       int
	sendConversationID bool
	stream             bool
	api                string
	ignoreEOS          bool
	timeout            time.Duration
	seed               uint64
	metricsURL         string
	jsonOut            string
	apiKey             string
	inputFile          string
	tokenizerURL       string
	maxTurns           int
	lockstep           bool
	prefillMetrics     []string
	saveConversations  string
	outputTokensSet    bool // --output-tokens given: overrides a workload's answer lengths
}

func parseMultiturnFlags(args []string, stderr io.Writer) (*mtConfig, error) {
	c := &mtConfig{}
	fs := flag.NewFlagSet("multiturn", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.url, "url", "http://127.0.0.1:8000", "base URL of the proxy (or any OpenAI server)")
	fs.StringVar(&c.model, "model", "", "model name; empty: the first of GET /v1/models, else omitted")
	fs.IntVar(&c.numClients, "num-clients", 4, "concurrent clients (N)")
	fs.IntVar(&c.numConversations, "num-conversations", 16, "conversations (M), shared out among the clients")
	fs.IntVar(&c.turns, "turns", 4, "turns per conversation (K)")
	fs.IntVar(&c.promptTokens, "prompt-tokens", 64, "words in each new user message (about one token each)")
	fs.IntVar(&c.outputTokens, "output-tokens", 32, "max_tokens of each answer")
	fs.BoolVar(&c.sendConversationID, "send-conversation-id", false,
		"send a top-level conversation_id (and X-Session-ID) so the multi-turn proxy can reuse KV across turns; off by default as in vLLM's benchmark")
	fs.BoolVar(&c.stream, "stream", true, "request streamed answers (needed for a true TTFT)")
	fs.StringVar(&c.api, "api", "chat", "chat (/v1/chat/completions) or completions (/v1/completions)")
	fs.BoolVar(&c.ignoreEOS, "ignore-eos", false, "send ignore_eos=true so every answer has output-tokens tokens (vLLM extension)")
	fs.DurationVar(&c.timeout, "timeout", 120*time.Second, "per-request timeout")
	fs.Uint64Var(&c.seed, "seed", 0, "seed of the synthetic conversations")
	fs.StringVar(&c.metricsURL, "metrics-url", "", "proxy metrics for the cache hit rate (default URL/metrics; \"none\" to skip)")
	fs.StringVar(&c.jsonOut, "json", "", "also write the results as JSON to this file")
	fs.StringVar(&c.inputFile, "input-file", "",
		"workload file in the formats of vLLM's benchmark_serving_multi_turn.py: a generate_conversations object "+
			"(generate_multi_turn.json style) or a list of {id, messages}; replaces --num-conversations, --turns and --prompt-tokens")
	fs.StringVar(&c.tokenizerURL, "tokenizer-url", "", "vLLM server whose /tokenize and /detokenize serve the model's tokenizer, for --input-file (default --url)")
	fs.IntVar(&c.maxTurns, "max-turns", 0, "send at most this many user turns of each conversation (0: all)")
	fs.BoolVar(&c.lockstep, "lockstep", false,
		"send every conversation's turn k (num-clients at a time) before any turn k+1, so that server counters can be read per turn")
	prefillMetrics := fs.String("prefill-metrics", "",
		"comma-separated /metrics URLs of the prefill instances: with --lockstep, the prompt tokens they computed, "+
			"pulled and found cached are reported per turn (vLLM's vllm:prompt_tokens_by_source)")
	fs.StringVar(&c.saveConversations, "save-conversations", "", "write the workload as a {id, messages} list (vLLM's benchmark reads it) and go on")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	fs.Visit(func(f *flag.Flag) { c.outputTokensSet = c.outputTokensSet || f.Name == "output-tokens" })
	for _, u := range strings.Split(*prefillMetrics, ",") {
		if u = strings.TrimSpace(u); u != "" {
			c.prefillMetrics = append(c.prefillMetrics, u)
		}
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	switch {
	case c.numClients < 1 || c.numConversations < 1 || c.turns < 1:
		return nil, errors.New("--num-clients, --num-conversations and --turns must be at least 1")
	case c.promptTokens < 1 || c.outputTokens < 1:
		return nil, errors.New("--prompt-tokens and --output-tokens must be at least 1")
	case c.api != "chat" && c.api != "completions":
		return nil, fmt.Errorf("--api %q: want chat or completions", c.api)
	case c.timeout <= 0:
		return nil, errors.New("--timeout must be positive")
	case c.maxTurns < 0:
		return nil, errors.New("--max-turns must not be negative")
	case len(c.prefillMetrics) > 0 && !c.lockstep:
		return nil, errors.New("--prefill-metrics needs --lockstep (the counters are read between turns)")
	}
	c.url = strings.TrimRight(c.url, "/")
	if c.tokenizerURL == "" {
		c.tokenizerURL = c.url
	}
	c.tokenizerURL = strings.TrimRight(c.tokenizerURL, "/")
	if c.metricsURL == "" {
		c.metricsURL = c.url + "/metrics"
	}
	c.apiKey = os.Getenv("OPENAI_API_KEY")
	return c, nil
}

// mtTurnResult is one request's measurements.
type mtTurnResult struct {
	conv, turn   int
	ok           bool
	err          string
	ttft, e2e    time.Duration
	outputTokens int
	usageTokens  bool          // outputTokens came from the server's usage
	promptTokens int           // from the server's usage; 0 if not given
	prefill      time.Duration // the proxy's prefill leg (Server-Timing); -1 if not given
}

type mtMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// mtWords is the synthetic vocabulary; common short English words are about one
// token each for most tokenizers.
var mtWords = strings.Fields(`the of and to in is was for on that with as by at from his her
they this have are but not you all were we when there can an which their said if do will each about
how up out them then she many some so these would other into has more two like him see time could
no make than first been its who now people my made over did down only way find use may water long
little very after called just where most know get through back much before go good new write our
used me man too any day same right look think also around another came come work three word must
because does part even place well such here take why things help put years different away again off
went old number great tell men say small every found still between name should home big give air line
set own under read last never us left end along while might next sound below saw something thought
both few those always looked show large often together asked house world going want school important
until form food keep children feet land side without boy once animals life enough took sometimes four
head above kind began almost live page got earth need far hand high year mother light parts country
father let night following picture being study second eyes soon times story boys since white days ever
paper hard near sentence better best across during today others however sure means knew its try told
young miles sun ways thing whole hear example heard several change answer room sea against top turned
learn point city play toward five using himself usually`)

func mtUserMessage(r *rand.Rand, n int) string {
	var b strings.Builder
	for i := 0; i < n; i++ {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(mtWords[r.IntN(len(mtWords))])
	}
	return b.String()
}

type mtRunner struct {
	cfg    *mtConfig
	client *http.Client
}

// mtConvState is a conversation in progress: its workload and the history
// sent so far (user turns and the server's answers).
type mtConvState struct {
	idx     int
	spec    *mtConversation
	convID  string
	history []mtMessage
	failed  bool
}

func (m *mtRunner) newState(idx int, spec *mtConversation) *mtConvState {
	st := &mtConvState{idx: idx, spec: spec, convID: fmt.Sprintf("gonixl-bench-%d-%s", m.cfg.seed, spec.id)}
	if spec.system != "" {
		st.history = append(st.history, mtMessage{Role: "system", Content: spec.system})
	}
	return st
}

// turns is how many user turns of a conversation are sent.
func (m *mtRunner) turns(spec *mtConversation) int {
	if m.cfg.maxTurns > 0 {
		return min(len(spec.turns), m.cfg.maxTurns)
	}
	return len(spec.turns)
}

// playTurn sends one user turn and keeps the answer in the history; after a
// failure the conversation stops (the rest would diverge from a real one).
func (m *mtRunner) playTurn(ctx context.Context, st *mtConvState, turn int) mtTurnResult {
	t := st.spec.turns[turn]
	maxTokens := m.cfg.outputTokens
	if t.maxTokens > 0 && !m.cfg.outputTokensSet {
		maxTokens = t.maxTokens
	}
	st.history = append(st.history, mtMessage{Role: "user", Content: t.user})
	res, answer := m.send(ctx, st.convID, st.history, maxTokens)
	res.conv, res.turn = st.idx, turn
	if res.ok {
		st.history = append(st.history, mtMessage{Role: "assistant", Content: answer})
	} else {
		st.failed = true
	}
	return res
}

// runConversation plays one conversation's turns in order.
func (m *mtRunner) runConversation(ctx context.Context, st *mtConvState, out chan<- mtTurnResult) {
	for turn := 0; turn < m.turns(st.spec) && !st.failed; turn++ {
		out <- m.playTurn(ctx, st, turn)
	}
}

// synthetic builds the flag-driven workload: random words from a fixed
// vocabulary, one generator per conversation.
func (m *mtRunner) synthetic() []mtConversation {
	convs := make([]mtConversation, m.cfg.numConversations)
	for c := range convs {
		r := rand.New(rand.NewPCG(m.cfg.seed, uint64(c)))
		convs[c].id = strconv.Itoa(c)
		for t := 0; t < m.cfg.turns; t++ {
			convs[c].turns = append(convs[c].turns, mtTurnSpec{user: mtUserMessage(r, m.cfg.promptTokens)})
		}
	}
	return convs
}

func (m *mtRunner) body(convID string, history []mtMessage, maxTokens int) ([]byte, string) {
	b := map[string]any{"max_tokens": maxTokens}
	if m.cfg.model != "" {
		b["model"] = m.cfg.model
	}
	path := "/v1/chat/completions"
	if m.cfg.api == "chat" {
		b["messages"] = history
	} else {
		path = "/v1/completions"
		var p strings.Builder
		for _, h := range history {
			p.WriteString(h.Role + ": " + h.Content + "\n")
		}
		p.WriteString("assistant:")
		b["prompt"] = p.String()
	}
	if m.cfg.stream {
		b["stream"] = true
		b["stream_options"] = map[string]any{"include_usage": true}
	}
	if m.cfg.ignoreEOS {
		b["ignore_eos"] = true
	}
	if m.cfg.sendConversationID {
		b["conversation_id"] = convID
	}
	raw, _ := json.Marshal(b) // plain maps of strings and numbers always marshal
	return raw, path
}

// mtChunk is the part of an OpenAI stream chunk (or response) the client
// reads.
type mtChunk struct {
	Choices []struct {
		Text    string `json:"text"`
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
	} `json:"usage"`
}

func (c mtChunk) content() string {
	var s strings.Builder
	for _, ch := range c.Choices {
		s.WriteString(ch.Text)
		s.WriteString(ch.Delta.Content)
		s.WriteString(ch.Message.Content)
	}
	return s.String()
}

func (m *mtRunner) send(ctx context.Context, convID string, history []mtMessage, maxTokens int) (mtTurnResult, string) {
	raw, path := m.body(convID, history, maxTokens)
	ctx, cancel := context.WithTimeout(ctx, m.cfg.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, m.cfg.url+path, bytes.NewReader(raw))
	if err != nil {
		return mtTurnResult{err: err.Error()}, ""
	}
	req.Header.Set("Content-Type", "application/json")
	if m.cfg.sendConversationID {
		req.Header.Set("X-Session-ID", convID)
	}
	if m.cfg.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+m.cfg.apiKey)
	}
	start := time.Now()
	resp, err := m.client.Do(req)
	if err != nil {
		return mtTurnResult{err: err.Error()}, ""
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return mtTurnResult{err: fmt.Sprintf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(b))}, ""
	}
	res := mtTurnResult{prefill: mtServerTiming(resp.Header.Get("Server-Timing"), "prefill")}
	var answer strings.Builder
	chunks := 0
	if !m.cfg.stream {
		var c mtChunk
		if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
			return mtTurnResult{err: "decoding response: " + err.Error()}, ""
		}
		res.e2e = time.Since(start)
		res.ttft = res.e2e
		answer.WriteString(c.content())
		if c.Usage != nil {
			res.outputTokens, res.usageTokens, res.promptTokens = c.Usage.CompletionTokens, true, c.Usage.PromptTokens
		}
	} else {
		br := bufio.NewReader(resp.Body)
		for {
			line, rerr := br.ReadBytes('\n')
			if data, ok := bytes.CutPrefix(bytes.TrimSpace(line), []byte("data:")); ok {
				data = bytes.TrimSpace(data)
				if string(data) == "[DONE]" {
					break
				}
				var c mtChunk
				if err := json.Unmarshal(data, &c); err == nil {
					if s := c.content(); s != "" {
						if chunks == 0 {
							res.ttft = time.Since(start)
						}
						chunks++
						answer.WriteString(s)
					}
					if c.Usage != nil {
						res.outputTokens, res.usageTokens, res.promptTokens = c.Usage.CompletionTokens, true, c.Usage.PromptTokens
					}
				}
			}
			if rerr == io.EOF {
				break
			}
			if rerr != nil {
				return mtTurnResult{err: "reading stream: " + rerr.Error()}, ""
			}
		}
		res.e2e = time.Since(start)
		if chunks == 0 {
			return mtTurnResult{err: "stream carried no content"}, ""
		}
	}
	if !res.usageTokens {
		// Without usage, a streamed chunk is about one token; a whole answer
		// is counted in words.
		res.outputTokens = chunks
		if !m.cfg.stream {
			res.outputTokens = len(strings.Fields(answer.String()))
		}
	}
	res.ok = true
	return res, answer.String()
}

// mtScrapeCache sums the proxy's cache hit and miss counters from a Prometheus
// text exposition.
func mtScrapeCache(ctx context.Context, client *http.Client, url string) (hits, misses float64, err error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, 0, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, 0, fmt.Errorf("GET %s: HTTP %d", url, resp.StatusCode)
	}
	found := false
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		for _, m := range []struct {
			name string
			dst  *float64
		}{{"gonixl_proxy_conversation_cache_hits_total", &hits}, {"gonixl_proxy_conversation_cache_misses_total", &misses}} {
			rest, ok := strings.CutPrefix(line, m.name)
			if !ok || (rest != "" && rest[0] != ' ' && rest[0] != '{') {
				continue
			}
			fields := strings.Fields(rest[strings.LastIndex(rest, "}")+1:])
			if len(fields) == 0 {
				continue
			}
			v, perr := strconv.ParseFloat(fields[0], 64)
			if perr != nil {
				continue
			}
			*m.dst += v
			found = true
		}
	}
	if err := sc.Err(); err != nil {
		return 0, 0, err
	}
	if !found {
		return 0, 0, fmt.Errorf("%s has no gonixl proxy cache counters (not a gonixl-proxy --multiturn?)", url)
	}
	return hits, misses, nil
}

// mtPercentile is the nearest-rank percentile of sorted values.
func mtPercentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p/100*float64(len(sorted)))) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

// mtLatency is a latency summary in milliseconds.
type mtLatency struct {
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
	Mean float64 `json:"mean"`
	Max  float64 `json:"max"`
}

func mtSummarize(ds []time.Duration) mtLatency {
	if len(ds) == 0 {
		return mtLatency{}
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	var sum time.Duration
	for _, d := range s {
		sum += d
	}
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	return mtLatency{P50: ms(mtPercentile(s, 50)), P90: ms(mtPercentile(s, 90)), P99: ms(mtPercentile(s, 99)),
		Mean: ms(sum / time.Duration(len(s))), Max: ms(s[len(s)-1])}
}

// mtReport is the benchmark's result (also its JSON output).
type mtReport struct {
	Requests        int            `json:"requests"`
	Failed          int            `json:"failed"`
	FirstErrors     []string       `json:"first_errors,omitempty"`
	WallSeconds     float64        `json:"wall_seconds"`
	TTFTms          mtLatency      `json:"ttft_ms"`
	E2Ems           mtLatency      `json:"e2e_ms"`
	OutputTokens    int            `json:"output_tokens"`
	TokensFromUsage bool           `json:"tokens_from_usage"`
	OutputTokPerSec float64        `json:"output_tokens_per_s"`
	RequestsPerSec  float64        `json:"requests_per_s"`
	CacheHits       *float64       `json:"cache_hits,omitempty"`
	CacheMisses     *float64       `json:"cache_misses,omitempty"`
	CacheHitRate    *float64       `json:"cache_hit_rate,omitempty"`
	CacheNote       string         `json:"cache_note,omitempty"`
	PerTurn         []mtTurnStats  `json:"per_turn"`
	Config          map[string]any `json:"config"`
}

// mtTurnStats is one turn index's measurements over all conversations.
type mtTurnStats struct {
	Turn     int       `json:"turn"` // 1-based
	Requests int       `json:"requests"`
	Failed   int       `json:"failed"`
	TTFTms   mtLatency `json:"ttft_ms"`
	E2Ems    mtLatency `json:"e2e_ms"`
	// PrefillMs is the proxy's prefill leg (its Server-Timing header), when
	// the proxy reports it.
	PrefillMs *mtLatency `json:"prefill_ms,omitempty"`
	// PromptTokens sums the server's usage.prompt_tokens.
	PromptTokens int `json:"prompt_tokens"`
	// Prefill* are deltas of vllm:prompt_tokens_by_source_total over the
	// turn on the --prefill-metrics instances (with --lockstep): the tokens
	// the prefills computed, pulled from another instance, and found in
	// their own prefix cache.
	PrefillComputed *float64 `json:"prefill_computed_tokens,omitempty"`
	PrefillPulled   *float64 `json:"prefill_pulled_tokens,omitempty"`
	PrefillCached   *float64 `json:"prefill_cached_tokens,omitempty"`
}

// mtServerTiming returns the named metric's dur from a Server-Timing header
// ("prefill;dur=12.5, decode;dur=40"), or -1.
func mtServerTiming(h, name string) time.Duration {
	for _, part := range strings.Split(h, ",") {
		fields := strings.Split(strings.TrimSpace(part), ";")
		if len(fields) == 0 || strings.TrimSpace(fields[0]) != name {
			continue
		}
		for _, f := range fields[1:] {
			if v, ok := strings.CutPrefix(strings.TrimSpace(f), "dur="); ok {
				if ms, err := strconv.ParseFloat(v, 64); err == nil && ms >= 0 {
					return time.Duration(ms * float64(time.Millisecond))
				}
			}
		}
	}
	return -1
}

// mtPromptSources sums vllm:prompt_tokens_by_source_total by its source label
// over the given /metrics URLs.
func mtPromptSources(ctx context.Context, client *http.Client, urls []string) (map[string]float64, error) {
	const name = "vllm:prompt_tokens_by_source_total"
	out := map[string]float64{}
	for _, u := range urls {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		if err != nil {
			cancel()
			return nil, err
		}
		resp, err := client.Do(req)
		if err != nil {
			cancel()
			return nil, err
		}
		found := false
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			rest, ok := strings.CutPrefix(sc.Text(), name+"{")
			if !ok {
				continue
			}
			labels, value, ok := strings.Cut(rest, "}")
			if !ok {
				continue
			}
			src := ""
			for _, l := range strings.Split(labels, ",") {
				if v, ok := strings.CutPrefix(strings.TrimSpace(l), "source="); ok {
					src = strings.Trim(v, `"`)
				}
			}
			fields := strings.Fields(value)
			if src == "" || len(fields) == 0 {
				continue
			}
			if v, err := strconv.ParseFloat(fields[0], 64); err == nil {
				out[src] += v
				found = true
			}
		}
		err = sc.Err()
		status := resp.StatusCode
		resp.Body.Close()
		cancel()
		if err != nil {
			return nil, err
		}
		if status != http.StatusOK || !found {
			return nil, fmt.Errorf("%s: HTTP %d, no %s samples (not a vLLM /metrics?)", u, status, name)
		}
	}
	return out, nil
}

func runMultiturn(args []string, stdout, stderr io.Writer) error {
	cfg, err := parseMultiturnFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	rep, err := benchMultiturn(context.Background(), cfg)
	if err != nil {
		return err
	}
	mtPrintReport(stdout, rep)
	if cfg.jsonOut != "" {
		b, _ := json.MarshalIndent(rep, "", "  ")
		if err := os.WriteFile(cfg.jsonOut, append(b, '\n'), 0o644); err != nil {
			return err
		}
	}
	if rep.Failed > 0 {
		return fmt.Errorf("%d of %d requests failed", rep.Failed, rep.Requests)
	}
	return nil
}

func benchMultiturn(ctx context.Context, cfg *mtConfig) (*mtReport, error) {
	tr := &http.Transport{Proxy: nil, MaxIdleConnsPerHost: cfg.numClients * 2, IdleConnTimeout: 90 * time.Second}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	if cfg.model == "" {
		cfg.model = mtDiscoverModel(ctx, client, cfg.url)
	}
	m := &mtRunner{cfg: cfg, client: client}
	workload := m.synthetic()
	if cfg.inputFile != "" {
		var err error
		tok := &mtHTTPTokenizer{client: client, base: cfg.tokenizerURL, model: cfg.model}
		if workload, err = mtLoadWorkload(ctx, cfg.inputFile, tok, cfg.seed); err != nil {
			return nil, err
		}
	}
	if cfg.saveConversations != "" {
		if err := mtSaveConversations(cfg.saveConversations, workload); err != nil {
			return nil, err
		}
	}
	maxTurns := 0
	for i := range workload {
		maxTurns = max(maxTurns, m.turns(&workload[i]))
	}
	rep := &mtReport{Config: map[string]any{
		"url": cfg.url, "model": cfg.model, "num_clients": cfg.numClients, "num_conversations": len(workload),
		"turns": maxTurns, "prompt_tokens": cfg.promptTokens, "output_tokens": cfg.outputTokens,
		"send_conversation_id": cfg.sendConversationID, "stream": cfg.stream, "api": cfg.api,
		"input_file": cfg.inputFile, "lockstep": cfg.lockstep,
	}}
	if cfg.inputFile != "" {
		delete(rep.Config, "prompt_tokens")
		if !cfg.outputTokensSet {
			rep.Config["output_tokens"] = "from the workload"
		}
	}
	scrape := cfg.metricsURL != "none"
	var h0, m0 float64
	if scrape {
		var err error
		if h0, m0, err = mtScrapeCache(ctx, client, cfg.metricsURL); err != nil {
			scrape = false
			rep.CacheNote = "cache hit rate unavailable: " + err.Error()
		}
	}

	states := make([]*mtConvState, len(workload))
	for i := range workload {
		states[i] = m.newState(i, &workload[i])
	}
	results := make(chan mtTurnResult, 64)
	// sources[k] is the prefills' counters before turn k (and after the last).
	var sources []map[string]float64
	start := time.Now()
	go func() {
		defer close(results)
		if !cfg.lockstep {
			m.pool(ctx, states, func(st *mtConvState) { m.runConversation(ctx, st, results) })
			return
		}
		for turn := 0; turn < maxTurns; turn++ {
			if len(cfg.prefillMetrics) > 0 {
				src, err := mtPromptSources(ctx, client, cfg.prefillMetrics)
				if err != nil {
					results <- mtTurnResult{conv: -1, turn: turn, err: "prefill metrics: " + err.Error()}
					return
				}
				sources = append(sources, src)
			}
			var due []*mtConvState
			for _, st := range states {
				if !st.failed && turn < m.turns(st.spec) {
					due = append(due, st)
				}
			}
			m.pool(ctx, due, func(st *mtConvState) { results <- m.playTurn(ctx, st, turn) })
		}
		if len(cfg.prefillMetrics) > 0 {
			if src, err := mtPromptSources(ctx, client, cfg.prefillMetrics); err == nil {
				sources = append(sources, src)
			} else {
				results <- mtTurnResult{conv: -1, turn: maxTurns, err: "prefill metrics: " + err.Error()}
			}
		}
	}()
	var ttfts, e2es []time.Duration
	perTurn := make([]struct {
		ttft, e2e, prefill []time.Duration
		stats              mtTurnStats
	}, maxTurns+1)
	rep.TokensFromUsage = true
	var benchErr error
	for r := range results {
		pt := &perTurn[min(r.turn, maxTurns)]
		if r.conv < 0 { // a bench-side failure, not a request
			benchErr = errors.Join(benchErr, errors.New(r.err))
			continue
		}
		rep.Requests++
		pt.stats.Requests++
		if !r.ok {
			rep.Failed++
			pt.stats.Failed++
			if len(rep.FirstErrors) < 5 {
				rep.FirstErrors = append(rep.FirstErrors, fmt.Sprintf("conversation %d turn %d: %s", r.conv, r.turn+1, r.err))
			}
			continue
		}
		ttfts = append(ttfts, r.ttft)
		e2es = append(e2es, r.e2e)
		pt.ttft, pt.e2e = append(pt.ttft, r.ttft), append(pt.e2e, r.e2e)
		if r.prefill >= 0 {
			pt.prefill = append(pt.prefill, r.prefill)
		}
		pt.stats.PromptTokens += r.promptTokens
		rep.OutputTokens += r.outputTokens
		rep.TokensFromUsage = rep.TokensFromUsage && r.usageTokens
	}
	wall := time.Since(start)
	if benchErr != nil {
		return nil, benchErr
	}
	for k := 0; k < maxTurns; k++ {
		pt := &perTurn[k]
		st := pt.stats
		st.Turn = k + 1
		st.TTFTms, st.E2Ems = mtSummarize(pt.ttft), mtSummarize(pt.e2e)
		if len(pt.prefill) > 0 {
			l := mtSummarize(pt.prefill)
			st.PrefillMs = &l
		}
		if k+1 < len(sources) {
			d := func(src string) *float64 { v := sources[k+1][src] - sources[k][src]; return &v }
			st.PrefillComputed, st.PrefillPulled, st.PrefillCached = d("local_compute"), d("external_kv_transfer"), d("local_cache_hit")
		}
		rep.PerTurn = append(rep.PerTurn, st)
	}
	rep.WallSeconds = wall.Seconds()
	rep.TTFTms, rep.E2Ems = mtSummarize(ttfts), mtSummarize(e2es)
	rep.OutputTokPerSec = float64(rep.OutputTokens) / wall.Seconds()
	rep.RequestsPerSec = float64(len(e2es)) / wall.Seconds()
	if scrape {
		h1, m1, err := mtScrapeCache(ctx, client, cfg.metricsURL)
		if err != nil {
			rep.CacheNote = "cache hit rate unavailable: " + err.Error()
		} else {
			dh, dm := h1-h0, m1-m0
			rep.CacheHits, rep.CacheMisses = &dh, &dm
			if dh+dm > 0 {
				rate := dh / (dh + dm)
				rep.CacheHitRate = &rate
			}
			rep.CacheNote = "from the proxy's /metrics, counted over this run (other clients of the proxy are included)"
		}
	}
	return rep, nil
}

// pool runs fn over the states with --num-clients workers and returns when
// all are done.
func (m *mtRunner) pool(ctx context.Context, states []*mtConvState, fn func(*mtConvState)) {
	work := make(chan *mtConvState)
	var wg sync.WaitGroup
	for c := 0; c < min(m.cfg.numClients, len(states)); c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for st := range work {
				fn(st)
			}
		}()
	}
	for _, st := range states {
		select {
		case work <- st:
		case <-ctx.Done():
		}
	}
	close(work)
	wg.Wait()
}

// mtDiscoverModel returns the first model of GET /v1/models, or "" (the field
// is then left out).
func mtDiscoverModel(ctx context.Context, client *http.Client, base string) string {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/v1/models", nil)
	if err != nil {
		return ""
	}
	resp, err := client.Do(req)
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	var l struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&l) != nil || len(l.Data) == 0 {
		return ""
	}
	return l.Data[0].ID
}

func mtPrintReport(w io.Writer, r *mtReport) {
	c := r.Config
	work := fmt.Sprintf("%v prompt words/turn", c["prompt_tokens"])
	if f, _ := c["input_file"].(string); f != "" {
		work = "workload " + f
	}
	fmt.Fprintf(w, "multiturn: %v clients, %v conversations x up to %v turns, %s, max_tokens %v, api %v, stream %v, send-conversation-id %v, lockstep %v\n",
		c["num_clients"], c["num_conversations"], c["turns"], work, c["output_tokens"], c["api"], c["stream"], c["send_conversation_id"], c["lockstep"])
	fmt.Fprintf(w, "requests: %d ok, %d failed in %.2f s (%.2f req/s)\n", r.Requests-r.Failed, r.Failed, r.WallSeconds, r.RequestsPerSec)
	for _, e := range r.FirstErrors {
		fmt.Fprintf(w, "  error: %s\n", e)
	}
	row := func(name string, s mtLatency) {
		fmt.Fprintf(w, "%-8s p50 %9.2f  p90 %9.2f  p99 %9.2f  mean %9.2f  max %9.2f  ms\n", name, s.P50, s.P90, s.P99, s.Mean, s.Max)
	}
	row("TTFT", r.TTFTms)
	row("E2E", r.E2Ems)
	src := "server usage"
	if !r.TokensFromUsage {
		src = "approximate: stream chunks or words"
	}
	fmt.Fprintf(w, "output: %d tokens (%s), %.1f tokens/s\n", r.OutputTokens, src, r.OutputTokPerSec)
	switch {
	case r.CacheHitRate != nil:
		fmt.Fprintf(w, "conversation cache: %.0f hits, %.0f misses, hit rate %.1f%% (%s)\n", *r.CacheHits, *r.CacheMisses, 100**r.CacheHitRate, r.CacheNote)
	case r.CacheHits != nil:
		fmt.Fprintf(w, "conversation cache: no lookups counted (%s)\n", r.CacheNote)
	case r.CacheNote != "":
		fmt.Fprintf(w, "conversation cache: %s\n", r.CacheNote)
	}
	if len(r.PerTurn) == 0 {
		return
	}
	fmt.Fprintf(w, "%4s %5s %10s %10s %10s %10s %9s %10s %10s %10s\n", "turn", "ok", "TTFT p50", "TTFT mean",
		"E2E p50", "prefill50", "prompt", "P-compute", "P-pulled", "P-cached")
	opt := func(v *float64) string {
		if v == nil {
			return "-"
		}
		return strconv.FormatFloat(*v, 'f', 0, 64)
	}
	for _, t := range r.PerTurn {
		pre := "-"
		if t.PrefillMs != nil {
			pre = strconv.FormatFloat(t.PrefillMs.P50, 'f', 1, 64)
		}
		fmt.Fprintf(w, "%4d %5d %10.1f %10.1f %10.1f %10s %9d %10s %10s %10s\n", t.Turn, t.Requests-t.Failed, t.TTFTms.P50,
			t.TTFTms.Mean, t.E2Ems.P50, pre, t.PromptTokens, opt(t.PrefillComputed), opt(t.PrefillPulled), opt(t.PrefillCached))
	}
	fmt.Fprintln(w, "(ms; prompt: usage.prompt_tokens summed; P-*: the prefills' vllm:prompt_tokens_by_source over the turn)")
}
