package shim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/nixltest"
	"github.com/gonixl/gonixl/sidechannel"
)

// The order vLLM's NixlConnector gives these names (its _region_sort_key,
// printed by the installed vLLM 0.32).
var vllmRegionOrder = []string{
	"3abc", "10abc", "abc", "decoder.layers.5.attn", "lm.7", "lm.7a", "lm.07b", "lm.007x",
	"model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn", "model.layers.2",
	"model.layers.2.cross_attn.attn", "model.layers.2.self_attn.attn", "model.layers.9.attn",
	"model.layers.9.mlp.attn", "model.layers.10.self_attn.attn", "model.layers.11.self_attn.attn",
	"model.layers.100.self_attn.attn",
}

func TestRegionLessMatchesVLLM(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	for i := 0; i < 20; i++ {
		names := slices.Clone(vllmRegionOrder)
		rng.Shuffle(len(names), func(a, b int) { names[a], names[b] = names[b], names[a] })
		slices.SortStableFunc(names, func(a, b string) int {
			if RegionLess(a, b) {
				return -1
			}
			if RegionLess(b, a) {
				return 1
			}
			return 0
		})
		// lm.7 vs lm.07b etc. are distinct keys; only exact ties keep input order.
		if !slices.Equal(names, vllmRegionOrder) {
			t.Fatalf("order %q\nwant  %q", names, vllmRegionOrder)
		}
	}
	if RegionLess("model.layers.10.attn", "model.layers.2.attn") || !RegionLess("model.layers.2.attn", "model.layers.10.attn") {
		t.Fatal("layers.10 sorted before layers.2")
	}
}

// cpuLayer is one vLLM CPU-attention cache: [num_blocks, heads, block_size,
// 2*head_dim] in its own storage (or at base, sharing storage).
func cpuLayer(name string, base uint64, group int, kind string, window int64) LayerTensor {
	const nb, h, bs, d, e = 8, 2, 4, 16, 4
	g := group
	return LayerTensor{Name: name, DataPtr: base, StoragePtr: base, StorageBytes: nb * h * bs * d * e, ElemSize: e,
		Shape: []int64{nb, h, bs, d}, Stride: []int64{h * bs * d, bs * d, d, 1}, Device: "cpu",
		Group: &g, Kind: kind, SlidingWindow: window}
}

func TestBuildLayoutModelOrderSharedGroupsAndSkips(t *testing.T) {
	var layers []LayerTensor
	// 12 layers handed over in dict order 0..11, each its own tensor.
	for i := 0; i < 12; i++ {
		layers = append(layers, cpuLayer(fmt.Sprintf("model.layers.%d.self_attn.attn", i), uint64(0x100000*(i+1)), 0, "full", 0))
	}
	l, err := BuildLayout(layers, 8)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range l.Regions {
		if want := fmt.Sprintf("model.layers.%d.self_attn.attn", i); r.Layer != want || r.Base != uint64(0x100000*(i+1)) {
			t.Fatalf("region %d is %s at %#x, want %s", i, r.Layer, r.Base, want)
		}
	}

	// Hybrid: layer 0 (full, group 0) and layer 1 (sliding window, group 1)
	// share one tensor, as do 2 and 3; layer 4 has no spec of its own.
	hy := []LayerTensor{
		cpuLayer("m.layers.3.attn", 0x200000, 1, "sliding_window", 64),
		cpuLayer("m.layers.0.attn", 0x100000, 0, "full", 0),
		cpuLayer("m.layers.1.attn", 0x100000, 1, "sliding_window", 64),
		cpuLayer("m.layers.2.attn", 0x200000, 0, "full", 0),
		cpuLayer("m.layers.4.attn", 0x300000, -1, "", 0),
	}
	l, err = BuildLayout(hy, 8)
	if err != nil {
		t.Fatal(err)
	}
	if len(l.Regions) != 2 || l.Regions[0].Layer != "m.layers.0.attn" || l.Regions[1].Layer != "m.layers.2.attn" ||
		l.Regions[0].Group != SharedGroup || l.Regions[1].Group != SharedGroup || len(l.Storage) != 2 {
		t.Fatalf("hybrid regions %+v storage %+v", l.Regions, l.Storage)
	}

	// Refused: a kind gonixl does not transfer; a shared tensor seen with
	// two geometries.
	bad := cpuLayer("m.layers.0.mamba", 0x100000, 0, "MambaSpec", 0)
	if _, err := BuildLayout([]LayerTensor{bad}, 8); err == nil || !strings.Contains(err.Error(), `"MambaSpec"`) {
		t.Fatalf("mamba layer: %v", err)
	}
	odd := cpuLayer("m.layers.1.attn", 0x100000, 1, "full", 0)
	odd.Shape, odd.Stride = []int64{8, 1, 4, 16}, []int64{64, 64, 16, 1}
	if _, err := BuildLayout([]LayerTensor{cpuLayer("m.layers.0.attn", 0x100000, 0, "full", 0), odd}, 8); err == nil ||
		!strings.Contains(err.Error(), "share memory") {
		t.Fatalf("shared tensor with two geometries: %v", err)
	}
}

