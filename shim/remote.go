// Remote engines: handshakes over the side channel, the peers they
// produce, and dropping a peer that failed or stopped answering. Both sides
// use them (a decode reads from its remotes; a prefill's workers never
// handshake, they only answer).

package shim

import (
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/sidechannel"
)

type remoteEngine struct {
	id        string
	agent     string
	list      nixl.DescList
	numBlocks int64
	regions   int
	offset    float64       // remote clock - local clock
	rtt       time.Duration // of the sample the offset came from: its error bound
	host      string        // side-channel address it was handshaken at
	port      int
	lastUsed  float64 // this worker's clock: last READ, notification, heartbeat or handshake (engine_ttl, evict.go)
}

type handshakeState struct {
	waiting []string // request ids waiting for this engine
}

// hsKey identifies a handshake: an engine at one address (a request may
// name a known engine at another address; that handshake must not disturb
// the working one).
func hsKey(engineID, host string, port int) string {
	return fmt.Sprintf("%s@%s:%d", engineID, host, port)
}

func (w *Worker) startHandshakeLocked(engineID, host string, port, remoteTP int, reqID string) {
	key := hsKey(engineID, host, port)
	hsState, running := w.handshakes[key]
	if running {
		if reqID != "" {
			hsState.waiting = append(hsState.waiting, reqID)
		}
		return
	}
	if err := w.admitHandshakeLocked(key); err != nil {
		// Refused before any network work: fail the request now.
		if st, ok := w.recv[reqID]; ok && st.waiting {
			st.waiting = false
			w.stats.RecordFailedHandshake()
			w.failLocked(st, "handshake_failed", fmt.Sprintf("engine %s at %s:%d", engineID, host, port), err)
		}
		return
	}
	hsState = &handshakeState{}
	if reqID != "" {
		hsState.waiting = append(hsState.waiting, reqID)
	}
	w.handshakes[key] = hsState
	// A panic on the handshake goroutine fails the requests waiting for
	// it instead of killing vLLM's process.
	onPanic := func(err error) { w.finishHandshake(engineID, host, port, nil, err) }
	if remoteTP != w.cfg.TPSize {
		w.goSafe("handshake with "+key, onPanic, func() {
			w.finishHandshake(engineID, host, port, nil, fmt.Errorf("remote engine has tp_size=%d, this engine %d: heterogeneous TP is not supported", remoteTP, w.cfg.TPSize))
		})
		return
	}
	hs, rank := w.hs, sidechannel.Rank{PP: w.cfg.PPRank, TP: w.cfg.TPRank}
	deadline := time.Now().Add(time.Duration(w.cfg.HandshakeTimeout * float64(time.Second)))
	w.goSafe("handshake with "+key, onPanic, func() {
		// A busy or just-starting peer can miss one query's receive
		// timeout; retry transient failures until handshake_timeout, never
		// a compatibility or identity mismatch, nor a refused connection
		// (nothing listens there: its requests fail now, not in 30 s).
		for attempt := 1; ; attempt++ {
			f := hs.Start(host, port, engineID, rank)
			<-f.Done()
			res, err := f.Result()
			if err == nil || !retryableHandshake(err) || time.Now().Add(250*time.Millisecond).After(deadline) {
				w.finishHandshake(engineID, host, port, res, err)
				return
			}
			w.log.Warn("handshake attempt failed; retrying", zap.String("remote_engine_id", engineID), zap.Int("attempt", attempt), zap.Error(err))
			time.Sleep(250 * time.Millisecond)
		}
	})
}

func retryableHandshake(err error) bool {
	if errors.Is(err, sidechannel.ErrCompatMismatch) || errors.Is(err, sidechannel.ErrEngineMismatch) || errors.Is(err, sidechannel.ErrClosed) ||
		errors.Is(err, sidechannel.ErrRefused) {
		return false
	}
	var re *sidechannel.RemoteError
	return !errors.As(err, &re)
}

