package shim

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
	"github.com/gonixl/gonixl/shim/kvwire"
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
	// BlockReshape says how the Python connector rearranges a block read
	// from a prefill of a smaller block size ("head_major": each block is
	// runs of tokens per head, permuted after the READ; "token_major": the
	// sub-blocks land in token order already), or "" when it cannot: such a
	// prefill is then refused at handshake.
	BlockReshape string `json:"block_reshape,omitempty"`
	// HeadSize is the model's head size (elements), which places tokens
	// inside a block for BlockReshape's kinds (KV digests of a partly
	// filled block, kvdigest.go).
	HeadSize int64 `json:"head_size,omitempty"`
	// KernelLayout is the attention kernel's layout inside a block where
	// the backend name does not fix it (the CPU backend's ISA-dependent
	// layouts: "cpu_attn:vec", "cpu_attn:amx"); "" elsewhere. Two gonixl
	// peers that both state one must state the same.
	KernelLayout string `json:"kernel_layout,omitempty"`
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

	// mu guards every field below it, the leases, hsGuard and the
	// transfer agent's use. Lock order: mu, then the agent's own lock
	// (taken inside every nixl.Agent call), then Stats.mu and the metrics
	// server's lock (taken by stats and live-count calls made under mu).
	// Nothing below mu calls back into the worker. Handshakes run on
	// their own goroutines (goSafe) and take mu only to record their
	// result (finishHandshake), never while waiting on the network: the
	// side-channel client (hs) is used from those goroutines, without mu.
	mu           sync.Mutex
	closed       bool
	engine       nixl.Engine
	agent        nixl.Agent
	layout       *KVLayout
	localList    nixl.DescList
	slotLists    map[int][]nixl.DescList // local blocks split in n slots (tpmap.go), by n
	subLists     map[int]nixl.DescList   // local blocks as n sub-blocks each, by n (a smaller remote block size)
	blockReshape string                  // WorkerInit.BlockReshape
	headSize     int64                   // WorkerInit.HeadSize
	noted        map[string]bool         // log lines printed once (noteOnce)
	kvFaults     bool                    // EnvKVFault: test fault injection (kvfault.go)
	checks       sync.WaitGroup          // KV digest checks hashing off the lock (kvdigest.go)
	heldDigest   heldDigests             // a decode's read-back holds being hashed (kvdigest_readback.go)
	// fetches: a read-back's digest fetches (kvdigest_readback.go), ended
	// by Close before it waits for the checks that wait for them.
	fetches        context.Context
	stopFetches    context.CancelFunc
	kernelLayout   string // WorkerInit.KernelLayout
	payload        []byte
	compatHash     string
	hs             *sidechannel.Client
	blockSize      int64
	kvLayout       string
	attnBackend    string
	engineOverride nixl.Engine // tests: bypass Select
	loggedLanes    bool

	remotes    map[string]*remoteEngine
	handshakes map[string]*handshakeState
	recv       map[string]*recvState
	// deferred: requests whose READ waits for the agent to finish a long
	// control call (busy.go); busySince, busyLogged, busySkips: the busy
	// period, for its log line.
	deferred   []string
	busySince  float64
	busyLogged bool
	busySkips  int64
	done       Finished
	invalid    map[int64]struct{}
	toProcess  map[string]struct{}
	held       *leases // prefill: requests whose blocks wait for readers
	consumers  map[string]int
	floors     *leases // decode: remote request id -> lower bound of its remote lease (heartbeats)
	earlyHB    *leases // prefill: heartbeats for leases not installed yet (send.go)
	// readEarly: requests whose readers were done before their hold was
	// installed, with digests served (send.go readEarlyLocked), until
	// the hold's step comes.
	readEarly *leases
	released  *leases // decode: remote blocks this worker told their engine it is done with (lease.go)
	// read: remote block sets this worker READ or let go of (remote engine
	// and request id), until their lease surely ended: this worker's
	// notification lets the remote free them, so a second READ of the same
	// params (a retry, replayed params) would read blocks it may have
	// reused.
	read *leases
	// notifsFailed: the last GetNotifs failed; notifsSkipped: the last
	// poll found the engine busy and drained nothing. Either way leases
	// are not swept (a heartbeat may wait undrained).
	notifsFailed, notifsSkipped bool
	// pub receives the idle state (idle.go); evictTimer bumps its counter
	// at evictAt, the next engine_ttl eviction of an idle worker.
	pub         Publisher
	evictTimer  *time.Timer
	evictAt     float64
	leaseExtend float64
	leaseMargin float64 // leaseMarginFor(kv_lease_duration)
	panics      atomic.Int64
	stuckTotal  atomic.Int64 // handles ever held because release failed
	pushHolds   atomic.Int64 // push waits that failed and held their blocks until no WRITE could land
	hsGuard     handshakeGuard
	// push: push mode, a prefill's sends and registrations (push_send.go);
	// a decode's waits live on its recvStates (push_recv.go).
	push       *pushSender
	lastPoll   time.Time     // GetFinished's last call (pollgap.go)
	idleEvery  time.Duration // this worker's idlePollAfter (idle.go)
	lockHolder string        // the last section that took mu through lockTimed

	// Posting from a goroutine (post.go): the posts waiting for the
	// poster, whether it runs and its end, the batch it posts, and how
	// many of its posts have not returned (read without mu).
	postQueue    []*postState
	posterOn     bool
	posterDone   chan struct{}
	postBatch    []*postState
	postsRunning atomic.Int32
}

