package shim

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"slices"
	"sort"
	"strings"

	"github.com/gonixl/gonixl/shim/kvwire"
)

// The model test's vLLM: one engine per side, a small, faithful copy of
// the parts of the installed vLLM 0.32 that decide when blocks change
// hands (vllm/v1/core/sched/scheduler.py, async_scheduler.py,
// vllm/v1/engine/core.py), driving the real Scheduler and Worker through
// pyConn, the copy of pybridge/gonixl/vllm.py. Attention-only, one KV-cache
// group, no local prefix cache, tp = pp = 1.
//
// What is modelled, with the vLLM code it follows:
//   - schedule(): running requests first (a chunk each within the token
//     budget; allocate_slots, and on failure preempt running[-1], which
//     frees its blocks: deferred on a consumer with async scheduling,
//     _free_request_blocks), then, if nothing was preempted, the waiting
//     ones, holders of KV blocks first (get_num_new_matched_tokens,
//     allocate, update_state_after_alloc, WAITING_FOR_REMOTE_KVS for an
//     asynchronous load, _update_waiting_for_remote_kv once its load is
//     reported); then build_connector_meta, then _update_after_schedule
//     (num_computed_tokens, and under async scheduling an output
//     placeholder per sampled step).
//   - The worker's step (execute_model, kv_connector_model_runner_mixin):
//     the forward writes this step's tokens' KV into the blocks scheduled,
//     start_load_kv runs after the forward's launch (on a GPU its writes
//     land any time before get_finished: either order is drawn), then
//     get_finished and the load errors.
//   - update_from_output(): the deferred frees whose step completed,
//     failed_recving (_handle_failed_recving) and invalid blocks
//     (_handle_invalid_blocks), sampled tokens (stale ones of a preempted
//     request dropped on a producer, requires_kv_delivery), stops
//     (max_tokens, an end-of-sequence token), _free_request with
//     request_finished, requests failed by a KV load error, then
//     finished_recving and finished_sending (_update_from_kv_xfer_finished).
//   - finish_requests() for aborts and errors: a request waiting for
//     remote KV keeps its blocks until finished_recving.
//   - The engine loop: step() without async scheduling, step_with_batch_
//     queue() with it (a queue of two batches: step N+1 is scheduled before
//     step N's output is processed), both only while has_requests().

type mStatus int

const (
	stWaiting mStatus = iota
	stWaitingRemote
	stRunning
	stPreempted
	stFinished
)

func (s mStatus) String() string {
	return [...]string{"WAITING", "WAITING_FOR_REMOTE_KVS", "RUNNING", "PREEMPTED", "FINISHED"}[s]
}

// mReq is one vLLM request.
type mReq struct {
	id        string
	e         *mEngine
	all       []int    // prompt then every output token it will produce (known ahead: a forward may run before its token is processed)
	kvHash    []uint64 // kvHash[t]: the KV of token t, a hash of all[:t+1]
	promptLen int
	maxTokens int
	eosAt     int // output index of an end-of-sequence token (stop), or -1
	outputs   int // output tokens processed (appended to the request)
	params    map[string]any

	status       mStatus
	reason       string // finish reason
	blocks       []int64
	numComputed  int
	inFlight     int
	placeholders int
	stale        int
	dropStale    bool
	preemptions  int
	lastSchedSeq int
	numExternal  int
	// delayFree: finished with its blocks held for the connector; freed:
	// its blocks went back (removed from the engine's requests).
	delayFree, freed bool
	arrival, ended   float64
	// scheduled: the request has been in a batch since it last left the
	// waiting queue (a "cached" request in the scheduler output).
	scheduled bool
	// recvReported: finished_recving was reported for it; recvFailed:
	// failed_recving was.
	recvReported, recvFailed bool
	conv                     *mConv
	params0                  map[string]any // as sent by the proxy (a retried READ reuses them)
}

func (r *mReq) numTokens() int { return r.promptLen + r.outputs }

func (r *mReq) String() string {
	var flags []string
	for _, f := range []struct {
		on   bool
		name string
	}{{r.delayFree, "held"}, {r.freed, "freed"}, {r.recvReported, "finished_recving"}, {r.recvFailed, "failed_recving"}} {
		if f.on {
			flags = append(flags, f.name)
		}
	}
	fl := ""
	if len(flags) > 0 {
		fl = " " + strings.Join(flags, ",")
	}
	return fmt.Sprintf("%s[%s%s c=%d/%d b=%v]", r.id, r.status, fl, r.numComputed, r.numTokens(), r.blocks)
}

// holdsForRecv: a transfer may write r's blocks (vLLM will not use or
// free them before finished_recving).
func (r *mReq) holdsForRecv() bool {
	if r.freed || r.recvReported {
		return false
	}
	return r.status == stWaitingRemote || (r.status == stFinished && r.delayFree)
}

// holdsForSend: a transfer may read r's blocks as its finished KV.
func (r *mReq) holdsForSend() bool {
	return !r.freed && r.status == stFinished && r.delayFree
}

type mBatch struct {
	seq   int
	order []*mReq
	n     map[*mReq]int
	work  []fwdItem
	meta  []byte // nil: an idle step (the worker's start_load_kv is skipped)
	// preempted: the metadata carries preempted announced pushes (the
	// worker's handle_preemptions runs before the forward)
	preempted bool
	total     int
	executed  bool
	// the worker's output
	fin     Finished
	invalid []int64
}

