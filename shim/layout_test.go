package shim

import (
	"strings"
	"testing"

	"github.com/gonixl/gonixl/nixl"
)

func contiguousStride(shape []int64) []int64 {
	st := make([]int64, len(shape))
	acc := int64(1)
	for i := len(shape) - 1; i >= 0; i-- {
		st[i] = acc
		acc *= shape[i]
	}
	return st
}

func tensor(shape []int64, elem int64) LayerTensor {
	n := elem
	for _, s := range shape {
		n *= s
	}
	return LayerTensor{Name: "l0", DataPtr: 0x10000, StoragePtr: 0x10000, StorageBytes: uint64(n), ElemSize: elem,
		Shape: shape, Stride: contiguousStride(shape), Device: "cpu"}
}

func TestLayoutShapes(t *testing.T) {
	const nb = 100
	cases := []struct {
		name     string
		shape    []int64
		regions  int
		blockLen uint64
		stride   uint64
		secondAt uint64 // base of region 1 relative to region 0
	}{
		// FlashAttention / vLLM CPU: [2, num_blocks, block_size, heads, head_dim]
		{"flash-attn K/V split", []int64{2, nb, 16, 4, 64}, 2, 16 * 4 * 64 * 2, 16 * 4 * 64 * 2, nb * 16 * 4 * 64 * 2},
		// CPU attention (HND inside the block): [2, num_blocks, heads, block_size, head_dim]
		{"cpu HND", []int64{2, nb, 4, 16, 64}, 2, 4 * 16 * 64 * 2, 4 * 16 * 64 * 2, nb * 4 * 16 * 64 * 2},
		// FlashInfer: [num_blocks, 2, block_size, heads, head_dim]: K and V in one block
		{"flashinfer", []int64{nb, 2, 16, 4, 64}, 1, 2 * 16 * 4 * 64 * 2, 2 * 16 * 4 * 64 * 2, 0},
		// MLA: [num_blocks, block_size, head_dim]
		{"mla", []int64{nb, 16, 576}, 1, 16 * 576 * 2, 16 * 576 * 2, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			l, err := BuildLayout([]LayerTensor{tensor(c.shape, 2)}, nb)
			if err != nil {
				t.Fatal(err)
			}
			if len(l.Regions) != c.regions || l.Regions[0].Len != c.blockLen || l.Regions[0].Stride != c.stride {
				t.Fatalf("regions %+v", l.Regions)
			}
			if c.regions > 1 && l.Regions[1].Base-l.Regions[0].Base != c.secondAt {
				t.Fatalf("second region at +%d, want +%d", l.Regions[1].Base-l.Regions[0].Base, c.secondAt)
			}
			if len(l.Storage) != 1 {
				t.Fatalf("storage %+v", l.Storage)
			}
			if got := len(nixl.ExpandStrided(layoutRuns(l.Regions, nb, 0))); got != c.regions*nb {
				t.Fatalf("%d descriptors", got)
			}
		})
	}
}

// vLLM registers its GPU caches as a permuted view: logical [2, blocks,
// tokens, heads, dim] over HND memory [2, blocks, heads, tokens, dim]. A
// block is still one contiguous range, in memory order.
func TestLayoutPermutedHNDView(t *testing.T) {
	const nb, bs, h, d = 100, 16, 4, 64
	l := tensor([]int64{2, nb, bs, h, d}, 2)
	l.Stride = []int64{nb * h * bs * d, h * bs * d, d, bs * d, 1}
	got, err := BuildLayout([]LayerTensor{l}, nb)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Regions) != 2 || got.Regions[0].Len != h*bs*d*2 || got.Regions[0].Stride != h*bs*d*2 ||
		got.Regions[1].Base-got.Regions[0].Base != nb*h*bs*d*2 {
		t.Fatalf("regions %+v", got.Regions)
	}
}

