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
	if err := fs.Parse(args); err != nil {
		return nil, err
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
	}
	c.url = strings.TrimRight(c.url, "/")
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
	usageTokens  bool // outputTokens came from the server's usage
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

// runConversation plays one conversation's turns in order.
func (m *mtRunner) runConversation(ctx context.Context, conv int, out chan<- mtTurnResult) {
	r := rand.New(rand.NewPCG(m.cfg.seed, uint64(conv)))
	convID := fmt.Sprintf("gonixl-bench-%d-%d", m.cfg.seed, conv)
	var history []mtMessage
	for turn := 0; turn < m.cfg.turns; turn++ {
		history = append(history, mtMessage{Role: "user", Content: mtUserMessage(r, m.cfg.promptTokens)})
		res, answer := m.send(ctx, convID, history)
		res.conv, res.turn = conv, turn
		out <- res
		if !res.ok {
			return // the rest of the conversation would diverge from a real one
		}
		history = append(history, mtMessage{Role: "assistant", Content: answer})
	}
}

func (m *mtRunner) body(convID string, history []mtMessage) ([]byte, string) {
	b := map[string]any{"max_tokens": m.cfg.outputTokens}
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

func (m *mtRunner) send(ctx context.Context, convID string, history []mtMessage) (mtTurnResult, string) {
	raw, path := m.body(convID, history)
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
	res := mtTurnResult{}
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
			res.outputTokens, res.usageTokens = c.Usage.CompletionTokens, true
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
						res.outputTokens, res.usageTokens = c.Usage.CompletionTokens, true
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

type mtLatency struct {
	P50, P90, P99, Mean, Max float64 // milliseconds
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
	Config          map[string]any `json:"config"`
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
	rep := &mtReport{Config: map[string]any{
		"url": cfg.url, "model": cfg.model, "num_clients": cfg.numClients, "num_conversations": cfg.numConversations,
		"turns": cfg.turns, "prompt_tokens": cfg.promptTokens, "output_tokens": cfg.outputTokens,
		"send_conversation_id": cfg.sendConversationID, "stream": cfg.stream, "api": cfg.api,
	}}
	scrape := cfg.metricsURL != "none"
	var h0, m0 float64
	if scrape {
		var err error
		if h0, m0, err = mtScrapeCache(ctx, client, cfg.metricsURL); err != nil {
			scrape = false
			rep.CacheNote = "cache hit rate unavailable: " + err.Error()
		}
	}

	m := &mtRunner{cfg: cfg, client: client}
	convs := make(chan int)
	results := make(chan mtTurnResult, 64)
	var wg sync.WaitGroup
	start := time.Now()
	for c := 0; c < cfg.numClients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for conv := range convs {
				m.runConversation(ctx, conv, results)
			}
		}()
	}
	go func() {
		for i := 0; i < cfg.numConversations; i++ {
			convs <- i
		}
		close(convs)
		wg.Wait()
		close(results)
	}()
	var ttfts, e2es []time.Duration
	rep.TokensFromUsage = true
	for r := range results {
		rep.Requests++
		if !r.ok {
			rep.Failed++
			if len(rep.FirstErrors) < 5 {
				rep.FirstErrors = append(rep.FirstErrors, fmt.Sprintf("conversation %d turn %d: %s", r.conv, r.turn, r.err))
			}
			continue
		}
		ttfts = append(ttfts, r.ttft)
		e2es = append(e2es, r.e2e)
		rep.OutputTokens += r.outputTokens
		rep.TokensFromUsage = rep.TokensFromUsage && r.usageTokens
	}
	wall := time.Since(start)
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
	fmt.Fprintf(w, "multiturn: %v clients, %v conversations x %v turns, %v prompt words/turn, max_tokens %v, api %v, stream %v, send-conversation-id %v\n",
		c["num_clients"], c["num_conversations"], c["turns"], c["prompt_tokens"], c["output_tokens"], c["api"], c["stream"], c["send_conversation_id"])
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
}
