// The sending side (a prefill's worker): requests whose blocks are held
// for decodes to read, counting the consumers' notifications until every
// reader is done, and freeing what the lease let lapse.

package shim

import (
	"fmt"
	"strings"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/shim/kvwire"
)

// pollNotifsLocked drains the engine's notifications (kvwire/notif.go): a
// heartbeat extends the leases it names that are still held; a done
// notification counts one reader, and the request's blocks are released
// once all its readers are done. One for a request neither held nor in the
// batch is counted as arriving after expiry (vLLM's metric and log line).
func (w *Worker) pollNotifsLocked() {
	var notifs []nixl.Notif
	var err error
	if tn, ok := w.agent.(nixl.TryNotifier); ok {
		// Never behind the engine's own thread (nixl.TryChecker's reason):
		// drained at the next poll, and no lease is swept before that.
		var got bool
		if notifs, err, got = tn.TryGetNotifs(); !got {
			w.notifsSkipped = true
			return
		}
	} else {
		notifs, err = w.agent.GetNotifs()
	}
	w.notifsSkipped = false
	if err != nil {
		// A heartbeat may be among what could not be read: no lease is
		// swept until the notifications are drained again (a decode whose
		// heartbeat extended a lease may be reading those blocks).
		w.notifsFailed = true
		w.log.Warn("draining notifications failed; leases are held until it works again", zap.Error(err))
		return
	}
	w.notifsFailed = false
	for _, n := range notifs {
		msg := string(n.Msg)
		switch {
		case strings.HasPrefix(msg, kvwire.PushRegPrefix):
			w.pushRegLocked(n.Agent, n.Msg[len(kvwire.PushRegPrefix):])
			continue
		case strings.HasPrefix(msg, kvwire.PushCancelPrefix):
			w.pushCancelLocked(n.Agent, n.Msg[len(kvwire.PushCancelPrefix):])
			continue
		case w.pushNotifLocked(n.Agent, msg):
			continue
		}
		nt, ok := kvwire.ParseNotif(msg)
		if !ok {
			w.log.Warn("malformed notification", zap.String("from", n.Agent), zap.String("msg", msg))
			continue
		}
		if nt.Heartbeat {
			exp := w.clock() + w.leaseExtend
			for _, id := range nt.IDs {
				if _, held := w.held.Deadline(id); held {
					w.held.Extend(id, exp)
				} else {
					// Its lease is not installed yet (the step that
					// carries it has not reached this worker): the decode
					// counts on this heartbeat, so it applies when it is.
					w.earlyHeartbeatLocked(id, exp)
				}
			}
			continue
		}
		id, want := nt.ReqID, nt.Consumers
		_, sending := w.held.Deadline(id)
		_, processing := w.toProcess[id]
		if !sending && !processing {
			w.stats.RecordNotifAfterExpiry()
			if w.cfg.TransferMode == "push" {
				// vLLM's push connector's words: a WRITE's notification for
				// a request this engine no longer waits for.
				w.log.Error(fmt.Sprintf("Unrecognized request %s notif (may have expired).", id), zap.String("from", n.Agent))
				continue
			}
			w.log.Error("Potentially invalid KV blocks for unrecognized request were retrieved by a decode worker. They may have expired.",
				zap.String("req_id", id))
			continue
		}
		w.consumers[id]++
		if w.consumers[id] >= want {
			delete(w.consumers, id)
			if !sending && w.readEarlyLocked(id) {
				continue
			}
			delete(w.toProcess, id)
			w.held.Drop(id)
			w.done.Sending = append(w.done.Sending, id)
		}
	}
}