// geoSide is a worker (and its scheduler) over CPU-attention layers made by
// mk, with the given transfer groups.
func geoSide(t *testing.T, eng nixl.Engine, kvRole, id string, groups []TransferGroup, factors map[string]any, layers []LayerTensor, mems []*nixltest.Mem) *side {
	t.Helper()
	port := freePort(t)
	cfg := func(role Role) *Config {
		raw := map[string]any{
			"role": role, "kv_role": kvRole, "engine_id": id,
			"side_channel_host": "127.0.0.1", "side_channel_port": port, "block_size": 4,
			"transfer_groups": groups, "hma_required": len(groups) > 1,
			"compat_factors": factors,
		}
		b, _ := json.Marshal(raw)
		c, err := ParseConfig(b)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	s, err := NewScheduler(cfg(RoleScheduler), nil)
	if err != nil {
		t.Fatal(err)
	}
	w, err := NewWorker(cfg(RoleWorker), nil)
	if err != nil {
		t.Fatal(err)
	}
	registerAndServe(t, s, w, eng, 0, cpuInit(layers))
	return &side{sched: s, work: w, port: port}
}

// cpuCaches allocates n real CPU-attention caches (filled with fill+index
// patterns) named by name(i), group by group(i).
func cpuCaches(t *testing.T, n int, fill byte, name func(int) string, group func(int) (int, string, int64), shareWith func(int) int) ([]LayerTensor, []*nixltest.Mem) {
	t.Helper()
	var layers []LayerTensor
	var mems []*nixltest.Mem
	for i := 0; i < n; i++ {
		base := uint64(0)
		if j := shareWith(i); j >= 0 {
			base = layers[j].DataPtr
		} else {
			m, err := nixltest.Alloc(8 * 2 * 4 * 16 * 4)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = m.Free() })
			for k := range m.Bytes {
				m.Bytes[k] = fill + byte(i*7+k/512)
			}
			mems = append(mems, m)
			base = m.Addr
		}
		g, kind, win := group(i)
		layers = append(layers, cpuLayer(name(i), base, g, kind, win))
	}
	return layers, mems
}

func cpuInit(layers []LayerTensor) *WorkerInit {
	return &WorkerInit{Layers: layers, NumBlocks: 8, BlockSize: 4, AttnBackend: "CPU_ATTN", KVCacheLayout: "LBHNC"}
}

func fullGroup(int) (int, string, int64) { return 0, "full", 0 }
func noShare(int) int                    { return -1 }

func decodeMeta(t *testing.T, w *Worker) *sidechannel.AgentMetadata {
	t.Helper()
	p, err := w.HandshakePayload()
	if err != nil {
		t.Fatal(err)
	}
	hp, err := sidechannel.DecodeHandshakePayload(p)
	if err != nil {
		t.Fatal(err)
	}
	md, err := sidechannel.DecodeAgentMetadata(hp.AgentMetadataBytes)
	if err != nil {
		t.Fatal(err)
	}
	return md
}

