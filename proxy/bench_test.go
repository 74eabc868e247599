package proxy

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"
)

// BenchmarkOverhead measures, in one run, the latency of calling a fake
// decode instance directly and of the same request through the proxy (which
// adds the prefill exchange with a fake prefill instance), at 1 and 64
// concurrent requests, non-streaming and streaming. Direct and proxied
// batches alternate so that both see the same machine noise. Each b.N
// iteration issues -proxybench.requests requests of each kind; run it with
// -benchtime=1x:
//
//	go test ./proxy -run '^$' -bench Overhead -benchtime 1x -args -proxybench.requests 20000
//
// Reported metrics (microseconds): direct-p50/p99, proxy-p50/p99 and
// added-p50/p99 (proxy minus direct); for streams also the time to the first
// chunk (ttfb-*). -proxybench.delay gives the fake decode instance a service
// time: with none, 64 closed-loop clients saturate the CPU and the added
// latency measures the two extra HTTP exchanges' CPU cost under saturation
// rather than the proxy's own delay. A request that fails or returns a wrong body fails the
// benchmark.
func BenchmarkOverhead(b *testing.B) {
	for _, stream := range []bool{false, true} {
		for _, conc := range []int{1, 64} {
			name := fmt.Sprintf("stream=%v/c=%d", stream, conc)
			b.Run(name, func(b *testing.B) { benchOverhead(b, stream, conc) })
		}
	}
}

var (
	benchRequests = flag.Int("proxybench.requests", 4000, "requests of each kind (direct, proxied) per benchmark iteration")
	benchBatch    = flag.Int("proxybench.batch", 2000, "requests per alternating batch")
	benchChunks   = flag.Int("proxybench.chunks", 16, "server-sent events per streamed response")
	benchDelay    = flag.Duration("proxybench.delay", 0, "fake decode service time before its first byte (a model server's latency)")
)

