package main

// The routes of gonixl-bench proxy: the fake decode called directly,
// gonixl-proxy in toy mode, and vllm-router in its vLLM P/D mode, each a
// process of its own in front of the same fake instances; and the fakes'
// checks of what each route sends them.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"
)

const (
	routeDirect     = "direct"
	routeGonixl     = "gonixl"
	routeVLLMRouter = "vllm-router"
)

// parseRoutes reads -routes: known names, no repeats, and the direct route
// first (added even when not named: it is every comparison's baseline).
func parseRoutes(s string) ([]string, error) {
	out := []string{routeDirect}
	for _, r := range splitList(s) {
		switch r {
		case routeDirect:
			continue
		case routeGonixl, routeVLLMRouter:
		default:
			return nil, fmt.Errorf("-routes: unknown route %q (want direct, gonixl, vllm-router)", r)
		}
		if hasRoute(out, r) {
			return nil, fmt.Errorf("-routes: %q named twice", r)
		}
		out = append(out, r)
	}
	return out, nil
}

func hasRoute(routes []string, r string) bool {
	for _, x := range routes {
		if x == r {
			return true
		}
	}
	return false
}

// benchRoute is a started route.
type benchRoute struct {
	name    string
	url     string // the completions URL clients post to
	pid     int    // the proxy process whose CPU time is charged to the route; 0: none
	proxied bool   // requests go through a prefill, then the decode
}

func (r benchRoute) describe() string {
	if r.name == routeDirect {
		return "direct"
	}
	return "through " + r.name
}

// routeStats is one route's figures at one point (µs beyond the service
// time; "added" is relative to the direct route).
type routeStats struct {
	Route      string  `json:"route"`
	Requests   int     `json:"requests"`
	P50        float64 `json:"p50_us"`
	P99        float64 `json:"p99_us"`
	AddedP50   float64 `json:"added_p50_us"`
	AddedP99   float64 `json:"added_p99_us"`
	FirstAdd50 float64 `json:"first_byte_added_p50_us"`
	FirstAdd99 float64 `json:"first_byte_added_p99_us"`
	RPS        float64 `json:"rps"`
	CPUus      float64 `json:"proxy_cpu_us_per_request,omitempty"`
}

// peerTarget is issue 19's comparison of gonixl-proxy with vllm-router at
// one point: gonixl's added p50 at most half the router's, and its
// throughput at least the router's.
type peerTarget struct {
	AddedP50Ratio float64 `json:"gonixl_over_router_added_p50"`
	RPSRatio      float64 `json:"gonixl_over_router_rps"`
	P50Met        bool    `json:"added_p50_met"`
	RPSMet        bool    `json:"rps_met"`
}

// comparePeers is nil unless both gonixl and vllm-router were measured.
func comparePeers(rs []routeStats) *peerTarget {
	var g, v *routeStats
	for i := range rs {
		switch rs[i].Route {
		case routeGonixl:
			g = &rs[i]
		case routeVLLMRouter:
			v = &rs[i]
		}
	}
	if g == nil || v == nil {
		return nil
	}
	t := &peerTarget{P50Met: g.AddedP50 <= 0.5*v.AddedP50, RPSMet: g.RPS >= v.RPS}
	if v.AddedP50 != 0 {
		t.AddedP50Ratio = g.AddedP50 / v.AddedP50
	}
	if v.RPS != 0 {
		t.RPSRatio = g.RPS / v.RPS
	}
	return t
}

func writeRouteRows(tw *tabwriter.Writer, p proxyPoint) {
	body := "JSON"
	if p.Stream {
		body = "SSE"
	}
	for _, r := range p.Routes {
		added, first, cpu := "\t", "\t", ""
		if r.Route != routeDirect {
			added = fmt.Sprintf("%.0f\t%.0f", r.AddedP50, r.AddedP99)
			if p.Stream {
				first = fmt.Sprintf("%.0f\t%.0f", r.FirstAdd50, r.FirstAdd99)
			}
			cpu = fmt.Sprintf("%.0f", r.CPUus)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%.0f\t%.0f\t%s\t%s\t%.0f\t%s\t\n", p.Delay, body, p.Concurrency, r.Route,
			r.P50, r.P99, added, first, r.RPS, cpu)
	}
}

func writePeerTargets(w io.Writer, pts []proxyPoint) {
	shown := false
	for _, p := range pts {
		t := p.PeerTarget
		if t == nil {
			continue
		}
		if !shown {
			fmt.Fprintln(w, "issue 19 targets: gonixl-proxy's added p50 ≤ 0.5 × vllm-router's; its req/s ≥ vllm-router's at 64 concurrent; no failed request")
			shown = true
		}
		body := "JSON"
		if p.Stream {
			body = "SSE"
		}
		mark := func(ok bool) string {
			if ok {
				return "met"
			}
			return "NOT met"
		}
		rps := fmt.Sprintf("req/s ratio %.2f (%s)", t.RPSRatio, mark(t.RPSMet))
		if p.Concurrency < 64 {
			rps = fmt.Sprintf("req/s ratio %.2f", t.RPSRatio)
		}
		fmt.Fprintf(w, "  %s %s c=%d: added p50 ratio %.2f (%s); %s\n", p.Delay, body, p.Concurrency, t.AddedP50Ratio, mark(t.P50Met), rps)
	}
	if !shown {
		fmt.Fprintln(w, "no failed request")
	}
}

