package nixltest_test

import (
	"errors"
	"reflect"
	"syscall"
	"testing"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/internal/conformance"
	"github.com/gonixl/gonixl/nixl/nixltest"
)

func TestMain(m *testing.M) {
	conformance.MaybePeer()
	conformance.Exit(m.Run())
}

// The fake passes every conformance case that needs no second process.
func TestConformanceInProcess(t *testing.T) {
	conformance.RunInProcess(t, conformance.Config{Engine: "fake"})
}

func TestConformanceInProcessSlowPolls(t *testing.T) {
	e := nixltest.NewEngine("fake-slow")
	e.SetScript(nixltest.Script{Polls: 5})
	nixl.Register(e)
	conformance.RunInProcess(t, conformance.Config{Engine: "fake-slow", Shape: conformance.Shape{Layers: 2, Blocks: 8, BlockSize: 256}})
}

type pair struct {
	a, b         *nixltest.Agent
	mem          []byte
	local, remot nixl.DescList
}

func newPair(t *testing.T, e *nixltest.Engine, s nixltest.Script) *pair {
	t.Helper()
	e.SetScript(s)
	mk := func(name string) *nixltest.Agent {
		ag, err := e.NewAgent(nixl.AgentConfig{Name: name, Telemetry: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ag.Close() })
		return ag.(*nixltest.Agent)
	}
	p := &pair{a: mk(t.Name() + "-a"), b: mk(t.Name() + "-b")}
	mem, err := syscall.Mmap(-1, 0, 8192, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Munmap(mem) })
	p.mem = mem
	base := uint64(reflect.ValueOf(mem).Pointer())
	ra, rb := nixl.Region{Addr: base, Len: 4096}, nixl.Region{Addr: base + 4096, Len: 4096}
	if err := p.a.RegisterMem(nixl.DRAM, []nixl.Region{ra}); err != nil {
		t.Fatal(err)
	}
	if err := p.b.RegisterMem(nixl.DRAM, []nixl.Region{rb}); err != nil {
		t.Fatal(err)
	}
	md, err := p.b.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.a.LoadRemoteMetadata(md); err != nil {
		t.Fatal(err)
	}
	if p.local, err = p.a.PrepDescList("", nixl.DRAM, []nixl.Desc{{Addr: base, Len: 4096}}); err != nil {
		t.Fatal(err)
	}
	if p.remot, err = p.a.PrepDescList(p.b.Name(), nixl.DRAM, []nixl.Desc{{Addr: base + 4096, Len: 4096}}); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestScriptedPolls(t *testing.T) {
	e := nixltest.NewEngine("polls")
	p := newPair(t, e, nixltest.Script{Polls: 3})
	for i := range 4096 {
		p.mem[4096+i] = byte(i)
	}
	x, err := p.a.MakeXfer(nixl.Read, p.local, []int32{0}, p.remot, []int32{0}, []byte("n1"))
	if err != nil {
		t.Fatal(err)
	}
	if st, err := x.Post(); st != nixl.InProgress || err != nil {
		t.Fatalf("Post: %v %v", st, err)
	}
	if st, err := x.Post(); st != nixl.ErrRepostActive || !errors.Is(err, nixl.ErrRepostActive) {
		t.Fatalf("repost while active: %v %v", st, err)
	}
	for i := 0; i < 3; i++ {
		if st, err := x.Check(); st != nixl.InProgress || err != nil {
			t.Fatalf("poll %d: %v %v", i, st, err)
		}
		if _, st := x.Telemetry(); st != nixl.InProgress {
			t.Fatalf("telemetry while in progress: %v", st)
		}
	}
	if st, err := x.Check(); st != nixl.Success || err != nil {
		t.Fatalf("final poll: %v %v", st, err)
	}
	if p.mem[100] != 100 || p.mem[4095] != byte(4095%256) {
		t.Fatal("data not copied")
	}
	ns, _ := p.b.GetNotifs()
	if len(ns) != 1 || string(ns[0].Msg) != "n1" || ns[0].Agent != p.a.Name() {
		t.Fatalf("notifs: %+v", ns)
	}
	tel, st := x.Telemetry()
	if st != nixl.Success || tel.Bytes != 4096 || tel.DescCount != 1 {
		t.Fatalf("telemetry: %+v %v", tel, st)
	}
	if got := p.a.CountCalls("Check"); got != 4 {
		t.Fatalf("recorded %d Check calls, want 4", got)
	}
	_ = x.Release()
	if l, xs := p.a.Live(); l != 2 || xs != 0 {
		t.Fatalf("live lists %d xfers %d", l, xs)
	}
}

