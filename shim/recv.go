// The receiving side (a decode's worker): posting a request's READ,
// polling it to completion, failing it within transfer_timeout, and
// reporting it to vLLM (finished_recving, failed_recving, load errors).

package shim

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/shim/kvwire"
)

type recvState struct {
	id      string
	meta    *RecvReq
	xfers   []*inflight
	waiting bool // for a handshake
	failed  bool
	report  bool // vLLM tracks it in _recving_metadata
	// failedSent: failed_recving was reported (reportFailedLocked); with a
	// stuck handle that happens before finished_recving (holdStuckLocked).
	failedSent bool
	remote     *remoteEngine
	// reshape: the blocks read from an engine of a smaller block size,
	// reported with finished_recving for the Python side to rearrange.
	reshape []BlockReshape
	// push: push mode, the wait for the prefill's WRITE (push_recv.go).
	push *pushWait
	// check: the prefill's digests of the blocks read (kvdigest.go), nil
	// when read unchecked.
	check *digestCheck
	// lateAt: a kvfault-late READ waits until then (kvfault.go).
	lateAt float64
	// checking: the hashing of the blocks read, once every READ completed
	// (kvdigest.go checkDoneLocked).
	checking chan digestResult
	// unwatch ends the goroutine that starts the check once the READs
	// landed (kvdigest.go watchLandingLocked), nil when none runs.
	unwatch func()
}

type inflight struct {
	x        nixl.Xfer
	posted   float64 // this worker's clock
	deadline float64
	slow     bool // "still in flight" was logged
	// post: its post by the poster (post.go), until its result was taken;
	// nil for one posted in place. what names it in a failure's log line.
	post *postState
	what string
	// A handle the engine would not release (a READ it cannot cancel):
	// stuck is when that was first seen, nextTry the next attempt. Its
	// request is reported failed but not finished receiving until the
	// handle is released, so vLLM cannot reuse blocks the READ may still
	// write.
	stuck, nextTry float64
	stuckLogged    float64 // last time it was logged
}

// stuckRetry is the period of release attempts for a stuck handle, and
// stuckLogEvery how often one still stuck is logged again.
const (
	stuckRetry    = 1.0
	stuckLogEvery = 60.0
)

// slowReadAfter is how long a READ may stay in flight before the worker logs
// it (once, then again when it ends): READs take milliseconds, and a stall
// is otherwise invisible until transfer_timeout or the lease fails it.
const slowReadAfter = 5.0 // seconds

// startReadsLocked starts the step's READs (or their handshakes), in
// request-id order.
func (w *Worker) startReadsLocked(m *StepMeta) {
	ids := make([]string, 0, len(m.ReqsToRecv))
	for id := range m.ReqsToRecv {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		rr := m.ReqsToRecv[id]
		old, dup := w.recv[id]
		if dup && (old.waiting || len(old.xfers) > 0) {
			w.log.Warn("request is already loading; ignoring the second load", zap.String("req_id", id))
			continue
		}
		if dup {
			w.stopWatchLocked(old) // replaced: nobody takes its check
		}
		st := &recvState{id: id, meta: rr, report: rr.AwaitingKVs || !rr.LocalBlockIDs.Empty()}
		w.recv[id] = st
		w.readLocked(st)
	}
}

