package conformance

import (
	"bytes"
	"encoding/gob"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"github.com/gonixl/gonixl/nixl"
)

// peerEnv carries a peer's configuration (JSON) to the re-executed binary.
const peerEnv = "GONIXL_CONFORMANCE_PEER"

// peerIdle is how long a peer waits for its next request before giving up,
// so that a peer whose parent hangs does not linger.
const peerIdle = 5 * time.Minute

type peerConfig struct {
	Engine string
	Agent  nixl.AgentConfig
	Shape  Shape
	Seed   uint64
}

// request is one parent → peer message.
type request struct {
	Op      string // "load", "wait_notif", "verify", "send_notif", "exit"
	MD      []byte
	Agent   string
	Msg     []byte
	Timeout time.Duration
	Writes  []blockWrite
}

type blockWrite struct {
	Dst  int32
	From blockSrc
}

// response is one peer → parent message; the first one is the hello.
type response struct {
	Err     string
	Name    string
	MD      []byte
	Regions []nixl.Region
	Notifs  []nixl.Notif
}

// MaybePeer makes this process a conformance peer when the harness started
// it (GONIXL_CONFORMANCE_PEER is set): it serves the parent over file
// descriptors 3 (requests) and 4 (responses) and exits. Otherwise it
// returns at once. Call it first thing in TestMain.
func MaybePeer() {
	v := os.Getenv(peerEnv)
	if v == "" {
		return
	}
	code := 0
	if err := servePeer(v); err != nil {
		fmt.Fprintln(os.Stderr, "conformance peer:", err)
		code = 3
	}
	Exit(code)
}

// Exit ends a test binary (use it as os.Exit(m.Run()) in TestMain). Under
// the race detector it skips the race runtime's exit hook, which has
// crashed (SIGSEGV in racefini) in processes where a native engine's
// threads are still alive; races are reported when they happen and m.Run's
// code already says whether any were found.
func Exit(code int) {
	if raceEnabled {
		syscall.Exit(code)
	}
	os.Exit(code)
}

