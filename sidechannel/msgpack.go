package sidechannel

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"unicode/utf8"
)

// This file holds the small MessagePack writer and reader the wire types
// use. They are hand-written rather than reflection-based so that the bytes
// match msgspec's exactly (smallest integer/str/bin/array/map header for the
// value, float64 for floats) and so that decoding is strict in the way
// msgspec's typed decoders are strict.

// maxDepth bounds nesting while skipping unknown values, so a hostile payload
// cannot exhaust the stack.
const maxDepth = 128

// errTruncated and friends are wrapped into *DecodeError with a path.
var (
	errTruncated = errors.New("data is truncated")
	errTooDeep   = errors.New("nesting is too deep")
)

// DecodeError reports why bytes could not be decoded into a wire type. Path is
// a msgspec-style location such as "$.block_lens[3]".
type DecodeError struct {
	Type string // "NixlAgentMetadata", "NixlHandshakePayload", ...
	Path string
	Err  error
}

func (e *DecodeError) Error() string {
	if e.Path == "" {
		return fmt.Sprintf("sidechannel: decode %s: %v", e.Type, e.Err)
	}
	return fmt.Sprintf("sidechannel: decode %s: %v - at `%s`", e.Type, e.Err, e.Path)
}

func (e *DecodeError) Unwrap() error { return e.Err }

// ---- writer ----

type mpWriter struct{ b []byte }

func (w *mpWriter) nil_() { w.b = append(w.b, 0xc0) }

func (w *mpWriter) bool_(v bool) {
	if v {
		w.b = append(w.b, 0xc3)
	} else {
		w.b = append(w.b, 0xc2)
	}
}

func (w *mpWriter) int_(v int64) {
	if v >= 0 {
		w.uint_(uint64(v))
		return
	}
	switch {
	case v >= -32:
		w.b = append(w.b, byte(int8(v)))
	case v >= math.MinInt8:
		w.b = append(w.b, 0xd0, byte(int8(v)))
	case v >= math.MinInt16:
		w.b = append(w.b, 0xd1)
		w.b = binary.BigEndian.AppendUint16(w.b, uint16(int16(v)))
	case v >= math.MinInt32:
		w.b = append(w.b, 0xd2)
		w.b = binary.BigEndian.AppendUint32(w.b, uint32(int32(v)))
	default:
		w.b = append(w.b, 0xd3)
		w.b = binary.BigEndian.AppendUint64(w.b, uint64(v))
	}
}

func (w *mpWriter) uint_(v uint64) {
	switch {
	case v <= 0x7f:
		w.b = append(w.b, byte(v))
	case v <= math.MaxUint8:
		w.b = append(w.b, 0xcc, byte(v))
	case v <= math.MaxUint16:
		w.b = append(w.b, 0xcd)
		w.b = binary.BigEndian.AppendUint16(w.b, uint16(v))
	case v <= math.MaxUint32:
		w.b = append(w.b, 0xce)
		w.b = binary.BigEndian.AppendUint32(w.b, uint32(v))
	default:
		w.b = append(w.b, 0xcf)
		w.b = binary.BigEndian.AppendUint64(w.b, v)
	}
}

func (w *mpWriter) float64_(v float64) {
	w.b = append(w.b, 0xcb)
	w.b = binary.BigEndian.AppendUint64(w.b, math.Float64bits(v))
}

func (w *mpWriter) header(n int, fix, fixMax byte, c16, c32 byte) {
	switch {
	case n <= int(fixMax):
		w.b = append(w.b, fix|byte(n))
	case n <= math.MaxUint16:
		w.b = append(w.b, c16)
		w.b = binary.BigEndian.AppendUint16(w.b, uint16(n))
	default:
		w.b = append(w.b, c32)
		w.b = binary.BigEndian.AppendUint32(w.b, uint32(n))
	}
}

func (w *mpWriter) str(s string) {
	n := len(s)
	switch {
	case n <= 31:
		w.b = append(w.b, 0xa0|byte(n))
	case n <= math.MaxUint8:
		w.b = append(w.b, 0xd9, byte(n))
	case n <= math.MaxUint16:
		w.b = append(w.b, 0xda)
		w.b = binary.BigEndian.AppendUint16(w.b, uint16(n))
	default:
		w.b = append(w.b, 0xdb)
		w.b = binary.BigEndian.AppendUint32(w.b, uint32(n))
	}
	w.b = append(w.b, s...)
}

