package shim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gonixl/gonixl/nixl/nixltest"
)

// pushPair builds a push-mode prefill and decode on one fake engine.
func pushPair(t *testing.T, clock *FakeClock, extra map[string]any, script ...nixltest.Script) (*nixltest.Engine, *side, *side) {
	t.Helper()
	eng := nixltest.NewEngine("t")
	for _, sc := range script {
		eng.SetScript(sc) // before the agents exist: each takes the script it is created with
	}
	x := map[string]any{"transfer_mode": "push"}
	for k, v := range extra {
		x[k] = v
	}
	var now Clock
	if clock != nil {
		now = clock.Now
	}
	p := newPushSide(t, eng, "kv_producer", "engine-p", now, 1, x)
	d := newPushSide(t, eng, "kv_consumer", "engine-d", now, 200, x)
	return eng, p, d
}

// newPushSide is newSide with transfer_mode push in the top-level config.
func newPushSide(t *testing.T, eng *nixltest.Engine, kvRole, id string, clock Clock, fill byte, extra map[string]any) *side {
	t.Helper()
	mode, _ := extra["transfer_mode"].(string)
	x := map[string]any{}
	for k, v := range extra {
		if k != "transfer_mode" {
			x[k] = v
		}
	}
	port := freePort(t)
	mk := func(role Role) *Config {
		c := testConfig(t, role, kvRole, id, port, x)
		c.TransferMode = mode
		if err := c.applyDefaults(); err != nil {
			t.Fatal(err)
		}
		return c
	}
	s, err := NewScheduler(mk(RoleScheduler), clock)
	if err != nil {
		t.Fatal(err)
	}
	w, err := NewWorker(mk(RoleWorker), clock)
	if err != nil {
		t.Fatal(err)
	}
	km := newKVMem(t, fill)
	registerAndServe(t, s, w, eng, 0, initFor(km))
	return &side{sched: s, work: w, kv: km, port: port}
}

// pushPrefill runs a prefill request to request_finished in push mode.
func pushPrefill(t *testing.T, p *side, reqID string, blocks []int64, numTokens int64, digest ...string) map[string]any {
	t.Helper()
	in := mustParams(t, `{"do_remote_decode": true}`)
	if len(digest) > 0 {
		in = mustParams(t, `{"do_remote_decode": true, "gonixl_prompt_digest": "`+digest[0]+`"}`)
	}
	if _, err := p.sched.UpdateStateAfterAlloc(reqID, in, nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	p.step(t)
	delay, out, err := p.sched.RequestFinished(reqID, in, true, numTokens, BlockIDs{blocks})
	if err != nil || !delay || out == nil {
		t.Fatalf("request_finished: delay=%v out=%s err=%v", delay, out, err)
	}
	var got map[string]any
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatal(err)
	}
	p.step(t)
	return got
}

// pushDecode schedules a decode request in push mode: it registers local.
func pushDecode(t *testing.T, d, p *side, reqID, remoteReqID string, prompt int64, local []int64, cached []int64, digest ...string) {
	t.Helper()
	params := map[string]any{"do_remote_prefill": true, "remote_engine_id": "engine-p", "remote_host": "127.0.0.1",
		"remote_port": p.port, "tp_size": 1, "remote_request_id": remoteReqID}
	if len(digest) > 0 {
		params["gonixl_prompt_digest"] = digest[0]
	}
	js, _ := json.Marshal(params)
	dp := mustParams(t, string(js))
	computed := int64(len(cached)) * tBlockSize
	n, async := d.sched.GetNumNewMatchedTokens(dp, prompt, computed)
	if n != prompt-computed || !async {
		t.Fatalf("decode matched %d async=%v, want %d true", n, async, prompt-computed)
	}
	mut, err := d.sched.UpdateStateAfterAlloc(reqID, dp, BlockIDs{local}, []int64{int64(len(cached))}, n)
	if err != nil || !mut {
		t.Fatalf("update_state_after_alloc: %v %v", mut, err)
	}
	d.step(t)
}

