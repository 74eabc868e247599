// Push mode, the prefill's side: matching a request's blocks with the
// decode's registration and WRITEing them (shim/kvwire/push.go has the
// messages).
//
// A prefill request's blocks are vLLM's until request_finished, then held
// for the transfer until finished_sending. An early push (PushEarly: the
// step that completes the prompt, before request_finished) WRITEs blocks of
// a request vLLM still runs: vLLM could preempt it and give its blocks to
// another request. The scheduler prevents that while the push is announced
// (Scheduler.PendingBlockFrees, vLLM's has_pending_block_frees, which vLLM
// asks before it preempts); a preemption it cannot prevent (vLLM's
// reset_prefix_cache, or an announcement gone stale) reaches this worker as
// PushPreempted in vLLM's handle_preemptions, before the forward that
// could overwrite the blocks, which drops an unposted WRITE or waits for a
// posted one (pushPreemptedLocked).
//
// A decode's blocks are written only under its registration, once: a
// registration matched, cancelled or written is consumed (copies dropped).
// The decode gives its blocks back only after this rank's last word, and
// "FAILED" is sent only once every handle of the WRITE is released — a
// WRITE the engine would not release may still be writing.
//
// A push's states (pushSend.state) and what moves them:
//
//	state       event                                   next        effect
//	unmatched   registration matched                    handshake   handshake with the decode (unknown engine)
//	unmatched   registration matched, engine known      computing / writing
//	handshake   handshake done                          computing / writing
//	handshake   handshake failed                        done        (no endpoint: nothing is written)
//	computing   the step's forward done (GetFinished)   writing     WRITE posted
//	handshake,  decode cancels                          unmatched   registration consumed, CANCELLED
//	computing
//	any, early  preempted, nothing posted               (removed)   registration back in the pool
//	writing     preempted                               done        handle_preemptions waits for the WRITE, before the forward
//	writing     every WRITE completed                   done        (the engine's notifications tell the decode)
//	writing     a WRITE failed or timed out             releasing   each handle released, or retried every second
//	releasing   every handle released                   done        FAILED to a gonixl decode
//	done        request_finished seen, lease            (removed)   finished_sending
//	unmatched   lease ended (finished)                  (removed)   (sweepLeasesLocked freed the blocks)

package shim

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/shim/kvwire"
)

type pushSendState int

const (
	sendUnmatched pushSendState = iota // blocks known, no registration
	sendHandshake                      // matched; handshaking with the decode
	sendComputing                      // matched early push; its forward may still run
	sendWriting                        // WRITEs posted
	sendReleasing                      // failed; handles the engine would not release yet
	sendDone                           // no transfer of ours touches its blocks
)

func (s pushSendState) String() string {
	return [...]string{"unmatched", "handshake", "computing", "writing", "releasing", "done"}[s]
}

// pushSend is a prefill request in push mode: its blocks, the registration
// they go to, and the WRITEs in flight.
type pushSend struct {
	id     string // this engine's request id
	state  pushSendState
	blocks BlockIDs
	digest string // its prompt's digest ("" when not known)
	tokens int64  // its prompt's tokens (0 when not known): the KV digests' slots
	reg    *pushReg
	xfers  []*inflight
	// early: announced by PushEarly, its request_finished not seen yet;
	// computed: the forward that fills its blocks is done (GetFinished ran
	// after the announcing step's start_load_kv).
	early, computed bool
	since           float64 // when it was announced or finished
}

// pushSender is a prefill worker's push state.
// maxPushRegs bounds the registrations a prefill keeps while their
// requests have not finished (a decode's word, so bounded).
const maxPushRegs = 1 << 14

type pushSender struct {
	sends    map[string]*pushSend // by this engine's request id
	order    []string             // arrival order of sends
	regs     map[string]*pushReg  // registrations waiting for their request, by decode request id
	regOrder []string             // arrival order of regs
	// consumed: registrations matched, cancelled or dropped, by decode
	// engine and request id, until this worker's clock reaches the value:
	// a copy that arrives later is dropped.
	consumed map[string]float64
	// computing: early pushes whose forward may still run (announced by
	// the last start_load_kv); earlyDone: early pushes that ended before
	// their request_finished, with the time they ended.
	computing []string
	earlyDone map[string]float64
	// arrived: base request ids of registrations accepted since the
	// scheduler last asked (Worker.PushArrivals), bounded by maxPushRegs.
	arrived []string
	// deferred: matched, computed pushes whose WRITE was put off while
	// the agent was busy (busy.go), written by the next poll that finds
	// it free.
	deferred []string
}