func (w *mpWriter) bin(p []byte) {
	n := len(p)
	switch {
	case n <= math.MaxUint8:
		w.b = append(w.b, 0xc4, byte(n))
	case n <= math.MaxUint16:
		w.b = append(w.b, 0xc5)
		w.b = binary.BigEndian.AppendUint16(w.b, uint16(n))
	default:
		w.b = append(w.b, 0xc6)
		w.b = binary.BigEndian.AppendUint32(w.b, uint32(n))
	}
	w.b = append(w.b, p...)
}

func (w *mpWriter) arrayHeader(n int) { w.header(n, 0x90, 15, 0xdc, 0xdd) }
func (w *mpWriter) mapHeader(n int)   { w.header(n, 0x80, 15, 0xde, 0xdf) }

func (w *mpWriter) ints(v []int64) {
	w.arrayHeader(len(v))
	for _, x := range v {
		w.int_(x)
	}
}

func (w *mpWriter) strs(v []string) {
	w.arrayHeader(len(v))
	for _, x := range v {
		w.str(x)
	}
}

// ---- reader ----

// kind is the coarse MessagePack type of the next value, named as msgspec
// names it in its error messages.
type kind int

const (
	kNil kind = iota
	kBool
	kInt
	kFloat
	kStr
	kBin
	kArray
	kMap
	kExt
	kInvalid
)

var kindNames = [...]string{"None", "bool", "int", "float", "str", "bytes", "array", "object", "ext", "invalid"}

func (k kind) String() string { return kindNames[k] }

func kindOf(c byte) kind {
	switch {
	case c <= 0x7f || c >= 0xe0:
		return kInt
	case c <= 0x8f:
		return kMap
	case c <= 0x9f:
		return kArray
	case c <= 0xbf:
		return kStr
	}
	switch c {
	case 0xc0:
		return kNil
	case 0xc2, 0xc3:
		return kBool
	case 0xc4, 0xc5, 0xc6:
		return kBin
	case 0xc7, 0xc8, 0xc9, 0xd4, 0xd5, 0xd6, 0xd7, 0xd8:
		return kExt
	case 0xca, 0xcb:
		return kFloat
	case 0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd1, 0xd2, 0xd3:
		return kInt
	case 0xd9, 0xda, 0xdb:
		return kStr
	case 0xdc, 0xdd:
		return kArray
	case 0xde, 0xdf:
		return kMap
	}
	return kInvalid // 0xc1
}

// mpReader reads MessagePack from a byte slice. Every method checks bounds
// before it slices or allocates.
type mpReader struct {
	b   []byte
	off int
}

func (r *mpReader) remaining() int { return len(r.b) - r.off }

func (r *mpReader) peek() (kind, error) {
	if r.off >= len(r.b) {
		return kInvalid, errTruncated
	}
	k := kindOf(r.b[r.off])
	if k == kInvalid {
		return k, fmt.Errorf("malformed data: invalid opcode 0x%02x (byte %d)", r.b[r.off], r.off)
	}
	return k, nil
}

func (r *mpReader) take(n int) ([]byte, error) {
	if n < 0 || n > r.remaining() {
		return nil, errTruncated
	}
	p := r.b[r.off : r.off+n]
	r.off += n
	return p, nil
}

func (r *mpReader) byte_() (byte, error) {
	p, err := r.take(1)
	if err != nil {
		return 0, err
	}
	return p[0], nil
}

func (r *mpReader) be(n int) (uint64, error) {
	p, err := r.take(n)
	if err != nil {
		return 0, err
	}
	var v uint64
	for _, c := range p {
		v = v<<8 | uint64(c)
	}
	return v, nil
}

func expected(want string, got kind) error {
	return fmt.Errorf("expected `%s`, got `%s`", want, got)
}

// isNil consumes a nil if one is next.
func (r *mpReader) isNil() (bool, error) {
	k, err := r.peek()
	if err != nil {
		return false, err
	}
	if k == kNil {
		r.off++
		return true, nil
	}
	return false, nil
}

