package main

// Workload files for gonixl-bench multiturn, in the two formats that vLLM's
// benchmarks/multi_turn/benchmark_serving_multi_turn.py reads, so that one
// file drives both benchmarks:
//
//   - a generator description (an object whose "filetype" is
//     "generate_conversations", as in vLLM's generate_multi_turn.json): turn
//     counts and token counts drawn from constant, uniform, zipf, poisson or
//     lognormal distributions, the text cut from "text_files" by token
//     counts of the served model's tokenizer;
//   - a conversation list (ShareGPT converted: [{"id", "messages"}]), each
//     message {"role", "content"}.
//
// The tokenizer is the served model's, reached through a vLLM server's
// /tokenize and /detokenize endpoints (vLLM's benchmark loads the same
// tokenizer with transformers). The distributions are sampled with Go's
// generator, not numpy's: the same file gives the same workload shape, not the
// same bytes. For byte-identical workloads write the generated conversations
// with --save-conversations; vLLM's benchmark reads that list as its input.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"time"
)

// mtTurnSpec is one user turn of a workload conversation.
type mtTurnSpec struct {
	user      string
	answer    string // the workload's answer text ("" if none): only its length matters
	maxTokens int    // 0: the --output-tokens default
}

// mtConversation is a workload conversation: an optional system message and
// its user turns (the answers come from the server).
type mtConversation struct {
	id     string
	system string
	turns  []mtTurnSpec
}

// mtDistribution samples token or turn counts.
type mtDistribution interface {
	sample(r *rand.Rand, n int) []int
	String() string
}

type mtConstant struct{ v float64 }

func (d mtConstant) sample(_ *rand.Rand, n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = int(math.Round(d.v))
	}
	return out
}
func (d mtConstant) String() string { return fmt.Sprintf("constant(%g)", d.v) }

type mtUniform struct {
	min, max float64
	integer  bool
}

func (d mtUniform) sample(r *rand.Rand, n int) []int {
	out := make([]int, n)
	for i := range out {
		if d.integer {
			out[i] = int(d.min) + r.IntN(int(d.max)-int(d.min)+1)
		} else {
			out[i] = int(math.Round(d.min + r.Float64()*(d.max-d.min)))
		}
	}
	return out
}
func (d mtUniform) String() string { return fmt.Sprintf("uniform[%g, %g]", d.min, d.max) }

// mtCap caps a sample at max when max is set (numpy-style: mass piles up at
// the cap rather than being redrawn).
func mtCap(v int, max float64) int {
	if max > 0 && float64(v) > max {
		return int(max)
	}
	return v
}

type mtZipf struct{ alpha, max float64 }

func (d mtZipf) sample(r *rand.Rand, n int) []int {
	// P(k) ∝ k^-alpha for k >= 1: Go's Zipf draws k-1 with v = 1.
	z := rand.NewZipf(r, d.alpha, 1, math.MaxInt32)
	out := make([]int, n)
	for i := range out {
		out[i] = mtCap(int(z.Uint64())+1, d.max)
	}
	return out
}
func (d mtZipf) String() string { return fmt.Sprintf("zipf(%g, max %g)", d.alpha, d.max) }

type mtPoisson struct{ lambda, max float64 }

func (d mtPoisson) sample(r *rand.Rand, n int) []int {
	out := make([]int, n)
	for i := range out {
		// A sum of Poisson variables is Poisson: draw in slices small enough
		// that exp(-λ) does not underflow (Knuth's method per slice).
		k, left := 0, d.lambda
		for left > 0 {
			l := math.Min(left, 200)
			left -= l
			limit, p := math.Exp(-l), 1.0
			for {
				p *= r.Float64()
				if p <= limit {
					break
				}
				k++
			}
		}
		out[i] = mtCap(k, d.max)
	}
	return out
}
func (d mtPoisson) String() string { return fmt.Sprintf("poisson(%g, max %g)", d.lambda, d.max) }

// mtLognormal is exp(N(mu, sigma²)); with average set, a batch is scaled so
// that its mean is the average (as vLLM's generator does), mu and sigma then
// coming from the average and median_ratio (median = ratio × mean).
type mtLognormal struct {
	mu, sigma, average, max float64
}