func checkBlocks(t *testing.T, d, p *side, dblocks, pblocks []int64) {
	t.Helper()
	for l := 0; l < tLayers; l++ {
		for kv := 0; kv < 2; kv++ {
			for i := range dblocks {
				if !bytes.Equal(d.kv.block(l, kv, int(dblocks[i])), p.kv.block(l, kv, int(pblocks[i]))) {
					t.Fatalf("layer %d kv %d: decode block %d != prefill block %d", l, kv, dblocks[i], pblocks[i])
				}
			}
		}
	}
}

// Both orders of vLLM's race: the decode's registration before the
// prefill finished, and after. The prefill WRITEs exactly the registered
// blocks (the tail of its list after a prefix hit on the decode), the
// decode finishes on the WRITE's notification, the prefill frees its
// blocks when the WRITE completed.
func TestPushBothOrders(t *testing.T) {
	for _, regFirst := range []bool{true, false} {
		t.Run(map[bool]string{true: "registration first", false: "prefill first"}[regFirst], func(t *testing.T) {
			_, p, d := pushPair(t, nil, nil)
			// vLLM's ids: the client's id plus "-<8 hex>" on each side.
			pid, did := "cmpl-x-0-aaaaaaaa", "cmpl-x-0-bbbbbbbb"
			var params map[string]any
			if regFirst {
				pushDecode(t, d, p, did, "cmpl-x-0", 12, []int64{9, 10}, []int64{8})
				// The registration arrives; the prefill has nothing yet.
				p.waitFinished(t, "registration stored", func(Finished) bool { return len(p.work.push.regs) == 1 })
				params = pushPrefill(t, p, pid, []int64{3, 4, 5}, 12)
			} else {
				params = pushPrefill(t, p, pid, []int64{3, 4, 5}, 12)
				pushDecode(t, d, p, did, "cmpl-x-0", 12, []int64{9, 10}, []int64{8})
			}
			if params["transfer_mode"] != "push" {
				t.Fatalf("params %v", params)
			}
			if _, ok := params["remote_blocks_expiry_time"]; ok {
				t.Fatalf("push params carry an expiry: %v", params)
			}
			var pf Finished // the prefill's worker runs too
			f := d.waitFinished(t, "decode recv", func(f Finished) bool {
				pf.Sending = append(pf.Sending, p.finished(t).Sending...)
				return contains(f.Recving, did)
			})
			if len(f.Failed) != 0 {
				t.Fatalf("failed %v", f.Failed)
			}
			checkBlocks(t, d, p, []int64{9, 10}, []int64{4, 5})
			for l := 0; l < tLayers; l++ {
				if bytes.Equal(d.kv.block(l, 0, 8), p.kv.block(l, 0, 3)) {
					t.Fatal("the decode's cached block was overwritten")
				}
			}
			p.waitFinished(t, "prefill frees", func(f Finished) bool { return contains(append(f.Sending, pf.Sending...), pid) })
			if len(p.work.push.sends) != 0 || len(p.work.push.regs) != 0 {
				t.Fatalf("prefill kept push state: %d sends, %d registrations", len(p.work.push.sends), len(p.work.push.regs))
			}
		})
	}
}

// A decode that waits past push_registration_timeout fails the request;
// with a gonixl prefill it asks it to drop the registration and gives the
// blocks back only on its answer. A registration that came too late (the
// prefill's lease had ended) never gets a WRITE.
func TestPushRegistrationTimeout(t *testing.T) {
	clock := NewFakeClock(100)
	_, p, d := pushPair(t, clock, map[string]any{"push_registration_timeout": 5, "kv_lease_duration": 2})
	pushPrefill(t, p, "cmpl-y-0-aaaaaaaa", []int64{3}, 4)
	clock.Advance(3) // the prefill's lease ends
	p.waitFinished(t, "lease expiry", func(f Finished) bool { return contains(f.Sending, "cmpl-y-0-aaaaaaaa") })
	pushDecode(t, d, p, "cmpl-y-0-bbbbbbbb", "cmpl-y-0", 4, []int64{9}, nil)
	p.waitFinished(t, "registration stored", func(Finished) bool { return len(p.work.push.regs) == 1 })
	if f := d.finished(t); len(f.Recving)+len(f.Failed) != 0 {
		t.Fatalf("decode finished early: %+v", f)
	}
	clock.Advance(6)
	f := d.finished(t)
	if !contains(f.Failed, "cmpl-y-0-bbbbbbbb") || contains(f.Recving, "cmpl-y-0-bbbbbbbb") {
		t.Fatalf("after the timeout: %+v (want failed, blocks still held)", f)
	}
	// The gonixl prefill answers the cancel; then the blocks are released.
	f = d.waitFinished(t, "blocks released", func(f Finished) bool {
		p.finished(t)
		return contains(f.Recving, "cmpl-y-0-bbbbbbbb")
	})
	if len(p.work.push.regs) != 0 {
		t.Fatal("the prefill kept the cancelled registration")
	}
	_ = f
}