// fwdItem is one request's share of a step's forward.
type fwdItem struct {
	r       *mReq
	blocks  []int64
	start   int
	n       int
	samples bool
}

type deferredFree struct {
	fence  int
	blocks []int64
}

// mEngine is one vLLM engine (scheduler and its single worker).
type mEngine struct {
	r        *mRun
	name     string // "P" (prefill, kv_producer) or "D" (decode, kv_consumer)
	engineID string
	producer bool
	async    bool
	// recompute: kv_load_failure_policy "recompute" (else "fail").
	recompute  bool
	budget     int
	maxRunning int
	loadFirst  bool // start_load_kv's effects before the forward's writes

	sched *Scheduler
	work  *Worker
	conn  *pyConn
	mem   *modelMem
	agent string
	port  int

	numBlocks int
	free      []int64
	owner     []string // block -> request id, "" when free or deferred
	deferred  []deferredFree
	deferFree bool
	schedSeq  int
	procSeq   int
	stepSeq   int

	reqs        map[string]*mReq
	running     []*mReq
	waiting     []*mReq
	finRecv     map[string]bool // finished_recving_kv_req_ids
	failRecv    map[string]bool // failed_recving_kv_req_ids
	preemptedID []string
	finishedIDs []string  // finished_req_ids: finished since the last schedule
	queue       []*mBatch // scheduled, output not processed; oldest first
	dead        bool
	stallUntil  float64 // the engine loop does not step before this time
	// postsOpen: its worker's posts pass the model's post gate (a call
	// that may fence a preempted push's WRITE runs: it waits for them);
	// under mRun.mu.
	postsOpen bool
}

func (e *mEngine) stalled() bool { return e.r.clock.Now() < e.stallUntil }

func (e *mEngine) String() string { return e.name }

// hasRequests is the scheduler's has_requests: unfinished requests, or
// finished ones not yet freed or not yet in a scheduler output
// (has_finished_requests), or the connector's push work.
func (e *mEngine) hasRequests() bool {
	return len(e.reqs) > 0 || len(e.finishedIDs) > 0 || e.conn.hasPendingPushWork()
}

// ---------------------------------------------------------------------------
// blocks

// allocate gives r blocks to hold tokens tokens (allocate_slots); false
// when the pool cannot.
func (e *mEngine) allocate(r *mReq, tokens int) bool {
	need := (tokens+tBlockSize-1)/tBlockSize - len(r.blocks)
	if need <= 0 {
		return true
	}
	if need > len(e.free) {
		return false
	}
	for i := 0; i < need; i++ {
		k := e.r.rng.Intn(len(e.free)) // any free block: reuse is what the model looks for
		b := e.free[k]
		e.free = append(e.free[:k], e.free[k+1:]...)
		e.owner[b] = r.id
		r.blocks = append(r.blocks, b)
	}
	return true
}

func (e *mEngine) canBeFreed(r *mReq) bool { return !e.deferFree || r.lastSchedSeq <= e.procSeq }

// freeBlocks gives r's blocks back (_free_request_blocks: deferred while a
// step that may write them is in flight).
func (e *mEngine) freeBlocks(r *mReq, why string) {
	if len(r.blocks) == 0 {
		return
	}
	for _, b := range r.blocks {
		if e.owner[b] != r.id {
			e.r.violate("model", "%s: %s frees block %d owned by %q", e.name, r.id, b, e.owner[b])
		}
		e.owner[b] = ""
	}
	e.r.tracef("  %s frees %v (%s)", r.id, r.blocks, why)
	if e.canBeFreed(r) {
		e.free = append(e.free, r.blocks...)
	} else {
		e.deferred = append(e.deferred, deferredFree{fence: e.schedSeq, blocks: r.blocks})
	}
	r.blocks = nil
}

// freeNow is kv_cache_manager.free: no deferral.
func (e *mEngine) freeNow(r *mReq) {
	for _, b := range r.blocks {
		e.owner[b] = ""
	}
	e.r.tracef("  %s frees %v (failed load)", r.id, r.blocks)
	e.free = append(e.free, r.blocks...)
	r.blocks = nil
}

func (e *mEngine) drainDeferred() {
	for len(e.deferred) > 0 && e.deferred[0].fence <= e.procSeq {
		e.free = append(e.free, e.deferred[0].blocks...)
		e.deferred = e.deferred[1:]
	}
}

// ---------------------------------------------------------------------------
// requests

func (e *mEngine) addRequest(r *mReq) {
	r.e = e
	r.status = stWaiting
	r.arrival = e.r.clock.Now()
	r.ended = -1
	e.reqs[r.id] = r
	e.waiting = append(e.waiting, r)
	e.r.tracef("  %s: add %s prompt=%d max_tokens=%d params=%s", e.name, r.id, r.promptLen, r.maxTokens, jsonOf(r.params))
	e.conn.onNewRequest(r)
}

func (e *mEngine) removeQueues(r *mReq) {
	e.running = slices.DeleteFunc(e.running, func(x *mReq) bool { return x == r })
	e.waiting = slices.DeleteFunc(e.waiting, func(x *mReq) bool { return x == r })
}

// finishRequests is finish_requests (an abort, or an error).
func (e *mEngine) finishRequests(ids []string, reason string) {
	for _, id := range ids {
		r := e.reqs[id]
		if r == nil || r.status == stFinished {
			continue
		}
		e.removeQueues(r)
		delay := false
		if r.status == stWaitingRemote {
			delay = !e.finRecv[id]
			delete(e.finRecv, id)
			delete(e.failRecv, id)
		}
		r.status, r.reason = stFinished, reason
		e.freeRequest(r, delay)
	}
}

