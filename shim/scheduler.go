package shim

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/gonixl/gonixl/shim/kvwire"
	"github.com/gonixl/gonixl/sidechannel"
)

// Scheduler is the scheduler-side connector state of one engine (vLLM's
// NixlPullConnectorScheduler). It lives in the EngineCore process and owns
// the side-channel listener.
type Scheduler struct {
	cfg   *Config
	clock Clock
	// wall is the Unix time in seconds (tests replace it): a decode's
	// params carry the wall-clock end of its blocks' TTL, comparable across
	// processes and (NTP-synchronised) hosts, unlike clock.
	wall func() float64
	log  *zap.Logger

	mu     sync.Mutex
	closed bool
	// preemptionsDeferred counts has_pending_block_frees answered true
	// (push_sched.go; gonixl_scheduler_preemptions_deferred_total).
	preemptionsDeferred int64
	reqsNeedRecv        map[string]*RecvReq
	reqsNeedRecvOrder   []string
	reqsNeedSend        map[string]float64
	reqsInBatch         map[string]struct{}
	reqsNotProcessed    map[string]struct{}
	hbByEngine          map[string]*hbTarget
	hbReqEngine         map[string][2]string // local req id -> (engine, remote req id)
	pushs               *pushSched           // push mode (push_sched.go)
	lastHeartbeat       float64
	hbInterval          float64
	listener            *sidechannel.Listener
	served              servedDigests // a decode's read-back digests (kvdigest_serve.go)
	// instance: this scheduler process's random id, in the params it makes
	// and in the handshake metadata it serves (kvwire.KeyInstance).
	instance string
	reg      *prometheus.Registry // live gauges
}

type hbTarget struct {
	info   HeartbeatInfo
	ids    map[string]struct{}
	expiry map[string]float64
}

// NewScheduler validates cfg and creates the scheduler side. clock may be
// nil (monotonic clock).
func NewScheduler(cfg *Config, clock Clock) (_ *Scheduler, err error) {
	defer classify(&err, ErrInvalidInput) // a side-channel address that cannot be bound is the configuration's
	if cfg.Role != RoleScheduler {
		return nil, errRole(cfg.Role, RoleScheduler)
	}
	if clock == nil {
		clock = MonotonicClock
	}
	s := &Scheduler{
		cfg:              cfg,
		clock:            clock,
		wall:             func() float64 { return float64(time.Now().UnixNano()) / 1e9 },
		log:              Logger().With(zap.String("role", "scheduler"), zap.String("engine_id", cfg.EngineID)),
		reqsNeedRecv:     map[string]*RecvReq{},
		reqsNeedSend:     map[string]float64{},
		reqsInBatch:      map[string]struct{}{},
		reqsNotProcessed: map[string]struct{}{},
		hbByEngine:       map[string]*hbTarget{},
		hbReqEngine:      map[string][2]string{},
		pushs:            newPushSched(),
		instance:         randomSuffix(),
		// vLLM: kv_lease_duration // 6 (integer seconds).
		hbInterval: float64(int(cfg.KVLeaseDuration) / 6),
	}
	if cfg.KVRole == "kv_both" {
		s.log.Warn("kv_role=kv_both is deprecated: set kv_producer on prefill instances and kv_consumer on decode instances")
	}
	s.log.Info("scheduler started",
		zap.String("kv_role", cfg.KVRole),
		zap.Float64("kv_lease_duration", cfg.KVLeaseDuration),
		zap.String("side_channel", fmt.Sprintf("%s:%d", cfg.SideChannelHost, cfg.SideChannelPort+cfg.DPIndex)))
	s.reg = newSchedulerRegistry(cfg.EngineID, s.Live)
	serveMetrics(cfg, s.reg, false, s.log)
	return s, nil
}

