package shim

import (
	"os"
	"strings"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl/memhash"
)

// EnvKVFault turns on the test-only damage of READs that the KV digests'
// end-to-end test (tests/e2e/test_faults.py) must catch: with it set to 1,
// a decode's worker damages the READ of each request whose id contains
// kvfault-flip (one bit of a block read flips after the READ), kvfault-tail
// (the last block is left out of the READ: a transfer's tail that never
// landed) or kvfault-late (the prefill is told the blocks were read, so it
// frees them, and the READ follows lateFaultDelay seconds later, past the
// lease checks: a READ of reassigned blocks). Never active unless set; a
// worker that has it says so when it starts.
const EnvKVFault = "GONIXL_TEST_KV_FAULT"

type kvFault int

const (
	faultNone kvFault = iota
	faultFlip
	faultTail
	faultLate
)

// lateFaultDelay is how long a kvfault-late READ waits after it let the
// prefill free the blocks (the test sends other prompts meanwhile).
const lateFaultDelay = 10.0

func kvFaultsFromEnv(log *zap.Logger) bool {
	if os.Getenv(EnvKVFault) != "1" {
		return false
	}
	log.Warn(EnvKVFault + "=1: test fault injection is on; READs of requests named kvfault-flip, kvfault-tail or kvfault-late are damaged on purpose")
	return true
}

// kvFaultFor is the fault to inject into request id's READ.
func (w *Worker) kvFaultFor(id string) kvFault {
	if !w.kvFaults {
		return faultNone
	}
	switch {
	case strings.Contains(id, "kvfault-flip"):
		return faultFlip
	case strings.Contains(id, "kvfault-tail"):
		return faultTail
	case strings.Contains(id, "kvfault-late"):
		return faultLate
	}
	return faultNone
}

// lateFaultLocked holds a kvfault-late READ back: the first time it tells
// the prefill the blocks were read; true while the READ must wait.
func (w *Worker) lateFaultLocked(st *recvState, re *remoteEngine, notif []byte) bool {
	now := w.clock()
	if st.lateAt == 0 {
		st.lateAt = now + lateFaultDelay
		w.notifyRanksLocked(st, re, notif, nil, "")
		w.log.Warn("test fault kvfault-late: told the prefill its blocks were read; reading them later", zap.String("request_id", st.id), zap.Float64("seconds", lateFaultDelay))
	}
	if now < st.lateAt {
		w.deferReadLocked(st)
		return true
	}
	return false
}

// tailFault leaves the last block of the last group out of a READ.
func tailFault(local, remote BlockIDs) (BlockIDs, BlockIDs) {
	for g := len(local) - 1; g >= 0; g-- {
		if n := len(local[g]); n > 1 {
			l, r := append(BlockIDs(nil), local...), append(BlockIDs(nil), remote...)
			l[g], r[g] = local[g][:n-1], remote[g][:n-1]
			return l, r
		}
	}
	return local, remote
}

// flipFaultLocked flips a bit of the first token of the first block st read.
func (w *Worker) flipFaultLocked(st *recvState) {
	for _, g := range st.meta.LocalBlockIDs {
		if len(g) > 0 {
			r := w.layout.Regions[0]
			memhash.FlipBit(r.Base + uint64(g[0])*r.Stride)
			w.log.Warn("test fault kvfault-flip: flipped a bit of a block read", zap.String("request_id", st.id), zap.Int64("local_block", g[0]))
			return
		}
	}
}