// readLocked posts the READ for one request, or queues it behind a
// handshake. Failures are recorded on the request, never returned: one bad
// request must not stop the step.
func (w *Worker) readLocked(st *recvState) {
	rm := &st.meta.Remote
	if rm.EngineID == "" {
		w.stats.RecordFailedTransfer()
		w.failLocked(st, "transfer_setup_failed", "kv_transfer_params has no remote_engine_id", nil)
		return
	}
	re, ok := w.remotes[rm.EngineID]
	if ok && (re.host != rm.Host || re.port != rm.Port) {
		// The request names the engine at another address: a restarted
		// prefill that kept its engine_id, or a wrong (or forged) address.
		// The working connection stays until a handshake at the new address
		// succeeds with that same engine id; only then is it replaced.
		w.log.Info("request names a known remote engine at another address; handshaking there", zap.String("remote_engine_id", re.id),
			zap.String("known", fmt.Sprintf("%s:%d", re.host, re.port)), zap.String("requested", fmt.Sprintf("%s:%d", rm.Host, rm.Port)))
		ok = false
	}
	if !ok {
		st.waiting = true
		w.startHandshakeLocked(rm.EngineID, rm.Host, rm.Port, st.meta.TPSize, st.id)
		return
	}
	if w.agentBusyLocked() {
		// Another peer's first contact, or a post, holds the agent: post
		// next time.
		w.deferReadLocked(st)
		return
	}
	st.waiting = false
	st.remote = re
	w.touchRemoteLocked(re)
	if st.meta.TPSize != re.plan.remoteTP {
		w.stats.RecordFailedTransfer()
		w.failLocked(st, "transfer_setup_failed", fmt.Sprintf("kv_transfer_params say tp_size %d, but engine %s was handshaken with tp_size %d", st.meta.TPSize, re.id, re.plan.remoteTP), nil)
		return
	}
	if st.meta.Push {
		w.registerPushLocked(st, re)
		return
	}
	if rm.Instance != "" && rm.Instance != re.instance {
		// The params were made by another process than the one serving
		// this engine id at this address now (a restart): its blocks hold
		// other KV. Not read, and not notified either (the new process
		// has no such request).
		w.stats.RecordFailedTransfer()
		w.failLocked(st, "transfer_setup_failed", fmt.Sprintf("engine %s restarted since it made these params (instance %s, now %q): not reading its blocks",
			re.id, rm.Instance, re.instance), nil)
		return
	}
	// vLLM's "<req>:<consumers>": how many decode ranks notify each
	// prefill rank (tpmap.go).
	notif := kvwire.DoneNotif(rm.RequestID, re.plan.consumers)
	local, remote, err := w.pairBlocks(st.meta, re)
	if err != nil {
		w.stats.RecordFailedTransfer()
		w.failLocked(st, "transfer_setup_failed", err.Error(), nil)
		return
	}
	readKey := re.id + "\x00" + rm.RequestID
	if len(local) == 0 {
		if _, reading := w.read.Deadline(readKey); reading {
			// Another request of this worker read, or reads, these
			// blocks: its notification (after its READ) frees them. One
			// sent now could free them under that READ.
			return
		}
		// Full local prefix hit or abort before scheduling: tell the
		// prefill it can free its blocks now. They are then consumed: a
		// second request with the same params must not read them.
		w.consumeRemoteLocked(st, readKey)
		w.released.Raise(readKey, w.clock()+2*max(w.cfg.KVLeaseDuration, w.cfg.DecoderKVBlocksTTL))
		w.notifyRanksLocked(st, re, notif, nil, "P worker blocks will be freed after timeout. This may indicate network issues.")
		return
	}
	if _, again := w.read.Deadline(readKey); again {
		// This engine read these blocks already and told the remote it
		// was done with them: they may hold another request's KV now.
		w.stats.RecordFailedTransfer()
		w.failLocked(st, "transfer_setup_failed", fmt.Sprintf("the blocks of request %s on engine %s were read by this engine already (retried or replayed kv_transfer_params); not reading blocks the remote may have reused",
			rm.RequestID, re.id), nil)
		return
	}
	fault := w.kvFaultFor(st.id)
	if fault == faultLate && w.lateFaultLocked(st, re, notif) {
		return
	}
	if left := w.leaseLeft(st); left < w.leaseMargin && fault != faultLate {
		// The remote's lease ends before a READ could safely complete.
		w.stats.RecordKVExpired()
		w.failLocked(st, "kv_lease_expired", fmt.Sprintf("the remote lease ends in %.1fs (< %.2gs safety margin; %s); not reading blocks the prefill may reuse",
			left, w.leaseMargin, w.leaseDetail(st)), nil)
		// Nothing will be read: let the prefill free the blocks now rather
		// than at its lease's end.
		w.consumeRemoteLocked(st, readKey)
		w.released.Raise(readKey, w.clock()+2*max(w.cfg.KVLeaseDuration, w.cfg.DecoderKVBlocksTTL))
		w.notifyRanksLocked(st, re, notif, nil, "")
		return
	}
	st.check = w.digestCheckLocked(st, re, local, remote)
	if fault == faultTail {
		local, remote = tailFault(local, remote)
	}
	mk := w.xferMaker(local, remote, re.numBlocks)
	if re.blockRatio > 1 {
		mk = w.subBlockXferMaker(local, remote, re.numBlocks, re.blockRatio)
		st.reshape = st.reshape[:0]
		for g := range local {
			if len(local[g]) > 0 {
				st.reshape = append(st.reshape, BlockReshape{Ratio: re.blockRatio, Blocks: local[g], Covered: len(remote[g])})
			}
		}
	}
	w.consumeRemoteLocked(st, readKey)
	read := map[string]bool{}
	// One READ per remote rank read, each carrying its notification.
	for _, rr := range re.ranks {
		if rr.list == nil {
			continue
		}
		x, err := mk(w.localListFor(re, rr), rr.list, notif)
		if err != nil {
			w.stats.RecordFailedTransfer()
			w.failLocked(st, "transfer_setup_failed", fmt.Sprintf("remote tp_rank %d", rr.tp), err)
			return
		}
		now := w.clock()
		f := &inflight{x: x, posted: now, deadline: now + w.cfg.TransferTimeout, what: fmt.Sprintf("remote tp_rank %d", rr.tp)}
		if err := w.postLocked(f); err != nil {
			if w.postFailedLocked(st, f, now, err) {
				st.xfers = append(st.xfers, f)
			}
			return
		}
		// Posted, or queued for the poster (post.go): in flight either way.
		read[rr.agent] = true
		st.xfers = append(st.xfers, f)
	}
	w.watchLandingLocked(st)
	// Ranks handshaken with but not read (MLA's single reader, duplicate
	// GQA heads) are told now that this decode rank is done with them.
	w.notifyRanksLocked(st, re, notif, read, "Remote rank will not update request state. This may indicate network issues.")
}

