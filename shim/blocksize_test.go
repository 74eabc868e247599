package shim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/nixltest"
)

// A prefill with a smaller block size than the decode's (vLLM's
// block_size_ratio): each decode block is read as ratio prefill blocks, one
// after another, and get_finished tells the Python side which blocks to put
// in token order. The layers are CPU-attention caches [blocks, heads,
// block_size, 2*head_dim] of 4-byte elements, every byte telling which
// (layer, block, byte) it is.

const (
	bsLayers  = 3
	bsBlocks  = 16
	bsHeads   = 2
	bsHeadDim = 8
)

type bsSide struct {
	*side
	mems      []*nixltest.Mem
	blockLen  int
	blockSize int64
}

func bsByte(seed byte, l, b, i int) byte { return seed + byte(l*53+b*11+i%7) }

func newBSSide(t *testing.T, eng nixl.Engine, kvRole, id string, blockSize int64, seed byte, reshape string) *bsSide {
	t.Helper()
	port := freePort(t)
	cfg := func(role Role) *Config {
		b, _ := json.Marshal(map[string]any{
			"role": role, "kv_role": kvRole, "engine_id": id,
			"side_channel_host": "127.0.0.1", "side_channel_port": port, "block_size": blockSize,
			"compat_factors": map[string]any{"model": "m", "dtype": "torch.float32", "num_kv_heads": bsHeads, "head_size": bsHeadDim},
		})
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
	bl := int(bsHeads * blockSize * 2 * bsHeadDim * 4)
	out := &bsSide{blockLen: bl, blockSize: blockSize}
	var layers []LayerTensor
	for l := 0; l < bsLayers; l++ {
		m, err := nixltest.Alloc(bsBlocks * bl)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = m.Free() })
		for b := 0; b < bsBlocks; b++ {
			for i := 0; i < bl; i++ {
				m.Bytes[b*bl+i] = bsByte(seed, l, b, i)
			}
		}
		out.mems = append(out.mems, m)
		layers = append(layers, LayerTensor{
			Name: fmt.Sprintf("model.layers.%d.self_attn.attn", l), DataPtr: m.Addr, StoragePtr: m.Addr, StorageBytes: uint64(bsBlocks * bl),
			ElemSize: 4, Shape: []int64{bsBlocks, bsHeads, blockSize, 2 * bsHeadDim},
			Stride: []int64{int64(bl / 4), blockSize * 2 * bsHeadDim, 2 * bsHeadDim, 1}, Device: "cpu",
		})
	}
	registerAndServe(t, s, w, eng, 0, &WorkerInit{Layers: layers, NumBlocks: bsBlocks, BlockSize: blockSize,
		AttnBackend: "CPU_ATTN", KVCacheLayout: "LBHNC", BlockReshape: reshape})
	out.side = &side{sched: s, work: w, port: port}
	return out
}

func (s *bsSide) block(l int, b int64) []byte {
	return s.mems[l].Bytes[int(b)*s.blockLen : int(b+1)*s.blockLen]
}

// bsRead has the decode read a prompt of tokens tokens, held by the prefill
// in pBlocks, into dBlocks after cached locally cached blocks; it returns
// what get_finished reported for the request.
func bsRead(t *testing.T, p, d *bsSide, req string, tokens int64, pBlocks, dBlocks []int64, cached int64) Finished {
	t.Helper()
	return bsReadParams(t, d, req, prefill(t, p.side, req+"-p", pBlocks, tokens), tokens, dBlocks, cached)
}

// bsReadParams is bsRead of params out.
func bsReadParams(t *testing.T, d *bsSide, req string, out []byte, tokens int64, dBlocks []int64, cached int64) Finished {
	t.Helper()
	dp := mustParams(t, string(out))
	d.sched.OnNewRequest(req, dp)
	d.sched.GetNumNewMatchedTokens(dp, tokens, cached*d.blockSize)
	if _, err := d.sched.UpdateStateAfterAlloc(req, dp, BlockIDs{dBlocks}, []int64{cached}, tokens-cached*d.blockSize); err != nil {
		t.Fatal(err)
	}
	d.step(t)
	return d.waitFinished(t, req, func(f Finished) bool { return contains(f.Recving, req) })
}

