//go:build cgo && !gonixl_noucx

package ucx

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/gonixl/gonixl/nixl"
)

// requireUCX fails when libucp cannot be loaded: UCX is installed wherever
// this cgo build runs (./build.sh setup installs it).
func requireUCX(t testing.TB) nixl.Engine {
	t.Helper()
	e, err := nixl.Lookup(EngineName)
	if err != nil {
		t.Fatalf("engine not registered: %v", err)
	}
	if err := e.Available(); err != nil {
		t.Fatalf("UCX does not load: %v", err)
	}
	return e
}

// mmapBuf returns memory outside the Go heap, as registered memory must be.
func mmapBuf(t testing.TB, n int) []byte {
	t.Helper()
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatalf("mmap: %v", err)
	}
	t.Cleanup(func() { syscall.Munmap(b) })
	return b
}

func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }

func newAgent(t testing.TB, name string, params map[string]string, progress bool) nixl.Agent {
	t.Helper()
	e := requireUCX(t)
	cfg := nixl.AgentConfig{Name: name, Telemetry: true, ProgressThread: progress}
	if params != nil {
		cfg.BackendParams = map[string]map[string]string{"UCX": params}
	}
	a, err := e.NewAgent(cfg)
	if err != nil {
		t.Fatalf("NewAgent(%s): %v", name, err)
	}
	t.Cleanup(func() {
		a.Close()
		notifStash.Lock()
		delete(notifStash.m, a)
		notifStash.Unlock()
	})
	return a
}

// notifStash keeps the notifications that drain took. GetNotifs both
// progresses an agent and takes its queue, so a helper that calls it only
// to progress a target (wait) would otherwise throw away the notification
// that waitNotif is about to wait for: with data_path "cma" the transfer's
// only UCX traffic is that notification, and when its send is queued
// (Post returns InProgress) it can arrive during wait's loop.
var notifStash = struct {
	sync.Mutex
	m map[nixl.Agent][]nixl.Notif
}{m: map[nixl.Agent][]nixl.Notif{}}

// drain progresses a through GetNotifs and keeps what it returns.
func drain(a nixl.Agent) error {
	ns, err := a.GetNotifs()
	if len(ns) > 0 {
		notifStash.Lock()
		notifStash.m[a] = append(notifStash.m[a], ns...)
		notifStash.Unlock()
	}
	return err
}

// takeNotif removes and returns the oldest notification kept for a.
func takeNotif(a nixl.Agent) (nixl.Notif, bool) {
	notifStash.Lock()
	defer notifStash.Unlock()
	q := notifStash.m[a]
	if len(q) == 0 {
		return nixl.Notif{}, false
	}
	notifStash.m[a] = q[1:]
	return q[0], true
}

// pair builds two agents that know each other, each with one registered
// buffer of n bytes.
type pairT struct {
	a, b       nixl.Agent
	bufA, bufB []byte
}

func newPair(t testing.TB, n int, params map[string]string, progress bool) *pairT {
	// Memory first: cleanups run last-in first-out, so the agents close
	// before their registered memory is unmapped.
	p := &pairT{bufA: mmapBuf(t, n), bufB: mmapBuf(t, n)}
	p.a, p.b = newAgent(t, "A", params, progress), newAgent(t, "B", params, progress)
	if err := p.a.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(p.bufA), Len: uint64(n)}}); err != nil {
		t.Fatal(err)
	}
	if err := p.b.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(p.bufB), Len: uint64(n)}}); err != nil {
		t.Fatal(err)
	}
	mdA, err := p.a.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	mdB, err := p.b.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	if name, err := p.a.LoadRemoteMetadata(mdB); err != nil || name != "B" {
		t.Fatalf("A loads B: %q %v", name, err)
	}
	if name, err := p.b.LoadRemoteMetadata(mdA); err != nil || name != "A" {
		t.Fatalf("B loads A: %q %v", name, err)
	}
	return p
}

// wait polls x (and progresses the other agent) until it leaves InProgress
// or the deadline passes.
func wait(t testing.TB, x nixl.Xfer, other nixl.Agent, d time.Duration) (nixl.Status, error) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		st, err := x.Check()
		if st != nixl.InProgress {
			return st, err
		}
		if other != nil {
			drain(other) // the target serves emulated RMA (tcp, shm on UCX 1.13)
		}
		if time.Now().After(deadline) {
			t.Fatalf("transfer still in progress after %v", d)
		}
	}
}