// OnNewRequest starts heartbeat tracking for a decode request that waits
// for a remote prefill's KV (vLLM's on_new_request).
func (s *Scheduler) OnNewRequest(reqID string, p *TransferParams) {
	if p == nil || !p.DoRemotePrefill || !p.HasHeartbeatTarget() {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.hbByEngine[p.RemoteEngineID]
	if !ok {
		t = &hbTarget{
			info:   HeartbeatInfo{Host: p.RemoteHost, Port: p.RemotePort, TPSize: p.TPSize, DCPSize: p.DCPSize, PPSize: p.PPSize},
			ids:    map[string]struct{}{},
			expiry: map[string]float64{},
		}
		s.hbByEngine[p.RemoteEngineID] = t
	}
	t.ids[p.RemoteRequestID] = struct{}{}
	if p.RemoteExpiry != nil {
		t.expiry[p.RemoteRequestID] = *p.RemoteExpiry
	}
	s.hbReqEngine[reqID] = [2]string{p.RemoteEngineID, p.RemoteRequestID}
}

func (s *Scheduler) stopHeartbeatLocked(reqID string) {
	key, ok := s.hbReqEngine[reqID]
	if !ok {
		return
	}
	delete(s.hbReqEngine, reqID)
	if t, ok := s.hbByEngine[key[0]]; ok {
		delete(t.ids, key[1])
		delete(t.expiry, key[1])
		if len(t.ids) == 0 {
			delete(s.hbByEngine, key[0])
		}
	}
}

// GetNumNewMatchedTokens returns how many prompt tokens can be loaded from
// the remote engine beyond numComputed, and whether loading is asynchronous.
func (s *Scheduler) GetNumNewMatchedTokens(p *TransferParams, numPromptTokens, numComputed int64) (int64, bool) {
	if p == nil {
		return 0, false
	}
	if p.DoRemotePrefill && s.push() {
		// Push: the prefill WRITEs into blocks allocated here, whether or
		// not it has finished yet; no remote block ids are needed.
		if !p.UsableEndpoint() || !p.HasTPSize() || p.RemoteRequestID == "" {
			s.log.Warn("push: do_remote_prefill without remote_engine_id, remote_request_id, remote_host, remote_port and tp_size: computing the prompt locally",
				zap.Bool("endpoint", p.UsableEndpoint()), zap.Bool("tp_size", p.HasTPSize()))
			return 0, false
		}
		if count := numPromptTokens - numComputed; count > 0 {
			return count, true
		}
		return 0, false
	}
	if p.DoRemotePrefill {
		if !readable(p) {
			// Nothing can be pulled (a broken proxy, or a prefill that kept
			// no blocks): compute locally rather than wait for KV that no
			// one will send.
			s.log.Warn("do_remote_prefill without usable remote_block_ids / remote endpoint: computing the prompt locally",
				zap.Bool("remote_block_ids", p.HasRemoteBlocks), zap.Bool("endpoint", p.HasRemoteEndpoint()))
			return 0, false
		}
		if p.RemoteNumTokens > 0 && p.RemoteNumTokens != numPromptTokens {
			// The prefill computed another number of tokens than this
			// prompt has: its blocks cannot hold this prompt's KV (a proxy
			// that mixed requests up, or a client's forged parameters).
			// Compute locally; the prefill is told to free its blocks.
			s.log.Warn("kv_transfer_params: remote_num_tokens differs from this prompt's length: computing the prompt locally",
				zap.Int64("remote_num_tokens", p.RemoteNumTokens), zap.Int64("prompt_tokens", numPromptTokens))
			return 0, false
		}
		// No prefill back-off: gonixl serves attention-only models (no
		// Mamba, no multi-token-prediction lookahead).
		if count := numPromptTokens - numComputed; count > 0 {
			return count, true
		}
	}
	if s.readbackable(p) {
		// Bidirectional: the prefill pulls the previous turn's KV back from
		// the decode that holds it.
		remote := p.RemoteNumTokens
		if remote > numPromptTokens {
			remote = numPromptTokens
		}
		if p.ExpiryUnix > 0 && s.wall()+readbackMargin >= p.ExpiryUnix {
			// The decode's TTL on these blocks has run out (or ends before
			// a READ could be trusted to finish): its blocks may hold
			// another request's KV by now. Compute the prompt here rather
			// than wait for a READ the worker would decline.
			s.log.Info("the decode's blocks of this conversation expired (decoder_kv_blocks_ttl): computing the whole prompt",
				zap.String("remote_engine_id", p.RemoteEngineID), zap.String("remote_request_id", p.RemoteRequestID),
				zap.Float64("expired_seconds_ago", s.wall()-p.ExpiryUnix))
			return 0, false
		}
		if p.ReadbackTokens >= 0 && remote > p.ReadbackTokens {
			// The prompt differs from the decode's tokens past this point
			// (an edited history): KV beyond it was computed from other
			// tokens and must not be used.
			remote = p.ReadbackTokens
		}
		if remote < p.RemoteNumTokens && s.hasSlidingWindow() {
			// A sliding-window group's remote list holds only the blocks
			// in the window before the decode's last token; a pull that
			// ends earlier would take them for other positions. Compute.
			return 0, false
		}
		if count := remote - numComputed; count > 0 {
			if th := int64(s.cfg.KVRecomputeThreshold); th > 0 && count < th {
				return 0, false
			}
			return count, true
		}
	}
	return 0, false
}

// readable reports whether p names remote blocks that a READ can fetch:
// blocks, a usable endpoint and the remote request id the READ's
// notification names. GetNumNewMatchedTokens answers "async" only for such
// params, and UpdateStateAfterAlloc schedules the READ for exactly those:
// a request told to wait whose READ is never scheduled would wait in
// WAITING_FOR_REMOTE_KVS for ever, holding its blocks.
func readable(p *TransferParams) bool {
	return p.HasRemoteBlocks && p.UsableEndpoint() && p.RemoteRequestID != ""
}

// readbackable reports whether p, a decode's params given to this
// prefill, can be read back (bidirectional_kv_xfer): see readable.
func (s *Scheduler) readbackable(p *TransferParams) bool {
	return p.DoRemoteDecode && s.cfg.BidirectionalKVXfer && !p.BlocksProcessed && readable(p)
}

// push reports whether this engine runs vLLM's push protocol.
func (s *Scheduler) push() bool { return s.cfg.TransferMode == "push" }

// readbackMargin: a bidirectional pull is not started with less than this
// left of the decode's TTL (vLLM declines a turn-2 READ at the same margin).
const readbackMargin = 5.0

// hasSlidingWindow reports whether a transfer group is a sliding
// window (its remote block lists are clipped to the window).
func (s *Scheduler) hasSlidingWindow() bool {
	for _, g := range s.cfg.TransferGroups {
		if g.SlidingWindow > 0 {
			return true
		}
	}
	return false
}

// UpdateStateAfterAlloc records the local blocks allocated for a request.
// localBlocks are the unhashed (new) block ids per group, empty when no
// external tokens are loaded. It returns true when the caller must mirror
// vLLM's parameter update (do_remote_prefill=False,
// _remote_blocks_processed=True) on the request's kv_transfer_params.
func (s *Scheduler) UpdateStateAfterAlloc(reqID string, p *TransferParams, localBlocks BlockIDs, localNumComputed []int64, numExternal int64) (_ bool, err error) {
	defer classify(&err, ErrInvalidInput)
	if p == nil {
		return false, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if p.DoRemoteDecode || (p.DoRemotePrefill && s.cfg.BidirectionalKVXfer) {
		s.reqsInBatch[reqID] = struct{}{}
	}
	if !(p.DoRemotePrefill || (p.DoRemoteDecode && s.cfg.BidirectionalKVXfer && !p.BlocksProcessed)) {
		return false, nil
	}
	if p.DoRemotePrefill && s.push() {
		// Push: register the newly allocated blocks with the prefill
		// (the worker sends PUSH_REG once it has handshaken).
		if numExternal > 0 && p.UsableEndpoint() && p.HasTPSize() && p.RemoteRequestID != "" {
			s.addRecvLocked(reqID, &RecvReq{
				LocalBlockIDs:    clipToWindow(localBlocks, s.cfg.TransferGroups, s.cfg.HMARequired),
				LocalNumComputed: localNumComputed,
				TPSize:           p.TPSize,
				DCPSize:          p.DCPSize,
				PPSize:           p.PPSize,
				AwaitingKVs:      true,
				Push:             true,
				PromptDigest:     p.PromptDigest,
				Remote:           RemoteMeta{Host: p.RemoteHost, Port: p.RemotePort, EngineID: p.RemoteEngineID, RequestID: p.RemoteRequestID},
			})
			s.pushs.waiting[reqID] = struct{}{}
		}
		return true, nil
	}
	if p.HasRemoteBlocks {
		if !readable(p) {
			s.log.Warn("invalid kv_transfer_params: this request will not use KV transfer",
				zap.String("req_id", reqID), zap.String("reason", "remote_engine_id, remote_request_id, remote_host and remote_port (1-65535) are required"))
		} else {
			if numExternal <= 0 {
				localBlocks = nil
			}
			localBlocks = clipToWindow(localBlocks, s.cfg.TransferGroups, s.cfg.HMARequired)
			rr := &RecvReq{
				LocalBlockIDs:    localBlocks,
				LocalNumComputed: localNumComputed,
				TPSize:           p.TPSize,
				DCPSize:          p.DCPSize,
				PPSize:           p.PPSize,
				RemoteBlockSize:  p.RemoteBlockSize,
				AwaitingKVs:      numExternal > 0,
				Readback:         !p.DoRemotePrefill,
				Remote: RemoteMeta{
					BlockIDs:  p.RemoteBlockIDs,
					Host:      p.RemoteHost,
					Port:      p.RemotePort,
					EngineID:  p.RemoteEngineID,
					RequestID: p.RemoteRequestID,
					Expiry:    p.RemoteExpiry,
					NumTokens: p.RemoteNumTokens,
					Instance:  p.Instance,
					Digest:    s.digestFor(reqID, p),
					// A read-back's digests come from the decode's side
					// channel (kvdigest_serve.go).
					DigestServed: !p.DoRemotePrefill && p.KVDigestServed && s.cfg.KVDigest != KVDigestOff,
				},
			}
			s.addRecvLocked(reqID, rr)
		}
	} else if numExternal != 0 {
		return false, fmt.Errorf("request %s: %d external tokens but kv_transfer_params has no remote_block_ids", reqID, numExternal)
	}
	return true, nil
}

func (s *Scheduler) addRecvLocked(reqID string, rr *RecvReq) {
	if _, ok := s.reqsNeedRecv[reqID]; !ok {
		s.reqsNeedRecvOrder = append(s.reqsNeedRecvOrder, reqID)
	}
	s.reqsNeedRecv[reqID] = rr
}

// BuildMeta returns this step's encoded metadata for the workers and resets
// the per-step state.
func (s *Scheduler) BuildMeta() ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.clock()
	m := &StepMeta{
		ReqsToRecv:       make(map[string]*RecvReq, len(s.reqsNeedRecv)),
		ReqsToSend:       s.reqsNeedSend,
		SchedulerClock:   now,
		ReqsInBatch:      sortedKeys(s.reqsInBatch),
		ReqsNotProcessed: sortedKeys(s.reqsNotProcessed),
	}
	for _, id := range s.reqsNeedRecvOrder {
		m.ReqsToRecv[id] = s.reqsNeedRecv[id]
	}
	s.pushs.fill(m)
	if len(s.hbByEngine) > 0 && now-s.lastHeartbeat >= s.hbInterval {
		s.lastHeartbeat = now
		m.Heartbeats = make(map[string]*HeartbeatInfo, len(s.hbByEngine))
		for eng, t := range s.hbByEngine {
			info := t.info
			info.ReqIDs = sortedKeys(t.ids)
			if len(t.expiry) > 0 {
				info.Expiry = make(map[string]float64, len(t.expiry))
				for id, e := range t.expiry {
					info.Expiry[id] = e
				}
			}
			m.Heartbeats[eng] = &info
		}
	}
	b, err := m.Encode()
	if err != nil {
		return nil, err
	}
	s.reqsNeedRecv = map[string]*RecvReq{}
	s.reqsNeedRecvOrder = nil
	s.reqsNeedSend = map[string]float64{}
	s.reqsInBatch = map[string]struct{}{}
	s.reqsNotProcessed = map[string]struct{}{}
	return b, nil
}

// BuildMetaOrIdle is BuildMeta for the C ABI: nil for an idle step, one
// that carries no work while no timer is pending (no request awaits remote
// KV, none is held or in the batch, no heartbeat is scheduled). Every
// change of that comes from one of the scheduler calls vLLM makes, so the
// Python connector, given nil, skips the worker's call for the step and its
// own next ones until it makes such a call: an idle engine step then costs
// no call into the library (bench/timed_connector.py measured 40-50 µs per
// call inside vLLM's engine process, cold caches, against 1 µs here).
//
// A step whose only pending work is a heartbeat not yet due is idle too: its
// metadata would carry nothing but the clock (a decode holding requests
// whose blocks a prefill keeps for it sent one every step). IdleFor says
// when the heartbeat is due.
func (s *Scheduler) BuildMetaOrIdle() ([]byte, error) {
	s.mu.Lock()
	idle := s.noWorkLocked() && !s.heartbeatDueLocked(s.clock())
	s.mu.Unlock()
	if idle {
		return nil, nil
	}
	return s.BuildMeta()
}

// noWorkLocked: nothing for the workers but, maybe, heartbeats.
func (s *Scheduler) noWorkLocked() bool {
	return len(s.reqsNeedRecv) == 0 && len(s.reqsNeedSend) == 0 && len(s.reqsInBatch) == 0 && len(s.reqsNotProcessed) == 0 &&
		s.pushs.idle()
}

// heartbeatDueLocked: a heartbeat goes with the metadata built at now.
func (s *Scheduler) heartbeatDueLocked(now float64) bool {
	return len(s.hbByEngine) > 0 && now-s.lastHeartbeat >= s.hbInterval
}

// IdleFor is, after BuildMetaOrIdle answered an idle step, how many seconds
// the scheduler stays idle unless one of its other calls is made: until the
// next heartbeat is due, 0 when there is work now, and -1 when nothing is
// timed (idle until another call).
func (s *Scheduler) IdleFor() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.clock()
	switch {
	case !s.noWorkLocked() || s.heartbeatDueLocked(now):
		return 0
	case len(s.hbByEngine) == 0:
		return -1
	}
	return s.lastHeartbeat + s.hbInterval - now
}

