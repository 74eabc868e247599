package sidechannel

import "time"

var clockEpoch = time.Now()

// MonotonicSeconds is the default clock of listeners and clients: seconds on
// Go's monotonic clock since this package was initialised. Like Python's
// time.perf_counter, which vLLM's listener sends, its values are comparable
// only within one process; whoever stamps remote_blocks_expiry_time must use
// the same clock as the listener (ListenerConfig.Clock).
func MonotonicSeconds() float64 { return time.Since(clockEpoch).Seconds() }
