package shim

import (
	"encoding/binary"
	"fmt"
	"math/rand"
	"reflect"
	"testing"
)

// opEnc builds a scheduler batch as the Python binding does
// (pybridge/gonixl/engine.py; include/gonixl.h "Scheduler batches").
type opEnc struct {
	b     []byte
	n     int
	start int // where the open op's length goes
}

// begin opens an op of kind; end writes its body's length.
func (e *opEnc) begin(kind byte) {
	e.b = append(e.b, kind, 0, 0, 0, 0)
	e.start = len(e.b) - 4
}

func (e *opEnc) end() {
	binary.LittleEndian.PutUint32(e.b[e.start:], uint32(len(e.b)-e.start-4))
	e.n++
}

func (e *opEnc) str(s string) {
	e.b = binary.LittleEndian.AppendUint32(e.b, uint32(len(s)))
	e.b = append(e.b, s...)
}

func (e *opEnc) i64s(v []int64) {
	e.b = binary.LittleEndian.AppendUint32(e.b, uint32(len(v)))
	for _, x := range v {
		e.b = binary.LittleEndian.AppendUint64(e.b, uint64(x))
	}
}

func (e *opEnc) groups(g BlockIDs) {
	e.b = binary.LittleEndian.AppendUint32(e.b, uint32(len(g)))
	for _, x := range g {
		e.i64s(x)
	}
}

func (e *opEnc) onNew(id, params string) {
	e.begin(opOnNewRequest)
	e.str(id)
	e.str(params)
	e.end()
}

func (e *opEnc) alloc(id, params string, blocks BlockIDs, computed []int64, ext int64) {
	e.begin(opUpdateStateAfterAlloc)
	e.str(id)
	e.str(params)
	e.groups(blocks)
	e.i64s(computed)
	e.b = binary.LittleEndian.AppendUint64(e.b, uint64(ext))
	e.end()
}

func (e *opEnc) finished(id, params string, normal bool, computed int64, blocks BlockIDs) {
	e.begin(opRequestFinished)
	e.str(id)
	e.str(params)
	if normal {
		e.b = append(e.b, 1)
	} else {
		e.b = append(e.b, 0)
	}
	e.b = binary.LittleEndian.AppendUint64(e.b, uint64(computed))
	e.groups(blocks)
	e.end()
}

func (e *opEnc) recvd(ids ...string) {
	e.begin(opUpdateConnectorOutput)
	e.b = binary.LittleEndian.AppendUint32(e.b, uint32(len(ids)))
	for _, id := range ids {
		e.str(id)
	}
	e.end()
}

func decodeParams(i int) string {
	return fmt.Sprintf(`{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[%d, %d]],
		"remote_engine_id": "prefill-%d", "remote_request_id": "p%d", "remote_host": "127.0.0.1", "remote_port": 5600,
		"remote_num_tokens": 64, "tp_size": 1}`, 10+i, 20+i, i%2, i)
}

// TestApplyOpsEqualsSingleCalls: a decode's per-request calls applied as
// one batch leave the scheduler exactly as the single calls do (same step
// metadata, same live counts, same idle time), for random interleavings of
// new requests, allocations, aborts before and after the load and
// completions.
func TestApplyOpsEqualsSingleCalls(t *testing.T) {
	fzQuiet()
	for seed := int64(1); seed <= 50; seed++ {
		rng := rand.New(rand.NewSource(seed))
		clk := NewFakeClock(100)
		mk := func() *Scheduler {
			s, err := NewScheduler(fzConfig(t, RoleScheduler, "kv_consumer", nil, nil), clk.Now)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = s.Close() })
			return s
		}
		single, batched := mk(), mk()
		for step := 0; step < 6; step++ {
			var enc opEnc
			for k := rng.Intn(6); k >= 0; k-- {
				i := rng.Intn(8)
				id, pj := fmt.Sprintf("d%d", i), decodeParams(i)
				p, err := ParseTransferParams([]byte(pj))
				if err != nil {
					t.Fatal(err)
				}
				blocks := BlockIDs{{int64(2*i + 1), int64(2*i + 2)}}
				switch rng.Intn(4) {
				case 0:
					single.OnNewRequest(id, p)
					enc.onNew(id, pj)
				case 1:
					m, err := single.UpdateStateAfterAlloc(id, p, blocks, []int64{0}, 64)
					if err != nil || !m {
						t.Fatalf("seed %d: update_state_after_alloc: %v %v", seed, m, err)
					}
					enc.alloc(id, pj, blocks, []int64{0}, 64)
				case 2:
					normal := rng.Intn(2) == 0
					if _, _, err := single.RequestFinished(id, p, normal, 64, blocks); err != nil {
						t.Fatal(err)
					}
					enc.finished(id, pj, normal, 64, blocks)
				case 3:
					single.UpdateConnectorOutput([]string{id})
					enc.recvd(id)
				}
			}
			res := make([]byte, enc.n)
			if err := batched.ApplyOps(enc.b, res); err != nil {
				t.Fatalf("seed %d: %v", seed, err)
			}
			for i, r := range res {
				if r&OpInvalid != 0 {
					t.Fatalf("seed %d: op %d refused", seed, i)
				}
			}
			clk.Advance(rng.Float64() * 10)
			if a, b := single.Live(), batched.Live(); a != b {
				t.Fatalf("seed %d step %d: live %+v single, %+v batched", seed, step, a, b)
			}
			if a, b := single.IdleFor(), batched.IdleFor(); a != b {
				t.Fatalf("seed %d step %d: idle_for %v single, %v batched", seed, step, a, b)
			}
			ma, err := single.BuildMetaOrIdle()
			if err != nil {
				t.Fatal(err)
			}
			mb, err := batched.BuildMetaOrIdle()
			if err != nil {
				t.Fatal(err)
			}
			if (ma == nil) != (mb == nil) {
				t.Fatalf("seed %d step %d: idle %v single, %v batched", seed, step, ma == nil, mb == nil)
			}
			if ma == nil {
				continue
			}
			da, err := DecodeStepMeta(ma)
			if err != nil {
				t.Fatal(err)
			}
			db, err := DecodeStepMeta(mb)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(da, db) {
				t.Fatalf("seed %d step %d: step metadata differs:\nsingle  %+v\nbatched %+v", seed, step, da, db)
			}
		}
	}
}

