package main

// gonixl-bench proxy: the latency gonixl-proxy adds, measured with the
// shipped binary in its own process. See docs/BENCHMARKS.md (Proxy).
//
// Three processes: fake OpenAI upstreams (this binary re-executed with
// -role upstream: one prefill and one decode instance), the gonixl-proxy
// binary in toy mode in front of them, and this process as the closed-loop
// load generator. For every (service time, body kind, concurrency) point it
// alternates batches of requests sent to the fake decode instance directly
// and through the proxy, so both see the same machine, and reports the
// percentiles of each and their difference. Every response is compared byte
// for byte with what the decode instance sends; one failure fails the run.
//
// -routes adds peers measured in the same run against the same fakes:
// vllm-router in its vLLM P/D mode (--vllm-pd-disaggregation) beside
// gonixl-proxy. The fakes check what each route sends (proxybench_routes.go):
// a prefill request must ask for one token, without streaming, with
// kv_transfer_params asking for a remote decode, and a proxied decode request
// must carry the fake prefill's kv_transfer_params; the counts are checked
// after every batch.

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
)

func init() {
	register("proxy", "latency added by the gonixl-proxy process vs calling the upstream directly", runProxyBench)
}

// proxyPoint is one measured (service time, body, concurrency) point.
type proxyPoint struct {
	Delay       string  `json:"decode_delay"`
	Stream      bool    `json:"stream"`
	Concurrency int     `json:"concurrency"`
	Requests    int     `json:"requests_each"`
	DirectP50   float64 `json:"direct_p50_us"`
	DirectP99   float64 `json:"direct_p99_us"`
	ProxyP50    float64 `json:"proxy_p50_us"`
	ProxyP99    float64 `json:"proxy_p99_us"`
	AddedP50    float64 `json:"added_p50_us"`
	AddedP99    float64 `json:"added_p99_us"`
	FirstAdd50  float64 `json:"first_byte_added_p50_us,omitempty"`
	FirstAdd99  float64 `json:"first_byte_added_p99_us,omitempty"`
	DirectRPS   float64 `json:"direct_rps"`
	ProxyRPS    float64 `json:"proxy_rps"`
	ProxyCPUus  float64 `json:"proxy_cpu_us_per_request"`
	Met         bool    `json:"target_met"`
	LoadAverage string  `json:"loadavg_after"`
	// Routes holds every measured route, direct first; the fields above
	// are its "direct" and "gonixl" entries.
	Routes     []routeStats `json:"routes,omitempty"`
	PeerTarget *peerTarget  `json:"peer_target,omitempty"`
}

type proxyReport struct {
	Command    string       `json:"command"`
	Proxy      string       `json:"proxy_binary"`
	VLLMRouter string       `json:"vllm_router_binary,omitempty"`
	Routes     []string     `json:"routes,omitempty"`
	CPUs       int          `json:"cpus"`
	Points     []proxyPoint `json:"points"`
}

// Fake upstream bodies. The decode bodies are what the client must receive.
var (
	fakePrefillResp = []byte(`{"id":"cmpl-p","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"length"}],` +
		`"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3,4,5,6,7,8],` +
		`"remote_engine_id":"e0","remote_request_id":"r0","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}}`)
	fakeDecodeJSON = []byte(`{"id":"cmpl-d","object":"text_completion","choices":[{"index":0,"text":"` +
		strings.Repeat("tok ", 16) + `","finish_reason":"length"}],"usage":{"prompt_tokens":64,"completion_tokens":16}}`)
)

func fakeDecodeSSE(chunks int) []byte {
	var b bytes.Buffer
	for i := 0; i < chunks; i++ {
		fmt.Fprintf(&b, "data: {\"id\":\"cmpl-d\",\"choices\":[{\"index\":0,\"text\":\"tok%d \",\"finish_reason\":null}]}\n\n", i)
	}
	b.WriteString("data: [DONE]\n\n")
	return b.Bytes()
}

