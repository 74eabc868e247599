package main

// gonixl-bench transfer: transfer-engine throughput and latency, and, in the
// same run, the same transfers through NIXL's own Python API
// (bench/nixl_python_bench.py) so that the ratio gonixl/NIXL-Python is
// printed. See docs/BENCHMARKS.md (transfer section).
//
// Two processes per side of the comparison: this process initiates, a
// re-executed copy of it ("-role target") registers the remote region and
// keeps draining notifications, as a prefill worker does. Every iteration
// takes vLLM's steps: MakeXfer (with a notification), Post, Check until
// done, Release.

import (
	"bufio"
	"encoding/gob"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/gonixl/gonixl/nixl"
	_ "github.com/gonixl/gonixl/nixl/libnixl" // engine "nixl"
	_ "github.com/gonixl/gonixl/nixl/ucx"     // engine "ucx"
)

func init() {
	register("transfer", "transfer-engine throughput/latency, gonixl vs NIXL's Python API", runTransfer)
}

// benchPrime is the index stride of the scattered pattern; it must match
// bench/nixl_python_bench.py.
const benchPrime = 7919

type transferOpts struct {
	engine        string
	ops           []nixl.XferOp
	blocks        []int
	batches       []int
	capBytes      int
	maxBatchBytes int
	minTime       time.Duration
	minIters      int
	maxIters      int
	pattern       string
	progress      bool
	progressDelay time.Duration
	python        string
	target        string // "go", "python" or "auto"
	pyModule      string // NIXL-Python module for -target python (set by the orchestrator)
	script        string
	memIters      int
	memBatch      int
	overheadDescs int
	jsonOut       string
	role          string
	rounds        int
	thp           bool
	fresh         bool
}

func parseSizes(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		mult := 1
		u := strings.ToUpper(f)
		for _, suf := range []struct {
			s string
			m int
		}{{"KIB", 1 << 10}, {"MIB", 1 << 20}, {"GIB", 1 << 30}, {"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}} {
			if strings.HasSuffix(u, suf.s) {
				mult, u = suf.m, strings.TrimSuffix(u, suf.s)
				break
			}
		}
		n, err := strconv.Atoi(u)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("bad size %q", f)
		}
		out = append(out, n*mult)
	}
	if len(out) == 0 {
		return nil, errors.New("empty size list")
	}
	return out, nil
}

