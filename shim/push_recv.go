// Push mode, the decode's side: registering a request's blocks with the
// prefill and waiting for its WRITE (shim/kvwire/push.go has the messages).
//
// A decode request's blocks are the connector's from update_state_after_alloc
// until finished_recving; vLLM may reuse them after that. So finished_recving
// is reported only once no WRITE can land in them: every prefill rank the
// registration reached has said its last word (its WRITE's completion
// notification, GONIXL_PUSH_FAILED, GONIXL_PUSH_CANCELLED), or is gone (its
// side channel refuses connections or answers with other agents: a process
// that no longer exists writes nothing). A failure (push_registration_timeout,
// an abort, a lost peer) is reported to vLLM at once in failed_recving, but
// the blocks stay held until then. A stock prefill cannot be asked to drop a
// registration (it keeps one for ever): its blocks are held until it writes
// or is gone, logged and counted (push_held_requests), never given back
// while a WRITE may come.
//
// The wait's states (pushWait.state) and what moves them:
//
//	state     event                                             next      effect
//	waiting   completions >= want                               done      finished_recving
//	waiting   a rank's FAILED/CANCELLED (others pending)        holding   failed_recving
//	waiting   push_registration_timeout, abort, lost peer      holding   failed_recving; CANCEL to a gonixl prefill
//	waiting   every rank's last word                            done      failed_recving (unless all completed), finished_recving
//	holding   every rank's last word, or gone                   done      finished_recving
//	holding   every pushRetryEvery                              holding   CANCEL again (gonixl); a probe handshake every pushProbeEvery
//
// engine_ttl eviction never ends a wait: an engine with a wait is busy
// (evict.go).

package shim

import (
	"errors"
	"fmt"
	"sort"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/shim/kvwire"
	"github.com/gonixl/gonixl/sidechannel"
)

const (
	// pushRetryEvery: how often a holding wait asks a gonixl prefill again
	// to drop its registration (a lost CANCEL, a prefill that was busy).
	pushRetryEvery = 5.0
	// pushProbeEvery: how soon a holding wait handshakes with the prefill
	// to learn whether the agents it registered with still exist; the
	// interval doubles after each probe that finds them alive, up to
	// pushProbeMax (a probe prepares the engine's descriptors again).
	pushProbeEvery = 30.0
	pushProbeMax   = 600.0
	// pushHoldWarnAfter: a hold on a gonixl prefill this long is logged.
	pushHoldWarnAfter = 300.0
)

type pushWaitState int

const (
	pushWaiting pushWaitState = iota // registered; the WRITE is expected
	pushHolding                      // failed or given up: reported, blocks held until no WRITE can land
	pushDone                         // nothing can land any more
)

func (s pushWaitState) String() string {
	return [...]string{"waiting", "holding", "done"}[s]
}

// pushWait is a decode request's wait for the prefill's WRITE.
type pushWait struct {
	state    pushWaitState
	deadline float64 // push_registration_timeout, this worker's clock
	want     int     // completion notifications that make the KV complete
	got      int
	// ranks: the prefill agents the registration reached, each true once
	// it said its last word (or is gone).
	ranks  map[string]bool
	gonixl bool // the prefill is a gonixl engine (it answers CANCEL)
	// digest: the prefill's digests of the KV its WRITE carries
	// (kvwire.PushDigest), checked once the WRITE completed.
	digest *kvwire.PushDigest
	since  float64 // holding since
	retry  float64 // holding: next CANCEL
	probe  float64 // holding: next probe handshake
	every  float64 // holding: the probe interval
	why    string  // holding: why, for the log
	warned bool    // a hold on a stock prefill, or a long one, was logged
}

// allSaid reports whether every rank the registration reached said its
// last word.
func (pw *pushWait) allSaid() bool {
	for _, said := range pw.ranks {
		if !said {
			return false
		}
	}
	return true
}