// postFailedLocked fails st for its READ f whose Post failed (in place, or
// on the poster: reported at the next poll) and releases the handle. Part
// of the READ may be out and still writing when the release is refused:
// the handle, and the request's blocks, are then held until it can be
// released (as for a READ that timed out): kept is true, and the caller
// keeps f in st.xfers.
func (w *Worker) postFailedLocked(st *recvState, f *inflight, now float64, err error) (kept bool) {
	w.stats.RecordFailedTransfer()
	w.failLocked(st, "transfer_failed", f.what, err)
	if rerr := f.x.Release(); rerr != nil {
		f.deadline = now
		w.holdStuckLocked(st, f, now, rerr)
		kept = true
	}
	if st.remote != nil {
		w.dropRemoteOnDisconnect(st.remote, err)
	}
	return kept
}

// consumeRemoteLocked remembers that this worker read (or told the remote
// it will not read) the remote blocks of st, until their lease surely
// ended (their expiry, or the longest lease either role holds when the
// remote sent none): the remote frees them on this worker's notification,
// so the same params again must not read them.
func (w *Worker) consumeRemoteLocked(st *recvState, key string) {
	until := w.clock() + 2*max(w.cfg.KVLeaseDuration, w.cfg.DecoderKVBlocksTTL)
	if left := w.leaseLeft(st); !math.IsInf(left, 1) {
		until = w.clock() + max(left, 0) + w.cfg.KVLeaseDuration
	}
	w.read.Raise(key, until)
}

// localListFor is the local descriptor list a transfer with remote rank rr
// of re uses: every block whole, or (more ranks there than here, for
// distinct heads) cut in the plan's slots, or (a smaller block size there)
// in sub-blocks.
func (w *Worker) localListFor(re *remoteEngine, rr *remoteRank) nixl.DescList {
	switch {
	case re.blockRatio > 1:
		return w.subLists[re.blockRatio]
	case re.plan.nSlots > 1:
		return w.slotLists[re.plan.nSlots][rr.slot]
	}
	return w.localList
}

// notifyRanksLocked sends notif to every rank of re not in skip.
func (w *Worker) notifyRanksLocked(st *recvState, re *remoteEngine, notif []byte, skip map[string]bool, failMsg string) {
	for _, rr := range re.ranks {
		if skip[rr.agent] {
			continue
		}
		if err := w.agent.SendNotif(rr.agent, notif); err != nil {
			w.stats.RecordFailedNotification()
			if failMsg != "" {
				w.logFailure("notification_failed", st, fmt.Sprintf("%s (remote tp_rank %d)", failMsg, rr.tp), err)
			}
		}
	}
}