func newPushSender() *pushSender {
	return &pushSender{sends: map[string]*pushSend{}, regs: map[string]*pushReg{}, consumed: map[string]float64{}, earlyDone: map[string]float64{}}
}

// live counts the sends that still hold something (blocks or handles).
func (p *pushSender) live() (sends, regs, handles int) {
	for _, ps := range p.sends {
		handles += len(ps.xfers)
	}
	return len(p.sends) + len(p.earlyDone), len(p.regs), handles
}

func regKey(r *pushReg) string { return r.DecodeEngineID + "\x00" + r.RequestID }

// pushFinishedLocked records the step's finished requests' blocks and
// starts the WRITEs whose registrations already arrived.
func (w *Worker) pushFinishedLocked(m *StepMeta) {
	p := w.push
	for _, id := range sortedKeys(m.PushFinished) {
		if _, ok := w.toProcess[id]; !ok {
			continue
		}
		if _, done := p.earlyDone[id]; done {
			// Its early WRITE already ended: its blocks are free to go.
			delete(p.earlyDone, id)
			w.held.Drop(id)
			delete(w.toProcess, id)
			w.done.Sending = append(w.done.Sending, id)
			continue
		}
		pf := m.PushFinished[id]
		if ps, dup := p.sends[id]; dup {
			ps.early = false // now held under its lease, as any other
			if !slices.EqualFunc(ps.blocks, pf.Blocks, slices.Equal) && (ps.state == sendUnmatched || ps.state == sendHandshake || ps.state == sendComputing) {
				// Announced with other blocks (a preemption this worker
				// was not told of): the finished ones are the held ones.
				w.log.Warn("push: request finished with other blocks than announced; writing the finished ones", zap.String("request_id", id))
				ps.blocks = pf.Blocks
			}
			if pf.Tokens > 0 {
				ps.tokens = pf.Tokens
			}
			continue
		}
		ps := &pushSend{id: id, blocks: pf.Blocks, digest: pf.PromptDigest, tokens: pf.Tokens, computed: true, since: w.clock()}
		p.sends[id] = ps
		p.order = append(p.order, id)
		if reg := w.takeRegLocked(id); reg != nil {
			w.matchPushLocked(ps, reg)
		}
	}
}

// pushEarlyLocked takes the step's requests whose prompt its forward
// completes (Scheduler.PushPromptDone): each is matched with its
// registration at once (handshaking if needed), and WRITTEN from the next
// GetFinished on, which vLLM calls after the step's forward.
func (w *Worker) pushEarlyLocked(m *StepMeta) {
	p := w.push
	now := w.clock()
	for _, id := range sortedKeys(m.PushEarly) {
		if _, dup := p.sends[id]; dup {
			continue
		}
		pf := m.PushEarly[id]
		ps := &pushSend{id: id, blocks: pf.Blocks, digest: pf.PromptDigest, tokens: pf.Tokens, early: true, since: now}
		p.sends[id] = ps
		p.order = append(p.order, id)
		p.computing = append(p.computing, id)
		if reg := w.takeRegLocked(id); reg != nil {
			w.matchPushLocked(ps, reg)
		}
	}
}

// pushComputedLocked marks the early pushes of the last start_load_kv
// computed (GetFinished runs after the step's forward) and WRITEs those
// already matched.
func (w *Worker) pushComputedLocked() {
	p := w.push
	ids := p.computing
	if len(ids) == 0 {
		return
	}
	p.computing = nil
	for _, id := range ids {
		ps := p.sends[id]
		if ps == nil || ps.computed {
			continue
		}
		ps.computed = true
		if ps.state == sendComputing {
			w.writeKnownLocked(ps)
		}
	}
}