// registerPushLocked sends st's registration to every rank of the prefill
// re it handshook with, and starts waiting for the WRITE.
func (w *Worker) registerPushLocked(st *recvState, re *remoteEngine) {
	if err := w.pushPairingError(re); err != nil {
		w.stats.RecordFailedTransfer()
		w.failLocked(st, "transfer_setup_failed", fmt.Sprintf("push from engine %s", re.id), err)
		return
	}
	msg, err := kvwire.EncodePushReg(w.pushRegOf(st))
	if err != nil {
		w.failLocked(st, "transfer_setup_failed", "encode the push registration", err)
		return
	}
	ranks := map[string]bool{}
	for _, a := range re.agents() {
		// A send that failed did not reach the rank: it cannot write.
		if err := w.agent.SendNotif(a, msg); err != nil {
			w.stats.RecordFailedNotification()
			w.logFailure("push_reg_notif_failed", st, "remote agent "+a, err)
			continue
		}
		ranks[a] = false
	}
	if len(ranks) == 0 {
		w.stats.RecordFailedTransfer()
		w.failLocked(st, "push_reg_notif_failed", fmt.Sprintf("no rank of engine %s took the registration", re.id), nil)
		return
	}
	st.remote = re
	st.push = &pushWait{
		deadline: w.clock() + w.cfg.PushRegistrationTimeout,
		// This rank registered with its own pipeline stage's ranks only
		// (startHandshakeLocked): each of them that holds distinct heads
		// WRITEs once.
		want:   max(1, re.plan.remoteTP/max(w.cfg.TPSize, 1)),
		ranks:  ranks,
		gonixl: re.gonixl,
	}
	w.touchRemoteLocked(re)
}

// pushRegOf is the registration of decode request st.
func (w *Worker) pushRegOf(st *recvState) *kvwire.PushReg {
	rm := &st.meta.Remote
	return &kvwire.PushReg{
		RequestID: st.id, DecodeEngineID: w.cfg.EngineID, DecodeHost: w.cfg.SideChannelHost,
		DecodePort: w.cfg.SideChannelPort + w.cfg.DPIndex, DecodeTPSize: w.cfg.TPSize, LocalBlockIDs: st.meta.LocalBlockIDs,
		RemoteEngineID: rm.EngineID, RemoteHost: rm.Host, RemotePort: rm.Port, RemoteTPSize: st.meta.TPSize, RemotePPSize: max(st.meta.PPSize, 1),
		PromptDigest: st.meta.PromptDigest, WantsKVDigest: w.cfg.KVDigest != KVDigestOff,
	}
}

// pushNotifLocked takes a decode-side push notification (a WRITE's
// completion or a gonixl prefill's last word); false if it is not one.
func (w *Worker) pushNotifLocked(from, msg string) bool {
	msg, digest := kvwire.SplitPushDigest(msg)
	id, word := kvwire.ParsePushWord(msg)
	if word == kvwire.PushNotAWord {
		return false
	}
	st, ok := w.recv[id]
	if !ok || st.push == nil || st.push.state == pushDone {
		if word != kvwire.PushCompleted {
			// A last word for a wait that ended (another rank's, or a
			// repeated CANCEL's answer): nothing to do.
			w.log.Debug("push: a prefill's word for a request this decode no longer waits for", zap.String("msg", msg), zap.String("from", from))
			return true
		}
		return false
	}
	pw := st.push
	if _, ranked := pw.ranks[from]; ranked {
		pw.ranks[from] = true
	}
	switch word {
	case kvwire.PushFailed:
		if !st.failed {
			w.stats.RecordFailedTransfer()
			w.failLocked(st, "transfer_failed", fmt.Sprintf("the prefill's WRITE failed (engine %s, agent %s)", st.meta.Remote.EngineID, from), nil)
		}
		w.holdPushLocked(st, "the prefill's WRITE failed")
	case kvwire.PushCancelled:
		if pw.state == pushWaiting {
			// Not asked for: a prefill that dropped the registration on
			// its own (its request was preempted and its WRITE dropped,
			// say) has nothing for this request.
			w.stats.RecordFailedTransfer()
			w.failLocked(st, "transfer_failed", fmt.Sprintf("the prefill (engine %s, agent %s) dropped the registration", st.meta.Remote.EngineID, from), nil)
			w.holdPushLocked(st, "the prefill dropped the registration")
		}
	default:
		pw.got++
		if digest != nil {
			w.pushDigestMsgLocked(st, digest)
		}
		if pw.got >= pw.want && pw.state == pushWaiting && !st.failed && w.startPushCheckLocked(st) {
			// Its blocks are being hashed (kvdigest.go): the wait ends
			// when pollPushWaitsLocked takes the result.
			if st.remote != nil {
				w.touchRemoteLocked(st.remote)
			}
			return true
		}
	}
	if pw.got >= pw.want || pw.allSaid() {
		w.endPushWaitLocked(st)
	}
	if st.remote != nil {
		w.touchRemoteLocked(st.remote)
	}
	return true
}