func (d mtLognormal) sample(r *rand.Rand, n int) []int {
	xs := make([]float64, n)
	sum := 0.0
	for i := range xs {
		xs[i] = math.Exp(d.mu + d.sigma*r.NormFloat64())
		sum += xs[i]
	}
	scale := 1.0
	if d.average > 0 && sum > 0 {
		scale = d.average / (sum / float64(n))
	}
	out := make([]int, n)
	for i, x := range xs {
		x *= scale
		if d.max > 0 {
			x = math.Min(x, d.max)
		}
		out[i] = int(math.Round(x))
	}
	return out
}
func (d mtLognormal) String() string {
	return fmt.Sprintf("lognormal(mu %.3f, sigma %.3f, average %g, max %g)", d.mu, d.sigma, d.average, d.max)
}

// mtParseDistribution reads one {"distribution": ...} object.
func mtParseDistribution(raw map[string]any, where string) (mtDistribution, error) {
	num := func(key string) (float64, bool, error) {
		v, ok := raw[key]
		if !ok || v == nil {
			return 0, false, nil
		}
		f, isNum := v.(float64)
		if !isNum {
			return 0, false, fmt.Errorf("%s: %q must be a number, got %v", where, key, v)
		}
		return f, true, nil
	}
	need := func(key string) (float64, error) {
		f, ok, err := num(key)
		if err == nil && !ok {
			err = fmt.Errorf("%s: missing field %q", where, key)
		}
		return f, err
	}
	name, _ := raw["distribution"].(string)
	maxV, _, err := num("max")
	if err != nil {
		return nil, err
	}
	switch name {
	case "constant":
		v, err := need("value")
		if err != nil {
			return nil, err
		}
		return mtConstant{v}, nil
	case "uniform":
		lo, err := need("min")
		if err != nil {
			return nil, err
		}
		hi, err := need("max")
		if err != nil {
			return nil, err
		}
		if lo <= 0 || lo > hi {
			return nil, fmt.Errorf("%s: uniform needs 0 < min <= max, got min %g max %g", where, lo, hi)
		}
		return mtUniform{lo, hi, lo == math.Trunc(lo) && hi == math.Trunc(hi)}, nil
	case "zipf":
		a, err := need("alpha")
		if err != nil {
			return nil, err
		}
		if a <= 1 {
			return nil, fmt.Errorf("%s: zipf alpha must be above 1, got %g", where, a)
		}
		return mtZipf{a, maxV}, nil
	case "poisson":
		a, err := need("alpha")
		if err != nil {
			return nil, err
		}
		if a < 0 {
			return nil, fmt.Errorf("%s: poisson alpha must not be negative, got %g", where, a)
		}
		return mtPoisson{a, maxV}, nil
	case "lognormal":
		avg, hasAvg, err := num("average")
		if err != nil {
			return nil, err
		}
		mean, hasMean, err := num("mean")
		if err != nil {
			return nil, err
		}
		sigma, hasSigma, err := num("sigma")
		if err != nil {
			return nil, err
		}
		if hasAvg {
			if hasMean || hasSigma {
				return nil, fmt.Errorf("%s: lognormal takes either average (and median_ratio) or mean and sigma", where)
			}
			if avg < 1 {
				return nil, fmt.Errorf("%s: lognormal average must be at least 1, got %g", where, avg)
			}
			ratio, hasRatio, err := num("median_ratio")
			if err != nil {
				return nil, err
			}
			if !hasRatio {
				ratio = 0.85 // vLLM's default: a fairly wide spread
			}
			if ratio <= 0 || ratio >= 1 {
				return nil, fmt.Errorf("%s: median_ratio must be in (0, 1), got %g", where, ratio)
			}
			// mean/median = exp(sigma²/2), median = exp(mu).
			return mtLognormal{mu: math.Log(avg * ratio), sigma: math.Sqrt(2 * math.Log(1/ratio)), average: avg, max: maxV}, nil
		}
		if !hasMean || !hasSigma {
			return nil, fmt.Errorf("%s: lognormal needs average, or both mean and sigma", where)
		}
		if mean <= 0 || sigma < 0 {
			return nil, fmt.Errorf("%s: lognormal needs mean > 0 and sigma >= 0", where)
		}
		return mtLognormal{mu: mean, sigma: sigma, max: maxV}, nil
	case "":
		return nil, fmt.Errorf("%s: missing field \"distribution\"", where)
	default:
		return nil, fmt.Errorf("%s: unknown distribution %q (constant, uniform, zipf, poisson, lognormal)", where, name)
	}
}

