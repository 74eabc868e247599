package sidechannel

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
)

// This file is a minimal ZMTP 3.1 peer (RFC 37/ZMTP, NULL mechanism) with the
// two socket roles the handshake needs: a REQ client and a ROUTER-compatible
// server that answers each connection's requests in order. Every frame length
// is checked against a limit before anything is allocated.

const (
	flagMore    = 0x01
	flagLong    = 0x02
	flagCommand = 0x04

	greetingLen   = 64
	maxCommandLen = 64 << 10 // READY/PING bodies are tiny
)

// ErrFrameTooLarge is returned when a peer announces a frame above the limit.
var ErrFrameTooLarge = errors.New("sidechannel: frame exceeds the size limit")

func greeting() []byte {
	g := make([]byte, greetingLen)
	g[0] = 0xff
	g[9] = 0x7f
	g[10], g[11] = 3, 1 // ZMTP 3.1
	copy(g[12:32], "NULL")
	return g // as-server 0, filler zeros
}

// zconn is one ZMTP connection after the greeting and READY exchange.
type zconn struct {
	c         net.Conn
	r         *bufio.Reader
	maxFrame  int
	maxFrames int
	peerType  string
}

// zmtpHandshake exchanges greetings and READY commands on c. own is our
// socket type; accept lists the peer socket types we talk to. The caller sets
// the deadline on c.
func zmtpHandshake(c net.Conn, own string, accept []string, maxFrame, maxFrames int) (*zconn, error) {
	z := &zconn{c: c, r: bufio.NewReaderSize(c, 4096), maxFrame: maxFrame, maxFrames: maxFrames}
	if _, err := c.Write(greeting()); err != nil {
		return nil, fmt.Errorf("send greeting: %w", err)
	}
	var g [greetingLen]byte
	if _, err := io.ReadFull(z.r, g[:]); err != nil {
		return nil, fmt.Errorf("read greeting: %w", err)
	}
	if g[0] != 0xff || g[9]&0x01 == 0 {
		return nil, errors.New("peer is not a ZMTP 3 peer (bad signature)")
	}
	if g[10] < 3 {
		return nil, fmt.Errorf("peer speaks ZMTP %d.%d, need 3.x", g[10], g[11])
	}
	if mech := string(bytes.TrimRight(g[12:32], "\x00")); mech != "NULL" {
		return nil, fmt.Errorf("peer uses security mechanism %q, only NULL is supported", mech)
	}
	ready := []byte("\x05READY")
	ready = appendProp(ready, "Socket-Type", own)
	if own == "REQ" || own == "ROUTER" {
		ready = appendProp(ready, "Identity", "")
	}
	if err := z.writeFrame(ready, flagCommand); err != nil {
		return nil, fmt.Errorf("send READY: %w", err)
	}
	body, flags, err := z.readFrame(maxCommandLen)
	if err != nil {
		return nil, fmt.Errorf("read READY: %w", err)
	}
	if flags&flagCommand == 0 {
		return nil, errors.New("peer sent a message before READY")
	}
	name, props, err := parseCommand(body)
	if err != nil {
		return nil, err
	}
	switch name {
	case "READY":
	case "ERROR":
		return nil, fmt.Errorf("peer refused the connection: %q", props["error"])
	default:
		return nil, fmt.Errorf("peer sent %q instead of READY", name)
	}
	z.peerType = props["socket-type"]
	for _, t := range accept {
		if z.peerType == t {
			return z, nil
		}
	}
	return nil, fmt.Errorf("peer socket type %q cannot talk to %s", z.peerType, own)
}

func appendProp(b []byte, name, value string) []byte {
	b = append(b, byte(len(name)))
	b = append(b, name...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(value)))
	return append(b, value...)
}

