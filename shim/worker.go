package shim

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/sidechannel"
)

// WorkerInit is what register_kv_caches hands over: the KV-cache tensors'
// geometry and the facts of the attention backend.
type WorkerInit struct {
	Layers        []LayerTensor `json:"layers"`
	NumBlocks     int64         `json:"num_blocks"`
	BlockSize     int64         `json:"block_size"`
	AttnBackend   string        `json:"attn_backend"`
	KVCacheLayout string        `json:"kv_cache_layout"`
}

// Finished is what get_finished reports for one step.
type Finished struct {
	Sending []string `json:"finished_sending"`
	Recving []string `json:"finished_recving"`
	Failed  []string `json:"failed_recving"`
}

// Worker is the worker-side connector state of one rank: the transfer
// agent, the registered KV cache, handshakes with remote engines, READs in
// flight, notifications and the prefill-side leases.
type Worker struct {
	cfg   *Config
	clock Clock
	log   *zap.Logger
	prom  *promMetrics
	stats *Stats

	mu             sync.Mutex
	closed         bool
	engine         nixl.Engine
	agent          nixl.Agent
	layout         *KVLayout
	localList      nixl.DescList
	payload        []byte
	compatHash     string
	hs             *sidechannel.Client
	blockSize      int64
	kvLayout       string
	attnBackend    string
	engineOverride nixl.Engine // tests: bypass Select
	loggedLanes    bool

	remotes     map[string]*remoteEngine
	handshakes  map[string]*handshakeState
	recv        map[string]*recvState
	done        Finished
	invalid     map[int64]struct{}
	toProcess   map[string]struct{}
	toSend      map[string]float64 // lease deadline, this worker's clock
	consumers   map[string]int
	leaseFloor  map[string]float64 // remote request id -> lower bound of its remote lease, local clock (from heartbeats)
	pendingFin  []byte
	leaseExtend float64
	leaseMargin float64 // leaseMarginFor(kv_lease_duration)
	panics      atomic.Int64
	stuckTotal  atomic.Int64 // handles ever held because release failed
	hsGuard     handshakeGuard
}

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

type recvState struct {
	id      string
	meta    *RecvReq
	xfers   []*inflight
	waiting bool // for a handshake
	failed  bool
	report  bool // vLLM tracks it in _recving_metadata
	// failedSent: failed_recving was reported (reportFailedLocked); with a
	// stuck handle that happens before finished_recving (holdStuckLocked).
	failedSent bool
	remote     *remoteEngine
}

type inflight struct {
	x        nixl.Xfer
	posted   float64 // this worker's clock
	deadline float64
	slow     bool // "still in flight" was logged
	// A handle the engine would not release (a READ it cannot cancel):
	// stuck is when that was first seen, nextTry the next attempt. Its
	// request is reported failed but not finished receiving until the
	// handle is released, so vLLM cannot reuse blocks the READ may still
	// write.
	stuck, nextTry float64
	stuckLogged    float64 // last time it was logged
}

// stuckRetry is the period of release attempts for a stuck handle, and
// stuckLogEvery how often one still stuck is logged again.
const (
	stuckRetry    = 1.0
	stuckLogEvery = 60.0
)

// slowReadAfter is how long a READ may stay in flight before the worker logs
// it (once, then again when it ends): READs take milliseconds, and a stall
// is otherwise invisible until transfer_timeout or the lease fails it.
const slowReadAfter = 5.0 // seconds

// NewWorker validates cfg and creates the worker side. clock may be nil.
// The transfer agent is created by RegisterKVCaches, when the memory type
// is known.
func NewWorker(cfg *Config, clock Clock) (*Worker, error) {
	if cfg.Role != RoleWorker {
		return nil, errRole(cfg.Role, RoleWorker)
	}
	if clock == nil {
		clock = MonotonicClock
	}
	prom := newPromMetrics(cfg.EngineID)
	w := &Worker{
		cfg:   cfg,
		clock: clock,
		log: Logger().With(zap.String("role", "worker"), zap.String("engine_id", cfg.EngineID),
			zap.Int("tp_rank", cfg.TPRank), zap.Int("pp_rank", cfg.PPRank)),
		prom:       prom,
		stats:      newStats(prom),
		remotes:    map[string]*remoteEngine{},
		handshakes: map[string]*handshakeState{},
		recv:       map[string]*recvState{},
		invalid:    map[int64]struct{}{},
		toProcess:  map[string]struct{}{},
		toSend:     map[string]float64{},
		consumers:  map[string]int{},
		leaseFloor: map[string]float64{},
		// vLLM: kv_lease_duration * 2 // 3
		leaseExtend: float64(int(cfg.KVLeaseDuration) * 2 / 3),
		leaseMargin: leaseMarginFor(cfg.KVLeaseDuration),
	}
	if cfg.KVLeaseDuration < 2 {
		w.log.Warn("kv_lease_duration is shorter than 2 s: a decode must start its READ within a quarter of it, so most transfers may be refused (kv_lease_expired) under load",
			zap.Float64("kv_lease_duration", cfg.KVLeaseDuration))
	}
	if w.leaseExtend <= 0 {
		w.leaseExtend = cfg.KVLeaseDuration * 2 / 3
	}
	prom.registerLive(cfg.EngineID, w.Live)
	serveMetrics(cfg, prom.reg, true, w.log)
	return w, nil
}

