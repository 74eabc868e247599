package shim

import (
	"fmt"
	"testing"

	"github.com/gonixl/gonixl/nixl"
	_ "github.com/gonixl/gonixl/nixl/libnixl"
)

// TestTensorParallelOverNIXL runs heterogeneous-TP transfers on real NIXL
// (libnixl_capi from the pip wheel), in one process.
func TestTensorParallelOverNIXL(t *testing.T) {
	eng, err := nixl.Lookup("nixl")
	if err != nil {
		t.Skipf("nixl engine not built in: %v", err)
	}
	if err := eng.Available(); err != nil {
		t.Skipf("NIXL not available on this host: %v", err)
	}
	for _, c := range [][3]int{{2, 1, 2}, {1, 2, 2}, {2, 2, 2}} {
		t.Run(fmt.Sprintf("P%d-D%d-heads%d", c[0], c[1], c[2]), func(t *testing.T) {
			tpTransfer(t, eng, c[0], c[1], c[2], "")
		})
	}
}