// NewWorker validates cfg and creates the worker side. clock may be nil.
// The transfer agent is created by RegisterKVCaches, when the memory type
// is known.
func NewWorker(cfg *Config, clock Clock) (_ *Worker, err error) {
	defer classify(&err, ErrInvalidInput)
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
		slotLists:  map[int][]nixl.DescList{},
		subLists:   map[int]nixl.DescList{},
		handshakes: map[string]*handshakeState{},
		recv:       map[string]*recvState{},
		invalid:    map[int64]struct{}{},
		toProcess:  map[string]struct{}{},
		push:       newPushSender(),
		held:       newLeases(clock),
		consumers:  map[string]int{},
		floors:     newLeases(clock),
		read:       newLeases(clock),
		earlyHB:    newLeases(clock),
		readEarly:  newLeases(clock),
		released:   newLeases(clock),
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
	w.kvFaults = kvFaultsFromEnv(w.log)
	w.fetches, w.stopFetches = context.WithCancel(context.Background())
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
	defer w.lockTimed("register_kv_caches")()
	if w.closed {
		return withClass(ErrState, errors.New("worker is closed"))
	}
	if w.agent != nil {
		return withClass(ErrState, errors.New("register_kv_caches called twice"))
	}
	layout, err := BuildLayout(init.Layers, init.NumBlocks)
	if err != nil {
		return withClass(ErrInvalidInput, err)
	}
	if err := w.checkKVPlacement(layout, init); err != nil {
		return withClass(ErrInvalidInput, err)
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
	list, err := nixl.PrepStrided(agent, "", layout.Mem, layoutRuns(layout.Regions, layout.NumBlocks, layout.DeviceID))
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
	w.kernelLayout = init.KernelLayout // geometryOf states it
	geom, err := json.Marshal(w.geometryOf(layout))
	if err != nil {
		return fmt.Errorf("kv geometry: %w", err)
	}
	am.Geometry = string(geom)
	payload := (&sidechannel.HandshakePayload{CompatibilityHash: hash, AgentMetadataBytes: am.Encode()}).Encode()

	env, err := sidechannel.FromEnv(os.Getenv)
	if err != nil {
		return withClass(ErrInvalidInput, err)
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
	w.blockReshape, w.headSize = init.BlockReshape, init.HeadSize
	ok = true
	w.startIdlePoller()
	var total uint64
	for _, s := range layout.Storage {
		total += s.Len
	}
	fields := []zap.Field{zap.Int("regions", len(layout.Regions)), zap.Int64("num_blocks", layout.NumBlocks),
		zap.Uint64("block_len", layout.Regions[0].Len), zap.Uint64("bytes", total), zap.String("mem", layout.Mem.String()),
		zap.String("compat_hash", hash)}
	if ai, ok := w.agent.(nixl.Describer); ok {
		// The agent's own settings (error handling, data path, shared regions).
		fields = append(fields, zap.String("agent", ai.Info()))
	}
	w.log.Info("KV cache registered", fields...)
	return nil
}

// HandshakePayload returns the encoded NixlHandshakePayload this rank
// serves through the scheduler's listener.
func (w *Worker) HandshakePayload() ([]byte, error) {
	defer w.lockTimed("handshake payload")()
	if w.payload == nil {
		return nil, withClass(ErrState, errors.New("no handshake payload before register_kv_caches"))
	}
	return w.payload, nil
}

// StartLoadKV takes one step's metadata: posts READs (handshaking in the
// background first where needed), updates the prefill-side lease table and
// sends heartbeats. It never waits on the network, but for one rare case:
// a preempted announced push whose WRITE is in flight, when vLLM did not
// call handle_preemptions first (pushPreemptedLocked's fence).
func (w *Worker) StartLoadKV(metaBytes []byte) error {
	m, err := DecodeStepMeta(metaBytes)
	if err != nil {
		return withClass(ErrInvalidInput, err)
	}
	defer w.lockTimed("start_load_kv")()
	defer w.publishLocked(false)
	if w.agent == nil {
		if len(m.ReqsToRecv) > 0 {
			return withClass(ErrState, errors.New("start_load_kv before register_kv_caches"))
		}
		return nil
	}
	// First: a preempted request's WRITE must be stopped or done before
	// this step's forward, which may overwrite its blocks.
	w.pushPreemptedLocked(m.PushPreempted)
	w.startReadsLocked(m)
	w.holdForReadersLocked(m)
	w.pushEarlyLocked(m)
	w.pushFinishedLocked(m)
	w.pushAbortedLocked(m.PushAborted)
	if !w.agentBusyLocked() {
		// Put off with the polls (busy.go); the next heartbeat is one
		// interval away, well inside the leases it extends.
		w.sendHeartbeatsLocked(m.Heartbeats)
	}
	return nil
}

// HandlePreemptions is vLLM's handle_preemptions, called with a step's
// metadata before that step's forward: an announced push whose request
// vLLM preempted has its WRITE dropped if not posted, or waited for if
// posted, before the forward can give its blocks another request's KV
// (push_send.go pushPreemptedLocked). start_load_kv, which vLLM calls
// after the forward, does the same for callers without this hook.
func (w *Worker) HandlePreemptions(metaBytes []byte) error {
	m, err := DecodeStepMeta(metaBytes)
	if err != nil {
		return withClass(ErrInvalidInput, err)
	}
	if len(m.PushPreempted) == 0 {
		return nil
	}
	defer w.lockTimed("handle_preemptions")()
	defer w.publishLocked(false)
	w.pushPreemptedLocked(m.PushPreempted)
	return nil
}

// GetFinished is Poll's result in kvwire's binary form, what the C ABI's
// gonixl_worker_get_finished returns every engine step.
func (w *Worker) GetFinished() ([]byte, error) {
	f := w.Poll()
	return kvwire.AppendFinished(make([]byte, 0, kvwire.FinishedSize(&f)), &f), nil
}

// Poll polls transfers and notifications, sweeps expired leases and
// returns what finished since the last call.
func (w *Worker) Poll() Finished {
	defer w.lockTimed("get_finished")()
	defer w.publishLocked(false)
	w.notePollLocked()
	if w.agent != nil && !w.agentBusyLocked() {
		w.postDeferredLocked()
		// After the step's forward (vLLM calls get_finished then): the
		// early pushes its start_load_kv announced are computed.
		w.pushComputedLocked()
		w.pollLocked()
	}
	f := w.done
	w.done = Finished{}
	f.Sending = w.heldSendingLocked(f.Sending)
	f.DigestsPending = len(w.heldDigest.ready) > 0
	f.LoadErrorsPending = len(w.invalid) > 0
	f.StatsPending = w.stats.Pending()
	f.PushArrivalsPending = len(w.push.arrived) > 0
	return f
}

// PushArrivals returns the base request ids of the decode registrations
// that arrived since the last call (push mode, a prefill), each once: the
// scheduler's push admission (pybridge/gonixl/push_admission.py) learns
// from them which requests a decode has allocated blocks for.
func (w *Worker) PushArrivals() []string {
	defer w.lockTimed("push arrivals")()
	out := w.push.arrived
	w.push.arrived = nil
	if out == nil {
		out = []string{}
	}
	return out
}

// pollLocked polls transfers and notifications and runs the timers:
// everything a poll does that does not depend on where vLLM's step is
// (IdlePoll runs it too).
func (w *Worker) pollLocked() {
	t0 := time.Now()
	w.pollTransfersLocked()
	t1 := time.Now()
	w.pollNotifsLocked()
	t2 := time.Now()
	w.sweepLeasesLocked()
	w.read.Expired()
	w.released.Expired()
	t3 := time.Now()
	w.evictIdleRemotesLocked()
	w.pollPushWaitsLocked()
	w.pollPushSendsLocked()
	w.sweepPushLocked()
	if t4 := time.Now(); t4.Sub(t0) >= SlowCallWarn() {
		w.log.Warn("slow get_finished", zap.Duration("transfers", t1.Sub(t0)), zap.Duration("notifications", t2.Sub(t1)),
			zap.Duration("leases", t3.Sub(t2)), zap.Duration("evictions", t4.Sub(t3)))
	}
}

// LoadErrors returns (and clears) the local block ids whose load failed.
func (w *Worker) LoadErrors() []int64 {
	defer w.lockTimed("get_block_ids_with_load_errors")()
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
	// No handle is released under a post (post.go): the poster ends
	// after its batch.
	w.waitPosterForClose()
	w.stopFetches()
	w.waitChecksForClose()
	if w.evictTimer != nil {
		w.evictTimer.Stop()
	}
	w.publishLocked(true)
	hs := w.hs
	unserveMetrics(w.prom.reg)
	var errs []error
	for _, st := range w.recv {
		for _, f := range st.xfers {
			_ = f.x.Release()
		}
	}
	for _, ps := range w.push.sends {
		for _, f := range ps.xfers {
			_ = f.x.Release()
		}
	}
	for _, re := range w.remotes {
		for _, r := range re.ranks {
			if r.list != nil {
				_ = r.list.Release()
			}
		}
	}
	for _, lists := range w.slotLists {
		for _, l := range lists {
			_ = l.Release()
		}
	}
	for _, l := range w.subLists {
		_ = l.Release()
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