// pushPreemptedLocked takes the early pushes vLLM preempted (it freed
// their blocks and may give them to a request this step's forward fills).
// It runs in handle_preemptions, before that forward (and again, to no
// effect, in start_load_kv): a push not posted yet is dropped (its
// registration goes back to the pool, for the recomputed request); a WRITE
// in flight is waited for, so that it reads the KV the announcing step
// computed and not the next request's. The wait holds vLLM's model thread,
// bounded by transfer_timeout (and a second after dropping the engine);
// past that the WRITE is logged as one that could not be stopped.
func (w *Worker) pushPreemptedLocked(ids []string) {
	p := w.push
	for _, id := range ids {
		ps := p.sends[id]
		if ps == nil || !ps.early {
			continue
		}
		switch ps.state {
		case sendUnmatched, sendHandshake, sendComputing:
			if ps.reg != nil {
				delete(p.consumed, regKey(ps.reg))
				w.keepRegLocked(ps.reg)
			}
			w.dropSendLocked(ps)
			w.log.Info("push: an announced request was preempted before its WRITE; it is written when recomputed", zap.String("request_id", id))
		case sendWriting, sendReleasing:
			w.fencePushLocked(ps)
		}
	}
}

// fencePushLocked waits (on vLLM's model thread, before the forward that
// may overwrite ps's blocks) until no WRITE of ps reads them: completed,
// or failed and released. Bounded by transfer_timeout; past it the decode
// engine is dropped (which cancels what the engine can) and the handles
// are released if they can be.
func (w *Worker) fencePushLocked(ps *pushSend) {
	t0 := time.Now()
	// WRITEs still queued for the poster are posted here: it cannot take
	// them while this holds the lock (post.go); one it is posting is
	// waited for below, as any WRITE in flight.
	w.postNowLocked(ps.xfers)
	limit := time.Duration(w.cfg.TransferTimeout * float64(time.Second))
	dropped := false
	for {
		w.pollPushSendLocked(ps)
		if ps.state == sendDone {
			w.log.Warn("push: waited for the WRITE of a preempted request before the next forward", zap.String("request_id", ps.id),
				zap.Duration("waited", time.Since(t0)))
			return
		}
		if time.Since(t0) >= limit {
			if dropped {
				w.stats.RecordFailedTransfer()
				w.log.Error("push: the WRITE of a preempted request's blocks could not be stopped; the decode may receive another request's KV",
					zap.String("request_id", ps.id), zap.String("decode_request_id", ps.reg.RequestID), zap.Duration("waited", time.Since(t0)))
				return
			}
			dropped = true
			if re := w.remotes[ps.reg.DecodeEngineID]; re != nil {
				w.dropRemoteLocked(re)
			}
			limit += time.Second
		}
		time.Sleep(200 * time.Microsecond)
	}
}

// takeRegLocked removes and returns the registration for prefill request
// id: the one with the same id, else the oldest with the same base id.
func (w *Worker) takeRegLocked(id string) *pushReg {
	p := w.push
	if r, ok := p.regs[id]; ok {
		w.dropRegLocked(id)
		return r
	}
	base := kvwire.BaseRequestID(id)
	for _, rid := range p.regOrder {
		if kvwire.BaseRequestID(rid) == base {
			r := p.regs[rid]
			w.dropRegLocked(rid)
			return r
		}
	}
	return nil
}

func (w *Worker) dropRegLocked(id string) {
	p := w.push
	delete(p.regs, id)
	if i := slices.Index(p.regOrder, id); i >= 0 {
		p.regOrder = slices.Delete(p.regOrder, i, i+1)
	}
}

// keepRegLocked stores a registration until its request comes.
func (w *Worker) keepRegLocked(reg *pushReg) {
	p := w.push
	if _, dup := p.regs[reg.RequestID]; dup {
		return
	}
	if len(p.regs) >= maxPushRegs {
		w.log.Warn("push: too many registrations waiting for their requests; dropping the oldest", zap.Int("limit", maxPushRegs))
		w.dropRegLocked(p.regOrder[0])
	}
	p.regs[reg.RequestID] = reg
	p.regOrder = append(p.regOrder, reg.RequestID)
}

// takeSendLocked is takeRegLocked's mirror: the unmatched request for
// registration id.
func (w *Worker) takeSendLocked(id string) *pushSend {
	p := w.push
	if ps, ok := p.sends[id]; ok && ps.state == sendUnmatched {
		return ps
	}
	base := kvwire.BaseRequestID(id)
	for _, pid := range p.order {
		if ps := p.sends[pid]; ps != nil && ps.state == sendUnmatched && kvwire.BaseRequestID(pid) == base {
			return ps
		}
	}
	return nil
}