// A WRITE that fails tells a gonixl decode at once: the request fails
// without waiting for the timeout, and the prefill frees its blocks.
func TestPushFailedWriteNotifiesDecode(t *testing.T) {
	_, p, d := pushPair(t, nil, nil, nixltest.Script{FailStep: nixltest.StepPost})
	pushPrefill(t, p, "cmpl-z-0-aaaaaaaa", []int64{3, 4}, 8)
	pushDecode(t, d, p, "cmpl-z-0-bbbbbbbb", "cmpl-z-0", 8, []int64{9, 10}, nil)
	sent := false
	f := d.waitFinished(t, "decode fails", func(f Finished) bool {
		if pf := p.finished(t); contains(pf.Sending, "cmpl-z-0-aaaaaaaa") {
			sent = true
		}
		return contains(f.Failed, "cmpl-z-0-bbbbbbbb") && contains(f.Recving, "cmpl-z-0-bbbbbbbb")
	})
	if !sent {
		p.waitFinished(t, "prefill frees", func(f Finished) bool { return contains(f.Sending, "cmpl-z-0-aaaaaaaa") })
	}
	_ = f
}

// A registration that is not this request's (more blocks than it has) is
// refused on the prefill, and the gonixl decode is told.
func TestPushRegistrationLargerThanRequestRefused(t *testing.T) {
	_, p, d := pushPair(t, nil, nil)
	pushPrefill(t, p, "cmpl-w-0-aaaaaaaa", []int64{3}, 4)
	pushDecode(t, d, p, "cmpl-w-0-bbbbbbbb", "cmpl-w-0", 40, []int64{9, 10, 11}, nil)
	d.waitFinished(t, "decode fails", func(f Finished) bool {
		p.finished(t)
		return contains(f.Failed, "cmpl-w-0-bbbbbbbb")
	})
	for l := 0; l < tLayers; l++ {
		if bytes.Equal(d.kv.block(l, 0, 9), p.kv.block(l, 0, 3)) {
			t.Fatal("a refused registration was written")
		}
	}
}

func TestPushConfig(t *testing.T) {
	c := testConfig(t, RoleWorker, "kv_consumer", "e", 5600, map[string]any{"bidirectional_kv_xfer": true})
	c.TransferMode = "push"
	if err := c.applyDefaults(); err == nil || !strings.Contains(err.Error(), "Bidirectional KV transfer is not supported for NIXL push connector.") {
		t.Fatalf("bidirectional push: %v", err)
	}
	c = testConfig(t, RoleWorker, "kv_consumer", "e", 5600, map[string]any{"decoder_kv_blocks_ttl": 99})
	c.TransferMode = "push"
	if err := c.applyDefaults(); err != nil || c.PushRegistrationTimeout != 99 {
		t.Fatalf("push_registration_timeout default: %v %v", c.PushRegistrationTimeout, err)
	}
	c.TransferMode = "sideways"
	if err := c.applyDefaults(); err == nil {
		t.Fatal("transfer_mode sideways accepted")
	}
}