// holdForReadersLocked records the step's sending-side requests: those in
// the batch (their notifications are expected), those vLLM will not process
// after all, and the leases of those whose blocks now wait for readers
// (rebased from the scheduler's clock to this worker's).
func (w *Worker) holdForReadersLocked(m *StepMeta) {
	for _, id := range m.ReqsInBatch {
		w.toProcess[id] = struct{}{}
	}
	for _, id := range m.ReqsNotProcessed {
		delete(w.toProcess, id)
		w.held.Drop(id)
		w.readEarly.Drop(id)
	}
	now := w.clock()
	for id, exp := range m.ReqsToSend {
		if _, ok := w.toProcess[id]; !ok {
			continue
		}
		if m.SchedulerClock != 0 {
			exp = now + (exp - m.SchedulerClock) // rebase to this worker's clock
		}
		if hb, ok := w.earlyHB.Deadline(id); ok {
			w.earlyHB.Drop(id)
			exp = max(exp, hb)
		}
		w.heldDigest.heldAgainLocked(id)
		if _, early := w.readEarly.Deadline(id); early {
			// Its readers are done: the hold ends now, in this step's
			// get_finished, after the digests this step's metadata asks
			// for (heldSendingLocked holds it back while they hash).
			w.readEarly.Drop(id)
			delete(w.toProcess, id)
			w.done.Sending = append(w.done.Sending, id)
			continue
		}
		w.held.Hold(id, exp)
	}
}

// maxReadEarly bounds the requests readEarly keeps (a peer's notifications
// put them there; beyond it they end as before).
const maxReadEarly = 1 << 12

// readEarlyLocked keeps the end of id's hold for the step that installs
// it, when this decode serves read-back digests: a reader may finish
// before that step (the params leave with the request's last output; the
// hold and its digest ask come in the next step's metadata, two steps on
// under async scheduling), and a hold ended then has its blocks back in
// vLLM's hands before they are hashed, so the reader reads unchecked. Held
// to that step, the blocks stay the connector's until the hashing the same
// step starts is done. False when id ends now, as it always did: no
// digests served here, or too many kept.
func (w *Worker) readEarlyLocked(id string) bool {
	if !w.cfg.BidirectionalKVXfer || w.cfg.KVDigest == KVDigestOff || w.readEarly.Len() >= maxReadEarly {
		return false
	}
	// Until the hold surely came or will not: a lease's length twice over.
	w.readEarly.Raise(id, w.clock()+2*max(w.cfg.KVLeaseDuration, w.cfg.DecoderKVBlocksTTL))
	return true
}

// maxEarlyHeartbeats bounds the heartbeats kept for leases not installed
// yet (a decode's word, so bounded).
const maxEarlyHeartbeats = 1 << 16

// earlyHeartbeatLocked keeps a heartbeat for a lease this worker has not
// installed yet, until the extension it grants has passed.
func (w *Worker) earlyHeartbeatLocked(id string, exp float64) {
	if w.earlyHB.Len() >= maxEarlyHeartbeats {
		w.earlyHB.Expired()
		if w.earlyHB.Len() >= maxEarlyHeartbeats {
			return
		}
	}
	w.earlyHB.Raise(id, exp)
}

// sweepLeasesLocked frees every request whose lease has passed, unless
// the last drain of notifications failed.
func (w *Worker) sweepLeasesLocked() {
	if w.notifsFailed || w.notifsSkipped {
		return
	}
	w.earlyHB.Expired()
	// A kept end whose hold never came (vLLM did not hold the blocks after
	// all) has nothing to report.
	w.readEarly.Expired()
	for _, id := range w.held.Expired() {
		if ps := w.push.sends[id]; ps != nil {
			if len(ps.xfers) > 0 {
				// Our own WRITE still reads these blocks: they are freed
				// when it ends (bounded by transfer_timeout) or, failed,
				// when its handles are released.
				w.held.Hold(id, w.clock()+1)
				continue
			}
			// Not posted yet (no registration, or a handshake with the
			// decode pending): the blocks go back to vLLM now, so they
			// are never written.
			w.abandonPushLocked(ps)
		}
		n := w.consumers[id]
		delete(w.consumers, id)
		delete(w.toProcess, id)
		w.stats.RecordKVExpired()
		w.log.Warn("Releasing expired KV blocks", zap.String("req_id", id), zap.Int("read_by_workers", n))
		w.done.Sending = append(w.done.Sending, id)
	}
}
