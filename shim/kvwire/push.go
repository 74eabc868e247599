// Push mode (vLLM's NixlPushConnector): the decode allocates its blocks
// first and registers them with the prefill; the prefill WRITEs its KV into
// them and the WRITE's notification tells the decode the KV has landed.
// This file is push mode's wire format; shim/push_send.go is the
// prefill's side, shim/push_recv.go the decode's, shim/push_sched.go the
// scheduler's, and docs/ARCHITECTURE.md ("Block ownership") says who owns a
// block when.
//
// As vLLM 0.32 speaks it (read from its push_scheduler.py and
// push_worker.py):
//   - registration, decode -> every prefill rank it handshook with, a NIXL
//     notification: "PUSH_REG:" + msgpack map of request_id (the decode's
//     request id), decode_engine_id, decode_host, decode_port,
//     decode_tp_size, local_block_ids (per KV-cache group), remote_engine_id,
//     remote_host, remote_port, remote_tp_size, remote_pp_size;
//   - completion, the WRITE's notification: "<decode request id>:<prefill
//     tp_size>"; the decode waits for pp_size * max(1, P tp / D tp) of them;
//   - a prefill request and a registration belong together when their
//     request ids are equal, or equal once vLLM's "-<8 hex>" suffix is cut
//     from both (the proxy sends one X-Request-Id to both).
//
// gonixl adds, between gonixl engines only (a stock engine would read any
// other notification as "<id>:<n>"), three words, each a prefill rank's
// last word on a decode request (after it, that rank never writes into the
// request's blocks):
//   - "GONIXL_PUSH_FAILED:<decode request id>": its WRITE failed, and every
//     handle of it is released (or it was never posted), so the decode
//     fails the request at once instead of waiting for
//     push_registration_timeout;
//   - "GONIXL_PUSH_CANCELLED:<id>", the answer to "GONIXL_PUSH_CANCEL:" +
//     the registration, which a decode that gave up waiting sends (again
//     every few seconds until answered): sent once no WRITE into those
//     blocks is in flight, and no later one will be posted.
// A registration's copies (every decode rank of a larger tp_size sends one
// to the same prefill rank) and a registration answered or written once
// are consumed: a later copy is dropped, never matched to another request.
// Where vLLM's decode only logs a timed-out registration and waits for
// ever, gonixl's fails the request (kv_load_failure_policy) within
// push_registration_timeout and keeps its blocks until no WRITE can land.
//
// Push pairs engines of equal block size, and of equal or different
// tp_size where every rank holds distinct KV heads (push_send.go
// pushPairingError); other pairings are refused with a clear error on both
// sides.

package kvwire

import (
	"bytes"
	"fmt"
	"math"
	"regexp"
	"strconv"
	"strings"

	"github.com/vmihailenco/msgpack/v5"
)

// The notification prefixes of push mode.
const (
	PushRegPrefix       = "PUSH_REG:"              // vLLM's registration
	PushFailedPrefix    = "GONIXL_PUSH_FAILED:"    // gonixl: a prefill rank's WRITE failed and is released
	PushCancelPrefix    = "GONIXL_PUSH_CANCEL:"    // gonixl: a decode gave up; the registration follows
	PushCancelledPrefix = "GONIXL_PUSH_CANCELLED:" // gonixl: the prefill rank will not write
	// PushDigestPrefix: gonixl, a prefill rank's digests of the KV its
	// WRITE carries, after a NUL at the end of the WRITE's completion
	// notification to a decode that asked for them (KeyWantsKVDigest in its
	// registration); a PushDigest follows (WithPushDigest).
	PushDigestPrefix = "GONIXL_PUSH_DIGEST:"
)

// KeyWantsKVDigest: a gonixl decode's registration key (msgpack true) asking
// the prefill for a PushDigest before its WRITE. Only such a decode gets
// one: an older decode would read the message as a completion.
const KeyWantsKVDigest = "gonixl_wants_kv_digest"

// MaxPushRegBytes bounds one registration notification.
const MaxPushRegBytes = 8 << 20