// A registration matched by request id whose prompt digest differs from the
// prefill request's is refused: nothing is written, the decode fails. With
// equal digests the push goes through.
func TestPushPromptDigestMismatchRefused(t *testing.T) {
	_, p, d := pushPair(t, nil, nil)
	pushPrefill(t, p, "cmpl-v-0-aaaaaaaa", []int64{3, 4}, 8, "blake2b-128:aa")
	pushDecode(t, d, p, "cmpl-v-0-bbbbbbbb", "cmpl-v-0", 8, []int64{9, 10}, nil, "blake2b-128:bb")
	d.waitFinished(t, "decode fails", func(f Finished) bool {
		p.finished(t)
		return contains(f.Failed, "cmpl-v-0-bbbbbbbb") && contains(f.Recving, "cmpl-v-0-bbbbbbbb")
	})
	for l := 0; l < tLayers; l++ {
		if bytes.Equal(d.kv.block(l, 0, 9), p.kv.block(l, 0, 3)) {
			t.Fatal("a decode with another prompt was written")
		}
	}
	pushPrefill(t, p, "cmpl-u-0-aaaaaaaa", []int64{5}, 4, "blake2b-128:cc")
	pushDecode(t, d, p, "cmpl-u-0-bbbbbbbb", "cmpl-u-0", 4, []int64{11}, nil, "blake2b-128:cc")
	f := d.waitFinished(t, "decode recv", func(f Finished) bool {
		p.finished(t)
		return contains(f.Recving, "cmpl-u-0-bbbbbbbb")
	})
	if len(f.Failed) != 0 {
		t.Fatalf("equal digests failed: %+v", f)
	}
	checkBlocks(t, d, p, []int64{11}, []int64{5})
}

// A WRITE's notification for a request the decode no longer waits for is
// counted as a notification after expiry, with vLLM's push log line.
func TestPushUnrecognizedNotification(t *testing.T) {
	_, p, d := pushPair(t, nil, nil)
	logs := observeInfo(d.work)
	pushPrefill(t, p, "cmpl-s-0-aaaaaaaa", []int64{3}, 4)
	pushDecode(t, d, p, "cmpl-s-0-bbbbbbbb", "cmpl-s-0", 4, []int64{9}, nil)
	d.waitFinished(t, "push", func(f Finished) bool {
		p.finished(t)
		return contains(f.Recving, "cmpl-s-0-bbbbbbbb")
	})
	d.work.Stats() // reset
	d.work.mu.Lock()
	pa := p.work.agent.Name()
	d.work.mu.Unlock()
	if err := p.work.agent.SendNotif(d.work.agent.Name(), []byte("cmpl-s-0-bbbbbbbb:1")); err != nil {
		t.Fatal(err)
	}
	d.waitFinished(t, "stray notification", func(Finished) bool {
		return logs.FilterMessage("Unrecognized request cmpl-s-0-bbbbbbbb notif (may have expired).").Len() == 1
	})
	var st map[string][]float64
	if err := json.Unmarshal(d.work.Stats(), &st); err != nil {
		t.Fatal(err)
	}
	if len(st["num_notifications_after_expiry"]) == 0 {
		t.Errorf("notification after expiry not counted: %v (from %s)", st, pa)
	}
}