func runProxyBench(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("proxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var role, proxyBin, delaysS, concS, streamsS, jsonOut, proxyEnv, routesS, routerBin, routerArgs string
	var requests, batch, chunks int
	var prefillDelay, tokenGap time.Duration
	var jitter float64
	fs.StringVar(&role, "role", "bench", "bench, or upstream (internal: the fake instances)")
	fs.StringVar(&proxyBin, "proxy-bin", "", "gonixl-proxy binary (default: next to this binary, else $PATH)")
	fs.StringVar(&delaysS, "delays", "0,5ms,20ms", "fake decode service times before the first byte, one point each")
	fs.DurationVar(&prefillDelay, "prefill-delay", 0, "fake prefill service time")
	fs.DurationVar(&tokenGap, "token-interval", 0, "pause between streamed events (inter-token latency)")
	fs.Float64Var(&jitter, "jitter", 0, "service times vary uniformly by ± this fraction (0: every request takes exactly the delay, so closed-loop clients stay in lockstep)")
	fs.StringVar(&concS, "concurrency", "1,64", "closed-loop clients, one point each")
	fs.StringVar(&streamsS, "stream", "false,true", "JSON response (false) and/or server-sent events (true)")
	fs.IntVar(&requests, "requests", 20000, "requests of each kind (direct, proxied) per point")
	fs.IntVar(&batch, "batch", 2000, "requests per alternating batch")
	fs.IntVar(&chunks, "chunks", 16, "events per streamed response")
	fs.StringVar(&jsonOut, "json", "", "also write the results as JSON to this file")
	fs.StringVar(&proxyEnv, "proxy-env", "", "extra environment for the proxy process only, comma-separated K=V (e.g. GOMAXPROCS=1)")
	fs.StringVar(&routesS, "routes", "direct,gonixl", "routes to measure, comma-separated: direct (always measured: the baseline), gonixl (gonixl-proxy, toy mode), vllm-router (vllm-router --vllm-pd-disaggregation)")
	fs.StringVar(&routerBin, "vllm-router-bin", "", "vllm-router executable (default: $PATH, else .venv/bin/vllm-router of the checkout this binary was built in)")
	fs.StringVar(&routerArgs, "vllm-router-args", "--policy round_robin", "extra vllm-router arguments, space-separated (its P/D mode, --prefill, --decode, --host, --port, --log-level warning and --prometheus-port are set by the bench)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if role == "upstream" {
		return serveFakeUpstreams(stdout, prefillDelay, tokenGap, chunks)
	}
	if role != "bench" {
		return fmt.Errorf("-role %q: want bench or upstream", role)
	}
	if requests <= 0 || batch <= 0 || chunks <= 0 {
		return errors.New("-requests, -batch and -chunks must be positive")
	}
	if jitter < 0 || jitter > 1 {
		return errors.New("-jitter must be within [0, 1]")
	}
	routes, err := parseRoutes(routesS)
	if err != nil {
		return err
	}
	var bin, rbin string
	if hasRoute(routes, routeGonixl) {
		if bin, err = findProxyBinary(proxyBin); err != nil {
			return err
		}
	}
	if hasRoute(routes, routeVLLMRouter) {
		if rbin, err = findVLLMRouter(routerBin); err != nil {
			return err
		}
	}
	legacy := len(routes) == 2 && routes[1] == routeGonixl
	launch := launcher{proxyBin: bin, proxyEnv: splitList(proxyEnv), routerBin: rbin, routerArgs: strings.Fields(routerArgs)}
	var delays []time.Duration
	for _, s := range splitList(delaysS) {
		d, err := time.ParseDuration(s)
		if s == "0" {
			d, err = 0, nil
		}
		if err != nil {
			return fmt.Errorf("-delays: %w", err)
		}
		delays = append(delays, d)
	}
	var concs []int
	for _, s := range splitList(concS) {
		c, err := strconv.Atoi(s)
		if err != nil || c <= 0 {
			return fmt.Errorf("-concurrency: bad value %q", s)
		}
		concs = append(concs, c)
	}
	var streams []bool
	for _, s := range splitList(streamsS) {
		v, err := strconv.ParseBool(s)
		if err != nil {
			return fmt.Errorf("-stream: %w", err)
		}
		streams = append(streams, v)
	}

	rep := proxyReport{Command: "gonixl-bench proxy " + strings.Join(args, " "), Proxy: bin, VLLMRouter: rbin, Routes: routes, CPUs: runtime.NumCPU()}
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	if bin != "" {
		fmt.Fprintf(stdout, "gonixl-proxy %s; ", bin)
	}
	if rbin != "" {
		fmt.Fprintf(stdout, "vllm-router %s %s; ", rbin, routerArgs)
	}
	fmt.Fprintf(stdout, "%d CPUs; %d requests of each kind per point; jitter ±%.0f%%\n", runtime.NumCPU(), requests, jitter*100)
	fmt.Fprintln(stdout, "µs of latency beyond each request's upstream service time (the decode delay, which the client sets per request)")
	if legacy {
		fmt.Fprintln(tw, "delay\tbody\tc\tdirect p50\tdirect p99\tproxy p50\tproxy p99\tadded p50\tadded p99\t1st byte +p50\t1st byte +p99\tproxy req/s\tproxy CPU µs/req\ttarget\t")
	} else {
		fmt.Fprintln(tw, "delay\tbody\tc\troute\tp50\tp99\tadded p50\tadded p99\t1st byte +p50\t1st byte +p99\treq/s\tproxy CPU µs/req\t")
	}
	for _, d := range delays {
		pts, err := proxyBenchDelay(launch, routes, d, prefillDelay, tokenGap, jitter, chunks, streams, concs, requests, batch, stderr)
		if err != nil {
			return err
		}
		for _, p := range pts {
			if !legacy {
				writeRouteRows(tw, p)
				rep.Points = append(rep.Points, p)
				continue
			}
			body := "JSON"
			if p.Stream {
				body = "SSE"
			}
			first := "\t"
			if p.Stream {
				first = fmt.Sprintf("%.0f\t%.0f", p.FirstAdd50, p.FirstAdd99)
			}
			mark := "met"
			if !p.Met {
				mark = "NOT met"
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t%.0f\t%s\t%.0f\t%.0f\t%s\t\n", p.Delay, body, p.Concurrency,
				p.DirectP50, p.DirectP99, p.ProxyP50, p.ProxyP99, p.AddedP50, p.AddedP99, first, p.ProxyRPS, p.ProxyCPUus, mark)
			rep.Points = append(rep.Points, p)
		}
		_ = tw.Flush()
	}
	_ = tw.Flush()
	if legacy {
		fmt.Fprintln(stdout, "target (issue 7): added ≤ 500 µs at p50 and ≤ 2000 µs at p99, no failed request")
	} else {
		writePeerTargets(stdout, rep.Points)
	}
	if jsonOut != "" {
		b, _ := json.MarshalIndent(rep, "", "  ")
		if err := os.WriteFile(jsonOut, append(b, '\n'), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func findProxyBinary(flagVal string) (string, error) {
	if flagVal != "" {
		if _, err := os.Stat(flagVal); err != nil {
			return "", fmt.Errorf("-proxy-bin: %w", err)
		}
		return flagVal, nil
	}
	if self, err := os.Executable(); err == nil {
		cand := filepath.Join(filepath.Dir(self), "gonixl-proxy")
		if _, err := os.Stat(cand); err == nil {
			return cand, nil
		}
	}
	if p, err := exec.LookPath("gonixl-proxy"); err == nil {
		return p, nil
	}
	return "", errors.New("gonixl-proxy not found next to gonixl-bench or in $PATH (./build.sh build puts both in build/bin; or pass -proxy-bin)")
}

// serveFakeUpstreams is the upstream role: a fake prefill and a fake decode
// instance on loopback; it prints "<prefill port> <decode port>" and serves
// until its stdin closes. Each checks what it is sent (fakeCheck) and counts
// it; GET /bench/counts on either returns the counts.
func serveFakeUpstreams(stdout io.Writer, prefillDelay, gap time.Duration, chunks int) error {
	sse := fakeDecodeSSE(chunks)
	var counts fakeCounter
	serve := func(prefill bool) (net.Listener, error) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodPost {
				// Health checks (vllm-router polls /health and reads
				// /metrics at start-up) and the counts.
				if r.URL.Path == countsPath {
					w.Header().Set("Content-Type", "application/json")
					_, _ = w.Write(counts.json())
				}
				return
			}
			body, _ := io.ReadAll(r.Body)
			if err := counts.check(prefill, body); err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			delay := prefillDelay
			if !prefill {
				delay = serviceTime(body)
			}
			if delay > 0 {
				time.Sleep(delay)
			}
			if prefill || !bytes.Contains(body, []byte(`"stream":true`)) {
				out := fakeDecodeJSON
				if prefill {
					out = fakePrefillResp
				}
				w.Header().Set("Content-Type", "application/json")
				w.Header().Set("Content-Length", strconv.Itoa(len(out)))
				_, _ = w.Write(out)
				return
			}
			// One event per write and flush, as vLLM streams tokens.
			w.Header().Set("Content-Type", "text/event-stream")
			fl := w.(http.Flusher)
			for rest := sse; len(rest) > 0; {
				i := bytes.Index(rest, []byte("\n\n")) + 2
				_, _ = w.Write(rest[:i])
				fl.Flush()
				rest = rest[i:]
				if gap > 0 && len(rest) > 0 {
					time.Sleep(gap)
				}
			}
		})
		go func() { _ = (&http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}).Serve(ln) }()
		return ln, nil
	}
	pl, err := serve(true)
	if err != nil {
		return err
	}
	dl, err := serve(false)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%d %d\n", pl.Addr().(*net.TCPAddr).Port, dl.Addr().(*net.TCPAddr).Port)
	_, _ = io.Copy(io.Discard, os.Stdin) // the parent closes stdin (or dies)
	return nil
}

