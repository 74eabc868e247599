// Remote engines: handshakes over the side channel, the peers they
// produce, and dropping a peer that failed or stopped answering. Both sides
// use them (a decode reads from its remotes; a prefill's workers never
// handshake, they only answer).

package shim

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/sidechannel"
)

type remoteEngine struct {
	id        string
	plan      tpPlan
	ranks     []*remoteRank // one per plan.targets, same order
	numBlocks int64
	regions   int
	offset    float64       // remote clock - local clock (of its first rank)
	rtt       time.Duration // of the sample the offset came from: its error bound
	host      string        // side-channel address it was handshaken at
	port      int
	lastUsed  float64 // this worker's clock: last READ, notification, heartbeat or handshake (engine_ttl, evict.go)
	// blockRatio is this engine's block size over the remote's (1: equal):
	// above 1, each local block is read as that many remote blocks.
	blockRatio int
	// gonixl: the remote is a gonixl engine (its metadata states its
	// geometry); only such a peer is sent gonixl's own notifications.
	gonixl bool
	// instance: the gonixl scheduler process serving it ("" for a stock
	// engine): params made by another process are not read from it.
	instance string
}

// remoteRank is one remote TP rank this worker handshook with: its agent,
// and, when this worker reads from it, the prepared descriptor list of the
// slice it reads (tpmap.go) and the local slot that slice lands in.
type remoteRank struct {
	tp    int
	agent string
	list  nixl.DescList // nil: notified, never read
	slot  int
}

// agents lists the remote agents, in rank order.
func (re *remoteEngine) agents() []string {
	out := make([]string, len(re.ranks))
	for i, r := range re.ranks {
		out[i] = r.agent
	}
	return out
}

// releaseLocked releases the prepared lists and invalidates the agents.
func (re *remoteEngine) release(agent nixl.Agent) {
	for _, r := range re.ranks {
		if r.list != nil {
			_ = r.list.Release()
		}
		_ = agent.InvalidateRemote(r.agent)
	}
}

type handshakeState struct {
	waiting     []string // request ids waiting for this engine
	pushWaiting []string // push mode, a prefill: request ids whose WRITE waits for this (decode) engine
	// cancelReplies: push mode, a prefill: decode request ids to tell,
	// once handshaken, that no WRITE will come (push.go)
	cancelReplies []string
}

// hsKey identifies a handshake: an engine at one address (a request may
// name a known engine at another address; that handshake must not disturb
// the working one).
func hsKey(engineID, host string, port int) string {
	return fmt.Sprintf("%s@%s:%d", engineID, host, port)
}

func (w *Worker) startHandshakeLocked(engineID, host string, port, remoteTP int, reqID string) {
	key := hsKey(engineID, host, port)
	hsState, running := w.handshakes[key]
	if running {
		if reqID != "" {
			hsState.waiting = append(hsState.waiting, reqID)
		}
		return
	}
	if err := w.admitHandshakeLocked(key); err != nil {
		// Refused before any network work: fail the request now.
		if st, ok := w.recv[reqID]; ok && st.waiting {
			st.waiting = false
			w.stats.RecordFailedHandshake()
			w.failLocked(st, "handshake_failed", fmt.Sprintf("engine %s at %s:%d", engineID, host, port), err)
		}
		return
	}
	hsState = &handshakeState{}
	if reqID != "" {
		hsState.waiting = append(hsState.waiting, reqID)
	}
	w.handshakes[key] = hsState
	// A panic on the handshake goroutine fails the requests waiting for
	// it instead of killing vLLM's process.
	onPanic := func(err error) { w.finishHandshake(engineID, host, port, nil, err) }
	plan, err := w.planFor(remoteTP)
	if err != nil {
		w.goSafe("handshake with "+key, onPanic, func() {
			w.finishHandshake(engineID, host, port, nil, fmt.Errorf("remote engine %s cannot exchange KV with this engine (tp_size %d, rank %d): %w", engineID, w.cfg.TPSize, w.cfg.TPRank, err))
		})
		return
	}
	hs := w.hs
	ranks := make([]sidechannel.Rank, len(plan.targets))
	for i, t := range plan.targets {
		ranks[i] = sidechannel.Rank{PP: w.cfg.PPRank, TP: t}
	}
	deadline := time.Now().Add(time.Duration(w.cfg.HandshakeTimeout * float64(time.Second)))
	w.goSafe("handshake with "+key, onPanic, func() {
		// A busy or just-starting peer can miss one query's receive
		// timeout; retry transient failures until handshake_timeout, never
		// a compatibility or identity mismatch, nor a refused connection
		// (nothing listens there: its requests fail now, not in 30 s).
		for attempt := 1; ; attempt++ {
			f := hs.Start(host, port, engineID, ranks...)
			<-f.Done()
			res, err := f.Result()
			if err == nil || !retryableHandshake(err) || time.Now().Add(250*time.Millisecond).After(deadline) {
				// Loading the agents and preparing the descriptor lists
				// (the costly part for a large model) happen here, on the
				// handshake goroutine, without the worker's lock: reads
				// from other engines go on meanwhile.
				var re *remoteEngine
				if err == nil {
					re, err = w.prepareRemote(engineID, host, port, plan, res)
				}
				w.finishHandshake(engineID, host, port, re, err)
				return
			}
			w.log.Warn("handshake attempt failed; retrying", zap.String("remote_engine_id", engineID), zap.Int("attempt", attempt), zap.Error(err))
			time.Sleep(250 * time.Millisecond)
		}
	})
}