func parseTransferFlags(args []string, stderr io.Writer) (*transferOpts, error) {
	fs := flag.NewFlagSet("transfer", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := &transferOpts{}
	var ops, blocks, batches, capS, maxB string
	fs.StringVar(&o.engine, "engine", "nixl", "transfer engine: nixl (real NIXL), ucx (direct UCX), fake")
	fs.StringVar(&ops, "ops", "read,write", "operations: read, write or both")
	fs.StringVar(&blocks, "block-sizes", "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB", "block (descriptor) sizes")
	fs.StringVar(&batches, "batch-sizes", "1,16,256,4096,16384", "descriptors per transfer")
	fs.StringVar(&capS, "cap", "256MiB", "bytes registered per side; indices wrap when a batch needs more blocks")
	fs.StringVar(&maxB, "max-batch-bytes", "1GiB", "skip (block, batch) pairs moving more than this per transfer")
	fs.DurationVar(&o.minTime, "min-time", 300*time.Millisecond, "minimum time per (op, block, batch)")
	fs.IntVar(&o.minIters, "min-iters", 5, "minimum iterations per (op, block, batch)")
	fs.IntVar(&o.maxIters, "max-iters", 2000, "maximum iterations per (op, block, batch)")
	fs.StringVar(&o.pattern, "pattern", "scattered", "index pattern: scattered (no merging), contiguous (NIXL merges) or same (every descriptor block 1 on both sides: ucx_perftest's footprint, one message buffer a side reused by every operation)")
	fs.BoolVar(&o.progress, "progress-thread", true, "engine progress thread (vLLM runs NIXL with it)")
	fs.DurationVar(&o.progressDelay, "progress-delay", 0, "gonixl's progress thread waits this long for an event between sweeps (NIXL's pthrDelay; 0, as NIXL-Python always uses: busy polling; the shim's default is 1ms). The Python target and NIXL-Python keep 0")
	fs.StringVar(&o.python, "python", "", "python for the NIXL-Python run (default: the project's .venv); \"none\" skips it")
	fs.StringVar(&o.target, "target", "auto", "gonixl's target process: go (this binary), python (bench/nixl_python_bench.py --target-only, the program NIXL-Python reads from; engine nixl only) or auto (python for engine nixl when the comparison runs, else go)")
	fs.StringVar(&o.pyModule, "py-module", "", "NIXL-Python module for -target python (default: from the engine's library path)")
	fs.StringVar(&o.script, "script", "", "path of bench/nixl_python_bench.py (default: found from the working directory)")
	fs.IntVar(&o.memIters, "mem-iters", 10000, "transfers for the memory-growth check (0 skips)")
	fs.IntVar(&o.memBatch, "mem-batch", 64, "descriptors per transfer in the memory-growth check")
	fs.IntVar(&o.overheadDescs, "overhead-descs", 16384, "descriptors for the per-descriptor CPU cost (0 skips)")
	fs.StringVar(&o.jsonOut, "json", "", "also write all results as JSON to this file")
	fs.StringVar(&o.role, "role", "initiator", "internal: initiator, serve or target")
	fs.BoolVar(&o.thp, "thp", false, "advise transparent huge pages for the registered regions on both sides, Go and Python (numpy's default; vLLM's torch KV cache does not)")
	fs.BoolVar(&o.fresh, "fresh", true, "start new processes (new memory) for every round")
	fs.IntVar(&o.rounds, "rounds", 1, "alternate gonixl and NIXL-Python sweeps this many times and keep each one's best per size (evens out load on a shared host)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	var err error
	for _, s := range strings.Split(ops, ",") {
		switch strings.ToLower(strings.TrimSpace(s)) {
		case "read":
			o.ops = append(o.ops, nixl.Read)
		case "write":
			o.ops = append(o.ops, nixl.Write)
		default:
			return nil, fmt.Errorf("-ops: unknown operation %q", s)
		}
	}
	if o.blocks, err = parseSizes(blocks); err != nil {
		return nil, fmt.Errorf("-block-sizes: %v", err)
	}
	if o.batches, err = parseSizes(batches); err != nil {
		return nil, fmt.Errorf("-batch-sizes: %v", err)
	}
	c, err := parseSizes(capS)
	if err != nil || len(c) != 1 {
		return nil, fmt.Errorf("-cap: bad size %q", capS)
	}
	o.capBytes = c[0]
	m, err := parseSizes(maxB)
	if err != nil || len(m) != 1 {
		return nil, fmt.Errorf("-max-batch-bytes: bad size %q", maxB)
	}
	o.maxBatchBytes = m[0]
	if o.pattern != "scattered" && o.pattern != "contiguous" && o.pattern != "same" {
		return nil, fmt.Errorf("-pattern: %q is not scattered, contiguous or same", o.pattern)
	}
	for _, b := range o.blocks {
		if b > o.capBytes && o.role == "initiator" {
			return nil, fmt.Errorf("block size %d exceeds -cap %d", b, o.capBytes)
		}
	}
	if o.rounds < 1 {
		return nil, errors.New("-rounds must be >= 1")
	}
	if o.minIters < 1 || o.maxIters < o.minIters {
		return nil, errors.New("need 1 <= -min-iters <= -max-iters")
	}
	return o, nil
}

// benchIndices returns a batch's descriptor indices over slots blocks: the
// scattered pattern never puts two consecutive indices next to each other
// (so NIXL cannot merge descriptors), the contiguous one always does, and
// same uses one block (block 1) for every descriptor on both sides.
func benchIndices(pattern string, batch, slots int, remote bool) []int32 {
	out := make([]int32, batch)
	off := 0
	if remote {
		off = 1
	}
	for i := range out {
		switch pattern {
		case "contiguous":
			out[i] = int32(i % slots)
		case "same":
			out[i] = int32(min(1, slots-1)) // block 1: inside the region's whole pages
		default:
			out[i] = int32((i*benchPrime + off) % slots)
		}
	}
	return out
}

// region is anonymous mmap-ed memory outside the Go heap.
type region struct {
	b []byte
	m []byte // the whole mapping when b is a part of it
}

// newRegion maps n bytes, with transparent huge pages advised when thp is
// set (what numpy does for large arrays; torch's CPU allocator, and so
// vLLM's KV cache, does not). The pages are populated either way.
func newRegion(n int, thp bool) (*region, error) {
	flags := syscall.MAP_ANON | syscall.MAP_PRIVATE
	if !thp {
		flags |= syscall.MAP_POPULATE
	}
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, flags)
	if err != nil {
		return nil, fmt.Errorf("mmap %d bytes: %w", n, err)
	}
	if thp {
		if err := syscall.Madvise(b, 14 /* MADV_HUGEPAGE */); err != nil {
			_ = syscall.Munmap(b)
			return nil, fmt.Errorf("madvise(MADV_HUGEPAGE): %w", err)
		}
		for i := 0; i < len(b); i += 4096 {
			b[i] = 0
		}
	}
	return &region{b: b}, nil
}

// newArrayRegion allocates n bytes the way numpy allocates a large array
// (np.zeros in the Python initiator, np.ones in its target), so that both
// implementations copy into and out of the same kind of memory: a fresh
// anonymous mapping, faulted in lazily on first touch, with the array 16
// bytes past a page boundary, where malloc's chunk header puts it. The
// kind matters: with the same C++ calls and no progress threads, 1 MiB × 16
// READs into a page-aligned MAP_POPULATE buffer took 4-6 % longer than into
// this one (2026-12-01, docs/BENCHMARKS.md). thp advises huge pages, as
// numpy does unless told otherwise.
func newArrayRegion(n int, thp bool) (*region, error) {
	const off = 16
	m, err := syscall.Mmap(-1, 0, n+4096, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return nil, fmt.Errorf("mmap %d bytes: %w", n, err)
	}
	if thp {
		if err := syscall.Madvise(m, 14 /* MADV_HUGEPAGE */); err != nil {
			_ = syscall.Munmap(m)
			return nil, fmt.Errorf("madvise(MADV_HUGEPAGE): %w", err)
		}
	}
	return &region{b: m[off : off+n], m: m}, nil
}

func (r *region) addr() uint64 { return uint64(reflect.ValueOf(r.b).Pointer()) }
func (r *region) free() {
	if r.m != nil {
		_ = syscall.Munmap(r.m)
		return
	}
	_ = syscall.Munmap(r.b)
}

func blockTable(base uint64, block, slots int) []nixl.Desc {
	d := make([]nixl.Desc, slots)
	for i := range d {
		d[i] = nixl.Desc{Addr: base + uint64(i*block), Len: uint64(block)}
	}
	return d
}

// hello is the target's first message.
type hello struct {
	Err  string
	Name string
	MD   []byte
	Base uint64
}

func newBenchAgent(o *transferOpts, role string) (nixl.Agent, nixl.Engine, error) {
	e, err := nixl.Lookup(o.engine)
	if err != nil {
		return nil, nil, err
	}
	if err := e.Available(); err != nil {
		return nil, nil, err
	}
	a, err := e.NewAgent(nixl.AgentConfig{
		Name:           fmt.Sprintf("gonixl-bench-%s-%d", role, os.Getpid()),
		Backends:       []string{"UCX"},
		ProgressThread: o.progress,
		ProgressDelay:  o.progressDelay,
		Telemetry:      true,
	})
	return a, e, err
}

// runTarget is the passive side: register, publish metadata on stdout,
// drain notifications until stdin closes.
func runTarget(o *transferOpts, stdout io.Writer) error {
	enc := gob.NewEncoder(stdout)
	fail := func(err error) error { _ = enc.Encode(hello{Err: err.Error()}); return err }
	a, _, err := newBenchAgent(o, "target")
	if err != nil {
		return fail(err)
	}
	defer a.Close()
	r, err := newArrayRegion(o.capBytes, o.thp)
	if err != nil {
		return fail(err)
	}
	defer r.free()
	// Data, not zero pages: the Python target's array is np.ones, and a
	// prefill's KV cache holds values.
	for i := range r.b {
		r.b[i] = 1
	}
	regs := []nixl.Region{{Addr: r.addr(), Len: uint64(o.capBytes)}}
	if err := a.RegisterMem(nixl.DRAM, regs); err != nil {
		return fail(err)
	}
	defer a.DeregisterMem(nixl.DRAM, regs)
	md, err := a.LocalMetadata()
	if err != nil {
		return fail(err)
	}
	if err := enc.Encode(hello{Name: a.Name(), MD: md, Base: r.addr()}); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() { _, _ = io.Copy(io.Discard, os.Stdin); close(done) }()
	// One thread drains notifications, as the Python target's loop does
	// (see serveGo).
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	t := time.NewTicker(time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-done:
			return nil
		case <-t.C:
			_, _ = a.GetNotifs()
		}
	}
}