// pushRegLocked takes a registration notification.
func (w *Worker) pushRegLocked(from string, payload []byte) {
	reg, err := decodePushReg(payload)
	if err != nil {
		w.log.Warn("push: malformed PUSH_REG notification dropped", zap.String("from", from), zap.Error(err))
		return
	}
	p := w.push
	if _, used := p.consumed[regKey(reg)]; used {
		// Another decode rank's copy of a registration already matched,
		// cancelled or dropped: matching it again would write into blocks
		// the decode may have given back.
		return
	}
	reg.received, reg.from = w.clock(), from
	if len(p.arrived) < maxPushRegs {
		p.arrived = append(p.arrived, kvwire.BaseRequestID(reg.RequestID))
	} else {
		w.log.Warn("push: too many registration arrivals not yet taken by the scheduler; this one is not reported (its request waits for the admission's budget)",
			zap.String("decode_request_id", reg.RequestID), zap.Int("limit", maxPushRegs))
	}
	if ps := w.takeSendLocked(reg.RequestID); ps != nil {
		w.matchPushLocked(ps, reg)
		return
	}
	w.keepRegLocked(reg)
}

// matchPushLocked pairs ps with its registration (consumed from now on)
// and WRITEs, handshaking with the decode first where needed.
func (w *Worker) matchPushLocked(ps *pushSend, reg *pushReg) {
	w.push.consumed[regKey(reg)] = w.clock() + w.regMemory()
	ps.reg = reg
	re, ok := w.remotes[reg.DecodeEngineID]
	if ok && (re.host != reg.DecodeHost || re.port != reg.DecodePort) {
		ok = false
	}
	if !ok {
		ps.state = sendHandshake
		w.startPushHandshakeLocked(reg, ps.id)
		return
	}
	ps.state = sendComputing
	if ps.computed {
		w.writeLocked(ps, re)
	}
}

// regMemory is how long a consumed registration is remembered: longer
// than any copy of it can take to arrive (a decode's timeout, a lease).
func (w *Worker) regMemory() float64 {
	return 2 * max(w.cfg.PushRegistrationTimeout, w.cfg.KVLeaseDuration)
}

// writeKnownLocked WRITEs a matched, computed push to its (handshaken)
// decode, or gives it up when the engine is gone.
func (w *Worker) writeKnownLocked(ps *pushSend) {
	re, ok := w.remotes[ps.reg.DecodeEngineID]
	if !ok {
		ps.state = sendHandshake
		w.startPushHandshakeLocked(ps.reg, ps.id)
		return
	}
	w.writeLocked(ps, re)
}