func TestHandshakeIdentityCheck(t *testing.T) {
	eng := nixltest.NewEngine("t")
	factors := map[string]any{"model": "m", "dtype": "torch.float32", "num_kv_heads": 2, "head_size": 8, "num_hidden_layers": 12}
	name := func(i int) string { return fmt.Sprintf("model.layers.%d.self_attn.attn", i) }
	pl, pm := cpuCaches(t, 12, 1, name, fullGroup, noShare)
	p := geoSide(t, eng, "kv_producer", "p", nil, factors, pl, pm)
	md := decodeMeta(t, p.work)
	if md.RegionNames[2] != name(2) || md.RegionNames[10] != name(10) || len(md.RegionGroupIDs) != 12 ||
		md.RegionNumBlocks[0] != 8 || md.RegionMemTypes[0] != "DRAM" || md.Geometry == "" {
		t.Fatalf("metadata identity: names %v groups %v blocks %v mem %v geometry %q", md.RegionNames, md.RegionGroupIDs, md.RegionNumBlocks, md.RegionMemTypes, md.Geometry)
	}
	dl, dm := cpuCaches(t, 12, 100, name, fullGroup, noShare)
	d := geoSide(t, eng, "kv_consumer", "d", nil, factors, dl, dm)
	check := func(mut func(*sidechannel.AgentMetadata)) error {
		m := *decodeMeta(t, p.work)
		if mut != nil {
			mut(&m)
		}
		w := d.work
		_, err := checkRemoteLayout(w.layout, w.blockSize, w.kvLayout, w.attnBackend, w.blockReshape, w.geometryOf(w.layout), samePlan(), &m)
		return err
	}
	if err := check(nil); err != nil {
		t.Fatalf("same geometry refused: %v", err)
	}
	cases := []struct {
		name string
		mut  func(*sidechannel.AgentMetadata)
		want string
	}{
		// The alphabetical order gonixl used to register: layers.10 at index 2.
		{"alphabetical order", func(m *sidechannel.AgentMetadata) {
			slices.SortFunc(m.RegionNames, strings.Compare)
		}, `region 2 holds layer "model.layers.10.self_attn.attn", this engine's region 2 holds "model.layers.2.self_attn.attn"`},
		{"fewer layers", func(m *sidechannel.AgentMetadata) {
			m.RegionNames, m.BlockLens, m.BlockStrides, m.KVCachesBaseAddr = m.RegionNames[:6], m.BlockLens[:6], m.BlockStrides[:6], m.KVCachesBaseAddr[:6]
			m.RegionGroupIDs, m.RegionNumBlocks, m.RegionMemTypes = m.RegionGroupIDs[:6], m.RegionNumBlocks[:6], m.RegionMemTypes[:6]
		}, "has 6 KV-cache regions, this engine 12"},
		{"no names", func(m *sidechannel.AgentMetadata) { m.RegionNames = nil }, "sent no region_names"},
		{"block length", func(m *sidechannel.AgentMetadata) { m.BlockLens[5] /= 2 }, "region 5 (model.layers.5.self_attn.attn) has block length"},
		{"group", func(m *sidechannel.AgentMetadata) { m.RegionGroupIDs[3] = 1 }, "region 3 (model.layers.3.self_attn.attn) belongs to KV-cache group 1"},
		{"layout", func(m *sidechannel.AgentMetadata) { m.KVCacheLayout = "LBNHC" }, `KV-cache layout "LBNHC"`},
		{"block size", func(m *sidechannel.AgentMetadata) { m.BlockSize = 16 }, "block_size 16"},
		{"backend", func(m *sidechannel.AgentMetadata) { m.AttnBackendName = "FLASH_ATTN" }, `attention backend "FLASH_ATTN"`},
		{"lengths disagree", func(m *sidechannel.AgentMetadata) { m.BlockStrides = m.BlockStrides[:11] }, "but 11 block_strides"},
		{"ssm", func(m *sidechannel.AgentMetadata) { m.SSMSizes = [2]int64{4, 4} }, "Mamba/SSM"},
		{"dtype", func(m *sidechannel.AgentMetadata) {
			m.Geometry = strings.Replace(m.Geometry, "torch.float32", "torch.bfloat16", 1)
		}, "dtype: remote torch.bfloat16, this engine torch.float32"},
		{"pipeline stage", func(m *sidechannel.AgentMetadata) {
			m.Geometry = strings.Replace(m.Geometry, `"pp_rank":0`, `"pp_rank":1`, 1)
		}, "pp_rank: remote 1, this engine 0"},
		{"bidirectional on one side only", func(m *sidechannel.AgentMetadata) {
			m.Geometry = strings.Replace(m.Geometry, `"transfer_direction":"oneway"`, `"transfer_direction":"bidirectional"`, 1)
		}, "has bidirectional_kv_xfer true, this engine false: set kv_connector_extra_config.bidirectional_kv_xfer the same on prefill and decode"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := check(c.mut)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, want an error containing %q", err, c.want)
			}
		})
	}

	// Block sizes (this engine's is 4): a smaller one that divides it is
	// accepted only where the Python side can rearrange the blocks, and
	// only with block lengths to match.
	half := func(m *sidechannel.AgentMetadata) {
		m.BlockSize = 2
		for i := range m.BlockLens {
			m.BlockLens[i] /= 2
		}
	}
	d.work.blockReshape = ""
	if err := check(half); err == nil || !strings.Contains(err.Error(), "no known token order") {
		t.Fatalf("block size 2 without a reshape rule: %v", err)
	}
	d.work.blockReshape = "head_major"
	for _, c := range []struct {
		name string
		mut  func(*sidechannel.AgentMetadata)
		want string // "" accepted
	}{
		{"half the block size", half, ""},
		{"half the block size, full block lengths", func(m *sidechannel.AgentMetadata) { m.BlockSize = 2 },
			"where 256 are expected for its block_size 2 against this engine's 512 bytes at block_size 4"},
		{"larger", func(m *sidechannel.AgentMetadata) { m.BlockSize = 8 }, "has block_size 8, larger than this engine's 4"},
		{"not a divisor", func(m *sidechannel.AgentMetadata) { m.BlockSize = 3 }, "has block_size 3, which does not divide this engine's 4"},
		{"zero", func(m *sidechannel.AgentMetadata) { m.BlockSize = 0 }, "advertises block_size 0"},
	} {
		err := check(c.mut)
		if (c.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%s: got %v, want %q", c.name, err, c.want)
		}
	}

	// The CPU backend's kernel layout (its ISA's byte order inside a block):
	// stated by gonixl peers, compared whenever both state it, and needed
	// from the peer for a different block size.
	d.work.kernelLayout = "cpu_attn:vec"
	withKernel := func(k string) func(*sidechannel.AgentMetadata) {
		return func(m *sidechannel.AgentMetadata) {
			m.Geometry = strings.TrimSuffix(m.Geometry, "}") + `,"kernel_layout":"` + k + `"}`
		}
	}
	both := func(fs ...func(*sidechannel.AgentMetadata)) func(*sidechannel.AgentMetadata) {
		return func(m *sidechannel.AgentMetadata) {
			for _, f := range fs {
				f(m)
			}
		}
	}
	for _, c := range []struct {
		name string
		mut  func(*sidechannel.AgentMetadata)
		want string
	}{
		{"same kernel layout", withKernel("cpu_attn:vec"), ""},
		{"same kernel layout, half the block size", both(half, withKernel("cpu_attn:vec")), ""},
		{"another kernel layout", withKernel("cpu_attn:amx"), "kernel_layout: remote cpu_attn:amx, this engine cpu_attn:vec"},
		{"an older gonixl peer, same block size", nil, ""},
		{"an older gonixl peer, half the block size", half, "does not state its attention kernel's layout"},
		{"a stock peer, half the block size", both(half, func(m *sidechannel.AgentMetadata) { m.Geometry = "" }), "needs gonixl on both sides"},
	} {
		err := check(c.mut)
		if (c.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%s: got %v, want %q", c.name, err, c.want)
		}
	}
}

