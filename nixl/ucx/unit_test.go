package ucx

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"math/rand"
	"reflect"
	"testing"

	"github.com/gonixl/gonixl/nixl"
)

func TestCoalesce(t *testing.T) {
	for _, c := range []struct {
		name string
		in   []op
		want []op
	}{
		{"empty", nil, nil},
		{"one", []op{{laddr: 0, raddr: 100, len: 10}}, []op{{laddr: 0, raddr: 100, len: 10}}},
		{"adjacent both sides", []op{{0, 100, 10, 0, 0}, {10, 110, 10, 0, 0}, {20, 120, 5, 0, 0}}, []op{{0, 100, 25, 0, 0}}},
		{"local gap", []op{{0, 100, 10, 0, 0}, {11, 110, 10, 0, 0}}, []op{{0, 100, 10, 0, 0}, {11, 110, 10, 0, 0}}},
		{"remote gap", []op{{0, 100, 10, 0, 0}, {10, 111, 10, 0, 0}}, []op{{0, 100, 10, 0, 0}, {10, 111, 10, 0, 0}}},
		{"reversed order", []op{{10, 110, 10, 0, 0}, {0, 100, 10, 0, 0}}, []op{{10, 110, 10, 0, 0}, {0, 100, 10, 0, 0}}},
		{"other rkey", []op{{0, 100, 10, 0, 0}, {10, 110, 10, 1, 0}}, []op{{0, 100, 10, 0, 0}, {10, 110, 10, 1, 0}}},
		{"other memh", []op{{0, 100, 10, 0, 0}, {10, 110, 10, 0, 1}}, []op{{0, 100, 10, 0, 0}, {10, 110, 10, 0, 1}}},
		{"run then break then run", []op{{0, 0, 4, 0, 0}, {4, 4, 4, 0, 0}, {100, 8, 4, 0, 0}, {104, 12, 4, 0, 0}},
			[]op{{0, 0, 8, 0, 0}, {100, 8, 8, 0, 0}}},
	} {
		got := coalesce(append([]op(nil), c.in...))
		if len(got) == 0 && len(c.want) == 0 {
			continue
		}
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: got %v, want %v", c.name, got, c.want)
		}
	}
}

// kvRequest builds the descriptor pairs of one vLLM-shaped READ: regions
// (layers × K,V) of nBlocks blocks each, desc id = region*nBlocks + block,
// as NixlConnector numbers them, for the given local and remote block ids.
func kvRequest(regions, nBlocks, blockLen int, local, remote []int) []op {
	var ops []op
	for r := 0; r < regions; r++ {
		lbase := uint64(r) * uint64(nBlocks*blockLen) // each region registered apart
		for i := range local {
			ops = append(ops, op{
				laddr: 1<<40 + lbase + uint64(local[i]*blockLen),
				raddr: 1<<41 + lbase + uint64(remote[i]*blockLen),
				len:   uint64(blockLen),
				rkey:  uint32(r), memh: uint32(r),
			})
		}
	}
	return ops
}

// TestCoalesceTypicalRequest documents the operation counts quoted in
// docs/BENCHMARKS.md (UCX section): 32 layers × K,V = 64 regions, a 1000-token prompt
// in 16-token blocks = 63 blocks.
func TestCoalesceTypicalRequest(t *testing.T) {
	const regions, nBlocks, blockLen, n = 64, 4096, 16 * 8 * 128 * 2, 63
	seq := func(start int) []int {
		b := make([]int, n)
		for i := range b {
			b[i] = start + i
		}
		return b
	}
	// Runs of 4 consecutive blocks at scattered places: a fragmented pool.
	frag := func(seed int64) []int {
		rng := rand.New(rand.NewSource(seed))
		var b []int
		for len(b) < n {
			s := rng.Intn(nBlocks/8) * 8
			for j := 0; j < 4 && len(b) < n; j++ {
				b = append(b, s+j)
			}
		}
		return b
	}
	// Every block on its own (no two consecutive ids).
	scattered := func(off int) []int {
		b := make([]int, n)
		for i := range b {
			b[i] = (i*7919 + off) % nBlocks * 1
		}
		return b
	}
	for _, c := range []struct {
		name          string
		local, remote []int
		want          int
	}{
		{"both sides contiguous", seq(100), seq(2000), regions},
		{"runs of 4 on both sides", frag(1), frag(1), regions * 16},
		{"local contiguous, remote scattered", seq(100), scattered(1), regions * n},
	} {
		ops := kvRequest(regions, nBlocks, blockLen, c.local, c.remote)
		before := len(ops)
		after := len(coalesce(ops))
		t.Logf("%s: %d descriptors → %d UCP operations", c.name, before, after)
		if before != regions*n || after != c.want {
			t.Errorf("%s: %d → %d, want %d → %d", c.name, before, after, regions*n, c.want)
		}
	}
}