func TestScriptedFailure(t *testing.T) {
	e := nixltest.NewEngine("fail")
	p := newPair(t, e, nixltest.Script{FailStep: nixltest.StepCheck, FailStatus: nixl.ErrRemoteDiscon, FailNth: 2, Polls: 5})
	x, err := p.a.MakeXfer(nixl.Write, p.local, []int32{0}, p.remot, []int32{0}, []byte("x"))
	if err != nil {
		t.Fatal(err)
	}
	defer x.Release()
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	if st, _ := x.Check(); st != nixl.InProgress {
		t.Fatalf("first check: %v", st)
	}
	st, err := x.Check()
	if st != nixl.ErrRemoteDiscon || !errors.Is(err, nixl.ErrRemoteDiscon) {
		t.Fatalf("second check: %v %v", st, err)
	}
	// Sticky.
	if st, _ := x.Check(); st != nixl.ErrRemoteDiscon {
		t.Fatalf("third check: %v", st)
	}
	if ns, _ := p.b.GetNotifs(); len(ns) != 0 {
		t.Fatalf("failed transfer delivered %v", ns)
	}
}

func TestKilledPeer(t *testing.T) {
	e := nixltest.NewEngine("kill")
	p := newPair(t, e, nixltest.Script{Polls: 1})
	x, err := p.a.MakeXfer(nixl.Read, p.local, []int32{0}, p.remot, []int32{0}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer x.Release()
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	p.b.Kill()
	if st, err := x.Check(); st != nixl.ErrRemoteDiscon || err == nil {
		t.Fatalf("check after kill: %v %v", st, err)
	}
	if err := p.a.SendNotif(p.b.Name(), []byte("x")); !errors.Is(err, nixl.ErrRemoteDiscon) {
		t.Fatalf("SendNotif to dead: %v", err)
	}
}

func TestUnavailable(t *testing.T) {
	e := nixltest.NewEngine("gone")
	e.SetUnavailable(errors.New("no library"))
	if err := e.Available(); !errors.Is(err, nixl.ErrUnavailable) {
		t.Fatalf("Available: %v", err)
	}
	if _, err := e.NewAgent(nixl.AgentConfig{Name: "x"}); err == nil {
		t.Fatal("NewAgent succeeded on an unavailable engine")
	}
}

func TestMetadataFromAnotherProcessRejected(t *testing.T) {
	e := nixltest.NewEngine("md")
	p := newPair(t, e, nixltest.Script{})
	md := []byte("gonixl-fake-md\x00{\"Name\":\"other\",\"PID\":1,\"Regs\":{}}")
	if _, err := p.a.LoadRemoteMetadata(md); nixl.StatusOf(err) != nixl.ErrNotSupported {
		t.Fatalf("foreign metadata: %v", err)
	}
}

// The observation API: a transfer is listed from MakeXfer to Release, its
// movement is reported to the move hook before the bytes move, Settle
// finishes it without a poll, and a held notification is delivered only
// when the test injects it.
func TestObserveAndSettle(t *testing.T) {
	e := nixltest.NewEngine("observe")
	p := newPair(t, e, nixltest.Script{Polls: 1000})
	for i := range 4096 {
		p.mem[4096+i] = byte(i)
	}
	var moves []nixltest.Move
	e.SetMoveHook(func(m nixltest.Move) {
		if p.mem[7] == 7 {
			t.Error("the move hook ran after the bytes moved")
		}
		moves = append(moves, m)
	})
	var held [][]byte
	e.SetNotifHook(func(from, to string, msg []byte) bool {
		if from != p.a.Name() || to != p.b.Name() {
			t.Errorf("notification %s -> %s", from, to)
		}
		held = append(held, msg)
		return true
	})
	x, err := p.a.MakeXfer(nixl.Read, p.local, []int32{0}, p.remot, []int32{0}, []byte("n1"))
	if err != nil {
		t.Fatal(err)
	}
	xs := e.Transfers()
	if len(xs) != 1 || xs[0].Posted || xs[0].Op != nixl.Read || xs[0].Initiator != p.a.Name() || xs[0].Target != p.b.Name() {
		t.Fatalf("before Post: %+v", xs)
	}
	id := xs[0].ID
	if e.Settle(id, true) {
		t.Fatal("settled a transfer never posted")
	}
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	xs = e.Transfers()
	if len(xs) != 1 || !xs[0].Posted || !xs[0].MayMove || xs[0].Status != nixl.InProgress || len(xs[0].Local) != 1 || xs[0].Local[0].Len != 4096 || string(xs[0].Notif) != "n1" {
		t.Fatalf("after Post: %+v", xs)
	}
	if !e.Settle(id, true) {
		t.Fatal("Settle of a transfer in flight")
	}
	if len(moves) != 1 || moves[0].ID != id || moves[0].Remote[0] != xs[0].Remote[0] || p.mem[4095] != byte(4095%256) {
		t.Fatalf("moves %+v, data %d", moves, p.mem[4095])
	}
	if ns, _ := p.b.GetNotifs(); len(ns) != 0 || len(held) != 1 || string(held[0]) != "n1" {
		t.Fatalf("held notification delivered: %v, held %q", ns, held)
	}
	p.b.Inject(p.a.Name(), held[0])
	if ns, _ := p.b.GetNotifs(); len(ns) != 1 || string(ns[0].Msg) != "n1" {
		t.Fatalf("injected: %+v", ns)
	}
	if st, err := x.Check(); st != nixl.Success || err != nil {
		t.Fatalf("Check after Settle: %v %v", st, err)
	}
	if e.Settle(id, true) {
		t.Fatal("settled a completed transfer")
	}
	if err := x.Release(); err != nil {
		t.Fatal(err)
	}
	if xs := e.Transfers(); len(xs) != 0 {
		t.Fatalf("released transfer listed: %+v", xs)
	}
}

// Settle without move fails a transfer in flight: nothing is copied, no
// notification, Check reports the failure.
func TestSettleFails(t *testing.T) {
	e := nixltest.NewEngine("settle-fail")
	p := newPair(t, e, nixltest.Script{Polls: 1000})
	p.mem[4096] = 99
	x, err := p.a.MakeXfer(nixl.Read, p.local, []int32{0}, p.remot, []int32{0}, []byte("n"))
	if err != nil {
		t.Fatal(err)
	}
	defer x.Release()
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	if !e.Settle(e.Transfers()[0].ID, false) {
		t.Fatal("Settle(false) of a transfer in flight")
	}
	if st, err := x.Check(); st != nixl.ErrBackend || err == nil {
		t.Fatalf("Check: %v %v", st, err)
	}
	if ns, _ := p.b.GetNotifs(); len(ns) != 0 || p.mem[0] == 99 {
		t.Fatalf("a failed transfer moved data or notified: %v", ns)
	}
}

// RefuseReleaseInFlight: the release of a transfer in flight is refused
// (the handle stays listed, its bytes may still move) until it completes,
// or its peer is invalidated, which cancels it (nothing moves after).
func TestRefuseReleaseInFlight(t *testing.T) {
	e := nixltest.NewEngine("refuse")
	p := newPair(t, e, nixltest.Script{Polls: 1000, RefuseReleaseInFlight: true})
	mk := func() (nixl.Xfer, uint64) {
		x, err := p.a.MakeXfer(nixl.Write, p.local, []int32{0}, p.remot, []int32{0}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := x.Post(); err != nil {
			t.Fatal(err)
		}
		xs := e.Transfers()
		return x, xs[len(xs)-1].ID
	}
	x, id := mk()
	if err := x.Release(); !errors.Is(err, nixl.ErrRepostActive) {
		t.Fatalf("release in flight: %v", err)
	}
	if xs := e.Transfers(); len(xs) != 1 || xs[0].Refused != 1 || !xs[0].MayMove {
		t.Fatalf("after a refused release: %+v", xs)
	}
	p.mem[0] = 42
	if !e.Settle(id, true) || p.mem[4096] != 42 {
		t.Fatal("the refused transfer did not land")
	}
	if err := x.Release(); err != nil {
		t.Fatalf("release after completion: %v", err)
	}
	x, id = mk()
	if err := p.a.InvalidateRemote(p.b.Name()); err != nil {
		t.Fatal(err)
	}
	p.mem[0] = 43
	e.Settle(id, true)
	if p.mem[4096] == 43 {
		t.Fatal("a transfer to an invalidated peer moved")
	}
	if err := x.Release(); err != nil {
		t.Fatalf("release after invalidation: %v", err)
	}
}

// A transfer whose Check failed but whose release was refused may still
// move bytes (Settle); one whose Post failed never does.
func TestSettleAfterFailure(t *testing.T) {
	e := nixltest.NewEngine("settle-after")
	p := newPair(t, e, nixltest.Script{Polls: 1000})
	x, err := p.a.MakeXfer(nixl.Write, p.local, []int32{0}, p.remot, []int32{0}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	p.a.FailNext(nixltest.StepCheck, nixl.ErrBackend)
	if st, _ := x.Check(); st != nixl.ErrBackend {
		t.Fatalf("Check: %v", st)
	}
	p.a.FailNext(nixltest.StepReleaseXfer, nixl.ErrBackend)
	if err := x.Release(); err == nil {
		t.Fatal("FailNext(ReleaseXfer) did not refuse")
	}
	p.mem[1] = 7
	if !e.Settle(e.Transfers()[0].ID, true) || p.mem[4097] != 7 {
		t.Fatal("a failed transfer whose release was refused did not move")
	}
	if err := x.Release(); err != nil {
		t.Fatal(err)
	}
	p.a.FailNext(nixltest.StepPost, 0)
	y, err := p.a.MakeXfer(nixl.Write, p.local, []int32{0}, p.remot, []int32{0}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer y.Release()
	if _, err := y.Post(); err == nil {
		t.Fatal("FailNext(Post) did not fail")
	}
	if e.Settle(e.Transfers()[0].ID, true) {
		t.Fatal("a transfer whose Post failed moved")
	}
	if _, err := y.Post(); err != nil {
		t.Fatalf("FailNext fails once: %v", err)
	}
}

// With InFlightSurvivesInvalidate, invalidating the peer cancels nothing:
// the release stays refused and the bytes may still land.
func TestInFlightSurvivesInvalidate(t *testing.T) {
	e := nixltest.NewEngine("survives")
	p := newPair(t, e, nixltest.Script{Polls: 1000, RefuseReleaseInFlight: true, InFlightSurvivesInvalidate: true})
	x, err := p.a.MakeXfer(nixl.Write, p.local, []int32{0}, p.remot, []int32{0}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.Post(); err != nil {
		t.Fatal(err)
	}
	if err := p.a.InvalidateRemote(p.b.Name()); err != nil {
		t.Fatal(err)
	}
	if err := x.Release(); !errors.Is(err, nixl.ErrRepostActive) {
		t.Fatalf("release after invalidation: %v", err)
	}
	xs := e.Transfers()
	if len(xs) != 1 || !xs[0].MayMove {
		t.Fatalf("after invalidation: %+v", xs)
	}
	p.mem[0] = 44
	if !e.Settle(xs[0].ID, true) || p.mem[4096] != 44 {
		t.Fatal("the transfer did not land after its peer was invalidated")
	}
	if err := x.Release(); err != nil {
		t.Fatal(err)
	}
}