// planFor maps this worker onto a remote engine of tp_size remoteTP
// (tpmap.go), refusing what cannot be mapped.
func (w *Worker) planFor(remoteTP int) (tpPlan, error) {
	kvHeads := int(w.geometryOf(w.layout).NumKVHeads)
	mla, other := 0, 0
	for _, r := range w.layout.Regions {
		if r.Kind == LayerKindMLA {
			mla++
		} else {
			other++
		}
	}
	if mla > 0 && other > 0 && remoteTP != w.cfg.TPSize {
		return tpPlan{}, fmt.Errorf("heterogeneous TP (remote %d) with both MLA and other attention layers is not supported", remoteTP)
	}
	return planTP(w.cfg.TPRank, w.cfg.TPSize, remoteTP, kvHeads, mla > 0)
}

func retryableHandshake(err error) bool {
	if errors.Is(err, sidechannel.ErrCompatMismatch) || errors.Is(err, sidechannel.ErrEngineMismatch) || errors.Is(err, sidechannel.ErrClosed) ||
		errors.Is(err, sidechannel.ErrRefused) {
		return false
	}
	var re *sidechannel.RemoteError
	return !errors.As(err, &re)
}

// finishHandshake runs on the handshake goroutine: it installs the remote
// engine prepared by prepareRemote and posts the READs that waited for it,
// or fails them.
func (w *Worker) finishHandshake(engineID, host string, port int, re *remoteEngine, err error) {
	defer w.lockTimed("handshake result")()
	key := hsKey(engineID, host, port)
	hsState := w.handshakes[key]
	if w.closed {
		delete(w.handshakes, key)
		if re != nil {
			re.release(w.agent)
		}
		return
	}
	if err == nil {
		w.installRemoteLocked(re)
	}
	if err != nil {
		w.stats.RecordFailedHandshake()
		w.logFailure("handshake_failed", nil, fmt.Sprintf("engine %s at %s:%d", engineID, host, port), err)
		if !errors.Is(err, errPanicked) {
			w.hsGuard.failed(key, err) // a bug is not the peer's failure
		}
	} else {
		w.hsGuard.succeeded(key)
		w.touchRemoteLocked(re)
		w.log.Info("handshake done", zap.String("remote_engine_id", engineID), zap.Strings("remote_agents", re.agents()),
			zap.String("tp_mapping", re.plan.String()), zap.Int("block_ratio", re.blockRatio),
			zap.Float64("clock_offset", re.offset), zap.Duration("rtt", re.rtt))
		if ei, ok := w.agent.(nixl.EndpointDescriber); ok && !w.loggedLanes {
			// Which transports UCX picked: a misconfiguration (TCP where
			// shared memory was expected) is visible here.
			w.loggedLanes = true
			w.log.Info("transport lanes of the first endpoint", zap.String("lanes", ei.EndpointInfo()))
		}
	}
	// Removed only now: after a panic above, the entry is still here and
	// the recovery fails its waiting requests.
	delete(w.handshakes, key)
	// What the handshake says of the agents push waits registered with.
	w.pushHandshakeSeenLocked(engineID, host, port, re, err)
	// Off vLLM's thread: the next step must poll (posted READs, failures).
	defer w.publishLocked(true)
	if hsState == nil {
		return
	}
	if len(hsState.pushWaiting)+len(hsState.cancelReplies) > 0 {
		w.pushHandshakeDoneLocked(hsState, engineID, re, err)
	}
	for _, id := range hsState.waiting {
		st, ok := w.recv[id]
		if !ok || !st.waiting {
			continue
		}
		st.waiting = false
		if err != nil {
			w.failLocked(st, "handshake_failed", "", err)
			continue
		}
		w.readLocked(st)
	}
}

