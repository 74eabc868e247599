package kvwire

import (
	"strconv"
	"unicode/utf8"
)

// A scanner for the plain form of kv_transfer_params: the JSON the Python
// connector encodes (msgspec) and the proxies send. Decoding through
// encoding/json (a map of raw values, each value decoded again by
// reflection) cost 17 us warm and 36-94 us cold for a 32-block pull's
// params with KV digests, paid by the first scheduler call that parses a
// request's params, inside vLLM's scheduling step.
//
// The scanner decides only what it can decide exactly: anything outside
// the plain form (an escaped key, a key given twice, nesting past
// maxScanDepth, a number or string it does not read itself) is left to
// encoding/json, which then decodes that input or value as before. So the
// result of every input is encoding/json's; FuzzParseTransferParamsScan
// holds the two paths to that.

// maxScanDepth bounds the nesting the scanner validates itself; deeper
// input goes to encoding/json (whose limit is 10,000).
const maxScanDepth = 64

// maxScanKeys bounds the keys the scanner keeps; params with more go to
// encoding/json (vLLM's have about 15).
const maxScanKeys = 64

// rawField is one key of a scanned object and its value's bytes, as
// encoding/json's RawMessage would hold them (no surrounding space).
type rawField struct {
	key, val []byte
}

// scanner reads JSON from b at i. Its methods return false for input it
// leaves to encoding/json: invalid JSON, and valid JSON outside what it
// reads itself.
type scanner struct {
	b []byte
	i int
}

func (s *scanner) space() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

func (s *scanner) next(c byte) bool {
	s.space()
	if s.i < len(s.b) && s.b[s.i] == c {
		s.i++
		return true
	}
	return false
}

// scanObject splits a JSON object into its fields. It fails (false) for
// anything but one object followed by space, for a key that is escaped,
// not ASCII or given twice, and for a value that value() does not accept.
func scanObject(b []byte) ([]rawField, bool) {
	s := scanner{b: b}
	s.space()
	fields, ok := s.object(1)
	s.space()
	return fields, ok && s.i == len(b)
}

// object reads an object at i (scanObject's rules) at nesting depth.
func (s *scanner) object(depth int) ([]rawField, bool) {
	if s.i >= len(s.b) || s.b[s.i] != '{' {
		return nil, false
	}
	s.i++
	var fields []rawField
	if s.next('}') {
		return fields, true
	}
	for {
		s.space()
		key, ok := s.plainString(true)
		if !ok || !s.next(':') {
			return nil, false
		}
		s.space()
		start := s.i
		if !s.value(depth + 1) {
			return nil, false
		}
		for _, f := range fields {
			if string(f.key) == string(key) {
				return nil, false // encoding/json keeps the last; left to it
			}
		}
		if len(fields) == maxScanKeys {
			return nil, false
		}
		fields = append(fields, rawField{key: key, val: s.b[start:s.i]})
		if s.next(',') {
			continue
		}
		if s.next('}') {
			return fields, true
		}
		return nil, false
	}
}

// value steps over one JSON value, checking its grammar.
func (s *scanner) value(depth int) bool {
	if depth > maxScanDepth || s.i >= len(s.b) {
		return false
	}
	switch c := s.b[s.i]; {
	case c == '"':
		return s.anyString()
	case c == '{':
		s.i++
		if s.next('}') {
			return true
		}
		for {
			s.space()
			if s.i >= len(s.b) || s.b[s.i] != '"' || !s.anyString() || !s.next(':') {
				return false
			}
			s.space()
			if !s.value(depth + 1) {
				return false
			}
			if s.next(',') {
				continue
			}
			return s.next('}')
		}
	case c == '[':
		s.i++
		if s.next(']') {
			return true
		}
		for {
			s.space()
			if !s.value(depth + 1) {
				return false
			}
			if s.next(',') {
				continue
			}
			return s.next(']')
		}
	case c == '-' || (c >= '0' && c <= '9'):
		_, ok := s.number()
		return ok
	default:
		for _, lit := range [...]string{"true", "false", "null"} {
			if len(s.b)-s.i >= len(lit) && string(s.b[s.i:s.i+len(lit)]) == lit {
				s.i += len(lit)
				return true
			}
		}
		return false
	}
}

// anyString steps over a string, escapes included; invalid UTF-8 is
// valid JSON to encoding/json (it reads it as U+FFFD).
func (s *scanner) anyString() bool {
	j := s.i + 1 // past the opening quote
	for j < len(s.b) {
		c := s.b[j]
		switch {
		case c == '"':
			s.i = j + 1
			return true
		case c < 0x20:
			return false
		case c == '\\':
			if j+1 >= len(s.b) {
				return false
			}
			switch s.b[j+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				j += 2
			case 'u':
				if j+6 > len(s.b) {
					return false
				}
				for _, h := range s.b[j+2 : j+6] {
					if !isHex(h) {
						return false
					}
				}
				j += 6
			default:
				return false
			}
		default:
			j++
		}
	}
	return false
}