func randomSuffix() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// RegisterKVCaches registers the KV cache with a transfer agent and builds
// the handshake payload this rank serves.
func (w *Worker) RegisterKVCaches(init *WorkerInit) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return errors.New("worker is closed")
	}
	if w.agent != nil {
		return errors.New("register_kv_caches called twice")
	}
	layout, err := BuildLayout(init.Layers, init.NumBlocks)
	if err != nil {
		return err
	}
	if err := w.checkKVPlacement(layout, init); err != nil {
		return err
	}
	eng, why := w.engineOverride, "injected"
	if eng == nil {
		if eng, why, err = nixl.Select(w.cfg.TransferEngine, layout.Mem); err != nil {
			return fmt.Errorf("transfer engine %q: %w", w.cfg.TransferEngine, err)
		}
	}
	w.log.Info("transfer engine selected", zap.String("engine", eng.Name()), zap.String("why", why), zap.String("info", eng.Info()))
	agent, err := eng.NewAgent(nixl.AgentConfig{
		Name:           fmt.Sprintf("%s-pp%d-tp%d-%s", w.cfg.EngineID, w.cfg.PPRank, w.cfg.TPRank, randomSuffix()),
		Backends:       w.cfg.Backends,
		ProgressThread: true,
		ProgressDelay:  time.Duration(w.cfg.ProgressDelayUs) * time.Microsecond,
		NumThreads:     w.cfg.NumThreads,
		Telemetry:      true,
	})
	if err != nil {
		return fmt.Errorf("create transfer agent: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			_ = agent.Close()
		}
	}()
	if err := agent.RegisterMem(layout.Mem, layout.Storage); err != nil {
		return fmt.Errorf("register KV cache memory: %w", err)
	}
	list, err := agent.PrepDescList("", layout.Mem, layoutDescs(layout.Regions, layout.NumBlocks, layout.DeviceID))
	if err != nil {
		return fmt.Errorf("prepare local descriptors: %w", err)
	}
	md, err := agent.LocalMetadata()
	if err != nil {
		return fmt.Errorf("agent metadata: %w", err)
	}
	factors := map[string]any{}
	for k, v := range w.cfg.CompatFactors {
		factors[k] = plainJSON(v)
	}
	factors["attn_backend_name"] = init.AttnBackend
	factors["nixl_connector_version"] = sidechannel.NIXLConnectorVersion
	hash, hints, err := compatHashes(factors, eng.Name())
	if err != nil {
		return fmt.Errorf("compatibility hash: %w", err)
	}
	am := sidechannel.NewAgentMetadata()
	am.EngineID = w.cfg.EngineID
	am.AgentMetadata = md
	am.DeviceID = int64(layout.DeviceID)
	am.NumBlocks = layout.NumBlocks
	am.KVCacheLayout = init.KVCacheLayout
	am.BlockSize = init.BlockSize
	am.AttnBackendName = init.AttnBackend
	am.PhysicalBlocksPerLogicalKVBlock = 1
	fillRegionIdentity(am, layout)
	geom, err := json.Marshal(w.geometryOf(layout))
	if err != nil {
		return fmt.Errorf("kv geometry: %w", err)
	}
	am.Geometry = string(geom)
	payload := (&sidechannel.HandshakePayload{CompatibilityHash: hash, AgentMetadataBytes: am.Encode()}).Encode()

	env, err := sidechannel.FromEnv(os.Getenv)
	if err != nil {
		return err
	}
	w.hs = sidechannel.NewClient(sidechannel.ClientConfig{
		CompatHash:          hash,
		AllowCompatMismatch: !w.cfg.EnforceHandshakeCompat,
		CompatHints:         hints,
		Secret:              sidechannel.ResolveSecret(w.cfg.SideChannelSecret, env),
		Timeout:             time.Duration(w.cfg.HandshakeTimeout * float64(time.Second)),
		Clock:               w.clock,
		Logger:              w.log,
	})
	w.engine, w.agent, w.layout, w.localList = eng, agent, layout, list
	w.payload, w.compatHash = payload, hash
	w.blockSize, w.kvLayout, w.attnBackend = init.BlockSize, init.KVCacheLayout, init.AttnBackend
	ok = true
	var total uint64
	for _, s := range layout.Storage {
		total += s.Len
	}
	fields := []zap.Field{zap.Int("regions", len(layout.Regions)), zap.Int64("num_blocks", layout.NumBlocks),
		zap.Uint64("block_len", layout.Regions[0].Len), zap.Uint64("bytes", total), zap.String("mem", layout.Mem.String()),
		zap.String("compat_hash", hash)}
	if ai, ok := w.agent.(interface{ Info() string }); ok {
		// The agent's own settings (error handling, data path, shared regions).
		fields = append(fields, zap.String("agent", ai.Info()))
	}
	w.log.Info("KV cache registered", fields...)
	return nil
}

