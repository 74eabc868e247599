package conformance

import (
	"bytes"
	"fmt"
	"math/rand"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl"
)

// Config parameterises a run. The zero value of every field but Engine
// picks a default.
type Config struct {
	// Engine is the registered engine name ("nixl", "ucx", "fake").
	Engine string
	// Agent is the template for every agent the harness creates; Name is
	// replaced by a unique name per agent. Telemetry defaults to on.
	Agent nixl.AgentConfig
	// Shape of each side's KV cache; default ShapeFromEnv().
	Shape Shape
	// Deadline bounds every wait for a transfer, notification or peer
	// response; default 60 s (GONIXL_CONFORMANCE_DEADLINE, in seconds,
	// overrides). It is a hang guard, not a performance assertion.
	Deadline time.Duration
	// DeathDeadline bounds how long a transfer to a killed peer may stay
	// in progress before the harness calls it a hang; default 2 × Deadline.
	DeathDeadline time.Duration
	// NoTelemetryCheck skips the telemetry assertions, for an engine that
	// does not fill them in.
	NoTelemetryCheck bool
	// Seed for the block patterns and index choices; default time-based
	// (logged, so a failure can be replayed).
	Seed int64
}

func (c *Config) fill(t testing.TB) {
	t.Helper()
	if c.Engine == "" {
		t.Fatal("conformance: Config.Engine is empty")
	}
	if c.Shape == (Shape{}) {
		s, err := ShapeFromEnv()
		if err != nil {
			t.Fatal(err)
		}
		c.Shape = s
	}
	if err := c.Shape.validate(); err != nil {
		t.Fatal(err)
	}
	if c.Deadline == 0 {
		c.Deadline = 60 * time.Second
		if v := os.Getenv("GONIXL_CONFORMANCE_DEADLINE"); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n <= 0 {
				t.Fatalf("conformance: GONIXL_CONFORMANCE_DEADLINE=%q: want seconds", v)
			}
			c.Deadline = time.Duration(n) * time.Second
		}
	}
	if c.DeathDeadline == 0 {
		c.DeathDeadline = 2 * c.Deadline
	}
	if c.Seed == 0 {
		c.Seed = time.Now().UnixNano()
	}
	if !c.Agent.Telemetry && !c.NoTelemetryCheck {
		c.Agent.Telemetry = true
	}
	if len(c.Agent.Backends) == 0 {
		c.Agent.Backends = []string{"UCX"}
	}
}

// engine looks the engine up and skips the test when it cannot run here.
func engine(t *testing.T, name string) nixl.Engine {
	t.Helper()
	e, err := nixl.Lookup(name)
	if err != nil {
		t.Fatalf("conformance: %v (is the engine package imported by the test?)", err)
	}
	if err := e.Available(); err != nil {
		t.Skipf("engine %q not available here: %v", name, err)
	}
	if !e.Supports(nixl.DRAM) {
		t.Skipf("engine %q cannot move DRAM", name)
	}
	return e
}

// Run runs every case, including those that need a peer process, for the
// named engine with default settings.
func Run(t *testing.T, engine string) { RunConfig(t, Config{Engine: engine}) }

// RunConfig runs every case with cfg.
func RunConfig(t *testing.T, cfg Config) {
	cfg.fill(t)
	engine(t, cfg.Engine)
	t.Logf("conformance: engine %s, shape %v, seed %d", cfg.Engine, cfg.Shape, cfg.Seed)
	t.Run("in-process", func(t *testing.T) { runInProcess(t, cfg) })
	t.Run("two-process", func(t *testing.T) { runTwoProcess(t, cfg) })
}

// RunInProcess runs the cases that need no second process.
func RunInProcess(t *testing.T, cfg Config) {
	cfg.fill(t)
	engine(t, cfg.Engine)
	t.Logf("conformance: engine %s, shape %v, seed %d", cfg.Engine, cfg.Shape, cfg.Seed)
	runInProcess(t, cfg)
}

// side is one agent with its KV cache, registered, and its local list.
type side struct {
	agent nixl.Agent
	mem   *kvMem
	local nixl.DescList
	// got keeps every notification drained from agent and not yet
	// matched: progress calls drain too, and must not lose any.
	got []nixl.Notif
}