// launcher starts the proxy processes of the routes.
type launcher struct {
	proxyBin   string
	proxyEnv   []string
	routerBin  string
	routerArgs []string
}

// start starts route name in front of the fakes at pPort (prefill) and
// dPort (decode). The process, when there is one, is the caller's to stop.
func (l launcher) start(name string, pPort, dPort int, stderr io.Writer) (benchRoute, *child, error) {
	if name == routeDirect {
		return benchRoute{name: name, url: fmt.Sprintf("http://127.0.0.1:%d/v1/completions", dPort)}, nil, nil
	}
	port, err := freePort()
	if err != nil {
		return benchRoute{}, nil, err
	}
	prefill, decode := fmt.Sprintf("http://127.0.0.1:%d", pPort), fmt.Sprintf("http://127.0.0.1:%d", dPort)
	var cmd *exec.Cmd
	var health string
	limit := 10 * time.Second
	switch name {
	case routeGonixl:
		cmd = exec.Command(l.proxyBin, "--host", "127.0.0.1", "--port", strconv.Itoa(port),
			"--prefiller-host", "127.0.0.1", "--prefiller-port", strconv.Itoa(pPort),
			"--decoder-host", "127.0.0.1", "--decoder-port", strconv.Itoa(dPort), "--log-level", "warn")
		cmd.Env = append(os.Environ(), l.proxyEnv...)
		health = "/healthcheck"
	case routeVLLMRouter:
		mport, err := freePort()
		if err != nil {
			return benchRoute{}, nil, err
		}
		cmd = exec.Command(l.routerBin, vllmRouterArgs(prefill, decode, port, mport, l.routerArgs)...)
		health = "/health"
		limit = 120 * time.Second // a Python start-up, then its first worker health checks
	default:
		return benchRoute{}, nil, fmt.Errorf("unknown route %q", name)
	}
	cmd.Stderr = stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return benchRoute{}, nil, err
	}
	if err := cmd.Start(); err != nil {
		return benchRoute{}, nil, fmt.Errorf("starting %s: %w", name, err)
	}
	proc := &child{cmd: cmd, stdin: in}
	if name == routeVLLMRouter {
		// Its Python launcher prints a traceback on SIGINT.
		proc.sig = syscall.SIGTERM
	}
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	if err := waitHTTP(base+health, limit); err != nil {
		proc.stop()
		return benchRoute{}, nil, fmt.Errorf("%s did not come up: %w", name, err)
	}
	return benchRoute{name: name, url: base + "/v1/completions", pid: cmd.Process.Pid, proxied: true}, proc, nil
}