// HandshakePayload returns the encoded NixlHandshakePayload this rank
// serves through the scheduler's listener.
func (w *Worker) HandshakePayload() ([]byte, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.payload == nil {
		return nil, errors.New("no handshake payload before register_kv_caches")
	}
	return w.payload, nil
}

// StartLoadKV takes one step's metadata: posts READs (handshaking in the
// background first where needed), updates the prefill-side lease table and
// sends heartbeats. It never blocks on the network.
func (w *Worker) StartLoadKV(metaBytes []byte) error {
	m, err := DecodeStepMeta(metaBytes)
	if err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.agent == nil {
		if len(m.ReqsToRecv) > 0 {
			return errors.New("start_load_kv before register_kv_caches")
		}
		return nil
	}
	ids := make([]string, 0, len(m.ReqsToRecv))
	for id := range m.ReqsToRecv {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		rr := m.ReqsToRecv[id]
		if old, dup := w.recv[id]; dup && (old.waiting || len(old.xfers) > 0) {
			w.log.Warn("request is already loading; ignoring the second load", zap.String("req_id", id))
			continue
		}
		st := &recvState{id: id, meta: rr, report: rr.AwaitingKVs || !rr.LocalBlockIDs.Empty()}
		w.recv[id] = st
		w.readLocked(st)
	}
	for _, id := range m.ReqsInBatch {
		w.toProcess[id] = struct{}{}
	}
	for _, id := range m.ReqsNotProcessed {
		delete(w.toProcess, id)
		delete(w.toSend, id)
	}
	now := w.clock()
	for id, exp := range m.ReqsToSend {
		if _, ok := w.toProcess[id]; !ok {
			continue
		}
		if m.SchedulerClock != 0 {
			exp = now + (exp - m.SchedulerClock) // rebase to this worker's clock
		}
		w.toSend[id] = exp
	}
	w.sendHeartbeatsLocked(m.Heartbeats)
	return nil
}

// readLocked posts the READ for one request, or queues it behind a
// handshake. Failures are recorded on the request, never returned: one bad
// request must not stop the step.
func (w *Worker) readLocked(st *recvState) {
	rm := &st.meta.Remote
	if rm.EngineID == "" {
		w.stats.RecordFailedTransfer()
		w.failLocked(st, "transfer_setup_failed", "kv_transfer_params has no remote_engine_id", nil)
		return
	}
	re, ok := w.remotes[rm.EngineID]
	if ok && (re.host != rm.Host || re.port != rm.Port) {
		// The request names the engine at another address: a restarted
		// prefill that kept its engine_id, or a wrong (or forged) address.
		// The working connection stays until a handshake at the new address
		// succeeds with that same engine id; only then is it replaced.
		w.log.Info("request names a known remote engine at another address; handshaking there", zap.String("remote_engine_id", re.id),
			zap.String("known", fmt.Sprintf("%s:%d", re.host, re.port)), zap.String("requested", fmt.Sprintf("%s:%d", rm.Host, rm.Port)))
		ok = false
	}
	if !ok {
		st.waiting = true
		w.startHandshakeLocked(rm.EngineID, rm.Host, rm.Port, st.meta.TPSize, st.id)
		return
	}
	st.waiting = false
	st.remote = re
	w.touchRemoteLocked(re)
	notif := []byte(rm.RequestID + ":1")
	local, remote, err := w.pairBlocks(st.meta, re)
	if err != nil {
		w.stats.RecordFailedTransfer()
		w.failLocked(st, "transfer_setup_failed", err.Error(), nil)
		return
	}
	if len(local) == 0 {
		// Full local prefix hit or abort before scheduling: tell the
		// prefill it can free its blocks now.
		if err := w.agent.SendNotif(re.agent, notif); err != nil {
			w.stats.RecordFailedNotification()
			w.logFailure("notification_failed", st, "P worker blocks will be freed after timeout. This may indicate network issues.", err)
		}
		return
	}
	if left := w.leaseLeft(st); left < w.leaseMargin {
		// The remote's lease ends before a READ could safely complete.
		w.stats.RecordKVExpired()
		w.failLocked(st, "kv_lease_expired", fmt.Sprintf("the remote lease ends in %.1fs (< %.2gs safety margin; %s); not reading blocks the prefill may reuse",
			left, w.leaseMargin, w.leaseDetail(st)), nil)
		// Nothing will be read: let the prefill free the blocks now rather
		// than at its lease's end.
		if err := w.agent.SendNotif(re.agent, notif); err != nil {
			w.stats.RecordFailedNotification()
		}
		return
	}
	lidx := regionDescIDs(w.layout.Regions, w.layout.NumBlocks, local)
	ridx := regionDescIDs(w.layout.Regions, re.numBlocks, remote)
	x, err := w.agent.MakeXfer(nixl.Read, w.localList, lidx, re.list, ridx, notif)
	if err != nil {
		w.stats.RecordFailedTransfer()
		w.failLocked(st, "transfer_setup_failed", "", err)
		return
	}
	if _, err := x.Post(); err != nil {
		_ = x.Release()
		w.stats.RecordFailedTransfer()
		w.failLocked(st, "transfer_failed", "", err)
		w.dropRemoteOnDisconnect(re, err)
		return
	}
	now := w.clock()
	st.xfers = append(st.xfers, &inflight{x: x, posted: now, deadline: now + w.cfg.TransferTimeout})
}