// pairBlocks validates and pairs local and remote block ids, group by
// group. An empty local side means nothing to read (a full local prefix
// hit, or an abort before scheduling). With a local prefix-cache hit the
// local list is shorter: only the tail of the remote blocks is read, which
// is right only when the remote list covers exactly the prompt this engine
// allocated for — so a full-attention group's remote list must have exactly
// as many blocks as this engine holds for the prompt (cached + to read),
// and a sliding-window group's no more than its window. Anything else is a
// kv_transfer_params that does not belong to this request, and reading it
// would compute from someone else's KV.
func (w *Worker) pairBlocks(rr *RecvReq, re *remoteEngine) (BlockIDs, BlockIDs, error) {
	local, remote := rr.LocalBlockIDs, rr.Remote.BlockIDs
	if local.Empty() {
		return nil, nil, nil
	}
	if re.blockRatio > 1 {
		return w.pairSubBlocks(rr, re)
	}
	groups := w.cfg.TransferGroups
	ng := max(len(groups), 1)
	if len(local) != ng {
		return nil, nil, fmt.Errorf("%d local KV-cache groups in the step metadata, this engine has %d", len(local), ng)
	}
	if len(remote) != ng {
		return nil, nil, fmt.Errorf("the remote engine sent block ids for %d KV-cache groups, this engine has %d", len(remote), ng)
	}
	outR := make(BlockIDs, ng)
	for g := range local {
		l, r := local[g], remote[g]
		window := 0
		if g < len(groups) && w.cfg.HMARequired {
			window = groups[g].blocksInWindow()
		}
		if rr.Readback && window == 0 && g < len(rr.LocalNumComputed) && int64(len(l)) > 0 {
			// The decode's list runs over its prompt and output; this
			// engine reads only up to what it allocated (vLLM's end trim).
			if need := rr.LocalNumComputed[g] + int64(len(l)); int64(len(r)) >= need {
				r = r[:need]
			}
		}
		switch {
		case window > 0 && len(r) > window:
			return nil, nil, fmt.Errorf("group %d: %d remote block ids for a sliding window of %d blocks", g, len(r), window)
		case window == 0 && g < len(rr.LocalNumComputed) && int64(len(l)) > 0 && int64(len(r)) != rr.LocalNumComputed[g]+int64(len(l)):
			return nil, nil, fmt.Errorf("group %d: the remote engine sent %d block ids, but this prompt takes %d blocks here (%d cached locally + %d to read): the kv_transfer_params do not belong to this prompt",
				g, len(r), rr.LocalNumComputed[g]+int64(len(l)), rr.LocalNumComputed[g], len(l))
		case len(l) > len(r):
			return nil, nil, fmt.Errorf("group %d: %d local blocks but the remote engine sent only %d block ids", g, len(l), len(r))
		}
		r = r[len(r)-len(l):]
		if err := w.checkBlockRange(l, r, re); err != nil {
			return nil, nil, err
		}
		outR[g] = r
	}
	if int64(len(w.layout.Regions))*max(w.layout.NumBlocks, re.numBlocks) > 1<<31-1 {
		return nil, nil, errors.New("descriptor ids exceed int32")
	}
	return local, outR, nil
}

// checkBlockRange checks local and remote block ids against the block
// counts of this engine and of re.
func (w *Worker) checkBlockRange(local, remote []int64, re *remoteEngine) error {
	for _, b := range local {
		if b < 0 || b >= w.layout.NumBlocks {
			return fmt.Errorf("local block id %d out of range [0, %d)", b, w.layout.NumBlocks)
		}
	}
	for _, b := range remote {
		if b < 0 || b >= re.numBlocks {
			return fmt.Errorf("remote block id %d out of range [0, %d) of engine %s", b, re.numBlocks, re.id)
		}
	}
	return nil
}

