package shim

// KV digests of a bidirectional read-back: the decode holds a finished
// request's blocks for the next turn's prefill, and that prefill checks what
// it read against the decode's digests.
//
// The decode's params leave with the request's last output
// (request_finished), before any of its workers could hash the blocks, so
// they carry gonixl_kv_digest_served instead of the digests. The Python
// connector lists the request in the next step's metadata (the held blocks,
// the advertised token count) and its workers digest them after that step's
// forward, off vLLM's thread (KVDigestsHeld: a goroutine of the worker's,
// whose result a later step takes); the digests come back in that step's
// worker metadata and reach this scheduler through SetKVDigests. The side
// channel serves them by request id (sidechannel.KVDigestMsg) until the
// hold's TTL is over and a grace after it: the reader's READ notification
// ends the hold, and the reader fetches the digests while its READ runs or
// right after. A request the workers did not digest is answered "none"
// (read unchecked); one whose digests are not in yet "pending" (the reader
// polls, bounded by its handshake_timeout).

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/shim/kvwire"
	"github.com/gonixl/gonixl/sidechannel"
)

// Served digests' answers: the side channel's KV digest reply statuses.
const (
	digestPending = sidechannel.KVDigestPending
	digestOK      = sidechannel.KVDigestOK
	digestNone    = sidechannel.KVDigestNone
)

// servedGrace keeps digests past the hold's TTL (a reader whose READ ended
// the hold fetches after it; a reader's READ never starts this late).
const servedGrace = 60.0

// The store's bounds; the oldest entries go first.
const (
	maxServedDigests     = 1 << 16
	maxServedDigestBytes = 256 << 20
)

// servedDigest is one held request's digests.
type servedDigest struct {
	state  string
	digest []byte // JSON of kvwire.KVDigest (state ok)
	until  float64
}

// servedDigests is the store. order is insertion order, an entry of it
// standing for m[id] only while their until agree (a request id served
// again gets a new place); every entry has the same lifetime, so they
// expire in that order.
type servedDigests struct {
	m     map[string]*servedDigest
	order []servedAt
	bytes int
}

type servedAt struct {
	id    string
	until float64
}

// serveDigestLocked starts serving reqID's digests ("pending" until its
// workers' digests come) for its hold of ttl seconds.
func (s *Scheduler) serveDigestLocked(reqID string, ttl float64) {
	now := s.clock()
	s.expireServedLocked(now)
	if s.served.m == nil {
		s.served.m = map[string]*servedDigest{}
	}
	if old, ok := s.served.m[reqID]; ok {
		s.served.bytes -= len(old.digest)
	}
	e := &servedDigest{state: digestPending, until: now + ttl + servedGrace}
	s.served.m[reqID] = e
	s.served.order = append(s.served.order, servedAt{reqID, e.until})
	s.trimServedLocked()
}

// expireServedLocked drops the entries whose time is over.
func (s *Scheduler) expireServedLocked(now float64) {
	for len(s.served.order) > 0 {
		at := s.served.order[0]
		if e, ok := s.served.m[at.id]; ok && e.until == at.until && e.until > now {
			return
		}
		s.dropOldestServedLocked()
	}
}

// trimServedLocked drops the oldest entries past the store's bounds.
func (s *Scheduler) trimServedLocked() {
	for len(s.served.order) > 0 && (len(s.served.m) > maxServedDigests || s.served.bytes > maxServedDigestBytes || len(s.served.order) > 2*maxServedDigests) {
		s.dropOldestServedLocked()
	}
}

func (s *Scheduler) dropOldestServedLocked() {
	at := s.served.order[0]
	if e, ok := s.served.m[at.id]; ok && e.until == at.until {
		s.served.bytes -= len(e.digest)
		delete(s.served.m, at.id)
	}
	s.served.order = s.served.order[1:]
	if len(s.served.order) == 0 {
		s.served.order = nil // let the backing array go
	}
}