// mtGenSpec is a parsed generate_conversations file.
type mtGenSpec struct {
	numConversations                                 int
	textFiles                                        []string
	turns, commonPrefix, prefix, inputTok, outputTok mtDistribution
}

func mtParseGenSpec(obj map[string]any, dir string) (*mtGenSpec, error) {
	for _, f := range []string{"filetype", "num_conversations", "text_files", "prompt_input", "prompt_output"} {
		if _, ok := obj[f]; !ok {
			return nil, fmt.Errorf("generate_conversations: missing field %q", f)
		}
	}
	g := &mtGenSpec{}
	n, _ := obj["num_conversations"].(float64)
	if n < 1 || n != math.Trunc(n) {
		return nil, fmt.Errorf("generate_conversations: num_conversations must be a positive integer, got %v", obj["num_conversations"])
	}
	g.numConversations = int(n)
	files, _ := obj["text_files"].([]any)
	if len(files) == 0 {
		return nil, errors.New("generate_conversations: text_files must be a list of at least one file")
	}
	for _, f := range files {
		s, ok := f.(string)
		if !ok || s == "" {
			return nil, fmt.Errorf("generate_conversations: text_files holds %v, not a file name", f)
		}
		// As vLLM's generator: relative to the working directory; failing
		// that, relative to the workload file.
		if _, err := os.Stat(s); err != nil && !filepath.IsAbs(s) {
			if _, err2 := os.Stat(filepath.Join(dir, s)); err2 == nil {
				s = filepath.Join(dir, s)
			}
		}
		g.textFiles = append(g.textFiles, s)
	}
	section := func(name string) (map[string]any, error) {
		s, ok := obj[name].(map[string]any)
		if !ok {
			return nil, fmt.Errorf("generate_conversations: %q must be an object", name)
		}
		return s, nil
	}
	in, err := section("prompt_input")
	if err != nil {
		return nil, err
	}
	out, err := section("prompt_output")
	if err != nil {
		return nil, err
	}
	dist := func(sec map[string]any, secName, key string, optional bool) (mtDistribution, error) {
		raw, ok := sec[key]
		if !ok && optional {
			return mtConstant{0}, nil
		}
		m, isObj := raw.(map[string]any)
		if !isObj {
			return nil, fmt.Errorf("generate_conversations: %s.%s must be a distribution object", secName, key)
		}
		return mtParseDistribution(m, secName+"."+key)
	}
	if g.turns, err = dist(in, "prompt_input", "num_turns", false); err != nil {
		return nil, err
	}
	if g.inputTok, err = dist(in, "prompt_input", "num_tokens", false); err != nil {
		return nil, err
	}
	if g.commonPrefix, err = dist(in, "prompt_input", "common_prefix_num_tokens", true); err != nil {
		return nil, err
	}
	if g.prefix, err = dist(in, "prompt_input", "prefix_num_tokens", false); err != nil {
		return nil, err
	}
	if g.outputTok, err = dist(out, "prompt_output", "num_tokens", false); err != nil {
		return nil, err
	}
	return g, nil
}

// mtTokenizer is the served model's tokenizer behind a vLLM server.
type mtTokenizer interface {
	encode(ctx context.Context, text string) ([]int, error)
	decode(ctx context.Context, ids []int) (string, error)
}

// mtHTTPTokenizer calls vLLM's /tokenize and /detokenize.
type mtHTTPTokenizer struct {
	client *http.Client
	base   string
	model  string
}

func (t *mtHTTPTokenizer) post(ctx context.Context, path string, body map[string]any, out any) error {
	if t.model != "" {
		body["model"] = t.model
	}
	raw, _ := json.Marshal(body)
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, t.base+path, bytes.NewReader(raw))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := t.client.Do(req)
	if err != nil {
		return fmt.Errorf("tokenizer %s%s: %w", t.base, path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("tokenizer %s%s: HTTP %d: %s (--tokenizer-url must be a vLLM server of the served model)",
			t.base, path, resp.StatusCode, bytes.TrimSpace(b))
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("tokenizer %s%s: %w", t.base, path, err)
	}
	return nil
}

func (t *mtHTTPTokenizer) encode(ctx context.Context, text string) ([]int, error) {
	var r struct {
		Tokens []int `json:"tokens"`
	}
	err := t.post(ctx, "/tokenize", map[string]any{"prompt": text, "add_special_tokens": false}, &r)
	return r.Tokens, err
}

