package shim

import (
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/nixl/nixltest"
)

// inPlaceEngine hands out the engine's agents without nixl.PostCopies (the
// one capability besides ControlBusy that the NIXL engine has): the worker
// then posts on the caller's thread, as before shim/post.go.
type inPlaceEngine struct{ nixl.Engine }

func (e inPlaceEngine) NewAgent(c nixl.AgentConfig) (nixl.Agent, error) {
	a, err := e.Engine.NewAgent(c)
	if err != nil {
		return nil, err
	}
	return inPlaceAgent{a}, nil
}

type inPlaceAgent struct{ nixl.Agent }

func (a inPlaceAgent) ControlBusy() bool {
	cb, ok := a.Agent.(nixl.ControlBusy)
	return ok && cb.ControlBusy()
}

// BenchmarkStartLoadKVOverNIXL times vLLM's start_load_kv on a decode
// whose READ is 14 MiB (112 blocks × 4 layers × K and V of 16 KiB) from a
// prefill in this process, through real NIXL: with the poster (the READ
// posted on the worker's goroutine) and in place (NIXL's Post, which
// copies, on the caller's thread). Reported: start_load_kv's median and
// worst, and the median from start_load_kv to finished_recving, polled
// every 0.5 ms (vLLM polls once per engine step, which takes longer).
// VIRTUAL_ENV=.venv go test -run XXX -bench StartLoadKVOverNIXL ./shim
func BenchmarkStartLoadKVOverNIXL(b *testing.B) {
	eng, err := nixl.Lookup("nixl")
	if err != nil {
		b.Skipf("built without cgo: %v", err)
	}
	if err := eng.Available(); err != nil {
		b.Fatalf("NIXL does not load (the nixl wheel in .venv, or NIXL_LIB_DIR): %v", err)
	}
	for _, c := range []struct {
		name string
		eng  nixl.Engine
	}{{"poster", eng}, {"in-place", inPlaceEngine{eng}}} {
		b.Run(c.name, func(b *testing.B) { benchStartLoadKV(b, c.eng) })
	}
}

