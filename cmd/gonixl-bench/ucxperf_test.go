package main

import (
	"math"
	"testing"
)

func TestParsePerftestCSV(t *testing.T) {
	out := "+---+\nsome banner\niterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n2000,53.468,108.634,108.634,9205.22,9000.00,9205,9205\n"
	got, err := parsePerftestCSV(out)
	if err != nil {
		t.Fatal(err)
	}
	if want := 9000.0 * (1 << 20) / 1e9; math.Abs(got-want) > 1e-9 {
		t.Errorf("got %v GB/s, want %v (overall_bw in MiB/s)", got, want)
	}
	if _, err := parsePerftestCSV("ERROR: connect failed\n"); err == nil {
		t.Error("no result line accepted")
	}
}

func TestPerftestFor(t *testing.T) {
	if bin, env := perftestFor("/x/ucx_perftest", "/usr/lib/libucp.so.0"); bin != "/x/ucx_perftest" || env != nil {
		t.Errorf("explicit: %s %v", bin, env)
	}
	if bin, env := perftestFor("", "/usr/lib/x86_64-linux-gnu/libucp.so.0"); bin != "ucx_perftest" || env != nil {
		t.Errorf("system: %s %v", bin, env)
	}
}