// vllmRouterArgs is the vllm-router command line of the bench: vLLM P/D
// mode with one prefill and one decode, its own logging at warning (as
// gonixl-proxy's at warn) and its metrics on a free port, then extra.
func vllmRouterArgs(prefill, decode string, port, metricsPort int, extra []string) []string {
	a := []string{"--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
		"--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"--log-level", "warning", "--prometheus-host", "127.0.0.1", "--prometheus-port", strconv.Itoa(metricsPort)}
	return append(a, extra...)
}

// findVLLMRouter: the flag, else vllm-router on $PATH, else the .venv of
// the checkout whose build/bin holds this binary (./build.sh setup installs
// it there from requirements.lock).
func findVLLMRouter(flagVal string) (string, error) {
	if flagVal != "" {
		if _, err := os.Stat(flagVal); err != nil {
			return "", fmt.Errorf("-vllm-router-bin: %w", err)
		}
		return flagVal, nil
	}
	if p, err := exec.LookPath("vllm-router"); err == nil {
		return p, nil
	}
	if self, err := os.Executable(); err == nil {
		cand := filepath.Join(filepath.Dir(self), "..", "..", ".venv", "bin", "vllm-router")
		if _, err := os.Stat(cand); err == nil {
			return filepath.Clean(cand), nil
		}
	}
	return "", errors.New("vllm-router not found in $PATH or .venv/bin (./build.sh setup installs it; or pass -vllm-router-bin)")
}

// countsPath is where the fakes report what they were sent.
const countsPath = "/bench/counts"

// fakeCounts: requests the fakes answered, by kind, and those they refused.
type fakeCounts struct {
	Prefill          int64  `json:"prefill"`
	DecodeWithParams int64  `json:"decode_with_params"`
	DecodePlain      int64  `json:"decode_plain"`
	Rejected         int64  `json:"rejected"`
	LastRejection    string `json:"last_rejection,omitempty"`
}

func (c fakeCounts) sub(o fakeCounts) fakeCounts {
	return fakeCounts{Prefill: c.Prefill - o.Prefill, DecodeWithParams: c.DecodeWithParams - o.DecodeWithParams,
		DecodePlain: c.DecodePlain - o.DecodePlain, Rejected: c.Rejected - o.Rejected, LastRejection: c.LastRejection}
}

// expect checks a batch of n requests' counts: a proxied route sent each
// to the prefill, then to the decode with the prefill's params; the direct
// route sent each to the decode alone, without params.
func (c fakeCounts) expect(proxied bool, n int) error {
	want := fakeCounts{DecodePlain: int64(n)}
	if proxied {
		want = fakeCounts{Prefill: int64(n), DecodeWithParams: int64(n)}
	}
	want.LastRejection = c.LastRejection
	if c != want {
		return fmt.Errorf("the fakes counted %+v for %d requests, want %+v", c, n, want)
	}
	return nil
}

func readFakeCounts(url string) (fakeCounts, error) {
	var c fakeCounts
	resp, err := http.Get(url)
	if err != nil {
		return c, err
	}
	defer resp.Body.Close()
	err = json.NewDecoder(resp.Body).Decode(&c)
	return c, err
}

// fakeCounter is the fakes' side of fakeCounts.
type fakeCounter struct {
	prefill, withParams, plain, rejected atomic.Int64
	last                                 atomic.Value // string
}

func (f *fakeCounter) json() []byte {
	c := fakeCounts{Prefill: f.prefill.Load(), DecodeWithParams: f.withParams.Load(), DecodePlain: f.plain.Load(), Rejected: f.rejected.Load()}
	if s, ok := f.last.Load().(string); ok {
		c.LastRejection = s
	}
	b, _ := json.Marshal(c)
	return b
}

// check counts a request to the fake prefill or decode, or refuses it.
func (f *fakeCounter) check(prefill bool, body []byte) error {
	var err error
	if prefill {
		err = checkPrefillRequest(body)
	} else {
		var withParams bool
		if withParams, err = checkDecodeRequest(body); err == nil {
			if withParams {
				f.withParams.Add(1)
			} else {
				f.plain.Add(1)
			}
		}
	}
	if err != nil {
		f.rejected.Add(1)
		f.last.Store(err.Error())
		return err
	}
	if prefill {
		f.prefill.Add(1)
	}
	return nil
}

// checkPrefillRequest: what a vLLM prefill behind a P/D proxy must be sent
// for the NixlConnector protocol: one token, no stream, and
// kv_transfer_params asking for a remote decode.
func checkPrefillRequest(body []byte) error {
	var r struct {
		MaxTokens *int  `json:"max_tokens"`
		Stream    *bool `json:"stream"`
		Params    *struct {
			DoRemoteDecode  bool `json:"do_remote_decode"`
			DoRemotePrefill bool `json:"do_remote_prefill"`
		} `json:"kv_transfer_params"`
		StreamOptions json.RawMessage `json:"stream_options"`
	}
	if err := json.Unmarshal(body, &r); err != nil {
		return fmt.Errorf("prefill: body is not JSON: %v", err)
	}
	switch {
	case r.MaxTokens == nil || *r.MaxTokens != 1:
		return errors.New("prefill: max_tokens is not 1")
	case r.Stream != nil && *r.Stream:
		return errors.New("prefill: stream is true")
	case r.StreamOptions != nil:
		return errors.New("prefill: stream_options without stream")
	case r.Params == nil || !r.Params.DoRemoteDecode || r.Params.DoRemotePrefill:
		return errors.New("prefill: kv_transfer_params do not ask for a remote decode")
	}
	return nil
}

// checkDecodeRequest: a decode request carries no kv_transfer_params
// (direct) or exactly the fake prefill's (proxied); withParams says which.
func checkDecodeRequest(body []byte) (withParams bool, err error) {
	i := strings.Index(string(body), `"kv_transfer_params"`)
	if i < 0 {
		return false, nil
	}
	var r struct {
		Params map[string]any `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(body, &r); err != nil {
		return false, fmt.Errorf("decode: body is not JSON: %v", err)
	}
	if !sameJSON(r.Params, fakePrefillParams()) {
		return false, fmt.Errorf("decode: kv_transfer_params %v are not the prefill's", r.Params)
	}
	return true, nil
}

// fakePrefillParams is the kv_transfer_params object of fakePrefillResp.
func fakePrefillParams() map[string]any {
	var r struct {
		Params map[string]any `json:"kv_transfer_params"`
	}
	_ = json.Unmarshal(fakePrefillResp, &r)
	return r.Params
}

func sameJSON(a, b any) bool {
	x, err1 := json.Marshal(a)
	y, err2 := json.Marshal(b)
	return err1 == nil && err2 == nil && string(x) == string(y)
}