// poll drains the agent's notifications into got.
func (s *side) poll() error {
	ns, err := s.agent.GetNotifs()
	s.got = append(s.got, ns...)
	return err
}

// waitNotif waits until (from, msg) is among the received notifications
// and removes it.
func (s *side) waitNotif(from string, msg []byte, d time.Duration, progress func()) error {
	deadline := time.Now().Add(d)
	for {
		if err := s.poll(); err != nil {
			return fmt.Errorf("GetNotifs: %w", err)
		}
		if i := findNotif(s.got, from, msg); i >= 0 {
			s.got = append(s.got[:i], s.got[i+1:]...)
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("notification %q from %q not received within %v (received: %s)", msg, from, d, notifString(s.got))
		}
		if progress != nil {
			progress()
		}
		time.Sleep(200 * time.Microsecond)
	}
}

var agentSeq int

func newAgentConfig(cfg Config, role string) nixl.AgentConfig {
	agentSeq++
	ac := cfg.Agent
	ac.Name = fmt.Sprintf("conformance-%s-%d-%d", role, os.Getpid(), agentSeq)
	return ac
}

func newSide(t *testing.T, cfg Config, role string, seed uint64) *side {
	t.Helper()
	e := engine(t, cfg.Engine)
	a, err := e.NewAgent(newAgentConfig(cfg, role))
	if err != nil {
		t.Fatalf("NewAgent: %v", err)
	}
	s := &side{agent: a}
	t.Cleanup(func() { s.close(t) })
	s.mem, err = newKVMem(cfg.Shape, seed)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.RegisterMem(nixl.DRAM, s.mem.regions()); err != nil {
		t.Fatalf("RegisterMem: %v", err)
	}
	s.local, err = a.PrepDescList("", nixl.DRAM, blockDescs(cfg.Shape, s.mem.regions()))
	if err != nil {
		t.Fatalf("PrepDescList(local): %v", err)
	}
	if s.local.Len() != cfg.Shape.Descs() || s.local.Agent() != "" {
		t.Fatalf("local list: Len %d Agent %q, want %d and \"\"", s.local.Len(), s.local.Agent(), cfg.Shape.Descs())
	}
	return s
}

func (s *side) close(t *testing.T) {
	if s.agent == nil {
		return
	}
	if s.local != nil {
		_ = s.local.Release()
	}
	if s.mem != nil {
		if err := s.agent.DeregisterMem(nixl.DRAM, s.mem.regions()); err != nil {
			t.Errorf("DeregisterMem: %v", err)
		}
	}
	if err := s.agent.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if err := s.agent.Close(); err != nil {
		t.Errorf("second Close (must be idempotent): %v", err)
	}
	if s.mem != nil {
		s.mem.free()
	}
	s.agent = nil
}

// pairs picks n distinct scattered indices on each side.
func pairs(rng *rand.Rand, descs, n int) (local, remote []int32) {
	lp, rp := rng.Perm(descs), rng.Perm(descs)
	local, remote = make([]int32, n), make([]int32, n)
	for i := 0; i < n; i++ {
		local[i], remote[i] = int32(lp[i]), int32(rp[i])
	}
	return local, remote
}

// waitXfer polls x until it leaves InProgress, within d.
func waitXfer(x nixl.Xfer, st nixl.Status, d time.Duration, progress func()) (nixl.Status, error) {
	deadline := time.Now().Add(d)
	for st == nixl.InProgress {
		if time.Now().After(deadline) {
			return st, fmt.Errorf("transfer still in progress after %v", d)
		}
		if progress != nil {
			progress()
		}
		var err error
		st, err = x.Check()
		if err != nil {
			return st, err
		}
	}
	return st, nil
}

// postAndWait posts x and waits for Success.
func postAndWait(t *testing.T, x nixl.Xfer, d time.Duration, progress func()) {
	t.Helper()
	st, err := x.Post()
	if err != nil {
		t.Fatalf("Post: %v", err)
	}
	if st != nixl.InProgress && st != nixl.Success {
		t.Fatalf("Post returned status %v with nil error", st)
	}
	st, err = waitXfer(x, st, d, progress)
	if err != nil {
		t.Fatalf("transfer: %v (status %v)", err, nixl.StatusOf(err))
	}
	if st != nixl.Success {
		t.Fatalf("transfer ended with %v", st)
	}
}