func waitNotif(t testing.TB, a nixl.Agent, other nixl.Agent, d time.Duration) nixl.Notif {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if err := drain(a); err != nil {
			t.Fatal(err)
		}
		if n, ok := takeNotif(a); ok {
			return n
		}
		if other != nil {
			drain(other)
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("no notification within %v", d)
	return nixl.Notif{}
}

func TestReadWriteNotif(t *testing.T) {
	for _, mode := range []string{"peer", "none", "cma"} {
		for _, prog := range []bool{false, true} {
			t.Run(mode+map[bool]string{false: "", true: "/progress-thread"}[prog], func(t *testing.T) {
				const blk, nblk = 4096, 16
				params := map[string]string{ParamErrMode: mode}
				if mode == "cma" {
					params = map[string]string{ParamErrMode: "none", ParamDataPath: "cma"}
				}
				p := newPair(t, blk*nblk, params, prog)
				for i := range p.bufB {
					p.bufB[i] = byte(i*7 + 3)
				}
				descs := make([]nixl.Desc, nblk)
				for i := range descs {
					descs[i] = nixl.Desc{Addr: addrOf(p.bufA) + uint64(i*blk), Len: blk}
				}
				rdescs := make([]nixl.Desc, nblk)
				for i := range rdescs {
					rdescs[i] = nixl.Desc{Addr: addrOf(p.bufB) + uint64(i*blk), Len: blk}
				}
				local, err := p.a.PrepDescList("", nixl.DRAM, descs)
				if err != nil {
					t.Fatal(err)
				}
				remote, err := p.a.PrepDescList("B", nixl.DRAM, rdescs)
				if err != nil {
					t.Fatal(err)
				}
				// READ blocks 0..7 from B into A in reverse, then 8..15 in order.
				li, ri := make([]int32, nblk), make([]int32, nblk)
				for i := 0; i < 8; i++ {
					li[i], ri[i] = int32(i), int32(7-i)
				}
				for i := 8; i < nblk; i++ {
					li[i], ri[i] = int32(i), int32(i)
				}
				x, err := p.a.MakeXfer(nixl.Read, local, li, remote, ri, []byte("req-1:1"))
				if err != nil {
					t.Fatal(err)
				}
				if ops, descs := x.(*xfer).Ops(); ops != 9 || descs != 16 {
					t.Errorf("ops after coalescing = %d (from %d), want 9", ops, descs)
				}
				st, err := x.Post()
				if err != nil {
					t.Fatalf("Post: %v %v", st, err)
				}
				if st, err = wait(t, x, p.b, 10*time.Second); st != nixl.Success {
					t.Fatalf("READ: %v %v", st, err)
				}
				for i := 0; i < nblk; i++ {
					src := int(ri[i]) * blk
					if !bytes.Equal(p.bufA[i*blk:(i+1)*blk], p.bufB[src:src+blk]) {
						t.Fatalf("block %d differs from remote block %d", i, ri[i])
					}
				}
				n := waitNotif(t, p.b, p.a, 10*time.Second)
				if n.Agent != "A" || string(n.Msg) != "req-1:1" {
					t.Errorf("notif = %+v", n)
				}
				tel, tst := x.Telemetry()
				if tst != nixl.Success || tel.Bytes != blk*nblk || tel.DescCount != 9 {
					t.Errorf("telemetry %+v %v", tel, tst)
				}
				// WRITE it back into B shifted, and repost the READ handle.
				for i := range p.bufA {
					p.bufA[i] = byte(i * 13)
				}
				w, err := p.a.MakeXfer(nixl.Write, local, []int32{0, 1, 2}, remote, []int32{5, 6, 7}, nil)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := w.Post(); err != nil {
					t.Fatal(err)
				}
				if st, err := wait(t, w, p.b, 10*time.Second); st != nixl.Success {
					t.Fatalf("WRITE: %v %v", st, err)
				}
				if !bytes.Equal(p.bufB[5*blk:8*blk], p.bufA[:3*blk]) {
					t.Fatal("WRITE data differs")
				}
				if err := w.Release(); err != nil {
					t.Fatal(err)
				}
				if err := w.Release(); err == nil {
					t.Error("second Release succeeded")
				}
				if err := p.a.SendNotif("B", []byte("hello")); err != nil {
					t.Fatal(err)
				}
				if n := waitNotif(t, p.b, p.a, 10*time.Second); string(n.Msg) != "hello" {
					t.Errorf("standalone notif = %+v", n)
				}
				info := p.a.(*agent).EndpointInfo()
				t.Logf("%s\n%s", p.a.(*agent).Info(), info)
				if !strings.Contains(info, "lane") {
					t.Errorf("endpoint info has no lanes: %q", info)
				}
			})
		}
	}
}

// Every transfer's notification reaches the target exactly once and in
// order, also when the target is progressed (through GetNotifs) while the
// initiator waits for completion, and none is dropped as malformed.
func TestNotifEachTransferOnce(t *testing.T) {
	for _, c := range []struct {
		name   string
		params map[string]string
		prog   bool
	}{
		{"none", map[string]string{ParamErrMode: "none"}, false},
		{"cma", map[string]string{ParamErrMode: "none", ParamDataPath: "cma"}, false},
		{"cma/progress-thread", map[string]string{ParamErrMode: "none", ParamDataPath: "cma"}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			const blk, n = 4096, 40
			p := newPair(t, blk, c.params, c.prog)
			local, err := p.a.PrepDescList("", nixl.DRAM, []nixl.Desc{{Addr: addrOf(p.bufA), Len: blk}})
			if err != nil {
				t.Fatal(err)
			}
			remote, err := p.a.PrepDescList("B", nixl.DRAM, []nixl.Desc{{Addr: addrOf(p.bufB), Len: blk}})
			if err != nil {
				t.Fatal(err)
			}
			for i := 0; i < n; i++ {
				x, err := p.a.MakeXfer(nixl.Read, local, []int32{0}, remote, []int32{0}, []byte(fmt.Sprintf("req-%d:1", i)))
				if err != nil {
					t.Fatal(err)
				}
				if st, err := x.Post(); err != nil {
					t.Fatalf("Post %d: %v %v", i, st, err)
				}
				if st, err := wait(t, x, p.b, 10*time.Second); st != nixl.Success {
					t.Fatalf("READ %d: %v %v", i, st, err)
				}
				if err := x.Release(); err != nil {
					t.Fatal(err)
				}
			}
			for i := 0; i < n; i++ {
				want := fmt.Sprintf("req-%d:1", i)
				if got := waitNotif(t, p.b, p.a, 10*time.Second); got.Agent != "A" || string(got.Msg) != want {
					t.Fatalf("notification %d = %s %q, want A %q", i, got.Agent, got.Msg, want)
				}
			}
			if err := drain(p.b); err != nil {
				t.Fatal(err)
			}
			if extra, ok := takeNotif(p.b); ok {
				t.Errorf("notification beyond the %d sent: %s %q", n, extra.Agent, extra.Msg)
			}
			if d := p.b.(*agent).DroppedNotifs(); d != 0 {
				t.Errorf("target dropped %d notifications as malformed", d)
			}
		})
	}
}

