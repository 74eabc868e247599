package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl"
)

// TestMain lets the test binary serve as the benchmark's target process
// ("<binary> transfer -role target ...").
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && (os.Args[1] == "transfer" || os.Args[1] == "proxy") {
		run := runTransfer
		if os.Args[1] == "proxy" {
			run = runProxyBench
		}
		if err := run(os.Args[2:], os.Stdout, os.Stderr); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func TestParseSizes(t *testing.T) {
	got, err := parseSizes("4KiB, 1M,512,2GiB")
	if err != nil || fmt.Sprint(got) != fmt.Sprint([]int{4096, 1 << 20, 512, 2 << 30}) {
		t.Fatalf("%v %v", got, err)
	}
	for _, bad := range []string{"", "x", "-4", "0", "4XB"} {
		if _, err := parseSizes(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestParseFlags(t *testing.T) {
	var errb bytes.Buffer
	o, err := parseTransferFlags([]string{"-engine", "ucx", "-ops", "write", "-block-sizes", "4KiB", "-batch-sizes", "1,16"}, &errb)
	if err != nil || o.engine != "ucx" || len(o.ops) != 1 || o.ops[0] != nixl.Write || len(o.batches) != 2 {
		t.Fatalf("%+v %v", o, err)
	}
	for _, bad := range [][]string{{"-ops", "copy"}, {"-pattern", "zigzag"}, {"-block-sizes", "1GiB", "-cap", "1MiB"}, {"-min-iters", "0"}} {
		if _, err := parseTransferFlags(bad, &errb); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

func TestBenchIndices(t *testing.T) {
	for _, slots := range []int{1, 2, 64, 4096} {
		for _, batch := range []int{1, 16, 16384} {
			l := benchIndices("scattered", batch, slots, false)
			r := benchIndices("scattered", batch, slots, true)
			for i := range l {
				if l[i] < 0 || int(l[i]) >= slots || r[i] < 0 || int(r[i]) >= slots {
					t.Fatalf("slots %d batch %d: index out of range at %d", slots, batch, i)
				}
				// Scattered means NIXL can never merge neighbours.
				if i > 0 && slots > 2 && (l[i] == l[i-1]+1 || r[i] == r[i-1]+1) {
					t.Fatalf("slots %d batch %d: consecutive indices at %d", slots, batch, i)
				}
			}
		}
	}
	c := benchIndices("contiguous", 5, 3, true)
	if fmt.Sprint(c) != "[0 1 2 0 1]" {
		t.Fatalf("contiguous: %v", c)
	}
}

// The Python side must use the very same indices.
func TestPythonIndicesMatch(t *testing.T) {
	wd, _ := os.Getwd()
	py := findUp(wd, ".venv/bin/python")
	script := findUp(wd, "bench/nixl_python_bench.py")
	if py == "" || script == "" {
		t.Skip("no .venv python or bench script")
	}
	code := fmt.Sprintf(`import sys, json; sys.path.insert(0, %q); import importlib.util as u
s = u.spec_from_file_location("b", %q); m = u.module_from_spec(s); s.loader.exec_module(m)
print(json.dumps([m.indices(p, 300, n, side).tolist() for p in ("scattered", "contiguous", "same") for n, side in ((4096, "local"), (64, "remote"))]))`,
		filepath.Dir(script), script)
	out, err := exec.Command(py, "-c", code).Output()
	if err != nil {
		t.Skipf("python: %v", err)
	}
	var got [][]int32
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatal(err)
	}
	var want [][]int32
	for _, p := range []string{"scattered", "contiguous", "same"} {
		want = append(want, benchIndices(p, 300, 4096, false), benchIndices(p, 300, 64, true))
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatal("Go and Python index patterns differ")
	}
}

func TestPythonModule(t *testing.T) {
	if pythonModule("NIXL via /x/.nixl_cu13.mesonpy.libs/libnixl_capi.so") != "nixl_cu13" || pythonModule("other") != "nixl" {
		t.Fatal("pythonModule")
	}
}

// A tiny real run: two processes through real NIXL, no Python.
func TestTransferSmoke(t *testing.T) {
	e, err := nixl.Lookup("nixl")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Available(); err != nil {
		t.Skipf("NIXL not available: %v", err)
	}
	var out, errb bytes.Buffer
	js := filepath.Join(t.TempDir(), "r.json")
	err = runTransfer([]string{"-block-sizes", "4KiB", "-batch-sizes", "1,8", "-cap", "1MiB", "-min-time", "1ms",
		"-min-iters", "2", "-mem-iters", "20", "-mem-batch", "4", "-overhead-descs", "64", "-python", "none", "-json", js}, &out, &errb)
	if err != nil {
		t.Fatalf("%v\nstdout:\n%s\nstderr:\n%s", err, out.String(), errb.String())
	}
	var rep report
	b, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Go) != 4 || rep.Overhead == nil || rep.Memory == nil {
		t.Fatalf("report: %d results, overhead %v, memory %v\n%s", len(rep.Go), rep.Overhead, rep.Memory, out.String())
	}
	for _, r := range rep.Go {
		if r.Iters < 2 || r.GBps <= 0 {
			t.Errorf("result %+v", r)
		}
	}
	if !strings.Contains(out.String(), "per-descriptor CPU cost") {
		t.Errorf("output:\n%s", out.String())
	}
}

func TestKeepBest(t *testing.T) {
	a := []result{{Op: "read", Block: 1, Batch: 1, GBps: 1}, {Op: "read", Block: 2, Batch: 1, GBps: 5}}
	b := []result{{Op: "read", Block: 1, Batch: 1, GBps: 3}, {Op: "read", Block: 2, Batch: 1, GBps: 4}, {Op: "write", Block: 1, Batch: 1, GBps: 2}}
	got := keepBest(a, b)
	if len(got) != 3 || got[0].GBps != 3 || got[1].GBps != 5 || got[2].Op != "write" {
		t.Fatalf("%+v", got)
	}
}

// The NIXL-Python comparison end to end (the project's .venv), tiny sizes.
func TestTransferWithPython(t *testing.T) {
	e, err := nixl.Lookup("nixl")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Available(); err != nil {
		t.Skipf("NIXL not available: %v", err)
	}
	wd, _ := os.Getwd()
	if findUp(wd, ".venv/bin/python") == "" {
		t.Skip("no .venv/bin/python above the working directory")
	}
	var out, errb bytes.Buffer
	js := filepath.Join(t.TempDir(), "r.json")
	err = runTransfer([]string{"-ops", "read", "-block-sizes", "4KiB", "-batch-sizes", "1,4", "-cap", "1MiB", "-min-time", "1ms",
		"-min-iters", "2", "-mem-iters", "0", "-overhead-descs", "0", "-rounds", "2", "-json", js}, &out, &errb)
	if err != nil {
		t.Fatalf("%v\n%s\n%s", err, out.String(), errb.String())
	}
	var rep report
	b, _ := os.ReadFile(js)
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Python) != 2 || rep.Rounds != 2 || !strings.Contains(rep.PyInfo, "_api.py") {
		t.Fatalf("python results %+v rounds %d info %q\nstderr:\n%s", rep.Python, rep.Rounds, rep.PyInfo, errb.String())
	}
	for _, r := range rep.Python {
		if r.Iters < 2 || r.GBps <= 0 {
			t.Errorf("python result %+v", r)
		}
	}
}

// The process group not measuring is stopped (SIGSTOP) and continued for
// its own measurements; a child of the group is stopped with it.
func TestProcGroupPause(t *testing.T) {
	cmd := exec.Command("sh", "-c", `sleep 60 & echo '{"info":{"x":"y"}}'; read line; kill $!`)
	g, err := startGroup("sh", cmd, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	defer g.close()
	state := func(pid int) byte {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			t.Fatal(err)
		}
		s := string(b)
		return s[strings.LastIndexByte(s, ')')+2]
	}
	waitState := func(pid int, want byte) {
		for i := 0; i < 200 && state(pid) != want; i++ {
			time.Sleep(10 * time.Millisecond)
		}
		if got := state(pid); got != want {
			t.Fatalf("pid %d state %c, want %c", pid, got, want)
		}
	}
	g.pause()
	waitState(cmd.Process.Pid, 'T')
	kids, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", cmd.Process.Pid, cmd.Process.Pid))
	if f := strings.Fields(string(kids)); len(f) == 1 {
		var kid int
		fmt.Sscan(f[0], &kid)
		waitState(kid, 'T')
	} else {
		t.Fatalf("want one child of the group, got %q", kids)
	}
	g.resume()
	waitState(cmd.Process.Pid, 'S')
}

func TestMedianOf(t *testing.T) {
	for _, c := range []struct {
		in   []float64
		want float64
	}{{nil, 0}, {[]float64{3}, 3}, {[]float64{5, 1, 3}, 3}, {[]float64{4, 1, 3, 2}, 2.5}} {
		if got := medianOf(c.in); got != c.want {
			t.Errorf("medianOf(%v) = %v, want %v", c.in, got, c.want)
		}
	}
}

func TestReadPythonHello(t *testing.T) {
	in := "2026-12-01 NIXL INFO    _api.py:405 Backend UCX was instantiated\n{\"md\": \"00ff10\", \"base\": 4096}\nmore log\n"
	var h hello
	if err := readPythonHello(strings.NewReader(in), &h); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(h.MD, []byte{0, 0xff, 0x10}) || h.Base != 4096 {
		t.Fatalf("hello %+v", h)
	}
	if err := readPythonHello(strings.NewReader("log only\n"), &h); err == nil {
		t.Fatal("no hello line accepted")
	}
}
