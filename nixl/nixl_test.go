package nixl

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

type stubEngine struct {
	name  string
	avail error
	dram  bool
}

func (s stubEngine) Name() string                        { return s.name }
func (s stubEngine) Available() error                    { return s.avail }
func (s stubEngine) Supports(m MemType) bool             { return m == DRAM && s.dram }
func (s stubEngine) NewAgent(AgentConfig) (Agent, error) { return nil, errors.New("stub") }
func (s stubEngine) Info() string                        { return "stub " + s.name }

func withEngines(t *testing.T, es ...Engine) {
	t.Helper()
	regMu.Lock()
	saved := engines
	engines = map[string]Engine{}
	regMu.Unlock()
	for _, e := range es {
		Register(e)
	}
	t.Cleanup(func() {
		regMu.Lock()
		engines = saved
		regMu.Unlock()
	})
}

func TestSelectAuto(t *testing.T) {
	unavailable := fmt.Errorf("NIXL not available: libnixl_capi.so: cannot open: %w", ErrUnavailable)
	cases := []struct {
		name    string
		engines []Engine
		want    string
		reason  string
	}{
		{"nixl preferred", []Engine{stubEngine{"nixl", nil, true}, stubEngine{"ucx", nil, true}}, "nixl", "auto"},
		{"ucx when nixl does not load", []Engine{stubEngine{"nixl", unavailable, true}, stubEngine{"ucx", nil, true}}, "ucx", "cannot open"},
		{"ucx when nixl cannot move DRAM", []Engine{stubEngine{"nixl", nil, false}, stubEngine{"ucx", nil, true}}, "ucx", "no DRAM support"},
		{"ucx when nixl not built in", []Engine{stubEngine{"ucx", nil, true}}, "ucx", "not built in"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			withEngines(t, c.engines...)
			e, why, err := Select("auto", DRAM)
			if err != nil || e.Name() != c.want || !strings.Contains(why, c.reason) {
				t.Fatalf("Select = %v, %q, %v; want %s with %q", e, why, err, c.want, c.reason)
			}
		})
	}
	withEngines(t, stubEngine{"nixl", unavailable, true}, stubEngine{"ucx", unavailable, true})
	if _, _, err := Select("", DRAM); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("nothing available: %v", err)
	}
}

func TestSelectExplicit(t *testing.T) {
	withEngines(t, stubEngine{"nixl", fmt.Errorf("gone: %w", ErrUnavailable), true}, stubEngine{"ucx", nil, false})
	if _, _, err := Select("nixl", DRAM); !errors.Is(err, ErrUnavailable) {
		t.Errorf("unavailable engine selected: %v", err)
	}
	if _, _, err := Select("ucx", DRAM); err == nil || !strings.Contains(err.Error(), "cannot move DRAM") {
		t.Errorf("engine without DRAM selected: %v", err)
	}
	if _, _, err := Select("rdma", DRAM); err == nil || !strings.Contains(err.Error(), "registered") {
		t.Errorf("unknown engine: %v", err)
	}
}

func TestRegisterTwicePanics(t *testing.T) {
	withEngines(t, stubEngine{name: "x"})
	defer func() {
		if recover() == nil {
			t.Fatal("duplicate registration did not panic")
		}
	}()
	Register(stubEngine{name: "x"})
}

func TestStatusErrors(t *testing.T) {
	err := fmt.Errorf("post: %w", Errorf(ErrRemoteDiscon, "Post", "peer %s gone", "p"))
	if !errors.Is(err, ErrRemoteDiscon) || errors.Is(err, ErrBackend) {
		t.Fatalf("errors.Is by status broken: %v", err)
	}
	if StatusOf(err) != ErrRemoteDiscon || StatusOf(nil) != Success || StatusOf(errors.New("x")) != ErrUnknown {
		t.Fatal("StatusOf")
	}
	if got := err.Error(); !strings.Contains(got, "ERR_REMOTE_DISCONNECT") || !strings.Contains(got, "peer p gone") {
		t.Fatalf("message %q", got)
	}
	// Every code keeps its own name: none collapses into another.
	seen := map[string]Status{}
	for s := ErrNoTelemetry; s <= InProgress; s++ {
		n := s.String()
		if prev, dup := seen[n]; dup {
			t.Fatalf("%d and %d share the name %s", prev, s, n)
		}
		seen[n] = s
	}
	if !ErrCanceled.IsError() || InProgress.IsError() || Success.IsError() {
		t.Fatal("IsError")
	}
}

func TestParseMemType(t *testing.T) {
	for in, want := range map[string]MemType{"DRAM": DRAM, "cpu": DRAM, "VRAM": VRAM, "cuda": VRAM, "BLOCK": BLK, "FILE": FILE, "OBJ": OBJ} {
		if got, err := ParseMemType(in); err != nil || got != want {
			t.Errorf("ParseMemType(%q) = %v, %v", in, got, err)
		}
	}
	if _, err := ParseMemType("HBM"); err == nil {
		t.Error("accepted HBM")
	}
}
