//go:build cgo && !gonixl_noucx

package ucx

import (
	"bufio"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/internal/conformance"
)

// envChild makes the test binary act as the peer process of the
// two-process tests in this file.
const envChild = "GONIXL_UCX_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv("UCX_LOG_LEVEL") == "" {
		// Dead-peer cases make UCX warn about requests it reclaims at
		// worker destruction; keep test output to errors.
		os.Setenv("UCX_LOG_LEVEL", "error")
	}
	conformance.MaybePeer() // never returns in a conformance peer process
	if os.Getenv(envChild) != "" {
		if err := runChild(); err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runChild registers a patterned buffer, prints its metadata as one hex
// line, loads the parent's metadata from stdin, then progresses until stdin
// closes or 60 s pass.
func runChild() error {
	e, err := nixl.Lookup(EngineName)
	if err != nil {
		return err
	}
	mode := os.Getenv(envChild)
	a, err := e.NewAgent(nixl.AgentConfig{Name: "child", BackendParams: map[string]map[string]string{"UCX": modeParams(mode)}})
	if err != nil {
		return err
	}
	defer a.Close()
	const size = 64 << 20
	buf, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return err
	}
	for i := 0; i < size; i += 4096 {
		buf[i] = byte(i >> 12)
	}
	if err := a.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(buf), Len: size}}); err != nil {
		return err
	}
	md, err := a.LocalMetadata()
	if err != nil {
		return err
	}
	fmt.Printf("%s\n", hex.EncodeToString(md))
	in := bufio.NewReader(os.Stdin)
	line, err := in.ReadString('\n')
	if err != nil {
		return err
	}
	pmd, err := hex.DecodeString(strings.TrimSpace(line))
	if err != nil {
		return err
	}
	if _, err := a.LoadRemoteMetadata(pmd); err != nil {
		return err
	}
	eof := make(chan struct{})
	go func() { io.Copy(io.Discard, in); close(eof) }()
	deadline := time.After(60 * time.Second)
	for {
		select {
		case <-eof:
			return nil
		case <-deadline:
			return errors.New("parent did not finish within 60s")
		default:
		}
		a.GetNotifs()
		time.Sleep(100 * time.Microsecond)
	}
}

// modeParams maps a child mode to backend parameters: an error-handling
// mode, or a data path ("cma", "shm") with error handling none.
func modeParams(mode string) map[string]string {
	if mode == "cma" || mode == "shm" {
		return map[string]string{ParamErrMode: "none", ParamDataPath: mode}
	}
	return map[string]string{ParamErrMode: mode}
}

type child struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	md    []byte
}