func (t *mtHTTPTokenizer) decode(ctx context.Context, ids []int) (string, error) {
	if len(ids) == 0 {
		return "", nil
	}
	var r struct {
		Prompt string `json:"prompt"`
	}
	err := t.post(ctx, "/detokenize", map[string]any{"tokens": ids}, &r)
	return r.Prompt, err
}

// mtBasePrompt is the request every generated user turn carries (the same
// sentence as vLLM's generator, so that both tools send the same workload).
const mtBasePrompt = "Please rewrite the following text and add more content: "

// mtGenerate builds conversations from a generator description. It follows
// vLLM's generator's rules: turn counts at least 2 and even (a user turn and
// its answer), a common prefix shared by every conversation's first turn, a
// per-conversation prefix (context) in the first turn, every user turn
// "<conv> is a nice number... " + the base prompt + text up to its token
// count, text windows placed so that conversations share no text.
func mtGenerate(ctx context.Context, g *mtGenSpec, tok mtTokenizer, seed uint64) ([]mtConversation, error) {
	r := rand.New(rand.NewPCG(seed, 0x6d74))
	var text []int
	for _, f := range g.textFiles {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("generate_conversations: text file: %w", err)
		}
		ids, err := tok.encode(ctx, string(b))
		if err != nil {
			return nil, err
		}
		text = append(text, ids...)
	}
	baseIDs, err := tok.encode(ctx, mtBasePrompt)
	if err != nil {
		return nil, err
	}
	window := func(lo, hi int, what string) ([]int, error) {
		if lo < 0 || hi >= len(text) || lo > hi {
			return nil, fmt.Errorf("generate_conversations: not enough text for %s (tokens %d..%d of %d): add text_files", what, lo, hi, len(text))
		}
		return text[lo:hi], nil
	}
	turns := g.turns.sample(r, g.numConversations)
	prefixes := g.prefix.sample(r, g.numConversations)
	offset := 0
	common := ""
	if n := g.commonPrefix.sample(r, 1)[0]; n > 0 {
		ids, err := window(0, max(0, n-2), "the common prefix")
		if err != nil {
			return nil, err
		}
		if common, err = tok.decode(ctx, ids); err != nil {
			return nil, err
		}
		common += "."
		offset += n
	}
	convs := make([]mtConversation, 0, g.numConversations)
	answers := map[int]string{}
	for c := 0; c < g.numConversations; c++ {
		n := max(turns[c], 2)
		n += n % 2
		in := g.inputTok.sample(r, n)
		maxIn := 0
		for i := range in {
			in[i] = max(in[i], len(baseIDs))
			maxIn = max(maxIn, in[i])
		}
		out := g.outputTok.sample(r, n)
		conv := mtConversation{id: fmt.Sprintf("CONV_ID_%d", c)}
		for t := 0; t < n; t += 2 {
			content := fmt.Sprintf("%d is a nice number... ", c)
			if t == 0 && common != "" {
				content = common + content
			}
			ids, err := tok.encode(ctx, content)
			if err != nil {
				return nil, err
			}
			left := in[t] - len(ids)
			if t == 0 && prefixes[c] > 0 {
				w, err := window(offset, offset+prefixes[c], fmt.Sprintf("conversation %d's prefix", c))
				if err != nil {
					return nil, err
				}
				s, err := tok.decode(ctx, w)
				if err != nil {
					return nil, err
				}
				content += fmt.Sprintf("%d, ", c) + s
				offset += prefixes[c]
			}
			content += mtBasePrompt
			left -= len(baseIDs)
			if left > 0 {
				lo := offset + t*maxIn
				w, err := window(lo, lo+left, fmt.Sprintf("conversation %d turn %d", c, t/2))
				if err != nil {
					return nil, err
				}
				s, err := tok.decode(ctx, w)
				if err != nil {
					return nil, err
				}
				content += s
			}
			// The answer is never sent (the server's answer is): it stands
			// in the saved workload for its token count, as in vLLM's.
			m := max(out[t+1], 1)
			ans, ok := answers[m]
			if !ok {
				w, err := window(0, m, "an answer")
				if err != nil {
					return nil, err
				}
				if ans, err = tok.decode(ctx, w); err != nil {
					return nil, err
				}
				answers[m] = ans
			}
			conv.turns = append(conv.turns, mtTurnSpec{user: content, answer: ans, maxTokens: m})
		}
		convs = append(convs, conv)
		offset += n
	}
	return convs, nil
}

