package kvwire

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// maxStepMetaDepth bounds the nesting CheckMsgpack accepts: step metadata
// is at most five levels deep (envelope, meta, map, request, block groups).
const maxStepMetaDepth = 16

// CheckMsgpack walks one MessagePack value in b without allocating and
// rejects what would make a decoder allocate or recurse beyond the input:
// a string, binary or extension longer than the bytes left, an array or map
// with more entries than bytes left (every entry takes at least one),
// nesting deeper than maxDepth, a truncated value, the never-used code
// 0xc1. vmihailenco/msgpack/v5 allocates what a header announces before
// reading it (a 6-byte input can ask for 4 GiB) and skips unknown fields
// recursively without a depth limit (a stack overflow is fatal, not a
// panic); step metadata and push registrations are checked with this first.
func CheckMsgpack(b []byte, maxDepth int) error {
	off, err := mpValue(b, 0, maxDepth)
	if err != nil {
		return err
	}
	if off != len(b) {
		return fmt.Errorf("msgpack: %d bytes after the value", len(b)-off)
	}
	return nil
}

var errMPTruncated = errors.New("msgpack: truncated")

// mpValue checks the value at b[off:] and returns the offset after it.
func mpValue(b []byte, off, depth int) (int, error) {
	if off >= len(b) {
		return 0, errMPTruncated
	}
	c := b[off]
	off++
	sized := func(lenBytes, extra int) (int, error) { // a length, then extra + length bytes
		if len(b)-off < lenBytes {
			return 0, errMPTruncated
		}
		n := uint64(0)
		for _, x := range b[off : off+lenBytes] {
			n = n<<8 | uint64(x)
		}
		off += lenBytes
		if n > uint64(len(b)-off) || uint64(extra) > uint64(len(b)-off)-n {
			return 0, fmt.Errorf("msgpack: a value of %d bytes with %d left", n+uint64(extra), len(b)-off)
		}
		return off + extra + int(n), nil
	}
	fixed := func(n int) (int, error) {
		if len(b)-off < n {
			return 0, errMPTruncated
		}
		return off + n, nil
	}
	switch {
	case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3:
		return off, nil
	case c >= 0xa0 && c <= 0xbf:
		return fixed(int(c & 0x1f))
	case c >= 0x80 && c <= 0x8f:
		return mpItems(b, off, 2*int(c&0x0f), depth)
	case c >= 0x90 && c <= 0x9f:
		return mpItems(b, off, int(c&0x0f), depth)
	}
	switch c {
	case 0xc4, 0xd9:
		return sized(1, 0)
	case 0xc5, 0xda:
		return sized(2, 0)
	case 0xc6, 0xdb:
		return sized(4, 0)
	case 0xc7:
		return sized(1, 1)
	case 0xc8:
		return sized(2, 1)
	case 0xc9:
		return sized(4, 1)
	case 0xca:
		return fixed(4)
	case 0xcb:
		return fixed(8)
	case 0xcc, 0xd0:
		return fixed(1)
	case 0xcd, 0xd1:
		return fixed(2)
	case 0xce, 0xd2:
		return fixed(4)
	case 0xcf, 0xd3:
		return fixed(8)
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8:
		return fixed(1 + 1<<(c-0xd4))
	case 0xdc, 0xde:
		if len(b)-off < 2 {
			return 0, errMPTruncated
		}
		n := int(binary.BigEndian.Uint16(b[off:]))
		if c == 0xde {
			n *= 2
		}
		return mpItems(b, off+2, n, depth)
	case 0xdd, 0xdf:
		if len(b)-off < 4 {
			return 0, errMPTruncated
		}
		n := uint64(binary.BigEndian.Uint32(b[off:]))
		if c == 0xdf {
			n *= 2
		}
		if n > uint64(len(b)-off-4) {
			return 0, fmt.Errorf("msgpack: %d entries with %d bytes left", n, len(b)-off-4)
		}
		return mpItems(b, off+4, int(n), depth)
	}
	return 0, fmt.Errorf("msgpack: code %#x is never used", c)
}

// mpItems checks n values (map entries count twice) inside a container.
func mpItems(b []byte, off, n, depth int) (int, error) {
	if depth <= 0 {
		return 0, errors.New("msgpack: nested too deeply")
	}
	if n > len(b)-off {
		return 0, fmt.Errorf("msgpack: %d entries with %d bytes left", n, len(b)-off)
	}
	var err error
	for i := 0; i < n; i++ {
		if off, err = mpValue(b, off, depth-1); err != nil {
			return 0, err
		}
	}
	return off, nil
}