// parseCommand splits a command body into its name and, for READY/ERROR, its
// properties (names lower-cased). ERROR carries a single reason string.
func parseCommand(body []byte) (string, map[string]string, error) {
	if len(body) < 1 || int(body[0]) > len(body)-1 {
		return "", nil, errors.New("malformed ZMTP command")
	}
	nl := int(body[0]) // int, not byte: 1+255 must not wrap to 0
	name := string(body[1 : 1+nl])
	rest := body[1+nl:]
	props := map[string]string{}
	if name == "ERROR" {
		if len(rest) >= 1 && int(rest[0]) <= len(rest)-1 {
			props["error"] = string(rest[1 : 1+int(rest[0])])
		}
		return name, props, nil
	}
	if name != "READY" {
		return name, props, nil
	}
	for len(rest) > 0 {
		n := int(rest[0])
		if n == 0 || n > len(rest)-1-4 {
			return "", nil, errors.New("malformed READY property")
		}
		key := strings.ToLower(string(rest[1 : 1+n]))
		rest = rest[1+n:]
		vl := binary.BigEndian.Uint32(rest)
		rest = rest[4:]
		if uint64(vl) > uint64(len(rest)) {
			return "", nil, errors.New("malformed READY property value")
		}
		props[key] = string(rest[:vl])
		rest = rest[vl:]
	}
	return name, props, nil
}

func (z *zconn) writeFrame(body []byte, flags byte) error {
	_, err := (&net.Buffers{frameHeader(len(body), flags), body}).WriteTo(z.c)
	return err
}

func frameHeader(n int, flags byte) []byte {
	if n > 255 {
		h := make([]byte, 9)
		h[0] = flags | flagLong
		binary.BigEndian.PutUint64(h[1:], uint64(n))
		return h
	}
	return []byte{flags, byte(n)}
}

// writeMsg sends frames as one multipart message in a single write.
func (z *zconn) writeMsg(frames ...[]byte) error {
	bufs := make(net.Buffers, 0, 2*len(frames))
	for i, f := range frames {
		var fl byte
		if i < len(frames)-1 {
			fl = flagMore
		}
		bufs = append(bufs, frameHeader(len(f), fl), f)
	}
	_, err := bufs.WriteTo(z.c)
	return err
}

// readFrame reads one frame whose body may be at most limit bytes.
func (z *zconn) readFrame(limit int) ([]byte, byte, error) {
	var hdr [9]byte
	if _, err := io.ReadFull(z.r, hdr[:2]); err != nil {
		return nil, 0, err
	}
	flags := hdr[0]
	if flags&^(flagMore|flagLong|flagCommand) != 0 {
		return nil, 0, fmt.Errorf("invalid ZMTP frame flags 0x%02x", flags)
	}
	size := uint64(hdr[1])
	if flags&flagLong != 0 {
		if _, err := io.ReadFull(z.r, hdr[2:9]); err != nil {
			return nil, 0, err
		}
		size = binary.BigEndian.Uint64(hdr[1:9])
	}
	if flags&flagCommand != 0 && flags&flagMore != 0 {
		return nil, 0, errors.New("invalid ZMTP frame: command with MORE flag")
	}
	if size > uint64(limit) {
		return nil, 0, fmt.Errorf("%w: peer announced %d bytes, limit is %d", ErrFrameTooLarge, size, limit)
	}
	body := make([]byte, size)
	if _, err := io.ReadFull(z.r, body); err != nil {
		return nil, 0, err
	}
	return body, flags, nil
}

// readMsg reads the next multipart message, answering PING commands and
// ignoring other commands between messages.
func (z *zconn) readMsg() ([][]byte, error) {
	var frames [][]byte
	total := 0
	for {
		body, flags, err := z.readFrame(z.maxFrame)
		if err != nil {
			return nil, err
		}
		if flags&flagCommand != 0 {
			if len(frames) > 0 {
				return nil, errors.New("ZMTP command inside a multipart message")
			}
			if len(body) > maxCommandLen {
				return nil, errors.New("ZMTP command too large")
			}
			if name, _, err := parseCommand(body); err == nil && name == "PING" && len(body) >= 7 {
				ctx := body[7:]
				if len(ctx) > 16 {
					ctx = ctx[:16]
				}
				if err := z.writeFrame(append([]byte("\x04PONG"), ctx...), flagCommand); err != nil {
					return nil, err
				}
			}
			continue
		}
		frames = append(frames, body)
		total += len(body)
		if len(frames) > z.maxFrames {
			return nil, fmt.Errorf("message has more than %d frames", z.maxFrames)
		}
		if total > z.maxFrame+z.maxFrames*64 {
			return nil, fmt.Errorf("%w: message totals more than %d bytes", ErrFrameTooLarge, total)
		}
		if flags&flagMore == 0 {
			return frames, nil
		}
	}
}