// pairSubBlocks is pairBlocks for a remote engine whose block size is this
// engine's divided by re.blockRatio (n): every local block to read takes n
// remote blocks, one after another. The remote list covers the prompt in
// remote blocks, so it must take exactly as many local blocks as this
// engine holds for the prompt (cached + to read); the remote blocks of the
// cached local blocks are skipped. The returned remote list of a group has
// more than (len(local)-1)*n and at most len(local)*n entries: the tail of
// the last local block may stay unwritten.
func (w *Worker) pairSubBlocks(rr *RecvReq, re *remoteEngine) (BlockIDs, BlockIDs, error) {
	local, remote := rr.LocalBlockIDs, rr.Remote.BlockIDs
	n := int64(re.blockRatio)
	ng := max(len(w.cfg.TransferGroups), 1)
	switch {
	case len(local) != ng:
		return nil, nil, fmt.Errorf("%d local KV-cache groups in the step metadata, this engine has %d", len(local), ng)
	case len(remote) != ng:
		return nil, nil, fmt.Errorf("the remote engine sent block ids for %d KV-cache groups, this engine has %d", len(remote), ng)
	case rr.Readback:
		return nil, nil, errors.New("reading a conversation back from an engine of a smaller block size is not supported")
	}
	outR := make(BlockIDs, ng)
	for g := range local {
		l, r := local[g], remote[g]
		if len(l) == 0 {
			continue
		}
		rbs := w.blockSize / n
		if t := rr.Remote.NumTokens; t > 0 && int64(len(r)) != (t+rbs-1)/rbs {
			return nil, nil, fmt.Errorf("group %d: the remote engine sent %d block ids of %d tokens for a prompt of %d tokens (%d blocks): the kv_transfer_params do not belong to this prompt",
				g, len(r), rbs, t, (t+rbs-1)/rbs)
		}
		held := (int64(len(r)) + n - 1) / n // local blocks the remote list fills
		cached := held - int64(len(l))
		if g < len(rr.LocalNumComputed) && rr.LocalNumComputed[g] != cached {
			return nil, nil, fmt.Errorf("group %d: the remote engine sent %d block ids of %d tokens (%d blocks of %d here), but this prompt takes %d blocks here (%d cached locally + %d to read): the kv_transfer_params do not belong to this prompt",
				g, len(r), rbs, held, w.blockSize, rr.LocalNumComputed[g]+int64(len(l)), rr.LocalNumComputed[g], len(l))
		}
		if cached < 0 {
			return nil, nil, fmt.Errorf("group %d: %d local blocks but the remote engine sent only %d block ids of %d tokens", g, len(l), len(r), rbs)
		}
		r = r[cached*n:]
		if err := w.checkBlockRange(l, r, re); err != nil {
			return nil, nil, err
		}
		outR[g] = r
	}
	if int64(len(w.layout.Regions))*n*max(w.layout.NumBlocks, re.numBlocks) > 1<<31-1 {
		return nil, nil, errors.New("descriptor ids exceed int32")
	}
	return local, outR, nil
}

// subBlockXferMaker returns how a READ from an engine of a block size n
// times smaller is made: remote block k of a group's list lands in
// sub-block k%n of local block k/n, in every region (the regions serve
// every group: blockRatio refuses separate group regions). The local list
// is w.subLists[n]. The descriptor pairs are built here in one pass and
// handed over whole.
func (w *Worker) subBlockXferMaker(local, remote BlockIDs, remoteNumBlocks int64, n int) func(l, r nixl.DescList, notif []byte) (nixl.Xfer, error) {
	total := 0
	for _, g := range remote {
		total += len(g)
	}
	regions := int64(len(w.layout.Regions))
	nb, k64 := w.layout.NumBlocks, int64(n)
	// The pairs of region 0, group-major (sub-block j of local block b is
	// local descriptor j*nb+b there); region i's are those plus the
	// region's first descriptor on each side (i*n*nb, i*remoteNumBlocks).
	lrel, rrel := make([]int64, 0, total), make([]int64, 0, total)
	for g := range remote {
		for k, rb := range remote[g] {
			lrel = append(lrel, int64(k%n)*nb+local[g][k/n])
			rrel = append(rrel, rb)
		}
	}
	lidx := make([]int32, 0, total*int(regions))
	ridx := make([]int32, 0, total*int(regions))
	for i := int64(0); i < regions; i++ {
		lidx = appendOffset(lidx, i*k64*nb, lrel)
		ridx = appendOffset(ridx, i*remoteNumBlocks, rrel)
	}
	return func(l, r nixl.DescList, notif []byte) (nixl.Xfer, error) {
		return w.agent.MakeXfer(nixl.Read, l, lidx, r, ridx, notif)
	}
}