// result is one (engine, op, block, batch) measurement.
type result struct {
	Impl      string  `json:"impl"` // "gonixl/<engine>" or "nixl-python"
	Op        string  `json:"op"`
	Block     int     `json:"block"`
	Batch     int     `json:"batch"`
	Iters     int     `json:"iters"`
	GBps      float64 `json:"gbps"`        // bytes / median(post start → done)
	GBpsMean  float64 `json:"gbps_mean"`   // Σbytes / Σ(post start → done)
	MakeUs    float64 `json:"make_us_p50"` // MakeXfer
	PostUs    float64 `json:"post_us_p50"` // Post call
	XferUs    float64 `json:"xfer_us_p50"` // post start → done
	XferP99Us float64 `json:"xfer_us_p99"` // post start → done
	ReleaseUs float64 `json:"release_us_p50"`
}

func pct(ns []int64, p float64) float64 {
	if len(ns) == 0 {
		return math.NaN()
	}
	s := append([]int64(nil), ns...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(math.Ceil(p*float64(len(s)))) - 1
	return float64(s[max(0, min(i, len(s)-1))]) / 1e3
}

func summarize(impl, op string, block, batch int, makes, posts, xfers, rels []int64) result {
	var sum int64
	for _, x := range xfers {
		sum += x
	}
	bytes := float64(block) * float64(batch)
	mean, med := 0.0, 0.0
	if sum > 0 {
		mean = bytes * float64(len(xfers)) / float64(sum)
	}
	if p := pct(xfers, .5); p > 0 {
		med = bytes / (p * 1e3)
	}
	return result{Impl: impl, Op: op, Block: block, Batch: batch, Iters: len(xfers), GBps: med, GBpsMean: mean,
		MakeUs: pct(makes, .5), PostUs: pct(posts, .5), XferUs: pct(xfers, .5), XferP99Us: pct(xfers, .99), ReleaseUs: pct(rels, .5)}
}

// readPythonHello reads the --target-only script's hello line, skipping
// the log lines NIXL prints on stdout before it.
func readPythonHello(r io.Reader, h *hello) error {
	br := bufio.NewReader(r)
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			return fmt.Errorf("python target: %w", err)
		}
		var m struct {
			MD   string `json:"md"`
			Base uint64 `json:"base"`
		}
		if json.Unmarshal([]byte(line), &m) != nil || m.MD == "" {
			continue
		}
		if h.MD, err = hex.DecodeString(m.MD); err != nil {
			return fmt.Errorf("python target metadata: %w", err)
		}
		h.Base = m.Base
		// The rest of its stdout is logs: keep the pipe drained.
		go func() { _, _ = io.Copy(io.Discard, br) }()
		return nil
	}
}