func TestMetadataRoundTrip(t *testing.T) {
	m := &metadata{UCXVersion: 1<<16 | 13<<8 | 1, Name: "agent-ü", Address: []byte{1, 2, 3, 4, 5},
		Proc: procID{BootID: "b", PidNS: 7, NetNS: 8, Pid: 42, Start: 99},
		Regions: []mdRegion{
			{Mem: nixl.DRAM, Addr: 0x1000, Len: 4096, DevID: 0, Rkey: []byte{9, 9}},
			{Mem: nixl.VRAM, Addr: 0x9000, Len: 1, DevID: 3, Rkey: bytes.Repeat([]byte{7}, 300)},
		}}
	b, err := m.encode()
	if err != nil {
		t.Fatal(err)
	}
	got, err := decodeMetadata(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, m) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got, m)
	}
	// Every truncation and every single-byte corruption is an error.
	for i := 0; i < len(b); i++ {
		if _, err := decodeMetadata(b[:i]); err == nil {
			t.Fatalf("truncated to %d bytes: no error", i)
		}
		c := append([]byte(nil), b...)
		c[i] ^= 0xff
		if _, err := decodeMetadata(c); err == nil {
			t.Fatalf("byte %d flipped: no error", i)
		}
	}
	for _, bad := range []*metadata{
		{Name: "", Address: []byte{1}},
		{Name: "x", Address: nil},
		{Name: "x", Address: []byte{1}, Regions: []mdRegion{{Len: 1, Rkey: nil}}},
	} {
		if _, err := bad.encode(); err == nil {
			t.Errorf("encode(%+v): no error", bad)
		}
	}
}

// A version-2 blob (no network namespace) still decodes, with NetNS 0.
func TestMetadataVersion2(t *testing.T) {
	m := &metadata{Name: "a", Address: []byte{1}, Proc: procID{BootID: "b", PidNS: 7, NetNS: 8, Pid: 42, Start: 99},
		Regions: []mdRegion{{Addr: 1, Len: 1, Rkey: []byte{1}}}}
	b, err := m.encode()
	if err != nil {
		t.Fatal(err)
	}
	// Rewrite as version 2: drop the 8 namespace bytes after the start time.
	at := len(mdMagic) + 2 + 2 + 4 + 2 + len(m.Name) + 4 + len(m.Address) + 1 + len(m.Proc.BootID) + 8 + 4 + 8
	v2 := append(append([]byte(nil), b[:at]...), b[at+8:len(b)-4]...)
	binary.LittleEndian.PutUint16(v2[len(mdMagic):], 2)
	v2 = binary.LittleEndian.AppendUint32(v2, crc32.Checksum(v2, castagnoli))
	got, err := decodeMetadata(v2)
	if err != nil {
		t.Fatal(err)
	}
	m.Proc.NetNS = 0
	if !reflect.DeepEqual(got, m) {
		t.Fatalf("version 2:\n got %+v\nwant %+v", got, m)
	}
}

// FuzzDecodeMetadata: arbitrary bytes never panic (go test -fuzz).
func FuzzDecodeMetadata(f *testing.F) {
	m := &metadata{Name: "a", Address: []byte{1}, Regions: []mdRegion{{Addr: 1, Len: 1, Rkey: []byte{1}}}}
	b, _ := m.encode()
	f.Add(b)
	f.Add([]byte(mdMagic))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeMetadata(b)
		if err == nil && (m.Name == "" || len(m.Address) == 0) {
			t.Fatalf("accepted invalid metadata %+v", m)
		}
	})
}