// regionDescIDs lists the descriptor ids (region r, block b: r*numBlocks+b)
// of a request's blocks, as vLLM's NixlConnector does: when every region
// serves the same groups (one group, or groups sharing every tensor), each
// region reads every group's blocks; otherwise group g's blocks are read
// from the regions of group g and the shared ones. Local and remote lists
// built from paired block ids with the same regions correspond entry by
// entry.
// xferMaker returns how this request's READ from one remote rank is made.
// When every region holds every block (one KV-cache group, or groups that
// share their regions) the descriptor pairs are the product of the regions
// and the block pairs, and the engine is given that structure
// (nixl.MakeXferBlocks: no per-descriptor index arrays here, and on an
// engine that keeps it none at all); otherwise the index arrays of
// regionDescIDs.
func (w *Worker) xferMaker(local, remote BlockIDs, remoteNumBlocks int64) func(l, r nixl.DescList, notif []byte) (nixl.Xfer, error) {
	return w.xferMakerOp(nixl.Read, local, remote, remoteNumBlocks)
}

// xferMakerOp is xferMaker for a READ or (push mode) a WRITE.
func (w *Worker) xferMakerOp(op nixl.XferOp, local, remote BlockIDs, remoteNumBlocks int64) func(l, r nixl.DescList, notif []byte) (nixl.Xfer, error) {
	regions := w.layout.Regions
	if !regionsMapped(regions) {
		lb, rb := flatBlocks(local), flatBlocks(remote)
		br := make([]nixl.BlockRegion, len(regions))
		for i := range regions {
			br[i] = nixl.BlockRegion{Local: int32(int64(i) * w.layout.NumBlocks), Remote: int32(int64(i) * remoteNumBlocks)}
		}
		return func(l, r nixl.DescList, notif []byte) (nixl.Xfer, error) {
			return nixl.MakeXferBlocks(w.agent, op, l, r, br, lb, rb, notif)
		}
	}
	lidx := regionDescIDs(regions, w.layout.NumBlocks, local)
	ridx := regionDescIDs(regions, remoteNumBlocks, remote)
	return func(l, r nixl.DescList, notif []byte) (nixl.Xfer, error) {
		return w.agent.MakeXfer(op, l, lidx, r, ridx, notif)
	}
}

// regionsMapped reports whether regions belong to different KV-cache
// groups (each group's blocks then go to its own regions).
func regionsMapped(regions []Region) bool {
	for _, r := range regions[1:] {
		if r.Group != regions[0].Group {
			return true
		}
	}
	return false
}

func flatBlocks(ids BlockIDs) []int32 {
	out := make([]int32, 0, ids.Count())
	for _, g := range ids {
		for _, b := range g {
			out = append(out, int32(b))
		}
	}
	return out
}

func regionDescIDs(regions []Region, numBlocks int64, ids BlockIDs) []int32 {
	n := 0
	for _, g := range ids {
		n += len(g)
	}
	out := make([]int32, 0, n*len(regions))
	if !regionsMapped(regions) {
		for ri := range regions {
			off := int64(ri) * numBlocks
			for _, g := range ids {
				out = appendOffset(out, off, g)
			}
		}
		return out
	}
	for gi, g := range ids {
		for ri, r := range regions {
			if r.Group != gi && r.Group != SharedGroup {
				continue
			}
			out = appendOffset(out, int64(ri)*numBlocks, g)
		}
	}
	return out
}

// appendOffset appends off+b for every block b of g to out, which has the
// room: one slice extension and a plain loop instead of an append (with
// its capacity check) per descriptor. The ids fit in int32 (pairBlocks).
func appendOffset(out []int32, off int64, g []int64) []int32 {
	n := len(out)
	out = slices.Grow(out, len(g))[:n+len(g)]
	dst := out[n:]
	for k, b := range g {
		dst[k] = int32(off + b)
	}
	return out
}