// initiator holds the initiating agent, its region and the target process.
type initiator struct {
	o      *transferOpts
	a      nixl.Agent
	e      nixl.Engine
	r      *region
	regs   []nixl.Region
	peer   string
	base   uint64
	target *exec.Cmd
	stdin  io.WriteCloser
	cache  map[int]preppedLists // prepared lists per block size
}

func startInitiator(o *transferOpts, stderr io.Writer) (*initiator, error) {
	var cmd *exec.Cmd
	if o.target == "python" {
		py, script, err := pythonScript(o)
		if err != nil {
			return nil, err
		}
		module := o.pyModule
		if module == "" {
			if e, err := nixl.Lookup(o.engine); err == nil {
				module = pythonModule(e.Info())
			}
		}
		cmd = exec.Command(py, script, "--target-only", "--module", module, "--cap", strconv.Itoa(o.capBytes),
			"--progress-thread", map[bool]string{true: "1", false: "0"}[o.progress], "--thp", map[bool]string{true: "1", false: "0"}[o.thp])
	} else {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		cmd = exec.Command(exe, "transfer", "-role", "target", "-engine", o.engine, "-cap", strconv.Itoa(o.capBytes),
			"-progress-thread="+strconv.FormatBool(o.progress), "-progress-delay="+o.progressDelay.String(), "-thp="+strconv.FormatBool(o.thp))
	}
	cmd.Stderr = stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start target: %w", err)
	}
	in := &initiator{o: o, target: cmd, stdin: stdin, cache: map[int]preppedLists{}}
	var h hello
	got := make(chan error, 1)
	if o.target == "python" {
		go func() { got <- readPythonHello(stdout, &h) }()
	} else {
		go func() { got <- gob.NewDecoder(stdout).Decode(&h) }()
	}
	select {
	case err = <-got:
	case <-time.After(60 * time.Second):
		err = errors.New("no answer within 60s")
	}
	if err == nil && h.Err != "" {
		err = errors.New(h.Err)
	}
	if err != nil {
		in.stop()
		return nil, fmt.Errorf("target: %w", err)
	}
	in.base = h.Base
	if in.a, in.e, err = newBenchAgent(o, "initiator"); err != nil {
		in.stop()
		return nil, err
	}
	if in.r, err = newArrayRegion(o.capBytes, o.thp); err != nil {
		in.stop()
		return nil, err
	}
	in.regs = []nixl.Region{{Addr: in.r.addr(), Len: uint64(o.capBytes)}}
	if err := in.a.RegisterMem(nixl.DRAM, in.regs); err != nil {
		in.stop()
		return nil, err
	}
	if in.peer, err = in.a.LoadRemoteMetadata(h.MD); err != nil {
		in.stop()
		return nil, err
	}
	return in, nil
}

func (in *initiator) stop() {
	if in.a != nil {
		in.releaseCache()
		if in.peer != "" {
			_ = in.a.InvalidateRemote(in.peer)
		}
		if in.r != nil {
			_ = in.a.DeregisterMem(nixl.DRAM, in.regs)
		}
		_ = in.a.Close()
	}
	if in.r != nil {
		in.r.free()
	}
	_ = in.stdin.Close()
	done := make(chan struct{})
	go func() { _ = in.target.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = in.target.Process.Kill()
		<-done
	}
}

// lists prepares the local and remote block tables for one block size.
func (in *initiator) lists(block int) (local, remote nixl.DescList, slots int, err error) {
	slots = max(1, in.o.capBytes/block)
	if local, err = in.a.PrepDescList("", nixl.DRAM, blockTable(in.r.addr(), block, slots)); err != nil {
		return nil, nil, 0, err
	}
	if remote, err = in.a.PrepDescList(in.peer, nixl.DRAM, blockTable(in.base, block, slots)); err != nil {
		local.Release()
		return nil, nil, 0, err
	}
	return local, remote, slots, nil
}