// freeRequest is _free_request: request_finished, then the blocks unless
// their free is delayed.
func (e *mEngine) freeRequest(r *mReq, delay bool) {
	n := (r.numComputed + tBlockSize - 1) / tBlockSize
	ids := append([]int64(nil), r.blocks[:min(n, len(r.blocks))]...)
	connDelay, out := e.conn.requestFinished(r, BlockIDs{ids})
	r.ended = e.r.clock.Now()
	e.finishedIDs = append(e.finishedIDs, r.id)
	e.r.tracef("  %s: %s finished (%s) delay=%v/%v params=%s", e.name, r.id, r.reason, delay, connDelay, jsonOf(out))
	if delay || connDelay {
		r.delayFree = true
	} else {
		e.freeAll(r, "finished")
	}
	if out != nil {
		e.r.output(r, out)
	}
}

// freeAll is _free_blocks: the blocks, and the request is forgotten.
func (e *mEngine) freeAll(r *mReq, why string) {
	e.freeBlocks(r, why)
	r.freed = true
	delete(e.reqs, r.id)
}

func (e *mEngine) preempt(r *mReq) {
	e.r.stats["preempt_"+e.name]++
	if e.conn.earlySeen[r.id] {
		e.r.stats["preempt_tracked_early"]++
	}
	e.freeBlocks(r, "preempted")
	r.status = stPreempted
	r.numComputed = 0
	r.dropStale = (e.producer) || (r.dropStale && r.stale > 0) // requires_kv_delivery: the producer role
	r.stale = r.inFlight
	r.placeholders = 0
	r.preemptions++
	r.scheduled = false
	e.waiting = append([]*mReq{r}, e.waiting...)
	e.preemptedID = append(e.preemptedID, r.id)
	e.r.tracef("  %s: preempt %s", e.name, r.id)
}

// ---------------------------------------------------------------------------
// schedule

// schedReq is one scheduled request as build_connector_meta sees it
// (yield_req_data): its new blocks (nil: none), and whether it resumed.
type schedReq struct {
	r       *mReq
	blocks  []int64
	resumed bool
	n       int
}

func (e *mEngine) schedule() *mBatch {
	e.stepSeq++
	b := &mBatch{seq: e.stepSeq, n: map[*mReq]int{}}
	budget := e.budget
	var out []schedReq
	var preempted []*mReq
	startBlocks := map[*mReq]int{}
	for i := 0; i < len(e.running) && budget > 0; i++ {
		r := e.running[i]
		if e.async && r.placeholders > 0 && r.numComputed+2-r.placeholders >= r.promptLen+r.maxTokens {
			continue // its last token is in flight
		}
		n := min(r.numTokens()+r.placeholders-r.numComputed, budget)
		if n <= 0 {
			continue
		}
		had := len(r.blocks)
		ok := false
		for {
			if e.allocate(r, r.numComputed+n) {
				ok = true
				break
			}
			if e.conn.hasPendingBlockFrees() {
				break
			}
			victim := e.running[len(e.running)-1]
			if !e.canBeFreed(victim) {
				break
			}
			e.running = e.running[:len(e.running)-1]
			e.preempt(victim)
			preempted = append(preempted, victim)
			if victim == r {
				break
			}
		}
		if !ok {
			break
		}
		startBlocks[r] = had
		b.n[r] = n
		b.order = append(b.order, r)
		budget -= n
	}
	for _, r := range b.order {
		var nb []int64
		if len(r.blocks) > startBlocks[r] {
			nb = append([]int64(nil), r.blocks[startBlocks[r]:]...)
		}
		out = append(out, schedReq{r: r, blocks: nb, n: b.n[r]})
	}
	if len(preempted) == 0 {
		// Holders of KV blocks first (kv_holding_waiting), then the rest,
		// each in queue order.
		var cands []*mReq
		for _, hold := range []bool{true, false} {
			for _, r := range e.waiting {
				if (r.numComputed > 0 || r.status == stWaitingRemote) == hold {
					cands = append(cands, r)
				}
			}
		}
		for _, r := range cands {
			if budget <= 0 || len(e.running) >= e.maxRunning {
				break
			}
			if r.status == stWaitingRemote {
				if !e.finRecv[r.id] {
					continue
				}
				e.updateWaitingForRemoteKV(r)
				if r.preemptions > 0 {
					r.status = stPreempted
				} else {
					r.status = stWaiting
				}
			}
			if r.stale > 0 && !r.dropStale {
				continue
			}
			ext, loadAsync := 0, false
			computed := r.numComputed
			if r.numComputed == 0 {
				ext, loadAsync = e.conn.getNumNewMatchedTokens(r, 0)
				loadAsync = loadAsync && ext > 0
				computed = ext
			}
			n := 0
			if !loadAsync {
				n = min(r.numTokens()-computed, budget)
				if n <= 0 {
					break
				}
			}
			if !e.allocate(r, computed+n) {
				break
			}
			e.conn.updateStateAfterAlloc(r, ext)
			if loadAsync {
				r.status = stWaitingRemote
				r.numComputed = computed
				r.numExternal = ext
				e.r.tracef("  %s: %s waits for %d remote tokens in %v", e.name, r.id, ext, r.blocks)
				continue
			}
			e.waiting = slices.DeleteFunc(e.waiting, func(x *mReq) bool { return x == r })
			e.running = append(e.running, r)
			resumed := r.status == stPreempted
			r.status = stRunning
			r.numComputed = computed
			r.scheduled = true
			b.n[r] = n
			b.order = append(b.order, r)
			budget -= n
			out = append(out, schedReq{r: r, blocks: append([]int64(nil), r.blocks...), resumed: resumed, n: n})
		}
	}
	for r, n := range b.n {
		b.total += n
		_ = r
	}
	b.meta = e.conn.buildConnectorMeta(out, e.preemptedID)
	b.preempted, e.conn.fenceNext = e.conn.fenceNext && b.meta != nil, false
	if e.deferFree && b.total > 0 {
		e.schedSeq++
	}
	// _update_after_schedule
	for _, r := range b.order {
		n := b.n[r]
		start := r.numComputed
		r.numComputed += n
		r.inFlight += n
		if e.deferFree {
			r.lastSchedSeq = e.schedSeq
		}
		prefillChunk := r.numComputed < r.numTokens()+r.placeholders
		if e.async && !prefillChunk {
			r.placeholders++
		}
		b.work = append(b.work, fwdItem{r: r, blocks: append([]int64(nil), r.blocks...), start: start, n: n, samples: !prefillChunk})
	}
	e.preemptedID, e.finishedIDs = nil, nil
	var desc []string
	for _, w := range b.work {
		desc = append(desc, fmt.Sprintf("%s:%d@%d", w.r.id, w.n, w.start))
	}
	e.r.tracef("  %s: schedule #%d [%s] meta=%d bytes", e.name, b.seq, strings.Join(desc, " "), len(b.meta))
	return b
}