// intRaw reads any MessagePack integer; neg tells whether it is negative
// (then v holds its int64 bits).
func (r *mpReader) intRaw() (v uint64, neg bool, err error) {
	k, err := r.peek()
	if err != nil {
		return 0, false, err
	}
	if k != kInt {
		return 0, false, expected("int", k)
	}
	c, _ := r.byte_()
	switch {
	case c <= 0x7f:
		return uint64(c), false, nil
	case c >= 0xe0:
		return uint64(int64(int8(c))), true, nil
	}
	switch c {
	case 0xcc:
		v, err = r.be(1)
	case 0xcd:
		v, err = r.be(2)
	case 0xce:
		v, err = r.be(4)
	case 0xcf:
		v, err = r.be(8)
	case 0xd0:
		v, err = r.be(1)
		v = uint64(int64(int8(v)))
	case 0xd1:
		v, err = r.be(2)
		v = uint64(int64(int16(v)))
	case 0xd2:
		v, err = r.be(4)
		v = uint64(int64(int32(v)))
	case 0xd3:
		v, err = r.be(8)
	}
	if err != nil {
		return 0, false, err
	}
	neg = c >= 0xd0 && int64(v) < 0
	return v, neg, nil
}

func (r *mpReader) int_() (int64, error) {
	v, neg, err := r.intRaw()
	if err != nil {
		return 0, err
	}
	if !neg && v > math.MaxInt64 {
		return 0, fmt.Errorf("integer %d does not fit in int64", v)
	}
	return int64(v), nil
}

func (r *mpReader) uint_() (uint64, error) {
	v, neg, err := r.intRaw()
	if err != nil {
		return 0, err
	}
	if neg {
		return 0, fmt.Errorf("integer %d is negative", int64(v))
	}
	return v, nil
}

// number reads an int or a float as float64 (the clock frame is decoded
// untyped by vLLM, so either is accepted there).
func (r *mpReader) number() (float64, error) {
	k, err := r.peek()
	if err != nil {
		return 0, err
	}
	switch k {
	case kInt:
		v, neg, err := r.intRaw()
		if err != nil {
			return 0, err
		}
		if neg {
			return float64(int64(v)), nil
		}
		return float64(v), nil
	case kFloat:
		c, _ := r.byte_()
		if c == 0xca {
			v, err := r.be(4)
			return float64(math.Float32frombits(uint32(v))), err
		}
		v, err := r.be(8)
		return math.Float64frombits(v), err
	}
	return 0, expected("float", k)
}

// strBytes reads a str without validating UTF-8 (map keys are compared as
// raw bytes, as msgspec does).
func (r *mpReader) strBytes() ([]byte, error) {
	k, err := r.peek()
	if err != nil {
		return nil, err
	}
	if k != kStr {
		return nil, expected("str", k)
	}
	c, _ := r.byte_()
	var n uint64
	switch c {
	case 0xd9:
		n, err = r.be(1)
	case 0xda:
		n, err = r.be(2)
	case 0xdb:
		n, err = r.be(4)
	default:
		n = uint64(c & 0x1f)
	}
	if err != nil {
		return nil, err
	}
	return r.take(int(n))
}

func (r *mpReader) str() (string, error) {
	p, err := r.strBytes()
	if err != nil {
		return "", err
	}
	if !utf8.Valid(p) {
		return "", errors.New("str is not valid UTF-8")
	}
	return string(p), nil
}

func (r *mpReader) binView() ([]byte, error) {
	k, err := r.peek()
	if err != nil {
		return nil, err
	}
	if k != kBin {
		return nil, expected("bytes", k)
	}
	c, _ := r.byte_()
	var n uint64
	switch c {
	case 0xc4:
		n, err = r.be(1)
	case 0xc5:
		n, err = r.be(2)
	default:
		n, err = r.be(4)
	}
	if err != nil {
		return nil, err
	}
	return r.take(int(n))
}

// bin returns a copy, so decoded values never alias the input buffer.
func (r *mpReader) bin() ([]byte, error) {
	p, err := r.binView()
	if err != nil {
		return nil, err
	}
	return append([]byte{}, p...), nil
}