// once runs one vLLM-shaped request and returns its phase durations.
func (in *initiator) once(op nixl.XferOp, local, remote nixl.DescList, li, ri []int32, it int) (mk, post, xfer, rel int64, err error) {
	t0 := time.Now()
	x, err := in.a.MakeXfer(op, local, li, remote, ri, []byte("bench:"+strconv.Itoa(it)))
	if err != nil {
		return 0, 0, 0, 0, err
	}
	t1 := time.Now()
	st, err := x.Post()
	t2 := time.Now()
	deadline := t1.Add(5 * time.Minute)
	for err == nil && st == nixl.InProgress {
		st, err = x.Check()
		if st == nixl.InProgress && time.Now().After(deadline) {
			err = errors.New("transfer did not finish within 5 minutes")
		}
	}
	t3 := time.Now()
	if rerr := x.Release(); err == nil {
		err = rerr
	}
	t4 := time.Now()
	return t1.Sub(t0).Nanoseconds(), t2.Sub(t1).Nanoseconds(), t3.Sub(t1).Nanoseconds(), t4.Sub(t3).Nanoseconds(), err
}

// combo is one (op, block, batch) size point.
type combo struct {
	op           nixl.XferOp
	block, batch int
}

func (o *transferOpts) combos() []combo {
	var out []combo
	for _, op := range o.ops {
		for _, block := range o.blocks {
			for _, batch := range o.batches {
				if block*batch <= o.maxBatchBytes {
					out = append(out, combo{op, block, batch})
				}
			}
		}
	}
	return out
}

type preppedLists struct {
	local, remote nixl.DescList
	slots         int
}

// measure runs iterations of one size point until -min-time and
// -min-iters are both met (or -max-iters).
func (in *initiator) measure(c combo) (result, error) {
	o := in.o
	pl, ok := in.cache[c.block]
	if !ok {
		local, remote, slots, err := in.lists(c.block)
		if err != nil {
			return result{}, err
		}
		pl = preppedLists{local, remote, slots}
		in.cache[c.block] = pl
	}
	li := benchIndices(o.pattern, c.batch, pl.slots, false)
	ri := benchIndices(o.pattern, c.batch, pl.slots, true)
	var makes, posts, xfers, rels []int64
	start := time.Now()
	for it := 0; it < o.maxIters && (it < o.minIters || time.Since(start) < o.minTime); it++ {
		m, p, x, r, err := in.once(c.op, pl.local, pl.remote, li, ri, it)
		if err != nil {
			return result{}, fmt.Errorf("%v block %d batch %d: %w", c.op, c.block, c.batch, err)
		}
		makes, posts, xfers, rels = append(makes, m), append(posts, p), append(xfers, x), append(rels, r)
	}
	return summarize("gonixl/"+o.engine, strings.ToLower(c.op.String()), c.block, c.batch, makes, posts, xfers, rels), nil
}

func (in *initiator) releaseCache() {
	for b, pl := range in.cache {
		pl.local.Release()
		pl.remote.Release()
		delete(in.cache, b)
	}
}

// overhead measures our side's per-descriptor CPU cost at n descriptors:
// building the index arrays from block ids (as the worker does) and
// MakeXfer (our checks, one cgo crossing, and NIXL's makeXferReq).
type overheadResult struct {
	Descs           int     `json:"descs"`
	BuildNsPerDesc  float64 `json:"build_index_ns_per_desc"`
	MakeNsPerDesc   float64 `json:"make_xfer_ns_per_desc"`
	PyMakeNsPerDesc float64 `json:"python_make_ns_per_desc,omitempty"`
}

func (in *initiator) overhead(n int) (overheadResult, error) {
	const block = 4096
	local, remote, slots, err := in.lists(block)
	if err != nil {
		return overheadResult{}, err
	}
	defer local.Release()
	defer remote.Release()
	n = min(n, slots)
	// Block ids as a scheduler hands them over, scattered.
	blocks := benchIndices("scattered", n, slots, false)
	li, ri := make([]int32, n), make([]int32, n)
	const reps = 50
	t0 := time.Now()
	for r := 0; r < reps; r++ {
		for i, b := range blocks {
			li[i] = b // region 0: desc id = region*numBlocks + block
			ri[i] = int32((int(b) + 1) % slots)
		}
	}
	build := time.Since(t0)
	var mk time.Duration
	for r := 0; r < reps; r++ {
		t := time.Now()
		x, err := in.a.MakeXfer(nixl.Read, local, li, remote, ri, []byte("o"))
		mk += time.Since(t)
		if err != nil {
			return overheadResult{}, err
		}
		if err := x.Release(); err != nil {
			return overheadResult{}, err
		}
	}
	return overheadResult{Descs: n, BuildNsPerDesc: float64(build.Nanoseconds()) / reps / float64(n),
		MakeNsPerDesc: float64(mk.Nanoseconds()) / reps / float64(n)}, nil
}

type memResult struct {
	Iters       int     `json:"iters"`
	Batch       int     `json:"batch"`
	RSSAt1kKiB  int64   `json:"rss_kib_after_1000"`
	RSSEndKiB   int64   `json:"rss_kib_end"`
	HeapAt1kKiB int64   `json:"go_heap_kib_after_1000"`
	HeapEndKiB  int64   `json:"go_heap_kib_end"`
	Seconds     float64 `json:"seconds"`
}