func TestRemoteOutsideAdvertised(t *testing.T) {
	p := newPair(t, 8192, map[string]string{ParamErrMode: "none"}, false)
	base := addrOf(p.bufB)
	for _, d := range []nixl.Desc{
		{Addr: base + 8192, Len: 1},     // just past the end
		{Addr: base + 4096, Len: 8192},  // starts inside, ends outside
		{Addr: base - 1, Len: 2},        // starts before
		{Addr: base, Len: 16, DevID: 1}, // wrong device
	} {
		_, err := p.a.PrepDescList("B", nixl.DRAM, []nixl.Desc{d})
		if !errors.Is(err, nixl.ErrNotFound) {
			t.Errorf("PrepDescList(%+v) = %v, want ERR_NOT_FOUND", d, err)
		}
	}
	if _, err := p.a.PrepDescList("nobody", nixl.DRAM, []nixl.Desc{{Addr: base, Len: 1}}); !errors.Is(err, nixl.ErrNotFound) {
		t.Errorf("unknown agent: %v", err)
	}
	if _, err := p.a.PrepDescList("", nixl.DRAM, []nixl.Desc{{Addr: addrOf(p.bufA) + 8000, Len: 400}}); !errors.Is(err, nixl.ErrNotFound) {
		t.Errorf("local outside: %v", err)
	}
}

