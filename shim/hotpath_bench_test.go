package shim

import (
	"fmt"
	"testing"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/shim/kvwire"
)

// Microbenchmarks of the worker's per-step hot paths (issue 19): the
// descriptor ids of a READ, the step metadata across the C ABI, the
// notifications a prefill drains, and the lease sweep of get_finished.
//
//	go test -run '^$' -bench 'ReadDescIDs|StepMeta|Notif|LeaseSweep|GetFinishedIdle' -benchmem ./shim/
//
// Sizes are a large model's: 80 layers (160 K and V regions), requests of
// 64 blocks (1,024 tokens of 16), steps of 1, 32 and 256 requests, 10,000
// requests held by a prefill.

const (
	hotLayers    = 80
	hotHeads     = 8
	hotNumBlocks = 10000
	hotReqBlocks = 64
)

// hotReqID is a request id shaped like vLLM's (a completion id plus its
// random suffix).
func hotReqID(i int) string {
	return fmt.Sprintf("cmpl-%032x-0-%08x", uint64(i)*0x9e3779b97f4a7c15, uint32(i)*2654435761)
}

// nopXfer is a transfer nobody posts: the benchmarks stop at its making.
type nopXfer struct{}

func (nopXfer) Post() (nixl.Status, error)  { return nixl.InProgress, nil }
func (nopXfer) Check() (nixl.Status, error) { return nixl.Success, nil }
func (nopXfer) Telemetry() (nixl.Telemetry, nixl.Status) {
	return nixl.Telemetry{}, nixl.Success
}
func (nopXfer) Release() error { return nil }

// indexAgent takes descriptor index arrays and keeps nothing (the libnixl
// engine's interface: nixl.MakeXferBlocks expands regions × blocks for it).
type indexAgent struct {
	benchAgent
	descs int
	inbox []nixl.Notif
}

func (a *indexAgent) MakeXfer(_ nixl.XferOp, _ nixl.DescList, li []int32, _ nixl.DescList, ri []int32, _ []byte) (nixl.Xfer, error) {
	a.descs = len(li)
	return nopXfer{}, nil
}
func (a *indexAgent) SendNotif(string, []byte) error { return nil }
func (a *indexAgent) GetNotifs() ([]nixl.Notif, error) {
	out := a.inbox
	a.inbox = nil
	return out, nil
}

// blocksAgent also takes a transfer as regions × blocks (the ucx engine).
type blocksAgent struct{ indexAgent }

func (a *blocksAgent) MakeXferBlocks(_ nixl.XferOp, _, _ nixl.DescList, regions []nixl.BlockRegion, lb, _ []int32, _ []byte) (nixl.Xfer, error) {
	a.descs = len(regions) * len(lb)
	return nopXfer{}, nil
}

// hotDecodeWorker is a decode worker of the large model (TP 1) that knows
// one remote engine of the same shape and block size ratio.
func hotDecodeWorker(b *testing.B, groups, ratio int, blocksEngine bool) (*Worker, *remoteEngine, *indexAgent) {
	b.Helper()
	fzQuiet()
	w := benchWorker(b, 1, 0, hotHeads, hotLayers, hotNumBlocks, false)
	a := &indexAgent{}
	w.agent = a
	if blocksEngine {
		ba := &blocksAgent{}
		w.agent, a = ba, &ba.indexAgent
	}
	if groups > 1 {
		// Hybrid: each layer's region belongs to one of the groups (vLLM's
		// HMA with full and further full-attention groups), so the ids are
		// listed per group (regionDescIDs).
		w.cfg.TransferGroups = nil
		for g := 0; g < groups; g++ {
			w.cfg.TransferGroups = append(w.cfg.TransferGroups, TransferGroup{Kind: LayerKindFull, BlockSize: 16})
		}
		for i := range w.layout.Regions {
			w.layout.Regions[i].Group = i % groups
		}
	}
	n := len(w.layout.Regions) * hotNumBlocks
	re := &remoteEngine{id: "engine-p", plan: samePlan(), numBlocks: hotNumBlocks, regions: len(w.layout.Regions), blockRatio: ratio,
		ranks: []*remoteRank{{agent: "p-rank-0", list: &fzList{n: n * ratio, agent: "p-rank-0"}}}}
	if ratio > 1 {
		w.subLists = map[int]nixl.DescList{ratio: &fzList{n: n * ratio}}
	}
	return w, re, a
}