func (e *mEngine) updateWaitingForRemoteKV(r *mReq) {
	if e.failRecv[r.id] {
		if r.numComputed == 0 {
			e.freeNow(r)
		}
		delete(e.failRecv, r.id)
	}
	if r.numComputed == r.numTokens() {
		r.numComputed = r.numTokens() - 1
	}
	delete(e.finRecv, r.id)
}

// ---------------------------------------------------------------------------
// the worker's step

func (e *mEngine) exec(b *mBatch) {
	b.executed = true
	if e.dead {
		return
	}
	if b.preempted {
		// A fence waits for a WRITE being posted: the worker's posts
		// pass the gate while the calls with these preemptions run
		// (a post takes milliseconds).
		e.r.openPosts(e, true)
		defer e.r.openPosts(e, false)
		// handle_preemptions, before the forward (gpu_model_runner).
		if err := e.work.HandlePreemptions(b.meta); err != nil {
			e.r.violate("model", "%s: handle_preemptions: %v", e.name, err)
		}
		e.r.afterCall(e)
	}
	if e.loadFirst {
		e.startLoad(b)
		e.forward(b)
	} else {
		e.forward(b)
		e.startLoad(b)
	}
	b.fin, b.invalid = e.conn.getFinished()
	e.r.tracef("  %s: exec #%d finished sending=%v recving=%v failed=%v invalid=%v", e.name, b.seq, b.fin.Sending, b.fin.Recving, b.fin.Failed, b.invalid)
}

func (e *mEngine) startLoad(b *mBatch) {
	if b.meta != nil {
		e.conn.startLoadKV(b.meta)
	}
}

// forward writes the KV of every token the step computes into the blocks
// the step was scheduled with.
func (e *mEngine) forward(b *mBatch) {
	for _, w := range b.work {
		for t := w.start; t < w.start+w.n; t++ {
			if t/tBlockSize >= len(w.blocks) {
				e.r.violate("model", "%s: %s computes token %d without a block", e.name, w.r.id, t)
				return
			}
			e.mem.writeToken(w.blocks[t/tBlockSize], t%tBlockSize, w.r.kvHash[t])
		}
	}
}

// ---------------------------------------------------------------------------
// update_from_output