// serviceTimeKey carries, in each request body, the service time the fake
// decode instance must take, so the client knows it exactly and reports
// latency minus service time ("overhead") for both routes.
const serviceTimeKey = `"bench_service_us":`

func serviceTime(body []byte) time.Duration {
	i := bytes.Index(body, []byte(serviceTimeKey))
	if i < 0 {
		return 0
	}
	rest := body[i+len(serviceTimeKey):]
	n := 0
	for n < len(rest) && rest[n] >= '0' && rest[n] <= '9' {
		n++
	}
	us, _ := strconv.Atoi(string(rest[:n]))
	return time.Duration(us) * time.Microsecond
}

// child is a started helper process.
type child struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	sig   os.Signal // what stop sends; nil: os.Interrupt
}

func (c *child) stop() {
	_ = c.stdin.Close()
	sig := c.sig
	if sig == nil {
		sig = os.Interrupt
	}
	_ = c.cmd.Process.Signal(sig)
	done := make(chan struct{})
	go func() { _ = c.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = c.cmd.Process.Kill()
		<-done
	}
}

// cpuTime is a process's user+system CPU time so far, from /proc.
func cpuTime(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, errors.New("bad /proc stat")
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, errors.New("bad /proc stat")
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * time.Second / 100, nil // USER_HZ is 100 on Linux
}

