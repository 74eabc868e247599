package shim

import (
	"encoding/json"
	"fmt"
	"testing"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/sidechannel"
)

// benchAgent is a transfer agent that accepts every descriptor list: the
// benchmarks below measure what gonixl itself does at first contact (TP
// plan, identity checks, descriptor arrays), not an engine's validation.
type benchAgent struct{ fzAgent }

func (a *benchAgent) LoadRemoteMetadata(md []byte) (string, error) { return string(md), nil }

// stridedBenchAgent also takes strided runs as they are (an engine that
// keeps runs, as the ucx engine does): what is left is gonixl's own work.
type stridedBenchAgent struct{ benchAgent }

func (a *stridedBenchAgent) PrepStridedDescList(agent string, _ nixl.MemType, runs []nixl.Strided) (nixl.DescList, error) {
	n := 0
	for _, r := range runs {
		n += int(r.Count)
	}
	return &fzList{n: n, agent: agent}, nil
}

// largeModelLayers is a FlashAttention-shaped cache of a large model on one
// rank: layers × [2, blocks, heads, 16, 128] bfloat16 at fake addresses.
func largeModelLayers(layers, blocks, heads int) []LayerTensor {
	const bs, hd, elem = 16, 128, 2
	per := uint64(2*blocks*heads*bs*hd) * elem
	out := make([]LayerTensor, layers)
	for l := range out {
		base := uint64(0x100000000) + uint64(l)*(per+4096)
		out[l] = LayerTensor{
			Name: fmt.Sprintf("model.layers.%d.self_attn", l), DataPtr: base, StoragePtr: base, StorageBytes: per,
			ElemSize: elem, Shape: []int64{2, int64(blocks), int64(heads), bs, hd},
			Stride: []int64{int64(blocks * heads * bs * hd), int64(heads * bs * hd), bs * hd, hd, 1},
			Device: "cpu",
		}
	}
	return out
}

func benchWorker(b *testing.B, tp, rank, kvHeads, layers, blocks int, strided bool) *Worker {
	b.Helper()
	raw := map[string]any{"role": RoleWorker, "kv_role": "kv_consumer", "engine_id": "engine-d", "side_channel_port": 5600,
		"block_size": 16, "tp_size": tp, "tp_rank": rank,
		"compat_factors": map[string]any{"model": "big", "dtype": "torch.bfloat16", "num_kv_heads": kvHeads}}
	js, _ := json.Marshal(raw)
	cfg, err := ParseConfig(js)
	if err != nil {
		b.Fatal(err)
	}
	w, err := NewWorker(cfg, nil)
	if err != nil {
		b.Fatal(err)
	}
	w.log = zap.NewNop()
	layout, err := BuildLayout(largeModelLayers(layers, blocks, max(1, kvHeads/tp)), int64(blocks))
	if err != nil {
		b.Fatal(err)
	}
	w.agent, w.layout, w.localList = &benchAgent{}, layout, &fzList{n: len(layout.Regions) * blocks}
	if strided {
		w.agent = &stridedBenchAgent{}
	}
	w.blockSize, w.kvLayout, w.attnBackend = 16, "LBHNC", "FLASH_ATTN"
	return w
}

// remoteResult is the side-channel answer of a prefill engine of TP remoteTP
// for the ranks plan targets, as decoded from the wire.
func remoteResult(b *testing.B, remoteTP, kvHeads, layers, blocks int, plan tpPlan) *sidechannel.Result {
	b.Helper()
	layout, err := BuildLayout(largeModelLayers(layers, blocks, max(1, kvHeads/remoteTP)), int64(blocks))
	if err != nil {
		b.Fatal(err)
	}
	res := &sidechannel.Result{Agents: map[sidechannel.Rank]*sidechannel.AgentMetadata{}}
	for _, r := range plan.targets {
		am := sidechannel.NewAgentMetadata()
		am.EngineID, am.AgentMetadata, am.NumBlocks = "engine-p", []byte(fmt.Sprintf("p-rank-%d", r)), int64(blocks)
		am.KVCacheLayout, am.BlockSize, am.AttnBackendName, am.PhysicalBlocksPerLogicalKVBlock = "LBHNC", 16, "FLASH_ATTN", 1
		fillRegionIdentity(am, layout)
		g := kvGeometry{Model: "big", Dtype: "torch.bfloat16", NumKVHeads: int64(kvHeads), TPSize: remoteTP, PPSize: 1}
		for _, reg := range layout.Regions {
			g.RegionKinds = append(g.RegionKinds, reg.Kind)
		}
		gj, _ := json.Marshal(g)
		am.Geometry = string(gj)
		md, err := sidechannel.DecodeAgentMetadata(am.Encode())
		if err != nil {
			b.Fatal(err)
		}
		res.Agents[sidechannel.Rank{TP: r}] = md
	}
	return res
}

// BenchmarkFirstContactPrepare: a decode worker's preparation for a new
// prefill engine of another TP size (plan, per-rank checks, descriptor
// arrays for the slices it reads, local slot lists) for a large model:
// 80 layers, K and V, 8 KV heads of dim 128, 16-token blocks, 10,000
// blocks — 1.6M descriptors per remote rank — and the 82k-descriptor case
// (512 blocks). Engine validation is not included (see nixl/ucx
// BenchmarkPrepDescList). "expanded": for an engine that takes descriptor
// arrays (NIXL); "strided": for one that keeps strided runs (ucx).
func BenchmarkFirstContactPrepare(b *testing.B) {
	fzQuiet()
	for _, c := range []struct {
		name                    string
		localTP, remoteTP, rank int
		blocks                  int
	}{
		{"D2-from-P1/80L-10kblocks", 2, 1, 1, 10000},
		{"D1-from-P2/80L-10kblocks", 1, 2, 0, 10000},
		{"D2-from-P1/80L-512blocks", 2, 1, 1, 512},
		{"D1-from-P1/80L-512blocks", 1, 1, 0, 512},
	} {
		for _, strided := range []bool{false, true} {
			b.Run(c.name+map[bool]string{false: "/expanded", true: "/strided"}[strided], func(b *testing.B) {
				const layers, heads = 80, 8
				w := benchWorker(b, c.localTP, c.rank, heads, layers, c.blocks, strided)
				plan, err := w.planFor(c.remoteTP)
				if err != nil {
					b.Fatal(err)
				}
				res := remoteResult(b, c.remoteTP, heads, layers, c.blocks, plan)
				descs := 0
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					delete(w.slotLists, plan.nSlots)
					re, err := w.prepareRemote("engine-p", "127.0.0.1", 5600, plan, res)
					if err != nil {
						b.Fatal(err)
					}
					descs = 0
					for _, r := range re.ranks {
						if r.list != nil {
							descs += r.list.Len()
						}
					}
					for _, l := range w.slotLists[plan.nSlots] {
						descs += l.Len()
					}
				}
				b.ReportMetric(float64(descs), "descs/op")
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(descs), "ns/desc")
			})
		}
	}
}

var _ nixl.Agent = (*benchAgent)(nil)