func TestSmallerPrefillBlocksAreReadAsSubBlocks(t *testing.T) {
	for _, c := range []struct {
		name             string
		pBS, dBS, tokens int64
		pBlocks, dBlocks []int64
		cached           int64
	}{
		// 11 tokens: three prefill blocks of 4 into two decode blocks of 8;
		// the second decode block's second half holds no prompt token.
		{"ratio 2", 4, 8, 11, []int64{3, 9, 5}, []int64{6, 1}, 0},
		// 16 tokens exactly: four blocks of 2 per decode block of 8.
		{"ratio 4", 2, 8, 16, []int64{1, 2, 3, 4, 12, 11, 10, 9}, []int64{7, 0}, 0},
		// 19 tokens, the first decode block a local prefix-cache hit: the
		// prefill's first two blocks are skipped.
		{"ratio 2 after a local hit", 4, 8, 19, []int64{3, 9, 5, 14, 2}, []int64{4, 8}, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			eng := nixltest.NewEngine("t")
			eng.SetScript(nixltest.Script{Polls: 1})
			p := newBSSide(t, eng, "kv_producer", "engine-p", c.pBS, 1, "head_major")
			d := newBSSide(t, eng, "kv_consumer", "engine-d", c.dBS, 100, "head_major")
			f := bsRead(t, p, d, "req", c.tokens, c.pBlocks, c.dBlocks, c.cached)
			if len(f.Failed) != 0 {
				t.Fatalf("failed: %+v", f)
			}
			n := int(c.dBS / c.pBS)
			read := c.pBlocks[c.cached*int64(n):]
			want := []BlockReshape{{Ratio: n, Blocks: c.dBlocks, Covered: len(read)}}
			if got := f.Reshape["req"]; fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("reshape %+v, want %+v", got, want)
			}
			sub := p.blockLen
			for l := 0; l < bsLayers; l++ {
				for k, db := range c.dBlocks {
					blk := d.block(l, db)
					for j := 0; j < n; j++ {
						got := blk[j*sub : (j+1)*sub]
						if idx := k*n + j; idx < len(read) {
							if !bytes.Equal(got, p.block(l, read[idx])) {
								t.Fatalf("layer %d decode block %d sub-block %d: not prefill block %d", l, db, j, read[idx])
							}
							continue
						}
						// Past the prompt: the READ leaves it alone (the
						// Python side zeroes it).
						for i, v := range got {
							if v != bsByte(100, l, int(db), j*sub+i) {
								t.Fatalf("layer %d decode block %d sub-block %d beyond the prompt was written", l, db, j)
							}
						}
					}
				}
				if d.block(l, 5)[0] != bsByte(100, l, 5, 0) {
					t.Fatalf("layer %d: block 5, outside the request, was written", l)
				}
			}
			p.waitFinished(t, "prefill frees", func(f Finished) bool { return contains(f.Sending, "req-p") })
		})
	}
}

func TestSmallerPrefillBlocksRefusals(t *testing.T) {
	eng := nixltest.NewEngine("t")
	eng.SetScript(nixltest.Script{Polls: 1})
	// A remote list that does not cover this prompt's blocks: 11 tokens
	// take two decode blocks of 8, but four prefill blocks of 4 take three
	// (a gonixl prefill trims its list to its tokens: forged params).
	p := newBSSide(t, eng, "kv_producer", "engine-p", 4, 1, "head_major")
	d := newBSSide(t, eng, "kv_consumer", "engine-d", 8, 100, "head_major")
	out := prefill(t, p.side, "req-p", []int64{3, 9, 5}, 11)
	if !strings.Contains(string(out), `"remote_block_ids":[[3,9,5]]`) {
		t.Fatalf("params %s", out)
	}
	f := bsReadParams(t, d, "req", []byte(strings.Replace(string(out), `[[3,9,5]]`, `[[3,9,5,6]]`, 1)), 11, []int64{6, 1}, 0)
	if !contains(f.Failed, "req") || len(f.Reshape) != 0 {
		t.Fatalf("a remote list of another prompt: %+v", f)
	}
	if d.block(0, 6)[0] != bsByte(100, 0, 6, 0) {
		t.Fatal("a refused request's block was written")
	}

	// A decode whose layout the Python side cannot rearrange, and a
	// prefill of a larger block size: refused at handshake (the messages:
	// TestHandshakeIdentityCheck), nothing read.
	for _, c := range []struct {
		name     string
		pBS, dBS int64
		reshape  string
	}{
		{"no reshape rule", 4, 8, ""},
		{"larger prefill blocks", 8, 4, "head_major"},
	} {
		t.Run(c.name, func(t *testing.T) {
			eng := nixltest.NewEngine("t")
			p := newBSSide(t, eng, "kv_producer", "engine-p", c.pBS, 1, c.reshape)
			d := newBSSide(t, eng, "kv_consumer", "engine-d", c.dBS, 100, c.reshape)
			tokens := min(c.pBS, c.dBS) * 2
			pb := make([]int64, tokens/c.pBS)
			db := make([]int64, tokens/c.dBS)
			for i := range pb {
				pb[i] = int64(i + 2)
			}
			for i := range db {
				db[i] = int64(i + 9)
			}
			f := bsRead(t, p, d, "req", tokens, pb, db, 0)
			if !contains(f.Failed, "req") {
				t.Fatalf("not failed: %+v", f)
			}
			if d.block(0, 9)[0] != bsByte(100, 0, 9, 0) {
				t.Fatal("a refused request's block was written")
			}
			for _, a := range eng.Agents() {
				if a.CountCalls("MakeXfer") != 0 {
					t.Fatal("a READ was prepared")
				}
			}
		})
	}
}