func (e *mEngine) update(b *mBatch) {
	if e.deferFree && b.total > 0 {
		e.procSeq++
		e.drainDeferred()
	}
	fin := b.fin
	failedLoad := map[string]bool{}
	for _, id := range fin.Failed {
		r := e.reqs[id]
		if r != nil {
			r.recvFailed = true
		}
		if r != nil && r.status == stWaitingRemote {
			if e.recompute {
				r.numComputed = 0
				e.failRecv[id] = true
			} else {
				failedLoad[id] = true
			}
		}
	}
	if len(b.invalid) > 0 {
		for id := range e.invalidBlocks(b) {
			failedLoad[id] = true
		}
	}
	for _, w := range b.work {
		r := w.r
		n := w.n
		stale := false
		if !r.freed {
			r.inFlight -= n
			if r.stale > 0 {
				stale = true
				r.stale -= n
				if r.stale < 0 {
					e.r.violate("model", "%s: %s stale count below zero", e.name, r.id)
				}
			}
		}
		if failedLoad[r.id] || r.freed || r.status == stFinished {
			continue
		}
		if stale && r.dropStale {
			continue
		}
		if !w.samples {
			continue
		}
		if e.async && !stale {
			r.placeholders-- // AsyncScheduler._update_request_with_output
		}
		r.outputs++
		stopped := ""
		switch {
		case r.eosAt >= 0 && r.outputs > r.eosAt:
			stopped = "stopped"
		case r.outputs >= r.maxTokens:
			stopped = "length"
		}
		if stopped == "" {
			continue
		}
		e.removeQueues(r)
		r.status, r.reason = stFinished, stopped
		e.freeRequest(r, false)
	}
	if !e.recompute && len(failedLoad) > 0 {
		e.finishRequests(sortedKeys(failedLoad), "error")
	}
	e.conn.updateConnectorOutput(fin.Sending, fin.Recving)
	for _, id := range fin.Recving {
		r := e.reqs[id]
		if r == nil {
			e.r.violate("report", "%s: finished_recving for %s, a request vLLM does not hold (its assert fails)", e.name, id)
			continue
		}
		r.recvReported = true
		if r.status == stWaitingRemote {
			e.finRecv[id] = true
			if !e.failRecv[id] && !r.recvFailed {
				e.r.checkReceived(r)
			}
			continue
		}
		if r.status != stFinished {
			e.r.violate("report", "%s: finished_recving for %s in state %s (its assert fails)", e.name, id, r.status)
			continue
		}
		e.freeAll(r, "finished_recving")
	}
	for _, id := range fin.Sending {
		r := e.reqs[id]
		if r == nil {
			e.r.violate("report", "%s: finished_sending for %s, a request vLLM does not hold (its assert fails)", e.name, id)
			continue
		}
		if r.status != stFinished {
			// vLLM frees the blocks of a request it still runs: the
			// blocks of a running request go back to the pool.
			e.r.violate("report", "%s: finished_sending for %s, which is %s: vLLM frees the blocks of a live request", e.name, id, r.status)
			continue
		}
		e.freeAll(r, "finished_sending")
	}
}

// invalidBlocks is _handle_invalid_blocks for one KV-cache group: the
// requests (waiting for remote KV, or running) holding an invalid block
// among their computed ones; with "recompute" they are truncated and
// retried, with "fail" failed.
func (e *mEngine) invalidBlocks(b *mBatch) map[string]bool {
	bad := map[int64]bool{}
	for _, x := range b.invalid {
		bad[x] = true
	}
	out := map[string]bool{}
	var reqs []*mReq
	for _, r := range e.waiting {
		if r.status == stWaitingRemote {
			reqs = append(reqs, r)
		}
	}
	reqs = append(reqs, e.running...)
	for _, r := range reqs {
		comp := r.numComputed
		if n, ok := b.n[r]; ok && r.status == stRunning {
			comp -= n
		}
		nb := (comp + tBlockSize - 1) / tBlockSize
		for i := 0; i < nb && i < len(r.blocks); i++ {
			if !bad[r.blocks[i]] {
				continue
			}
			if r.status == stRunning {
				e.r.tracef("  %s: load errors name block %d of running request %s", e.name, r.blocks[i], r.id)
			}
			r.numComputed = i * tBlockSize
			out[r.id] = true
			break
		}
	}
	if e.recompute {
		for id := range out {
			if r := e.reqs[id]; r != nil && r.status == stWaitingRemote {
				e.failRecv[id] = true
			}
		}
		// Running requests are rescheduled from their truncated count.
		for id := range out {
			if r := e.reqs[id]; r != nil && r.status == stRunning {
				continue
			}
			delete(out, id)
		}
	}
	return out
}

// ---------------------------------------------------------------------------
// the engine loop

// tick is one call of EngineCore.step (sync) or step_with_batch_queue
// (async). It reports whether it did anything.
func (e *mEngine) tick() bool {
	if !e.async {
		if !e.hasRequests() {
			return false
		}
		b := e.schedule()
		e.exec(b)
		e.update(b)
		return true
	}
	if e.hasRequests() {
		b := e.schedule()
		e.queue = append(e.queue, b)
		if len(e.queue) < 2 {
			return true
		}
	} else if len(e.queue) == 0 {
		return false
	}
	oldest := e.queue[0]
	for !oldest.executed {
		e.execNext()
	}
	e.queue = e.queue[1:]
	e.update(oldest)
	return true
}

// execNext runs the worker's next scheduled step; false when none waits.
func (e *mEngine) execNext() bool {
	for _, b := range e.queue {
		if !b.executed {
			e.exec(b)
			return true
		}
	}
	return false
}

// ---------------------------------------------------------------------------
// pyConn mirrors pybridge/gonixl/vllm.py (GoNixlConnector and
// GoNixlPushConnector): what the Python connector decides before and after
// each call into the library. Keep it in step with vllm.py: this is the one
// place the model test copies Python logic (the digest checks, push-early
// tracking, has_pending_push_work, the mutations of kv_transfer_params).

type pyConn struct {
	e     *mEngine
	push  bool
	sched *Scheduler
	work  *Worker
	// push mode, a prefill: _push_early_ok (full attention, no staging),
	// _push_early (request -> blocks so far), _push_early_seen (every id
	// tracked, until its request_finished)
	earlyOK   bool
	early     map[string][]int64
	earlySeen map[string]bool
	// has_pending_push_work's sets: _push_sending, _push_registering,
	// _push_registered, _push_unreceived (request -> when vLLM finished it
	// before its finished_recving; vllm.py uses time.monotonic, the model
	// its clock)
	pushSending     map[string]bool
	pushRegistering map[string]bool
	pushRegistered  map[string]bool
	pushUnreceived  map[string]float64
	dirty           bool    // _sched_dirty
	due             float64 // _sched_due (the model's clock; 0 for none)
	loadErrPending  bool
	fenceNext       bool // _fence_next: the next step's metadata needs handle_preemptions
	// engine.Scheduler's batch: the queued calls and what runs on each
	// one's result (sched_ops.go).
	ops  opEnc
	then []func(byte)
}