// SetKVDigests takes the workers' digests of held blocks: a JSON object by
// request id, each a gonixl_kv_digest value (docs/PROTOCOL.md), or null for
// a request the workers did not digest (then answered "none").
func (s *Scheduler) SetKVDigests(in []byte) (err error) {
	defer classify(&err, ErrInvalidInput)
	var m map[string]json.RawMessage
	if err := json.Unmarshal(in, &m); err != nil {
		return fmt.Errorf("kv digests: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireServedLocked(s.clock())
	for id, d := range m {
		e, ok := s.served.m[id]
		if !ok {
			continue // its hold ended, or it was never held
		}
		s.served.bytes -= len(e.digest)
		if len(d) == 0 || string(d) == "null" {
			e.state, e.digest = digestNone, nil
			continue
		}
		e.state, e.digest = digestOK, append([]byte(nil), d...)
		s.served.bytes += len(e.digest)
	}
	s.trimServedLocked()
	return nil
}

// serveKVDigest answers the side channel's KV digest query.
func (s *Scheduler) serveKVDigest(reqID string) (string, []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireServedLocked(s.clock())
	e, ok := s.served.m[reqID]
	if !ok {
		return digestNone, nil
	}
	return e.state, e.digest
}

// listenerDigests is the listener's KV digest provider (it answers "none"
// for every request unless this scheduler serves read-back digests).
func (s *Scheduler) listenerDigests() func(string) (string, []byte) {
	if s.cfg.KVDigestReadback {
		s.log.Info("serving KV digests of blocks held for read-back on the side channel", zap.String("kv_digest", s.cfg.KVDigest))
	}
	return s.serveKVDigest
}

// fetchedDigest is a read-back's digests as the decode served them, or why
// there are none to check against.
type fetchedDigest struct {
	d   *kvwire.KVDigest
	why string
}

// fetchDigestLocked fetches the digests of st's read-back from the decode's
// side channel on a goroutine, bounded by handshake_timeout; the check
// (runCheck) takes them once the READ is done. An answer of "none", a
// timeout or an unreachable decode leaves the blocks unchecked (said once):
// the READ's own checks (lease, instance) stand.
func (w *Worker) fetchDigestLocked(st *recvState) (<-chan fetchedDigest, context.CancelFunc) {
	ch := make(chan fetchedDigest, 1)
	rm := st.meta.Remote
	hs := w.hs
	// Ended by Close, by the request's end (a failed READ stops asking)
	// and by handshake_timeout.
	ctx, cancel := context.WithTimeout(w.fetches, time.Duration(w.cfg.HandshakeTimeout*float64(time.Second)))
	send := func(f fetchedDigest) {
		select { // the first answer stands
		case ch <- f:
		default:
		}
	}
	w.goSafe("kv digest fetch", func(err error) {
		send(fetchedDigest{why: "fetching the decode's KV digests failed: " + err.Error()})
	}, func() {
		if hs == nil {
			send(fetchedDigest{why: "no side-channel client"})
			return
		}
		b, err := hs.KVDigest(ctx, rm.Host, rm.Port, rm.RequestID)
		switch {
		case err != nil:
			send(fetchedDigest{why: fmt.Sprintf("the decode's KV digests could not be fetched from %s:%d: %v", rm.Host, rm.Port, err)})
			return
		case b == nil:
			send(fetchedDigest{why: "the decode has no KV digests of these blocks (not digested, or its hold is over)"})
			return
		}
		d, err := kvwire.ParseKVDigest(b, rm.BlockIDs)
		switch {
		case err != nil:
			send(fetchedDigest{why: "the decode's KV digests are malformed: " + err.Error()})
		case d.Tokens != rm.NumTokens:
			send(fetchedDigest{why: fmt.Sprintf("the decode's KV digests cover another token count: %d, its params %d", d.Tokens, rm.NumTokens)})
		default:
			send(fetchedDigest{d: d})
		}
	})
	return ch, cancel
}

// heldDigests is a decode worker's read-back hashing (KVDigestsHeld). The
// held blocks are the connector's until this worker reports the hold in
// finished_sending; the hashing reads them, so that report waits for it:
//
//	event                                  effect
//	KVDigestsHeld                          hashing[id]; a goroutine hashes
//	the hold ends (reader's notification,  finished_sending held back
//	  lease) while hashing[id]               (sendLater[id])
//	the goroutine ends                     ready[id] (null: none, on a panic);
//	                                         sendLater[id] reported; change
//	                                         counter bumped
//	TakeHeldDigests (get_finished said     ready handed to the scheduler
//	  digests pending)                       (worker metadata)
//	Close                                  waits for the goroutine (w.checks)
//
// The metadata that installs a hold (ReqsToSend) also asks for its
// digests, a step after request_finished's (two under async scheduling); a
// reader done before that step does not end the hold early: its end waits
// for that step (send.go readEarlyLocked), so the hashing finds the blocks
// still held. Should a hold's finished_sending be reported before its
// digests are asked for all the same (sent, the last maxSentRemembered),
// vLLM may reuse its blocks: it is not hashed, its digests are ready as
// none (null), and the reader reads unchecked at once instead of failing
// on a hash of reused blocks.
type heldDigests struct {
	hashing   map[string]int // goroutines hashing the request's hold
	sendLater map[string]bool
	ready     map[string]*DigestOut // nil: none
	sent      map[string]bool
	sentOrder []string
	// hook, tests: runs on the hashing goroutine before it hashes.
	hook func([]DigestReq)
}

// KVDigestsHeld starts hashing the held blocks of a bidirectional decode's
// finished requests (a JSON list of DigestReq, as KVDigests takes) on a
// goroutine, and returns at once: called after the forward of the step
// whose metadata listed them (the step that wrote their last advertised
// token is done by then), on vLLM's thread. The digests are taken with
// TakeHeldDigests once get_finished says they are pending; each request's
// finished_sending waits for its hashing.
func (w *Worker) KVDigestsHeld(in []byte) error {
	defer w.lockTimed("kv_digests_held")()
	reqs, err := w.digestReqsLocked(in)
	if err != nil || len(reqs) == 0 {
		return err
	}
	hd := &w.heldDigest
	hd.init()
	todo := reqs[:0:0]
	for _, r := range reqs {
		if hd.sent[r.ID] {
			hd.ready[r.ID] = nil
			if w.noteOnce("held digest after finished_sending") {
				w.log.Info("a read-back hold ended before its digests were asked for (its reader was quicker than this engine's next step); served as not digested, read unchecked (logged once)",
					zap.String("request_id", r.ID))
			}
			continue
		}
		hd.hashing[r.ID]++
		todo = append(todo, r)
	}
	if len(todo) == 0 {
		w.publishLocked(true)
		return nil
	}
	reqs = todo
	hook := hd.hook
	w.checks.Add(1)
	var once sync.Once
	done := func() { once.Do(w.checks.Done) }
	out := make(map[string]DigestOut, len(reqs))
	finish := func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		defer w.publishLocked(true)
		for _, r := range reqs {
			if hd.hashing[r.ID]--; hd.hashing[r.ID] > 0 {
				continue // listed twice (a request id reused): the other hashing reports
			}
			delete(hd.hashing, r.ID)
			if !w.closed {
				hd.ready[r.ID] = nil // not digested (a panic): served as none at once
				if d, ok := out[r.ID]; ok {
					hd.ready[r.ID] = &d
				}
			}
			if hd.sendLater[r.ID] {
				delete(hd.sendLater, r.ID)
				w.done.Sending = append(w.done.Sending, r.ID)
			}
		}
	}
	var finished sync.Once // a panic after finish began must not end the holds twice
	w.goSafe("kv digests of held blocks", func(error) { finished.Do(finish); done() }, func() {
		defer done()
		if hook != nil {
			hook(reqs)
		}
		for _, r := range reqs {
			// One goroutine: nobody waits on it, and vLLM's forward (its
			// threads on every core, on a CPU platform) runs meanwhile.
			if d, ok := w.digestReq(r, 1); ok {
				out[r.ID] = d
			}
		}
		finished.Do(finish)
	})
	return nil
}

func (hd *heldDigests) init() {
	if hd.hashing == nil {
		hd.hashing, hd.sendLater, hd.ready, hd.sent = map[string]int{}, map[string]bool{}, map[string]*DigestOut{}, map[string]bool{}
	}
}

// heldAgainLocked forgets that id's finished_sending was reported: a new
// hold of it (a request id reused) is installed and will be hashed.
func (hd *heldDigests) heldAgainLocked(id string) {
	delete(hd.sent, id) // the ids stay in sentOrder until they age out; harmless
}

// maxSentRemembered bounds the finished_sending ids a bidirectional
// decode remembers (heldDigests.sent): far more than the holds that end
// within the step or two before their digests are asked for.
const maxSentRemembered = 1 << 12

// heldSendingLocked takes out of a poll's finished_sending the holds whose
// blocks are still being hashed: reported when the hashing ends. A
// bidirectional decode that digests its holds remembers the ids it reports.
func (w *Worker) heldSendingLocked(ids []string) []string {
	hd := &w.heldDigest
	if len(hd.hashing) > 0 {
		keep := ids[:0]
		for _, id := range ids {
			if hd.hashing[id] > 0 {
				hd.sendLater[id] = true
				continue
			}
			keep = append(keep, id)
		}
		ids = keep
	}
	if len(ids) > 0 && w.cfg.BidirectionalKVXfer && w.cfg.KVDigest != KVDigestOff {
		hd.init()
		for _, id := range ids {
			if hd.sent[id] {
				continue
			}
			if len(hd.sentOrder) >= maxSentRemembered {
				delete(hd.sent, hd.sentOrder[0])
				hd.sentOrder = hd.sentOrder[1:]
			}
			hd.sent[id] = true
			hd.sentOrder = append(hd.sentOrder, id)
		}
	}
	return ids
}

// TakeHeldDigests returns the digests KVDigestsHeld finished since the
// last call, by request id (a JSON object of DigestOut; null: not
// digested, served as none).
func (w *Worker) TakeHeldDigests() ([]byte, error) {
	defer w.lockTimed("take held digests")()
	hd := &w.heldDigest
	out := maps.Clone(hd.ready)
	clear(hd.ready)
	if out == nil {
		out = map[string]*DigestOut{}
	}
	return json.Marshal(out)
}