// pairBlocks validates and pairs local and remote block ids, group by
// group. An empty local side means nothing to read (a full local prefix
// hit, or an abort before scheduling). With a local prefix-cache hit the
// local list is shorter: only the tail of the remote blocks is read, which
// is right only when the remote list covers exactly the prompt this engine
// allocated for — so a full-attention group's remote list must have exactly
// as many blocks as this engine holds for the prompt (cached + to read),
// and a sliding-window group's no more than its window. Anything else is a
// kv_transfer_params that does not belong to this request, and reading it
// would compute from someone else's KV.
func (w *Worker) pairBlocks(rr *RecvReq, re *remoteEngine) (BlockIDs, BlockIDs, error) {
	local, remote := rr.LocalBlockIDs, rr.Remote.BlockIDs
	if local.Empty() {
		return nil, nil, nil
	}
	groups := w.cfg.TransferGroups
	ng := max(len(groups), 1)
	if len(local) != ng {
		return nil, nil, fmt.Errorf("%d local KV-cache groups in the step metadata, this engine has %d", len(local), ng)
	}
	if len(remote) != ng {
		return nil, nil, fmt.Errorf("the remote engine sent block ids for %d KV-cache groups, this engine has %d", len(remote), ng)
	}
	outR := make(BlockIDs, ng)
	for g := range local {
		l, r := local[g], remote[g]
		window := 0
		if g < len(groups) && w.cfg.HMARequired {
			window = groups[g].blocksInWindow()
		}
		switch {
		case window > 0 && len(r) > window:
			return nil, nil, fmt.Errorf("group %d: %d remote block ids for a sliding window of %d blocks", g, len(r), window)
		case window == 0 && g < len(rr.LocalNumComputed) && int64(len(l)) > 0 && int64(len(r)) != rr.LocalNumComputed[g]+int64(len(l)):
			return nil, nil, fmt.Errorf("group %d: the remote engine sent %d block ids, but this prompt takes %d blocks here (%d cached locally + %d to read): the kv_transfer_params do not belong to this prompt",
				g, len(r), rr.LocalNumComputed[g]+int64(len(l)), rr.LocalNumComputed[g], len(l))
		case len(l) > len(r):
			return nil, nil, fmt.Errorf("group %d: %d local blocks but the remote engine sent only %d block ids", g, len(l), len(r))
		}
		r = r[len(r)-len(l):]
		for _, b := range l {
			if b < 0 || b >= w.layout.NumBlocks {
				return nil, nil, fmt.Errorf("local block id %d out of range [0, %d)", b, w.layout.NumBlocks)
			}
		}
		for _, b := range r {
			if b < 0 || b >= re.numBlocks {
				return nil, nil, fmt.Errorf("remote block id %d out of range [0, %d) of engine %s", b, re.numBlocks, re.id)
			}
		}
		outR[g] = r
	}
	if int64(len(w.layout.Regions))*max(w.layout.NumBlocks, re.numBlocks) > 1<<31-1 {
		return nil, nil, errors.New("descriptor ids exceed int32")
	}
	return local, outR, nil
}