// holdPushLocked moves a wait to holding: the failure is reported now,
// finished_recving (vLLM's leave to reuse the blocks) only once no WRITE
// can land. A gonixl prefill is asked to drop the registration at once.
func (w *Worker) holdPushLocked(st *recvState, why string) {
	pw := st.push
	st.failed = true
	w.reportFailedLocked(st)
	if pw.state != pushWaiting {
		return
	}
	now := w.clock()
	pw.state, pw.since, pw.why = pushHolding, now, why
	pw.retry, pw.probe, pw.every = now, now+pushProbeEvery, pushProbeEvery
	w.pushHolds.Add(1)
	w.sendPushCancelLocked(st)
}

// sendPushCancelLocked asks the ranks of a gonixl prefill that did not
// say their last word to drop st's registration. The registration goes
// again under another prefix: the prefill may not know this engine yet,
// and answers at its address.
func (w *Worker) sendPushCancelLocked(st *recvState) {
	pw := st.push
	pw.retry = w.clock() + pushRetryEvery
	if !pw.gonixl {
		return
	}
	msg, err := kvwire.EncodePushReg(w.pushRegOf(st))
	if err != nil {
		return
	}
	msg = append([]byte(kvwire.PushCancelPrefix), msg[len(kvwire.PushRegPrefix):]...)
	for _, a := range sortedKeys(pw.ranks) {
		if pw.ranks[a] {
			continue
		}
		if err := w.agent.SendNotif(a, msg); err != nil {
			w.stats.RecordFailedNotification()
			if errors.Is(err, nixl.ErrRemoteDiscon) {
				pw.probe = w.clock() // gone? the next poll's handshake says
			}
		}
	}
}

// endPushWaitLocked ends a wait: no WRITE can land in its blocks any more.
func (w *Worker) endPushWaitLocked(st *recvState) {
	pw := st.push
	if pw.state == pushHolding {
		w.log.Info("push: no WRITE can land in a failed request's blocks any more; giving them back to vLLM", zap.String("request_id", st.id),
			zap.String("remote_engine_id", st.meta.Remote.EngineID), zap.Float64("held_seconds", w.clock()-pw.since))
	} else if pw.got < pw.want && !st.failed {
		// Every rank's last word, not all of them completions.
		w.stats.RecordFailedTransfer()
		w.failLocked(st, "transfer_failed", fmt.Sprintf("%d of %d WRITEs from engine %s completed", pw.got, pw.want, st.meta.Remote.EngineID), nil)
	}
	pw.state = pushDone
}

