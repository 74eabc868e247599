package libnixl

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/gonixl/gonixl/nixl"
)

// encodeNotifs writes records as gxnixl_get_notifs does: per notification
// a native-endian uint32 length and the agent name, then a length and the
// message.
func encodeNotifs(ns []nixl.Notif) []byte {
	var b []byte
	for _, n := range ns {
		b = binary.NativeEndian.AppendUint32(b, uint32(len(n.Agent)))
		b = append(b, n.Agent...)
		b = binary.NativeEndian.AppendUint32(b, uint32(len(n.Msg)))
		b = append(b, n.Msg...)
	}
	return b
}

// FuzzParseNotifs: the notification buffer holds what remote agents sent
// (names and messages are theirs). Properties: no panic; exactly count
// notifications without an error; the records parsed are a prefix of the
// buffer; and notifications made from the input (split at 0x00: agent,
// message, agent, ...; empty messages included) survive encode + parse.
func FuzzParseNotifs(f *testing.F) {
	f.Add(encodeNotifs([]nixl.Notif{{Agent: "engine-d-pp0-tp0-1a2b", Msg: []byte("req-1:1")}, {Agent: "b", Msg: []byte("HB:x,y")}}), uint16(2))
	f.Add(encodeNotifs([]nixl.Notif{{Agent: "a", Msg: []byte{}}}), uint16(1)) // an empty message, last
	f.Add(encodeNotifs([]nixl.Notif{{Agent: "a", Msg: []byte{}}, {Agent: "b", Msg: []byte("x")}}), uint16(2))
	f.Add([]byte{9, 0, 0, 0, 'a'}, uint16(1))
	f.Add([]byte{}, uint16(0))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff}, uint16(65535))
	f.Add([]byte("a\x00req-1:1\x00b\x00\x00"), uint16(3))
	f.Fuzz(func(t *testing.T, b []byte, count uint16) {
		ns, err := parseNotifs(b, int(count))
		if err == nil && len(ns) != int(count) {
			t.Fatalf("%d notifications for count %d", len(ns), count)
		}
		if len(ns) > int(count) {
			t.Fatalf("%d notifications for count %d", len(ns), count)
		}
		if enc := encodeNotifs(ns); !bytes.HasPrefix(b, enc) {
			t.Fatalf("parsed records %q are not a prefix of the buffer", ns)
		}
		// Round trip of notifications built from the input.
		parts := bytes.Split(b, []byte{0})
		var want []nixl.Notif
		for i := 0; i+1 < len(parts) && len(want) < 64; i += 2 {
			want = append(want, nixl.Notif{Agent: string(parts[i]), Msg: parts[i+1]})
		}
		got, err := parseNotifs(encodeNotifs(want), len(want))
		if err != nil || len(got) != len(want) {
			t.Fatalf("%d notifications do not round-trip: %d back, %v", len(want), len(got), err)
		}
		for i := range want {
			if got[i].Agent != want[i].Agent || !bytes.Equal(got[i].Msg, want[i].Msg) {
				t.Fatalf("notification %d: %q/%q, want %q/%q", i, got[i].Agent, got[i].Msg, want[i].Agent, want[i].Msg)
			}
		}
	})
}