// regionDescIDs lists the descriptor ids (region r, block b: r*numBlocks+b)
// of a request's blocks, as vLLM's NixlConnector does: when every region
// serves the same groups (one group, or groups sharing every tensor), each
// region reads every group's blocks; otherwise group g's blocks are read
// from the regions of group g and the shared ones. Local and remote lists
// built from paired block ids with the same regions correspond entry by
// entry.
func regionDescIDs(regions []Region, numBlocks int64, ids BlockIDs) []int32 {
	n := 0
	for _, g := range ids {
		n += len(g)
	}
	out := make([]int32, 0, n*len(regions))
	mapped := false
	for _, r := range regions[1:] {
		if r.Group != regions[0].Group {
			mapped = true
			break
		}
	}
	if !mapped {
		for ri := range regions {
			off := int64(ri) * numBlocks
			for _, g := range ids {
				for _, b := range g {
					out = append(out, int32(off+b))
				}
			}
		}
		return out
	}
	for gi, g := range ids {
		for ri, r := range regions {
			if r.Group != gi && r.Group != SharedGroup {
				continue
			}
			off := int64(ri) * numBlocks
			for _, b := range g {
				out = append(out, int32(off+b))
			}
		}
	}
	return out
}

func (w *Worker) failLocked(st *recvState, kind, msg string, err error) {
	st.failed = true
	w.logFailure(kind, st, msg, err)
}