// queue is engine.Scheduler._queue.
func (c *pyConn) queue(then func(byte)) { c.then = append(c.then, then) }

// flush is engine.Scheduler.flush (apply=false) or the batch half of its
// build_meta (apply_build_meta).
func (c *pyConn) flush() {
	if c.ops.n == 0 {
		return
	}
	res := make([]byte, c.ops.n)
	if err := c.sched.ApplyOps(c.ops.b, res); err != nil {
		c.e.r.violate("model", "%s: scheduler batch: %v", c.e.name, err)
	}
	then := c.then
	c.ops, c.then = opEnc{}, nil
	for i, f := range then {
		if res[i]&OpInvalid != 0 {
			c.e.r.tracef("  %s: batched op %d refused", c.e.name, i)
		}
		if f != nil {
			f(res[i])
		}
	}
}

func newPyConn(e *mEngine, push bool) *pyConn {
	return &pyConn{e: e, push: push, sched: e.sched, work: e.work, earlyOK: push && e.producer,
		early: map[string][]int64{}, earlySeen: map[string]bool{}, pushSending: map[string]bool{},
		pushRegistering: map[string]bool{}, pushRegistered: map[string]bool{}, pushUnreceived: map[string]float64{},
		dirty: true, loadErrPending: true}
}

const promptDigestKey = "gonixl_prompt_digest"

// promptDigest is vllm.py's prompt_digest (any stable function of the
// first n tokens: the library only compares digests).
func promptDigest(tokens []int, n int) (string, bool) {
	if n <= 0 || n > len(tokens) {
		return "", false
	}
	h := fnv.New128a()
	for _, t := range tokens[:n] {
		fmt.Fprintf(h, "%d,", t)
	}
	return "fnv-128:" + hex.EncodeToString(h.Sum(nil)), true
}

func (c *pyConn) parse(r *mReq, params map[string]any) *TransferParams {
	if params == nil {
		return nil
	}
	p, err := ParseTransferParams([]byte(jsonOf(params)))
	if err != nil {
		c.e.r.violate("model", "%s: params of %s do not parse: %v", c.e.name, r.id, err)
		return nil
	}
	return p
}

func (c *pyConn) prompt(r *mReq) []int { return r.all[:r.promptLen] }

// checkPromptDigest is _check_prompt_digest.
func (c *pyConn) checkPromptDigest(r *mReq) {
	p := r.params
	if p == nil || !truthy(p["do_remote_prefill"]) {
		return
	}
	want, ok := p[promptDigestKey]
	if !ok {
		return
	}
	n, isInt := asInt(p["remote_num_tokens"])
	got, has := "", false
	if isInt {
		got, has = promptDigest(c.prompt(r), n)
	}
	if has && got == want {
		delete(p, promptDigestKey)
		return
	}
	np := map[string]any{}
	for k, v := range p {
		if !strings.HasPrefix(k, "remote_") && k != promptDigestKey {
			np[k] = v
		}
	}
	np["do_remote_prefill"] = false
	np["gonixl_prompt_mismatch"] = true
	r.params = np
	c.e.r.tracef("  %s: %s prompt digest mismatch: computing locally", c.e.name, r.id)
}

const (
	readbackDigestKey = "gonixl_token_digest"
	readbackTokensKey = "gonixl_readback_tokens"
)

// tokenDigest stands for digest.py's token_digest: what the decode's blocks
// hold (the first n tokens), None when n is not in 1..len(tokens).
func tokenDigest(tokens []int, n int) (map[string]any, bool) {
	d, ok := promptDigest(tokens, n)
	if !ok {
		return nil, false
	}
	return map[string]any{"v": 1, "n": n, "final": d}, true
}

// matchedTokens stands for digest.py's matched_tokens with prompts shorter
// than its checkpoint step (256 tokens): all n tokens, or none.
func matchedTokens(digest any, tokens []int) int {
	m, ok := digest.(map[string]any)
	if !ok {
		return 0
	}
	n, ok := asInt(m["n"])
	if !ok {
		return 0
	}
	if d, ok := promptDigest(tokens, n); ok && d == m["final"] {
		return n
	}
	return 0
}

// checkReadbackDigest is _check_readback_digest.
func (c *pyConn) checkReadbackDigest(r *mReq) {
	p := r.params
	if p == nil || !truthy(p["do_remote_decode"]) || truthy(p["_remote_blocks_processed"]) {
		return
	}
	digest, ok := p[readbackDigestKey]
	if !ok {
		if p["gonixl_expiry_unix"] != nil && truthy(p["remote_block_ids"]) {
			if _, has := p[readbackTokensKey]; !has {
				// A gonixl decode's params without its digest: pull nothing.
				p[readbackTokensKey] = 0
			}
		}
		return
	}
	delete(p, readbackDigestKey)
	p[readbackTokensKey] = matchedTokens(digest, c.prompt(r))
}

func (c *pyConn) onNewRequest(r *mReq) {
	c.checkPromptDigest(r)
	c.checkReadbackDigest(r)
	if len(r.params) == 0 {
		return
	}
	c.dirty = true
	c.ops.onNew(r.id, jsonOf(r.params))
	c.queue(nil)
}

