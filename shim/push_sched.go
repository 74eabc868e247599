// Push mode, the scheduler's side: what each step's metadata tells the
// workers about push requests, and the early push's guard against
// preemption.
//
// An announced request (PushPromptDone: its prompt completes this step,
// its blocks are WRITTEN once the forward is done) is still running in
// vLLM until request_finished: with async scheduling the next step is
// scheduled first, and a preemption there would free its blocks while the
// WRITE reads them. While any request is announced and not finished,
// PendingBlockFrees is true: vLLM's has_pending_block_frees, which vLLM's
// scheduler asks before it preempts to make room, and which makes it wait
// a step instead. A preemption that does not ask (reset_prefix_cache) is
// reported by the Python connector (PushPreempted, from the step's
// preempted request ids) and goes to the workers in the step's metadata,
// which they take in vLLM's handle_preemptions, before the forward that
// could overwrite the blocks (push_send.go).
//
// A prefill request's states here:
//
//	(none) --PushPromptDone--> announced --RequestFinished--> finished (blocks held, PushFinished in the step's metadata)
//	announced --PushPreempted--> (none; PushPreempted in the step's metadata; recomputed, it finishes through request_finished)
//	announced for pushAnnounceStale seconds without request_finished --> (none; PushPreempted, as a preemption), logged
//
// A decode request's: UpdateStateAfterAlloc registers it (waiting) until
// UpdateConnectorOutput receives it, or RequestFinished (an abort) puts it
// in PushAborted.

package shim

import (
	"errors"

	"go.uber.org/zap"
)

// pushAnnounceStale: an announced request whose request_finished has not
// come after this long is forgotten (vLLM finishes a max_tokens 1 request
// in the step that completes its prompt; a step or two with async
// scheduling or pipeline parallelism): it no longer holds preemption off.
const pushAnnounceStale = 30.0

// pushSched is a scheduler's push state. Guarded by the scheduler's mutex.
type pushSched struct {
	finished  map[string]*PushFinished // prefill: blocks to WRITE, for the next step's metadata
	early     map[string]*PushFinished // prefill: requests whose prompt this step completes
	announced map[string]float64       // prefill: announced, request_finished not yet seen (announce time)
	preempted []string                 // prefill: announced requests vLLM preempted (next step's metadata)
	waiting   map[string]struct{}      // decode: registered requests not yet received
	aborted   []string                 // decode: registered requests that finished first (next step's metadata)
}

func newPushSched() *pushSched {
	return &pushSched{finished: map[string]*PushFinished{}, early: map[string]*PushFinished{},
		announced: map[string]float64{}, waiting: map[string]struct{}{}}
}

// idle reports whether no push state needs a step's metadata.
func (p *pushSched) idle() bool {
	return len(p.finished) == 0 && len(p.early) == 0 && len(p.preempted) == 0 && len(p.aborted) == 0
}

// fill puts the step's push state in m and starts the next step's.
func (p *pushSched) fill(m *StepMeta) {
	if len(p.finished) > 0 {
		m.PushFinished = p.finished
		p.finished = map[string]*PushFinished{}
	}
	if len(p.early) > 0 {
		m.PushEarly = p.early
		p.early = map[string]*PushFinished{}
	}
	m.PushAborted, p.aborted = p.aborted, nil
	m.PushPreempted, p.preempted = p.preempted, nil
}

// PushPromptDone (push mode, a prefill) names a request whose prompt the
// step being scheduled completes, with its blocks: the workers WRITE them
// as soon as that step's forward is done (Worker.GetFinished), instead of
// after request_finished, which vLLM calls once the step's output is
// processed and whose blocks reach the workers only with a later step's
// metadata, after that step's forward (another prefill's, when several
// queue). The caller guarantees that the request finishes with this step
// (max_tokens 1) and that no block of it is freed before request_finished
// but by a preemption (full-attention groups only). Until its
// request_finished the request holds preemption off (PendingBlockFrees),
// and request_finished reports it as a push send whatever its status, so
// that its blocks stay held while the WRITE may read them.
func (s *Scheduler) PushPromptDone(reqID string, p *TransferParams, blockIDs BlockIDs, tokens int64) (err error) {
	defer classify(&err, ErrInvalidInput)
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.push() {
		return errors.New("push_prompt_done: this engine is not in push mode")
	}
	if p == nil || !p.DoRemoteDecode {
		return errors.New("push_prompt_done: the request is not a prefill for a remote decode (do_remote_decode)")
	}
	blockIDs = clipToWindow(blockIDs, s.cfg.TransferGroups, s.cfg.HMARequired)
	if blockIDs.Empty() {
		return nil
	}
	s.pushs.early[reqID] = &PushFinished{Blocks: blockIDs, PromptDigest: p.PromptDigest, Tokens: max(tokens, 0)}
	s.pushs.announced[reqID] = s.clock()
	return nil
}

// PushPreempted takes the request ids vLLM preempted this step (its
// SchedulerOutput's preempted_req_ids); those announced and not finished
// go to the workers, which drop their unposted WRITEs or wait for posted
// ones before the step's forward.
func (s *Scheduler) PushPreempted(reqIDs []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range reqIDs {
		if _, ok := s.pushs.announced[id]; !ok {
			continue
		}
		delete(s.pushs.announced, id)
		delete(s.pushs.early, id) // announced this very step: nothing to write
		s.pushs.preempted = append(s.pushs.preempted, id)
		s.log.Warn("push: vLLM preempted a request whose prompt was announced for its WRITE; the workers fence it", zap.String("req_id", id))
	}
}

// PendingBlockFrees is vLLM's has_pending_block_frees: true while a
// request is announced for an early WRITE and not finished, so that vLLM
// waits a step instead of preempting (which would free blocks the WRITE
// reads).
func (s *Scheduler) PendingBlockFrees() bool {
	pending, _ := s.PendingBlockFreesFenced()
	return pending
}

// PendingBlockFreesFenced is PendingBlockFrees, and whether it handed
// stale announcements to the workers as preemptions (the next step's
// metadata then needs vLLM's handle_preemptions).
func (s *Scheduler) PendingBlockFreesFenced() (pending, fenced bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.clock()
	before := len(s.pushs.preempted)
	for id, t := range s.pushs.announced {
		if now-t > pushAnnounceStale {
			// vLLM may preempt it from now on without telling: the
			// workers treat it as preempted (its WRITE dropped, or
			// waited for), and its request_finished as any other.
			delete(s.pushs.announced, id)
			delete(s.pushs.early, id)
			s.pushs.preempted = append(s.pushs.preempted, id)
			s.log.Warn("push: an announced request was not finished within its step; it no longer holds preemption off, and its early WRITE is dropped", zap.String("req_id", id))
		}
	}
	pending = len(s.pushs.announced) > 0
	if pending {
		// vLLM asks only where it would preempt a request to make room
		// (scheduler.py's allocation loop): it waits a step instead.
		s.preemptionsDeferred++
	}
	return pending, len(s.pushs.preempted) > before
}

// pushAnnouncedLocked reports (and forgets) whether reqID was announced
// and not preempted: request_finished then reports it as a push send.
func (s *Scheduler) pushAnnouncedLocked(reqID string) bool {
	_, ok := s.pushs.announced[reqID]
	delete(s.pushs.announced, reqID)
	return ok
}