// writeLocked posts the WRITE of ps's blocks into the decode's (ps is
// matched and computed, state sendComputing), or puts it off while the
// agent is busy (busy.go): MakeXfer would wait behind the call holding it.
func (w *Worker) writeLocked(ps *pushSend, re *remoteEngine) {
	if w.agentBusyLocked() {
		if !slices.Contains(w.push.deferred, ps.id) {
			w.push.deferred = append(w.push.deferred, ps.id)
		}
		return
	}
	w.touchRemoteLocked(re)
	fail := func(kind string, err error) {
		w.stats.RecordFailedTransfer()
		w.log.Error("NIXL transfer failure: "+kind, zap.String("request_id", ps.id), zap.String("decode_request_id", ps.reg.RequestID),
			zap.String("decode_engine_id", ps.reg.DecodeEngineID), zap.Error(err))
		w.pushFailedLocked(ps)
	}
	if err := w.pushPairingError(re); err != nil {
		fail("transfer_setup_failed", err)
		return
	}
	if ps.reg.from != "" && !slices.Contains(re.agents(), ps.reg.from) {
		// The registering process is gone: the engine id and address are
		// another process's now, whose blocks are not the registered ones.
		// Nothing to write, and nobody to tell.
		w.log.Warn("push: the decode process that registered is gone (its engine id and address answer with other agents); not writing",
			zap.String("request_id", ps.id), zap.String("decode_request_id", ps.reg.RequestID), zap.String("registered_by", ps.reg.from))
		ps.state = sendDone
		w.pushSentLocked(ps)
		return
	}
	if ps.reg.PromptDigest != "" && ps.digest != ps.reg.PromptDigest {
		// Matched by request id, but the decode's prompt is not this
		// request's (a reused id, a proxy mix-up), or this request's KV
		// is not known to be its prompt's (no digest: its blocks may run
		// past the prompt): writing could give it another prompt's KV.
		fail("transfer_setup_failed", fmt.Errorf("the decode's prompt is not known to be this request's (gonixl_prompt_digest %s, here %q): not writing", ps.reg.PromptDigest, ps.digest))
		return
	}
	local, remote, err := pairPush(ps.blocks, ps.reg.LocalBlockIDs)
	if err != nil {
		fail("transfer_setup_failed", err)
		return
	}
	for g := range local {
		if err := w.checkBlockRange(local[g], remote[g], re); err != nil {
			fail("transfer_setup_failed", err)
			return
		}
	}
	notif := []byte(ps.reg.RequestID + ":" + strconv.Itoa(w.cfg.TPSize))
	ps.state = sendWriting
	if local.Empty() {
		// Every block was a prefix hit on the decode: nothing to write,
		// but the decode waits for the notification.
		w.sendNotifsLocked(re, notif)
		w.pushSentLocked(ps)
		return
	}
	if digest := w.pushDigestLocked(ps, re, local); digest != nil {
		// In the WRITE's own completion notification (only a decode that
		// asked gets this form): it arrives with the data, never apart.
		notif = kvwire.WithPushDigest(notif, digest)
	}
	mk := w.xferMakerOp(nixl.Write, local, remote, re.numBlocks)
	for _, rr := range re.ranks {
		if rr.list == nil {
			continue
		}
		// Fewer ranks here than on the decode: this rank's blocks hold
		// several decode ranks' heads, one slot each (localListFor).
		x, err := mk(w.localListFor(re, rr), rr.list, notif)
		if err != nil {
			fail("transfer_setup_failed", err)
			return
		}
		now := w.clock()
		f := &inflight{x: x, posted: now, deadline: now + w.cfg.TransferTimeout, what: fmt.Sprintf("decode tp_rank %d", rr.tp)}
		// Posted, or queued for the poster (post.go): in flight either
		// way, its error (if any) handled by its next poll.
		ps.xfers = append(ps.xfers, f)
		if err := w.postLocked(f); err != nil {
			// Whether any byte of it moved is not known: released like
			// the others (pushFailedLocked) before the decode is told.
			f.deadline = now
			fail("transfer_failed", err)
			w.dropRemoteOnDisconnect(re, err)
			return
		}
	}
}

func (w *Worker) sendNotifsLocked(re *remoteEngine, msg []byte) {
	for _, a := range re.agents() {
		if err := w.agent.SendNotif(a, msg); err != nil {
			w.stats.RecordFailedNotification()
		}
	}
}

// pairPush pairs a prefill request's blocks with the decode's registered
// ones, group by group: the decode registers only the blocks it did not
// find in its prefix cache, so the prefill's list is cut at its front to
// the decode's length.
func pairPush(prefill, decode BlockIDs) (BlockIDs, BlockIDs, error) {
	if len(prefill) != len(decode) {
		return nil, nil, fmt.Errorf("the decode registered %d KV-cache groups, this request has %d", len(decode), len(prefill))
	}
	l, r := make(BlockIDs, len(prefill)), make(BlockIDs, len(prefill))
	for g := range prefill {
		p, d := prefill[g], decode[g]
		if len(d) > len(p) {
			return nil, nil, fmt.Errorf("group %d: the decode registered %d blocks for a request of %d blocks here: the registration is not this request's", g, len(d), len(p))
		}
		l[g], r[g] = p[len(p)-len(d):], d
	}
	return l, r, nil
}