func TestGarbageMetadata(t *testing.T) {
	buf := mmapBuf(t, 4096)
	a := newAgent(t, "A", nil, false)
	b := newAgent(t, "B", nil, false)
	if err := b.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(buf), Len: 4096}}); err != nil {
		t.Fatal(err)
	}
	md, err := b.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	bad := [][]byte{nil, {}, []byte("nixlSerDes|garbage"), md[:len(md)-1], md[:20], append(append([]byte{}, md...), 0)}
	for i := 0; i < len(md); i += 7 {
		c := append([]byte{}, md...)
		c[i] ^= 0x5a
		bad = append(bad, c)
	}
	for i, m := range bad {
		if _, err := a.LoadRemoteMetadata(m); err == nil {
			t.Errorf("garbage %d (%d bytes) loaded", i, len(m))
		}
	}
	own, _ := a.LocalMetadata()
	if _, err := a.LoadRemoteMetadata(own); err == nil {
		t.Error("own metadata loaded as remote")
	}
	if _, err := a.LoadRemoteMetadata(md); err != nil {
		t.Fatalf("good metadata after garbage: %v", err)
	}
}

// A re-handshake with identical metadata keeps prepared transfers valid; a
// reload that changes the regions makes them fail with ERR_NOT_FOUND.
func TestReloadMetadata(t *testing.T) {
	p := newPair(t, 8192, map[string]string{ParamErrMode: "none"}, false)
	extra := mmapBuf(t, 4096)
	l, err := p.a.PrepDescList("", nixl.DRAM, []nixl.Desc{{Addr: addrOf(p.bufA), Len: 64}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := p.a.PrepDescList("B", nixl.DRAM, []nixl.Desc{{Addr: addrOf(p.bufB), Len: 64}})
	if err != nil {
		t.Fatal(err)
	}
	x, err := p.a.MakeXfer(nixl.Read, l, []int32{0}, r, []int32{0}, nil)
	if err != nil {
		t.Fatal(err)
	}
	md, _ := p.b.LocalMetadata()
	if _, err := p.a.LoadRemoteMetadata(md); err != nil {
		t.Fatalf("identical reload: %v", err)
	}
	if _, err := x.Post(); err != nil {
		t.Fatalf("Post after identical reload: %v", err)
	}
	if st, err := wait(t, x, p.b, 10*time.Second); st != nixl.Success {
		t.Fatal(st, err)
	}
	if err := p.b.RegisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(extra), Len: 4096}}); err != nil {
		t.Fatal(err)
	}
	md, _ = p.b.LocalMetadata()
	if _, err := p.a.LoadRemoteMetadata(md); err != nil {
		t.Fatalf("reload with a new region: %v", err)
	}
	if _, err := x.Post(); !errors.Is(err, nixl.ErrNotFound) {
		t.Errorf("Post against replaced metadata: %v, want ERR_NOT_FOUND", err)
	}
	if _, err := p.a.MakeXfer(nixl.Read, l, []int32{0}, r, []int32{0}, nil); !errors.Is(err, nixl.ErrNotFound) {
		t.Errorf("MakeXfer with a stale remote list: %v, want ERR_NOT_FOUND", err)
	}
	r2, err := p.a.PrepDescList("B", nixl.DRAM, []nixl.Desc{{Addr: addrOf(extra) + 100, Len: 64}})
	if err != nil {
		t.Fatalf("new region not visible after reload: %v", err)
	}
	r2.Release()
	x.Release()
	if err := p.b.DeregisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(extra), Len: 4096}}); err != nil {
		t.Fatal(err)
	}
	if err := p.b.DeregisterMem(nixl.DRAM, []nixl.Region{{Addr: addrOf(extra), Len: 4096}}); !errors.Is(err, nixl.ErrNotFound) {
		t.Errorf("second DeregisterMem: %v", err)
	}
}

