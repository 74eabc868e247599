package proxy

import (
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

// ConversationCache holds, per conversation_id, the kv_transfer_params that a
// decode instance returned at the end of the conversation's last turn. Entries
// are single use: Take removes the entry it returns. It is safe for concurrent
// use.
type ConversationCache struct {
	ttl   time.Duration
	max   int
	clock func() time.Time

	mu sync.Mutex
	m  map[string]cacheEntry
}

type cacheEntry struct {
	params []byte // a JSON object, owned by the cache
	stored time.Time
}

// NewConversationCache returns an empty cache whose entries live for ttl, as
// read from clock, holding at most max conversations.
func NewConversationCache(ttl time.Duration, max int, clock func() time.Time) *ConversationCache {
	return &ConversationCache{ttl: ttl, max: max, clock: clock, m: make(map[string]cacheEntry)}
}

// Take removes and returns the entry for id. An entry older than the TTL is
// discarded and reported as Stale.
func (c *ConversationCache) Take(id string) ([]byte, LookupResult) {
	now := c.clock()
	c.mu.Lock()
	e, ok := c.m[id]
	if ok {
		delete(c.m, id)
	}
	c.mu.Unlock()
	if !ok {
		return nil, Miss
	}
	if now.Sub(e.stored) > c.ttl {
		return nil, Stale
	}
	return e.params, Hit
}

// Put stores a copy of params (a JSON object) for id, replacing any earlier
// entry. When the cache is full, stale entries are evicted first, then the
// oldest.
func (c *ConversationCache) Put(id string, params []byte) {
	cp := append([]byte(nil), params...)
	now := c.clock()
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, exists := c.m[id]; !exists && len(c.m) >= c.max {
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
			delete(c.m, oldestID)
		}
	}
	c.m[id] = cacheEntry{params: cp, stored: now}
}

// EvictStale removes the entries older than the TTL and returns how many it
// removed.
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
			delete(c.m, k)
			n++
		}
	}
	return n
}

// Len is the number of cached conversations, stale ones included.
func (c *ConversationCache) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.m)
}