// logFailure prints vLLM's failure line: "NIXL transfer failure: <type> |
// Context: {...}".
func (w *Worker) logFailure(kind string, st *recvState, msg string, err error) {
	ctx := map[string]any{"failure_type": kind, "engine_id": w.cfg.EngineID}
	if st != nil {
		ctx["request_id"] = st.id
		rm := st.meta.Remote
		ctx["remote_engine_id"] = rm.EngineID
		ctx["remote_request_id"] = rm.RequestID
		ctx["remote_host"] = rm.Host
		ctx["remote_port"] = rm.Port
		ctx["num_local_blocks"] = st.meta.LocalBlockIDs.Count()
		ctx["num_remote_blocks"] = rm.BlockIDs.Count()
	}
	if err != nil {
		ctx["error"] = err.Error()
	}
	if msg != "" {
		kind += ". " + msg
	}
	b, _ := json.Marshal(ctx)
	w.log.Error("NIXL transfer failure: " + kind + " | Context: " + string(b))
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

// goSafe runs fn on a new goroutine. A panic there is recovered, logged
// with its stack, counted, and handed to onPanic as an error (itself
// guarded): a bug in a background goroutine fails the work it was doing,
// never the host process.
func (w *Worker) goSafe(what string, onPanic func(error), fn func()) {
	go func() {
		defer func() {
			p := recover()
			if p == nil {
				return
			}
			err := fmt.Errorf("%w (%s): panic: %v", errPanicked, what, p)
			w.log.Error("recovered a panic on a background goroutine", zap.String("where", what),
				zap.Any("panic", p), zap.Stack("stack"))
			w.panics.Add(1)
			if onPanic == nil {
				return
			}
			defer func() {
				if p2 := recover(); p2 != nil {
					w.log.Error("recovered a second panic while failing the work of a panicked goroutine",
						zap.String("where", what), zap.Any("panic", p2))
					w.panics.Add(1)
				}
			}()
			onPanic(err)
		}()
		if testPanicHook != nil {
			testPanicHook(what)
		}
		fn()
	}()
}

// errPanicked marks the error a recovered panic turned into.
var errPanicked = errors.New("internal error in gonixl")

// testPanicHook, when set (tests only), runs first on every goSafe goroutine.
var testPanicHook func(what string)

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
		if ei, ok := w.agent.(interface{ EndpointInfo() string }); ok && !w.loggedLanes {
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

func (w *Worker) sendHeartbeatsLocked(hbs map[string]*HeartbeatInfo) {
	engines := make([]string, 0, len(hbs))
	for e := range hbs {
		engines = append(engines, e)
	}
	sort.Strings(engines)
	for _, eng := range engines {
		info := hbs[eng]
		re, ok := w.remotes[eng]
		if !ok {
			w.startHandshakeLocked(eng, info.Host, info.Port, info.TPSize, "")
			continue
		}
		w.touchRemoteLocked(re)
		msg := []byte("HB:" + strings.Join(info.ReqIDs, ","))
		sent := w.clock()
		if err := w.agent.SendNotif(re.agent, msg); err != nil {
			w.log.Debug("heartbeat send failed", zap.String("remote_engine_id", eng), zap.Error(err))
			continue
		}
		// The prefill extends a lease it still holds to at least (its
		// receive time + 2/3 of its lease); its receive time is after our
		// send time. A heartbeat counts only if the lease was surely alive
		// when it arrived: sent with more than the safety margin left of
		// what we know (the expiry it sent, or an earlier heartbeat). A
		// lease that already ended is never revived, and without a known
		// expiry there is nothing to extend. Both sides are assumed to use
		// the same kv_lease_duration, as heartbeats themselves do.
		for _, id := range info.ReqIDs {
			exp, ok := info.Expiry[id]
			if !ok {
				continue
			}
			bound := exp - re.offset - re.rtt.Seconds()
			if f, ok := w.leaseFloor[id]; ok && f > bound {
				bound = f
			}
			if sent+w.leaseMargin < bound {
				if floor := sent + w.leaseExtend; floor > w.leaseFloor[id] {
					w.leaseFloor[id] = floor
				}
			}
		}
	}
}

// GetFinished polls transfers and notifications, sweeps expired leases and
// returns what finished since the last call.
func (w *Worker) GetFinished() ([]byte, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.agent != nil {
		w.pollTransfersLocked()
		w.pollNotifsLocked()
		w.sweepLeasesLocked()
		w.evictIdleRemotesLocked()
	}
	f := w.done
	w.done = Finished{}
	if f.Sending == nil {
		f.Sending = []string{}
	}
	if f.Recving == nil {
		f.Recving = []string{}
	}
	if f.Failed == nil {
		f.Failed = []string{}
	}
	b, err := json.Marshal(f)
	if err != nil {
		return nil, err
	}
	return b, nil
}

func (w *Worker) pollTransfersLocked() {
	now := w.clock()
	ids := make([]string, 0, len(w.recv))
	for id := range w.recv {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		st := w.recv[id]
		if st.waiting {
			continue
		}
		kept := st.xfers[:0]
		for _, f := range st.xfers {
			if f.stuck > 0 {
				// Already failed; only the handle is left to release.
				if !w.retryStuckLocked(st, f, now) {
					kept = append(kept, f)
				}
				continue
			}
			status, err := f.x.Check()
			switch {
			case err == nil && status == nixl.Success:
				if f.slow {
					w.log.Warn("slow READ completed", zap.String("request_id", st.id),
						zap.String("remote_engine_id", st.meta.Remote.EngineID), zap.Float64("seconds", now-f.posted))
				}
				if t, ts := f.x.Telemetry(); ts == nixl.Success {
					w.stats.RecordTransfer(t.XferDur.Seconds(), t.PostDur.Seconds(), t.Bytes, t.DescCount)
				}
				if rerr := f.x.Release(); rerr != nil {
					// Complete: nothing writes the blocks any more.
					w.logFailure("transfer_release_failed", st, "", rerr)
				}
				if left := w.leaseLeft(st); left <= 0 {
					// Completed after the remote lease ended: the prefill may
					// have freed and reused the blocks mid-read. No silent
					// corruption: fail the load (kv_load_failure_policy).
					w.stats.RecordKVExpired()
					w.failLocked(st, "kv_lease_expired", fmt.Sprintf("READ completed %.1fs after the remote lease ended (%s); the data may be stale", -left, w.leaseDetail(st)), nil)
				}
			case err == nil && status == nixl.InProgress:
				if !f.slow && now-f.posted >= slowReadAfter {
					f.slow = true
					w.log.Warn("READ still in flight", zap.String("request_id", st.id),
						zap.String("remote_engine_id", st.meta.Remote.EngineID), zap.Float64("seconds", now-f.posted),
						zap.Int("local_blocks", st.meta.LocalBlockIDs.Count()), zap.Float64("transfer_timeout", w.cfg.TransferTimeout))
				}
				if now >= f.deadline {
					// Bounded wait: cancel and fail the request.
					w.stats.RecordFailedTransfer()
					w.failLocked(st, "transfer_failed", fmt.Sprintf("READ still in flight after transfer_timeout=%gs", w.cfg.TransferTimeout), nil)
					if st.remote != nil {
						// A peer that stopped answering is handshaken anew
						// (this also closes the endpoint, which cancels
						// what is still posted on it).
						w.dropRemoteLocked(st.remote)
					}
					if rerr := f.x.Release(); rerr != nil {
						w.holdStuckLocked(st, f, now, rerr)
						kept = append(kept, f)
					}
					continue
				}
				kept = append(kept, f)
			default:
				if err == nil {
					err = fmt.Errorf("transfer status %v", status)
				}
				w.stats.RecordFailedTransfer()
				w.failLocked(st, "transfer_failed", "", err)
				if re, ok := w.remotes[st.meta.Remote.EngineID]; ok {
					w.dropRemoteOnDisconnect(re, err)
				}
				if rerr := f.x.Release(); rerr != nil {
					w.holdStuckLocked(st, f, now, rerr)
					kept = append(kept, f)
				}
			}
		}
		st.xfers = kept
		if len(st.xfers) > 0 {
			continue
		}
		delete(w.recv, id)
		delete(w.leaseFloor, st.meta.Remote.RequestID)
		if !st.report {
			continue // notify-only: vLLM does not wait for it
		}
		w.done.Recving = append(w.done.Recving, id)
		if st.failed {
			w.reportFailedLocked(st)
		}
	}
}

// reportFailedLocked reports a failed load once: the request in
// failed_recving, its blocks in the load errors (the Python side passes
// those on only for a single KV-cache group, as vLLM requires).
func (w *Worker) reportFailedLocked(st *recvState) {
	if st.failedSent {
		return
	}
	st.failedSent = true
	w.done.Failed = append(w.done.Failed, st.id)
	for _, g := range st.meta.LocalBlockIDs {
		for _, b := range g {
			w.invalid[b] = struct{}{}
		}
	}
}

// holdStuckLocked keeps a handle the engine would not release. Its request
// is already failed and is reported in failed_recving at once; it is
// reported finished receiving only once the handle is released: until then
// the engine may still write into those blocks, and vLLM must not give them
// to another request. Visible as gonixl_stuck_transfer_handles and in the log.
func (w *Worker) holdStuckLocked(st *recvState, f *inflight, now float64, err error) {
	f.stuck, f.nextTry, f.stuckLogged = now, now+stuckRetry, now
	w.stuckTotal.Add(1)
	if st.report {
		// The failure is reported now (bounded); finished_recving, which
		// lets vLLM free or reuse the blocks, only at release. vLLM's
		// scheduler keeps the blocks of a request that is not finished
		// receiving: under "fail" it ends the request with an error at
		// once and holds its blocks (the delayed free of an aborted
		// receive); under "recompute" the request waits in
		// WAITING_FOR_REMOTE_KVS, its blocks allocated, until the release.
		w.reportFailedLocked(st)
	}
	w.logFailure("transfer_release_failed", st, fmt.Sprintf("the engine cannot release the READ's handle; the request is reported failed, its %d local blocks stay held (finished_recving withheld) until the handle is released, retried every %gs",
		st.meta.LocalBlockIDs.Count(), stuckRetry), err)
}

// retryStuckLocked retries releasing a stuck handle; true once released.
func (w *Worker) retryStuckLocked(st *recvState, f *inflight, now float64) bool {
	if now < f.nextTry {
		return false
	}
	f.nextTry = now + stuckRetry
	err := f.x.Release()
	if err == nil {
		w.log.Warn("stuck READ handle released; its request is reported finished receiving now (vLLM may reuse its blocks)", zap.String("request_id", st.id),
			zap.Float64("held_seconds", now-f.stuck))
		return true
	}
	if now-f.stuckLogged >= stuckLogEvery {
		f.stuckLogged = now
		w.log.Error("READ handle still cannot be released; its local blocks stay held", zap.String("request_id", st.id),
			zap.Float64("held_seconds", now-f.stuck), zap.Error(err))
	}
	return false
}

func (w *Worker) pollNotifsLocked() {
	notifs, err := w.agent.GetNotifs()
	if err != nil {
		w.log.Warn("draining notifications failed", zap.Error(err))
		return
	}
	for _, n := range notifs {
		msg := string(n.Msg)
		if ids, ok := strings.CutPrefix(msg, "HB:"); ok {
			exp := w.clock() + w.leaseExtend
			for _, id := range strings.Split(ids, ",") {
				if old, ok := w.toSend[id]; ok && exp > old {
					w.toSend[id] = exp
				}
			}
			continue
		}
		i := strings.LastIndexByte(msg, ':')
		if i < 0 {
			w.log.Warn("malformed notification", zap.String("from", n.Agent), zap.String("msg", msg))
			continue
		}
		id := msg[:i]
		want, err := strconv.Atoi(msg[i+1:])
		if err != nil || want <= 0 {
			w.log.Warn("malformed notification", zap.String("from", n.Agent), zap.String("msg", msg))
			continue
		}
		_, sending := w.toSend[id]
		_, processing := w.toProcess[id]
		if !sending && !processing {
			w.stats.RecordNotifAfterExpiry()
			w.log.Error("Potentially invalid KV blocks for unrecognized request were retrieved by a decode worker. They may have expired.",
				zap.String("req_id", id))
			continue
		}
		w.consumers[id]++
		if w.consumers[id] >= want {
			delete(w.consumers, id)
			delete(w.toProcess, id)
			delete(w.toSend, id)
			w.done.Sending = append(w.done.Sending, id)
		}
	}
}

// sweepLeasesLocked frees every expired lease: a full sweep, since
// heartbeats extend deadlines in place and the table is not ordered.
func (w *Worker) sweepLeasesLocked() {
	now := w.clock()
	for id, exp := range w.toSend {
		if now < exp {
			continue
		}
		n := w.consumers[id]
		delete(w.consumers, id)
		delete(w.toSend, id)
		delete(w.toProcess, id)
		w.stats.RecordKVExpired()
		w.log.Warn("Releasing expired KV blocks", zap.String("req_id", id), zap.Int("read_by_workers", n))
		w.done.Sending = append(w.done.Sending, id)
	}
}

// LoadErrors returns (and clears) the local block ids whose load failed.
func (w *Worker) LoadErrors() []int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]int64, 0, len(w.invalid))
	for b := range w.invalid {
		out = append(out, b)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	w.invalid = map[int64]struct{}{}
	return out
}