// pushFailedLocked gives up a push's WRITE: its handles are released, and
// only once all of them are (nothing of it can move bytes any more) a
// gonixl decode is told and the blocks freed. Handles the engine would not
// release are retried by pollPushSendsLocked.
func (w *Worker) pushFailedLocked(ps *pushSend) {
	kept := ps.xfers[:0]
	for _, f := range ps.xfers {
		if f.post != nil && !w.dropQueuedLocked(f) {
			if f.posting() {
				// Being posted (post.go): released once Post returned.
				kept = append(kept, f)
				continue
			}
			f.post = nil // returned; the push failed anyway
		}
		if err := f.x.Release(); err != nil {
			if f.stuck == 0 {
				f.stuck, f.stuckLogged = w.clock(), w.clock()
				w.stuckTotal.Add(1)
				w.log.Error("NIXL transfer failure: transfer_release_failed. push: the engine cannot release a failed WRITE's handle; the decode is told, and the blocks freed, once it is released",
					zap.String("request_id", ps.id), zap.String("decode_request_id", ps.reg.RequestID), zap.Error(err))
			}
			f.nextTry = w.clock() + stuckRetry
			kept = append(kept, f)
		}
	}
	ps.xfers = kept
	if len(ps.xfers) > 0 {
		ps.state = sendReleasing
		return
	}
	if re, ok := w.remotes[ps.reg.DecodeEngineID]; ok && re.gonixl {
		w.sendNotifsLocked(re, []byte(kvwire.PushFailedPrefix+ps.reg.RequestID))
	}
	w.pushSentLocked(ps)
}

// pushSentLocked ends a push (sendDone): no transfer of it touches its
// blocks, which vLLM gets back once it finished the request.
func (w *Worker) pushSentLocked(ps *pushSend) {
	ps.state = sendDone
	w.dropSendLocked(ps)
	if ps.early {
		// vLLM has not finished the request yet: its finished_sending
		// waits for the request_finished (pushFinishedLocked).
		w.push.earlyDone[ps.id] = w.clock()
		return
	}
	if _, held := w.held.Deadline(ps.id); held || w.isToProcess(ps.id) {
		w.held.Drop(ps.id)
		delete(w.toProcess, ps.id)
		w.done.Sending = append(w.done.Sending, ps.id)
	}
}

// abandonPushLocked drops a push that posted nothing, whose blocks vLLM
// gets back now (its lease ended): a matched gonixl decode is told at
// once (nothing of this engine writes into its blocks).
func (w *Worker) abandonPushLocked(ps *pushSend) {
	if ps.reg != nil {
		w.log.Warn("push: the request's lease ended before its WRITE could be posted; not writing", zap.String("request_id", ps.id),
			zap.String("decode_request_id", ps.reg.RequestID), zap.String("state", ps.state.String()))
		if re, ok := w.remotes[ps.reg.DecodeEngineID]; ok && re.gonixl {
			w.sendNotifsLocked(re, []byte(kvwire.PushFailedPrefix+ps.reg.RequestID))
		}
	}
	ps.state = sendDone
	w.dropSendLocked(ps)
}

func (w *Worker) dropSendLocked(ps *pushSend) {
	p := w.push
	delete(p.sends, ps.id)
	if i := slices.Index(p.order, ps.id); i >= 0 {
		p.order = slices.Delete(p.order, i, i+1)
	}
}

func (w *Worker) isToProcess(id string) bool {
	_, ok := w.toProcess[id]
	return ok
}

// pollPushSendsLocked polls the WRITEs in flight and retries releasing
// the handles of failed ones.
func (w *Worker) pollPushSendsLocked() {
	for _, id := range slices.Clone(w.push.order) {
		if ps := w.push.sends[id]; ps != nil {
			w.pollPushSendLocked(ps)
		}
	}
}