// A decode whose layers do not match the prefill's fails the request at
// handshake and never posts a READ.
func TestMismatchedLayersNeverTransfer(t *testing.T) {
	eng := nixltest.NewEngine("t")
	factors := map[string]any{"model": "m", "dtype": "torch.float32"}
	pl, pm := cpuCaches(t, 3, 1, func(i int) string { return fmt.Sprintf("model.layers.%d.attn", i) }, fullGroup, noShare)
	p := geoSide(t, eng, "kv_producer", "p", nil, factors, pl, pm)
	dl, dm := cpuCaches(t, 3, 100, func(i int) string { return fmt.Sprintf("model.decoder.%d.attn", i) }, fullGroup, noShare)
	d := geoSide(t, eng, "kv_consumer", "d", nil, factors, dl, dm)
	out := prefill(t, p, "req", []int64{1, 2}, 8)
	dp := mustParams(t, string(out))
	if _, err := d.sched.UpdateStateAfterAlloc("req-d", dp, BlockIDs{{5, 6}}, []int64{0}, 8); err != nil {
		t.Fatal(err)
	}
	d.step(t)
	f := d.waitFinished(t, "failure", func(f Finished) bool { return contains(f.Failed, "req-d") })
	if !contains(f.Recving, "req-d") {
		t.Fatalf("failed request not reported done: %+v", f)
	}
	for _, a := range eng.Agents() {
		if a.CountCalls("MakeXfer") != 0 {
			t.Fatal("a READ was prepared for mismatched layers")
		}
	}
	if got := d.work.LoadErrors(); !slices.Equal(got, []int64{5, 6}) {
		t.Fatalf("load errors %v", got)
	}
}

