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