// Push between tensor-parallel engines, equal and different tp_size, every
// rank holding distinct KV heads: each decode rank registers with the
// prefill ranks it maps to, each prefill rank writes its heads (whole, or
// slot by slot into several decode ranks), and every byte of every head of
// every decode rank is the prefill's. Replicated heads are refused.
func TestPushTensorParallel(t *testing.T) {
	for _, c := range []struct{ p, d, heads int }{{2, 2, 2}, {2, 1, 2}, {1, 2, 2}, {4, 2, 4}, {1, 2, 4}} {
		t.Run(fmt.Sprintf("P%d-D%d-heads%d", c.p, c.d, c.heads), func(t *testing.T) {
			eng := nixltest.NewEngine("t")
			eng.SetScript(nixltest.Script{Polls: 1})
			p := newTPEngine(t, eng, "kv_producer", "engine-p", c.p, c.heads, 1, "", "push")
			d := newTPEngine(t, eng, "kv_consumer", "engine-d", c.d, c.heads, 100, "", "push")
			pBlocks, dBlocks := []int64{3, 4, 9}, []int64{7, 2, 11}
			pushTP(t, p, d, "cmpl-tp-0-aaaaaaaa", "cmpl-tp-0-bbbbbbbb", pBlocks, dBlocks)
			for r := range d.workers {
				f := d.side(r).waitFinished(t, fmt.Sprintf("decode rank %d recv", r), func(f Finished) bool {
					for pr := range p.workers {
						p.side(pr).finished(t)
					}
					return contains(f.Recving, "cmpl-tp-0-bbbbbbbb")
				})
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
							got := mem[int(db)*blockLen+k*tpHeadBytes : int(db)*blockLen+(k+1)*tpHeadBytes]
							for j := range got {
								if got[j] != headByte(1, l, int(pBlocks[i]), h, j) {
									t.Fatalf("decode rank %d layer %d block %d head %d byte %d: %d, want %d", r, l, db, h, j, got[j], headByte(1, l, int(pBlocks[i]), h, j))
								}
							}
						}
					}
					if mem[5*blockLen] != headByte(100, l, 5, r*d.heads, 0) {
						t.Fatalf("decode rank %d layer %d: block 5 was overwritten", r, l)
					}
				}
			}
		})
	}
	t.Run("replicated heads refused", func(t *testing.T) {
		eng := nixltest.NewEngine("t")
		p := newTPEngine(t, eng, "kv_producer", "engine-p", 1, 1, 1, "", "push")
		d := newTPEngine(t, eng, "kv_consumer", "engine-d", 2, 1, 100, "", "push")
		pushTP(t, p, d, "cmpl-rep-0-aaaaaaaa", "cmpl-rep-0-bbbbbbbb", []int64{3}, []int64{7})
		for r := range d.workers {
			d.side(r).waitFinished(t, fmt.Sprintf("decode rank %d refuses", r), func(f Finished) bool {
				p.side(0).finished(t)
				return contains(f.Failed, "cmpl-rep-0-bbbbbbbb")
			})
		}
	})
}

// pushTP finishes a prefill request in push mode and schedules the decode's.
func pushTP(t *testing.T, p, d *tpEngine, pid, did string, pBlocks, dBlocks []int64) {
	t.Helper()
	in := mustParams(t, `{"do_remote_decode": true}`)
	if _, err := p.sched.UpdateStateAfterAlloc(pid, in, nil, []int64{0}, 0); err != nil {
		t.Fatal(err)
	}
	p.step(t)
	if _, _, err := p.sched.RequestFinished(pid, in, true, 12, BlockIDs{pBlocks}); err != nil {
		t.Fatal(err)
	}
	p.step(t)
	js, _ := json.Marshal(map[string]any{"do_remote_prefill": true, "remote_engine_id": "engine-p", "remote_host": "127.0.0.1",
		"remote_port": p.port, "tp_size": len(p.workers), "remote_request_id": "cmpl-tp-0"})
	dp := mustParams(t, string(js))
	if n, async := d.sched.GetNumNewMatchedTokens(dp, 12, 0); n != 12 || !async {
		t.Fatalf("matched %d async %v", n, async)
	}
	if _, err := d.sched.UpdateStateAfterAlloc(did, dp, BlockIDs{dBlocks}, []int64{0}, 12); err != nil {
		t.Fatal(err)
	}
	d.step(t)
}

// A decode request vLLM finishes (aborts) while it waits for the WRITE is
// failed at once and its blocks released as soon as the prefill confirms,
// without waiting for push_registration_timeout.
func TestPushAbortedDecodeCancelsAtOnce(t *testing.T) {
	clock := NewFakeClock(100)
	_, p, d := pushPair(t, clock, map[string]any{"push_registration_timeout": 300})
	pushDecode(t, d, p, "cmpl-ab-0-bbbbbbbb", "cmpl-ab-0", 4, []int64{9}, nil)
	p.waitFinished(t, "registration stored", func(Finished) bool { return len(p.work.push.regs) == 1 })
	dp := mustParams(t, `{"do_remote_prefill": false, "remote_engine_id": "engine-p"}`)
	if _, _, err := d.sched.RequestFinished("cmpl-ab-0-bbbbbbbb", dp, false, 0, BlockIDs{{9}}); err != nil {
		t.Fatal(err)
	}
	d.step(t)
	d.waitFinished(t, "failed and released", func(f Finished) bool {
		p.finished(t)
		return contains(f.Failed, "cmpl-ab-0-bbbbbbbb") && contains(f.Recving, "cmpl-ab-0-bbbbbbbb")
	})
	if len(p.work.push.regs) != 0 {
		t.Fatal("the prefill kept the aborted request's registration")
	}
}

