// Leases: how long a prefill holds a request's blocks for its readers, on
// both sides of the transfer.

package shim

import (
	"fmt"
	"math"
	"sort"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/shim/kvwire"
)

// leaseSafetyMargin is how much of the remote lease must be left to start a
// READ (vLLM's margin for its turn-2 reads), for leases of 20 s and more;
// shorter leases get a quarter of their length (a fixed 5 s would refuse

// leases maps request ids to deadlines on the worker's injected clock. The
// prefill keeps one per request whose blocks wait for readers (Worker.held:
// the lease's end, extended by heartbeats, freed once passed); the decode
// keeps one per remote request it heartbeats (Worker.floors: a lower bound
// of the remote lease's end, raised by heartbeats sent while that lease was
// surely alive). Guarded by the worker's mutex.
type leases struct {
	clock Clock
	until map[string]float64
	// low is a lower bound of every deadline in until (+Inf when empty), so
	// that Expired skips its full sweep while nothing can be due: Hold and
	// Raise lower it to a deadline they set, Extend and Drop keep it a bound
	// (they only raise or remove deadlines), and a full sweep makes it exact
	// again. With 10,000 requests held, get_finished then stops walking the
	// whole table every engine step; it walks it about once a lease length.
	low float64
}

func newLeases(clock Clock) *leases {
	return &leases{clock: clock, until: map[string]float64{}, low: math.Inf(1)}
}

// Deadline returns the lease's end and whether id holds one.
func (l *leases) Deadline(id string) (float64, bool) {
	t, ok := l.until[id]
	return t, ok
}

// Hold sets id's lease to end at until.
func (l *leases) Hold(id string, until float64) {
	l.until[id] = until
	l.low = min(l.low, until)
}

// Extend moves the end of a lease id holds to until if that is later; a
// lease not held is not created (an expired one is never revived).
func (l *leases) Extend(id string, until float64) {
	if old, ok := l.until[id]; ok && until > old {
		l.until[id] = until
	}
}

// Raise sets id's lease to end no earlier than until, creating it.
func (l *leases) Raise(id string, until float64) {
	if old, ok := l.until[id]; !ok || until > old {
		l.until[id] = until
		l.low = min(l.low, until)
	}
}

// Drop forgets id's lease.
func (l *leases) Drop(id string) { delete(l.until, id) }

// Len is the number of leases held.
func (l *leases) Len() int { return len(l.until) }

// IDs returns the ids holding a lease, sorted.
func (l *leases) IDs() []string {
	out := make([]string, 0, len(l.until))
	for id := range l.until {
		out = append(out, id)
	}
	sort.Strings(out)
	return out
}

// Expired removes and returns (sorted) every lease whose end has passed: a
// full sweep, since extensions move deadlines in place.
func (l *leases) Expired() []string {
	now := l.clock()
	if now < l.low {
		return nil // nothing can be due yet
	}
	var out []string
	low := math.Inf(1)
	for id, t := range l.until {
		if now >= t {
			out = append(out, id)
		} else {
			low = min(low, t)
		}
	}
	l.low = low
	sort.Strings(out)
	for _, id := range out {
		delete(l.until, id)
	}
	return out
}

// every READ under a lease below 5 s).
const leaseSafetyMargin = 5.0

// leaseMarginFor is the safety margin for a lease of the given length.
func leaseMarginFor(lease float64) float64 {
	return min(leaseSafetyMargin, lease/4)
}

// leaseLeft is how long, on this worker's clock, the remote engine will
// still hold the request's blocks: the expiry it sent (rebased by the
// handshake's clock offset, less that sample's round trip as error bound),
// raised by the heartbeats this worker sent. +Inf when the remote sent no
// expiry (a stock vLLM prefill): nothing to check against.
func (w *Worker) leaseLeft(st *recvState) float64 {
	rm := st.meta.Remote
	if rm.Expiry == nil || st.remote == nil {
		return math.Inf(1)
	}
	deadline := *rm.Expiry - st.remote.offset - st.remote.rtt.Seconds()
	if floor, ok := w.floors.Deadline(rm.RequestID); ok && floor > deadline {
		deadline = floor
	}
	return deadline - w.clock()
}

// leaseDetail explains a lease decision for the failure log.
func (w *Worker) leaseDetail(st *recvState) string {
	rm := st.meta.Remote
	if rm.Expiry == nil || st.remote == nil {
		return "no expiry"
	}
	floor, hasFloor := w.floors.Deadline(rm.RequestID)
	return fmt.Sprintf("remote expiry %.3f, clock offset %.3f, rtt %v, heartbeat floor %.3f (%v), now %.3f",
		*rm.Expiry, st.remote.offset, st.remote.rtt, floor, hasFloor, w.clock())
}

func (w *Worker) sendHeartbeatsLocked(hbs map[string]*HeartbeatInfo) {
	engines := make([]string, 0, len(hbs))
	for e := range hbs {
		engines = append(engines, e)
	}
	sort.Strings(engines)
	for _, eng := range engines {
		info := hbs[eng]
		re, ok := w.remotes[eng]
		if !ok {
			w.startHandshakeLocked(eng, info.Host, info.Port, info.TPSize, "")
			continue
		}
		w.touchRemoteLocked(re)
		msg := kvwire.HeartbeatNotif(info.ReqIDs)
		sent := w.clock()
		// Every remote rank holds the request's blocks under its own lease.
		sentAll := true
		for _, a := range re.agents() {
			if err := w.agent.SendNotif(a, msg); err != nil {
				w.log.Debug("heartbeat send failed", zap.String("remote_engine_id", eng), zap.String("remote_agent", a), zap.Error(err))
				sentAll = false
			}
		}
		if !sentAll {
			continue
		}
		// The prefill extends a lease it still holds to at least (its
		// receive time + 2/3 of its lease); its receive time is after our
		// send time. A heartbeat counts only if the lease was surely alive
		// when it arrived: sent with more than the safety margin left of
		// what we know (the expiry it sent, or an earlier heartbeat). A
		// lease that already ended is never revived, and without a known
		// expiry there is nothing to extend. Both sides are assumed to use
		// the same kv_lease_duration, as heartbeats themselves do.
		for _, id := range info.ReqIDs {
			exp, ok := info.Expiry[id]
			if !ok {
				continue
			}
			if _, released := w.released.Deadline(eng + "\x00" + id); released {
				// This worker told the remote it is done with these blocks
				// (its READ completed, or it let go of them): the remote
				// freed them, and a heartbeat extends nothing. Another
				// request with the same params gets no floor from it.
				w.floors.Drop(id)
				continue
			}
			bound := exp - re.offset - re.rtt.Seconds()
			if f, ok := w.floors.Deadline(id); ok && f > bound {
				bound = f
			}
			if sent+w.leaseMargin < bound {
				w.floors.Raise(id, sent+w.leaseExtend)
			}
		}
	}
}