// PushReg is a decode's registration of its blocks for one request.
type PushReg struct {
	RequestID      string
	DecodeEngineID string
	DecodeHost     string
	DecodePort     int
	DecodeTPSize   int
	LocalBlockIDs  BlockIDs
	RemoteEngineID string
	RemoteHost     string
	RemotePort     int
	RemoteTPSize   int
	RemotePPSize   int
	// PromptDigest (gonixl's key gonixl_prompt_digest, "" from a stock
	// decode): the digest of the decode's prompt.
	PromptDigest string
	// WantsKVDigest (KeyWantsKVDigest): the decode checks the WRITE against
	// a PushDigest sent before it.
	WantsKVDigest bool
}

// EncodePushReg writes the registration notification with vLLM's keys, in
// its order, integers in their smallest msgpack form (msgspec's encoding).
func EncodePushReg(r *PushReg) ([]byte, error) {
	var buf bytes.Buffer
	buf.WriteString(PushRegPrefix)
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	str := func(k, v string) error {
		if err := enc.EncodeString(k); err != nil {
			return err
		}
		return enc.EncodeString(v)
	}
	num := func(k string, v int) error {
		if err := enc.EncodeString(k); err != nil {
			return err
		}
		return enc.EncodeInt(int64(v))
	}
	n := 11
	if r.PromptDigest != "" {
		n++
	}
	if r.WantsKVDigest {
		n++
	}
	steps := []func() error{
		func() error { return enc.EncodeMapLen(n) },
		func() error { return str("request_id", r.RequestID) },
		func() error { return str("decode_engine_id", r.DecodeEngineID) },
		func() error { return str("decode_host", r.DecodeHost) },
		func() error { return num("decode_port", r.DecodePort) },
		func() error { return num("decode_tp_size", r.DecodeTPSize) },
		func() error {
			if err := enc.EncodeString("local_block_ids"); err != nil {
				return err
			}
			if err := enc.EncodeArrayLen(len(r.LocalBlockIDs)); err != nil {
				return err
			}
			for _, g := range r.LocalBlockIDs {
				if err := enc.EncodeArrayLen(len(g)); err != nil {
					return err
				}
				for _, b := range g {
					if err := enc.EncodeInt(b); err != nil {
						return err
					}
				}
			}
			return nil
		},
		func() error { return str("remote_engine_id", r.RemoteEngineID) },
		func() error { return str("remote_host", r.RemoteHost) },
		func() error { return num("remote_port", r.RemotePort) },
		func() error { return num("remote_tp_size", r.RemoteTPSize) },
		func() error { return num("remote_pp_size", r.RemotePPSize) },
		func() error {
			if r.PromptDigest == "" {
				return nil
			}
			return str(KeyPromptDigest, r.PromptDigest)
		},
		func() error {
			if !r.WantsKVDigest {
				return nil
			}
			if err := enc.EncodeString(KeyWantsKVDigest); err != nil {
				return err
			}
			return enc.EncodeBool(true)
		},
	}
	for _, f := range steps {
		if err := f(); err != nil {
			return nil, err
		}
	}
	return buf.Bytes(), nil
}