// Several goroutines drive one agent at once (transfers, notifications,
// metadata) while its progress thread runs: run with -race.
func TestConcurrentUse(t *testing.T) {
	const blk, nblk, workers = 4096, 32, 4
	p := newPair(t, blk*nblk, map[string]string{ParamErrMode: "none"}, true)
	descs := func(base []byte) []nixl.Desc {
		d := make([]nixl.Desc, nblk)
		for i := range d {
			d[i] = nixl.Desc{Addr: addrOf(base) + uint64(i*blk), Len: blk}
		}
		return d
	}
	local, err := p.a.PrepDescList("", nixl.DRAM, descs(p.bufA))
	if err != nil {
		t.Fatal(err)
	}
	remote, err := p.a.PrepDescList("B", nixl.DRAM, descs(p.bufB))
	if err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, workers+1)
	stop := make(chan struct{})
	go func() { // the target drains notifications meanwhile
		for {
			select {
			case <-stop:
				errs <- nil
				return
			default:
			}
			if _, err := p.b.GetNotifs(); err != nil {
				errs <- err
				return
			}
		}
	}()
	done := make(chan error, workers)
	for w := 0; w < workers; w++ {
		go func(w int) {
			for i := 0; i < 50; i++ {
				idx := []int32{int32(w * 8), int32(w*8 + 1 + i%7)}
				op := nixl.Read
				if i%2 == 1 {
					op = nixl.Write
				}
				x, err := p.a.MakeXfer(op, local, idx, remote, idx, []byte("w"))
				if err != nil {
					done <- err
					return
				}
				if _, err := x.Post(); err != nil {
					done <- err
					return
				}
				deadline := time.Now().Add(20 * time.Second)
				for {
					st, err := x.Check()
					if err != nil {
						done <- err
						return
					}
					if st == nixl.Success {
						break
					}
					if time.Now().After(deadline) {
						done <- errors.New("transfer stuck")
						return
					}
				}
				if err := x.Release(); err != nil {
					done <- err
					return
				}
				if _, err := p.a.LocalMetadata(); err != nil {
					done <- err
					return
				}
			}
			done <- nil
		}(w)
	}
	for w := 0; w < workers; w++ {
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
	close(stop)
	if err := <-errs; err != nil {
		t.Error(err)
	}
}

// The default error mode, auto, uses "none" for a peer on this host, so UCX
// may pick shared memory instead of TCP.
func TestAutoErrModeSameHost(t *testing.T) {
	p := newPair(t, 4096, nil, false)
	info := p.a.(*agent).EndpointInfo()
	if !strings.Contains(info, "error handling none, setting auto") {
		t.Errorf("endpoint info: %s", info)
	}
}

func TestStatusMapping(t *testing.T) {
	for rc, want := range map[int]nixl.Status{
		0: nixl.Success, 1: nixl.InProgress, gxErrRepostActive: nixl.ErrRepostActive,
		gxErrEpFailed: nixl.ErrRemoteDiscon, gxErrEpClosed: nixl.ErrRemoteDiscon,
		-25: nixl.ErrRemoteDiscon, -24: nixl.ErrRemoteDiscon, -16: nixl.ErrRemoteDiscon, -80: nixl.ErrRemoteDiscon, -45: nixl.ErrRemoteDiscon,
		-5: nixl.ErrInvalidParam, -3: nixl.ErrBackend, -4: nixl.ErrBackend,
	} {
		if got := statusOfInt(rc); got != want {
			t.Errorf("rc %d → %v, want %v", rc, got, want)
		}
	}
}

// Loading UCX must leave the Go runtime's SIGSEGV handling in place: a nil
// dereference is still a recoverable panic (UCX's own error handlers would
// abort the process instead; see native.SetUCXDefaults).
func TestGoPanicRecoverableAfterUCX(t *testing.T) {
	if v, set := os.LookupEnv("UCX_HANDLE_ERRORS"); set && v != "none" {
		t.Skipf("UCX_HANDLE_ERRORS=%q set by the user: UCX's signal handlers are wanted", v)
	}
	newAgent(t, "A", nil, false)
	var p *int
	var got any
	func() {
		defer func() { got = recover() }()
		_ = *p
	}()
	if got == nil {
		t.Fatal("nil dereference did not panic")
	}
}

