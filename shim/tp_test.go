package shim

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/nixltest"
)

// A tensor-parallel engine in one process: a scheduler and one worker per
// rank, each rank's KV caches holding its share of the model's KV heads in
// the CPU backend's block layout [heads, tokens, 2*dim] (one region per
// layer), every head's bytes telling which (layer, block, head) they are.
type tpEngine struct {
	sched   *Scheduler
	workers []*Worker
	mems    [][]*nixltest.Mem // [rank][layer]
	heads   int               // KV heads per rank
	port    int
}

const (
	tpLayers    = 3
	tpBlocks    = 12
	tpHeadBytes = tBlockSize * 2 * tHeadDim * tElem // one head of one block
)

// headByte is what byte i of global head h of block b of layer l holds on
// an engine seeded with seed.
func headByte(seed byte, l, b, h, i int) byte {
	return seed + byte(l*61+b*7+h*29+i%5)
}

func newTPEngine(t *testing.T, eng nixl.Engine, kvRole, id string, tp, kvHeads int, seed byte, kind string, mode ...string) *tpEngine {
	t.Helper()
	port := freePort(t)
	cfg := func(role Role, rank int) *Config {
		c := testConfig(t, role, kvRole, id, port, nil)
		c.TPSize, c.TPRank = tp, rank
		c.CompatFactors["num_kv_heads"] = kvHeads
		if len(mode) > 0 {
			c.TransferMode = mode[0]
			if err := c.applyDefaults(); err != nil {
				t.Fatal(err)
			}
		}
		return c
	}
	s, err := NewScheduler(cfg(RoleScheduler, 0), nil)
	if err != nil {
		t.Fatal(err)
	}
	te := &tpEngine{sched: s, heads: max(1, kvHeads/tp), port: port}
	if kind == LayerKindMLA {
		te.heads = 1
	}
	t.Cleanup(func() {
		for _, w := range te.workers {
			_ = w.Close()
		}
		_ = s.Close()
	})
	blockLen := te.heads * tpHeadBytes
	for r := 0; r < tp; r++ {
		w, err := NewWorker(cfg(RoleWorker, r), nil)
		if err != nil {
			t.Fatal(err)
		}
		w.engineOverride = eng
		te.workers = append(te.workers, w)
		var layers []LayerTensor
		var mems []*nixltest.Mem
		for l := 0; l < tpLayers; l++ {
			m, err := nixltest.Alloc(tpBlocks * blockLen)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = m.Free() })
			for b := 0; b < tpBlocks; b++ {
				for k := 0; k < te.heads; k++ {
					h := r*te.heads + k // the global head this rank holds
					if tp > kvHeads {
						h = r * kvHeads / tp
					}
					if kind == LayerKindMLA {
						h = 0
					}
					for i := 0; i < tpHeadBytes; i++ {
						m.Bytes[b*blockLen+k*tpHeadBytes+i] = headByte(seed, l, b, h, i)
					}
				}
			}
			mems = append(mems, m)
			shape := []int64{tpBlocks, int64(te.heads), tBlockSize, 2 * tHeadDim}
			stride := []int64{int64(te.heads) * tBlockSize * 2 * tHeadDim, tBlockSize * 2 * tHeadDim, 2 * tHeadDim, 1}
			layers = append(layers, LayerTensor{
				Name: fmt.Sprintf("model.layers.%d.self_attn", l), DataPtr: m.Addr, StoragePtr: m.Addr, StorageBytes: uint64(tpBlocks * blockLen),
				ElemSize: tElem, Shape: shape, Stride: stride, Device: "cpu", Kind: kind,
			})
		}
		te.mems = append(te.mems, mems)
		if err := w.RegisterKVCaches(&WorkerInit{Layers: layers, NumBlocks: tpBlocks, BlockSize: tBlockSize, AttnBackend: "CPU_ATTN", KVCacheLayout: "LBHNC"}); err != nil {
			t.Fatal(err)
		}
		payload, err := w.HandshakePayload()
		if err != nil {
			t.Fatal(err)
		}
		if err := s.SetHandshakePayload(0, r, payload); err != nil {
			t.Fatal(err)
		}
	}
	return te
}