func (w *Worker) pollTransfersLocked() {
	now := w.clock()
	ids := make([]string, 0, len(w.recv))
	for id := range w.recv {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		st := w.recv[id]
		if st.waiting || st.push != nil {
			continue
		}
		kept := st.xfers[:0]
		for _, f := range st.xfers {
			if f.stuck > 0 {
				// Already failed; only the handle is left to release.
				if !w.retryStuckLocked(st, f, now) {
					kept = append(kept, f)
				}
				continue
			}
			perr, returned := f.takePostResult()
			if !returned {
				// Still being posted (post.go): in flight, never released
				// or timed out before its Post returned.
				kept = append(kept, f)
				continue
			}
			if perr != nil {
				if w.postFailedLocked(st, f, now, perr) {
					kept = append(kept, f)
				}
				continue
			}
			var status nixl.Status
			var err error
			if tc, ok := f.x.(nixl.TryChecker); ok && now < f.deadline {
				// Never behind the engine's own thread: a transfer whose
				// engine is busy counts as in flight until the next poll
				// (InProgress, nil). At its deadline it is checked, waiting.
				status, err, _ = tc.TryCheck()
			} else {
				status, err = f.x.Check()
			}
			switch {
			case err == nil && status == nixl.Success:
				if f.slow {
					w.log.Warn("slow READ completed", zap.String("request_id", st.id),
						zap.String("remote_engine_id", st.meta.Remote.EngineID), zap.Float64("seconds", now-f.posted))
				}
				if t, ts := f.x.Telemetry(); ts == nixl.Success {
					w.stats.RecordTransfer(t.XferDur.Seconds(), t.PostDur.Seconds(), t.Bytes, t.DescCount)
				}
				if rerr := f.x.Release(); rerr != nil {
					// Complete: nothing writes the blocks any more.
					w.logFailure("transfer_release_failed", st, "", rerr)
				}
				if left := w.leaseLeft(st); left <= 0 && w.kvFaultFor(st.id) != faultLate {
					// Completed after the remote lease ended: the prefill may
					// have freed and reused the blocks mid-read. No silent
					// corruption: fail the load (kv_load_failure_policy).
					w.stats.RecordKVExpired()
					w.failLocked(st, "kv_lease_expired", fmt.Sprintf("READ completed %.1fs after the remote lease ended (%s); the data may be stale", -left, w.leaseDetail(st)), nil)
				}
			case err == nil && status == nixl.InProgress:
				if !f.slow && now-f.posted >= slowReadAfter {
					f.slow = true
					w.log.Warn("READ still in flight", zap.String("request_id", st.id),
						zap.String("remote_engine_id", st.meta.Remote.EngineID), zap.Float64("seconds", now-f.posted),
						zap.Int("local_blocks", st.meta.LocalBlockIDs.Count()), zap.Float64("transfer_timeout", w.cfg.TransferTimeout))
				}
				if now >= f.deadline {
					// Bounded wait: cancel and fail the request.
					w.stats.RecordFailedTransfer()
					w.failLocked(st, "transfer_failed", fmt.Sprintf("READ still in flight after transfer_timeout=%gs", w.cfg.TransferTimeout), nil)
					if st.remote != nil {
						// A peer that stopped answering is handshaken anew
						// (this also closes the endpoint, which cancels
						// what is still posted on it).
						w.dropRemoteLocked(st.remote)
					}
					if rerr := f.x.Release(); rerr != nil {
						w.holdStuckLocked(st, f, now, rerr)
						kept = append(kept, f)
					}
					continue
				}
				kept = append(kept, f)
			default:
				if err == nil {
					err = fmt.Errorf("transfer status %v", status)
				}
				w.stats.RecordFailedTransfer()
				w.failLocked(st, "transfer_failed", "", err)
				if re, ok := w.remotes[st.meta.Remote.EngineID]; ok {
					w.dropRemoteOnDisconnect(re, err)
				}
				if rerr := f.x.Release(); rerr != nil {
					w.holdStuckLocked(st, f, now, rerr)
					kept = append(kept, f)
				}
			}
		}
		st.xfers = kept
		if len(st.xfers) > 0 {
			continue
		}
		if st.report && !st.failed && st.check != nil {
			if st.checking == nil && w.kvFaultFor(id) == faultFlip {
				w.flipFaultLocked(st)
			}
			if !w.checkDoneLocked(st) {
				continue // its blocks are being hashed (kvdigest.go)
			}
		}
		delete(w.recv, id)
		w.stopWatchLocked(st)
		if st.check != nil && st.check.stopFetch != nil {
			st.check.stopFetch() // a failed READ's fetch stops asking
		}
		w.floors.Drop(st.meta.Remote.RequestID)
		if st.remote != nil {
			// The READ's notification lets the remote free the blocks:
			// heartbeats of another request with these params extend
			// nothing from here on (sendHeartbeatsLocked).
			w.released.Raise(st.remote.id+"\x00"+st.meta.Remote.RequestID, w.clock()+2*max(w.cfg.KVLeaseDuration, w.cfg.DecoderKVBlocksTTL))
		}
		if !st.report {
			continue // notify-only: vLLM does not wait for it
		}
		w.done.Recving = append(w.done.Recving, id)
		if st.failed {
			w.reportFailedLocked(st)
		} else if len(st.reshape) > 0 {
			if w.done.Reshape == nil {
				w.done.Reshape = map[string][]BlockReshape{}
			}
			w.done.Reshape[id] = st.reshape
		}
	}
}