func TestResolveSettings(t *testing.T) {
	env := func(kv map[string]string) func(string) string { return func(k string) string { return kv[k] } }
	cfg := func(p map[string]string) nixl.AgentConfig {
		c := nixl.AgentConfig{Name: "a"}
		if p != nil {
			c.BackendParams = map[string]map[string]string{"UCX": p}
		}
		return c
	}
	s, err := resolveSettings(cfg(nil), env(nil))
	if err != nil || !s.autoMode || s.errFrom != "default" {
		t.Errorf("default: %+v %v", s, err)
	}
	if !reflect.DeepEqual(s.ucxCfg, []string{"RNDV_THRESH=inf"}) {
		t.Errorf("default ucx config %v", s.ucxCfg)
	}
	s, _ = resolveSettings(cfg(nil), env(map[string]string{EnvErrMode: "none", "UCX_RNDV_THRESH": "8k"}))
	if s.peerMode || s.errFrom != EnvErrMode || len(s.ucxCfg) != 0 {
		t.Errorf("env: %+v", s)
	}
	s, _ = resolveSettings(cfg(map[string]string{ParamErrMode: "peer"}), env(map[string]string{EnvErrMode: "none"}))
	if !s.peerMode || s.autoMode {
		t.Errorf("param must win over env: %+v", s)
	}
	if !s.peerModeFor(thisProc()) {
		t.Error("peer mode must apply to a same-host peer too")
	}
	s, _ = resolveSettings(cfg(map[string]string{ParamErrMode: "auto"}), env(nil))
	if s.peerModeFor(thisProc()) || !s.peerModeFor(procID{BootID: "elsewhere", Pid: 1, Start: 1}) {
		t.Error("auto: want none on this host, peer elsewhere")
	}
	// Same host, another network namespace (two pods on one node): UCX's
	// shared-memory lanes would be chosen and hang, so auto picks peer mode
	// (network transports). A version-2 peer (no namespace) counts as
	// another namespace.
	other := thisProc()
	other.NetNS++
	if thisProc().NetNS == 0 {
		t.Fatal("this process's network namespace is unknown")
	}
	if !s.peerModeFor(other) || !sameHost(other) {
		t.Error("auto: want peer mode for a same-host peer in another network namespace")
	}
	other.NetNS = 0
	if !s.peerModeFor(other) {
		t.Error("auto: want peer mode for a peer whose network namespace is unknown")
	}
	s, _ = resolveSettings(cfg(map[string]string{"error_handling": "NONE", ParamDevices: "lo, eth0:1", ParamEngineConfig: "UCX_TLS=tcp, MAX_EAGER_LANES=2"}), env(nil))
	if s.peerMode || !reflect.DeepEqual(s.ucxCfg, []string{"RNDV_THRESH=inf", "NET_DEVICES=lo:1,eth0:1", "TLS=tcp", "MAX_EAGER_LANES=2"}) {
		t.Errorf("params: %+v", s)
	}
	for _, c := range []nixl.AgentConfig{
		{},
		cfg(map[string]string{ParamErrMode: "sometimes"}),
		cfg(map[string]string{ParamEngineConfig: "novalue"}),
		cfg(map[string]string{"bogus": "1"}),
		{Name: "a", Backends: []string{"UCX", "POSIX"}},
		{Name: "a", BackendParams: map[string]map[string]string{"LIBFABRIC": {}}},
	} {
		if _, err := resolveSettings(c, env(nil)); err == nil {
			t.Errorf("%+v: no error", c)
		} else if st := nixl.StatusOf(err); !st.IsError() {
			t.Errorf("%+v: status %v", c, st)
		}
	}
	var e *nixl.Error
	if _, err := resolveSettings(nixl.AgentConfig{Name: "a", Backends: []string{"GDS"}}, env(nil)); !errors.As(err, &e) || e.Status != nixl.ErrNotSupported {
		t.Errorf("foreign backend: %v", err)
	}
}