func TestRemoteBlockListMustMatchAllocation(t *testing.T) {
	eng := nixltest.NewEngine("t")
	pl, pm := cpuCaches(t, 2, 1, func(i int) string { return fmt.Sprintf("l.%d", i) }, fullGroup, noShare)
	p := geoSide(t, eng, "kv_producer", "p", nil, nil, pl, pm)
	dl, dm := cpuCaches(t, 2, 100, func(i int) string { return fmt.Sprintf("l.%d", i) }, fullGroup, noShare)
	d := geoSide(t, eng, "kv_consumer", "d", nil, nil, dl, dm)
	out := prefill(t, p, "req", []int64{1, 2}, 8)
	var params map[string]any
	if err := json.Unmarshal(out, &params); err != nil {
		t.Fatal(err)
	}
	// A client's list: the prefill's two blocks, then 3 more ids.
	params["remote_block_ids"] = [][]int64{{1, 2, 3, 4, 5}}
	b, _ := json.Marshal(params)
	dp := mustParams(t, string(b))
	if _, err := d.sched.UpdateStateAfterAlloc("over", dp, BlockIDs{{5, 6}}, []int64{0}, 8); err != nil {
		t.Fatal(err)
	}
	d.step(t)
	d.waitFinished(t, "over-long list fails", func(f Finished) bool { return contains(f.Failed, "over") })
	for _, a := range eng.Agents() {
		if a.CountCalls("MakeXfer") != 0 {
			t.Fatal("an over-long block list was read")
		}
	}
	// remote_num_tokens that is not this prompt's length: compute locally.
	if n, async := d.sched.GetNumNewMatchedTokens(dp, 9, 0); n != 0 || async {
		t.Fatalf("remote_num_tokens 8 for a 9-token prompt matched %d tokens", n)
	}
	if n, _ := d.sched.GetNumNewMatchedTokens(dp, 8, 0); n != 8 {
		t.Fatalf("matching prompt: %d tokens", n)
	}
}

func TestRegionDescIDs(t *testing.T) {
	shared := []Region{{Group: SharedGroup}, {Group: SharedGroup}}
	if got := regionDescIDs(shared, 10, BlockIDs{{1, 2}, {7}}); !slices.Equal(got, []int32{1, 2, 7, 11, 12, 17}) {
		t.Fatalf("shared regions: %v", got)
	}
	mapped := []Region{{Group: 0}, {Group: 1}, {Group: SharedGroup}}
	if got := regionDescIDs(mapped, 10, BlockIDs{{1, 2}, {7}}); !slices.Equal(got, []int32{1, 2, 21, 22, 17, 27}) {
		t.Fatalf("mapped regions: %v", got)
	}
}

func TestClipToWindow(t *testing.T) {
	groups := []TransferGroup{{Kind: "full", BlockSize: 32}, {Kind: "sliding_window", SlidingWindow: 64, BlockSize: 32}}
	ids := BlockIDs{{1, 2, 3, 4, 5}, {0, 0, 8, 9, 10}}
	got := clipToWindow(ids, groups, true)
	if !slices.Equal(got[0], ids[0]) || !slices.Equal(got[1], []int64{8, 9, 10}) {
		t.Fatalf("clipped %v", got)
	}
	if got := clipToWindow(ids, groups, false); !slices.Equal(got[1], ids[1]) {
		t.Fatal("clipped without the hybrid manager")
	}
}

