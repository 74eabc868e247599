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