func proxyBenchDelay(l launcher, routeNames []string, delay, prefillDelay, gap time.Duration, jitter float64, chunks int, streams []bool,
	concs []int, requests, batch int, stderr io.Writer) ([]proxyPoint, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	up := exec.Command(self, "proxy", "-role", "upstream",
		"-prefill-delay", prefillDelay.String(), "-token-interval", gap.String(), "-chunks", strconv.Itoa(chunks))
	up.Stderr = stderr
	upIn, err := up.StdinPipe()
	if err != nil {
		return nil, err
	}
	upOut, err := up.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := up.Start(); err != nil {
		return nil, err
	}
	upstream := &child{cmd: up, stdin: upIn}
	defer upstream.stop()
	var pPort, dPort int
	line, err := bufio.NewReader(upOut).ReadString('\n')
	if err != nil {
		return nil, fmt.Errorf("fake upstreams did not start: %w", err)
	}
	if _, err := fmt.Sscanf(line, "%d %d", &pPort, &dPort); err != nil {
		return nil, fmt.Errorf("fake upstreams said %q: %w", line, err)
	}

	var routes []benchRoute
	for _, name := range routeNames {
		rt, proc, err := l.start(name, pPort, dPort, stderr)
		if err != nil {
			return nil, err
		}
		if proc != nil {
			defer proc.stop()
		}
		routes = append(routes, rt)
	}
	counts := func() (fakeCounts, error) {
		return readFakeCounts(fmt.Sprintf("http://127.0.0.1:%d%s", dPort, countsPath))
	}

	var out []proxyPoint
	for _, stream := range streams {
		want := fakeDecodeJSON
		if stream {
			want = fakeDecodeSSE(chunks)
		}
		head := `{"model":"m","prompt":"` + strings.Repeat("word ", 64) + `","max_tokens":16,"stream":` +
			strconv.FormatBool(stream) + `,` + serviceTimeKey
		// Request k's service time: the delay, varied by ± jitter with a
		// fixed sequence, so both routes see the same service times.
		svc := func(k int) time.Duration {
			if jitter == 0 {
				return delay
			}
			u := rand.New(rand.NewPCG(uint64(k), 7)).Float64()
			return time.Duration(float64(delay) * (1 + jitter*(2*u-1)))
		}
		reqBody := func(k int) ([]byte, time.Duration) {
			d := svc(k)
			return []byte(head + strconv.FormatInt(d.Microseconds(), 10) + `}`), d.Truncate(time.Microsecond)
		}
		for _, conc := range concs {
			pt, err := measureRoutes(routes, counts, reqBody, want, conc, requests, batch)
			if err != nil {
				return nil, fmt.Errorf("delay %v stream=%v c=%d: %w", delay, stream, conc, err)
			}
			pt.Delay, pt.Stream = delay.String(), stream
			out = append(out, pt)
		}
	}
	return out, nil
}

