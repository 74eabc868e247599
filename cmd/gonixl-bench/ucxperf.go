package main

// gonixl-bench ucxperf: the "ucx" engine against UCX's own ucx_perftest and
// against single-core memcpy, in one run. See docs/BENCHMARKS.md (UCX section).
//
// It runs the transfer benchmark (runTransfer) with -engine ucx twice: with
// scattered blocks over the whole region (what a KV cache looks like; the
// memcpy reference copies the same scattered blocks on one core) and with
// every descriptor on block 1 of each side (ucx_perftest's footprint: one
// message buffer a side, reused by every operation). Then, for every block
// size, ucx_perftest ucp_get (READ) or ucp_put_bw (WRITE) with that message
// size between a server and a client process on loopback. The perftest
// ratios compare like footprints (gonixl "same" against ucx_perftest), the
// memcpy ratio like scattered copies. Every process inherits the same
// UCX_TLS, error-handling mode and GONIXL_UCX_DATA_PATH.

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/ucx"
)

func init() {
	register("ucxperf", "ucx engine vs ucx_perftest (ucp_get/ucp_put_bw) and single-core memcpy", runUCXPerf)
}

// perfRow is one (op, block) line of the comparison.
type perfRow struct {
	Op             string  `json:"op"`
	Block          int     `json:"block"`
	Batch          int     `json:"batch"`
	GonixlGBps     float64 `json:"gonixl_gbps"`      // scattered blocks
	GonixlSameGBps float64 `json:"gonixl_same_gbps"` // every descriptor on block 1 (perftest's footprint)
	PerftestGBps   float64 `json:"perftest_gbps"`
	MemcpyGBps     float64 `json:"memcpy_gbps"`
	RatioPerftest  float64 `json:"ratio_perftest"`
	RatioMemcpy    float64 `json:"ratio_memcpy"`
	PerftestIters  int     `json:"perftest_iters"`
	PerftestErrMsg string  `json:"perftest_error,omitempty"`
	// ucx_perftest on memory UCX did not allocate (UCX_ALLOC_PRIO=heap:
	// malloc-ed, as torch's CPU tensors and so vLLM's KV cache are), i.e.
	// the memory kind gonixl is given.
	PerftestAnonGBps  float64 `json:"perftest_anon_gbps"`
	RatioPerftestAnon float64 `json:"ratio_perftest_anon"`
	PerftestAnonIters int     `json:"perftest_anon_iters"`
	PerftestAnonErr   string  `json:"perftest_anon_error,omitempty"`
}

type perfReport struct {
	Command      string    `json:"command"`
	Library      string    `json:"library"`
	Perftest     string    `json:"perftest"`
	UCXTLS       string    `json:"ucx_tls"`
	ErrMode      string    `json:"err_mode"`
	MemcpyBigGBs float64   `json:"memcpy_64mib_gbps"`
	Rows         []perfRow `json:"rows"`
	Transfer     *report   `json:"transfer"`      // scattered
	TransferSame *report   `json:"transfer_same"` // every descriptor on block 1
}

