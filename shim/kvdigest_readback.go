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
// forward, as a pull prefill's do; the digests come back in the step's
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
