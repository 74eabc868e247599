package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestServiceTime(t *testing.T) {
	for body, want := range map[string]time.Duration{
		`{"stream":true,"bench_service_us":2500}`: 2500 * time.Microsecond,
		`{"bench_service_us":0}`:                  0,
		`{"model":"m"}`:                           0,
	} {
		if got := serviceTime([]byte(body)); got != want {
			t.Errorf("serviceTime(%s) = %v, want %v", body, got, want)
		}
	}
}

// A small real run: the gonixl-proxy binary (built here) in front of the
// fake instances, both bodies, with a service time the report must subtract.
func TestProxyBenchSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("builds gonixl-proxy; skipped with -short")
	}
	bin := filepath.Join(t.TempDir(), "gonixl-proxy")
	build := exec.Command("go", "build", "-o", bin, "github.com/gonixl/gonixl/cmd/gonixl-proxy")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build gonixl-proxy: %v\n%s", err, out)
	}
	js := filepath.Join(t.TempDir(), "p.json")
	var out, errb bytes.Buffer
	err := runProxyBench([]string{"-proxy-bin", bin, "-requests", "40", "-batch", "20", "-delays", "3ms",
		"-jitter", "0.5", "-concurrency", "1,4", "-json", js}, &out, &errb)
	if err != nil {
		t.Fatalf("%v\n%s\n%s", err, out.String(), errb.String())
	}
	var rep proxyReport
	b, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Points) != 4 {
		t.Fatalf("want 4 points (2 bodies x 2 concurrencies), got %d\n%s", len(rep.Points), out.String())
	}
	for _, p := range rep.Points {
		// Latencies are reported beyond the 1.5-4.5 ms service time: a
		// report that forgot to subtract it would show >= 1500 µs at p50.
		if p.Requests != 40 || p.DirectP50 <= 0 || p.ProxyP50 <= 0 || p.DirectP50 >= 1500 || p.ProxyRPS <= 0 {
			t.Errorf("implausible point %+v", p)
		}
	}
	if !strings.Contains(out.String(), "added p50") {
		t.Errorf("no table in output:\n%s", out.String())
	}
}

func TestParseRoutes(t *testing.T) {
	for in, want := range map[string]string{
		"direct,gonixl":             "direct,gonixl",
		"gonixl":                    "direct,gonixl",
		"vllm-router, gonixl":       "direct,vllm-router,gonixl",
		"direct,gonixl,vllm-router": "direct,gonixl,vllm-router",
		"":                          "direct",
	} {
		got, err := parseRoutes(in)
		if err != nil || strings.Join(got, ",") != want {
			t.Errorf("parseRoutes(%q) = %v, %v; want %s", in, got, err, want)
		}
	}
	for _, bad := range []string{"gonixl,gonixl", "nginx", "direct,vllm_router"} {
		if _, err := parseRoutes(bad); err == nil {
			t.Errorf("parseRoutes(%q): no error", bad)
		}
	}
}

func TestVLLMRouterArgs(t *testing.T) {
	got := strings.Join(vllmRouterArgs("http://127.0.0.1:1", "http://127.0.0.1:2", 3, 4, []string{"--policy", "round_robin"}), " ")
	want := "--vllm-pd-disaggregation --prefill http://127.0.0.1:1 --decode http://127.0.0.1:2 --host 127.0.0.1 --port 3 " +
		"--log-level warning --prometheus-host 127.0.0.1 --prometheus-port 4 --policy round_robin"
	if got != want {
		t.Errorf("got  %s\nwant %s", got, want)
	}
}

// The fake prefill accepts what gonixl-proxy and vllm-router 0.1.17 send
// (bodies as each sent them) and refuses what would not make vLLM's
// prefill hand its KV to a decode.
func TestCheckPrefillRequest(t *testing.T) {
	ok := []string{
		// gonixl-proxy, toy mode
		`{"model":"m","prompt":"a","max_tokens":1,"stream":false,"bench_service_us":0,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`,
		// vllm-router --vllm-pd-disaggregation
		`{"model":"m","prompt":"a","max_tokens":1,"stream":false,"echo":false,"no_stop_trim":false,"ignore_eos":false,"skip_special_tokens":true,"return_hidden_states":false,"min_tokens":1,"bench_service_us":0,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`,
	}
	for _, b := range ok {
		if err := checkPrefillRequest([]byte(b)); err != nil {
			t.Errorf("%s: %v", b, err)
		}
	}
	bad := []string{
		`{"max_tokens":16,"stream":false,"kv_transfer_params":{"do_remote_decode":true}}`,
		`{"max_tokens":1,"stream":true,"kv_transfer_params":{"do_remote_decode":true}}`,
		`{"max_tokens":1,"stream_options":{"include_usage":true},"kv_transfer_params":{"do_remote_decode":true}}`,
		`{"max_tokens":1}`,
		`{"max_tokens":1,"kv_transfer_params":{"do_remote_decode":false}}`,
		`not json`,
	}
	for _, b := range bad {
		if err := checkPrefillRequest([]byte(b)); err == nil {
			t.Errorf("%s: accepted", b)
		}
	}
}