func (c *pyConn) getNumNewMatchedTokens(r *mReq, computed int) (int, bool) {
	c.checkPromptDigest(r)
	c.checkReadbackDigest(r)
	if len(r.params) == 0 {
		return 0, false
	}
	p := c.parse(r, r.params)
	if p == nil {
		return 0, false
	}
	c.dirty = true
	n, async := c.sched.GetNumNewMatchedTokens(p, int64(r.promptLen), int64(computed))
	return int(n), async
}

func (c *pyConn) updateStateAfterAlloc(r *mReq, ext int) {
	if len(r.params) == 0 {
		return
	}
	params := r.params
	if c.earlyOK && truthy(params["do_remote_decode"]) && r.maxTokens == 1 && !c.earlySeen[r.id] {
		c.earlySeen[r.id] = true
		c.early[r.id] = nil
	}
	pushRegister := c.push && ext > 0 && truthy(params["do_remote_prefill"])
	send := params
	if pushRegister {
		if d, ok := promptDigest(c.prompt(r), r.promptLen); ok {
			send = withKey(params, promptDigestKey, d)
		}
	}
	groups := BlockIDs{}
	if ext > 0 {
		groups = BlockIDs{append([]int64(nil), r.blocks...)}
	}
	if c.parse(r, send) == nil {
		return
	}
	c.dirty = true
	// Queued for the step's build_meta; its answer mutates the params then.
	c.ops.alloc(r.id, jsonOf(send), groups, []int64{0}, int64(ext))
	c.queue(func(res byte) {
		if res&OpMutated != 0 {
			params["do_remote_prefill"] = false
			params["_remote_blocks_processed"] = true
			if pushRegister {
				c.pushRegistered[r.id] = true
			}
		}
	})
	if pushRegister {
		c.pushRegistering[r.id] = true
	}
}

// hasPendingBlockFrees is has_pending_block_frees: vLLM asks it before it
// preempts to make room.
func (c *pyConn) hasPendingBlockFrees() bool {
	if len(c.earlySeen) == 0 {
		return false
	}
	c.flush()
	pending, fenced := c.sched.PendingBlockFreesFenced()
	if fenced {
		c.dirty, c.fenceNext = true, true
	}
	return pending
}

// pushPreempted is _push_preempted: the tracked requests vLLM preempted
// (scheduler_output.preempted_req_ids).
func (c *pyConn) pushPreempted(preempted []string) {
	var ids []string
	for _, id := range preempted {
		if c.earlySeen[id] {
			ids = append(ids, id)
		}
	}
	if len(ids) == 0 {
		return
	}
	sort.Strings(ids)
	c.dirty, c.fenceNext = true, true
	c.flush()
	c.sched.PushPreempted(ids)
}

// pushPromptsDone is _push_prompts_done.
func (c *pyConn) pushPromptsDone(out []schedReq) bool {
	announced := false
	for _, s := range out {
		acc, ok := c.early[s.r.id]
		if !ok {
			continue
		}
		if s.blocks != nil {
			if s.resumed || len(acc) == 0 {
				acc = append([]int64(nil), s.blocks...)
			} else {
				acc = append(acc, s.blocks...)
			}
			c.early[s.r.id] = acc
		}
		r := s.r
		if r.numComputed+s.n < r.promptLen {
			continue
		}
		delete(c.early, r.id)
		send := r.params
		if d, ok := promptDigest(c.prompt(r), r.promptLen); ok {
			send = withKey(r.params, promptDigestKey, d)
		}
		p := c.parse(r, send)
		if p == nil {
			continue
		}
		c.flush()
		if err := c.sched.PushPromptDone(r.id, p, BlockIDs{append([]int64(nil), acc...)}, 0); err != nil {
			c.e.r.tracef("  %s: push_prompt_done(%s): %v", c.e.name, r.id, err)
			continue
		}
		c.e.r.tracef("  %s: announce %s blocks %v", c.e.name, r.id, acc)
		c.dirty = true
		announced = true
	}
	return announced
}

func (c *pyConn) buildConnectorMeta(out []schedReq, preempted []string) []byte {
	if len(c.earlySeen) > 0 {
		c.pushPreempted(preempted)
	}
	if len(c.early) > 0 {
		c.pushPromptsDone(out)
	}
	var data []byte
	if now := c.e.r.clock.Now(); c.dirty || (c.due != 0 && now >= c.due) {
		c.flush()
		b, err := c.sched.BuildMetaOrIdle()
		if err != nil {
			c.e.r.violate("model", "%s: build_meta: %v", c.e.name, err)
		}
		data = b
		c.dirty = data != nil
		c.due = 0
		if data == nil {
			if wait := c.sched.IdleFor(); wait >= 0 {
				c.due = now + wait
			}
		}
	}
	clear(c.pushRegistering)
	return data
}

func (c *pyConn) updateConnectorOutput(sending, recving []string) {
	for _, id := range sending {
		delete(c.pushSending, id)
	}
	for _, id := range recving {
		delete(c.pushRegistered, id)
		delete(c.pushUnreceived, id)
	}
	if len(recving) > 0 {
		c.dirty = true
		c.ops.recvd(slices.Sorted(slices.Values(recving))...)
		c.queue(nil)
	}
}