func benchStartLoadKV(b *testing.B, eng nixl.Engine) {
	old := logger
	Logger()
	logger = zap.NewNop()
	b.Cleanup(func() { logger = old })
	const (
		layers, heads, bs, hd, elem = 4, 2, 16, 128, 4
		numBlocks, reqBlocks        = 128, 112
	)
	mk := func(kvRole, id string, fill byte) *side {
		port := freePortB(b)
		conf := func(role Role) *Config {
			raw := map[string]any{"role": role, "kv_role": kvRole, "engine_id": id, "side_channel_host": "127.0.0.1",
				"side_channel_port": port, "block_size": bs, "transfer_engine": eng.Name(),
				"compat_factors": map[string]any{"model": "bench", "dtype": "torch.float32", "num_kv_heads": heads}}
			js, _ := json.Marshal(raw)
			cfg, err := ParseConfig(js)
			if err != nil {
				b.Fatal(err)
			}
			return cfg
		}
		s, err := NewScheduler(conf(RoleScheduler), nil)
		if err != nil {
			b.Fatal(err)
		}
		w, err := NewWorker(conf(RoleWorker), nil)
		if err != nil {
			b.Fatal(err)
		}
		per := 2 * numBlocks * heads * bs * hd * elem
		var ls []LayerTensor
		for l := 0; l < layers; l++ {
			m, err := nixltest.Alloc(per)
			if err != nil {
				b.Fatal(err)
			}
			for i := range m.Bytes {
				m.Bytes[i] = fill + byte(i)
			}
			b.Cleanup(func() { _ = m.Free() })
			ls = append(ls, LayerTensor{Name: fmt.Sprintf("model.layers.%d.self_attn", l), DataPtr: m.Addr, StoragePtr: m.Addr,
				StorageBytes: uint64(per), ElemSize: elem, Shape: []int64{2, numBlocks, heads, bs, hd},
				Stride: []int64{numBlocks * heads * bs * hd, heads * bs * hd, bs * hd, hd, 1}, Device: "cpu"})
		}
		b.Cleanup(func() { _ = w.Close(); _ = s.Close() })
		w.engineOverride = eng
		if err := w.RegisterKVCaches(&WorkerInit{Layers: ls, NumBlocks: numBlocks, BlockSize: bs, AttnBackend: "CPU_ATTN", KVCacheLayout: "LBHNC"}); err != nil {
			b.Fatal(err)
		}
		payload, err := w.HandshakePayload()
		if err != nil {
			b.Fatal(err)
		}
		if err := s.SetHandshakePayload(0, 0, payload); err != nil {
			b.Fatal(err)
		}
		return &side{sched: s, work: w, port: port}
	}
	p, d := mk("kv_producer", "engine-p", 1), mk("kv_consumer", "engine-d", 100)
	step := func(sd *side) []byte {
		meta, err := sd.sched.BuildMeta()
		if err != nil {
			b.Fatal(err)
		}
		return meta
	}
	blocks := make([]int64, reqBlocks)
	for i := range blocks {
		blocks[i] = int64(i)
	}
	tokens := int64(reqBlocks * bs)
	var loads, dones []time.Duration
	one := func(i int) (load, done time.Duration) {
		pid, did := fmt.Sprintf("req-p-%d", i), fmt.Sprintf("req-d-%d", i)
		in, _ := ParseTransferParams([]byte(`{"do_remote_decode": true, "do_remote_prefill": false}`))
		p.sched.GetNumNewMatchedTokens(in, tokens, 0)
		if _, err := p.sched.UpdateStateAfterAlloc(pid, in, nil, []int64{0}, 0); err != nil {
			b.Fatal(err)
		}
		if err := p.work.StartLoadKV(step(p)); err != nil {
			b.Fatal(err)
		}
		_, out, err := p.sched.RequestFinished(pid, in, true, tokens, BlockIDs{blocks})
		if err != nil || out == nil {
			b.Fatalf("request_finished: %v", err)
		}
		if err := p.work.StartLoadKV(step(p)); err != nil {
			b.Fatal(err)
		}
		dp, err := ParseTransferParams(out)
		if err != nil {
			b.Fatal(err)
		}
		d.sched.OnNewRequest(did, dp)
		d.sched.GetNumNewMatchedTokens(dp, tokens, 0)
		if _, err := d.sched.UpdateStateAfterAlloc(did, dp, BlockIDs{blocks}, []int64{0}, tokens); err != nil {
			b.Fatal(err)
		}
		meta := step(d)
		t0 := time.Now()
		if err := d.work.StartLoadKV(meta); err != nil {
			b.Fatal(err)
		}
		load = time.Since(t0)
		for deadline := t0.Add(30 * time.Second); ; {
			f := d.work.Poll()
			if len(f.Failed) != 0 {
				b.Fatalf("READ failed: %+v", f)
			}
			if slices.Contains(f.Recving, did) {
				break
			}
			if time.Now().After(deadline) {
				b.Fatal("READ did not finish")
			}
			time.Sleep(500 * time.Microsecond)
		}
		done = time.Since(t0)
		d.sched.UpdateConnectorOutput([]string{did})
		for deadline := time.Now().Add(30 * time.Second); ; {
			if slices.Contains(p.work.Poll().Sending, pid) {
				break
			}
			if time.Now().After(deadline) {
				b.Fatal("prefill did not free its blocks")
			}
			time.Sleep(500 * time.Microsecond)
		}
		p.sched.UpdateConnectorOutput(nil)
		return load, done
	}
	one(-1) // the handshake; its READ is posted when it ends
	b.SetBytes(int64(reqBlocks * layers * 2 * heads * bs * hd * elem))
	i := 0
	for b.Loop() {
		l, dn := one(i)
		loads, dones = append(loads, l), append(dones, dn)
		i++
	}
	slices.Sort(loads)
	slices.Sort(dones)
	b.ReportMetric(float64(loads[len(loads)/2].Microseconds()), "start_load_kv-µs")
	b.ReportMetric(float64(loads[len(loads)-1].Microseconds()), "start_load_kv-max-µs")
	b.ReportMetric(float64(dones[len(dones)/2].Microseconds()), "recv-µs")
}

// freePortB is freePort for a benchmark.
func freePortB(b *testing.B) int {
	b.Helper()
	return freePortRun(b, 1)
}