// A panic in the progress thread must not kill the process: the thread
// stops, GetNotifs reports it once, and transfers keep completing on the
// callers' polls.
func TestProgressThreadPanicRecovered(t *testing.T) {
	var once sync.Once
	progressPanicHook = func() { once.Do(func() { panic("injected") }) }
	t.Cleanup(func() { progressPanicHook = nil })
	const blk = 4096
	p := newPair(t, blk*4, map[string]string{ParamErrMode: "none"}, true)
	for i := range p.bufB {
		p.bufB[i] = byte(i*5 + 1)
	}
	deadline := time.Now().Add(10 * time.Second)
	var got error
	for got == nil && time.Now().Before(deadline) {
		got = drain(p.a)
		if got == nil {
			got = drain(p.b)
		}
		time.Sleep(time.Millisecond)
	}
	if got == nil || !strings.Contains(got.Error(), "panicked") || !strings.Contains(got.Error(), "injected") {
		t.Fatalf("GetNotifs after the progress thread panicked: %v", got)
	}
	if err := drain(p.a); err != nil {
		t.Fatalf("reported more than once: %v", err)
	}
	local, err := p.a.PrepDescList("", nixl.DRAM, []nixl.Desc{{Addr: addrOf(p.bufA), Len: blk * 4}})
	if err != nil {
		t.Fatal(err)
	}
	remote, err := p.a.PrepDescList("B", nixl.DRAM, []nixl.Desc{{Addr: addrOf(p.bufB), Len: blk * 4}})
	if err != nil {
		t.Fatal(err)
	}
	x, err := p.a.MakeXfer(nixl.Read, local, []int32{0}, remote, []int32{0}, []byte("r:1"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, x, p.b, 10*time.Second); st != nixl.Success {
		t.Fatalf("READ after the panic: %v %v", st, err)
	}
	if !bytes.Equal(p.bufA, p.bufB) {
		t.Fatal("READ after the panic moved wrong data")
	}
	_ = x.Release()
}

// A READ given up on (its peer stopped progressing) must never write local
// memory after it is released: Release refuses while its GETs may still
// land. In peer mode InvalidateRemote force-closes an established endpoint
// so that they cannot, and Release then succeeds at once; the peer's late
// answers are dropped. In none mode (UCX 1.13: a forced close does not
// complete the operations) Release keeps refusing until the peer answers.
func TestGivenUpReadNeverLandsLate(t *testing.T) {
	for _, c := range []struct {
		name, tls, mode string
		cancels         bool
	}{
		{"tcp-peer", "tcp", "peer", true},
		{"sm-none", "", "none", false},
	} {
		t.Run(c.name, func(t *testing.T) { givenUpReadNeverLandsLate(t, c.tls, c.mode, c.cancels) })
	}
}

func givenUpReadNeverLandsLate(t *testing.T, tls, mode string, cancels bool) {
	if tls != "" {
		t.Setenv("UCX_TLS", tls) // GETs emulated over active messages: the target must progress
	}
	const blk, nblk = 64 << 10, 8
	// Data path ucp: this test is about UCX's GETs (cma, the default, moves
	// the bytes in this process; TestHostCopyIsAsync covers it).
	p := newPair(t, blk*nblk, map[string]string{ParamErrMode: mode, ParamDataPath: "ucp"}, false)
	local, err := p.a.PrepDescList("", nixl.DRAM, []nixl.Desc{{Addr: addrOf(p.bufA), Len: blk * nblk}})
	if err != nil {
		t.Fatal(err)
	}
	remote, err := p.a.PrepDescList("B", nixl.DRAM, []nixl.Desc{{Addr: addrOf(p.bufB), Len: blk * nblk}})
	if err != nil {
		t.Fatal(err)
	}
	// One READ with B progressing: the endpoint is wired up.
	warm, err := p.a.MakeXfer(nixl.Read, local, []int32{0}, remote, []int32{0}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := warm.Post(); err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, warm, p.b, 10*time.Second); st != nixl.Success {
		t.Fatalf("warm-up READ: %v %v", st, err)
	}
	_ = warm.Release()
	for i := range p.bufA {
		p.bufA[i] = 0
	}
	for i := range p.bufB {
		p.bufB[i] = 0xAB
	}
	x, err := p.a.MakeXfer(nixl.Read, local, []int32{0}, remote, []int32{0}, []byte("late:1"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	// B does not progress now: the READ stays in flight.
	for i := 0; i < 50; i++ {
		if st, err := x.Check(); st != nixl.InProgress {
			t.Skipf("the READ completed without the target's progress (%v %v): this UCX serves GET without it", st, err)
		}
		time.Sleep(2 * time.Millisecond)
	}
	if err := x.Release(); nixl.StatusOf(err) != nixl.ErrRepostActive {
		t.Fatalf("Release of a READ still in flight: %v, want ERR_REPOST_ACTIVE", err)
	}
	t0 := time.Now()
	if err := p.a.InvalidateRemote("B"); err != nil {
		t.Fatal(err)
	}
	// The endpoint is retired in the background: the caller (vLLM's model
	// thread, through the worker) does not wait for the flush timeout.
	if d := time.Since(t0); d >= flushTimeoutMs*time.Millisecond/2 {
		t.Fatalf("InvalidateRemote of a silent peer took %v: it waited for the endpoint's flush", d)
	}
	if !cancels {
		// B still silent: the operations stay outstanding, and so must the
		// handle (its memory may still be written).
		for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
			if err := x.Release(); nixl.StatusOf(err) != nixl.ErrRepostActive {
				t.Fatalf("Release with the operations outstanding after InvalidateRemote: %v, want ERR_REPOST_ACTIVE", err)
			}
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := x.Release()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Release after InvalidateRemote: %v", err)
		}
		if !cancels {
			drain(p.b) // B answers now
		}
		time.Sleep(10 * time.Millisecond)
	}
	landed := 0
	for _, v := range p.bufA {
		if v != 0 {
			landed++
		}
	}
	t.Logf("%d of %d bytes had landed before the release", landed, len(p.bufA))
	for i := range p.bufA {
		p.bufA[i] = 0
	}
	_ = local.Release()
	_ = remote.Release()
	// Now B answers, and A progresses: nothing may land.
	for i := 0; i < 200; i++ {
		drain(p.b)
		drain(p.a)
		time.Sleep(time.Millisecond)
	}
	for i, v := range p.bufA {
		if v != 0 {
			t.Fatalf("byte %d of the given-up READ's buffer changed to %#x after the READ was released", i, v)
		}
	}
}

// TestHostCopyIsAsync: with the default data path (cma) a same-host READ is
// copied by this process on its own goroutine: Post returns before the copy
// (vLLM posts from its model thread), the transfer is in progress and
// cannot be released while the copy runs, Close waits for it, and the bytes
// land without the peer ever progressing (UCX 1.13's emulated GET would wait
// for the peer's progress thread, which a busy host starves).
func TestHostCopyIsAsync(t *testing.T) {
	const n = 1 << 20
	p := newPair(t, n, nil, false) // defaults: error mode auto, data path cma
	if info := p.a.(*agent).Info(); !strings.Contains(info, "cma for same-host peers") {
		t.Fatalf("default data path: %s", info)
	}
	for i := range p.bufB {
		p.bufB[i] = byte(i*7 + 3)
	}
	local, err := p.a.PrepDescList("", nixl.DRAM, []nixl.Desc{{Addr: addrOf(p.bufA), Len: n}})
	if err != nil {
		t.Fatal(err)
	}
	remote, err := p.a.PrepDescList("B", nixl.DRAM, []nixl.Desc{{Addr: addrOf(p.bufB), Len: n}})
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	started := make(chan struct{}, 4)
	hostCopyHook = func() { started <- struct{}{}; <-release }
	t.Cleanup(func() { hostCopyHook = nil })
	x, err := p.a.MakeXfer(nixl.Read, local, []int32{0}, remote, []int32{0}, []byte("async:1"))
	if err != nil {
		t.Fatal(err)
	}
	if st, err := x.Post(); st != nixl.InProgress || err != nil {
		t.Fatalf("Post with the copy held: %v %v, want IN_PROG", st, err)
	}
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the host copy did not start")
	}
	if st, _ := x.Check(); st != nixl.InProgress {
		t.Fatalf("Check while the copy is held: %v, want IN_PROG", st)
	}
	if err := x.Release(); nixl.StatusOf(err) != nixl.ErrRepostActive {
		t.Fatalf("Release while the copy runs: %v, want ERR_REPOST_ACTIVE", err)
	}
	if p.bufA[n-1] != 0 {
		t.Fatal("bytes landed before the copy ran")
	}
	landed := x.(nixl.Lander).Landed()
	select {
	case <-landed:
		t.Fatal("Landed closed before the copy ran")
	default:
	}
	close(release)
	// B never progresses: the data must still arrive, and Landed says so
	// without a Check.
	select {
	case <-landed:
	case <-time.After(10 * time.Second):
		t.Fatal("Landed did not close after the copy")
	}
	if !bytes.Equal(p.bufA, p.bufB) {
		t.Fatal("Landed closed before every byte of the READ was in place")
	}
	if st, err := wait(t, x, p.b, 10*time.Second); st != nixl.Success {
		t.Fatalf("READ: %v %v", st, err)
	}
	if m := waitNotif(t, p.b, p.a, 10*time.Second); string(m.Msg) != "async:1" {
		t.Fatalf("notification %q", m.Msg)
	}
	if err := x.Release(); err != nil {
		t.Fatal(err)
	}

	// Close waits for a copy in flight.
	release2 := make(chan struct{})
	hostCopyHook = func() { started <- struct{}{}; <-release2 }
	y, err := p.a.MakeXfer(nixl.Read, local, []int32{0}, remote, []int32{0}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := y.Post(); err != nil {
		t.Fatal(err)
	}
	<-started
	closed := make(chan error, 1)
	go func() { closed <- p.a.Close() }()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a host copy was running", err)
	case <-time.After(200 * time.Millisecond):
	}
	close(release2)
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return after the copy ended")
	}
}