// maxRemoteDescs bounds the descriptors prepared for one remote engine: a
// peer's num_blocks is its own word, and a lying one must get an error, not
// an allocation that kills vLLM's process. Generous against real peers
// (a prefill's rank holds at most a few times a decode rank's blocks).
func maxRemoteDescs(localDescs int64) int64 {
	return max(16*localDescs, 1<<22)
}

// prepareRemote checks every remote rank's metadata against this worker's
// layout and the TP plan, loads the agents and prepares the descriptor
// lists of the slices this worker reads (and the local slot lists they land
// in). It runs on the handshake goroutine without the worker's lock: only
// immutable worker state (the layout, the config) and the agent (which
// locks itself) are used.
func (w *Worker) prepareRemote(engineID, host string, port int, plan tpPlan, res *sidechannel.Result) (_ *remoteEngine, err error) {
	re := &remoteEngine{id: engineID, plan: plan, regions: len(w.layout.Regions), offset: res.ClockOffset, rtt: res.BestRTT, host: host, port: port}
	defer func() {
		if err != nil {
			re.release(w.agent)
		}
	}()
	mine := w.geometryOf(w.layout)
	for _, tp := range plan.targets {
		rank := sidechannel.Rank{PP: w.cfg.PPRank, TP: tp}
		md, ok := res.Agents[rank]
		if !ok || md == nil {
			return nil, fmt.Errorf("remote engine %s returned no metadata for pp_rank %d tp_rank %d", engineID, rank.PP, rank.TP)
		}
		if md.NumBlocks <= 0 || md.NumBlocks > 1<<31 {
			return nil, fmt.Errorf("remote engine %s advertises num_blocks=%d", engineID, md.NumBlocks)
		}
		if re.numBlocks != 0 && md.NumBlocks != re.numBlocks {
			return nil, fmt.Errorf("remote engine %s: tp_rank %d has %d blocks, tp_rank %d %d (the ranks of one engine must agree)", engineID, tp, md.NumBlocks, plan.targets[0], re.numBlocks)
		}
		re.numBlocks = md.NumBlocks
		ratio, err := checkRemoteLayout(w.layout, w.blockSize, w.kvLayout, w.attnBackend, w.blockReshape, mine, plan, md)
		if err != nil {
			return nil, fmt.Errorf("remote engine %s (pp_rank %d, tp_rank %d) cannot exchange KV with this engine: it %w", engineID, rank.PP, rank.TP, err)
		}
		if re.blockRatio != 0 && ratio != re.blockRatio {
			return nil, fmt.Errorf("remote engine %s: its ranks advertise different block sizes", engineID)
		}
		re.blockRatio = ratio
		re.gonixl = md.Geometry != ""
		re.instance = md.Instance
		n := int64(len(md.KVCachesBaseAddr)) * md.NumBlocks
		if n > math.MaxInt32 || n > maxRemoteDescs(int64(len(w.layout.Regions))*w.layout.NumBlocks) {
			return nil, fmt.Errorf("remote engine %s (tp_rank %d) advertises %d regions x %d blocks, more descriptors than this engine accepts from a peer (%d here)",
				engineID, tp, len(md.KVCachesBaseAddr), md.NumBlocks, int64(len(w.layout.Regions))*w.layout.NumBlocks)
		}
		name, err := w.agent.LoadRemoteMetadata(md.AgentMetadata)
		if err != nil {
			return nil, fmt.Errorf("load remote agent metadata (tp_rank %d): %w", tp, err)
		}
		rr := &remoteRank{tp: tp, agent: name}
		re.ranks = append(re.ranks, rr)
		slot := slices.Index(plan.sources, tp)
		if slot < 0 {
			continue // notified, not read
		}
		rr.slot = slot
		regs := make([]Region, len(md.KVCachesBaseAddr))
		for i := range regs {
			off, n := plan.readSlice(w.layout.Regions[i].Len)
			regs[i] = Region{Base: md.KVCachesBaseAddr[i] + off, Len: n / uint64(ratio), Stride: uint64(md.BlockStrides[i]), Group: w.layout.Regions[i].Group}
		}
		// The engine checks every descriptor against the regions the peer
		// registered: a lying peer gets an error here, not a wild read.
		rr.list, err = nixl.PrepStrided(w.agent, name, w.layout.Mem, layoutRuns(regs, md.NumBlocks, uint64(md.DeviceID)))
		if err != nil {
			return nil, fmt.Errorf("prepare remote descriptors (tp_rank %d): %w", tp, err)
		}
	}
	if plan.nSlots > 1 {
		if err := w.ensureSlotLists(plan.nSlots); err != nil {
			return nil, err
		}
	}
	if re.blockRatio > 1 {
		if err := w.ensureSubList(re.blockRatio); err != nil {
			return nil, err
		}
	}
	return re, nil
}