// Stats returns the stats accumulated since the last call as JSON, or nil.
func (w *Worker) Stats() []byte { return w.stats.Take() }

// MetricsText renders gonixl's own Prometheus registry.
func (w *Worker) MetricsText() ([]byte, error) { return w.prom.Text() }

// Close releases transfers, remote agents and the agent. Idempotent.
func (w *Worker) Close() error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return nil
	}
	w.closed = true
	hs := w.hs
	unserveMetrics(w.prom.reg)
	var errs []error
	for _, st := range w.recv {
		for _, f := range st.xfers {
			_ = f.x.Release()
		}
	}
	for _, re := range w.remotes {
		_ = re.list.Release()
	}
	if w.localList != nil {
		_ = w.localList.Release()
	}
	if w.agent != nil {
		if err := w.agent.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	w.mu.Unlock()
	if hs != nil {
		hs.Close()
	}
	return errors.Join(errs...)
}

// plainJSON turns json.Number (the config is decoded with UseNumber) into
// int64 or float64, recursively, so values hash as Python's json does.
func plainJSON(v any) any {
	switch t := v.(type) {
	case json.Number:
		if i, err := t.Int64(); err == nil {
			return i
		}
		f, _ := t.Float64()
		return f
	case map[string]any:
		out := make(map[string]any, len(t))
		for k, e := range t {
			out[k] = plainJSON(e)
		}
		return out
	case []any:
		out := make([]any, len(t))
		for i, e := range t {
			out[i] = plainJSON(e)
		}
		return out
	}
	return v
}

