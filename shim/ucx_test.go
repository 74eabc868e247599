package shim

import (
	"bytes"
	"fmt"
	"strings"
	"testing"

	"github.com/gonixl/gonixl/nixl"
	_ "github.com/gonixl/gonixl/nixl/ucx"
)

// TestPrefillToDecodeOverUCX runs the P -> D flow of
// TestPrefillToDecodeTransfer on the real UCX engine, in one process, and
// checks that nothing outside the requested blocks changed.
func TestPrefillToDecodeOverUCX(t *testing.T) {
	eng := ucxEngine(t)
	p := newSide(t, eng, "kv_producer", "engine-p", nil, 1, nil)
	d := newSide(t, eng, "kv_consumer", "engine-d", nil, 200, nil)
	before := make([][]byte, len(d.kv.mems))
	for i, m := range d.kv.mems {
		before[i] = bytes.Clone(m.Bytes)
	}
	out := prefill(t, p, "req-p", []int64{3, 4, 5}, 12)
	dp := mustParams(t, string(out))
	if _, err := d.sched.UpdateStateAfterAlloc("req-d", dp, BlockIDs{{7, 8, 9}}, []int64{0}, 12); err != nil {
		t.Fatal(err)
	}
	d.step(t)
	f := d.waitFinished(t, "decode recv", func(f Finished) bool { return contains(f.Recving, "req-d") })
	if len(f.Failed) != 0 {
		t.Fatalf("failed: %v", f.Failed)
	}
	for l := 0; l < tLayers; l++ {
		for kv := 0; kv < 2; kv++ {
			for b := 0; b < tNumBlocks; b++ {
				got := d.kv.block(l, kv, b)
				switch {
				case b >= 7 && b <= 9:
					if !bytes.Equal(got, p.kv.block(l, kv, b-4)) {
						t.Fatalf("layer %d kv %d block %d: wrong data", l, kv, b)
					}
				default:
					off := (kv*tNumBlocks + b) * tBlockLen
					if !bytes.Equal(got, before[l][off:off+tBlockLen]) {
						t.Fatalf("layer %d kv %d block %d outside the request changed", l, kv, b)
					}
				}
			}
		}
	}
	p.waitFinished(t, "prefill send", func(f Finished) bool { return contains(f.Sending, "req-p") })
}

// TestTensorParallelOverUCX runs heterogeneous-TP transfers of
// TestTensorParallelTransfers on the real UCX engine: head slices read from
// one prefill rank, slots filled from two, and GQA replication.
func TestTensorParallelOverUCX(t *testing.T) {
	eng := ucxEngine(t)
	for _, c := range [][3]int{{1, 2, 2}, {2, 1, 2}, {2, 2, 2}, {2, 1, 1}, {1, 4, 2}} {
		t.Run(fmt.Sprintf("P%d-D%d-heads%d", c[0], c[1], c[2]), func(t *testing.T) {
			tpTransfer(t, eng, c[0], c[1], c[2], "")
		})
	}
}

// ucxEngine returns the UCX engine. Built without cgo the package has the
// stub engine, and these tests skip (./build.sh test runs them in its cgo
// step; tests/declared.toml declares the skip for the CGO_ENABLED=0 one);
// with cgo, UCX not loading is a failure: it is installed wherever these
// tests run.
func ucxEngine(t *testing.T) nixl.Engine {
	t.Helper()
	eng, err := nixl.Lookup("ucx")
	if err != nil {
		t.Fatalf("ucx engine not registered: %v", err)
	}
	if err := eng.Available(); err != nil {
		if strings.Contains(err.Error(), "built without the UCX binding") {
			t.Skipf("built without cgo: %v", err)
		}
		t.Fatalf("UCX does not load: %v", err)
	}
	return eng
}