// TestApplyOpsMutatedAndRefused: each op's result byte says what the
// single call would have answered; params the library refuses mark their
// op and leave the others applied; a request_finished whose answer could
// hold blocks is refused (vLLM, told nothing, frees them).
func TestApplyOpsMutatedAndRefused(t *testing.T) {
	fzQuiet()
	s, err := NewScheduler(fzConfig(t, RoleScheduler, "kv_consumer", nil, nil), NewFakeClock(100).Now)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Close() }()
	var enc opEnc
	enc.alloc("ok", decodeParams(1), BlockIDs{{1, 2}}, []int64{0}, 64)
	enc.alloc("bad-json", `{"do_remote_prefill": tru`, BlockIDs{{3}}, []int64{0}, 64)
	enc.alloc("no-remote", `{"do_remote_prefill": false}`, BlockIDs{{4}}, []int64{0}, 0)
	enc.finished("holding", `{"do_remote_decode": true, "do_remote_prefill": false}`, true, 64, BlockIDs{{5, 6}})
	enc.onNew("plain", "")
	res := make([]byte, enc.n)
	if err := s.ApplyOps(enc.b, res); err != nil {
		t.Fatal(err)
	}
	if want := []byte{OpMutated, OpInvalid, 0, OpInvalid, 0}; !reflect.DeepEqual(res, want) {
		t.Fatalf("results %v, want %v", res, want)
	}
	if l := s.Live(); l.AwaitingKV != 1 || l.SendPending != 0 {
		t.Fatalf("live %+v: want the one valid READ awaited and nothing held", l)
	}
}