// leaseSafetyMargin is how much of the remote lease must be left to start a
// READ (vLLM's margin for its turn-2 reads), for leases of 20 s and more;
// shorter leases get a quarter of their length (a fixed 5 s would refuse
// every READ under a lease below 5 s).
const leaseSafetyMargin = 5.0

// leaseMarginFor is the safety margin for a lease of the given length.
func leaseMarginFor(lease float64) float64 {
	return min(leaseSafetyMargin, lease/4)
}

// leaseLeft is how long, on this worker's clock, the remote engine will
// still hold the request's blocks: the expiry it sent (rebased by the
// handshake's clock offset, less that sample's round trip as error bound),
// raised by the heartbeats this worker sent. +Inf when the remote sent no
// expiry (a stock vLLM prefill): nothing to check against.
func (w *Worker) leaseLeft(st *recvState) float64 {
	rm := st.meta.Remote
	if rm.Expiry == nil || st.remote == nil {
		return math.Inf(1)
	}
	deadline := *rm.Expiry - st.remote.offset - st.remote.rtt.Seconds()
	if floor, ok := w.leaseFloor[rm.RequestID]; ok && floor > deadline {
		deadline = floor
	}
	return deadline - w.clock()
}

// leaseDetail explains a lease decision for the failure log.
func (w *Worker) leaseDetail(st *recvState) string {
	rm := st.meta.Remote
	if rm.Expiry == nil || st.remote == nil {
		return "no expiry"
	}
	floor, hasFloor := w.leaseFloor[rm.RequestID]
	return fmt.Sprintf("remote expiry %.3f, clock offset %.3f, rtt %v, heartbeat floor %.3f (%v), now %.3f",
		*rm.Expiry, st.remote.offset, st.remote.rtt, floor, hasFloor, w.clock())
}
