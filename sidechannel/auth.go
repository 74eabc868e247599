package sidechannel

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"strings"
)

// Optional shared-secret authentication. With no secret configured nothing
// here is used and the wire bytes are vLLM's. With a secret:
//
//   - the request's first tuple element is b"get_meta_msg" + authMarker +
//     nonce (16 bytes) + HMAC-SHA256(secret, "gonixl-side-channel request v1\x00"
//     || nonce || be64(pp) || be64(tp)). A stock vLLM listener only logs a
//     warning for the unexpected tag and answers unauthenticated, which the
//     client then refuses;
//   - the reply gets a third frame, HMAC-SHA256(secret,
//     "gonixl-side-channel reply v1\x00" || request MAC || be64(len(payload))
//     || payload || clock frame), binding it to this request.
//
// The MAC authenticates; it does not encrypt (the metadata is not secret,
// but a forged one would point transfers at the wrong memory).

const (
	authMarker = "+gonixl-hmac-sha256-v1:"
	nonceLen   = 16
	macLen     = sha256.Size
)

// Listener error replies travel as a NixlHandshakePayload whose
// compatibility_hash starts with errorPrefix and whose agent metadata is
// empty: a gonixl client reports the message, and a stock vLLM client fails
// its hash check with the message in its "Remote: ..." text.
const errorPrefix = "gonixl-side-channel-error: "

// Error reply codes.
const (
	codeNotReady        = "not-ready"
	codeBadRequest      = "bad-request"
	codeAuthRequired    = "auth-required"
	codeAuthUnsupported = "auth-unsupported"
	codeAuthFailed      = "auth-failed"
)

const secretHint = "set kv_connector_extra_config.side_channel_secret or GONIXL_SIDE_CHANNEL_SECRET to the same value on both sides"

func requestMAC(secret, nonce []byte, rank Rank) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("gonixl-side-channel request v1\x00"))
	m.Write(nonce)
	var b [16]byte
	binary.BigEndian.PutUint64(b[:8], uint64(int64(rank.PP)))
	binary.BigEndian.PutUint64(b[8:], uint64(int64(rank.TP)))
	m.Write(b[:])
	return m.Sum(nil)
}

func replyMAC(secret, reqMAC, payload, clock []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("gonixl-side-channel reply v1\x00"))
	m.Write(reqMAC)
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(len(payload)))
	m.Write(b[:])
	m.Write(payload)
	m.Write(clock)
	return m.Sum(nil)
}

// authTag builds the authenticated request tag; it returns the tag and the
// request MAC the reply must be bound to.
func authTag(secret []byte, rank Rank) (tag, mac []byte, err error) {
	return sealTag(GetMetaMsg, func(nonce []byte) []byte { return requestMAC(secret, nonce, rank) })
}

// splitAuthTag returns nonce and MAC when tag is an authenticated tag.
func splitAuthTag(tag []byte) (nonce, mac []byte, ok bool) { return openTag(GetMetaMsg, tag) }

// sealTag is msg + authMarker + a fresh nonce + mac(nonce), and the MAC.
func sealTag(msg string, mac func(nonce []byte) []byte) (tag, m []byte, err error) {
	nonce := make([]byte, nonceLen)
	if _, err := rand.Read(nonce); err != nil {
		return nil, nil, err
	}
	m = mac(nonce)
	tag = make([]byte, 0, len(msg)+len(authMarker)+nonceLen+macLen)
	tag = append(tag, msg...)
	tag = append(tag, authMarker...)
	tag = append(tag, nonce...)
	tag = append(tag, m...)
	return tag, m, nil
}

// openTag returns nonce and MAC when tag is msg's authenticated form.
func openTag(msg string, tag []byte) (nonce, mac []byte, ok bool) {
	prefix := msg + authMarker
	if len(tag) != len(prefix)+nonceLen+macLen || !bytes.HasPrefix(tag, []byte(prefix)) {
		return nil, nil, false
	}
	rest := tag[len(prefix):]
	return rest[:nonceLen], rest[nonceLen:], true
}

func errorPayload(code, msg string) []byte {
	p := HandshakePayload{CompatibilityHash: errorPrefix + code + ": " + msg, AgentMetadataBytes: []byte{}}
	return p.Encode()
}

// RemoteError is an error reply from a gonixl listener.
type RemoteError struct {
	Code    string // "not-ready", "bad-request", "auth-required", ...
	Message string
}

func (e *RemoteError) Error() string {
	return "sidechannel: listener replied " + e.Code + ": " + e.Message
}

// Is lets errors.Is(err, ErrAuth) match the authentication codes.
func (e *RemoteError) Is(target error) bool {
	return target == ErrAuth && strings.HasPrefix(e.Code, "auth-")
}

// ErrAuth matches every side-channel authentication failure.
var ErrAuth = errors.New("sidechannel: side-channel authentication failed")

func parseErrorPayload(p *HandshakePayload) *RemoteError {
	if !strings.HasPrefix(p.CompatibilityHash, errorPrefix) {
		return nil
	}
	rest := strings.TrimPrefix(p.CompatibilityHash, errorPrefix)
	code, msg, _ := strings.Cut(rest, ": ")
	return &RemoteError{Code: code, Message: msg}
}

// KV digest query authentication (same marker and nonce as the handshake,
// separate MAC domains so neither message can stand in for the other):
//
//   - tag = b"gonixl_kv_digest" + authMarker + nonce (16 bytes) +
//     HMAC-SHA256(secret, "gonixl-side-channel kv digest v1\x00" || nonce ||
//     be64(len(request_id)) || request_id);
//   - reply frames [body, mac], mac = HMAC-SHA256(secret,
//     "gonixl-side-channel kv digest reply v1\x00" || request MAC ||
//     be64(len(body)) || body).

// Listener-side code for a failing KV digest provider.
const codeProviderFailed = "provider-failed"

func kvDigestRequestMAC(secret, nonce []byte, requestID string) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("gonixl-side-channel kv digest v1\x00"))
	m.Write(nonce)
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(len(requestID)))
	m.Write(b[:])
	m.Write([]byte(requestID))
	return m.Sum(nil)
}

func kvDigestReplyMAC(secret, reqMAC, body []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("gonixl-side-channel kv digest reply v1\x00"))
	m.Write(reqMAC)
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(len(body)))
	m.Write(b[:])
	m.Write(body)
	return m.Sum(nil)
}

// kvDigestAuthTag builds the authenticated KV digest tag and returns it with
// the request MAC the reply must be bound to.
func kvDigestAuthTag(secret []byte, requestID string) (tag, mac []byte, err error) {
	return sealTag(KVDigestMsg, func(nonce []byte) []byte { return kvDigestRequestMAC(secret, nonce, requestID) })
}

// splitKVDigestAuthTag returns nonce and MAC when tag is an authenticated KV
// digest tag.
func splitKVDigestAuthTag(tag []byte) (nonce, mac []byte, ok bool) { return openTag(KVDigestMsg, tag) }

// kvDigestErrorReply is an error reply body; Message is "<code>: <text>" so
// a client can tell authentication failures (RemoteError codes) apart.
func kvDigestErrorReply(code, msg string) []byte {
	return (&KVDigestReply{Status: KVDigestError, Message: code + ": " + msg}).Encode()
}

func parseKVDigestError(msg string) *RemoteError {
	code, text, ok := strings.Cut(msg, ": ")
	if !ok || code == "" || strings.ContainsAny(code, " \t\n") {
		return &RemoteError{Code: "error", Message: msg}
	}
	return &RemoteError{Code: code, Message: text}
}