func isHex(c byte) bool {
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

// plainString reads a string without escapes or control characters, in
// valid UTF-8 (ASCII only when ascii is set), and returns its bytes
// without the quotes: what encoding/json would decode it to.
func (s *scanner) plainString(ascii bool) ([]byte, bool) {
	if s.i >= len(s.b) || s.b[s.i] != '"' {
		return nil, false
	}
	start := s.i + 1
	high := false
	for j := start; j < len(s.b); j++ {
		switch c := s.b[j]; {
		case c == '"':
			str := s.b[start:j]
			if high && (ascii || !utf8.Valid(str)) {
				return nil, false
			}
			s.i = j + 1
			return str, true
		case c == '\\' || c < 0x20:
			return nil, false
		case c >= 0x80:
			high = true
		}
	}
	return nil, false
}

// number steps over a JSON number and reports whether it is an integer
// (no fraction, no exponent).
func (s *scanner) number() (integer, ok bool) {
	j := s.i
	if j < len(s.b) && s.b[j] == '-' {
		j++
	}
	switch {
	case j < len(s.b) && s.b[j] == '0':
		j++
	case j < len(s.b) && s.b[j] >= '1' && s.b[j] <= '9':
		for j < len(s.b) && s.b[j] >= '0' && s.b[j] <= '9' {
			j++
		}
	default:
		return false, false
	}
	integer = true
	if j < len(s.b) && s.b[j] == '.' {
		integer = false
		j++
		if j >= len(s.b) || s.b[j] < '0' || s.b[j] > '9' {
			return false, false
		}
		for j < len(s.b) && s.b[j] >= '0' && s.b[j] <= '9' {
			j++
		}
	}
	if j < len(s.b) && (s.b[j] == 'e' || s.b[j] == 'E') {
		integer = false
		j++
		if j < len(s.b) && (s.b[j] == '+' || s.b[j] == '-') {
			j++
		}
		if j >= len(s.b) || s.b[j] < '0' || s.b[j] > '9' {
			return false, false
		}
		for j < len(s.b) && s.b[j] >= '0' && s.b[j] <= '9' {
			j++
		}
	}
	s.i = j
	return integer, true
}

// wholeValue reports whether v is exactly one value that read accepts.
func wholeValue(v []byte, read func(*scanner) bool) bool {
	s := scanner{b: v}
	return read(&s) && s.i == len(v)
}

// plainInt reads v when it is one JSON integer that fits an int64.
func plainInt(v []byte) (int64, bool) {
	var integer bool
	if !wholeValue(v, func(s *scanner) bool { i, ok := s.number(); integer = i; return ok }) || !integer {
		return 0, false
	}
	n, err := strconv.ParseInt(string(v), 10, 64)
	return n, err == nil
}

// plainFloat reads v when it is one JSON number: encoding/json reads a
// number into a float64 with the same strconv.ParseFloat.
func plainFloat(v []byte) (float64, bool) {
	if !wholeValue(v, func(s *scanner) bool { _, ok := s.number(); return ok }) {
		return 0, false
	}
	f, err := strconv.ParseFloat(string(v), 64)
	return f, err == nil
}

// plainStringValue reads v when it is one plain string (plainString).
func plainStringValue(v []byte) (string, bool) {
	var str []byte
	if !wholeValue(v, func(s *scanner) bool { var ok bool; str, ok = s.plainString(false); return ok }) {
		return "", false
	}
	return string(str), true
}

// list reads v when it is one JSON list and nothing after it but space,
// each element with elem (called at the element, space skipped before it).
func list(v []byte, elem func(s *scanner) bool) bool {
	s := scanner{b: v}
	if !s.next('[') {
		return false
	}
	if !s.next(']') {
		for {
			s.space()
			if !elem(&s) {
				return false
			}
			if s.next(',') {
				continue
			}
			if !s.next(']') {
				return false
			}
			break
		}
	}
	s.space()
	return s.i == len(v)
}

// plainIDList reads v when it is a list of non-negative JSON integers.
func plainIDList(v []byte) ([]int64, bool) {
	out := make([]int64, 0, len(v)/2)
	ok := list(v, func(s *scanner) bool {
		start := s.i
		if integer, ok := s.number(); !ok || !integer {
			return false
		}
		n, err := strconv.ParseInt(string(s.b[start:s.i]), 10, 64)
		if err != nil || n < 0 {
			return false
		}
		out = append(out, n)
		return true
	})
	if !ok {
		return nil, false
	}
	return out, true
}

// plainBlockIDs reads v when it is a flat list of block ids or a list of
// such lists (parseBlockIDs's two spellings) in the plain form.
func plainBlockIDs(v []byte) (BlockIDs, bool) {
	s := scanner{b: v}
	if !s.next('[') {
		return nil, false
	}
	s.space()
	if s.i >= len(v) || v[s.i] != '[' {
		ids, ok := plainIDList(v)
		if !ok {
			return nil, false
		}
		if len(ids) == 0 {
			return BlockIDs{}, true
		}
		return BlockIDs{ids}, true
	}
	var out BlockIDs
	ok := list(v, func(s *scanner) bool {
		start := s.i
		if s.i >= len(s.b) || s.b[s.i] != '[' || !s.value(2) {
			return false
		}
		ids, ok := plainIDList(s.b[start:s.i])
		out = append(out, ids)
		return ok
	})
	if !ok {
		return nil, false
	}
	return out, true
}

// plainStrings reads v when it is a list of plain strings.
func plainStrings(v []byte) ([]string, bool) {
	out := []string{}
	ok := list(v, func(s *scanner) bool {
		str, ok := s.plainString(false)
		out = append(out, string(str))
		return ok
	})
	if !ok {
		return nil, false
	}
	return out, true
}

// plainObjects splits v, a list of objects, into each object's fields.
func plainObjects(v []byte) ([][]rawField, bool) {
	out := [][]rawField{}
	ok := list(v, func(s *scanner) bool {
		f, ok := s.object(2)
		out = append(out, f)
		return ok
	})
	if !ok {
		return nil, false
	}
	return out, true
}