func rssKiB() int64 {
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		return -1
	}
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return -1
	}
	pages, _ := strconv.ParseInt(f[1], 10, 64)
	return pages * int64(os.Getpagesize()) / 1024
}

func heapKiB() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc / 1024)
}

// memGrowth repeats a small READ many times and samples memory after a
// warm-up of 1000 transfers and at the end.
func (in *initiator) memGrowth(iters, batch int) (memResult, error) {
	const block = 4096
	local, remote, slots, err := in.lists(block)
	if err != nil {
		return memResult{}, err
	}
	defer local.Release()
	defer remote.Release()
	li := benchIndices("scattered", batch, slots, false)
	ri := benchIndices("scattered", batch, slots, true)
	res := memResult{Iters: iters, Batch: batch}
	start := time.Now()
	for it := 0; it < iters; it++ {
		if _, _, _, _, err := in.once(nixl.Read, local, remote, li, ri, it); err != nil {
			return res, err
		}
		if it == 999 || (iters < 1000 && it == 0) {
			res.HeapAt1kKiB, res.RSSAt1kKiB = heapKiB(), rssKiB()
		}
	}
	res.Seconds = time.Since(start).Seconds()
	res.HeapEndKiB, res.RSSEndKiB = heapKiB(), rssKiB()
	return res, nil
}

// findUp looks for rel in dir and its parents.
func findUp(dir, rel string) string {
	for d := dir; ; d = filepath.Dir(d) {
		p := filepath.Join(d, rel)
		if _, err := os.Stat(p); err == nil {
			return p
		}
		if filepath.Dir(d) == d {
			return ""
		}
	}
}

// pythonModule names the NIXL Python package matching the library the Go
// engine loaded, so both sides run the same build.
func pythonModule(info string) string {
	switch {
	case strings.Contains(info, ".nixl_cu12."):
		return "nixl_cu12"
	case strings.Contains(info, ".nixl_cu13."):
		return "nixl_cu13"
	}
	return "nixl"
}

// pythonScript finds the python and bench/nixl_python_bench.py to run.
func pythonScript(o *transferOpts) (py, script string, err error) {
	wd, _ := os.Getwd()
	py = o.python
	if py == "" || py == "none" {
		if v := os.Getenv("VIRTUAL_ENV"); v != "" {
			py = filepath.Join(v, "bin", "python")
		} else if p := findUp(wd, ".venv/bin/python"); p != "" {
			py = p
		} else {
			py = "python3"
		}
	}
	script = o.script
	if script == "" {
		if script = findUp(wd, "bench/nixl_python_bench.py"); script == "" {
			return "", "", errors.New("bench/nixl_python_bench.py not found (use -script)")
		}
	}
	return py, script, nil
}

// startPython starts bench/nixl_python_bench.py in --serve mode: it measures
// one size point per request, so that gonixl and NIXL-Python alternate.
func startPython(o *transferOpts, module string, stderr io.Writer) (*procGroup, string, error) {
	py, script, err := pythonScript(o)
	if err != nil {
		return nil, "", err
	}
	args := []string{script, "--serve", "--module", module,
		"--cap", strconv.Itoa(o.capBytes),
		"--min-time", strconv.FormatFloat(o.minTime.Seconds(), 'f', 3, 64),
		"--min-iters", strconv.Itoa(o.minIters), "--max-iters", strconv.Itoa(o.maxIters),
		"--pattern", o.pattern, "--progress-thread", map[bool]string{true: "1", false: "0"}[o.progress],
		"--thp", map[bool]string{true: "1", false: "0"}[o.thp]}
	g, err := startGroup("NIXL-Python ("+py+" "+script+")", exec.Command(py, args...), stderr)
	if err != nil {
		return nil, "", err
	}
	return g, fmt.Sprintf("%s (%s)", g.info["module"], g.info["api_file"]), nil
}

type report struct {
	Command  string          `json:"command"`
	Rounds   int             `json:"rounds"`
	Engine   string          `json:"engine"`
	Info     string          `json:"engine_info"`
	PyInfo   string          `json:"python_info,omitempty"`
	Go       []result        `json:"gonixl"`
	Python   []result        `json:"nixl_python,omitempty"`
	Overhead *overheadResult `json:"overhead,omitempty"`
	Memory   *memResult      `json:"memory,omitempty"`
	// Paired holds, per "op/block/batch", gonixl GB/s ÷ NIXL-Python GB/s
	// of each round, both measured back to back in that round.
	Paired map[string][]float64 `json:"paired_ratios,omitempty"`
}