func checkTelemetry(t *testing.T, cfg Config, x nixl.Xfer, n int) {
	t.Helper()
	if cfg.NoTelemetryCheck {
		return
	}
	tel, st := x.Telemetry()
	if st != nixl.Success {
		t.Fatalf("Telemetry after Success: status %v", st)
	}
	if want := uint64(n * cfg.Shape.BlockSize); tel.Bytes != want {
		t.Errorf("Telemetry.Bytes = %d, want %d", tel.Bytes, want)
	}
	if tel.DescCount < 1 || tel.DescCount > n {
		t.Errorf("Telemetry.DescCount = %d, want 1..%d", tel.DescCount, n)
	}
	if tel.XferDur < tel.PostDur || tel.PostDur < 0 {
		t.Errorf("Telemetry durations: post %v, xfer %v (xfer includes post)", tel.PostDur, tel.XferDur)
	}
}

// ---------------------------------------------------------------------------
// In-process cases: two agents in this process.

func runInProcess(t *testing.T, cfg Config) {
	rng := rand.New(rand.NewSource(cfg.Seed))
	a := newSide(t, cfg, "a", uint64(rng.Int63()))
	b := newSide(t, cfg, "b", uint64(rng.Int63()))
	mdB, err := b.agent.LocalMetadata()
	if err != nil {
		t.Fatalf("LocalMetadata: %v", err)
	}
	if len(mdB) == 0 {
		t.Fatal("LocalMetadata returned no bytes")
	}
	name, err := a.agent.LoadRemoteMetadata(mdB)
	if err != nil {
		t.Fatalf("LoadRemoteMetadata: %v", err)
	}
	if name != b.agent.Name() {
		t.Fatalf("LoadRemoteMetadata returned %q, want %q", name, b.agent.Name())
	}
	remote, err := a.agent.PrepDescList(name, nixl.DRAM, blockDescs(cfg.Shape, b.mem.regions()))
	if err != nil {
		t.Fatalf("PrepDescList(remote): %v", err)
	}
	defer remote.Release()
	if remote.Agent() != name || remote.Len() != cfg.Shape.Descs() {
		t.Fatalf("remote list: Agent %q Len %d", remote.Agent(), remote.Len())
	}
	// b progresses while a waits: a target without a progress thread
	// may need it.
	progB := func() { _ = b.poll() }

	for _, op := range []nixl.XferOp{nixl.Read, nixl.Write} {
		t.Run(op.String(), func(t *testing.T) {
			n := max(1, cfg.Shape.Descs()/4)
			li, ri := pairs(rng, cfg.Shape.Descs(), n)
			msg := []byte(fmt.Sprintf("%v-%d", op, rng.Int63()))
			x, err := a.agent.MakeXfer(op, a.local, li, remote, ri, msg)
			if err != nil {
				t.Fatalf("MakeXfer: %v", err)
			}
			defer x.Release()
			postAndWait(t, x, cfg.Deadline, progB)
			for i := range li {
				if op == nixl.Read {
					a.mem.expectCopy(li[i], b.mem.expect[ri[i]])
				} else {
					b.mem.expectCopy(ri[i], a.mem.expect[li[i]])
				}
			}
			if err := a.mem.verify(); err != nil {
				t.Errorf("initiator memory after %v: %v", op, err)
			}
			if err := b.mem.verify(); err != nil {
				t.Errorf("target memory after %v: %v", op, err)
			}
			checkTelemetry(t, cfg, x, n)
			if err := b.waitNotif(a.agent.Name(), msg, cfg.Deadline, nil); err != nil {
				t.Errorf("target: %v", err)
			}
		})
	}

	t.Run("notif", func(t *testing.T) {
		msg := []byte(fmt.Sprintf("standalone-%d", rng.Int63()))
		if err := a.agent.SendNotif(name, msg); err != nil {
			t.Fatalf("SendNotif: %v", err)
		}
		if err := b.waitNotif(a.agent.Name(), msg, cfg.Deadline, func() { _ = a.poll() }); err != nil {
			t.Error(err)
		}
		if err := a.agent.SendNotif("no-such-agent", msg); err == nil {
			t.Error("SendNotif to an unknown agent succeeded")
		}
	})

	t.Run("garbage-metadata", func(t *testing.T) {
		junk := make([]byte, 4096)
		rng.Read(junk)
		// Truncations are of a third agent's metadata: NIXL drops a
		// known agent whose corrupt metadata it is asked to load, and
		// this case must not depend on that.
		c, err := engine(t, cfg.Engine).NewAgent(newAgentConfig(cfg, "c"))
		if err != nil {
			t.Fatalf("NewAgent: %v", err)
		}
		mdC, err := c.LocalMetadata()
		if err != nil {
			t.Fatalf("LocalMetadata: %v", err)
		}
		if err := c.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
		cases := map[string][]byte{
			"empty":           {},
			"random":          junk,
			"serdes-prefix":   append([]byte("nixlSerDes|"), junk[:64]...),
			"truncated-half":  mdC[:len(mdC)/2],
			"truncated-start": mdC[:min(len(mdC), 16)],
			"truncated-end":   mdC[:len(mdC)-1],
		}
		for cname, md := range cases {
			if got, err := a.agent.LoadRemoteMetadata(md); err == nil {
				t.Errorf("%s: LoadRemoteMetadata succeeded (agent %q)", cname, got)
			} else if !nixl.StatusOf(err).IsError() {
				t.Errorf("%s: error %v carries no error status", cname, err)
			}
		}
		// The agent still works after rejecting garbage.
		if _, err := a.agent.LocalMetadata(); err != nil {
			t.Errorf("LocalMetadata after garbage: %v", err)
		}
		if _, err := a.agent.PrepDescList("no-such-agent", nixl.DRAM, blockDescs(cfg.Shape, b.mem.regions())[:1]); err == nil {
			t.Error("PrepDescList for an unknown agent succeeded")
		}
	})

	t.Run("bad-indices", func(t *testing.T) {
		d := int32(cfg.Shape.Descs())
		msg := []byte("must-not-arrive")
		bad := []struct {
			name   string
			li, ri []int32
		}{
			{"local-too-big", []int32{0, d}, []int32{0, 1}},
			{"remote-too-big", []int32{0, 1}, []int32{1, d}},
			{"negative", []int32{-1}, []int32{0}},
			{"length-mismatch", []int32{0, 1}, []int32{0}},
			{"empty", nil, nil},
		}
		for _, c := range bad {
			x, err := a.agent.MakeXfer(nixl.Read, a.local, c.li, remote, c.ri, msg)
			if err == nil {
				_ = x.Release()
				t.Errorf("%s: MakeXfer succeeded", c.name)
				continue
			}
			if st := nixl.StatusOf(err); st != nixl.ErrInvalidParam {
				t.Errorf("%s: status %v, want %v (%v)", c.name, st, nixl.ErrInvalidParam, err)
			}
		}
		// A pair of descriptors with different lengths.
		half := []nixl.Desc{{Addr: a.mem.regions()[0].Addr, Len: uint64(cfg.Shape.BlockSize / 2)}}
		hl, err := a.agent.PrepDescList("", nixl.DRAM, half)
		if err != nil {
			t.Fatalf("PrepDescList(half block): %v", err)
		}
		defer hl.Release()
		if x, err := a.agent.MakeXfer(nixl.Read, hl, []int32{0}, remote, []int32{0}, msg); err == nil {
			_ = x.Release()
			t.Error("MakeXfer with unequal descriptor lengths succeeded")
		}
		// A local list where a remote one belongs, and the reverse.
		if x, err := a.agent.MakeXfer(nixl.Read, remote, []int32{0}, a.local, []int32{0}, msg); err == nil {
			_ = x.Release()
			t.Error("MakeXfer with the lists swapped succeeded")
		}
		// A descriptor outside every registered region.
		outside := []nixl.Desc{{Addr: 4096, Len: 4096}}
		if l, err := a.agent.PrepDescList("", nixl.DRAM, outside); err == nil {
			_ = l.Release()
			t.Error("PrepDescList of unregistered memory succeeded")
		}
		// Nothing was moved and nothing was announced.
		if err := b.mem.verify(); err != nil {
			t.Errorf("target memory changed: %v", err)
		}
		if err := a.mem.verify(); err != nil {
			t.Errorf("initiator memory changed: %v", err)
		}
		for i := 0; i < 20; i++ {
			if err := b.poll(); err != nil {
				t.Fatalf("GetNotifs: %v", err)
			}
			if findNotif(b.got, "", msg) >= 0 {
				t.Fatal("a notification of a rejected transfer arrived")
			}
			_ = a.poll()
			time.Sleep(time.Millisecond)
		}
	})

	t.Run("double-release", func(t *testing.T) {
		x, err := a.agent.MakeXfer(nixl.Read, a.local, []int32{0}, remote, []int32{0}, nil)
		if err != nil {
			t.Fatalf("MakeXfer: %v", err)
		}
		if err := x.Release(); err != nil {
			t.Fatalf("Release: %v", err)
		}
		if err := x.Release(); err == nil {
			t.Error("second Xfer.Release succeeded")
		}
		if _, err := x.Post(); err == nil {
			t.Error("Post after Release succeeded")
		}
		if _, err := x.Check(); err == nil {
			t.Error("Check after Release succeeded")
		}
		l, err := a.agent.PrepDescList("", nixl.DRAM, blockDescs(cfg.Shape, a.mem.regions())[:2])
		if err != nil {
			t.Fatalf("PrepDescList: %v", err)
		}
		if err := l.Release(); err != nil {
			t.Fatalf("DescList.Release: %v", err)
		}
		if err := l.Release(); err == nil {
			t.Error("second DescList.Release succeeded")
		}
		if x, err := a.agent.MakeXfer(nixl.Read, l, []int32{0}, remote, []int32{0}, nil); err == nil {
			_ = x.Release()
			t.Error("MakeXfer with a released list succeeded")
		}
	})

	t.Run("invalidate", func(t *testing.T) {
		// Run last: it drops b from a.
		if err := a.agent.InvalidateRemote(name); err != nil {
			t.Fatalf("InvalidateRemote: %v", err)
		}
		if err := a.agent.InvalidateRemote(name); err == nil {
			t.Error("second InvalidateRemote succeeded")
		}
		if l, err := a.agent.PrepDescList(name, nixl.DRAM, blockDescs(cfg.Shape, b.mem.regions())[:1]); err == nil {
			_ = l.Release()
			t.Error("PrepDescList for an invalidated agent succeeded")
		}
	})
}