// Hybrid model: two groups (full attention, sliding window of 8 tokens =
// 3 blocks of 4) sharing every tensor, as vLLM's hybrid allocator lays
// them out. Both groups' blocks arrive in every region; the window group
// sends only its in-window tail.
func TestHybridGroupsTransfer(t *testing.T) {
	eng := nixltest.NewEngine("t")
	groups := []TransferGroup{{Kind: "full", BlockSize: 4}, {Kind: "sliding_window", SlidingWindow: 8, BlockSize: 4}}
	name := func(i int) string { return fmt.Sprintf("model.layers.%d.attn", i) }
	group := func(i int) (int, string, int64) {
		if i%2 == 1 {
			return 1, "sliding_window", 8
		}
		return 0, "full", 0
	}
	share := func(i int) int {
		if i%2 == 1 {
			return i - 1
		}
		return -1
	}
	pl, pm := cpuCaches(t, 4, 1, name, group, share)
	p := geoSide(t, eng, "kv_producer", "p", groups, nil, pl, pm)
	dl, dm := cpuCaches(t, 4, 100, name, group, share)
	d := geoSide(t, eng, "kv_consumer", "d", groups, nil, dl, dm)
	if n := len(p.work.layout.Regions); n != 2 {
		t.Fatalf("%d regions, want 2 shared", n)
	}
	in := mustParams(t, `{"do_remote_decode": true}`)
	if _, err := p.sched.UpdateStateAfterAlloc("req", in, nil, []int64{0, 0}, 0); err != nil {
		t.Fatal(err)
	}
	p.step(t)
	// 16 tokens: 4 full blocks; the window group's first block is null (0).
	_, out, err := p.sched.RequestFinished("req", in, true, 16, BlockIDs{{1, 2, 3, 4}, {0, 5, 6, 7}})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(out, []byte(`"remote_block_ids":[[1,2,3,4],[5,6,7]]`)) {
		t.Fatalf("window group not clipped: %s", out)
	}
	p.step(t)
	dp := mustParams(t, string(out))
	if _, err := d.sched.UpdateStateAfterAlloc("req-d", dp, BlockIDs{{1, 2, 3, 4}, {0, 0, 5, 6, 7}}, []int64{0, 0}, 16); err != nil {
		t.Fatal(err)
	}
	d.step(t)
	f := d.waitFinished(t, "hybrid recv", func(f Finished) bool { return contains(f.Recving, "req-d") })
	if len(f.Failed) != 0 {
		t.Fatalf("failed: %+v", f)
	}
	const blk = 512
	for r, m := range dm {
		for _, b := range []int{1, 2, 3, 4, 5, 6, 7} {
			if !bytes.Equal(m.Bytes[b*blk:(b+1)*blk], pm[r].Bytes[b*blk:(b+1)*blk]) {
				t.Fatalf("region %d block %d not transferred", r, b)
			}
		}
		if bytes.Equal(m.Bytes[0:blk], pm[r].Bytes[0:blk]) {
			t.Fatalf("region %d: the null block was transferred", r)
		}
	}
}

func TestCompatHashesNameTheOtherTransport(t *testing.T) {
	f := map[string]any{"model": "m", "vllm_version": "0.32.0"}
	ucx, ucxHints, err := compatHashes(f, "ucx")
	if err != nil {
		t.Fatal(err)
	}
	nixlHash, nixlHints, err := compatHashes(f, "nixl")
	if err != nil {
		t.Fatal(err)
	}
	want, _ := sidechannel.HashFactors(f) // vLLM's hash: what a stock peer sends
	if nixlHash != want || ucx == nixlHash {
		t.Fatalf("nixl hash %s (vLLM's %s), ucx hash %s", nixlHash, want, ucx)
	}
	if h := ucxHints[nixlHash]; !strings.Contains(h, "vLLM's NixlConnector") || !strings.Contains(h, "transfer_engine ucx") {
		t.Fatalf("ucx engine's hint for a NIXL peer: %q", h)
	}
	if h := nixlHints[ucx]; !strings.Contains(h, "transfer_engine ucx") {
		t.Fatalf("nixl engine's hint for a ucx peer: %q", h)
	}
}

// ppSide is one engine with pipeline parallelism: one scheduler and a
// worker per stage, each stage's worker holding its own layers and served
// under its pp_rank, as vLLM runs them.
type ppSide struct {
	sched   *Scheduler
	workers []*Worker
	mems    [][]*nixltest.Mem
	port    int
}