func runTransfer(args []string, stdout, stderr io.Writer) error {
	o, err := parseTransferFlags(args, stderr)
	if err != nil {
		return err
	}
	if o.role == "target" {
		return runTarget(o, stdout)
	}
	if o.role == "serve" {
		return serveGo(o, os.Stdin, stdout, stderr)
	}
	var goG, py *procGroup
	closeGroups := func() {
		if goG != nil {
			goG.close()
			goG = nil
		}
		if py != nil {
			py.close()
			py = nil
		}
	}
	defer closeGroups()
	rep := report{Command: "gonixl-bench transfer " + strings.Join(args, " "), Engine: o.engine}
	pyWanted := o.python != "none" && o.engine != "fake"
	// Every process of both groups gets the UCX setting vLLM makes for
	// NIXL-Python (vllm/distributed/nixl_utils.py) and nixl/libnixl makes
	// for gonixl; without this only gonixl's group had it.
	if _, ok := os.LookupEnv("UCX_RCACHE_MAX_UNRELEASED"); !ok {
		_ = os.Setenv("UCX_RCACHE_MAX_UNRELEASED", "1024")
	}
	if o.target == "auto" {
		o.target = "go"
		if pyWanted && o.engine == "nixl" {
			o.target = "python"
		}
	}
	// startGroups starts both implementations' processes, each paused until
	// it measures. With -fresh every round gets new processes (new memory):
	// on this VM a region's bandwidth depends on where its pages landed, and
	// a process keeps its luck for its whole life.
	// The two groups start one after the other, gonixl's first in even
	// rounds and NIXL-Python's first in odd ones, so that neither always
	// gets the memory freed by the round before.
	startGroups := func(round int) error {
		startGo := func() error {
			var err error
			if goG, err = startGoGroup(o, stderr); err != nil {
				return err
			}
			goG.pause()
			rep.Info = goG.info["engine"]
			return nil
		}
		startPy := func() {
			if !pyWanted {
				return
			}
			info := rep.Info
			if info == "" { // NIXL-Python starts first: the module Go would load
				if e, err := nixl.Lookup(o.engine); err == nil {
					info = e.Info()
				}
			}
			var err error
			if py, rep.PyInfo, err = startPython(o, pythonModule(info), stderr); err != nil {
				fmt.Fprintf(stderr, "NIXL-Python comparison skipped: %v\n", err)
				pyWanted = false
			} else {
				py.pause()
			}
		}
		return byRound(round, startGo, startPy)
	}
	if err := startGroups(0); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "engine %s: %s\npattern %s, progress thread %v, cap %d MiB a side, huge pages %v\n",
		o.engine, rep.Info, o.pattern, o.progress, o.capBytes>>20, o.thp)
	// Size by size, gonixl and NIXL-Python back to back (order swapped
	// every round); the group not measuring is stopped (transfer_serve.go).
	for round := 0; round < o.rounds; round++ {
		if round > 0 && o.fresh {
			closeGroups()
			if err := startGroups(round); err != nil {
				return err
			}
		}
		for _, c := range o.combos() {
			var goR, pyR result
			runGo := func() error {
				r, err := goG.measure(c, "gonixl/"+o.engine)
				if err == nil {
					rep.Go = keepBest(rep.Go, []result{r})
					goR = r
				}
				return err
			}
			runPy := func() {
				if py == nil {
					return
				}
				r, err := py.measure(c, "nixl-python")
				if err != nil {
					fmt.Fprintf(stderr, "NIXL-Python comparison stopped: %v\n", err)
					py.close()
					py = nil
					return
				}
				rep.Python = keepBest(rep.Python, []result{r})
				pyR = r
			}
			if err := byRound(round, runGo, runPy); err != nil {
				return err
			}
			if goR.GBps > 0 && pyR.GBps > 0 {
				if rep.Paired == nil {
					rep.Paired = map[string][]float64{}
				}
				k := comboKey(goR)
				rep.Paired[k] = append(rep.Paired[k], goR.GBps/pyR.GBps)
			}
		}
		rep.Rounds = round + 1
	}
	closeGroups()
	if o.overheadDescs == 0 && o.memIters == 0 {
		printReport(stdout, &rep)
		return writeReportJSON(o.jsonOut, &rep)
	}
	// Our own CPU cost and memory growth, in this process, with the
	// comparison's processes gone.
	in, err := startInitiator(o, stderr)
	if err != nil {
		return err
	}
	defer in.stop()
	in.releaseCache()
	if o.overheadDescs > 0 {
		ov, err := in.overhead(o.overheadDescs)
		if err != nil {
			return fmt.Errorf("overhead: %w", err)
		}
		for _, p := range rep.Python {
			if p.Op == "read" && p.Block == 4096 && p.Batch == ov.Descs {
				ov.PyMakeNsPerDesc = p.MakeUs * 1e3 / float64(p.Batch)
			}
		}
		rep.Overhead = &ov
	}
	if o.memIters > 0 {
		m, err := in.memGrowth(o.memIters, o.memBatch)
		if err != nil {
			return fmt.Errorf("memory growth: %w", err)
		}
		rep.Memory = &m
	}
	printReport(stdout, &rep)
	return writeReportJSON(o.jsonOut, &rep)
}

// byRound runs gonixl's step and NIXL-Python's in the round's order:
// gonixl first in even rounds, NIXL-Python first in odd ones.
func byRound(round int, goStep func() error, pyStep func()) error {
	if round%2 == 1 {
		pyStep()
	}
	if err := goStep(); err != nil {
		return err
	}
	if round%2 == 0 {
		pyStep()
	}
	return nil
}

