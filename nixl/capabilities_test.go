package nixl

import "testing"

// The index rules every engine's MakeXfer applies, with their statuses.
func TestIndexRules(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		bad  bool
	}{
		{"empty", CheckIndexArrays(nil, nil), true},
		{"unequal", CheckIndexArrays([]int32{0}, []int32{0, 1}), true},
		{"ok arrays", CheckIndexArrays([]int32{0}, []int32{1}), false},
		{"negative", CheckPairRange(0, -1, 0, 4, 4), true},
		{"local past end", CheckPairRange(0, 4, 0, 4, 4), true},
		{"remote past end", CheckPairRange(0, 0, 4, 4, 4), true},
		{"in range", CheckPairRange(0, 3, 3, 4, 4), false},
		{"lengths differ", CheckPairLengths(0, 8, 16), true},
		{"lengths equal", CheckPairLengths(0, 8, 8), false},
	} {
		if (c.err != nil) != c.bad {
			t.Errorf("%s: %v", c.name, c.err)
		}
		if c.bad && StatusOf(c.err) != ErrInvalidParam {
			t.Errorf("%s: status %v, want ERR_INVALID_PARAM", c.name, StatusOf(c.err))
		}
	}
}