// mtFromList reads a ShareGPT-converted list: a leading system message is kept
// as every request's first message; each user message is a turn, and the
// assistant message after it sets that turn's max_tokens (its token count, as
// vLLM's benchmark does with its limits taken from the dataset).
func mtFromList(ctx context.Context, items []any, tok mtTokenizer) ([]mtConversation, error) {
	seen := map[string]bool{}
	var convs []mtConversation
	for i, it := range items {
		obj, ok := it.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("conversation %d: not an object with id and messages", i)
		}
		id, ok := obj["id"].(string)
		if !ok || id == "" {
			return nil, fmt.Errorf("conversation %d: id must be a non-empty string", i)
		}
		if seen[id] {
			return nil, fmt.Errorf("conversation id %q appears more than once", id)
		}
		seen[id] = true
		msgs, ok := obj["messages"].([]any)
		if !ok || len(msgs) == 0 {
			return nil, fmt.Errorf("conversation %q: messages must be a non-empty list", id)
		}
		conv := mtConversation{id: id}
		for j, m := range msgs {
			mo, ok := m.(map[string]any)
			role, _ := mo["role"].(string)
			content, okc := mo["content"].(string)
			if !ok || !okc {
				return nil, fmt.Errorf("conversation %q message %d: want {\"role\", \"content\"} with string content", id, j)
			}
			switch {
			case role == "system" && j == 0:
				conv.system = content
			case role == "user":
				if len(conv.turns) > 0 && j > 0 {
					if prev, _ := msgs[j-1].(map[string]any); prev["role"] == "user" {
						return nil, fmt.Errorf("conversation %q message %d: two user messages in a row", id, j)
					}
				}
				conv.turns = append(conv.turns, mtTurnSpec{user: content})
			case role == "assistant":
				if len(conv.turns) == 0 || conv.turns[len(conv.turns)-1].maxTokens != 0 {
					return nil, fmt.Errorf("conversation %q message %d: an assistant message must answer a user message", id, j)
				}
				ids, err := tok.encode(ctx, content)
				if err != nil {
					return nil, err
				}
				last := &conv.turns[len(conv.turns)-1]
				last.answer, last.maxTokens = content, max(len(ids), 1)
			default:
				return nil, fmt.Errorf("conversation %q message %d: role %q (want user or assistant; system only first)", id, j, role)
			}
		}
		if len(conv.turns) == 0 {
			return nil, fmt.Errorf("conversation %q has no user message", id)
		}
		convs = append(convs, conv)
	}
	if len(convs) == 0 {
		return nil, errors.New("the conversation list is empty")
	}
	return convs, nil
}

// mtLoadWorkload reads a workload file in either format.
func mtLoadWorkload(ctx context.Context, path string, tok mtTokenizer, seed uint64) ([]mtConversation, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	switch x := v.(type) {
	case map[string]any:
		if ft, _ := x["filetype"].(string); ft != "generate_conversations" {
			return nil, fmt.Errorf("%s: an object workload needs \"filetype\": \"generate_conversations\" (got %q); a conversation list is a JSON array", path, ft)
		}
		g, err := mtParseGenSpec(x, filepath.Dir(path))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		return mtGenerate(ctx, g, tok, seed)
	case []any:
		convs, err := mtFromList(ctx, x, tok)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		return convs, nil
	default:
		return nil, fmt.Errorf("%s: want a generate_conversations object or a list of {id, messages}", path)
	}
}

// mtSaveConversations writes a workload as the list format that vLLM's
// benchmark reads: each user turn followed by its workload answer (whose token
// count sets max_tokens in both tools).
func mtSaveConversations(path string, convs []mtConversation) error {
	type msg struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	type item struct {
		ID       string `json:"id"`
		Messages []msg  `json:"messages"`
	}
	out := make([]item, 0, len(convs))
	for _, c := range convs {
		it := item{ID: c.id}
		if c.system != "" {
			it.Messages = append(it.Messages, msg{"system", c.system})
		}
		for _, t := range c.turns {
			it.Messages = append(it.Messages, msg{"user", t.user})
			if t.answer != "" {
				it.Messages = append(it.Messages, msg{"assistant", t.answer})
			}
		}
		out = append(out, it)
	}
	b, err := json.MarshalIndent(out, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}