func newPPSide(t *testing.T, eng nixl.Engine, kvRole, id string, stages [][]string) *ppSide {
	t.Helper()
	port := freePort(t)
	cfg := func(role Role, pp int) *Config {
		raw := map[string]any{
			"role": role, "kv_role": kvRole, "engine_id": id, "pp_size": len(stages), "pp_rank": pp,
			"side_channel_host": "127.0.0.1", "side_channel_port": port, "block_size": 4,
			"compat_factors": map[string]any{"model": "m", "dtype": "torch.float32"},
		}
		b, _ := json.Marshal(raw)
		c, err := ParseConfig(b)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	s, err := NewScheduler(cfg(RoleScheduler, 0), nil)
	if err != nil {
		t.Fatal(err)
	}
	ps := &ppSide{sched: s, port: port}
	for pp, names := range stages {
		w, err := NewWorker(cfg(RoleWorker, pp), nil)
		if err != nil {
			t.Fatal(err)
		}
		layers, mems := cpuCaches(t, len(names), byte(40*pp+len(id)), func(i int) string { return names[i] }, fullGroup, noShare)
		registerAndServe(t, s, w, eng, pp, cpuInit(layers))
		ps.workers = append(ps.workers, w)
		ps.mems = append(ps.mems, mems)
	}
	return ps
}

// step feeds one scheduler step's metadata to every stage's worker.
func (ps *ppSide) step(t *testing.T) {
	t.Helper()
	b, err := ps.sched.BuildMeta()
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range ps.workers {
		if err := w.StartLoadKV(b); err != nil {
			t.Fatal(err)
		}
	}
}

// Pipeline parallelism: each decode stage reads its own layers from the
// prefill's worker of the same stage; a decode whose stages split the
// layers differently is refused at handshake by the stage that sees it.
func TestPipelineStagesReadTheirOwnLayers(t *testing.T) {
	eng := nixltest.NewEngine("t")
	names := func(lo, hi int) []string {
		var out []string
		for i := lo; i < hi; i++ {
			out = append(out, fmt.Sprintf("model.layers.%d.self_attn.attn", i))
		}
		return out
	}
	p := newPPSide(t, eng, "kv_producer", "p", [][]string{names(0, 6), names(6, 12)})
	d := newPPSide(t, eng, "kv_consumer", "d", [][]string{names(0, 6), names(6, 12)})
	odd := newPPSide(t, eng, "kv_consumer", "odd", [][]string{names(0, 5), names(5, 12)})

	in := mustParams(t, `{"do_remote_decode": true}`)
	for _, id := range []string{"r1", "r2"} {
		if _, err := p.sched.UpdateStateAfterAlloc(id, in, nil, []int64{0}, 0); err != nil {
			t.Fatal(err)
		}
	}
	p.step(t)
	_, out1, _ := p.sched.RequestFinished("r1", in, true, 8, BlockIDs{{2, 3}})
	_, out2, _ := p.sched.RequestFinished("r2", in, true, 8, BlockIDs{{4, 5}})
	p.step(t)

	load := func(ps *ppSide, id string, out []byte) []Finished {
		dp := mustParams(t, string(out))
		if _, err := ps.sched.UpdateStateAfterAlloc(id, dp, BlockIDs{{6, 7}}, []int64{0}, 8); err != nil {
			t.Fatal(err)
		}
		ps.step(t)
		res := make([]Finished, len(ps.workers))
		deadline := time.Now().Add(10 * time.Second)
		for pp, w := range ps.workers {
			for !contains(res[pp].Recving, id) {
				if time.Now().After(deadline) {
					t.Fatalf("stage %d never finished %s: %+v", pp, id, res[pp])
				}
				f := w.Poll()
				res[pp].Recving = append(res[pp].Recving, f.Recving...)
				res[pp].Failed = append(res[pp].Failed, f.Failed...)
				time.Sleep(2 * time.Millisecond)
			}
		}
		return res
	}
	res := load(d, "d1", out1)
	const blk = 512
	for pp := range d.workers {
		if len(res[pp].Failed) != 0 {
			t.Fatalf("stage %d failed: %+v", pp, res[pp])
		}
		for l := range d.mems[pp] {
			for i, b := range []int{2, 3} {
				got := d.mems[pp][l].Bytes[(6+i)*blk : (7+i)*blk]
				if !bytes.Equal(got, p.mems[pp][l].Bytes[b*blk:(b+1)*blk]) {
					t.Fatalf("stage %d layer %d: block %d is not the prefill stage's block %d", pp, l, 6+i, b)
				}
			}
		}
	}
	res = load(odd, "o2", out2)
	for pp := range odd.workers {
		if !contains(res[pp].Failed, "o2") {
			t.Fatalf("stage %d of a decode with another layer split did not fail: %+v", pp, res[pp])
		}
	}
}
