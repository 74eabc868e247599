package conformance

import (
	"strings"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/nixltest"
)

func TestMain(m *testing.M) {
	MaybePeer()
	Exit(m.Run())
}

// The peer plumbing itself: start, hello, a request, clean exit, kill.
func TestPeerProcess(t *testing.T) {
	_ = nixltest.Fake // registers "fake"
	sh := Shape{Layers: 1, Blocks: 4, BlockSize: 64}
	p, err := startPeer(peerConfig{Engine: "fake", Agent: nixl.AgentConfig{Name: "peer-under-test"}, Shape: sh, Seed: 7}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if p.hello.Name != "peer-under-test" || len(p.hello.Regions) != 2 || len(p.hello.MD) == 0 {
		t.Fatalf("hello: %+v", p.hello)
	}
	// The fake is in-process only: the peer must refuse our metadata with
	// a clear error, which travels back over the pipe.
	_, err = p.call(request{Op: "load", MD: []byte("gonixl-fake-md\x00{\"Name\":\"x\",\"PID\":1}")}, 30*time.Second)
	if err == nil || !strings.Contains(err.Error(), "in-process only") {
		t.Fatalf("load: %v", err)
	}
	if _, err := p.call(request{Op: "verify"}, 30*time.Second); err != nil {
		t.Fatalf("verify of untouched memory: %v", err)
	}
	if _, err := p.call(request{Op: "verify", Writes: []blockWrite{{Dst: 1, From: blockSrc{Seed: 99, Idx: 1}}}}, 30*time.Second); err == nil {
		t.Fatal("verify accepted memory that does not match")
	}
	if _, err := p.call(request{Op: "wait_notif", Msg: []byte("never"), Timeout: 10 * time.Millisecond}, 30*time.Second); err == nil {
		t.Fatal("wait_notif for a notification never sent succeeded")
	}
	if err := p.stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}

	p2, err := startPeer(peerConfig{Engine: "fake", Agent: nixl.AgentConfig{Name: "peer-2"}, Shape: sh, Seed: 8}, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	p2.kill()
	if _, err := p2.call(request{Op: "verify"}, time.Second); err == nil {
		t.Fatal("call to a killed peer succeeded")
	}
}

func TestPeerUnknownEngine(t *testing.T) {
	_, err := startPeer(peerConfig{Engine: "no-such-engine", Shape: Shape{Layers: 1, Blocks: 1, BlockSize: 8}}, 30*time.Second)
	if err == nil || !strings.Contains(err.Error(), "no-such-engine") {
		t.Fatalf("startPeer: %v", err)
	}
}

func TestShapeFromEnv(t *testing.T) {
	for v, want := range map[string]Shape{"": DefaultShape(), "big": BigShape(), "2x3x64": {2, 3, 64}} {
		t.Setenv("GONIXL_CONFORMANCE_SHAPE", v)
		got, err := ShapeFromEnv()
		if err != nil || got != want {
			t.Errorf("%q: %+v %v", v, got, err)
		}
	}
	for _, v := range []string{"1x2", "ax1x8", "1x1x7", "0x1x8"} {
		t.Setenv("GONIXL_CONFORMANCE_SHAPE", v)
		if _, err := ShapeFromEnv(); err == nil {
			t.Errorf("%q accepted", v)
		}
	}
}

func TestPatternDetectsCorruption(t *testing.T) {
	m, err := newKVMem(Shape{Layers: 1, Blocks: 4, BlockSize: 64}, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer m.free()
	if err := m.verify(); err != nil {
		t.Fatal(err)
	}
	m.block(3)[63] ^= 1
	if err := m.verify(); err == nil {
		t.Fatal("a flipped bit went unnoticed")
	}
}