func benchOverhead(b *testing.B, stream bool, conc int) {
	prefillResp := []byte(`{"id":"cmpl-p","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"length"}],` +
		`"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3,4,5,6,7,8],` +
		`"remote_engine_id":"e0","remote_request_id":"r0","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}}`)
	decodeJSON := []byte(`{"id":"cmpl-d","object":"text_completion","choices":[{"index":0,"text":"` +
		string(bytes.Repeat([]byte("tok "), 16)) + `","finish_reason":"length"}],"usage":{"prompt_tokens":64,"completion_tokens":16}}`)
	var sse bytes.Buffer
	for i := 0; i < *benchChunks; i++ {
		fmt.Fprintf(&sse, "data: {\"id\":\"cmpl-d\",\"choices\":[{\"index\":0,\"text\":\"tok%d \",\"finish_reason\":null}]}\n\n", i)
	}
	sse.WriteString("data: [DONE]\n\n")
	decodeSSE := sse.Bytes()

	serve := func(body []byte, ctype string, chunked bool, delay time.Duration) *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			if delay > 0 {
				time.Sleep(delay)
			}
			w.Header().Set("Content-Type", ctype)
			if !chunked {
				w.Header().Set("Content-Length", strconv.Itoa(len(body)))
				_, _ = w.Write(body)
				return
			}
			// One event per write and flush, as vLLM streams tokens.
			fl := w.(http.Flusher)
			rest := body
			for len(rest) > 0 {
				i := bytes.Index(rest, []byte("\n\n")) + 2
				_, _ = w.Write(rest[:i])
				fl.Flush()
				rest = rest[i:]
			}
		}))
	}
	pSrv := serve(prefillResp, "application/json", false, 0)
	defer pSrv.Close()
	var dSrv *httptest.Server
	if stream {
		dSrv = serve(decodeSSE, "text/event-stream", true, *benchDelay)
	} else {
		dSrv = serve(decodeJSON, "application/json", false, *benchDelay)
	}
	defer dSrv.Close()
	inst := func(s *httptest.Server) Instance {
		a := s.Listener.Addr().(*net.TCPAddr)
		return Instance{Host: "127.0.0.1", Port: a.Port}
	}
	px, err := New(Config{Prefill: []Instance{inst(pSrv)}, Decode: []Instance{inst(dSrv)}})
	if err != nil {
		b.Fatal(err)
	}
	defer px.Close()
	pxSrv := httptest.NewServer(px)
	defer pxSrv.Close()

	want := decodeJSON
	if stream {
		want = decodeSSE
	}
	reqBody := []byte(`{"model":"m","prompt":"` + string(bytes.Repeat([]byte("word "), 64)) + `","max_tokens":16,"stream":` +
		strconv.FormatBool(stream) + `}`)
	// Separate client transports, so that the two kinds of request do not
	// share a connection-pool lock.
	newClient := func() *http.Client {
		return &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 4 * conc, DisableCompression: true}}
	}
	directClient, proxyClient := newClient(), newClient()
	defer directClient.CloseIdleConnections()
	defer proxyClient.CloseIdleConnections()

	type sample struct{ first, total time.Duration }
	one := func(client *http.Client, url string) (sample, error) {
		start := time.Now()
		resp, err := client.Post(url, "application/json", bytes.NewReader(reqBody))
		if err != nil {
			return sample{}, err
		}
		defer resp.Body.Close()
		buf := make([]byte, 0, len(want))
		tmp := make([]byte, 4096)
		var first time.Duration
		for {
			n, rerr := resp.Body.Read(tmp)
			if n > 0 && first == 0 {
				first = time.Since(start)
			}
			buf = append(buf, tmp[:n]...)
			if rerr == io.EOF {
				break
			}
			if rerr != nil {
				return sample{}, rerr
			}
		}
		total := time.Since(start)
		if resp.StatusCode != 200 || !bytes.Equal(buf, want) {
			return sample{}, fmt.Errorf("status %d, body %.80q", resp.StatusCode, buf)
		}
		return sample{first, total}, nil
	}
	batch := func(client *http.Client, url string, n int) ([]sample, error) {
		out := make([]sample, n)
		errs := make(chan error, conc)
		var next sync.Mutex
		i := 0
		var wg sync.WaitGroup
		for g := 0; g < conc; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					next.Lock()
					k := i
					i++
					next.Unlock()
					if k >= n {
						return
					}
					s, err := one(client, url)
					if err != nil {
						errs <- err
						return
					}
					out[k] = s
				}
			}()
		}
		wg.Wait()
		close(errs)
		return out, <-errs
	}

	directURL, proxyURL := dSrv.URL+"/v1/completions", pxSrv.URL+"/v1/completions"
	// Warm up connections and code paths.
	if _, err := batch(directClient, directURL, 4*conc); err != nil {
		b.Fatalf("warm-up direct: %v", err)
	}
	if _, err := batch(proxyClient, proxyURL, 4*conc); err != nil {
		b.Fatalf("warm-up through the proxy: %v", err)
	}
	var direct, proxied []sample
	b.ResetTimer()
	for it := 0; it < b.N; it++ {
		for done := 0; done < *benchRequests; done += *benchBatch {
			n := min(*benchBatch, *benchRequests-done)
			d, err := batch(directClient, directURL, n)
			if err != nil {
				b.Fatalf("direct: %v", err)
			}
			p, err := batch(proxyClient, proxyURL, n)
			if err != nil {
				b.Fatalf("through the proxy: %v", err)
			}
			direct, proxied = append(direct, d...), append(proxied, p...)
		}
	}
	b.StopTimer()

	pct := func(s []sample, first bool, q float64) float64 {
		ds := make([]time.Duration, len(s))
		for i, x := range s {
			ds[i] = x.total
			if first {
				ds[i] = x.first
			}
		}
		sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
		k := int(q*float64(len(ds))+0.999999) - 1
		return float64(ds[max(0, min(k, len(ds)-1))]) / 1e3
	}
	for _, q := range []struct {
		name string
		v    float64
	}{{"p50", 0.50}, {"p99", 0.99}} {
		d, p := pct(direct, false, q.v), pct(proxied, false, q.v)
		b.ReportMetric(d, "direct-"+q.name+"-us")
		b.ReportMetric(p, "proxy-"+q.name+"-us")
		b.ReportMetric(p-d, "added-"+q.name+"-us")
		if stream {
			df, pf := pct(direct, true, q.v), pct(proxied, true, q.v)
			b.ReportMetric(pf-df, "ttfb-added-"+q.name+"-us")
		}
	}
	b.ReportMetric(float64(len(proxied)), "requests")
	b.ReportMetric(0, "ns/op")
}