// ---------------------------------------------------------------------------
// Two-process cases.

type twoProc struct {
	cfg    Config
	me     *side
	p      *peer
	peer   string
	remote nixl.DescList
	// peerExpect mirrors the peer's kvMem.expect.
	peerExpect []blockSrc
}

func setupTwoProc(t *testing.T, cfg Config, rng *rand.Rand, role string) *twoProc {
	t.Helper()
	me := newSide(t, cfg, role, uint64(rng.Int63()))
	peerSeed := uint64(rng.Int63())
	pc := peerConfig{Engine: cfg.Engine, Agent: newAgentConfig(cfg, role+"-peer"), Shape: cfg.Shape, Seed: peerSeed}
	p, err := startPeer(pc, cfg.Deadline)
	if err != nil {
		t.Fatal(err)
	}
	tp := &twoProc{cfg: cfg, me: me, p: p, peer: p.hello.Name}
	p.progress = func() { _ = me.poll() }
	t.Cleanup(func() {
		if tp.remote != nil {
			_ = tp.remote.Release()
		}
		if tp.p != nil {
			if err := tp.p.stop(cfg.Deadline); err != nil {
				t.Errorf("peer: %v", err)
			}
		}
	})
	tp.peerExpect = make([]blockSrc, cfg.Shape.Descs())
	for i := range tp.peerExpect {
		tp.peerExpect[i] = blockSrc{Seed: peerSeed, Idx: int32(i)}
	}
	name, err := me.agent.LoadRemoteMetadata(p.hello.MD)
	if err != nil {
		t.Fatalf("LoadRemoteMetadata(peer): %v", err)
	}
	if name != tp.peer {
		t.Fatalf("LoadRemoteMetadata returned %q, peer says %q", name, tp.peer)
	}
	md, err := me.agent.LocalMetadata()
	if err != nil {
		t.Fatalf("LocalMetadata: %v", err)
	}
	resp, err := p.call(request{Op: "load", MD: md}, cfg.Deadline)
	if err != nil {
		t.Fatal(err)
	}
	if resp.Name != me.agent.Name() {
		t.Fatalf("peer loaded agent %q, want %q", resp.Name, me.agent.Name())
	}
	if len(p.hello.Regions) != cfg.Shape.Regions() {
		t.Fatalf("peer advertised %d regions, want %d", len(p.hello.Regions), cfg.Shape.Regions())
	}
	tp.remote, err = me.agent.PrepDescList(tp.peer, nixl.DRAM, blockDescs(cfg.Shape, p.hello.Regions))
	if err != nil {
		t.Fatalf("PrepDescList(peer): %v", err)
	}
	return tp
}

