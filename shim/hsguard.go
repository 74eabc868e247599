package shim

import (
	"fmt"
	"time"
)

// Handshakes are started on behalf of kv_transfer_params, which come from
// clients (through a proxy, or straight to a decode's HTTP port). A flood of
// requests naming random engines or addresses must not exhaust the decode:
// new handshakes are capped in number and rate, and a failed one is
// remembered briefly so that requests naming the same engine at the same
// address fail at once instead of each starting another. A known engine at
// its known address needs no handshake and is never affected.
const (
	maxPendingHandshakes = 64              // handshakes in flight at once
	handshakeBurst       = 64              // token bucket: burst of new handshakes
	handshakeRate        = 32.0            // and its refill, per second
	handshakeFailTTL     = 2 * time.Second // how long a failure is remembered
	maxRememberedFails   = 4096
)

type hsFailure struct {
	err   error
	until time.Time
}

// handshakeGuard holds the caps' state; the worker's mutex guards it.
type handshakeGuard struct {
	tokens   float64
	last     time.Time
	fails    map[string]hsFailure
	refused  int64 // handshakes refused by a cap or the failure cache
	now      func() time.Time
	initDone bool
}

func (g *handshakeGuard) init() {
	if g.initDone {
		return
	}
	g.initDone = true
	if g.now == nil {
		g.now = time.Now
	}
	g.tokens, g.last = handshakeBurst, g.now()
	g.fails = map[string]hsFailure{}
}

// admitHandshakeLocked decides whether a new handshake to key may start.
func (w *Worker) admitHandshakeLocked(key string) error {
	g := &w.hsGuard
	g.init()
	now := g.now()
	if f, ok := g.fails[key]; ok {
		if now.Before(f.until) {
			g.refused++
			return fmt.Errorf("a handshake with it failed %.1fs ago (remembered for %v): %w",
				handshakeFailTTL.Seconds()-f.until.Sub(now).Seconds(), handshakeFailTTL, f.err)
		}
		delete(g.fails, key)
	}
	if len(w.handshakes) >= maxPendingHandshakes {
		g.refused++
		return fmt.Errorf("%d handshakes are already in progress (the limit): refusing another (a flood of requests naming unknown engines?)", len(w.handshakes))
	}
	g.tokens += now.Sub(g.last).Seconds() * handshakeRate
	if g.tokens > handshakeBurst {
		g.tokens = handshakeBurst
	}
	g.last = now
	if g.tokens < 1 {
		g.refused++
		return fmt.Errorf("new handshakes are limited to %g per second (burst %d): refusing this one (a flood of requests naming unknown engines?)", handshakeRate, handshakeBurst)
	}
	g.tokens--
	return nil
}

func (g *handshakeGuard) failed(key string, err error) {
	g.init()
	now := g.now()
	if len(g.fails) >= maxRememberedFails {
		for k, f := range g.fails {
			if !now.Before(f.until) {
				delete(g.fails, k)
			}
		}
		if len(g.fails) >= maxRememberedFails {
			return // full of fresh failures: the rate cap still holds
		}
	}
	g.fails[key] = hsFailure{err: err, until: now.Add(handshakeFailTTL)}
}

func (g *handshakeGuard) succeeded(key string) {
	g.init()
	delete(g.fails, key)
}
