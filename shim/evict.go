package shim

import (
	"sort"

	"go.uber.org/zap"
)

// engine_ttl (kv_connector_extra_config, default 3600 s): a remote engine
// this worker has not used for engine_ttl seconds is evicted — its prepared
// descriptor list released and its agent invalidated (dropRemoteLocked) — so
// that the worker does not hold the state of every prefill it ever talked
// to, and the next request for it handshakes again. engine_ttl <= 0 turns
// eviction off. As vLLM's NixlConnector (base_worker.py _evict_stale_engines,
// _engine_last_active):
//
//   - "used" is stamped when a READ or a notify-only completion is issued to
//     the engine (readLocked, as pull_worker.py _read_blocks_for_req), when a
//     heartbeat is sent to it (sendHeartbeatsLocked, stamped before sending,
//     as _send_heartbeats) and when a handshake with it completes
//     (finishHandshake, as _ensure_handshake's done callback). The stamp is
//     not refreshed while a READ runs, nor when it completes.
//   - an engine is evicted once now - last use > engine_ttl, unless it is
//     busy: a READ of a request is still in flight from it (vLLM's
//     _engines_with_inflight_transfers), or a request waits for a handshake
//     with it (gonixl keeps the working connection while it handshakes the
//     engine at another address; vLLM's pending handshakes have no stamp).
//
// Where gonixl differs: vLLM sweeps only when _ensure_handshake runs (a
// heartbeat, or a request for an engine it has no agent for), so an idle
// decode that gets no new engine never frees anything, and an engine that
// went stale is evicted just before it is used again. gonixl sweeps on every
// get_finished (each engine step): an idle engine is freed within one step
// of its TTL, whether or not another engine shows up, and a request that
// arrives in the step between the TTL passing and the sweep uses the
// still-loaded agent instead of handshaking again.

// touchRemoteLocked records a use of re (engine_ttl).
func (w *Worker) touchRemoteLocked(re *remoteEngine) {
	re.lastUsed = w.clock()
}

// evictIdleRemotesLocked evicts the remote engines idle for more than
// engine_ttl. It runs on every get_finished: O(number of remotes) when none
// is idle, plus one pass over the requests being received when one is.
func (w *Worker) evictIdleRemotesLocked() {
	ttl := w.cfg.EngineTTL
	if ttl <= 0 || len(w.remotes) == 0 {
		return
	}
	now := w.clock()
	var idle []*remoteEngine
	for _, re := range w.remotes {
		if now-re.lastUsed > ttl {
			idle = append(idle, re)
		}
	}
	if len(idle) == 0 {
		return
	}
	busy := w.busyRemotesLocked()
	sort.Slice(idle, func(i, j int) bool { return idle[i].id < idle[j].id })
	for _, re := range idle {
		if busy[re.id] {
			continue
		}
		if w.dropRemoteLocked(re) {
			w.log.Info("evicted idle remote engine; it will be re-handshaken on next use",
				zap.String("remote_engine_id", re.id), zap.Float64("idle_seconds", now-re.lastUsed),
				zap.Float64("engine_ttl", ttl))
		}
	}
}

// busyRemotesLocked returns the ids of the remote engines that must not be
// evicted: a READ from them is in flight, a request waits for a handshake
// with them, a push wait holds blocks they may write (push_recv.go), or a
// push of this prefill writes or is about to write to them.
func (w *Worker) busyRemotesLocked() map[string]bool {
	busy := map[string]bool{}
	for _, st := range w.recv {
		if len(st.xfers) > 0 || st.waiting || (st.push != nil && st.push.state != pushDone) {
			busy[st.meta.Remote.EngineID] = true
		}
	}
	for _, ps := range w.push.sends {
		if ps.reg != nil && ps.state != sendUnmatched {
			busy[ps.reg.DecodeEngineID] = true
		}
	}
	return busy
}