func writeReportJSON(path string, rep *report) error {
	if path == "" {
		return nil
	}
	b, _ := json.MarshalIndent(rep, "", "  ")
	return os.WriteFile(path, b, 0o644)
}

// keepBest merges a round's results into the best so far, per (op, block,
// batch), by bandwidth.
func keepBest(best, round []result) []result {
	idx := map[string]int{}
	for i, r := range best {
		idx[fmt.Sprintf("%s/%d/%d", r.Op, r.Block, r.Batch)] = i
	}
	for _, r := range round {
		k := fmt.Sprintf("%s/%d/%d", r.Op, r.Block, r.Batch)
		if i, ok := idx[k]; ok {
			if r.GBps > best[i].GBps {
				best[i] = r
			}
			continue
		}
		idx[k] = len(best)
		best = append(best, r)
	}
	return best
}

func comboKey(r result) string { return fmt.Sprintf("%s/%d/%d", r.Op, r.Block, r.Batch) }

// medianOf returns the median of xs (the mean of the middle two for an
// even count), and 0 for none.
func medianOf(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if n := len(s); n%2 == 1 {
		return s[n/2]
	} else {
		return (s[n/2-1] + s[n/2]) / 2
	}
}

func sizeStr(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return strconv.Itoa(n)
}

func printReport(w io.Writer, rep *report) {
	py := map[string]result{}
	for _, r := range rep.Python {
		py[fmt.Sprintf("%s/%d/%d", r.Op, r.Block, r.Batch)] = r
	}
	if rep.PyInfo != "" {
		fmt.Fprintf(w, "NIXL-Python: %s\n", rep.PyInfo)
	}
	fmt.Fprintf(w, "best of %d round(s) per size (new processes every round unless -fresh=false), gonixl and NIXL-Python alternating size by size, the one not measuring stopped; GB/s from the median transfer time (robust to load spikes), GB/s mean = Σbytes/Σtime; ratio = gonixl GB/s / NIXL-Python GB/s (best against best); paired = median over rounds of the ratio of the two measured back to back in one round\n", rep.Rounds)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "op\tblock\tbatch\titers\tGB/s\tGB/s mean\tmake µs\tpost µs\txfer µs p50\txfer µs p99\trelease µs\tpy GB/s\tpy GB/s mean\tpy make µs\tpy post µs\tpy xfer µs\tratio\tpaired\tpaired min–max\t")
	for _, r := range rep.Go {
		line := fmt.Sprintf("%s\t%s\t%d\t%d\t%.3f\t%.3f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t", r.Op, sizeStr(r.Block), r.Batch, r.Iters, r.GBps, r.GBpsMean, r.MakeUs, r.PostUs, r.XferUs, r.XferP99Us, r.ReleaseUs)
		// Ratios with three decimals: a 0.946 must not print as 0.95.
		if p, ok := py[fmt.Sprintf("%s/%d/%d", r.Op, r.Block, r.Batch)]; ok && p.GBps > 0 {
			line += fmt.Sprintf("%.3f\t%.3f\t%.1f\t%.1f\t%.1f\t%.3f\t", p.GBps, p.GBpsMean, p.MakeUs, p.PostUs, p.XferUs, r.GBps/p.GBps)
			if pr := rep.Paired[comboKey(r)]; len(pr) > 0 {
				lo, hi := pr[0], pr[0]
				for _, x := range pr {
					lo, hi = min(lo, x), max(hi, x)
				}
				line += fmt.Sprintf("%.3f\t%.2f–%.2f\t", medianOf(pr), lo, hi)
			} else {
				line += "-\t-\t"
			}
		} else {
			line += "-\t-\t-\t-\t-\t-\t-\t-\t"
		}
		fmt.Fprintln(tw, line)
	}
	tw.Flush()
	if ov := rep.Overhead; ov != nil {
		fmt.Fprintf(w, "per-descriptor CPU cost at %d descriptors: building index arrays %.2f ns/desc; MakeXfer (our checks + one cgo call + the engine's own make) %.1f ns/desc\n", ov.Descs, ov.BuildNsPerDesc, ov.MakeNsPerDesc)
		if ov.PyMakeNsPerDesc > 0 {
			fmt.Fprintf(w, "  NIXL-Python make_prepped_xfer at the same size (read, 4KiB, numpy int32 indices): %.1f ns/desc\n", ov.PyMakeNsPerDesc)
		}
	}
	if m := rep.Memory; m != nil {
		fmt.Fprintf(w, "memory over %d transfers of %d descriptors (%.1fs): RSS %d KiB after 1000 → %d KiB at end (%+d KiB); Go heap %d → %d KiB (%+d KiB)\n",
			m.Iters, m.Batch, m.Seconds, m.RSSAt1kKiB, m.RSSEndKiB, m.RSSEndKiB-m.RSSAt1kKiB, m.HeapAt1kKiB, m.HeapEndKiB, m.HeapEndKiB-m.HeapAt1kKiB)
	}
}
