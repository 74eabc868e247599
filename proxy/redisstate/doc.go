// Package redisstate is the multi-turn proxy's conversation state in Redis or
// Valkey (proxy.StateStore), so that several gonixl-proxy replicas share it:
// a conversation's next turn finds the decode's params whichever replica it
// reaches, and a restarted replica forgets nothing.
//
// One hash per conversation, at <prefix><conversation_id>:
//
//	t  the conversation's newest turn number (decimal)
//	c  the conversation_id the params were stored for
//	p  the decode's kv_transfer_params (JSON), absent once taken
//
// Both operations are Lua scripts, so each is one atomic step on the server
// and one round trip (EVALSHA, EVAL when the server lost its script cache):
//
//   - take: the turn's number is max(server time in µs, t + 1); p and c are
//     read and deleted, t set, the key's TTL renewed. Two turns racing on
//     one conversation are ordered by the server: one gets p, the other
//     nothing, and the later one has the higher number.
//   - put: stores p, c and t unless t is already above the turn's number (a
//     later turn started), and sets the key's TTL.
//
// The server's clock makes the numbers grow across key expiry (a new key
// starts from the current time, far above any number handed out a TTL
// earlier); t + 1 keeps them growing if the clock steps back. The key's
// TTL is the decode's decoder_kv_blocks_ttl: Redis drops the entry when the
// decode drops the blocks (the prefill also checks the decode's expiry in
// the params).
//
// Every call is bounded by Options.Timeout (dial, pool wait, read, write and
// the caller's context), with no retries: a take that timed out may have run
// on the server, and running it again would only lose the params it took.
// go-redis closes a connection whose command timed out, so a late reply
// never reaches another command; take also checks that c is the requested
// conversation before returning p.
//
// Imports: proxy (the StateStore contract) and github.com/redis/go-redis/v9.
// Concurrency: a *Store is safe for concurrent use (go-redis's pool).
package redisstate