// step feeds one step's metadata to every rank, as vLLM does.
func (te *tpEngine) step(t *testing.T) {
	t.Helper()
	b, err := te.sched.BuildMeta()
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range te.workers {
		if err := w.StartLoadKV(b); err != nil {
			t.Fatal(err)
		}
	}
}

func (te *tpEngine) side(r int) *side { return &side{sched: te.sched, work: te.workers[r]} }

// tpTransfer runs one request from a prefill of TP pTP to a decode of TP
// dTP and checks every byte of every head of every block on every decode
// rank, and that every prefill rank frees the request.
func tpTransfer(t *testing.T, eng nixl.Engine, pTP, dTP, kvHeads int, kind string) {
	p := newTPEngine(t, eng, "kv_producer", "engine-p", pTP, kvHeads, 1, kind)
	d := newTPEngine(t, eng, "kv_consumer", "engine-d", dTP, kvHeads, 100, kind)

	pBlocks, dBlocks := []int64{3, 4, 9}, []int64{7, 2, 11}
	in := mustParams(t, `{"do_remote_decode": true, "do_remote_prefill": false}`)
	p.sched.GetNumNewMatchedTokens(in, 12, 0)
	if _, err := p.sched.UpdateStateAfterAlloc("req-p", in, nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	p.step(t)
	_, out, err := p.sched.RequestFinished("req-p", in, true, 12, BlockIDs{pBlocks})
	if err != nil || out == nil {
		t.Fatalf("request_finished: %v", err)
	}
	p.step(t)
	dp := mustParams(t, string(out))
	if dp.TPSize != pTP {
		t.Fatalf("kv_transfer_params tp_size %d, want %d", dp.TPSize, pTP)
	}
	d.sched.OnNewRequest("req-d", dp)
	if n, async := d.sched.GetNumNewMatchedTokens(dp, 12, 0); n != 12 || !async {
		t.Fatalf("matched %d async %v", n, async)
	}
	if _, err := d.sched.UpdateStateAfterAlloc("req-d", dp, BlockIDs{dBlocks}, []int64{0}, 12); err != nil {
		t.Fatal(err)
	}
	d.step(t)
	for r := range d.workers {
		f := d.side(r).waitFinished(t, fmt.Sprintf("decode rank %d recv", r), func(f Finished) bool { return contains(f.Recving, "req-d") })
		if len(f.Failed) != 0 {
			t.Fatalf("decode rank %d failed: %v", r, f.Failed)
		}
	}
	for r := range d.workers {
		for l := 0; l < tpLayers; l++ {
			mem := d.mems[r][l].Bytes
			blockLen := d.heads * tpHeadBytes
			for i, db := range dBlocks {
				for k := 0; k < d.heads; k++ {
					h := r*d.heads + k
					if dTP > kvHeads {
						h = r * kvHeads / dTP
					}
					if kind == LayerKindMLA {
						h = 0
					}
					got := mem[int(db)*blockLen+k*tpHeadBytes : int(db)*blockLen+(k+1)*tpHeadBytes]
					want := make([]byte, tpHeadBytes)
					for j := range want {
						want[j] = headByte(1, l, int(pBlocks[i]), h, j)
					}
					if !bytes.Equal(got, want) {
						t.Fatalf("decode rank %d layer %d block %d head slot %d (global head %d): got %v…, want %v…", r, l, db, k, h, got[:6], want[:6])
					}
				}
			}
			// A block outside the request is untouched.
			if mem[5*blockLen] != headByte(100, l, 5, r*d.heads, 0) && kind != LayerKindMLA && dTP <= kvHeads {
				t.Fatalf("decode rank %d layer %d: block 5 was overwritten", r, l)
			}
		}
	}
	for r := range p.workers {
		p.side(r).waitFinished(t, fmt.Sprintf("prefill rank %d frees", r), func(f Finished) bool { return contains(f.Sending, "req-p") })
	}
}

func TestTensorParallelTransfers(t *testing.T) {
	for _, c := range []struct {
		p, d, heads int
		kind        string
	}{
		{2, 2, 2, ""}, // same TP: rank r reads rank r
		{1, 2, 2, ""}, // decode ranks read head slices of one prefill rank
		{1, 2, 4, ""}, // two heads per decode rank
		{1, 4, 2, ""}, // decode replicates heads (TP > KV heads)
		{1, 2, 1, ""}, // one KV head, both decode ranks read it whole
		{2, 1, 2, ""}, // decode rank reads from two prefill ranks into slots
		{4, 2, 4, ""}, // two slots from two prefill ranks per decode rank
		{2, 1, 1, ""}, // prefill replicates its one head: read rank 0, notify rank 1
		{4, 1, 2, ""}, // prefill replicates: two distinct heads of four ranks
		{2, 1, 1, LayerKindMLA},
		{1, 2, 1, LayerKindMLA},
	} {
		t.Run(fmt.Sprintf("P%d-D%d-heads%d%s", c.p, c.d, c.heads, c.kind), func(t *testing.T) {
			eng := nixltest.NewEngine("t")
			eng.SetScript(nixltest.Script{Polls: 1})
			tpTransfer(t, eng, c.p, c.d, c.heads, c.kind)
		})
	}
}

// TestFirstContactDoesNotStallOtherReads: while the descriptor lists for a
// new prefill engine are being prepared (held here for as long as the test
// likes), a READ from another engine completes, and the worker's calls
// from vLLM's model thread (start_load_kv, get_finished) return at once.
func TestFirstContactDoesNotStallOtherReads(t *testing.T) {
	eng := nixltest.NewEngine("t")
	gate, entered := make(chan struct{}), make(chan struct{}, 1)
	eng.SetScript(nixltest.Script{Polls: 20, PrepHook: func(remote string, n int) {
		if strings.HasPrefix(remote, "engine-p2-") {
			entered <- struct{}{}
			<-gate
		}
	}})
	p1 := newSide(t, eng, "kv_producer", "engine-p1", nil, 1, nil)
	p2 := newSide(t, eng, "kv_producer", "engine-p2", nil, 50, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	defer func() {
		select {
		case <-gate:
		default:
			close(gate)
		}
	}()

	load := func(p *side, preq, dreq string, pb, db []int64) { loadFrom(t, d, p, preq, dreq, pb, db) }
	// Engine p1 is known and its READ in flight (20 polls to complete).
	load(p1, "req-1", "req-a", []int64{1, 2, 3}, []int64{4, 5, 6})
	deadline := time.Now().Add(5 * time.Second)
	for {
		d.work.mu.Lock()
		st := d.work.recv["req-a"]
		posted := st != nil && len(st.xfers) > 0
		d.work.mu.Unlock()
		if posted {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("READ from engine-p1 never posted")
		}
		time.Sleep(time.Millisecond)
	}
	// First contact with p2: its preparation is held at the gate.
	load(p2, "req-2", "req-b", []int64{7, 8, 9}, []int64{10, 11, 12})
	select {
	case <-entered:
	case <-time.After(5 * time.Second):
		t.Fatal("engine-p2's descriptor preparation never started")
	}
	start := time.Now()
	// Run on another goroutine: a worker that held its lock across the
	// preparation would block these calls until the gate opens.
	done := make(chan Finished, 1)
	go func() {
		f := d.waitFinished(t, "req-a while engine-p2 is being prepared", func(f Finished) bool { return contains(f.Recving, "req-a") })
		d.step(t) // start_load_kv returns while the preparation is held
		done <- f
	}()
	var f Finished
	select {
	case f = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("get_finished/start_load_kv blocked while another engine's descriptor lists were being prepared")
	}
	if contains(f.Recving, "req-b") || len(f.Failed) != 0 {
		t.Fatalf("unexpected %+v", f)
	}
	t.Logf("req-a finished %v after engine-p2's preparation was held", time.Since(start))
	close(gate)
	d.waitFinished(t, "req-b after the gate opened", func(f Finished) bool { return contains(f.Recving, "req-b") })
	for i := 0; i < 3; i++ {
		if !bytes.Equal(d.kv.block(0, 0, 10+i), p2.kv.block(0, 0, 7+i)) {
			t.Fatalf("req-b block %d not transferred", i)
		}
	}
}