// hotRecvReq is one request of nBlocks per group: local blocks scattered
// over the cache, the remote ones (ratio per local block) elsewhere.
func hotRecvReq(seed, groups, nBlocks, ratio int) *RecvReq {
	rr := &RecvReq{TPSize: 1, DCPSize: 1, PPSize: 1, RemoteBlockSize: 16 / ratio,
		Remote: RemoteMeta{Host: "10.0.0.7", Port: 5600, EngineID: "engine-p", RequestID: hotReqID(seed), NumTokens: int64(nBlocks * 16)}}
	for g := 0; g < groups; g++ {
		l := make([]int64, nBlocks)
		r := make([]int64, nBlocks*ratio)
		for i := range l {
			l[i] = int64((seed*7919 + g*131 + i*37) % hotNumBlocks)
		}
		for i := range r {
			r[i] = int64((seed*104729 + g*17 + i*53) % hotNumBlocks)
		}
		rr.LocalBlockIDs = append(rr.LocalBlockIDs, l)
		rr.Remote.BlockIDs = append(rr.Remote.BlockIDs, r)
		if ratio == 1 {
			rr.LocalNumComputed = append(rr.LocalNumComputed, 0)
		}
	}
	return rr
}

// BenchmarkReadDescIDs: what readLocked does to turn one request's block
// ids into a READ per remote rank (pairBlocks, then xferMaker or
// subBlockXferMaker, localListFor and the maker itself), for the large
// model: 160 regions × 64 blocks = 10,240 descriptor pairs (one group), the
// same blocks in each of 2 groups of 80 regions each, and a remote of half
// the block size (128 remote blocks). "index" engines take index arrays
// (libnixl: nixl.ExpandBlocks runs here); "blocks" engines take regions ×
// blocks (ucx).
func BenchmarkReadDescIDs(b *testing.B) {
	for _, c := range []struct {
		name          string
		groups, ratio int
		blocksEngine  bool
		nBlocks       int
	}{
		{"1group/64blk/index", 1, 1, false, hotReqBlocks},
		{"1group/64blk/blocks", 1, 1, true, hotReqBlocks},
		{"1group/1024blk/index", 1, 1, false, 1024},
		{"2groups/64blk/index", 2, 1, false, hotReqBlocks},
		{"subblock2/64blk/index", 1, 2, false, hotReqBlocks},
	} {
		b.Run(c.name, func(b *testing.B) {
			w, re, a := hotDecodeWorker(b, c.groups, c.ratio, c.blocksEngine)
			rr := hotRecvReq(1, c.groups, c.nBlocks, c.ratio)
			notif := kvwire.DoneNotif(rr.Remote.RequestID, re.plan.consumers)
			b.ReportAllocs()
			for b.Loop() {
				local, remote, err := w.pairBlocks(rr, re)
				if err != nil {
					b.Fatal(err)
				}
				mk := w.xferMaker(local, remote, re.numBlocks)
				if re.blockRatio > 1 {
					mk = w.subBlockXferMaker(local, remote, re.numBlocks, re.blockRatio)
				}
				for _, r := range re.ranks {
					if _, err := mk(w.localListFor(re, r), r.list, notif); err != nil {
						b.Fatal(err)
					}
				}
			}
			b.ReportMetric(float64(a.descs), "descs/op")
		})
	}
}

// hotStepMeta is a step's metadata with n requests of 64 blocks each way: a
// decode's n new READs (with the heartbeats of as many held requests) and a
// prefill's n requests whose blocks wait for readers.
func hotStepMeta(n int) *StepMeta {
	m := &StepMeta{ReqsToRecv: map[string]*RecvReq{}, ReqsToSend: map[string]float64{}, SchedulerClock: 12345.678,
		Heartbeats: map[string]*HeartbeatInfo{}}
	hb := &HeartbeatInfo{Expiry: map[string]float64{}, Host: "10.0.0.7", Port: 5600, TPSize: 1, DCPSize: 1, PPSize: 1}
	for i := 0; i < n; i++ {
		rr := hotRecvReq(i, 1, hotReqBlocks, 1)
		exp := 12345.678 + 480
		rr.Remote.Expiry, rr.AwaitingKVs = &exp, true
		id := hotReqID(i)
		m.ReqsToRecv[id] = rr
		hb.ReqIDs = append(hb.ReqIDs, rr.Remote.RequestID)
		hb.Expiry[rr.Remote.RequestID] = exp
		sid := hotReqID(n + i)
		m.ReqsToSend[sid] = 12345.678 + 480
		m.ReqsInBatch = append(m.ReqsInBatch, sid)
	}
	m.Heartbeats["engine-p"] = hb
	return m
}

// BenchmarkStepMeta: the per-step metadata both ways across the C ABI
// (Encode in the scheduler's build_connector_meta, DecodeStepMeta in the
// worker's start_load_kv, on vLLM's model thread).
func BenchmarkStepMeta(b *testing.B) {
	for _, n := range []int{1, 32, 256} {
		m := hotStepMeta(n)
		enc, err := m.Encode()
		if err != nil {
			b.Fatal(err)
		}
		b.Run(fmt.Sprintf("encode/%dreqs", n), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(enc)))
			for b.Loop() {
				if _, err := m.Encode(); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("decode/%dreqs", n), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(enc)))
			for b.Loop() {
				if _, err := DecodeStepMeta(enc); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkParseNotif: one notification of each kind a prefill receives.
func BenchmarkParseNotif(b *testing.B) {
	ids := make([]string, 32)
	for i := range ids {
		ids[i] = hotReqID(i)
	}
	for _, c := range []struct{ name, msg string }{
		{"done", string(kvwire.DoneNotif(hotReqID(7), 2))},
		{"heartbeat-32ids", string(kvwire.HeartbeatNotif(ids))},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, ok := kvwire.ParseNotif(c.msg); !ok {
					b.Fatal("malformed")
				}
			}
		})
	}
}

