package nixltest

import (
	"bytes"
	"sort"

	"github.com/gonixl/gonixl/nixl"
)

// Observation and control of transfers and notifications, for tests that
// check what a higher layer lets the engine touch (shim's model test):
// every data movement can be seen as it happens (SetMoveHook), every live
// transfer listed (Transfers), notifications held back and delivered later
// or twice (SetNotifHook, Agent.Inject), and a transfer in flight finished
// by the engine's own progress, as a real engine does whether or not its
// owner polls (Settle).

// Move is one transfer's data movement, reported before the bytes move.
type Move struct {
	ID        uint64
	Op        nixl.XferOp
	Initiator string // the agent that made the transfer
	Target    string // the remote agent
	// Local[i] and Remote[i] are the i-th descriptor pair: a READ copies
	// Remote[i] into Local[i], a WRITE Local[i] into Remote[i].
	Local, Remote []nixl.Desc
	Notif         []byte // nil: none
}

// XferState is a transfer request not yet released.
type XferState struct {
	ID                uint64
	Op                nixl.XferOp
	Initiator, Target string
	// Dead: the initiator died (Kill) or closed; its operations move
	// nothing any more.
	Dead   bool
	Posted bool
	Status nixl.Status // InProgress while posted and not finished
	Local  []nixl.Desc
	Remote []nixl.Desc
	Notif  []byte
	// Refused counts the releases the engine refused.
	Refused int
	// MayMove: its operations were issued and have neither completed nor
	// been cancelled (initiator and peer alive, the peer's metadata not
	// invalidated): bytes may still move, with or without a poll (Settle).
	MayMove bool
}

// SetMoveHook sets fn to be called whenever a transfer moves bytes, just
// before they move (nil removes it). fn runs with the engine's lock held
// and must not call into the engine.
func (e *Engine) SetMoveHook(fn func(Move)) {
	e.mu.Lock()
	e.moveHook = fn
	e.mu.Unlock()
}

// SetNotifHook sets fn to see every notification before it reaches its
// target's inbox: those sent with SendNotif and a completed transfer's
// (nil removes it). When fn returns true it has taken the notification:
// the engine does not deliver it (the test may deliver it later, or
// several times, with Agent.Inject). fn runs with the engine's lock held
// and must not call into the engine.
func (e *Engine) SetNotifHook(fn func(from, to string, msg []byte) bool) {
	e.mu.Lock()
	e.notifHook = fn
	e.mu.Unlock()
}

// deliverLocked queues msg from agent from in to's inbox, unless the
// notification hook takes it.
func (e *Engine) deliverLocked(from, to *Agent, msg []byte) {
	if h := e.notifHook; h != nil && h(from.cfg.Name, to.cfg.Name, bytes.Clone(msg)) {
		return
	}
	to.inbox = append(to.inbox, nixl.Notif{Agent: from.cfg.Name, Msg: bytes.Clone(msg)})
}

// Transfers lists every transfer request not yet released, by ID.
func (e *Engine) Transfers() []XferState {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]XferState, 0, len(e.live))
	for _, x := range e.live {
		mv := x.moveInfo(nil)
		out = append(out, XferState{
			ID: x.id, Op: x.op, Initiator: x.a.cfg.Name, Target: x.remote.agent,
			Dead: x.a.dead || x.a.closed, Posted: x.posted, Status: x.status,
			Local: mv.Local, Remote: mv.Remote, Notif: bytes.Clone(x.notif), Refused: x.refused,
			MayMove: x.posted && x.started && x.status != nixl.Success && !x.a.dead && !x.a.closed && x.peerLocked() != nil,
		})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Settle ends transfer id, posted and not released, as the engine's own
// progress would, whether or not its owner polls it: with move, its bytes
// are copied and, if it was still in progress, its notification is
// delivered and it completes (a later Check reports Success); a transfer
// whose Check already reported a failure but whose release was refused
// moves its bytes without completing. Without move, one still in progress
// fails with ERR_BACKEND and nothing is copied. Nothing moves for an
// initiator or peer that died or closed, nor once the peer's metadata was
// invalidated or reloaded (its operations were cancelled): the transfer
// then fails instead. Settle reports whether the transfer changed.
func (e *Engine) Settle(id uint64, move bool) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	x, ok := e.live[id]
	if !ok || !x.posted || x.status == nixl.Success || x.a.dead || x.a.closed {
		return false
	}
	peer := x.peerLocked()
	if !move || peer == nil {
		if x.status != nixl.InProgress {
			return false
		}
		x.status = nixl.ErrBackend
		if peer == nil {
			x.status = nixl.ErrRemoteDiscon
		}
		return true
	}
	if x.status == nixl.InProgress {
		x.complete(peer)
		return true
	}
	if !x.started {
		return false // its Post failed: nothing was issued
	}
	x.move(peer)
	return true
}

// peerLocked is the live agent at the far end of x, or nil when it died,
// closed, or (unless the script says operations survive it) its metadata
// was invalidated or reloaded since x was made.
func (x *xfer) peerLocked() *Agent {
	if x.a.script.InFlightSurvivesInvalidate && x.peer != nil {
		if x.peer.dead || x.peer.closed {
			return nil
		}
		return x.peer
	}
	ri := x.a.remotes[x.remote.agent]
	if ri == nil || ri.gen != x.gen || ri.agent.dead || ri.agent.closed {
		return nil
	}
	return ri.agent
}

// moveInfo describes x's descriptor pairs (peer nil: the target by name).
func (x *xfer) moveInfo(peer *Agent) Move {
	m := Move{ID: x.id, Op: x.op, Initiator: x.a.cfg.Name, Target: x.remote.agent,
		Local: make([]nixl.Desc, len(x.li)), Remote: make([]nixl.Desc, len(x.ri))}
	if peer != nil {
		m.Target = peer.cfg.Name
	}
	for i := range x.li {
		m.Local[i], m.Remote[i] = x.local.descs[x.li[i]], x.remote.descs[x.ri[i]]
	}
	if x.hasNotif {
		m.Notif = bytes.Clone(x.notif)
	}
	return m
}

// FailNext makes the agent's next occurrence of step fail with st
// (ERR_BACKEND for 0 or InProgress), whatever its script says.
func (a *Agent) FailNext(step Step, st nixl.Status) {
	if st == 0 || st == nixl.InProgress {
		st = nixl.ErrBackend
	}
	a.e.mu.Lock()
	a.next[step] = st
	a.e.mu.Unlock()
}