// ensureSubList prepares, once per ratio n, the local descriptor list that
// cuts every block of every region into n equal sub-blocks, each the size
// of a remote block: sub-block j of block b of region i is descriptor
// (i*n + j)*NumBlocks + b. Called without the worker's lock.
func (w *Worker) ensureSubList(n int) error {
	w.mu.Lock()
	_, ok := w.subLists[n]
	w.mu.Unlock()
	if ok {
		return nil
	}
	regs := make([]Region, 0, len(w.layout.Regions)*n)
	for _, r := range w.layout.Regions {
		part := r.Len / uint64(n)
		for j := 0; j < n; j++ {
			regs = append(regs, Region{Base: r.Base + uint64(j)*part, Len: part, Stride: r.Stride, Group: r.Group})
		}
	}
	l, err := nixl.PrepStrided(w.agent, "", w.layout.Mem, layoutRuns(regs, w.layout.NumBlocks, w.layout.DeviceID))
	if err != nil {
		return fmt.Errorf("prepare local descriptors in %d sub-blocks: %w", n, err)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.subLists[n]; ok || w.closed {
		_ = l.Release()
		return nil
	}
	w.subLists[n] = l
	return nil
}

// ensureSlotLists prepares, once per slot count, the local descriptor
// lists that split each local block into n equal slots (a decode rank
// reading several prefill ranks: slot i receives source i's heads). Called
// without the worker's lock; a concurrent twin's lists are released.
func (w *Worker) ensureSlotLists(n int) error {
	w.mu.Lock()
	_, ok := w.slotLists[n]
	w.mu.Unlock()
	if ok {
		return nil
	}
	lists := make([]nixl.DescList, n)
	release := func() {
		for _, l := range lists {
			if l != nil {
				_ = l.Release()
			}
		}
	}
	for slot := range lists {
		regs := make([]Region, len(w.layout.Regions))
		for i, r := range w.layout.Regions {
			part := r.Len / uint64(n)
			regs[i] = Region{Base: r.Base + uint64(slot)*part, Len: part, Stride: r.Stride, Group: r.Group}
		}
		l, err := nixl.PrepStrided(w.agent, "", w.layout.Mem, layoutRuns(regs, w.layout.NumBlocks, w.layout.DeviceID))
		if err != nil {
			release()
			return fmt.Errorf("prepare local descriptors for %d slots: %w", n, err)
		}
		lists[slot] = l
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.slotLists[n]; ok || w.closed {
		release()
		return nil
	}
	w.slotLists[n] = lists
	return nil
}

// installRemoteLocked makes re the remote engine for its id, replacing (and
// releasing) an older one.
func (w *Worker) installRemoteLocked(re *remoteEngine) {
	if old, ok := w.remotes[re.id]; ok {
		// An engine handshaken again at another address may be the same
		// process: its agents are shared with the new entry.
		keep := map[string]bool{}
		for _, a := range re.agents() {
			keep[a] = true
		}
		for _, r := range old.ranks {
			if r.list != nil {
				_ = r.list.Release()
			}
			if !keep[r.agent] {
				_ = w.agent.InvalidateRemote(r.agent)
			}
		}
	}
	w.remotes[re.id] = re
}

// dropRemoteOnDisconnect forgets a remote engine whose peer is gone, so the
// next request re-handshakes (a restarted prefill gets a fresh agent).
func (w *Worker) dropRemoteOnDisconnect(re *remoteEngine, err error) {
	if !errors.Is(err, nixl.ErrRemoteDiscon) {
		return
	}
	if w.dropRemoteLocked(re) {
		w.log.Warn("remote engine disconnected; it will be re-handshaken on next use", zap.String("remote_engine_id", re.id))
	}
	w.pushPeerLostLocked(re.id)
}

// dropRemoteLocked forgets a remote engine (its prepared list and agent),
// so the next request for it handshakes again. Transfers still in flight
// keep their own references and finish or fail on their own. A push wait
// on the engine is not ended: dropping a connection does not stop the
// engine from writing (push_recv.go).
func (w *Worker) dropRemoteLocked(re *remoteEngine) bool {
	cur, ok := w.remotes[re.id]
	if !ok || cur != re {
		return false
	}
	delete(w.remotes, re.id)
	re.release(w.agent)
	return true
}