func (w *Worker) pollPushSendLocked(ps *pushSend) {
	now := w.clock()
	switch ps.state {
	case sendReleasing:
		ready := false
		for _, f := range ps.xfers {
			ready = ready || (!f.posting() && now >= f.nextTry)
		}
		if ready {
			w.pushFailedLocked(ps)
		}
		return
	case sendWriting:
	default:
		return
	}
	kept := ps.xfers[:0]
	failed := false
	var failErr error
	for _, f := range ps.xfers {
		perr, returned := f.takePostResult()
		if !returned {
			// Still being posted (post.go): in flight, neither checked
			// nor timed out before its Post returned.
			kept = append(kept, f)
			continue
		}
		var status nixl.Status
		var err error
		if perr != nil {
			// Its Post failed on the poster: as a failed post in place.
			status, err = nixl.StatusOf(perr), perr
		} else {
			status, err = f.x.Check()
		}
		switch {
		case err == nil && status == nixl.Success:
			if t, ts := f.x.Telemetry(); ts == nixl.Success {
				w.stats.RecordTransfer(t.XferDur.Seconds(), t.PostDur.Seconds(), t.Bytes, t.DescCount)
			}
			if rerr := f.x.Release(); rerr != nil {
				w.log.Warn("push: releasing a completed WRITE failed", zap.String("request_id", ps.id), zap.Error(rerr))
			}
		case err == nil && status == nixl.InProgress && now < f.deadline:
			kept = append(kept, f)
		default:
			if err == nil {
				err = fmt.Errorf("WRITE still in flight after transfer_timeout=%gs", w.cfg.TransferTimeout)
			}
			w.stats.RecordFailedTransfer()
			w.log.Error("NIXL transfer failure: transfer_failed", zap.String("request_id", ps.id), zap.String("decode_request_id", ps.reg.RequestID),
				zap.String("decode_engine_id", ps.reg.DecodeEngineID), zap.Error(err))
			kept = append(kept, f)
			failed, failErr = true, err
		}
	}
	ps.xfers = kept
	if failed {
		w.pushFailedLocked(ps)
		if re := w.remotes[ps.reg.DecodeEngineID]; re != nil && errors.Is(failErr, nixl.ErrRemoteDiscon) {
			w.dropRemoteOnDisconnect(re, failErr)
		}
		return
	}
	if len(ps.xfers) == 0 {
		w.pushSentLocked(ps)
	}
}

// pushCancelLocked answers a gonixl decode that gave up waiting (payload:
// its registration): the registration is consumed, a push matched to it
// and not posted goes back to waiting for another, and once no WRITE into
// its blocks is in flight the decode is told so, at its address
// (handshaking with it first if this engine never did). A WRITE in flight
// answers by itself (its notification, or FAILED once released).
func (w *Worker) pushCancelLocked(from string, payload []byte) {
	reg, err := decodePushReg(payload)
	if err != nil {
		w.log.Warn("push: malformed cancel notification dropped", zap.String("from", from), zap.Error(err))
		return
	}
	p := w.push
	id := reg.RequestID
	p.consumed[regKey(reg)] = w.clock() + w.regMemory()
	if r, ok := p.regs[id]; ok && r.DecodeEngineID == reg.DecodeEngineID {
		w.dropRegLocked(id)
	}
	for _, ps := range p.sends {
		if ps.reg == nil || ps.reg.RequestID != id || ps.reg.DecodeEngineID != reg.DecodeEngineID {
			continue
		}
		switch ps.state {
		case sendWriting, sendReleasing:
			return // its WRITE's notification (or FAILED) answers
		case sendHandshake, sendComputing:
			ps.reg, ps.state = nil, sendUnmatched
			if r := w.takeRegLocked(ps.id); r != nil {
				w.matchPushLocked(ps, r)
			}
		}
	}
	if re, ok := w.remotes[reg.DecodeEngineID]; ok && re.host == reg.DecodeHost && re.port == reg.DecodePort {
		w.sendNotifsLocked(re, []byte(kvwire.PushCancelledPrefix+id))
		return
	}
	key := hsKey(reg.DecodeEngineID, reg.DecodeHost, reg.DecodePort)
	w.startHandshakeLocked(reg.DecodeEngineID, reg.DecodeHost, reg.DecodePort, reg.DecodeTPSize, "")
	if hs, ok := w.handshakes[key]; ok && !slices.Contains(hs.cancelReplies, id) {
		hs.cancelReplies = append(hs.cancelReplies, id)
	}
}

// sweepPushLocked drops registrations that waited longer than
// push_registration_timeout for their request (the decode gave up),
// forgets consumed registrations, and drops pushes whose blocks' lease
// ended before a registration came (sweepLeasesLocked freed them).
func (w *Worker) sweepPushLocked() {
	p := w.push
	now := w.clock()
	// Every one: a registration put back after a preemption keeps its
	// arrival time but goes to the end of the order.
	for _, id := range slices.Clone(p.regOrder) {
		r := p.regs[id]
		if r != nil && now-r.received < w.cfg.PushRegistrationTimeout {
			continue
		}
		if r != nil {
			p.consumed[regKey(r)] = now + w.regMemory()
		}
		w.dropRegLocked(id)
	}
	for k, until := range p.consumed {
		if now >= until {
			delete(p.consumed, k)
		}
	}
	// An early push whose request_finished never came (vLLM calls it for
	// every request, within a step or two) is given up after two leases.
	stale := 2 * w.cfg.KVLeaseDuration
	for id, t := range p.earlyDone {
		if now-t > stale {
			delete(p.earlyDone, id)
		}
	}
	for _, id := range slices.Clone(p.order) {
		ps := p.sends[id]
		if ps == nil || ps.state != sendUnmatched {
			continue
		}
		if ps.early {
			if now-ps.since > stale {
				w.log.Warn("push: an announced request never finished; dropping its push", zap.String("request_id", id))
				w.dropSendLocked(ps)
			}
			continue // not held before its request_finished
		}
		if _, held := w.held.Deadline(id); !held && !w.isToProcess(id) {
			// The lease ended (its blocks are freed) before a decode
			// registered: nothing will be written.
			w.dropSendLocked(ps)
		}
	}
}