func waitHTTP(url string, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		resp, err := http.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return nil
			}
			err = fmt.Errorf("HTTP %d", resp.StatusCode)
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

type latSample struct{ first, total time.Duration }

// measureRoutes measures one (service time, body, concurrency) point on
// every route: batches of each route in turn (the order rotating from batch
// to batch), so that all see the same machine. routes[0] is the direct
// route, the baseline of every "added" figure.
func measureRoutes(routes []benchRoute, counts func() (fakeCounts, error), reqBody func(int) ([]byte, time.Duration), want []byte,
	conc, requests, batch int) (proxyPoint, error) {
	// One client transport per route so that routes do not share a
	// connection-pool lock.
	clients := make([]*http.Client, len(routes))
	for i := range clients {
		clients[i] = &http.Client{Timeout: time.Minute, Transport: &http.Transport{
			Proxy: nil, MaxIdleConnsPerHost: 4 * conc, DisableCompression: true}}
		defer clients[i].CloseIdleConnections()
	}

	one := func(client *http.Client, url string, k int, tmp []byte) (latSample, error) {
		body, svc := reqBody(k)
		start := time.Now()
		resp, err := client.Post(url, "application/json", bytes.NewReader(body))
		if err != nil {
			return latSample{}, err
		}
		defer resp.Body.Close()
		got := make([]byte, 0, len(want))
		var first time.Duration
		for {
			n, rerr := resp.Body.Read(tmp)
			if n > 0 && first == 0 {
				first = time.Since(start)
			}
			got = append(got, tmp[:n]...)
			if rerr == io.EOF {
				break
			}
			if rerr != nil {
				return latSample{}, rerr
			}
		}
		total := time.Since(start)
		if resp.StatusCode != 200 || !bytes.Equal(got, want) {
			return latSample{}, fmt.Errorf("status %d, body %.80q", resp.StatusCode, got)
		}
		return latSample{first - svc, total - svc}, nil
	}
	run := func(client *http.Client, url string, base, n int) ([]latSample, time.Duration, error) {
		out := make([]latSample, n)
		var mu sync.Mutex
		next := 0
		var firstErr error
		var wg sync.WaitGroup
		start := time.Now()
		for g := 0; g < conc; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				tmp := make([]byte, 4096)
				for {
					mu.Lock()
					k := next
					next++
					stop := firstErr != nil
					mu.Unlock()
					if k >= n || stop {
						return
					}
					s, err := one(client, url, base+k, tmp)
					if err != nil {
						mu.Lock()
						if firstErr == nil {
							firstErr = err
						}
						mu.Unlock()
						return
					}
					out[k] = s
				}
			}()
		}
		wg.Wait()
		return out, time.Since(start), firstErr
	}
	// Warm up connections and code paths on every route.
	for i, rt := range routes {
		if _, _, err := run(clients[i], rt.url, 1<<30, 4*conc); err != nil {
			return proxyPoint{}, fmt.Errorf("warm-up %s (%s): %w", rt.name, rt.url, err)
		}
	}
	samples := make([][]latSample, len(routes))
	elapsed := make([]time.Duration, len(routes))
	cpu := make([]time.Duration, len(routes))
	for done, b := 0, 0; done < requests; done, b = done+batch, b+1 {
		n := min(batch, requests-done)
		for j := range routes {
			i := (j + b) % len(routes)
			rt := routes[i]
			before, err := counts()
			if err != nil {
				return proxyPoint{}, err
			}
			var c0 time.Duration
			if rt.pid > 0 {
				c0, _ = cpuTime(rt.pid)
			}
			s, el, err := run(clients[i], rt.url, done, n)
			if err != nil {
				return proxyPoint{}, fmt.Errorf("%s: %w", rt.describe(), err)
			}
			if rt.pid > 0 {
				c1, _ := cpuTime(rt.pid)
				cpu[i] += c1 - c0
			}
			after, err := counts()
			if err != nil {
				return proxyPoint{}, err
			}
			if err := after.sub(before).expect(rt.proxied, n); err != nil {
				return proxyPoint{}, fmt.Errorf("%s: %w", rt.describe(), err)
			}
			elapsed[i] += el
			samples[i] = append(samples[i], s...)
		}
	}
	pt := summarizeRoutes(routes, samples, elapsed, cpu)
	pt.Concurrency = conc
	return pt, nil
}