// finishHandshake runs on the handshake goroutine: it loads the remote
// agent and posts the READs that waited for it, or fails them.
func (w *Worker) finishHandshake(engineID, host string, port int, res *sidechannel.Result, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	key := hsKey(engineID, host, port)
	hsState := w.handshakes[key]
	if w.closed {
		delete(w.handshakes, key)
		return
	}
	var re *remoteEngine
	if err == nil {
		re, err = w.addRemoteLocked(engineID, host, port, res)
	}
	if err != nil {
		w.stats.RecordFailedHandshake()
		w.logFailure("handshake_failed", nil, fmt.Sprintf("engine %s at %s:%d", engineID, host, port), err)
		if !errors.Is(err, errPanicked) {
			w.hsGuard.failed(key, err) // a bug is not the peer's failure
		}
	} else {
		w.hsGuard.succeeded(key)
		w.touchRemoteLocked(re)
		w.log.Info("handshake done", zap.String("remote_engine_id", engineID), zap.String("remote_agent", re.agent),
			zap.Float64("clock_offset", re.offset), zap.Duration("rtt", res.BestRTT))
		if ei, ok := w.agent.(nixl.EndpointDescriber); ok && !w.loggedLanes {
			// Which transports UCX picked: a misconfiguration (TCP where
			// shared memory was expected) is visible here.
			w.loggedLanes = true
			w.log.Info("transport lanes of the first endpoint", zap.String("lanes", ei.EndpointInfo()))
		}
	}
	// Removed only now: after a panic above, the entry is still here and
	// the recovery fails its waiting requests.
	delete(w.handshakes, key)
	if hsState == nil {
		return
	}
	for _, id := range hsState.waiting {
		st, ok := w.recv[id]
		if !ok || !st.waiting {
			continue
		}
		st.waiting = false
		if err != nil {
			w.failLocked(st, "handshake_failed", "", err)
			continue
		}
		w.readLocked(st)
	}
}

func (w *Worker) addRemoteLocked(engineID, host string, port int, res *sidechannel.Result) (*remoteEngine, error) {
	rank := sidechannel.Rank{PP: w.cfg.PPRank, TP: w.cfg.TPRank}
	md, ok := res.Agents[rank]
	if !ok || md == nil {
		return nil, fmt.Errorf("remote engine %s returned no metadata for pp_rank %d tp_rank %d", engineID, rank.PP, rank.TP)
	}
	if md.NumBlocks <= 0 || md.NumBlocks > 1<<31 {
		return nil, fmt.Errorf("remote engine %s advertises num_blocks=%d", engineID, md.NumBlocks)
	}
	if err := checkRemoteLayout(w.layout, w.blockSize, w.kvLayout, w.attnBackend, w.geometryOf(w.layout), md); err != nil {
		return nil, fmt.Errorf("remote engine %s (pp_rank %d, tp_rank %d) cannot exchange KV with this engine: it %w", engineID, rank.PP, rank.TP, err)
	}
	strides := md.BlockStrides
	name, err := w.agent.LoadRemoteMetadata(md.AgentMetadata)
	if err != nil {
		return nil, fmt.Errorf("load remote agent metadata: %w", err)
	}
	regs := make([]Region, len(md.KVCachesBaseAddr))
	for i := range regs {
		regs[i] = Region{Base: md.KVCachesBaseAddr[i], Len: uint64(md.BlockLens[i]), Stride: uint64(strides[i]), Group: w.layout.Regions[i].Group}
	}
	// The engine checks every descriptor against the regions the peer
	// registered: a lying peer gets an error here, not a wild read.
	list, err := w.agent.PrepDescList(name, w.layout.Mem, layoutDescs(regs, md.NumBlocks, uint64(md.DeviceID)))
	if err != nil {
		_ = w.agent.InvalidateRemote(name)
		return nil, fmt.Errorf("prepare remote descriptors: %w", err)
	}
	if old, ok := w.remotes[engineID]; ok {
		_ = old.list.Release()
		if old.agent != name {
			_ = w.agent.InvalidateRemote(old.agent)
		}
	}
	re := &remoteEngine{id: engineID, agent: name, list: list, numBlocks: md.NumBlocks, regions: len(regs),
		offset: res.ClockOffset, rtt: res.BestRTT, host: host, port: port}
	w.remotes[engineID] = re
	return re, nil
}

// dropRemoteOnDisconnect forgets a remote engine whose peer is gone, so the
// next request re-handshakes (a restarted prefill gets a fresh agent).
func (w *Worker) dropRemoteOnDisconnect(re *remoteEngine, err error) {
	if !errors.Is(err, nixl.ErrRemoteDiscon) {
		return
	}
	if w.dropRemoteLocked(re) {
		w.log.Warn("remote engine disconnected; it will be re-handshaken on next use", zap.String("remote_engine_id", re.id))
	}
}

// dropRemoteLocked forgets a remote engine (its prepared list and agent),
// so the next request for it handshakes again. Transfers still in flight
// keep their own references and finish or fail on their own.
func (w *Worker) dropRemoteLocked(re *remoteEngine) bool {
	cur, ok := w.remotes[re.id]
	if !ok || cur != re {
		return false
	}
	delete(w.remotes, re.id)
	_ = re.list.Release()
	_ = w.agent.InvalidateRemote(re.agent)
	return true
}
