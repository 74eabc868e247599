package main

// The comparison runs each implementation as its own group of processes
// (gonixl: "-role serve" initiator plus its target; NIXL-Python: the --serve
// script plus its target) and stops the group that is not measuring with
// SIGSTOP. Every NIXL agent runs a progress thread that polls even when idle
// (vLLM's default); on a 2-core host the idle implementation's two threads
// took about 0.75 of a core from the one being measured, which made the
// per-size ratio noise.

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gonixl/gonixl/nixl"
)

// pointRequest asks a serving process to measure one size point.
type pointRequest struct {
	Op    string `json:"op"`
	Block int    `json:"block"`
	Batch int    `json:"batch"`
}

// serveGo is the "-role serve" process: an in-process initiator (which starts
// its own target) measuring one point per request line on stdin, answering
// one JSON result line on stdout; "quit" ends it.
//
// The measuring goroutine is locked to its OS thread. Inside vLLM every call
// into the library runs on the calling Python thread (ctypes -> C -> Go stays
// on that thread), so one thread posts and polls a transfer, as in the
// Python loop; an unlocked goroutine instead moves between the runtime's
// threads across cgo calls, and NIXL/UCX, which copies CMA fragments in
// whichever thread posts or progresses, then spreads one transfer over three
// or four threads (strace: 4 threads against Python's 2), which made bulk
// READs 10-25 % slower than the same calls from Python.
func serveGo(o *transferOpts, stdin io.Reader, stdout, stderr io.Writer) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	in, err := startInitiator(o, stderr)
	if err != nil {
		return err
	}
	defer in.stop()
	enc := json.NewEncoder(stdout)
	if err := enc.Encode(map[string]any{"info": map[string]string{"engine": in.e.Info()}}); err != nil {
		return err
	}
	sc := bufio.NewScanner(stdin)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "quit" {
			return nil
		}
		var req pointRequest
		if err := json.Unmarshal([]byte(line), &req); err != nil {
			return fmt.Errorf("serve: bad request %q: %w", line, err)
		}
		op := nixl.Read
		if req.Op == "write" {
			op = nixl.Write
		}
		r, err := in.measure(combo{op, req.Block, req.Batch})
		if err != nil {
			_ = enc.Encode(map[string]string{"error": err.Error()})
			return err
		}
		if err := enc.Encode(r); err != nil {
			return err
		}
	}
	return sc.Err()
}

// procGroup is a serving process in its own process group, talking
// line-delimited JSON.
type procGroup struct {
	name  string
	cmd   *exec.Cmd
	stdin io.WriteCloser
	sc    *bufio.Scanner
	info  map[string]string
}

func startGroup(name string, cmd *exec.Cmd, stderr io.Writer) (*procGroup, error) {
	cmd.Stderr = stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	g := &procGroup{name: name, cmd: cmd, stdin: stdin, sc: bufio.NewScanner(out)}
	g.sc.Buffer(make([]byte, 1<<20), 64<<20)
	for g.sc.Scan() {
		var line struct {
			Info map[string]string `json:"info"`
		}
		if json.Unmarshal(g.sc.Bytes(), &line) == nil && line.Info != nil {
			g.info = line.Info
			return g, nil
		}
	}
	g.close()
	return nil, fmt.Errorf("%s exited before it was ready", name)
}

// pause stops every process of the group; resume continues them.
func (g *procGroup) pause()  { _ = syscall.Kill(-g.cmd.Process.Pid, syscall.SIGSTOP) }
func (g *procGroup) resume() { _ = syscall.Kill(-g.cmd.Process.Pid, syscall.SIGCONT) }

// measure resumes the group, has it measure one point and pauses it again.
func (g *procGroup) measure(c combo, impl string) (result, error) {
	g.resume()
	defer g.pause()
	req, _ := json.Marshal(pointRequest{Op: strings.ToLower(c.op.String()), Block: c.block, Batch: c.batch})
	if _, err := g.stdin.Write(append(req, '\n')); err != nil {
		return result{}, fmt.Errorf("%s: %w", g.name, err)
	}
	for g.sc.Scan() {
		var line struct {
			result
			Error   string  `json:"error"`
			Make    []int64 `json:"make_ns"`
			Post    []int64 `json:"post_ns"`
			Xfer    []int64 `json:"xfer_ns"`
			Release []int64 `json:"release_ns"`
		}
		if json.Unmarshal(g.sc.Bytes(), &line) != nil {
			continue // not ours
		}
		if line.Error != "" {
			return result{}, fmt.Errorf("%s: %s", g.name, line.Error)
		}
		if line.Op == "" {
			continue
		}
		if line.Xfer != nil { // raw samples (the Python script)
			return summarize(impl, line.Op, line.Block, line.Batch, line.Make, line.Post, line.Xfer, line.Release), nil
		}
		return line.result, nil
	}
	return result{}, fmt.Errorf("%s exited", g.name)
}

func (g *procGroup) close() {
	g.resume()
	_, _ = io.WriteString(g.stdin, "quit\n")
	_ = g.stdin.Close()
	done := make(chan struct{})
	go func() { _ = g.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		_ = syscall.Kill(-g.cmd.Process.Pid, syscall.SIGKILL)
		<-done
	}
}

// startGoGroup starts "gonixl-bench transfer -role serve" with the options
// that shape a measurement.
func startGoGroup(o *transferOpts, stderr io.Writer) (*procGroup, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	args := []string{"transfer", "-role", "serve", "-engine", o.engine, "-cap", strconv.Itoa(o.capBytes),
		"-progress-thread=" + strconv.FormatBool(o.progress), "-progress-delay=" + o.progressDelay.String(), "-pattern", o.pattern, "-thp=" + strconv.FormatBool(o.thp),
		"-min-time", o.minTime.String(), "-min-iters", strconv.Itoa(o.minIters), "-max-iters", strconv.Itoa(o.maxIters),
		"-target", o.target, "-python", o.python, "-script", o.script}
	g, err := startGroup("gonixl initiator", exec.Command(exe, args...), stderr)
	if err != nil {
		return nil, err
	}
	if g.info["engine"] == "" {
		g.close()
		return nil, errors.New("gonixl initiator did not say which engine it runs")
	}
	return g, nil
}
