package proxy

import (
	"context"
	"sync"
	"time"
)

// LookupResult says what a conversation cache lookup found.
type LookupResult int

const (
	// Miss: nothing cached for the conversation.
	Miss LookupResult = iota
	// Hit: a fresh entry, now consumed.
	Hit
	// Stale: an entry older than the TTL, now discarded.
	Stale
)

func (r LookupResult) String() string {
	switch r {
	case Hit:
		return "hit"
	case Stale:
		return "stale"
	}
	return "miss"
}

// ConversationCache is the in-process StateStore (the default): per
// conversation_id, the kv_transfer_params that a decode instance returned at
// the end of the conversation's last turn. Entries are single use: a Take
// removes the params it returns. It is safe for concurrent use.
//
// Turn numbers come from one counter for the whole cache, so they grow per
// conversation too. A conversation whose params were taken keeps its last
// turn number (without params) until the TTL passes, so that a Put of an
// earlier turn that arrives late is refused.
type ConversationCache struct {
	ttl   time.Duration
	max   int
	clock func() time.Time

	mu     sync.Mutex
	m      map[string]cacheEntry
	turn   uint64 // the last turn number handed out
	params int    // entries holding params
}

type cacheEntry struct {
	params []byte // a JSON object, owned by the cache; nil once taken
	stored time.Time
	turn   uint64 // the newest turn of the conversation seen (a Take or a Put)
}

var _ StateStore = (*ConversationCache)(nil)

// NewConversationCache returns an empty cache whose entries live for ttl, as
// read from clock, holding at most max conversations.
func NewConversationCache(ttl time.Duration, max int, clock func() time.Time) *ConversationCache {
	return &ConversationCache{ttl: ttl, max: max, clock: clock, m: make(map[string]cacheEntry)}
}

// Take removes and returns the params stored for id, without starting a
// numbered turn. Params older than the TTL are discarded and reported as
// Stale.
func (c *ConversationCache) Take(id string) ([]byte, LookupResult) {
	t := c.take(id, false)
	return t.Params, t.Result
}

// TakeTurn implements StateStore; it never fails.
func (c *ConversationCache) TakeTurn(_ context.Context, id string) (Taken, error) {
	return c.take(id, true), nil
}

func (c *ConversationCache) take(id string, numbered bool) Taken {
	now := c.clock()
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[id]
	var out Taken
	if ok && e.params != nil {
		c.params--
		if now.Sub(e.stored) > c.ttl {
			out.Result = Stale
		} else {
			out.Params, out.Result = e.params, Hit
		}
	}
	if !numbered {
		if ok {
			e.params = nil
			c.m[id] = e
		}
		return out
	}
	c.turn++
	out.Turn = c.turn
	c.insertLocked(id, cacheEntry{stored: now, turn: c.turn}, now, ok)
	return out
}

// Put stores a copy of params (a JSON object) for id as the newest turn of
// the conversation, replacing any earlier entry.
func (c *ConversationCache) Put(id string, params []byte) {
	c.mu.Lock()
	c.turn++
	turn := c.turn
	c.mu.Unlock()
	_, _ = c.PutTurn(context.Background(), id, turn, params)
}

// PutTurn implements StateStore: it stores a copy of params unless a later
// turn of the conversation has started. When the cache is full, stale
// entries are evicted first, then the oldest.
func (c *ConversationCache) PutTurn(_ context.Context, id string, turn uint64, params []byte) (bool, error) {
	cp := append([]byte(nil), params...)
	now := c.clock()
	c.mu.Lock()
	defer c.mu.Unlock()
	e, exists := c.m[id]
	if exists && e.turn > turn {
		return false, nil
	}
	if exists && e.params != nil {
		c.params--
	}
	c.insertLocked(id, cacheEntry{params: cp, stored: now, turn: turn}, now, exists)
	c.params++
	return true, nil
}

// insertLocked sets m[id], making room first when id is new and the cache
// is full.
func (c *ConversationCache) insertLocked(id string, e cacheEntry, now time.Time, exists bool) {
	if !exists && len(c.m) >= c.max {
		c.evictLocked(now)
		if len(c.m) >= c.max {
			var oldestID string
			var oldest time.Time
			first := true
			for k, e := range c.m {
				if first || e.stored.Before(oldest) {
					oldestID, oldest, first = k, e.stored, false
				}
			}
			c.deleteLocked(oldestID)
		}
	}
	c.m[id] = e
}

func (c *ConversationCache) deleteLocked(id string) {
	if e, ok := c.m[id]; ok {
		if e.params != nil {
			c.params--
		}
		delete(c.m, id)
	}
}

// EvictStale removes the entries older than the TTL and returns how many of
// them held params.
func (c *ConversationCache) EvictStale() int {
	now := c.clock()
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.evictLocked(now)
}

func (c *ConversationCache) evictLocked(now time.Time) int {
	n := 0
	for k, e := range c.m {
		if now.Sub(e.stored) > c.ttl {
			if e.params != nil {
				n++
			}
			c.deleteLocked(k)
		}
	}
	return n
}

// Len is the number of conversations with params, stale ones included.
func (c *ConversationCache) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.params
}

// Close implements StateStore; it does nothing.
func (c *ConversationCache) Close() error { return nil }

// String implements StateStore.
func (c *ConversationCache) String() string { return "memory" }