// containerLen reads an array or map header. Each element needs at least one
// byte (two for a map entry), so a length larger than the rest of the input is
// rejected before anything is allocated.
func (r *mpReader) containerLen(want kind) (int, error) {
	k, err := r.peek()
	if err != nil {
		return 0, err
	}
	if k != want {
		return 0, expected(want.String(), k)
	}
	c, _ := r.byte_()
	var n uint64
	switch c {
	case 0xdc, 0xde:
		n, err = r.be(2)
	case 0xdd, 0xdf:
		n, err = r.be(4)
	default:
		n = uint64(c & 0x0f)
	}
	if err != nil {
		return 0, err
	}
	per := uint64(1)
	if want == kMap {
		per = 2
	}
	if n > uint64(r.remaining())/per {
		return 0, errTruncated
	}
	return int(n), nil
}

func (r *mpReader) arrayLen() (int, error) { return r.containerLen(kArray) }
func (r *mpReader) mapLen() (int, error)   { return r.containerLen(kMap) }

// skip consumes one value of any type.
func (r *mpReader) skip(depth int) error {
	if depth > maxDepth {
		return errTooDeep
	}
	k, err := r.peek()
	if err != nil {
		return err
	}
	c := r.b[r.off]
	switch k {
	case kNil, kBool:
		r.off++
		return nil
	case kInt:
		_, _, err = r.intRaw()
		return err
	case kFloat:
		_, err = r.number()
		return err
	case kStr:
		_, err = r.strBytes()
		return err
	case kBin:
		_, err = r.binView()
		return err
	case kArray, kMap:
		n, err := r.containerLen(k)
		if err != nil {
			return err
		}
		if k == kMap {
			n *= 2
		}
		for i := 0; i < n; i++ {
			if err := r.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case kExt:
		r.off++
		var n uint64
		switch c {
		case 0xd4:
			n = 1
		case 0xd5:
			n = 2
		case 0xd6:
			n = 4
		case 0xd7:
			n = 8
		case 0xd8:
			n = 16
		case 0xc7:
			n, err = r.be(1)
		case 0xc8:
			n, err = r.be(2)
		case 0xc9:
			n, err = r.be(4)
		}
		if err != nil {
			return err
		}
		_, err = r.take(int(n) + 1) // type byte + data
		return err
	}
	return fmt.Errorf("malformed data: invalid opcode 0x%02x", c)
}

func (r *mpReader) ints() ([]int64, error) {
	n, err := r.arrayLen()
	if err != nil {
		return nil, err
	}
	out := make([]int64, n)
	for i := range out {
		if out[i], err = r.int_(); err != nil {
			return nil, indexErr(i, err)
		}
	}
	return out, nil
}

func (r *mpReader) uints() ([]uint64, error) {
	n, err := r.arrayLen()
	if err != nil {
		return nil, err
	}
	out := make([]uint64, n)
	for i := range out {
		if out[i], err = r.uint_(); err != nil {
			return nil, indexErr(i, err)
		}
	}
	return out, nil
}

func (r *mpReader) strs() ([]string, error) {
	n, err := r.arrayLen()
	if err != nil {
		return nil, err
	}
	out := make([]string, n)
	for i := range out {
		if out[i], err = r.str(); err != nil {
			return nil, indexErr(i, err)
		}
	}
	return out, nil
}

// pathErr carries the location of a nested error up to the DecodeError.
type pathErr struct {
	path string // relative, e.g. "[3]" or ".x"
	err  error
}

func (e *pathErr) Error() string { return e.err.Error() }

func indexErr(i int, err error) error { return prefixErr(fmt.Sprintf("[%d]", i), err) }

func prefixErr(p string, err error) error {
	if pe, ok := err.(*pathErr); ok {
		return &pathErr{path: p + pe.path, err: pe.err}
	}
	return &pathErr{path: p, err: err}
}

func toDecodeError(typ string, err error) error {
	if pe, ok := err.(*pathErr); ok {
		return &DecodeError{Type: typ, Path: "$" + pe.path, Err: pe.err}
	}
	return &DecodeError{Type: typ, Err: err}
}