// DecodePushReg parses a registration (without its prefix). It reads the
// keys vLLM's prefill reads; anything malformed is an error naming the key.
// local_block_ids may also be one flat list (a single group), as vLLM
// accepts.
func DecodePushReg(b []byte) (*PushReg, error) {
	if len(b) > MaxPushRegBytes {
		return nil, fmt.Errorf("registration of %d bytes (limit %d)", len(b), MaxPushRegBytes)
	}
	if err := CheckMsgpack(b, 8); err != nil {
		return nil, err
	}
	var m map[string]any
	dec := msgpack.NewDecoder(bytes.NewReader(b))
	dec.UseLooseInterfaceDecoding(true)
	if err := dec.Decode(&m); err != nil {
		return nil, fmt.Errorf("not a msgpack map: %w", err)
	}
	r := &PushReg{}
	var err error
	str := func(k string) string {
		if err != nil {
			return ""
		}
		v, ok := m[k].(string)
		if !ok || v == "" {
			err = fmt.Errorf("%s: want a non-empty string, got %T", k, m[k])
		}
		return v
	}
	num := func(k string, lo, hi int64) int {
		if err != nil {
			return 0
		}
		v, ok := asInt64(m[k])
		if !ok || v < lo || v > hi {
			err = fmt.Errorf("%s: want an integer in [%d, %d], got %v", k, lo, hi, m[k])
		}
		return int(v)
	}
	r.RequestID = str("request_id")
	r.DecodeEngineID = str("decode_engine_id")
	r.DecodeHost = str("decode_host")
	r.DecodePort = num("decode_port", 1, 65535)
	r.DecodeTPSize = num("decode_tp_size", 1, 1<<16)
	if err != nil {
		return nil, err
	}
	if d, ok := m[KeyPromptDigest]; ok {
		if r.PromptDigest, ok = d.(string); !ok || len(r.PromptDigest) > 256 {
			return nil, fmt.Errorf("gonixl_prompt_digest: want a short string, got %T", d)
		}
	}
	r.WantsKVDigest, _ = m[KeyWantsKVDigest].(bool)
	groups, ok := m["local_block_ids"].([]any)
	if !ok {
		return nil, fmt.Errorf("local_block_ids: want a list, got %T", m["local_block_ids"])
	}
	if len(groups) > 0 {
		if _, flat := asInt64(groups[0]); flat {
			groups = []any{groups}
		}
	}
	for gi, g := range groups {
		ids, ok := g.([]any)
		if !ok {
			return nil, fmt.Errorf("local_block_ids[%d]: want a list, got %T", gi, g)
		}
		out := make([]int64, len(ids))
		for i, v := range ids {
			n, ok := asInt64(v)
			if !ok || n < 0 || n > math.MaxInt32 {
				return nil, fmt.Errorf("local_block_ids[%d][%d]: want a block id, got %v", gi, i, v)
			}
			out[i] = n
		}
		r.LocalBlockIDs = append(r.LocalBlockIDs, out)
	}
	return r, nil
}

// asInt64 reads an integer of a loosely decoded msgpack value (int64 or
// uint64: DecodePushReg's decoder gives no other integer types).
func asInt64(v any) (int64, bool) {
	switch t := v.(type) {
	case int64:
		return t, true
	case uint64:
		if t > math.MaxInt64 {
			return 0, false
		}
		return int64(t), true
	}
	return 0, false
}

// vllmSuffix is the "-<8 hex>" vLLM appends to a client's request id.
var vllmSuffix = regexp.MustCompile(`(?i)-[0-9a-f]{8}$`)

// BaseRequestID is vLLM's get_base_request_id: the id without that suffix.
func BaseRequestID(id string) string { return vllmSuffix.ReplaceAllString(id, "") }

// PushWord is a gonixl prefill rank's last word on a decode request.
type PushWord int

// The words, and the completion notification of a WRITE.
const (
	PushNotAWord  PushWord = iota // not a push notification
	PushCompleted                 // "<decode request id>:<prefill tp_size>": a WRITE landed
	PushFailed                    // PushFailedPrefix
	PushCancelled                 // PushCancelledPrefix
)

// WithPushDigest appends an encoded PushDigest (EncodePushDigest's, prefix
// included) to a WRITE's completion notification, after a NUL.
func WithPushDigest(notif, digest []byte) []byte {
	out := make([]byte, 0, len(notif)+1+len(digest))
	out = append(append(append(out, notif...), 0), digest...)
	return out
}

// SplitPushDigest separates a completion notification from the PushDigest
// payload WithPushDigest appended (nil when there is none).
func SplitPushDigest(msg string) (string, []byte) {
	if i := strings.Index(msg, "\x00"+PushDigestPrefix); i >= 0 {
		return msg[:i], []byte(msg[i+1+len(PushDigestPrefix):])
	}
	return msg, nil
}

// ParsePushWord reads a notification a decode gets in push mode: the
// request id and which word it is.
func ParsePushWord(msg string) (id string, w PushWord) {
	switch {
	case strings.HasPrefix(msg, PushFailedPrefix):
		return msg[len(PushFailedPrefix):], PushFailed
	case strings.HasPrefix(msg, PushCancelledPrefix):
		return msg[len(PushCancelledPrefix):], PushCancelled
	}
	i := strings.LastIndexByte(msg, ':')
	if i <= 0 {
		return "", PushNotAWord
	}
	if _, err := strconv.Atoi(msg[i+1:]); err != nil {
		return "", PushNotAWord
	}
	return msg[:i], PushCompleted
}