// reportFailedLocked reports a failed load once: the request in
// failed_recving, its blocks in the load errors (the Python side passes
// those on only for a single KV-cache group, as vLLM requires).
func (w *Worker) reportFailedLocked(st *recvState) {
	if st.failedSent {
		return
	}
	st.failedSent = true
	w.done.Failed = append(w.done.Failed, st.id)
	for _, g := range st.meta.LocalBlockIDs {
		for _, b := range g {
			w.invalid[b] = struct{}{}
		}
	}
}

// holdStuckLocked keeps a handle the engine would not release. Its request
// is already failed and is reported in failed_recving at once; it is
// reported finished receiving only once the handle is released: until then
// the engine may still write into those blocks, and vLLM must not give them
// to another request. Visible as gonixl_stuck_transfer_handles and in the log.
func (w *Worker) holdStuckLocked(st *recvState, f *inflight, now float64, err error) {
	f.stuck, f.nextTry, f.stuckLogged = now, now+stuckRetry, now
	w.stuckTotal.Add(1)
	if st.report {
		// The failure is reported now (bounded); finished_recving, which
		// lets vLLM free or reuse the blocks, only at release. vLLM's
		// scheduler keeps the blocks of a request that is not finished
		// receiving: under "fail" it ends the request with an error at
		// once and holds its blocks (the delayed free of an aborted
		// receive); under "recompute" the request waits in
		// WAITING_FOR_REMOTE_KVS, its blocks allocated, until the release.
		w.reportFailedLocked(st)
	}
	w.logFailure("transfer_release_failed", st, fmt.Sprintf("the engine cannot release the READ's handle; the request is reported failed, its %d local blocks stay held (finished_recving withheld) until the handle is released, retried every %gs",
		st.meta.LocalBlockIDs.Count(), stuckRetry), err)
}

// retryStuckLocked retries releasing a stuck handle; true once released.
func (w *Worker) retryStuckLocked(st *recvState, f *inflight, now float64) bool {
	if now < f.nextTry {
		return false
	}
	f.nextTry = now + stuckRetry
	err := f.x.Release()
	if err == nil {
		w.log.Warn("stuck READ handle released; its request is reported finished receiving now (vLLM may reuse its blocks)", zap.String("request_id", st.id),
			zap.Float64("held_seconds", now-f.stuck))
		return true
	}
	if now-f.stuckLogged >= stuckLogEvery {
		f.stuckLogged = now
		w.log.Error("READ handle still cannot be released; its local blocks stay held", zap.String("request_id", st.id),
			zap.Float64("held_seconds", now-f.stuck), zap.Error(err))
	}
	return false
}

func (w *Worker) failLocked(st *recvState, kind, msg string, err error) {
	st.failed = true
	w.stopWatchLocked(st)
	w.logFailure(kind, st, msg, err)
}

// logFailure prints vLLM's failure line: "NIXL transfer failure: <type> |
// Context: {...}".
func (w *Worker) logFailure(kind string, st *recvState, msg string, err error) {
	ctx := map[string]any{"failure_type": kind, "engine_id": w.cfg.EngineID}
	if st != nil {
		ctx["request_id"] = st.id
		rm := st.meta.Remote
		ctx["remote_engine_id"] = rm.EngineID
		ctx["remote_request_id"] = rm.RequestID
		ctx["remote_host"] = rm.Host
		ctx["remote_port"] = rm.Port
		ctx["num_local_blocks"] = st.meta.LocalBlockIDs.Count()
		ctx["num_remote_blocks"] = rm.BlockIDs.Count()
	}
	if err != nil {
		ctx["error"] = err.Error()
	}
	if msg != "" {
		kind += ". " + msg
	}
	b, _ := json.Marshal(ctx)
	w.log.Error("NIXL transfer failure: " + kind + " | Context: " + string(b))
}