// requestFinished is request_finished_all_groups.
func (c *pyConn) requestFinished(r *mReq, ids BlockIDs) (bool, map[string]any) {
	delete(c.early, r.id)
	delete(c.earlySeen, r.id)
	if c.pushRegistered[r.id] {
		delete(c.pushRegistered, r.id)
		c.pushUnreceived[r.id] = c.e.r.clock.Now()
	}
	if len(r.params) == 0 {
		return false, nil
	}
	// The library overrides "normal" for a request announced for an early
	// WRITE. Tokens whose KV is written: num_computed_tokens less the
	// step still in flight (num_in_flight_tokens), within the token ids.
	normal := r.reason == "length" || r.reason == "stopped"
	computed := max(0, min(r.numComputed-r.inFlight, r.numTokens()))
	pushSend := c.push && truthy(r.params["do_remote_decode"])
	send := r.params
	if pushSend {
		if d, ok := promptDigest(c.prompt(r), computed); ok {
			send = withKey(r.params, promptDigestKey, d)
		}
	}
	p := c.parse(r, send)
	if p == nil {
		return false, nil
	}
	c.dirty = true
	if !c.sched.cfg.BidirectionalKVXfer && !truthy(r.params["do_remote_decode"]) {
		// A decode's: queued, its answer is always "nothing held".
		c.ops.finished(r.id, jsonOf(send), normal, int64(computed), ids)
		c.queue(nil)
		if truthy(r.params["do_remote_prefill"]) {
			r.params["do_remote_prefill"] = false
		}
		return false, nil
	}
	c.flush()
	delay, out, err := c.sched.RequestFinished(r.id, p, normal, int64(computed), ids)
	if err != nil {
		c.e.r.tracef("  %s: request_finished(%s): %v", c.e.name, r.id, err)
		return false, nil
	}
	if truthy(r.params["do_remote_prefill"]) {
		r.params["do_remote_prefill"] = false
	}
	if pushSend && delay {
		c.pushSending[r.id] = true
	}
	var params map[string]any
	if out != nil {
		if err := json.Unmarshal(out, &params); err != nil {
			c.e.r.violate("model", "%s: request_finished params %q: %v", c.e.name, out, err)
			return delay, nil
		}
	}
	if params != nil && truthy(params["do_remote_prefill"]) {
		n, _ := asInt(params["remote_num_tokens"])
		if d, ok := promptDigest(c.prompt(r), n); ok {
			params[promptDigestKey] = d
		}
	} else if params != nil && truthy(params["do_remote_decode"]) && truthy(params["remote_block_ids"]) {
		n, _ := asInt(params["remote_num_tokens"])
		if d, ok := tokenDigest(r.all[:r.numTokens()], n); ok {
			params[readbackDigestKey] = d
		}
	}
	return delay, params
}

// pushHoldStepping is vllm.py's _PUSH_HOLD_STEPPING: how long a push decode
// keeps vLLM stepping after it finished a request its worker still holds.
const pushHoldStepping = 60.0

func (c *pyConn) hasPendingPushWork() bool {
	if len(c.pushSending)+len(c.pushRegistering) > 0 {
		return true
	}
	horizon := c.e.r.clock.Now() - pushHoldStepping
	for id, t := range c.pushUnreceived {
		if t < horizon {
			delete(c.pushUnreceived, id)
		}
	}
	return len(c.pushUnreceived) > 0
}

func (c *pyConn) startLoadKV(meta []byte) {
	if err := c.work.StartLoadKV(meta); err != nil {
		c.e.r.violate("model", "%s: start_load_kv: %v", c.e.name, err)
	}
	c.e.r.afterCall(c.e)
}

// getFinished is get_transfer_results and get_block_ids_with_load_errors.
func (c *pyConn) getFinished() (Finished, []int64) {
	b, err := c.work.GetFinished()
	// A KV digest check this poll started runs on a goroutine: done before
	// the next poll, as it would be on any host with a free core, so that
	// runs stay reproducible from their seed.
	c.work.checks.Wait()
	c.e.r.afterCall(c.e)
	var f Finished
	if err == nil {
		var fp *Finished
		if fp, err = kvwire.DecodeFinished(b); err == nil {
			f = *fp
		}
	}
	if err != nil {
		c.e.r.violate("model", "%s: get_finished: %v", c.e.name, err)
		return Finished{}, nil
	}
	var invalid []int64
	if c.loadErrPending || f.LoadErrorsPending {
		invalid = c.work.LoadErrors()
	}
	c.loadErrPending = f.LoadErrorsPending
	return f, invalid
}

// ---------------------------------------------------------------------------
// helpers

func truthy(v any) bool {
	switch t := v.(type) {
	case bool:
		return t
	case nil:
		return false
	case string:
		return t != ""
	case float64:
		return t != 0
	case int:
		return t != 0
	}
	return true
}

func asInt(v any) (int, bool) {
	switch t := v.(type) {
	case int:
		return t, true
	case float64:
		if t == float64(int(t)) {
			return int(t), true
		}
	}
	return 0, false
}

func withKey(m map[string]any, k string, v any) map[string]any {
	out := make(map[string]any, len(m)+1)
	for kk, vv := range m {
		out[kk] = vv
	}
	out[k] = v
	return out
}

func jsonOf(v any) string {
	if v == nil {
		return "null"
	}
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprintf("<%v>", err)
	}
	return string(b)
}

func sortedReqIDs(m map[string]*mReq) []string {
	out := make([]string, 0, len(m))
	for id := range m {
		out = append(out, id)
	}
	sort.Strings(out)
	return out
}