// A prompt completed by a step is WRITTEN once that step's forward is done
// (the GetFinished after its StartLoadKV), before vLLM finishes the request;
// its blocks are freed only after both the WRITE and request_finished, in
// either order. The fake engine copies at Post (Polls -1): a WRITE posted
// at StartLoadKV, before the "forward" fills the blocks, would carry the
// old bytes.
func TestPushEarlyWriteAfterTheForward(t *testing.T) {
	for _, tc := range []struct {
		name     string
		regFirst bool // the decode registers before the prompt is done
		finFirst bool // request_finished before the WRITE
	}{
		{"registration first", true, false},
		{"prompt first", false, false},
		{"prompt first, finished before the registration", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, p, d := pushPair(t, nil, nil, nixltest.Script{Polls: -1})
			// Twice: the second time the prefill knows the decode already
			// (no handshake puts the WRITE off).
			for round := 0; round < 2; round++ {
				pid, did := fmt.Sprintf("cmpl-e-%d-aaaaaaaa", round), fmt.Sprintf("cmpl-e-%d-bbbbbbbb", round)
				client := fmt.Sprintf("cmpl-e-%d", round)
				r := 3 * int64(round)
				pblocks, dblocks := []int64{1 + r, 2 + r, 3 + r}, []int64{8 + r, 9 + r, 10 + r}
				if tc.regFirst {
					pushDecode(t, d, p, did, client, 12, dblocks, nil)
					p.waitFinished(t, "registration stored", func(Finished) bool { return len(p.work.push.regs) == 1 })
				}
				in := mustParams(t, `{"do_remote_decode": true}`)
				if _, err := p.sched.UpdateStateAfterAlloc(pid, in, nil, []int64{0}, 0); err != nil {
					t.Fatal(err)
				}
				if err := p.sched.PushPromptDone(pid, in, BlockIDs{pblocks}, 0); err != nil {
					t.Fatal(err)
				}
				p.step(t) // the step that completes the prompt
				if ps := p.work.push.sends[pid]; ps == nil || len(ps.xfers) != 0 {
					t.Fatalf("WRITE posted at start_load_kv, before the forward: %+v", ps)
				}
				for l := 0; l < tLayers; l++ { // the forward fills the blocks
					for kv := 0; kv < 2; kv++ {
						for _, b := range pblocks {
							blk := p.kv.block(l, kv, int(b))
							for i := range blk {
								blk[i] = byte(0xA0 + l + kv + int(b) + 16*round)
							}
						}
					}
				}
				var sent []string
				collect := func() { sent = append(sent, p.finished(t).Sending...) }
				collect() // the step's get_finished: computed from here on
				finish := func() {
					delay, _, err := p.sched.RequestFinished(pid, in, true, 12, BlockIDs{pblocks})
					if err != nil || !delay {
						t.Fatalf("request_finished: delay=%v err=%v", delay, err)
					}
					p.step(t)
				}
				if tc.finFirst {
					finish()
				}
				if !tc.regFirst {
					pushDecode(t, d, p, did, client, 12, dblocks, nil)
				}
				d.waitFinished(t, "decode recv", func(f Finished) bool {
					collect()
					if len(f.Failed) != 0 {
						t.Fatalf("failed %v", f.Failed)
					}
					return contains(f.Recving, did)
				})
				checkBlocks(t, d, p, dblocks, pblocks)
				if !tc.finFirst {
					for i := 0; i < 3; i++ {
						collect()
					}
					if contains(sent, pid) {
						t.Fatal("finished_sending reported before request_finished: vLLM would free a running request's blocks")
					}
					if _, ok := p.work.push.earlyDone[pid]; !ok {
						t.Fatal("the finished early WRITE is not remembered for its request_finished")
					}
					finish()
				}
				p.waitFinished(t, "prefill frees", func(f Finished) bool { return contains(append(f.Sending, sent...), pid) })
				if len(p.work.push.sends)+len(p.work.push.regs)+len(p.work.push.earlyDone) != 0 {
					t.Fatalf("prefill kept push state: %d sends, %d registrations, %d early", len(p.work.push.sends), len(p.work.push.regs), len(p.work.push.earlyDone))
				}
			}
		})
	}
}