func TestLayoutRejects(t *testing.T) {
	good := tensor([]int64{2, 10, 4, 8}, 4)
	cases := map[string]func(*LayerTensor){
		"no block dim":        func(l *LayerTensor) { l.Shape = []int64{2, 9, 4, 8} },
		"strided block":       func(l *LayerTensor) { l.Stride = []int64{320, 40, 1, 5} },
		"overlapping inner":   func(l *LayerTensor) { l.Stride = []int64{320, 32, 1, 2} },
		"outside storage":     func(l *LayerTensor) { l.StorageBytes = 100 },
		"null pointer":        func(l *LayerTensor) { l.DataPtr = 0 },
		"shape/stride length": func(l *LayerTensor) { l.Stride = l.Stride[:2] },
		"bad device":          func(l *LayerTensor) { l.Device = "tpu" },
	}
	for name, mut := range cases {
		t.Run(name, func(t *testing.T) {
			l := good
			l.Shape = append([]int64(nil), good.Shape...)
			l.Stride = append([]int64(nil), good.Stride...)
			mut(&l)
			if _, err := BuildLayout([]LayerTensor{l}, 10); err == nil {
				t.Fatal("accepted")
			}
		})
	}
	if _, err := BuildLayout(nil, 10); err == nil || !strings.Contains(err.Error(), "no layers") {
		t.Fatalf("empty: %v", err)
	}
}

func TestConfigDefaultsAndErrors(t *testing.T) {
	c, err := ParseConfig([]byte(`{"role":"worker","kv_role":"kv_consumer","engine_id":"e",
		"kv_connector_extra_config":{"kv_lease_duration":"12","bidirectional_kv_xfer":"True","backends":["UCX","LIBFABRIC"]}}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.KVLeaseDuration != 12 || !c.BidirectionalKVXfer || c.KVRecomputeThreshold != 64 || len(c.Backends) != 2 ||
		c.NumThreads != 4 || c.EngineTTL != 3600 || c.DecoderKVBlocksTTL != 480 || c.KVLoadFailurePolicy != "fail" ||
		c.SideChannelHost != "localhost" || c.SideChannelPort != 5600 || c.TransferEngine != "auto" || !c.EnforceHandshakeCompat ||
		c.ProgressDelayUs != 1000 || !c.PostOffModelThread {
		t.Fatalf("defaults: %+v", c)
	}
	if c, err := ParseConfig([]byte(`{"role":"worker","kv_role":"kv_consumer","engine_id":"e",
		"kv_connector_extra_config":{"progress_thread_delay_us":"0","post_off_model_thread":"False"}}`)); err != nil || c.ProgressDelayUs != 0 || c.PostOffModelThread {
		t.Fatalf("progress_thread_delay_us \"0\", post_off_model_thread \"False\": %v, %+v", err, c)
	}
	for _, bad := range []string{
		`{"role":"worker","kv_role":"kv_consumer","engine_id":"e","tp_size":2,"tp_rank":2}`,
		`{"role":"worker","kv_role":"kv_consumer","engine_id":"e","kv_connector_extra_config":{"num_threads":1.5}}`,
		`{"role":"worker","kv_role":"kv_consumer","engine_id":"e","kv_connector_extra_config":{"kv_lease_duration":-1}}`,
		`{"role":"worker","kv_role":"kv_consumer","engine_id":"e","side_channel_port":70000}`,
		`{"role":"worker","kv_role":"kv_consumer","engine_id":"e","kv_connector_extra_config":{"progress_thread_delay_us":-5}}`,
		`{"role":"worker","kv_role":"kv_consumer","engine_id":"e","kv_connector_extra_config":{"post_off_model_thread":"maybe"}}`,
	} {
		if _, err := ParseConfig([]byte(bad)); err == nil {
			t.Errorf("accepted %s", bad)
		}
	}
}

func TestTransferParamsErrors(t *testing.T) {
	for _, bad := range []string{
		`{"do_remote_prefill": "yes"}`,
		`{"remote_block_ids": [1, -2]}`,
		`{"remote_block_ids": "1,2"}`,
		`{"remote_block_ids": [[1], ["x"]]}`,
		`{"remote_port": 99999}`,
		`{"tp_size": 0}`,
		`{"remote_engine_id": 5}`,
		`[1,2]`,
	} {
		if _, err := ParseTransferParams([]byte(bad)); err == nil {
			t.Errorf("accepted %s", bad)
		}
	}
	p, err := ParseTransferParams([]byte(`{"do_remote_prefill": true, "remote_block_ids": [4, 5], "remote_engine_id": "e",
		"remote_request_id": "r", "remote_host": "h", "remote_port": 1}`))
	if err != nil || !p.HasRemoteEndpoint() || len(p.RemoteBlockIDs) != 1 || p.RemoteBlockIDs[0][1] != 5 {
		t.Fatalf("flat block ids: %+v %v", p, err)
	}
	if p, err := ParseTransferParams([]byte(`null`)); p != nil || err != nil {
		t.Fatal("null params")
	}
}
