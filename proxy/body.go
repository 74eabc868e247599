package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
)

// object is a JSON object whose values are kept as raw bytes, so that fields
// the proxy does not touch reach the upstream byte for byte (key order aside).
type object map[string]json.RawMessage

var errNotObject = errors.New("request body must be a JSON object")

// parseObject parses a JSON object. It accepts and rejects exactly what
// json.Unmarshal into an object does, with the same errors, but does not
// decode through reflection: validJSON checks the whole text, then one
// walk over the top level maps each key to its value's bytes. The values
// alias b, which must not change afterwards.
func parseObject(b []byte) (object, error) {
	if !validJSON(b) {
		return unmarshalObject(b) // its error
	}
	i := skipSpace(b, 0)
	if b[i] != '{' {
		// null is a nil object; any other value an error of json.Unmarshal's.
		return unmarshalObject(b)
	}
	o := make(object, 8)
	i = skipSpace(b, i+1)
	if b[i] == '}' {
		return o, nil
	}
	for {
		kEnd := skipString(b, i)
		key, ok := plainKey(b[i+1 : kEnd-1])
		if !ok {
			if err := json.Unmarshal(b[i:kEnd], &key); err != nil {
				return nil, err // cannot happen: the text is valid
			}
		}
		i = skipSpace(b, kEnd)
		i = skipSpace(b, i+1) // past ':'
		vEnd := skipValue(b, i)
		o[key] = json.RawMessage(b[i:vEnd:vEnd])
		i = skipSpace(b, vEnd)
		if b[i] == '}' {
			return o, nil
		}
		i = skipSpace(b, i+1) // past ','
	}
}

// unmarshalObject is parseObject through encoding/json (its error paths).
func unmarshalObject(b []byte) (object, error) {
	var o object
	if err := json.Unmarshal(b, &o); err != nil {
		return nil, err
	}
	if o == nil { // the literal null
		return nil, errNotObject
	}
	return o, nil
}

// The scanners below walk text that validJSON accepted.

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipString returns the index past the string that starts at b[i] ('"').
func skipString(b []byte, i int) int {
	for i++; ; i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
}

// skipValue returns the index past the value that starts at b[i].
func skipValue(b []byte, i int) int {
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for ; ; i++ {
			switch b[i] {
			case '"':
				i = skipString(b, i) - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return i + 1
				}
			}
		}
	default: // number, true, false, null
		for i < len(b) && b[i] != ',' && b[i] != '}' && b[i] != ']' &&
			b[i] != ' ' && b[i] != '\t' && b[i] != '\n' && b[i] != '\r' {
			i++
		}
		return i
	}
}

// plainKey returns a key's text when it needs no decoding (printable ASCII
// without escapes), as encoding/json would decode it.
func plainKey(b []byte) (string, bool) {
	for _, c := range b {
		if c == '\\' || c >= 0x80 {
			return "", false
		}
	}
	return string(b), true
}

func (o object) clone() object {
	c := make(object, len(o)+1)
	for k, v := range o {
		c[k] = v
	}
	return c
}

func (o object) has(key string) bool { _, ok := o[key]; return ok }

// setRaw stores v, which must be valid JSON.
func (o object) setRaw(key string, v []byte) { o[key] = json.RawMessage(v) }

var (
	jsonTrue  = []byte("true")
	jsonFalse = []byte("false")
	jsonOne   = []byte("1")
)

func (o object) setString(key, v string) {
	b, _ := json.Marshal(v) // a string always marshals
	o[key] = b
}

// marshal encodes the object with sorted keys. Values are written as they
// are: they were validated when parsed, or made by this package.
func (o object) marshal() ([]byte, error) {
	keys := make([]string, 0, len(o))
	n := 2
	for k, v := range o {
		keys = append(keys, k)
		n += len(k) + len(v) + 4
	}
	sort.Strings(keys)
	out := make([]byte, 0, n)
	out = append(out, '{')
	for i, k := range keys {
		if i > 0 {
			out = append(out, ',')
		}
		out = appendJSONString(out, k)
		out = append(out, ':')
		v := o[k]
		if len(v) == 0 {
			return nil, fmt.Errorf("field %q has no value", k)
		}
		out = append(out, v...)
	}
	return append(out, '}'), nil
}

