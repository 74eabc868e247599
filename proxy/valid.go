package proxy

// validJSON reports whether b is one JSON value, accepting exactly what
// json.Valid accepts (bytes of strings are not checked as UTF-8, nesting is
// limited to encoding/json's 10000 levels). It is a direct recursive
// descent, several times faster than encoding/json's byte-at-a-time state
// machine; FuzzValidJSON holds it to json.Valid.
func validJSON(b []byte) bool {
	v := validator{b: b}
	i, ok := v.value(skipSpace(b, 0), 0)
	return ok && skipSpace(b, i) == len(b)
}

// maxJSONDepth is encoding/json's nesting limit.
const maxJSONDepth = 10000

type validator struct{ b []byte }

// value checks the value at b[i] and returns the index past it.
func (v *validator) value(i, depth int) (int, bool) {
	b := v.b
	if i >= len(b) {
		return i, false
	}
	switch c := b[i]; {
	case c == '"':
		return v.str(i)
	case c == '{':
		if depth++; depth > maxJSONDepth {
			return i, false
		}
		i = skipSpace(b, i+1)
		if i < len(b) && b[i] == '}' {
			return i + 1, true
		}
		for {
			if i >= len(b) || b[i] != '"' {
				return i, false
			}
			var ok bool
			if i, ok = v.str(i); !ok {
				return i, false
			}
			i = skipSpace(b, i)
			if i >= len(b) || b[i] != ':' {
				return i, false
			}
			if i, ok = v.value(skipSpace(b, i+1), depth); !ok {
				return i, false
			}
			i = skipSpace(b, i)
			if i >= len(b) {
				return i, false
			}
			switch b[i] {
			case '}':
				return i + 1, true
			case ',':
				i = skipSpace(b, i+1)
			default:
				return i, false
			}
		}
	case c == '[':
		if depth++; depth > maxJSONDepth {
			return i, false
		}
		i = skipSpace(b, i+1)
		if i < len(b) && b[i] == ']' {
			return i + 1, true
		}
		for {
			var ok bool
			if i, ok = v.value(i, depth); !ok {
				return i, false
			}
			i = skipSpace(b, i)
			if i >= len(b) {
				return i, false
			}
			switch b[i] {
			case ']':
				return i + 1, true
			case ',':
				i = skipSpace(b, i+1)
			default:
				return i, false
			}
		}
	case c == '-' || ('0' <= c && c <= '9'):
		return v.number(i)
	case c == 't':
		return v.literal(i, "true")
	case c == 'f':
		return v.literal(i, "false")
	case c == 'n':
		return v.literal(i, "null")
	}
	return i, false
}

func (v *validator) literal(i int, lit string) (int, bool) {
	if len(v.b)-i < len(lit) || string(v.b[i:i+len(lit)]) != lit {
		return i, false
	}
	return i + len(lit), true
}

// str checks the string at b[i] ('"').
func (v *validator) str(i int) (int, bool) {
	b := v.b
	for i++; i < len(b); i++ {
		switch c := b[i]; {
		case c == '"':
			return i + 1, true
		case c < 0x20:
			return i, false
		case c == '\\':
			i++
			if i >= len(b) {
				return i, false
			}
			switch b[i] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			case 'u':
				if len(b)-i < 5 {
					return i, false
				}
				for _, h := range b[i+1 : i+5] {
					if !('0' <= h && h <= '9' || 'a' <= h && h <= 'f' || 'A' <= h && h <= 'F') {
						return i, false
					}
				}
				i += 4
			default:
				return i, false
			}
		}
	}
	return i, false
}

// number checks the number at b[i]: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func (v *validator) number(i int) (int, bool) {
	b := v.b
	digits := func(i int) (int, bool) {
		j := i
		for j < len(b) && '0' <= b[j] && b[j] <= '9' {
			j++
		}
		return j, j > i
	}
	if b[i] == '-' {
		i++
	}
	if i >= len(b) {
		return i, false
	}
	if b[i] == '0' {
		i++
	} else {
		var ok bool
		if i, ok = digits(i); !ok {
			return i, false
		}
	}
	if i < len(b) && b[i] == '.' {
		var ok bool
		if i, ok = digits(i + 1); !ok {
			return i, false
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		var ok bool
		if i, ok = digits(i); !ok {
			return i, false
		}
	}
	return i, true
}