func runUCXPerf(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("ucxperf", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var blocksS, opsS, capS, tls, errMode, perftest, jsonOut string
	var batch, perftestMiB int
	var minTime time.Duration
	var progress bool
	fs.StringVar(&blocksS, "block-sizes", "4KiB,32KiB,256KiB,1MiB,4MiB", "block (= ucx_perftest message) sizes")
	fs.StringVar(&opsS, "ops", "read", "read (ucp_get) and/or write (ucp_put_bw)")
	fs.IntVar(&batch, "batch", 64, "descriptors per gonixl transfer")
	fs.StringVar(&capS, "cap", "256MiB", "bytes registered per side (blocks are scattered over it)")
	fs.StringVar(&tls, "tls", "", "UCX_TLS for every process (empty: inherit)")
	fs.StringVar(&errMode, "err-mode", "none", "endpoint error handling: none, peer (ucx_perftest -e) or auto (none here: one host)")
	fs.StringVar(&perftest, "perftest", "", "ucx_perftest binary (default: the one matching the loaded libucp)")
	fs.IntVar(&perftestMiB, "perftest-mib", 2048, "MiB moved per ucx_perftest size")
	fs.DurationVar(&minTime, "min-time", time.Second, "minimum time per gonixl (op, block)")
	fs.BoolVar(&progress, "progress-thread", true, "engine progress thread")
	fs.StringVar(&jsonOut, "json", "", "also write the results as JSON to this file")
	if err := fs.Parse(args); err != nil {
		return err
	}
	blocks, err := parseSizes(blocksS)
	if err != nil {
		return fmt.Errorf("-block-sizes: %v", err)
	}
	c, err := parseSizes(capS)
	if err != nil || len(c) != 1 {
		return fmt.Errorf("-cap: bad size %q", capS)
	}
	if errMode != "none" && errMode != "peer" && errMode != "auto" {
		return fmt.Errorf("-err-mode: want none, peer or auto, got %q", errMode)
	}
	var ops []nixl.XferOp
	for _, s := range strings.Split(opsS, ",") {
		switch strings.TrimSpace(s) {
		case "read":
			ops = append(ops, nixl.Read)
		case "write":
			ops = append(ops, nixl.Write)
		default:
			return fmt.Errorf("-ops: unknown operation %q", s)
		}
	}
	// Environment first: the engine's target process and ucx_perftest
	// inherit it, and UCX reads it when a context is created.
	if tls != "" {
		os.Setenv("UCX_TLS", tls)
	}
	os.Setenv(ucx.EnvErrMode, errMode)
	e, err := nixl.Lookup(ucx.EngineName)
	if err != nil {
		return err
	}
	if err := e.Available(); err != nil {
		return err
	}
	rep := &perfReport{Command: "gonixl-bench ucxperf " + strings.Join(args, " "), Library: e.Info(),
		UCXTLS: os.Getenv("UCX_TLS"), ErrMode: errMode}
	ptBin, _ := perftestFor(perftest, ucx.LibraryPath())
	rep.Perftest = ptBin
	fmt.Fprintf(stdout, "%s\nUCX_TLS=%q, error handling %s, ucx_perftest %s\n", rep.Library, rep.UCXTLS, errMode, ptBin)

	// 1. gonixl through the transfer benchmark, scattered and same.
	transfer := func(pattern string) (*report, error) {
		tmp, err := os.CreateTemp("", "gonixl-ucxperf-*.json")
		if err != nil {
			return nil, err
		}
		tmp.Close()
		defer os.Remove(tmp.Name())
		targs := []string{"-engine", "ucx", "-python", "none", "-mem-iters", "0", "-overhead-descs", "0",
			"-ops", opsS, "-block-sizes", blocksS, "-batch-sizes", strconv.Itoa(batch), "-cap", capS, "-pattern", pattern,
			"-min-time", minTime.String(), "-progress-thread=" + strconv.FormatBool(progress), "-json", tmp.Name()}
		fmt.Fprintf(stdout, "\n== gonixl-bench transfer %s\n", strings.Join(targs, " "))
		if err := runTransfer(targs, stdout, stderr); err != nil {
			return nil, fmt.Errorf("transfer benchmark: %w", err)
		}
		b, err := os.ReadFile(tmp.Name())
		if err != nil {
			return nil, err
		}
		r := &report{}
		if err := json.Unmarshal(b, r); err != nil {
			return nil, fmt.Errorf("transfer benchmark JSON: %w", err)
		}
		return r, nil
	}
	if rep.Transfer, err = transfer("scattered"); err != nil {
		return err
	}
	if rep.TransferSame, err = transfer("same"); err != nil {
		return err
	}

	// 2. memcpy on one core, 3. ucx_perftest, per size.
	rep.Rows, rep.MemcpyBigGBs, err = ucxPerfCompare(stderr, ops, blocks, batch, c[0], minTime, perftest, errMode, perftestMiB,
		rep.Transfer.Go, rep.TransferSame.Go)
	if err != nil {
		return err
	}
	printPerf(stdout, rep)
	if jsonOut != "" {
		b, _ := json.MarshalIndent(rep, "", "  ")
		if err := os.WriteFile(jsonOut, b, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// ucxPerfCompare runs, for each op and block size, ucx_perftest with that
// message size and a single-core memcpy of the same scattered blocks, and
// pairs them with the gonixl results of the transfer benchmark (rows for
// batch; scattered and same patterns). UCX_TLS and GONIXL_UCX_ERR_MODE
// must already be set as for the transfer run. perftest "" picks the binary
// matching the loaded libucp.
func ucxPerfCompare(stderr io.Writer, ops []nixl.XferOp, blocks []int, batch, capBytes int, minTime time.Duration,
	perftest, errMode string, perftestMiB int, gonixl, gonixlSame []result) (rows []perfRow, memcpy64MiB float64, err error) {
	ptBin, ptEnv := perftestFor(perftest, ucx.LibraryPath())
	if memcpy64MiB, err = memcpyBig(64 << 20); err != nil {
		return nil, 0, err
	}
	got, gotSame := map[string]float64{}, map[string]float64{}
	for _, r := range gonixl {
		if r.Batch == batch {
			got[fmt.Sprintf("%s/%d", r.Op, r.Block)] = r.GBps
		}
	}
	for _, r := range gonixlSame {
		if r.Batch == batch {
			gotSame[fmt.Sprintf("%s/%d", r.Op, r.Block)] = r.GBps
		}
	}
	for _, op := range ops {
		name := strings.ToLower(op.String())
		for _, blk := range blocks {
			key := fmt.Sprintf("%s/%d", name, blk)
			row := perfRow{Op: name, Block: blk, Batch: batch, GonixlGBps: got[key], GonixlSameGBps: gotSame[key]}
			if row.MemcpyGBps, err = memcpyScattered(blk, batch, capBytes, minTime); err != nil {
				return nil, 0, err
			}
			iters := max(200, min(1_000_000, perftestMiB<<20/blk))
			row.PerftestIters = iters
			row.PerftestGBps, err = runPerftest(ptBin, ptEnv, op, blk, iters, errMode == "peer")
			if err != nil {
				row.PerftestErrMsg = err.Error()
				fmt.Fprintf(stderr, "ucx_perftest %s %d: %v\n", name, blk, err)
				err = nil
			}
			if row.PerftestGBps > 0 {
				row.RatioPerftest = row.GonixlSameGBps / row.PerftestGBps
			}
			// The same test on malloc-ed memory. UCX 1.13 serves it by
			// software emulation, one active-message round trip per
			// fragment answered by the server's progress, so it is slow:
			// fewer iterations.
			row.PerftestAnonIters = max(200, min(2000, iters/64))
			anonEnv := append(append([]string(nil), ptEnv...), "UCX_ALLOC_PRIO=heap")
			row.PerftestAnonGBps, err = runPerftest(ptBin, anonEnv, op, blk, row.PerftestAnonIters, errMode == "peer")
			if err != nil {
				row.PerftestAnonErr = err.Error()
				fmt.Fprintf(stderr, "ucx_perftest (malloc-ed memory) %s %d: %v\n", name, blk, err)
				err = nil
			}
			if row.PerftestAnonGBps > 0 {
				row.RatioPerftestAnon = row.GonixlSameGBps / row.PerftestAnonGBps
			}
			if row.MemcpyGBps > 0 {
				row.RatioMemcpy = row.GonixlGBps / row.MemcpyGBps
			}
			rows = append(rows, row)
		}
	}
	return rows, memcpy64MiB, nil
}

func printPerf(w io.Writer, rep *perfReport) {
	fmt.Fprintf(w, "\n== gonixl-ucx vs ucx_perftest vs memcpy (GB/s = 1e9 B/s; memcpy on one core, 64 MiB copy: %.2f GB/s)\n", rep.MemcpyBigGBs)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "same: every descriptor on block 1 of each side, ucx_perftest's footprint (one message buffer a side); scattered: blocks over the whole region, as a KV cache")
	fmt.Fprintln(w, "ucx_perftest: its own UCX-allocated (shared) memory; ucx_perftest malloc: UCX_ALLOC_PRIO=heap, the kind of memory vLLM hands gonixl")
	fmt.Fprintln(w, "perftest ratios: gonixl same / ucx_perftest; memcpy ratio: gonixl scattered / memcpy of the same scattered blocks")
	fmt.Fprintln(tw, "op\tblock\tbatch\tgonixl same\tucx_perftest\tratio\tucx_perftest malloc\tratio\tgonixl scattered\tmemcpy\tratio\ttargets (≥0.9× perftest from 32KiB, ≥0.5× memcpy)\t")
	for _, r := range rep.Rows {
		pt, ratio, pta, ratioA := "-", "-", "-", "-"
		if r.PerftestGBps > 0 {
			pt, ratio = fmt.Sprintf("%.3f", r.PerftestGBps), fmt.Sprintf("%.2f", r.RatioPerftest)
		}
		if r.PerftestAnonGBps > 0 {
			pta, ratioA = fmt.Sprintf("%.3f", r.PerftestAnonGBps), fmt.Sprintf("%.2f", r.RatioPerftestAnon)
		}
		var verdict []string
		if r.Block >= 32<<10 && r.PerftestGBps > 0 {
			verdict = append(verdict, map[bool]string{true: "perftest ok", false: "perftest MISSED"}[r.RatioPerftest >= 0.9])
		}
		if r.Block >= 32<<10 && r.PerftestAnonGBps > 0 {
			verdict = append(verdict, map[bool]string{true: "perftest-malloc ok", false: "perftest-malloc MISSED"}[r.RatioPerftestAnon >= 0.9])
		}
		verdict = append(verdict, map[bool]string{true: "memcpy ok", false: "memcpy MISSED"}[r.RatioMemcpy >= 0.5])
		fmt.Fprintf(tw, "%s\t%s\t%d\t%.3f\t%s\t%s\t%s\t%s\t%.3f\t%.3f\t%.2f\t%s\t\n", r.Op, sizeStr(r.Block), r.Batch, r.GonixlSameGBps, pt, ratio, pta, ratioA,
			r.GonixlGBps, r.MemcpyGBps, r.RatioMemcpy, strings.Join(verdict, ", "))
	}
	tw.Flush()
}

// perftestFor picks the ucx_perftest that belongs to the loaded libucp: the
// wheel's bin/ucx_perftest (with its lib directory on LD_LIBRARY_PATH) when
// libucp came from a libucx wheel, else ucx_perftest from PATH.
func perftestFor(explicit, libPath string) (string, []string) {
	if explicit != "" {
		return explicit, nil
	}
	if strings.Contains(libPath, string(filepath.Separator)+"libucx"+string(filepath.Separator)) {
		libDir := filepath.Dir(libPath)
		bin := filepath.Join(filepath.Dir(libDir), "bin", "ucx_perftest")
		if _, err := os.Stat(bin); err == nil {
			return bin, []string{"LD_LIBRARY_PATH=" + libDir}
		}
	}
	return "ucx_perftest", nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// runPerftest runs one ucx_perftest server/client pair on loopback and
// returns the client's overall bandwidth in GB/s (ucx_perftest prints MB/s
// with MB = 2^20 bytes).
func runPerftest(bin string, env []string, op nixl.XferOp, size, iters int, errHandling bool) (float64, error) {
	test := "ucp_get"
	if op == nixl.Write {
		test = "ucp_put_bw"
	}
	port, err := freePort()
	if err != nil {
		return 0, err
	}
	common := []string{"-p", strconv.Itoa(port)}
	if errHandling {
		common = append(common, "-e")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	srv := exec.CommandContext(ctx, bin, common...)
	srv.Env = append(os.Environ(), env...)
	var srvOut strings.Builder
	srv.Stdout, srv.Stderr = &srvOut, &srvOut
	if err := srv.Start(); err != nil {
		return 0, fmt.Errorf("start server: %w", err)
	}
	defer func() {
		_ = srv.Process.Kill()
		_ = srv.Wait()
	}()
	// The server needs a moment to listen; retry the client a few times.
	args := append([]string{"127.0.0.1", "-t", test, "-s", strconv.Itoa(size), "-n", strconv.Itoa(iters),
		"-w", strconv.Itoa(max(10, iters/20)), "-f", "-v"}, common...)
	var out []byte
	for attempt := 0; attempt < 20; attempt++ {
		time.Sleep(150 * time.Millisecond)
		cl := exec.CommandContext(ctx, bin, args...)
		cl.Env = append(os.Environ(), env...)
		out, err = cl.CombinedOutput()
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			break
		}
	}
	if err != nil {
		return 0, fmt.Errorf("%v: %s", err, lastLines(string(out)+srvOut.String(), 3))
	}
	return parsePerftestCSV(string(out))
}

// parsePerftestCSV reads the last line of ucx_perftest -f -v output:
// iterations,lat50,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr.
func parsePerftestCSV(out string) (float64, error) {
	lines := strings.Split(strings.TrimSpace(out), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		f := strings.Split(strings.TrimSpace(lines[i]), ",")
		if len(f) != 8 {
			continue
		}
		mbps, err := strconv.ParseFloat(f[5], 64)
		if err != nil {
			continue
		}
		return mbps * (1 << 20) / 1e9, nil
	}
	return 0, errors.New("no result line in ucx_perftest output: " + lastLines(out, 3))
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, " | ")
}

// memcpyBig copies n bytes between two populated mmap regions on this
// goroutine (one core) for at least 300 ms and returns GB/s.
func memcpyBig(n int) (float64, error) {
	src, err := newRegion(n, false)
	if err != nil {
		return 0, err
	}
	defer src.free()
	dst, err := newRegion(n, false)
	if err != nil {
		return 0, err
	}
	defer dst.free()
	copy(dst.b, src.b) // warm
	var bytes int
	start := time.Now()
	for time.Since(start) < 300*time.Millisecond {
		copy(dst.b, src.b)
		bytes += n
	}
	return float64(bytes) / time.Since(start).Seconds() / 1e9, nil
}

// memcpyScattered copies batch blocks of size blk with the transfer
// benchmark's scattered index pattern over two capBytes regions: what the
// engine moves per transfer, done by one core with copy().
func memcpyScattered(blk, batch, capBytes int, minTime time.Duration) (float64, error) {
	src, err := newRegion(capBytes, false)
	if err != nil {
		return 0, err
	}
	defer src.free()
	dst, err := newRegion(capBytes, false)
	if err != nil {
		return 0, err
	}
	defer dst.free()
	slots := max(1, capBytes/blk)
	li := benchIndices("scattered", batch, slots, false)
	ri := benchIndices("scattered", batch, slots, true)
	var bytes int
	start := time.Now()
	for it := 0; it < 5 || time.Since(start) < minTime; it++ {
		for i := range li {
			d, s := int(li[i])*blk, int(ri[i])*blk
			copy(dst.b[d:d+blk], src.b[s:s+blk])
		}
		bytes += batch * blk
	}
	return float64(bytes) / time.Since(start).Seconds() / 1e9, nil
}