// TestApplyOpsMalformed: an op whose body does not decode (cut anywhere
// inside, an unknown kind, a count past its end, a negative block id, bytes
// left over) is refused alone, the ops around it applied; a batch whose
// framing does not hold (an op longer than the bytes left) or that holds
// another number of ops than results applies nothing.
func TestApplyOpsMalformed(t *testing.T) {
	fzQuiet()
	newSched := func() *Scheduler {
		s, err := NewScheduler(fzConfig(t, RoleScheduler, "kv_consumer", nil, nil), NewFakeClock(100).Now)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		return s
	}
	var good opEnc
	good.alloc("a", decodeParams(1), BlockIDs{{1, 2}}, []int64{0}, 64)
	body := good.b[5:]
	bad := map[string][]byte{"unknown kind": append([]byte{9}, good.b[1:]...)}
	for cut := 0; cut < len(body); cut++ {
		op := append([]byte{opUpdateStateAfterAlloc, 0, 0, 0, 0}, body[:cut]...)
		binary.LittleEndian.PutUint32(op[1:], uint32(cut))
		bad[fmt.Sprintf("body cut at %d", cut)] = op
	}
	long := append([]byte{opUpdateStateAfterAlloc, 0, 0, 0, 0}, body...)
	long = append(long, 7)
	binary.LittleEndian.PutUint32(long[1:], uint32(len(body)+1))
	bad["a byte left over"] = long
	var neg opEnc
	neg.alloc("a", decodeParams(1), BlockIDs{{1, -2}}, []int64{0}, 64)
	bad["negative block id"] = neg.b
	// The block count of the one group (40 bytes from the end: that count,
	// its 2 ids, the num_computed count and value, num_external).
	huge := append([]byte{}, good.b...)
	binary.LittleEndian.PutUint32(huge[len(huge)-40:], 0x7fffffff)
	bad["count past the end"] = huge
	for name, op := range bad {
		s := newSched()
		var before, after opEnc
		before.onNew("x", decodeParams(2))
		after.alloc("y", decodeParams(3), BlockIDs{{5, 6}}, []int64{0}, 64)
		batch := append(append(append([]byte{}, before.b...), op...), after.b...)
		res := make([]byte, 3)
		if err := s.ApplyOps(batch, res); err != nil {
			t.Errorf("%s: the batch was refused: %v", name, err)
			continue
		}
		if res[0] != 0 || res[1] != OpInvalid || res[2] != OpMutated {
			t.Errorf("%s: results %v, want [0 %d %d]", name, res, OpInvalid, OpMutated)
		}
		if l := s.Live(); l.AwaitingKV != 1 || l.HeartbeatLeases != 1 {
			t.Errorf("%s: the ops around it not applied: %+v", name, l)
		}
	}
	for name, c := range map[string]struct {
		batch []byte
		n     int
	}{
		"an op longer than the batch": {good.b[:len(good.b)-1], 1},
		"a header cut short":          {append(append([]byte{}, good.b...), 2, 0), 2},
		"3 results for 1 op":          {good.b, 3},
	} {
		s := newSched()
		res := []byte{0xff, 0xff, 0xff}[:c.n]
		if err := s.ApplyOps(c.batch, res); err == nil {
			t.Errorf("%s: accepted", name)
		}
		if l := s.Live(); l.AwaitingKV != 0 || l.HeartbeatLeases != 0 {
			t.Errorf("%s: refused but applied: %+v", name, l)
		}
		for _, r := range res {
			if r != 0xff {
				t.Errorf("%s: a result written: %v", name, res)
			}
		}
	}
}

// FuzzApplyOps: any bytes as a scheduler batch: an error or ops applied,
// never a panic.
func FuzzApplyOps(f *testing.F) {
	fzQuiet()
	var enc opEnc
	enc.onNew("a", decodeParams(1))
	enc.alloc("a", decodeParams(1), BlockIDs{{1, 2}}, []int64{0}, 64)
	enc.finished("b", decodeParams(2), false, 0, BlockIDs{{3}})
	enc.recvd("a", "c")
	f.Add(enc.b, uint8(4))
	f.Add([]byte{4, 0, 0, 0, 0}, uint8(1))
	f.Fuzz(func(t *testing.T, b []byte, n uint8) {
		s, err := NewScheduler(fzConfig(t, RoleScheduler, "kv_consumer", nil, nil), NewFakeClock(100).Now)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = s.Close() }()
		if err := s.ApplyOps(b, make([]byte, n)); err == nil {
			if _, err := s.BuildMeta(); err != nil {
				t.Fatal(err)
			}
		}
	})
}

// BenchmarkStepBatch: a decode step's per-request scheduler work for 8 new
// requests (on_new_request + update_state_after_alloc), as single calls
// and as one batch; the crossing the batch saves is not in these numbers
// (tests/python measure it through the binding).
func BenchmarkStepBatch(b *testing.B) {
	fzQuiet()
	var enc opEnc
	var ps []*TransferParams
	for i := 0; i < 8; i++ {
		enc.onNew(fmt.Sprintf("d%d", i), decodeParams(i))
		enc.alloc(fmt.Sprintf("d%d", i), decodeParams(i), BlockIDs{{int64(2*i + 1), int64(2*i + 2)}}, []int64{0}, 64)
		p, err := ParseTransferParams([]byte(decodeParams(i)))
		if err != nil {
			b.Fatal(err)
		}
		ps = append(ps, p)
	}
	s, err := NewScheduler(fzConfig(b, RoleScheduler, "kv_consumer", nil, nil), NewFakeClock(100).Now)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = s.Close() }()
	b.Run("single", func(b *testing.B) {
		for range b.N {
			for i, p := range ps {
				id := fmt.Sprintf("d%d", i)
				s.OnNewRequest(id, p)
				if _, err := s.UpdateStateAfterAlloc(id, p, BlockIDs{{int64(2*i + 1), int64(2*i + 2)}}, []int64{0}, 64); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
	b.Run("batch", func(b *testing.B) {
		res := make([]byte, enc.n)
		for range b.N {
			if err := s.ApplyOps(enc.b, res); err != nil {
				b.Fatal(err)
			}
		}
	})
}
