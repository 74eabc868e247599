package proxy

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// StateStore keeps the multi-turn proxy's conversation state: per
// conversation_id, the kv_transfer_params a decode instance returned at the
// end of the conversation's last turn, for the next turn's prefill. Two
// implementations: ConversationCache (in process, the default) and
// proxy/redisstate (Redis or Valkey, shared by several proxy replicas).
//
// The rules every implementation keeps:
//
//   - Single use. TakeTurn removes the params it returns, atomically: of two
//     turns of one conversation racing (on one proxy or on two), exactly one
//     gets them. A prefill that reads a decode's blocks makes that decode
//     free them, so a second reader would read blocks vLLM may have reused.
//   - Turn order. TakeTurn gives the turn a number larger than that of any
//     earlier turn of the conversation; PutTurn with that number stores the
//     turn's params unless a later turn of the conversation has already
//     started (then it returns false). So a turn's params never replace
//     those of a turn the client sent after it, whatever order their decodes
//     finish in, and a Put that reaches the store late (its caller gave up
//     waiting) cannot bring back an older history. The numbers come from
//     the store itself (its clock or counter), not from the proxies' or the
//     decodes' clocks, and hold for decodes that put no expiry in their
//     params (vLLM's stock connector).
//   - Lifetime. An entry lives the decode's decoder_kv_blocks_ttl from its
//     Put; the prefill itself refuses params whose decode-side expiry has
//     passed (gonixl_expiry_unix, vLLM's remote_blocks_expiry_time), so an
//     entry kept a moment too long costs a full prefill, never a wrong read.
//   - No leakage. TakeTurn returns only params that a PutTurn stored for the
//     same conversation_id.
//
// An implementation that talks to a server returns an error when it cannot
// answer within the context's deadline; the proxy then serves the turn as a
// miss (a full prefill) and counts it.
type StateStore interface {
	// TakeTurn starts a turn of conversation id: it removes and returns the
	// conversation's params, if any, and numbers the turn.
	TakeTurn(ctx context.Context, id string) (Taken, error)
	// PutTurn stores a copy of params (a JSON object) for conversation id as
	// the result of turn, unless a turn numbered higher has started. It
	// reports whether it stored them.
	PutTurn(ctx context.Context, id string, turn uint64, params []byte) (bool, error)
	// Close releases the store's connections.
	Close() error
	// String names the store in logs and /health ("memory", "redis://...").
	String() string
}

// Taken is what TakeTurn found.
type Taken struct {
	Params []byte // the stored params when Result is Hit
	Result LookupResult
	Turn   uint64 // this turn's number (never 0)
}

// DefaultStateTimeout bounds each call to a remote StateStore.
const DefaultStateTimeout = 50 * time.Millisecond

// takeState is the turn's TakeTurn, bounded by Config.StateTimeout for a
// remote store. A failure is logged, counted, and reported as a miss with
// turn 0 (the turn then stores nothing).
func (p *Proxy) takeState(ex *exchange, conv string) Taken {
	ctx, cancel := p.stateContext(ex)
	t, err := p.state.TakeTurn(ctx, conv)
	cancel()
	if err != nil {
		p.stateFailed(ex, "take", conv, err)
		return Taken{}
	}
	p.stateOK()
	return t
}

// putState stores the turn's decode params when the turn was numbered.
func (p *Proxy) putState(ex *exchange, conv string, turn uint64, params []byte) {
	if turn == 0 {
		// The turn's TakeTurn failed: without a number it cannot be ordered
		// against the conversation's other turns, so it stores nothing and
		// the next turn is a full prefill.
		ex.logAt(zapcore.DebugLevel, "not caching decode kv_transfer_params: the turn has no number (state store failed)",
			zap.String("conversation_id", conv))
		return
	}
	ctx, cancel := p.stateContext(ex)
	stored, err := p.state.PutTurn(ctx, conv, turn, params)
	cancel()
	if err != nil {
		p.stateFailed(ex, "put", conv, err)
		return
	}
	p.stateOK()
	if !stored {
		p.m.stateSuperseded.Inc()
		ex.logAt(zapcore.DebugLevel, "decode kv_transfer_params not cached: a later turn of the conversation started",
			zap.String("conversation_id", conv), zap.Uint64("turn", turn))
		return
	}
	ex.logAt(zapcore.DebugLevel, "cached decode kv_transfer_params", zap.String("conversation_id", conv), zap.Uint64("turn", turn))
}

// stateContext bounds a remote store's call; the in-process store never
// waits. A Put runs after the decode answered: a client that has gone
// does not cancel it.
func (p *Proxy) stateContext(ex *exchange) (context.Context, context.CancelFunc) {
	ctx := context.WithoutCancel(ex.r.Context())
	if p.localState {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, p.cfg.StateTimeout)
}

// stateFailed counts a failed store call and logs it: a warning when the
// store starts failing, debug lines while it goes on failing.
func (p *Proxy) stateFailed(ex *exchange, op, conv string, err error) {
	reason := "error"
	if errors.Is(err, context.DeadlineExceeded) || isTimeout(err) {
		reason = "timeout"
	}
	p.m.stateErrors.WithLabelValues(op, reason).Inc()
	fields := []zap.Field{zap.String("op", op), zap.String("reason", reason), zap.String("conversation_id", conv),
		zap.Stringer("store", p.state), zap.Error(err)}
	if p.stateDown.CompareAndSwap(false, true) {
		ex.base.Warn("conversation state store failed: turns are full prefills until it answers again", fields...)
		return
	}
	ex.logAt(zapcore.DebugLevel, "conversation state store failed", fields...)
}

func (p *Proxy) stateOK() {
	if p.stateDown.Load() && p.stateDown.CompareAndSwap(true, false) {
		p.cfg.Logger.Info("conversation state store answers again", zap.Stringer("store", p.state))
	}
}

func isTimeout(err error) bool {
	var t interface{ Timeout() bool }
	return errors.As(err, &t) && t.Timeout()
}