// PushPromptDone is push mode's and a prefill's only; announced requests
// travel in the step's metadata once.
func TestPushPromptDoneRefusals(t *testing.T) {
	_, p, _ := pushPair(t, nil, nil)
	if err := p.sched.PushPromptDone("r", mustParams(t, `{"do_remote_prefill": true}`), BlockIDs{{1}}, 0); !errors.Is(err, ErrInvalidInput) {
		t.Fatalf("a decode request: %v, want invalid input", err)
	}
	pull := newSide(t, nixltest.NewEngine("pull"), "kv_producer", "engine-x", nil, 1, nil)
	if err := pull.sched.PushPromptDone("r", mustParams(t, `{"do_remote_decode": true}`), BlockIDs{{1}}, 0); !errors.Is(err, ErrInvalidInput) {
		t.Fatalf("pull mode: %v, want invalid input", err)
	}
	if err := p.sched.PushPromptDone("r", mustParams(t, `{"do_remote_decode": true}`), BlockIDs{{1, 2}}, 0); err != nil {
		t.Fatal(err)
	}
	b, err := p.sched.BuildMetaOrIdle()
	if err != nil || b == nil {
		t.Fatalf("build_meta: %v %v", b, err)
	}
	m, err := DecodeStepMeta(b)
	if err != nil || m.PushEarly["r"] == nil || m.PushEarly["r"].Blocks.Count() != 2 {
		t.Fatalf("meta %+v err %v", m, err)
	}
	if b, err := p.sched.BuildMetaOrIdle(); err != nil || b != nil {
		t.Fatalf("the next step is not idle: %d bytes, %v", len(b), err)
	}
}

// The prefill's workers tell its scheduler which requests a decode has
// claimed (push admission, pybridge/gonixl/push_admission.py): each
// registration's base request id once, flagged in get_finished, also when
// the registration found its request already held.
func TestPushArrivalsReportedOnce(t *testing.T) {
	for _, regFirst := range []bool{true, false} {
		t.Run(map[bool]string{true: "registration first", false: "prefill first"}[regFirst], func(t *testing.T) {
			_, p, d := pushPair(t, nil, nil)
			pid, did := "cmpl-y-0-aaaaaaaa", "cmpl-y-0-bbbbbbbb"
			if !regFirst {
				pushPrefill(t, p, pid, []int64{3, 4, 5}, 12)
			}
			if got := p.work.PushArrivals(); len(got) != 0 {
				t.Fatalf("arrivals before any registration: %v", got)
			}
			pushDecode(t, d, p, did, "cmpl-y-0", 12, []int64{9, 10}, []int64{8})
			for deadline := time.Now().Add(10 * time.Second); !p.finished(t).PushArrivalsPending; time.Sleep(2 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("get_finished never flagged the registration's arrival")
				}
			}
			got := p.work.PushArrivals()
			if !slices.Equal(got, []string{"cmpl-y-0"}) {
				t.Fatalf("arrivals %v, want [cmpl-y-0]", got)
			}
			if again := p.work.PushArrivals(); len(again) != 0 {
				t.Fatalf("arrivals reported twice: %v", again)
			}
			if f := p.finished(t); f.PushArrivalsPending {
				t.Fatal("get_finished still flags arrivals after they were taken")
			}
		})
	}
}