func servePeer(cfgJSON string) error {
	var cfg peerConfig
	if err := json.Unmarshal([]byte(cfgJSON), &cfg); err != nil {
		return fmt.Errorf("bad %s: %v", peerEnv, err)
	}
	in := os.NewFile(3, "conformance-requests")
	out := os.NewFile(4, "conformance-responses")
	if in == nil || out == nil {
		return errors.New("file descriptors 3 and 4 are not open")
	}
	enc := gob.NewEncoder(out)
	fail := func(err error) error {
		_ = enc.Encode(response{Err: err.Error()})
		return err
	}

	eng, err := nixl.Lookup(cfg.Engine)
	if err != nil {
		return fail(err)
	}
	if err := eng.Available(); err != nil {
		return fail(err)
	}
	agent, err := eng.NewAgent(cfg.Agent)
	if err != nil {
		return fail(err)
	}
	defer agent.Close()
	mem, err := newKVMem(cfg.Shape, cfg.Seed)
	if err != nil {
		return fail(err)
	}
	defer mem.free()
	if err := agent.RegisterMem(nixl.DRAM, mem.regions()); err != nil {
		return fail(err)
	}
	md, err := agent.LocalMetadata()
	if err != nil {
		return fail(err)
	}
	if err := enc.Encode(response{Name: agent.Name(), MD: md, Regions: mem.regions()}); err != nil {
		return err
	}

	// Requests arrive on a goroutine; the main loop keeps progressing the
	// agent (GetNotifs) while idle, as a serving vLLM worker does, so that
	// transports that need target-side progress work.
	reqs := make(chan request)
	readErr := make(chan error, 1)
	go func() {
		dec := gob.NewDecoder(in)
		for {
			var r request
			if err := dec.Decode(&r); err != nil {
				readErr <- err
				return
			}
			reqs <- r
		}
	}()
	var pending []nixl.Notif
	drain := func() error {
		n, err := agent.GetNotifs()
		pending = append(pending, n...)
		return err
	}
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	idle := time.NewTimer(peerIdle)
	defer idle.Stop()
	for {
		select {
		case <-tick.C:
			_ = drain()
			continue
		case err := <-readErr:
			if errors.Is(err, io.EOF) {
				return nil // parent went away
			}
			return err
		case <-idle.C:
			return fmt.Errorf("no request for %v", peerIdle)
		case r := <-reqs:
			idle.Reset(peerIdle)
			var resp response
			switch r.Op {
			case "load":
				name, err := agent.LoadRemoteMetadata(r.MD)
				resp.Name = name
				resp.Err = errString(err)
			case "wait_notif":
				deadline := time.Now().Add(r.Timeout)
				for {
					if err := drain(); err != nil {
						resp.Err = err.Error()
						break
					}
					if i := findNotif(pending, r.Agent, r.Msg); i >= 0 {
						resp.Notifs = []nixl.Notif{pending[i]}
						pending = append(pending[:i], pending[i+1:]...)
						break
					}
					if time.Now().After(deadline) {
						resp.Err = fmt.Sprintf("notification %q from %q not received within %v (received: %s)", r.Msg, r.Agent, r.Timeout, notifString(pending))
						break
					}
					time.Sleep(200 * time.Microsecond)
				}
			case "verify":
				for _, w := range r.Writes {
					if int(w.Dst) < 0 || int(w.Dst) >= len(mem.expect) {
						resp.Err = fmt.Sprintf("verify: block %d out of range", w.Dst)
						break
					}
					mem.expectCopy(w.Dst, w.From)
				}
				if resp.Err == "" {
					resp.Err = errString(mem.verify())
				}
			case "send_notif":
				resp.Err = errString(agent.SendNotif(r.Agent, r.Msg))
			case "exit":
				resp.Err = errString(agent.Close())
				_ = enc.Encode(resp)
				return nil
			default:
				resp.Err = fmt.Sprintf("unknown op %q", r.Op)
			}
			if err := enc.Encode(resp); err != nil {
				return err
			}
		}
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func findNotif(ns []nixl.Notif, agent string, msg []byte) int {
	for i, n := range ns {
		if (agent == "" || n.Agent == agent) && bytes.Equal(n.Msg, msg) {
			return i
		}
	}
	return -1
}

func notifString(ns []nixl.Notif) string {
	var b bytes.Buffer
	b.WriteByte('[')
	for i, n := range ns {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s:%q", n.Agent, n.Msg)
	}
	b.WriteByte(']')
	return b.String()
}

// peer is the parent's handle on a peer process.
type peer struct {
	cmd     *exec.Cmd
	reqW    *os.File
	respR   *os.File
	enc     *gob.Encoder
	dec     *gob.Decoder
	stderr  *tailBuffer
	hello   response
	waitErr chan error
	// progress, if set, is called while waiting for a response, so that
	// the parent's agent keeps progressing too.
	progress func()
}

// startPeer re-executes the test binary as a peer and reads its hello.
func startPeer(cfg peerConfig, timeout time.Duration) (*peer, error) {
	js, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	reqR, reqW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	respR, respW, err := os.Pipe()
	if err != nil {
		reqR.Close()
		reqW.Close()
		return nil, err
	}
	p := &peer{reqW: reqW, respR: respR, stderr: &tailBuffer{max: 64 << 10}, waitErr: make(chan error, 1)}
	// -test.run=^$ keeps a binary whose TestMain forgot MaybePeer from
	// running the tests again; it then exits and the hello fails clearly.
	p.cmd = exec.Command(os.Args[0], "-test.run=^$")
	p.cmd.Env = append(os.Environ(), peerEnv+"="+string(js))
	p.cmd.ExtraFiles = []*os.File{reqR, respW}
	p.cmd.Stdout = p.stderr
	p.cmd.Stderr = p.stderr
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		reqR.Close()
		reqW.Close()
		respR.Close()
		respW.Close()
		return nil, fmt.Errorf("conformance: start peer: %w", err)
	}
	reqR.Close()
	respW.Close()
	go func() { p.waitErr <- p.cmd.Wait() }()
	p.enc = gob.NewEncoder(reqW)
	p.dec = gob.NewDecoder(respR)
	hello, err := p.recv(timeout)
	if err == nil && hello.Err != "" {
		err = errors.New(hello.Err)
	}
	if err != nil {
		p.kill()
		return nil, fmt.Errorf("conformance: peer did not start (does TestMain call conformance.MaybePeer?): %w; peer output:\n%s", err, p.stderr.String())
	}
	p.hello = hello
	return p, nil
}

func (p *peer) recv(timeout time.Duration) (response, error) {
	var r response
	if err := p.respR.SetReadDeadline(time.Now().Add(timeout)); err != nil {
		return r, err
	}
	done := make(chan error, 1)
	go func() { done <- p.dec.Decode(&r) }()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-done:
			return r, err
		case <-tick.C:
			if p.progress != nil {
				p.progress()
			}
		}
	}
}

// call sends a request and waits for its response, at most timeout plus a
// margin for the peer's own work.
func (p *peer) call(r request, timeout time.Duration) (response, error) {
	if err := p.reqW.SetWriteDeadline(time.Now().Add(timeout)); err != nil {
		return response{}, err
	}
	if err := p.enc.Encode(r); err != nil {
		return response{}, fmt.Errorf("conformance: send %s to peer: %w; peer output:\n%s", r.Op, err, p.stderr.String())
	}
	resp, err := p.recv(timeout + r.Timeout)
	if err != nil {
		return resp, fmt.Errorf("conformance: peer %s: %w; peer output:\n%s", r.Op, err, p.stderr.String())
	}
	if resp.Err != "" {
		return resp, fmt.Errorf("peer %s: %s", r.Op, resp.Err)
	}
	return resp, nil
}

// kill ends the peer at once (SIGKILL) and reaps it.
func (p *peer) kill() {
	_ = p.cmd.Process.Kill()
	select {
	case <-p.waitErr:
	case <-time.After(30 * time.Second):
	}
	p.reqW.Close()
	p.respR.Close()
}

// stop asks the peer to exit cleanly, then kills it if it does not.
func (p *peer) stop(timeout time.Duration) error {
	_, err := p.call(request{Op: "exit"}, timeout)
	select {
	case werr := <-p.waitErr:
		if err == nil && werr != nil {
			err = fmt.Errorf("peer exit: %v; peer output:\n%s", werr, p.stderr.String())
		}
	case <-time.After(timeout):
		_ = p.cmd.Process.Kill()
		<-p.waitErr
		if err == nil {
			err = fmt.Errorf("peer did not exit within %v", timeout)
		}
	}
	p.reqW.Close()
	p.respR.Close()
	return err
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
	max int
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if len(b.buf) > b.max {
		b.buf = append(b.buf[:0:0], b.buf[len(b.buf)-b.max:]...)
	}
	return len(p), nil
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}