// RequestFinished decides whether a finished request's blocks are freed now
// or held for a remote reader, and returns the kv_transfer_params for the
// request's output (JSON, nil for none). finishedNormally is true for
// FINISHED_LENGTH_CAPPED and FINISHED_STOPPED. numComputedTokens is the
// request's num_computed_tokens. blockIDs are the request's blocks per group.
func (s *Scheduler) RequestFinished(reqID string, p *TransferParams, finishedNormally bool, numComputedTokens int64, blockIDs BlockIDs) (_ bool, _ []byte, err error) {
	defer classify(&err, ErrInvalidInput)
	s.mu.Lock()
	defer s.mu.Unlock()
	if p == nil {
		return false, nil, nil
	}
	isP := p.DoRemoteDecode
	isD := !isP
	s.stopHeartbeatLocked(reqID)
	if _, ok := s.pushs.waiting[reqID]; ok {
		// Finished (aborted) while waiting for the prefill's WRITE: the
		// worker fails the wait now and asks the prefill to drop the
		// registration, instead of holding the blocks until
		// push_registration_timeout.
		delete(s.pushs.waiting, reqID)
		s.pushs.aborted = append(s.pushs.aborted, reqID)
	}
	if s.pushAnnouncedLocked(reqID) {
		// Its early WRITE may be reading its blocks (an abort after the
		// forward leaves whole KV): they are held as for any push send.
		finishedNormally = true
	}
	if p.DoRemotePrefill && s.push() {
		// Never registered (aborted before allocation): the prefill frees
		// its blocks at its lease, as vLLM's push connector does.
		return false, nil, nil
	}
	if p.DoRemotePrefill {
		// Aborted (or finished) before its KV was loaded: send the
		// notify-only message so the prefill frees its blocks now (when
		// there is a prefill to tell).
		if p.UsableEndpoint() {
			s.addRecvLocked(reqID, &RecvReq{
				TPSize: p.TPSize, DCPSize: p.DCPSize, PPSize: p.PPSize, RemoteBlockSize: p.RemoteBlockSize,
				Remote: RemoteMeta{BlockIDs: p.RemoteBlockIDs, Host: p.RemoteHost, Port: p.RemotePort,
					EngineID: p.RemoteEngineID, RequestID: p.RemoteRequestID, Expiry: p.RemoteExpiry, NumTokens: p.RemoteNumTokens},
			})
		}
		return false, nil, nil
	}
	if isD && !s.cfg.BidirectionalKVXfer {
		return false, nil, nil
	}
	if !finishedNormally {
		s.reqsNotProcessed[reqID] = struct{}{}
		return false, nil, nil
	}
	delay := !blockIDs.Empty()
	var remoteNumTokens int64
	var expiry, expiryUnix *float64
	if delay {
		ttl := s.cfg.KVLeaseDuration
		if isD {
			ttl = s.cfg.DecoderKVBlocksTTL
		}
		exp := s.clock() + ttl
		s.reqsNeedSend[reqID] = exp
		if isD {
			eu := s.wall() + ttl
			expiryUnix = &eu
		}
		// vLLM sends the expiry only for a decode's blocks (bidirectional
		// mode); gonixl also sends the prefill's, so that a gonixl decode can
		// refuse KV whose lease lapsed before the READ completed instead of
		// using blocks the prefill may already have reused.
		expiry = &exp
		remoteNumTokens = numComputedTokens
	}
	if blockIDs == nil {
		blockIDs = BlockIDs{}
	}
	if delay {
		blockIDs = trimToTokens(blockIDs, s.cfg.TransferGroups, int64(s.cfg.BlockSize), remoteNumTokens)
	}
	blockIDs = clipToWindow(blockIDs, s.cfg.TransferGroups, s.cfg.HMARequired)
	out := kvwire.OutParams{
		DoRemotePrefill: isP,
		DoRemoteDecode:  isD,
		RemoteBlockIDs:  blockIDs,
		RemoteEngineID:  s.cfg.EngineID,
		RemoteRequestID: reqID,
		RemoteHost:      s.cfg.SideChannelHost,
		RemotePort:      s.cfg.SideChannelPort + s.cfg.DPIndex,
		TPSize:          s.cfg.TPSize,
		DCPSize:         1,
		PPSize:          s.cfg.PPSize,
		RemoteNumTokens: remoteNumTokens,
		RemoteExpiry:    expiry,
		ExpiryUnix:      expiryUnix,
		TransferMode:    s.cfg.TransferMode,
		Instance:        s.instance,
	}
	if isD && delay && s.cfg.KVDigestReadback {
		// The workers digest the held blocks in the next step; the
		// side channel serves the digests until the hold is over.
		out.KVDigestServed = true
		s.serveDigestLocked(reqID, s.cfg.DecoderKVBlocksTTL)
	}
	b, err := json.Marshal(out)
	if err != nil {
		return false, nil, err
	}
	if s.push() && isP {
		// The decode does not read: no expiry for it to check (vLLM's
		// push connector sends no such key). The worker WRITEs these
		// blocks once the decode registered its own.
		var m map[string]json.RawMessage
		if err := json.Unmarshal(b, &m); err != nil {
			return false, nil, err
		}
		delete(m, "remote_blocks_expiry_time")
		if b, err = json.Marshal(m); err != nil {
			return false, nil, err
		}
		if delay {
			s.pushs.finished[reqID] = &PushFinished{Blocks: blockIDs, PromptDigest: p.PromptDigest, Tokens: numComputedTokens}
		}
	}
	return delay, b, nil
}