// summarizeRoutes computes each route's percentiles (µs, through the
// transfer benchmark's pct), its difference from the direct route
// (routes[0]), and the legacy direct/proxy fields.
func summarizeRoutes(routes []benchRoute, samples [][]latSample, elapsed, cpu []time.Duration) proxyPoint {
	lat := func(s []latSample, first bool, q float64) float64 {
		ns := make([]int64, len(s))
		for i, x := range s {
			ns[i] = int64(x.total)
			if first {
				ns[i] = int64(x.first)
			}
		}
		return pct(ns, q)
	}
	pt := proxyPoint{}
	d := samples[0]
	for i, rt := range routes {
		s := samples[i]
		rs := routeStats{Route: rt.name, Requests: len(s), P50: lat(s, false, 0.5), P99: lat(s, false, 0.99)}
		rs.AddedP50, rs.AddedP99 = rs.P50-lat(d, false, 0.5), rs.P99-lat(d, false, 0.99)
		rs.FirstAdd50 = lat(s, true, 0.5) - lat(d, true, 0.5)
		rs.FirstAdd99 = lat(s, true, 0.99) - lat(d, true, 0.99)
		if elapsed[i] > 0 {
			rs.RPS = float64(len(s)) / elapsed[i].Seconds()
		}
		if rt.pid > 0 && len(s) > 0 {
			rs.CPUus = float64(cpu[i].Microseconds()) / float64(len(s))
		}
		pt.Routes = append(pt.Routes, rs)
		switch rt.name {
		case routeDirect:
			pt.DirectP50, pt.DirectP99, pt.DirectRPS = rs.P50, rs.P99, rs.RPS
		case routeGonixl:
			pt.Requests = rs.Requests
			pt.ProxyP50, pt.ProxyP99, pt.ProxyRPS, pt.ProxyCPUus = rs.P50, rs.P99, rs.RPS, rs.CPUus
			pt.AddedP50, pt.AddedP99, pt.FirstAdd50, pt.FirstAdd99 = rs.AddedP50, rs.AddedP99, rs.FirstAdd50, rs.FirstAdd99
			pt.Met = pt.AddedP50 <= 500 && pt.AddedP99 <= 2000
		}
	}
	if pt.Requests == 0 {
		pt.Requests = len(d)
	}
	pt.PeerTarget = comparePeers(pt.Routes)
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		pt.LoadAverage = strings.Join(strings.Fields(string(b))[:3], " ")
	}
	return pt
}