// pollPushWaitsLocked fails the waits past push_registration_timeout,
// asks again and probes for the holding ones, and reports the ended ones.
func (w *Worker) pollPushWaitsLocked() {
	now := w.clock()
	var ids []string
	for id, st := range w.recv {
		if st.push != nil {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	probe := map[string]*recvState{}
	for _, id := range ids {
		st := w.recv[id]
		pw := st.push
		if st.checking != nil {
			// The WRITE completed and its blocks are being hashed: no
			// timeout meanwhile; the wait ends with the check.
			if !w.checkDoneLocked(st) {
				continue
			}
			if pw.state != pushDone {
				w.endPushWaitLocked(st)
			}
		}
		if pw.state == pushWaiting && now >= pw.deadline {
			w.stats.RecordFailedTransfer()
			w.failLocked(st, "push_registration_timeout", fmt.Sprintf("no WRITE from engine %s within push_registration_timeout=%gs", st.meta.Remote.EngineID, w.cfg.PushRegistrationTimeout), nil)
			w.holdPushLocked(st, "push_registration_timeout")
		}
		if pw.state == pushHolding {
			if !pw.gonixl && !pw.warned {
				pw.warned = true
				w.log.Warn("push: a failed request's blocks stay held until its stock prefill writes them or is gone (it cannot be told to drop the registration)",
					zap.String("request_id", st.id), zap.String("remote_engine_id", st.meta.Remote.EngineID),
					zap.Int("blocks", st.meta.LocalBlockIDs.Count()), zap.String("why", pw.why))
			} else if pw.gonixl && !pw.warned && now-pw.since >= pushHoldWarnAfter {
				// A live gonixl prefill answers at once; one that does not
				// (it cannot reach this decode's side channel, say) keeps
				// these blocks until it is gone.
				pw.warned = true
				w.log.Warn("push: a failed request's blocks are still held: its gonixl prefill has not answered the cancel (can it reach this engine's side channel?); they stay held until it answers or is gone",
					zap.String("request_id", st.id), zap.String("remote_engine_id", st.meta.Remote.EngineID),
					zap.Int("blocks", st.meta.LocalBlockIDs.Count()), zap.Float64("held_seconds", now-pw.since), zap.String("why", pw.why))
			}
			if now >= pw.retry {
				w.sendPushCancelLocked(st)
			}
			if now >= pw.probe {
				pw.probe = now + pw.every
				pw.every = min(2*pw.every, pushProbeMax)
				probe[st.meta.Remote.EngineID] = st
			}
		}
		if pw.state != pushDone {
			continue
		}
		delete(w.recv, id)
		w.done.Recving = append(w.done.Recving, id)
		if st.failed {
			w.reportFailedLocked(st)
		}
	}
	for _, eng := range sortedKeys(probe) {
		rm := probe[eng].meta.Remote
		w.startHandshakeLocked(rm.EngineID, rm.Host, rm.Port, probe[eng].meta.TPSize, "")
	}
}

// pushAbortedLocked ends the waits of requests vLLM finished (aborted)
// before their WRITE came: failed at once, held until no WRITE can land.
// One not registered yet (its handshake, or a busy engine, held the
// registration back) is never registered: nothing can land in its blocks,
// which go back to vLLM now instead of after push_registration_timeout.
func (w *Worker) pushAbortedLocked(ids []string) {
	for _, id := range ids {
		st, ok := w.recv[id]
		if !ok || !st.meta.Push {
			continue
		}
		if st.push == nil {
			if st.waiting {
				st.waiting, st.failed = false, true // reported by pollTransfersLocked
			}
			continue
		}
		if st.push.state != pushWaiting {
			continue
		}
		w.holdPushLocked(st, "vLLM finished the request first")
	}
}

// pushHandshakeSeenLocked learns from a handshake with engineID (re nil
// when it failed with err) which prefill agents are gone: all of them when
// nothing listens at its side channel any more or another engine answers
// there, the ones not among its agents when it answers (a restarted
// engine: the old process, and its registrations, are gone). A holding
// wait whose ranks are all gone or answered ends; a live gonixl prefill
// is asked again at once.
func (w *Worker) pushHandshakeSeenLocked(engineID, host string, port int, re *remoteEngine, err error) {
	var live map[string]bool
	switch {
	case err == nil:
		live = map[string]bool{}
		for _, a := range re.agents() {
			live[a] = true
		}
	case errors.Is(err, sidechannel.ErrRefused), errors.Is(err, sidechannel.ErrEngineMismatch):
		live = map[string]bool{}
	default:
		return // unknown: keep holding
	}
	for _, id := range sortedKeys(w.recv) {
		st := w.recv[id]
		rm := &st.meta.Remote
		if st.push == nil || st.push.state == pushDone || rm.EngineID != engineID || rm.Host != host || rm.Port != port {
			continue // a handshake elsewhere says nothing of the agents at this request's address
		}
		pw := st.push
		gone := 0
		for a, said := range pw.ranks {
			if !said && !live[a] {
				pw.ranks[a] = true
				gone++
			}
		}
		if gone > 0 {
			if pw.state == pushWaiting {
				w.stats.RecordFailedTransfer()
				w.failLocked(st, "transfer_failed", fmt.Sprintf("%d agents of prefill engine %s are gone before their WRITE", gone, engineID), nil)
				w.holdPushLocked(st, "the prefill's agents are gone")
			}
			w.log.Info("push: prefill agents the registration reached are gone", zap.String("request_id", id),
				zap.String("remote_engine_id", engineID), zap.Int("gone", gone))
		}
		if pw.allSaid() {
			w.endPushWaitLocked(st)
		} else if pw.state == pushHolding && err == nil && re != nil {
			st.remote = re
			w.sendPushCancelLocked(st)
		}
	}
}
