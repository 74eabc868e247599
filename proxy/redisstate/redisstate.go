package redisstate

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/gonixl/gonixl/proxy"
)

// DefaultPrefix starts every conversation key.
const DefaultPrefix = "gonixl:conv:"

// Options configures a Store.
type Options struct {
	// URL is the server: redis://[user:password@]host:port/db,
	// rediss://... (TLS) or unix:///path?db=N (go-redis's ParseURL).
	URL string
	// Prefix starts every key (default DefaultPrefix); proxies that share
	// conversations use the same prefix and database.
	Prefix string
	// TTL is how long a conversation's params are kept after their Put:
	// the decodes' decoder_kv_blocks_ttl (default proxy.DefaultCacheTTL).
	TTL time.Duration
	// Timeout bounds each connection set-up, pool wait, read and write
	// (default proxy.DefaultStateTimeout); the caller's context bounds the
	// whole call.
	Timeout time.Duration
}

// Store is a proxy.StateStore in Redis or Valkey.
type Store struct {
	rdb    *redis.Client
	prefix string
	ttlMS  string
	name   string
}

var _ proxy.StateStore = (*Store)(nil)

// ErrForeignEntry reports an entry stored for another conversation under
// the requested key; it is never returned as this conversation's params.
var ErrForeignEntry = errors.New("redisstate: the entry under this key belongs to another conversation")

// New returns a Store for o.URL; it does not connect (the first call does).
func New(o Options) (*Store, error) {
	opt, err := redis.ParseURL(o.URL)
	if err != nil {
		return nil, fmt.Errorf("state store %q: %w", redact(o.URL), err)
	}
	if o.Prefix == "" {
		o.Prefix = DefaultPrefix
	}
	if o.TTL <= 0 {
		o.TTL = proxy.DefaultCacheTTL
	}
	if o.Timeout <= 0 {
		o.Timeout = proxy.DefaultStateTimeout
	}
	opt.DialTimeout, opt.ReadTimeout, opt.WriteTimeout, opt.PoolTimeout = o.Timeout, o.Timeout, o.Timeout, o.Timeout
	opt.ContextTimeoutEnabled = true
	opt.MaxRetries = -1   // none: see the package comment
	opt.DialerRetries = 1 // one dial per call: a refused connection fails the call at once
	opt.Protocol = 2      // RESP2: no HELLO round trip, any Redis or Valkey
	opt.DisableIdentity = true
	opt.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	ms := o.TTL.Milliseconds()
	if ms < 1 {
		ms = 1
	}
	return &Store{rdb: redis.NewClient(opt), prefix: o.Prefix, ttlMS: strconv.FormatInt(ms, 10), name: redact(o.URL)}, nil
}

// take: KEYS[1] the conversation's key; ARGV[1] the TTL in ms. Returns
// {turn} or {turn, stored conversation_id, params}. Numbers are formatted
// with %.0f: Lua's tostring keeps only 14 significant digits.
var takeScript = redis.NewScript(`
local t = redis.call('TIME')
local turn = tonumber(t[1]) * 1000000 + tonumber(t[2])
local last = tonumber(redis.call('HGET', KEYS[1], 't') or '0')
if turn <= last then turn = last + 1 end
local vals = redis.call('HMGET', KEYS[1], 'c', 'p')
local sturn = string.format('%.0f', turn)
redis.call('HDEL', KEYS[1], 'c', 'p')
redis.call('HSET', KEYS[1], 't', sturn)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if vals[2] then return {sturn, vals[1] or '', vals[2]} end
return {sturn}
`)

// put: KEYS[1] the key; ARGV[1] the turn, ARGV[2] the conversation_id,
// ARGV[3] the params, ARGV[4] the TTL in ms. Returns 1 when stored, 0 when
// a later turn has started.
var putScript = redis.NewScript(`
local last = tonumber(redis.call('HGET', KEYS[1], 't') or '0')
if tonumber(ARGV[1]) < last then return 0 end
redis.call('HSET', KEYS[1], 't', ARGV[1], 'c', ARGV[2], 'p', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
`)

// TakeTurn implements proxy.StateStore.
func (s *Store) TakeTurn(ctx context.Context, id string) (proxy.Taken, error) {
	v, err := takeScript.Run(ctx, s.rdb, []string{s.prefix + id}, s.ttlMS).Slice()
	if err != nil {
		return proxy.Taken{}, err
	}
	if len(v) != 1 && len(v) != 3 {
		return proxy.Taken{}, fmt.Errorf("redisstate: take returned %d values", len(v))
	}
	ts, _ := v[0].(string)
	turn, err := strconv.ParseUint(ts, 10, 64)
	if err != nil || turn == 0 {
		return proxy.Taken{}, fmt.Errorf("redisstate: take returned turn %q", ts)
	}
	out := proxy.Taken{Turn: turn}
	if len(v) == 3 {
		conv, _ := v[1].(string)
		params, _ := v[2].(string)
		if conv != id {
			return out, ErrForeignEntry
		}
		out.Params, out.Result = []byte(params), proxy.Hit
	}
	return out, nil
}

// PutTurn implements proxy.StateStore.
func (s *Store) PutTurn(ctx context.Context, id string, turn uint64, params []byte) (bool, error) {
	n, err := putScript.Run(ctx, s.rdb, []string{s.prefix + id},
		strconv.FormatUint(turn, 10), id, params, s.ttlMS).Int()
	if err != nil {
		return false, err
	}
	return n == 1, nil
}

// SetLogger sends go-redis's own log lines (pool and connection events) to
// logf instead of the standard logger. It is process-wide (go-redis keeps
// one logger for all clients).
func SetLogger(logf func(format string, args ...any)) { redis.SetLogger(logger(logf)) }

type logger func(format string, args ...any)

func (l logger) Printf(_ context.Context, format string, args ...any) { l(format, args...) }

// Ping checks that the server answers (the proxy logs it at start-up).
func (s *Store) Ping(ctx context.Context) error { return s.rdb.Ping(ctx).Err() }

// Close implements proxy.StateStore.
func (s *Store) Close() error { return s.rdb.Close() }

// String implements proxy.StateStore: the URL without its password.
func (s *Store) String() string { return s.name }

func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "redis (unparsable URL)"
	}
	return u.Redacted()
}