func runTwoProcess(t *testing.T, cfg Config) {
	rng := rand.New(rand.NewSource(cfg.Seed + 1))
	tp := setupTwoProc(t, cfg, rng, "parent")
	me := tp.me

	t.Run("read", func(t *testing.T) {
		n := max(1, cfg.Shape.Descs()/4)
		li, ri := pairs(rng, cfg.Shape.Descs(), n)
		msg := []byte(fmt.Sprintf("read-%d", rng.Int63()))
		x, err := me.agent.MakeXfer(nixl.Read, me.local, li, tp.remote, ri, msg)
		if err != nil {
			t.Fatalf("MakeXfer: %v", err)
		}
		defer func() {
			if err := x.Release(); err != nil {
				t.Errorf("Release: %v", err)
			}
		}()
		for round := 0; round < 2; round++ {
			if round == 1 {
				// Spoil the destinations, then post the same request again.
				for _, l := range li {
					me.mem.fill(l, 0xdead, l)
				}
			}
			postAndWait(t, x, cfg.Deadline, nil)
			for i := range li {
				me.mem.expectCopy(li[i], tp.peerExpect[ri[i]])
			}
			if err := me.mem.verify(); err != nil {
				t.Fatalf("round %d: local memory after READ: %v", round, err)
			}
			checkTelemetry(t, cfg, x, n)
			if _, err := tp.p.call(request{Op: "wait_notif", Agent: me.agent.Name(), Msg: msg, Timeout: cfg.Deadline}, cfg.Deadline); err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
		}
	})

	t.Run("write", func(t *testing.T) {
		n := max(1, cfg.Shape.Descs()/4)
		li, ri := pairs(rng, cfg.Shape.Descs(), n)
		msg := []byte(fmt.Sprintf("write-%d", rng.Int63()))
		x, err := me.agent.MakeXfer(nixl.Write, me.local, li, tp.remote, ri, msg)
		if err != nil {
			t.Fatalf("MakeXfer: %v", err)
		}
		defer func() {
			if err := x.Release(); err != nil {
				t.Errorf("Release: %v", err)
			}
		}()
		postAndWait(t, x, cfg.Deadline, nil)
		checkTelemetry(t, cfg, x, n)
		writes := make([]blockWrite, n)
		for i := range li {
			writes[i] = blockWrite{Dst: ri[i], From: me.mem.expect[li[i]]}
			tp.peerExpect[ri[i]] = me.mem.expect[li[i]]
		}
		if _, err := tp.p.call(request{Op: "wait_notif", Agent: me.agent.Name(), Msg: msg, Timeout: cfg.Deadline}, cfg.Deadline); err != nil {
			t.Fatal(err)
		}
		if _, err := tp.p.call(request{Op: "verify", Writes: writes}, cfg.Deadline); err != nil {
			t.Fatalf("peer memory after WRITE: %v", err)
		}
		if err := me.mem.verify(); err != nil {
			t.Errorf("local memory changed by WRITE: %v", err)
		}
	})

	t.Run("notif", func(t *testing.T) {
		msg := []byte(fmt.Sprintf("to-peer-%d", rng.Int63()))
		if err := me.agent.SendNotif(tp.peer, msg); err != nil {
			t.Fatalf("SendNotif: %v", err)
		}
		if _, err := tp.p.call(request{Op: "wait_notif", Agent: me.agent.Name(), Msg: msg, Timeout: cfg.Deadline}, cfg.Deadline); err != nil {
			t.Fatal(err)
		}
		back := []byte(fmt.Sprintf("to-parent-%d", rng.Int63()))
		if _, err := tp.p.call(request{Op: "send_notif", Agent: me.agent.Name(), Msg: back}, cfg.Deadline); err != nil {
			t.Fatal(err)
		}
		if err := me.waitNotif(tp.peer, back, cfg.Deadline, nil); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("garbage-metadata", func(t *testing.T) {
		// Runs after the cases that move data: a corrupt copy of a known
		// agent's metadata may make the engine drop that agent.
		md := tp.p.hello.MD
		flipped := bytes.Clone(md)
		for i := len("nixlSerDes|"); i < len(flipped); i += 7 {
			flipped[i] ^= 0x5a
		}
		for cname, b := range map[string][]byte{"truncated": md[:len(md)-1], "flipped": flipped} {
			if got, err := me.agent.LoadRemoteMetadata(b); err == nil {
				// Loading can only succeed by coincidence for a flip that
				// kept the structure; it must not be the peer's name then.
				t.Errorf("%s peer metadata loaded as agent %q", cname, got)
			}
		}
	})

	t.Run("peer-death", func(t *testing.T) { peerDeath(t, cfg, rng) })
}

// peerDeath kills a peer while READs from it are in flight and requires
// an error status within cfg.DeathDeadline, then that releasing the
// request and forgetting the peer do not hang.
func peerDeath(t *testing.T, cfg Config, rng *rand.Rand) {
	tp := setupTwoProc(t, cfg, rng, "death")
	me := tp.me
	d := cfg.Shape.Descs()
	idx := make([]int32, d)
	for i := range idx {
		idx[i] = int32(i)
	}
	x, err := me.agent.MakeXfer(nixl.Read, me.local, idx, tp.remote, idx, []byte("death"))
	if err != nil {
		t.Fatalf("MakeXfer: %v", err)
	}
	st, err := x.Post()
	if err != nil {
		t.Fatalf("first Post (peer alive): %v", err)
	}
	tp.p.kill()
	tp.p = nil
	start := time.Now()
	deadline := start.Add(cfg.DeathDeadline)
	var failure error
	posts := 1
	for failure == nil {
		if time.Now().After(deadline) {
			break
		}
		switch st {
		case nixl.InProgress:
			st, failure = x.Check()
		case nixl.Success:
			st, failure = x.Post()
			posts++
		default:
			failure = fmt.Errorf("status %v without an error", st)
		}
		if failure == nil && st == nixl.InProgress {
			time.Sleep(100 * time.Microsecond)
		}
	}
	if failure == nil {
		t.Fatalf("transfers from a killed peer still succeed or stay in progress after %v (%d posts, last status %v)", cfg.DeathDeadline, posts, st)
	}
	t.Logf("peer death surfaced after %v and %d posts as %v: %v", time.Since(start).Round(time.Millisecond), posts, nixl.StatusOf(failure), failure)
	if !nixl.StatusOf(failure).IsError() {
		t.Errorf("failure %v carries no error status", failure)
	}
	guard(t, cfg.Deadline, "Xfer.Release after peer death", func() error {
		err := x.Release()
		if err != nil {
			t.Logf("Release after failure: %v", err)
		}
		return nil
	})
	guard(t, cfg.Deadline, "InvalidateRemote of a dead peer", func() error {
		err := me.agent.InvalidateRemote(tp.peer)
		t.Logf("InvalidateRemote(dead peer): %v", err)
		return nil
	})
	// The agent keeps working locally.
	if _, err := me.agent.LocalMetadata(); err != nil {
		t.Errorf("LocalMetadata after peer death: %v", err)
	}
}

// guard runs f and fails the test if it does not return within d.
func guard(t *testing.T, d time.Duration, what string, f func() error) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- f() }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("%s: %v", what, err)
		}
	case <-time.After(d):
		t.Errorf("%s did not return within %v", what, d)
	}
}