func startChild(t *testing.T, mode string, parent nixl.Agent) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envChild+"="+mode)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, stdin: stdin}
	t.Cleanup(func() {
		stdin.Close()
		cmd.Process.Kill()
		cmd.Wait()
	})
	lines := make(chan string, 1)
	go func() {
		s, _ := bufio.NewReader(stdout).ReadString('\n')
		lines <- s
	}()
	select {
	case s := <-lines:
		if c.md, err = hex.DecodeString(strings.TrimSpace(s)); err != nil || len(c.md) == 0 {
			t.Fatalf("child metadata %q: %v", s, err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("child printed no metadata within 30s")
	}
	md, err := parent.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(stdin, "%s\n", hex.EncodeToString(md))
	return c
}

// readAll builds a READ of the child's whole 64 MiB buffer in 1 MiB blocks
// into dst, alternating the order so that nothing coalesces.
func readAll(t *testing.T, a nixl.Agent, dst []byte, remoteBase uint64) nixl.Xfer {
	t.Helper()
	const blk, n = 1 << 20, 64
	ld, rd := make([]nixl.Desc, n), make([]nixl.Desc, n)
	li, ri := make([]int32, n), make([]int32, n)
	for i := 0; i < n; i++ {
		ld[i] = nixl.Desc{Addr: addrOf(dst) + uint64(i*blk), Len: blk}
		rd[i] = nixl.Desc{Addr: remoteBase + uint64(i*blk), Len: blk}
		li[i], ri[i] = int32(i), int32(i^1)
	}
	l, err := a.PrepDescList("", nixl.DRAM, ld)
	if err != nil {
		t.Fatal(err)
	}
	r, err := a.PrepDescList("child", nixl.DRAM, rd)
	if err != nil {
		t.Fatal(err)
	}
	x, err := a.MakeXfer(nixl.Read, l, li, r, ri, []byte("done"))
	if err != nil {
		t.Fatal(err)
	}
	return x
}

func remoteBase(t *testing.T, md []byte) uint64 {
	m, err := decodeMetadata(md)
	if err != nil || len(m.Regions) != 1 {
		t.Fatalf("child metadata: %v", err)
	}
	return m.Regions[0].Addr
}

// TestPeerKilledMidTransfer kills the peer process while READs from it are
// in flight: the transfer must end in ERR_REMOTE_DISCONNECT within a bounded
// time, and a restarted peer with the same name must be usable afterwards.
// In "peer" mode UCX reports the failure; in "none" mode the engine's
// same-host /proc check does; with data path shm, the peer's pidfd.
func TestPeerKilledMidTransfer(t *testing.T) {
	requireUCX(t)
	for _, mode := range []string{"peer", "none", "cma", "shm"} {
		t.Run(mode, func(t *testing.T) { peerKilled(t, mode) })
	}
}

func peerKilled(t *testing.T, mode string) {
	dst := mmapBuf(t, 64<<20)
	a := newAgent(t, "parent", modeParams(mode), false)
	if err := a.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(dst), Len: uint64(len(dst))}}); err != nil {
		t.Fatal(err)
	}
	c := startChild(t, mode, a)
	if _, err := a.LoadRemoteMetadata(c.md); err != nil {
		t.Fatal(err)
	}
	if mode == "shm" {
		requireShmPeer(t, a, "child")
	}
	x := readAll(t, a, dst, remoteBase(t, c.md))
	// One full transfer first, so the kill below hits a working path.
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, x, nil, 60*time.Second); st != nixl.Success {
		t.Fatalf("first READ: %v %v", st, err)
	}
	if dst[(1<<20)+4096] != byte(((0<<20)+4096)>>12) {
		t.Fatal("first READ data wrong")
	}
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// Keep reposting while transfers still succeed; a dead peer must turn
	// into an error before the deadline.
	deadline := time.Now().Add(60 * time.Second)
	var st nixl.Status
	var err error
	for time.Now().Before(deadline) {
		st, err = x.Check()
		if st == nixl.Success {
			st, err = x.Post()
		}
		if st.IsError() {
			break
		}
	}
	if !st.IsError() {
		t.Fatalf("transfer from a killed peer still %v after 60s", st)
	}
	t.Logf("after kill: %v %v", st, err)
	if !errors.Is(err, nixl.ErrRemoteDiscon) {
		t.Errorf("status %v, want ERR_REMOTE_DISCONNECT", st)
	}
	x.Release()

	// A restarted peer under the same name replaces the failed one.
	c2 := startChild(t, mode, a)
	if _, err := a.LoadRemoteMetadata(c2.md); err != nil {
		t.Fatalf("reload restarted peer: %v", err)
	}
	if mode == "shm" {
		requireShmPeer(t, a, "child")
	}
	x2 := readAll(t, a, dst, remoteBase(t, c2.md))
	if _, err := x2.Post(); err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, x2, nil, 60*time.Second); st != nixl.Success {
		t.Fatalf("READ from restarted peer: %v %v", st, err)
	}
	x2.Release()
}

// TestUnavailableReportsWhy loads a libucp that does not exist (in a child
// process: the library is loaded once per process) and checks that the
// engine says why it is unavailable instead of failing to load.
func TestUnavailableReportsWhy(t *testing.T) {
	if os.Getenv("GONIXL_UCX_TEST_AVAIL") != "" {
		e, err := nixl.Lookup(EngineName)
		if err != nil {
			t.Fatal(err)
		}
		err = e.Available()
		fmt.Printf("available=%v unavailable=%v\ninfo=%s\n", err == nil, errors.Is(err, nixl.ErrUnavailable), e.Info())
		if _, err := e.NewAgent(nixl.AgentConfig{Name: "x"}); err == nil {
			t.Fatal("NewAgent succeeded without UCX")
		}
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestUnavailableReportsWhy$", "-test.v")
	cmd.Env = append(os.Environ(), "GONIXL_UCX_TEST_AVAIL=1", EnvLib+"=/nonexistent/libucp.so.0")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	s := string(out)
	if !strings.Contains(s, "available=false unavailable=true") || !strings.Contains(s, "/nonexistent/libucp.so.0") || !strings.Contains(s, EnvLib) {
		t.Errorf("child output does not explain the missing library:\n%s", s)
	}
}