// hotPrefillWorker is a prefill worker of the large model holding held
// requests' blocks for readers, leases ending at 1000+480 (a clock at 1000).
func hotPrefillWorker(b *testing.B, held int) (*Worker, *indexAgent, *FakeClock, []string) {
	b.Helper()
	fzQuiet()
	w := benchWorker(b, 1, 0, hotHeads, hotLayers, 512, false)
	clock := NewFakeClock(1000)
	w.clock, w.held.clock, w.floors.clock = clock.Now, clock.Now, clock.Now
	a := &indexAgent{}
	w.agent = a
	ids := make([]string, held)
	for i := range ids {
		ids[i] = hotReqID(i)
		w.toProcess[ids[i]] = struct{}{}
		w.held.Hold(ids[i], 1480)
	}
	return w, a, clock, ids
}

// BenchmarkPollNotifs: a prefill worker of 10,000 held requests drains one
// get_finished's notifications: done notifications (each frees its
// request, which is held again before the next round, as start_load_kv
// would), or heartbeats naming 32 requests each.
func BenchmarkPollNotifs(b *testing.B) {
	const held = 10000
	for _, c := range []struct {
		name string
		n    int
		hb   bool
	}{
		{"done/256notifs", 256, false},
		{"heartbeat/8x32ids", 8, true},
	} {
		b.Run(c.name, func(b *testing.B) {
			w, a, _, ids := hotPrefillWorker(b, held)
			notifs := make([]nixl.Notif, c.n)
			for i := range notifs {
				msg := kvwire.DoneNotif(ids[i], 1)
				if c.hb {
					msg = kvwire.HeartbeatNotif(ids[i*32 : (i+1)*32])
				}
				notifs[i] = nixl.Notif{Agent: "d-rank-0", Msg: msg}
			}
			b.ReportAllocs()
			for b.Loop() {
				if !c.hb {
					for _, id := range ids[:c.n] {
						w.toProcess[id] = struct{}{}
						w.held.Hold(id, 1480)
					}
				}
				a.inbox = notifs
				w.pollNotifsLocked()
				w.done.Sending = w.done.Sending[:0]
			}
			if want := held - map[bool]int{false: c.n}[c.hb]; w.held.Len() != want {
				b.Fatalf("%d leases held, want %d", w.held.Len(), want)
			}
		})
	}
}

// BenchmarkLeaseSweep: sweepLeasesLocked over 10,000 held leases, every
// get_finished: none due (the common case), and 1% due (freed, then held
// again for the next round).
func BenchmarkLeaseSweep(b *testing.B) {
	const held = 10000
	for _, due := range []int{0, held / 100} {
		b.Run(fmt.Sprintf("10k-held/%d-due", due), func(b *testing.B) {
			w, _, _, ids := hotPrefillWorker(b, held)
			b.ReportAllocs()
			for b.Loop() {
				for _, id := range ids[:due] {
					w.toProcess[id] = struct{}{}
					w.held.Hold(id, 999)
				}
				w.sweepLeasesLocked()
				if len(w.done.Sending) != due {
					b.Fatalf("%d freed, want %d", len(w.done.Sending), due)
				}
				w.done.Sending = w.done.Sending[:0]
			}
		})
	}
}

// BenchmarkGetFinishedIdle: a whole get_finished of a prefill worker holding
// 10,000 requests' blocks when nothing happened (no notification, no lease
// due): the call vLLM makes every engine step.
func BenchmarkGetFinishedIdle(b *testing.B) {
	w, _, _, _ := hotPrefillWorker(b, 10000)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := w.GetFinished(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkGetFinishedResult: get_finished of a prefill worker holding
// 10,000 requests' blocks in a step that finished 32 sends and 32 receives:
// the part of a step's cost that grows with its results (their encoding for
// the Python connector).
func BenchmarkGetFinishedResult(b *testing.B) {
	w, _, _, ids := hotPrefillWorker(b, 10000)
	sending, recving := ids[:32], ids[32:64]
	b.ReportAllocs()
	for b.Loop() {
		w.done.Sending = append(w.done.Sending[:0], sending...)
		w.done.Recving = append(w.done.Recving[:0], recving...)
		if _, err := w.GetFinished(); err != nil {
			b.Fatal(err)
		}
	}
}