// UpdateConnectorOutput stops heartbeats for requests whose KV arrived.
func (s *Scheduler) UpdateConnectorOutput(finishedRecving []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range finishedRecving {
		s.stopHeartbeatLocked(id)
		delete(s.pushs.waiting, id)
	}
}

// SetHandshakePayload serves a worker's encoded NixlHandshakePayload for
// (pp, tp) on the side channel, starting the listener on first use.
func (s *Scheduler) SetHandshakePayload(pp, tp int, payload []byte) (err error) {
	defer classify(&err, ErrInvalidInput)
	hp, err := sidechannel.DecodeHandshakePayload(payload)
	if err != nil {
		return fmt.Errorf("handshake payload for pp_rank=%d tp_rank=%d: %w", pp, tp, err)
	}
	if am, err := sidechannel.DecodeAgentMetadata(hp.AgentMetadataBytes); err == nil && am.Geometry != "" {
		// A gonixl worker's: served with this process's instance id.
		am.Instance = s.instance
		hp.AgentMetadataBytes = am.Encode()
		payload = hp.Encode()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("scheduler is closed")
	}
	if s.listener == nil {
		env, err := sidechannel.FromEnv(os.Getenv)
		if err != nil {
			return err
		}
		l, err := sidechannel.NewListener(sidechannel.ListenerConfig{
			Host:     s.cfg.SideChannelHost,
			BasePort: s.cfg.SideChannelPort,
			DPIndex:  s.cfg.DPIndex,
			Secret:   sidechannel.ResolveSecret(s.cfg.SideChannelSecret, env),
			Logger:   s.log,
			Clock:    s.clock,
			KVDigest: s.listenerDigests(),
		})
		if err != nil {
			return err
		}
		s.listener = l
		s.log.Info("side-channel listener started", zap.String("addr", l.Addr().String()))
	}
	return s.listener.SetPayload(pp, tp, payload)
}

// Close stops the listener. Idempotent.
func (s *Scheduler) Close() error {
	s.mu.Lock()
	l := s.listener
	s.listener = nil
	s.closed = true
	s.mu.Unlock()
	unserveMetrics(s.reg)
	if l != nil {
		return l.Stop()
	}
	return nil
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// digestFor is the KV digest a decode's worker checks the READ of reqID
// against: the params' gonixl_kv_digest, unless kv_digest is off here or
// the digests were malformed (then read unchecked, and said so).
func (s *Scheduler) digestFor(reqID string, p *kvwire.TransferParams) *kvwire.KVDigest {
	if s.cfg.KVDigest == KVDigestOff || !p.DoRemotePrefill {
		return nil
	}
	if p.KVDigestErr != nil {
		s.log.Warn("kv_transfer_params carry malformed KV digests; the request's KV is read unchecked", zap.String("request_id", reqID), zap.Error(p.KVDigestErr))
		return nil
	}
	return p.KVDigest
}