// appendJSONString appends s as a JSON string; plain ASCII is copied, the
// rest goes through encoding/json.
func appendJSONString(dst []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			b, _ := json.Marshal(s) // a string always marshals
			return append(dst, b...)
		}
	}
	dst = append(dst, '"')
	dst = append(dst, s...)
	return append(dst, '"')
}

// isTrue reports whether key holds the JSON literal true.
func (o object) isTrue(key string) bool {
	return bytes.Equal(bytes.TrimSpace(o[key]), jsonTrue)
}

// emptyPrefillParams is what both reference proxies send a prefill instance
// when there is nothing to pull: prefill locally, keep the blocks for a remote
// decode.
const emptyPrefillParams = `{"do_remote_decode":true,"do_remote_prefill":false,` +
	`"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

// toyPrefillBody is toy_proxy_server.py's prefill rewrite.
func toyPrefillBody(req object) ([]byte, error) {
	p := req.clone()
	p.setRaw("kv_transfer_params", []byte(emptyPrefillParams))
	p.setRaw("stream", jsonFalse)
	p.setRaw("max_tokens", jsonOne)
	if p.has("max_completion_tokens") {
		p.setRaw("max_completion_tokens", jsonOne)
	}
	delete(p, "stream_options")
	delete(p, "min_tokens")
	delete(p, "min_completion_tokens")
	return p.marshal()
}

// multiturnPrefillBody is disagg_proxy_multiturn.py's prefill rewrite. params
// are the kv_transfer_params to send (cached decode params on a hit, the empty
// set on a miss).
func multiturnPrefillBody(req object, params []byte) ([]byte, error) {
	p := req.clone()
	p.setRaw("kv_transfer_params", params)
	p.setRaw("stream", jsonFalse)
	p.setRaw("max_tokens", jsonOne)
	delete(p, "max_completion_tokens")
	delete(p, "min_tokens")
	delete(p, "stream_options")
	return p.marshal()
}

// kvParams returns the kv_transfer_params of a response (or stream chunk) when
// they are a non-empty JSON object, as the reference's truthiness test does.
func kvParams(o object) (object, bool) {
	if !hasKVParams(o) {
		return nil, false
	}
	p, err := parseObject(o["kv_transfer_params"])
	if err != nil || len(p) == 0 {
		return nil, false
	}
	return p, true
}

// hasKVParams is kvParams's test without parsing the params: o's values are
// valid JSON (parseObject), so a non-empty object is '{' followed by
// something other than '}'.
func hasKVParams(o object) bool {
	raw := o["kv_transfer_params"]
	i := skipSpace(raw, 0)
	if i >= len(raw) || raw[i] != '{' {
		return false
	}
	i = skipSpace(raw, i+1)
	return i < len(raw) && raw[i] != '}'
}

// withRemoteHost returns params with remote_host set to host.
func withRemoteHost(params object, host string) ([]byte, error) {
	c := params.clone()
	c.setString("remote_host", host)
	return c.marshal()
}

// forPrefillPull marks cached decode params for the prefill instance: pull
// the decode's blocks (do_remote_prefill is false because the prefill does not
// wait for a remote prefill; do_remote_decode because a decode follows).
func forPrefillPull(cached []byte) ([]byte, error) {
	p, err := parseObject(cached)
	if err != nil {
		return nil, fmt.Errorf("cached kv_transfer_params: %w", err)
	}
	p.setRaw("do_remote_decode", jsonTrue)
	p.setRaw("do_remote_prefill", jsonFalse)
	return p.marshal()
}

// conversationID pops conversation_id from the body. A string is used as is,
// null as absent, any other JSON value by its text.
func conversationID(o object) string {
	raw, ok := o["conversation_id"]
	if !ok {
		return ""
	}
	delete(o, "conversation_id")
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s
	}
	t := string(bytes.TrimSpace(raw))
	if t == "null" {
		return ""
	}
	return t
}