// A panic on the host copy's goroutine fails that transfer, and only it:
// the process lives on, Check reports the failure, the handle releases and
// the agent still moves bytes.
func TestHostCopyPanicFailsTheTransfer(t *testing.T) {
	const n = 4096
	p := newPair(t, n, nil, false)
	local, err := p.a.PrepDescList("", nixl.DRAM, []nixl.Desc{{Addr: addrOf(p.bufA), Len: n}})
	if err != nil {
		t.Fatal(err)
	}
	remote, err := p.a.PrepDescList("B", nixl.DRAM, []nixl.Desc{{Addr: addrOf(p.bufB), Len: n}})
	if err != nil {
		t.Fatal(err)
	}
	hostCopyHook = func() { panic("injected") }
	t.Cleanup(func() { hostCopyHook = nil })
	x, err := p.a.MakeXfer(nixl.Read, local, []int32{0}, remote, []int32{0}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	st, err := wait(t, x, p.b, 10*time.Second)
	if st != nixl.ErrBackend || err == nil || !strings.Contains(err.Error(), "panic: injected") {
		t.Fatalf("after a panic in the copy: %v %v, want ERR_BACKEND naming the panic", st, err)
	}
	select {
	case <-x.(nixl.Lander).Landed():
		t.Fatal("Landed closed for a transfer that failed")
	default:
	}
	if err := x.Release(); err != nil {
		t.Fatal(err)
	}
	hostCopyHook = nil
	for i := range p.bufB {
		p.bufB[i] = byte(i + 1)
	}
	y, err := p.a.MakeXfer(nixl.Read, local, []int32{0}, remote, []int32{0}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := y.Post(); err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, y, p.b, 10*time.Second); st != nixl.Success || !bytes.Equal(p.bufA, p.bufB) {
		t.Fatalf("the next READ: %v %v", st, err)
	}
	_ = y.Release()
}

// TryCheck and TryGetNotifs decline, checking and taking nothing, while
// another thread holds the agent mutex (the progress thread's sweep, a
// post), and never keep it; free, TryCheck is Check.
func TestTryCallsDeclineWhileTheAgentIsHeld(t *testing.T) {
	a := &agent{name: "a"}
	x := &xfer{a: a}
	a.mu.Lock()
	if st, err, ok := x.TryCheck(); ok || st != nixl.InProgress || err != nil {
		t.Fatalf("TryCheck with the agent held: %v %v %v", st, err, ok)
	}
	if n, err, ok := a.TryGetNotifs(); ok || n != nil || err != nil {
		t.Fatalf("TryGetNotifs with the agent held: %v %v %v", n, err, ok)
	}
	a.mu.Unlock()
	if st, _, ok := x.TryCheck(); !ok || st != nixl.ErrNotPosted {
		t.Fatalf("TryCheck of a transfer never posted, the agent free: %v %v", st, ok)
	}
	a.closed = true
	if _, err, ok := a.TryGetNotifs(); !ok || err == nil {
		t.Fatalf("TryGetNotifs of a closed agent: %v %v", err, ok)
	}
	if !a.mu.TryLock() {
		t.Fatal("a Try call kept the agent mutex")
	}
	a.mu.Unlock()
}