func TestCheckDecodeRequest(t *testing.T) {
	params := fakePrefillParams()
	if params["remote_engine_id"] != "e0" {
		t.Fatalf("fakePrefillParams = %v", params)
	}
	pj, _ := json.Marshal(params)
	for body, want := range map[string]bool{
		`{"model":"m","prompt":"a","max_tokens":16,"bench_service_us":5}`:                                 false,
		`{"model":"m","prompt":"a","max_tokens":16,"echo":false,"kv_transfer_params":` + string(pj) + `}`: true,
		`{"kv_transfer_params":{"tp_size":1,"remote_port":5600,"remote_host":"127.0.0.1","remote_request_id":"r0",` +
			`"remote_engine_id":"e0","remote_block_ids":[1,2,3,4,5,6,7,8],"do_remote_decode":false,"do_remote_prefill":true}}`: true,
	} {
		got, err := checkDecodeRequest([]byte(body))
		if err != nil || got != want {
			t.Errorf("%s: %v, %v; want %v", body, got, err, want)
		}
	}
	for _, b := range []string{
		`{"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"other"}}`,
		`{"kv_transfer_params":null}`,
	} {
		if _, err := checkDecodeRequest([]byte(b)); err == nil {
			t.Errorf("%s: accepted", b)
		}
	}
}

func TestFakeCounts(t *testing.T) {
	var f fakeCounter
	prefill := []byte(`{"max_tokens":1,"stream":false,"kv_transfer_params":{"do_remote_decode":true}}`)
	pj, _ := json.Marshal(fakePrefillParams())
	for i := 0; i < 3; i++ {
		if err := f.check(true, prefill); err != nil {
			t.Fatal(err)
		}
		if err := f.check(false, []byte(`{"kv_transfer_params":`+string(pj)+`}`)); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.check(false, []byte(`{"max_tokens":16}`)); err != nil {
		t.Fatal(err)
	}
	if f.check(true, []byte(`{"max_tokens":16}`)) == nil {
		t.Fatal("a prefill request without max_tokens 1 was accepted")
	}
	var c fakeCounts
	if err := json.Unmarshal(f.json(), &c); err != nil {
		t.Fatal(err)
	}
	if c.Prefill != 3 || c.DecodeWithParams != 3 || c.DecodePlain != 1 || c.Rejected != 1 || !strings.Contains(c.LastRejection, "max_tokens") {
		t.Fatalf("counts %+v", c)
	}
	proxied := fakeCounts{Prefill: 3, DecodeWithParams: 3}
	if err := proxied.expect(true, 3); err != nil {
		t.Error(err)
	}
	if err := proxied.expect(false, 3); err == nil {
		t.Error("proxied counts passed as direct")
	}
	if err := (fakeCounts{DecodePlain: 2}).expect(false, 2); err != nil {
		t.Error(err)
	}
	if err := (fakeCounts{DecodePlain: 2, Rejected: 1}).expect(false, 2); err == nil {
		t.Error("a rejection passed")
	}
	if err := (fakeCounts{Prefill: 2, DecodePlain: 2}).expect(true, 2); err == nil {
		t.Error("a decode without the prefill's params passed")
	}
}

func TestComparePeers(t *testing.T) {
	rs := []routeStats{{Route: "direct", RPS: 1000}, {Route: "gonixl", AddedP50: 100, RPS: 900}, {Route: "vllm-router", AddedP50: 300, RPS: 800}}
	pt := comparePeers(rs)
	if pt == nil || !pt.P50Met || !pt.RPSMet || pt.AddedP50Ratio < 0.33 || pt.AddedP50Ratio > 0.34 || pt.RPSRatio != 900.0/800 {
		t.Fatalf("%+v", pt)
	}
	rs[1].AddedP50, rs[1].RPS = 200, 700
	if pt = comparePeers(rs); pt.P50Met || pt.RPSMet {
		t.Fatalf("%+v", pt)
	}
	if comparePeers(rs[:2]) != nil {
		t.Fatal("a comparison without vllm-router")
	}
}

// A small real run of every route: the gonixl-proxy binary built here and
// the vllm-router of the project's .venv (skipped without it).
func TestProxyBenchRoutesSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("builds gonixl-proxy and starts vllm-router; skipped with -short")
	}
	router, err := filepath.Abs(filepath.Join("..", "..", ".venv", "bin", "vllm-router"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(router); err != nil {
		t.Skipf("no vllm-router in .venv (./build.sh setup installs it): %v", err)
	}
	bin := filepath.Join(t.TempDir(), "gonixl-proxy")
	build := exec.Command("go", "build", "-o", bin, "github.com/gonixl/gonixl/cmd/gonixl-proxy")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build gonixl-proxy: %v\n%s", err, out)
	}
	js := filepath.Join(t.TempDir(), "p.json")
	var out, errb bytes.Buffer
	err = runProxyBench([]string{"-proxy-bin", bin, "-vllm-router-bin", router, "-routes", "direct,gonixl,vllm-router",
		"-requests", "20", "-batch", "10", "-delays", "5ms", "-concurrency", "2", "-json", js}, &out, &errb)
	if err != nil {
		t.Fatalf("%v\n%s\n%s", err, out.String(), errb.String())
	}
	var rep proxyReport
	b, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Points) != 2 || strings.Join(rep.Routes, ",") != "direct,gonixl,vllm-router" {
		t.Fatalf("want 2 points over 3 routes, got %d over %v\n%s", len(rep.Points), rep.Routes, out.String())
	}
	for _, p := range rep.Points {
		if len(p.Routes) != 3 || p.PeerTarget == nil {
			t.Fatalf("point %+v", p)
		}
		for _, r := range p.Routes {
			// Beyond the 5 ms service time: a report that forgot to
			// subtract it would show >= 5000 µs at p50.
			if r.Requests != 20 || r.P50 <= 0 || r.P50 >= 5000 || r.RPS <= 0 {
				t.Errorf("implausible %s figures %+v", r.Route, r)
			}
		}
	}
	if !strings.Contains(out.String(), "issue 19 targets") {
		t.Errorf("no peer comparison in output:\n%s", out.String())
	}
}