// startPushHandshakeLocked handshakes with a registration's decode engine;
// the push of prefill request id waits for it (pushHandshakeDoneLocked).
func (w *Worker) startPushHandshakeLocked(reg *pushReg, id string) {
	key := hsKey(reg.DecodeEngineID, reg.DecodeHost, reg.DecodePort)
	w.startHandshakeLocked(reg.DecodeEngineID, reg.DecodeHost, reg.DecodePort, reg.DecodeTPSize, "")
	hs, ok := w.handshakes[key]
	if !ok {
		// Refused before any network work (hsguard): give the push up.
		w.stats.RecordFailedHandshake()
		w.log.Error("NIXL transfer failure: push_handshake_failed", zap.String("request_id", id),
			zap.String("decode_engine_id", reg.DecodeEngineID), zap.String("decode", fmt.Sprintf("%s:%d", reg.DecodeHost, reg.DecodePort)))
		if ps := w.push.sends[id]; ps != nil {
			w.pushSentLocked(ps) // nothing was posted
		}
		return
	}
	if !slices.Contains(hs.pushWaiting, id) {
		hs.pushWaiting = append(hs.pushWaiting, id)
	}
}

// pushHandshakeDoneLocked continues the pushes and cancel answers that
// waited for a handshake with a decode engine (re nil: it failed).
func (w *Worker) pushHandshakeDoneLocked(hs *handshakeState, engineID string, re *remoteEngine, err error) {
	if err == nil {
		for _, id := range hs.cancelReplies {
			w.sendNotifsLocked(re, []byte(kvwire.PushCancelledPrefix+id))
		}
	}
	for _, id := range hs.pushWaiting {
		ps := w.push.sends[id]
		if ps == nil || ps.state != sendHandshake || ps.reg.DecodeEngineID != engineID {
			continue
		}
		if err != nil {
			w.log.Error("NIXL transfer failure: push_handshake_failed", zap.String("request_id", id),
				zap.String("decode_engine_id", engineID), zap.Error(err))
			w.pushSentLocked(ps) // nothing was posted
			continue
		}
		ps.state = sendComputing
		if ps.computed {
			w.writeLocked(ps, re)
		}
	}
}

// pushPairingError says why this engine cannot push with re. Handled:
// equal block sizes, and equal tp_size or different ones where every rank
// holds distinct KV heads (a prefill rank then writes its whole blocks into
// its heads' slice of a decode rank's blocks, or each slice of its blocks
// into one decode rank: the tp plan's slices and slots, as a READ uses
// them). Replicated KV heads (fewer heads than a side's tp_size) and MLA
// across tp sizes are refused.
func (w *Worker) pushPairingError(re *remoteEngine) error {
	if re.blockRatio != 1 {
		return errors.New("push between different block sizes is not supported by gonixl yet (pull mode supports a smaller prefill block size)")
	}
	pl := re.plan
	if pl.remoteTP == w.cfg.TPSize {
		return nil
	}
	if pl.mla {
		return fmt.Errorf("push of an MLA cache between tp_size %d and %d is not supported by gonixl yet", w.cfg.TPSize, pl.remoteTP)
	}
	if heads := int(w.geometryOf(w.layout).NumKVHeads); heads < max(pl.localTP, pl.remoteTP) {
		return fmt.Errorf("push between tp_size %d and %d with %d KV heads (replicated on some ranks) is not supported by gonixl yet", w.cfg.TPSize, pl.remoteTP, heads)
	}
	return nil
}
