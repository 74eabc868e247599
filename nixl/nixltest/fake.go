package nixltest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gonixl/gonixl/nixl"
)

// Step names an API step a Script can fail.
type Step string

const (
	StepNewAgent    Step = "NewAgent"
	StepRegister    Step = "RegisterMem"
	StepDeregister  Step = "DeregisterMem"
	StepMetadata    Step = "LocalMetadata"
	StepLoad        Step = "LoadRemoteMetadata"
	StepInvalidate  Step = "InvalidateRemote"
	StepPrep        Step = "PrepDescList"
	StepMake        Step = "MakeXfer"
	StepPost        Step = "Post"
	StepCheck       Step = "Check"
	StepSendNotif   Step = "SendNotif"
	StepGetNotifs   Step = "GetNotifs"
	StepReleaseXfer Step = "ReleaseXfer" // the handle stays live (an engine that cannot cancel)
)

// Script scripts an engine's (or one agent's) behaviour.
type Script struct {
	// Polls is the number of Check calls that return InProgress before a
	// transfer completes; 0 completes on the first Check; a negative value
	// completes inside Post (Post returns Success).
	Polls int
	// FailStep, if set, makes that step fail with FailStatus (default
	// ERR_BACKEND): every time when FailNth is 0, otherwise only its
	// FailNth occurrence (1-based, counted per agent).
	FailStep   Step
	FailStatus nixl.Status
	FailNth    int
	// NoCopy leaves memory untouched (for tests that register fake
	// addresses). Notifications are still delivered.
	NoCopy bool
	// Lands makes a transfer's Landed (nixl.Lander) a channel closed when
	// its bytes moved (at completion, as the ucx engine's own copies
	// do); off, Landed returns nil: when the bytes land is not known.
	Lands bool
	// PrepHook, if set, is called at the start of PrepDescList (remote
	// agent name, "" for a local list; descriptor count) without the
	// engine's lock held: a test can make a preparation slow and check
	// what keeps running meanwhile.
	PrepHook func(remote string, n int)
	// PostCopies makes the agent report nixl.PostCopies (Post moves the
	// bytes on the caller's thread, as the NIXL engine's does for DRAM);
	// off, it reports that it does not (the ucx engine has no such
	// method).
	PostCopies bool
	// PostHook, if set, is called at the start of every Post (the
	// transfer's id, as Transfers lists it) without the engine's lock
	// held: a test can make a post slow, or hold it, and check what the
	// caller does meanwhile.
	PostHook func(id uint64)
	// ControlBusy makes the agent report nixl.ControlBusy while a
	// PrepDescList (its PrepHook included) or LoadRemoteMetadata runs, as
	// the NIXL engine does; off, it never reports busy.
	ControlBusy bool
	// RefuseReleaseInFlight makes Release of a posted transfer that is
	// still in progress fail with ERR_REPOST_ACTIVE, as the ucx engine's
	// does while its operations are in flight and cannot be cancelled;
	// once the peer is dead or its metadata was invalidated (which cancels
	// the operations) the release succeeds.
	RefuseReleaseInFlight bool
	// InFlightSurvivesInvalidate: operations already issued keep going
	// when the peer's metadata is invalidated (an engine that cannot
	// cancel them at all): with RefuseReleaseInFlight, the release is
	// refused until the transfer completes, fails, or its peer dies.
	InFlightSurvivesInvalidate bool
}

// Call is one recorded API call.
type Call struct {
	Op     string
	Detail string
}

// Engine is a fake engine. Fake is the instance registered as "fake";
// NewEngine makes isolated ones.
type Engine struct {
	name string

	mu          sync.Mutex
	holding     atomic.Bool // Hold: TryCheck and TryGetNotifs decline
	script      Script
	unavailable error
	agents      map[string]*Agent
	order       []*Agent
	// Observation (observe.go): transfers not yet released by id, and
	// the test's hooks.
	nextXfer  uint64
	live      map[uint64]*xfer
	moveHook  func(Move)
	notifHook func(from, to string, msg []byte) bool
}

// Fake is the engine registered under the name "fake".
var Fake = NewEngine("fake")

func init() { nixl.Register(Fake) }

// NewEngine returns an unregistered engine; pass it to nixl.Register under
// a fresh name if the code under test looks engines up by name.
func NewEngine(name string) *Engine {
	return &Engine{name: name, agents: map[string]*Agent{}, live: map[uint64]*xfer{}}
}

// Hold makes the engine busy until the returned func is called, as a
// real engine's own thread holding its lock (the ucx engine's progress
// sweep): TryCheck and TryGetNotifs decline meanwhile. Other calls go on.
func (e *Engine) Hold() (release func()) {
	e.holding.Store(true)
	var once sync.Once
	return func() { once.Do(func() { e.holding.Store(false) }) }
}

func (e *Engine) Name() string { return e.name }

func (e *Engine) Info() string { return "nixltest fake engine (in-process, for tests)" }

func (e *Engine) Supports(m nixl.MemType) bool { return m == nixl.DRAM || m == nixl.VRAM }

// Available returns the error set by SetUnavailable, wrapped in
// nixl.ErrUnavailable.
func (e *Engine) Available() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.unavailable != nil {
		return fmt.Errorf("%w: %v", nixl.ErrUnavailable, e.unavailable)
	}
	return nil
}

// SetUnavailable makes Available (and NewAgent) fail with err; nil undoes it.
func (e *Engine) SetUnavailable(err error) {
	e.mu.Lock()
	e.unavailable = err
	e.mu.Unlock()
}

// SetScript sets the script that agents created from now on start with.
func (e *Engine) SetScript(s Script) {
	e.mu.Lock()
	e.script = s
	e.mu.Unlock()
}

// Agent returns the live agent of that name, or nil.
func (e *Engine) Agent(name string) *Agent {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.agents[name]
}

// Agents returns every agent created (closed ones too), oldest first.
func (e *Engine) Agents() []*Agent {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]*Agent(nil), e.order...)
}

// Reset forgets all agents (closing them) and the script.
func (e *Engine) Reset() {
	for _, a := range e.Agents() {
		_ = a.Close()
	}
	e.mu.Lock()
	e.agents = map[string]*Agent{}
	e.order = nil
	e.script = Script{}
	e.unavailable = nil
	e.live = map[uint64]*xfer{}
	e.moveHook, e.notifHook = nil, nil
	e.mu.Unlock()
}

// NewAgent creates an agent. The name must be unique among live agents.
func (e *Engine) NewAgent(cfg nixl.AgentConfig) (nixl.Agent, error) {
	if err := e.Available(); err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if cfg.Name == "" {
		return nil, nixl.Errorf(nixl.ErrInvalidParam, "NewAgent", "empty agent name")
	}
	if _, dup := e.agents[cfg.Name]; dup {
		return nil, nixl.Errorf(nixl.ErrInvalidParam, "NewAgent", "agent %q exists", cfg.Name)
	}
	for _, b := range cfg.Backends {
		if b != "UCX" && b != "FAKE" {
			return nil, nixl.Errorf(nixl.ErrNotFound, "NewAgent", "backend %q not available in the fake engine", b)
		}
	}
	a := &Agent{
		e: e, cfg: cfg, script: e.script,
		regs:    map[nixl.MemType][]nixl.Region{},
		remotes: map[string]*remoteInfo{},
		counts:  map[Step]int{},
		next:    map[Step]nixl.Status{},
	}
	a.record("NewAgent", "%s", cfg.Name)
	if err := a.fault(StepNewAgent); err != nil {
		return nil, err
	}
	e.agents[cfg.Name] = a
	e.order = append(e.order, a)
	return a, nil
}

// Agent is a fake agent. All methods take the engine's lock.
type Agent struct {
	e       *Engine
	cfg     nixl.AgentConfig
	script  Script
	closed  bool
	dead    bool
	control atomic.Int32 // control calls running (Script.ControlBusy)

	regs    map[nixl.MemType][]nixl.Region
	remotes map[string]*remoteInfo
	inbox   []nixl.Notif
	calls   []Call
	counts  map[Step]int
	next    map[Step]nixl.Status // FailNext: the next occurrence of a step fails
	lists   int                  // live prepared lists
	xfers   int                  // live transfer requests
}

type remoteInfo struct {
	agent *Agent
	regs  map[nixl.MemType][]nixl.Region
	gen   int
}

// metadata blob: magic, then JSON.
const mdMagic = "gonixl-fake-md\x00"

type mdBlob struct {
	Name string
	PID  int
	Regs map[nixl.MemType][]nixl.Region
}

func (a *Agent) record(op, format string, args ...any) {
	a.calls = append(a.calls, Call{Op: op, Detail: fmt.Sprintf(format, args...)})
}

// fault applies the script to one occurrence of step.
func (a *Agent) fault(step Step) error {
	a.counts[step]++
	if st, ok := a.next[step]; ok {
		delete(a.next, step)
		return nixl.Errorf(st, string(step), "scripted failure (FailNext)")
	}
	s := a.script
	if s.FailStep != step || (s.FailNth != 0 && s.FailNth != a.counts[step]) {
		return nil
	}
	st := s.FailStatus
	if st == 0 || st == nixl.InProgress {
		st = nixl.ErrBackend
	}
	return nixl.Errorf(st, string(step), "scripted failure")
}

func (a *Agent) live(op string) error {
	if a.closed {
		return nixl.Errorf(nixl.ErrInvalidParam, op, "agent %q is closed", a.cfg.Name)
	}
	return nil
}

func (a *Agent) Name() string   { return a.cfg.Name }
func (a *Agent) Engine() string { return a.e.name }

// Config returns the configuration the agent was created with.
func (a *Agent) Config() nixl.AgentConfig { return a.cfg }

// SetScript replaces this agent's script.
func (a *Agent) SetScript(s Script) {
	a.e.mu.Lock()
	a.script = s
	a.e.mu.Unlock()
}

// Calls returns the recorded calls, oldest first.
func (a *Agent) Calls() []Call {
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	return append([]Call(nil), a.calls...)
}

// CountCalls returns how many calls of op were recorded.
func (a *Agent) CountCalls(op string) int {
	n := 0
	for _, c := range a.Calls() {
		if c.Op == op {
			n++
		}
	}
	return n
}

// Live returns the numbers of prepared lists and transfer requests not yet
// released (for leak checks).
func (a *Agent) Live() (lists, xfers int) {
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	return a.lists, a.xfers
}

// Kill makes the agent behave like a peer whose process died: transfers
// that involve it fail with ERR_REMOTE_DISCONNECT and notifications to it
// are lost.
func (a *Agent) Kill() {
	a.e.mu.Lock()
	a.dead = true
	a.e.mu.Unlock()
}

// Inject queues a notification in this agent's inbox as if from agent.
func (a *Agent) Inject(from string, msg []byte) {
	a.e.mu.Lock()
	a.inbox = append(a.inbox, nixl.Notif{Agent: from, Msg: bytes.Clone(msg)})
	a.e.mu.Unlock()
}

func (a *Agent) RegisterMem(mem nixl.MemType, regions []nixl.Region) error {
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	a.record("RegisterMem", "%v %d regions", mem, len(regions))
	if err := a.live("RegisterMem"); err != nil {
		return err
	}
	if err := a.fault(StepRegister); err != nil {
		return err
	}
	if !a.e.Supports(mem) {
		return nixl.Errorf(nixl.ErrNotFound, "RegisterMem", "no backend for %v", mem)
	}
	for _, r := range regions {
		if r.Len == 0 {
			return nixl.Errorf(nixl.ErrInvalidParam, "RegisterMem", "empty region at %#x", r.Addr)
		}
	}
	a.regs[mem] = append(a.regs[mem], regions...)
	return nil
}

func (a *Agent) DeregisterMem(mem nixl.MemType, regions []nixl.Region) error {
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	a.record("DeregisterMem", "%v %d regions", mem, len(regions))
	if err := a.live("DeregisterMem"); err != nil {
		return err
	}
	if err := a.fault(StepDeregister); err != nil {
		return err
	}
	have := a.regs[mem]
	for _, r := range regions {
		i := indexOf(have, r)
		if i < 0 {
			return nixl.Errorf(nixl.ErrNotFound, "DeregisterMem", "region %+v was not registered", r)
		}
		have = append(have[:i:i], have[i+1:]...)
	}
	a.regs[mem] = have
	return nil
}

func indexOf(rs []nixl.Region, r nixl.Region) int {
	for i, x := range rs {
		if x == r {
			return i
		}
	}
	return -1
}

func (a *Agent) LocalMetadata() ([]byte, error) {
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	a.record("LocalMetadata", "")
	if err := a.live("LocalMetadata"); err != nil {
		return nil, err
	}
	if err := a.fault(StepMetadata); err != nil {
		return nil, err
	}
	js, err := json.Marshal(mdBlob{Name: a.cfg.Name, PID: os.Getpid(), Regs: a.regs})
	if err != nil {
		return nil, nixl.Errorf(nixl.ErrUnknown, "LocalMetadata", "%v", err)
	}
	return append([]byte(mdMagic), js...), nil
}

// PostCopies implements nixl.PostCopies (Script.PostCopies).
func (a *Agent) PostCopies() bool {
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	return a.script.PostCopies
}

// ControlBusy implements nixl.ControlBusy (Script.ControlBusy).
func (a *Agent) ControlBusy() bool { return a.control.Load() > 0 }

// controlCall counts a control call for ControlBusy when the script asks.
func (a *Agent) controlCall() (done func()) {
	a.e.mu.Lock()
	on := a.script.ControlBusy
	a.e.mu.Unlock()
	if !on {
		return func() {}
	}
	a.control.Add(1)
	return func() { a.control.Add(-1) }
}

func (a *Agent) LoadRemoteMetadata(md []byte) (string, error) {
	defer a.controlCall()()
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	a.record("LoadRemoteMetadata", "%d bytes", len(md))
	if err := a.live("LoadRemoteMetadata"); err != nil {
		return "", err
	}
	if err := a.fault(StepLoad); err != nil {
		return "", err
	}
	if !bytes.HasPrefix(md, []byte(mdMagic)) {
		return "", nixl.Errorf(nixl.ErrMismatch, "LoadRemoteMetadata", "not fake-engine metadata (%d bytes)", len(md))
	}
	var b mdBlob
	dec := json.NewDecoder(bytes.NewReader(md[len(mdMagic):]))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&b); err != nil || b.Name == "" {
		return "", nixl.Errorf(nixl.ErrMismatch, "LoadRemoteMetadata", "corrupt metadata: %v", err)
	}
	if b.PID != os.Getpid() {
		return "", nixl.Errorf(nixl.ErrNotSupported, "LoadRemoteMetadata", "agent %q lives in process %d; the fake engine is in-process only", b.Name, b.PID)
	}
	if b.Name == a.cfg.Name {
		return "", nixl.Errorf(nixl.ErrInvalidParam, "LoadRemoteMetadata", "metadata is this agent's own")
	}
	peer := a.e.agents[b.Name]
	if peer == nil || peer.closed {
		return "", nixl.Errorf(nixl.ErrNotFound, "LoadRemoteMetadata", "agent %q is not alive", b.Name)
	}
	gen := 1
	if old := a.remotes[b.Name]; old != nil {
		gen = old.gen + 1
	}
	a.remotes[b.Name] = &remoteInfo{agent: peer, regs: b.Regs, gen: gen}
	return b.Name, nil
}

func (a *Agent) InvalidateRemote(name string) error {
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	a.record("InvalidateRemote", "%s", name)
	if err := a.live("InvalidateRemote"); err != nil {
		return err
	}
	if err := a.fault(StepInvalidate); err != nil {
		return err
	}
	if a.remotes[name] == nil {
		return nixl.Errorf(nixl.ErrNotFound, "InvalidateRemote", "unknown agent %q", name)
	}
	delete(a.remotes, name)
	return nil
}

func covered(regs []nixl.Region, d nixl.Desc) bool {
	for _, r := range regs {
		if r.DevID == d.DevID && d.Addr >= r.Addr && d.Addr+d.Len <= r.Addr+r.Len && d.Addr+d.Len >= d.Addr {
			return true
		}
	}
	return false
}

func (a *Agent) PrepDescList(agent string, mem nixl.MemType, descs []nixl.Desc) (nixl.DescList, error) {
	defer a.controlCall()()
	a.e.mu.Lock()
	hook := a.script.PrepHook
	a.e.mu.Unlock()
	if hook != nil {
		hook(agent, len(descs))
	}
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	a.record("PrepDescList", "%q %v %d descs", agent, mem, len(descs))
	if err := a.live("PrepDescList"); err != nil {
		return nil, err
	}
	if err := a.fault(StepPrep); err != nil {
		return nil, err
	}
	regs := a.regs[mem]
	gen := 0
	if agent != "" {
		ri := a.remotes[agent]
		if ri == nil {
			return nil, nixl.Errorf(nixl.ErrNotFound, "PrepDescList", "no metadata loaded for agent %q", agent)
		}
		regs, gen = ri.regs[mem], ri.gen
	}
	for i, d := range descs {
		if !covered(regs, d) {
			return nil, nixl.Errorf(nixl.ErrNotFound, "PrepDescList", "descriptor %d (%#x+%d dev %d) is not in a registered %v region", i, d.Addr, d.Len, d.DevID, mem)
		}
	}
	a.lists++
	return &descList{a: a, agent: agent, mem: mem, descs: append([]nixl.Desc(nil), descs...), gen: gen}, nil
}

type descList struct {
	a        *Agent
	agent    string
	mem      nixl.MemType
	descs    []nixl.Desc
	gen      int
	released bool
}

func (l *descList) Len() int      { return len(l.descs) }
func (l *descList) Agent() string { return l.agent }

func (l *descList) Release() error {
	l.a.e.mu.Lock()
	defer l.a.e.mu.Unlock()
	l.a.record("ReleaseDescList", "%q", l.agent)
	if l.released {
		return nixl.Errorf(nixl.ErrInvalidParam, "DescList.Release", "list released twice")
	}
	l.released = true
	l.a.lists--
	return nil
}

func (a *Agent) MakeXfer(op nixl.XferOp, local nixl.DescList, localIdx []int32, remote nixl.DescList, remoteIdx []int32, notif []byte) (nixl.Xfer, error) {
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	a.record("MakeXfer", "%v %d descs notif=%q", op, len(localIdx), notif)
	if err := a.live("MakeXfer"); err != nil {
		return nil, err
	}
	if err := a.fault(StepMake); err != nil {
		return nil, err
	}
	bad := func(f string, args ...any) error { return nixl.Errorf(nixl.ErrInvalidParam, "MakeXfer", f, args...) }
	if op != nixl.Read && op != nixl.Write {
		return nil, bad("unknown operation %v", op)
	}
	ll, ok1 := local.(*descList)
	rl, ok2 := remote.(*descList)
	if !ok1 || !ok2 || ll == nil || rl == nil || ll.a != a || rl.a != a {
		return nil, bad("descriptor lists do not belong to this agent")
	}
	if ll.released || rl.released {
		return nil, bad("descriptor list already released")
	}
	if ll.agent != "" || rl.agent == "" {
		return nil, bad("local list must be prepared for \"\" and remote list for a remote agent")
	}
	if ll.mem != rl.mem {
		return nil, bad("memory types differ: %v vs %v", ll.mem, rl.mem)
	}
	if err := nixl.CheckIndexArrays(localIdx, remoteIdx); err != nil {
		return nil, err
	}
	var total uint64
	for i := range localIdx {
		li, ri := localIdx[i], remoteIdx[i]
		if err := nixl.CheckPairRange(i, li, ri, len(ll.descs), len(rl.descs)); err != nil {
			return nil, err
		}
		if err := nixl.CheckPairLengths(i, ll.descs[li].Len, rl.descs[ri].Len); err != nil {
			return nil, err
		}
		total += ll.descs[li].Len
	}
	a.xfers++
	a.e.nextXfer++
	x := &xfer{
		id: a.e.nextXfer, a: a, op: op, local: ll, remote: rl,
		li: append([]int32(nil), localIdx...), ri: append([]int32(nil), remoteIdx...),
		notif: bytes.Clone(notif), hasNotif: notif != nil, bytes: total, gen: rl.gen,
	}
	a.e.live[x.id] = x
	return x, nil
}

type xfer struct {
	id            uint64 // engine-wide, for Transfers and Settle
	a             *Agent
	op            nixl.XferOp
	local, remote *descList
	li, ri        []int32
	notif         []byte
	hasNotif      bool
	bytes         uint64
	gen           int

	released bool
	status   nixl.Status
	posted   bool
	polls    int
	start    time.Time
	postDur  time.Duration
	xferDur  time.Duration
	refused  int           // releases refused (Script.RefuseReleaseInFlight, a scripted ReleaseXfer failure)
	started  bool          // its operations were issued (a Post that did not fail)
	peer     *Agent        // the agent its operations target, from Post
	landed   chan struct{} // this post's, with Script.Lands; closed at completion
}

// Landed is nixl.Lander's channel of the last post: nil without
// Script.Lands or before a post.
func (x *xfer) Landed() <-chan struct{} {
	x.a.e.mu.Lock()
	defer x.a.e.mu.Unlock()
	return x.landed
}

func (x *xfer) stale(op string) error {
	if x.released {
		return nixl.Errorf(nixl.ErrInvalidParam, op, "transfer request already released")
	}
	return x.a.live(op)
}

func (x *xfer) Post() (nixl.Status, error) {
	a := x.a
	a.e.mu.Lock()
	hook := a.script.PostHook
	a.e.mu.Unlock()
	if hook != nil {
		hook(x.id)
	}
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	a.record("Post", "%v %d descs", x.op, len(x.li))
	if err := x.stale("Post"); err != nil {
		return nixl.ErrInvalidParam, err
	}
	if x.posted && x.status == nixl.InProgress {
		return nixl.ErrRepostActive, nixl.Errorf(nixl.ErrRepostActive, "Post", "request still in progress")
	}
	x.landed = nil // this post's (below), never the last one's
	if a.script.Lands {
		x.landed = make(chan struct{})
	}
	ri := a.remotes[x.remote.agent]
	if ri == nil || ri.gen != x.gen {
		return nixl.ErrNotFound, nixl.Errorf(nixl.ErrNotFound, "Post", "metadata of %q was invalidated or reloaded", x.remote.agent)
	}
	x.start = time.Now()
	x.posted, x.polls, x.postDur, x.xferDur, x.started = true, 0, 0, 0, false
	if err := a.fault(StepPost); err != nil {
		x.status = nixl.StatusOf(err)
		return x.status, err
	}
	if ri.agent.dead || ri.agent.closed {
		x.status = nixl.ErrRemoteDiscon
		delete(a.remotes, x.remote.agent) // NIXL invalidates the remote on disconnect
		return x.status, nixl.Errorf(nixl.ErrRemoteDiscon, "Post", "agent %q disconnected", x.remote.agent)
	}
	x.status, x.started, x.peer = nixl.InProgress, true, ri.agent
	if a.script.Polls < 0 {
		x.complete(ri.agent)
	}
	x.postDur = time.Since(x.start)
	if x.status == nixl.Success {
		x.xferDur = x.postDur
	}
	return x.status, nil
}

// complete moves the data and delivers the notification.
func (x *xfer) complete(peer *Agent) {
	x.move(peer)
	if x.landed != nil {
		close(x.landed) // complete runs once per post
	}
	if x.hasNotif {
		x.a.e.deliverLocked(x.a, peer, x.notif)
	}
	x.status = nixl.Success
}

// move copies the transfer's bytes, telling the move hook first.
func (x *xfer) move(peer *Agent) {
	if h := x.a.e.moveHook; h != nil {
		h(x.moveInfo(peer))
	}
	if !x.a.script.NoCopy {
		for i := range x.li {
			l, r := x.local.descs[x.li[i]], x.remote.descs[x.ri[i]]
			if x.op == nixl.Read {
				memmove(l.Addr, r.Addr, l.Len)
			} else {
				memmove(r.Addr, l.Addr, l.Len)
			}
		}
	}
}

func (x *xfer) Check() (nixl.Status, error) {
	x.a.e.mu.Lock()
	defer x.a.e.mu.Unlock()
	return x.checkLocked()
}

// TryCheck is nixl.TryChecker's: Check, unless a test holds the engine
// (Engine.Hold). Other calls running at the same time are waited for, so
// that tests do not depend on how calls happen to interleave.
func (x *xfer) TryCheck() (nixl.Status, error, bool) {
	if x.a.e.holding.Load() {
		return nixl.InProgress, nil, false
	}
	st, err := x.Check()
	return st, err, true
}

func (x *xfer) checkLocked() (nixl.Status, error) {
	a := x.a
	a.record("Check", "")
	if err := x.stale("Check"); err != nil {
		return nixl.ErrInvalidParam, err
	}
	if !x.posted {
		return nixl.ErrNotPosted, nixl.Errorf(nixl.ErrNotPosted, "Check", "request was never posted")
	}
	if x.status != nixl.InProgress {
		if x.status.IsError() {
			return x.status, nixl.Errorf(x.status, "Check", "transfer failed")
		}
		return x.status, nil
	}
	if err := a.fault(StepCheck); err != nil {
		x.status = nixl.StatusOf(err)
		return x.status, err
	}
	ri := a.remotes[x.remote.agent]
	var peer *Agent
	if ri != nil {
		peer = ri.agent
	}
	if peer == nil || peer.dead || peer.closed {
		x.status = nixl.ErrRemoteDiscon
		return x.status, nixl.Errorf(nixl.ErrRemoteDiscon, "Check", "agent %q disconnected", x.remote.agent)
	}
	if x.polls < a.script.Polls {
		x.polls++
		return nixl.InProgress, nil
	}
	x.complete(peer)
	x.xferDur = time.Since(x.start)
	return nixl.Success, nil
}

func (x *xfer) Telemetry() (nixl.Telemetry, nixl.Status) {
	a := x.a
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	if x.released {
		return nixl.Telemetry{}, nixl.ErrInvalidParam
	}
	if !a.cfg.Telemetry {
		return nixl.Telemetry{}, nixl.ErrNoTelemetry
	}
	if !x.posted {
		return nixl.Telemetry{}, nixl.ErrNotPosted
	}
	if x.status != nixl.Success {
		return nixl.Telemetry{}, x.status
	}
	return nixl.Telemetry{Start: x.start, PostDur: x.postDur, XferDur: x.xferDur, Bytes: x.bytes, DescCount: len(x.li)}, nixl.Success
}

func (x *xfer) Release() error {
	a := x.a
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	a.record("ReleaseXfer", "")
	if x.released {
		return nixl.Errorf(nixl.ErrInvalidParam, "Xfer.Release", "transfer request released twice")
	}
	if err := a.fault(StepReleaseXfer); err != nil {
		x.refused++
		return err
	}
	if a.script.RefuseReleaseInFlight && x.posted && x.status == nixl.InProgress {
		if x.peerLocked() != nil {
			x.refused++
			return nixl.Errorf(nixl.ErrRepostActive, "Xfer.Release", "the transfer's operations are still in flight and cannot be cancelled")
		}
		x.status = nixl.ErrRemoteDiscon // cancelled with its peer
	}
	x.released = true
	a.xfers--
	delete(a.e.live, x.id)
	return nil
}

func (a *Agent) SendNotif(agent string, msg []byte) error {
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	a.record("SendNotif", "%q %q", agent, msg)
	if err := a.live("SendNotif"); err != nil {
		return err
	}
	if err := a.fault(StepSendNotif); err != nil {
		return err
	}
	ri := a.remotes[agent]
	if ri == nil {
		return nixl.Errorf(nixl.ErrNotFound, "SendNotif", "no metadata loaded for agent %q", agent)
	}
	if ri.agent.dead || ri.agent.closed {
		return nixl.Errorf(nixl.ErrRemoteDiscon, "SendNotif", "agent %q disconnected", agent)
	}
	a.e.deliverLocked(a, ri.agent, msg)
	return nil
}

func (a *Agent) GetNotifs() ([]nixl.Notif, error) {
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	return a.takeNotifsLocked()
}

// TryGetNotifs is nixl.TryNotifier's: GetNotifs, unless a test holds the
// engine (Engine.Hold), as TryCheck.
func (a *Agent) TryGetNotifs() ([]nixl.Notif, error, bool) {
	if a.e.holding.Load() {
		return nil, nil, false
	}
	n, err := a.GetNotifs()
	return n, err, true
}

func (a *Agent) takeNotifsLocked() ([]nixl.Notif, error) {
	a.record("GetNotifs", "")
	if err := a.live("GetNotifs"); err != nil {
		return nil, err
	}
	if err := a.fault(StepGetNotifs); err != nil {
		return nil, err
	}
	out := a.inbox
	a.inbox = nil
	return out, nil
}

func (a *Agent) Close() error {
	a.e.mu.Lock()
	defer a.e.mu.Unlock()
	if a.closed {
		return nil
	}
	a.record("Close", "")
	a.closed = true
	if a.e.agents[a.cfg.Name] == a {
		delete(a.e.agents, a.cfg.Name)
	}
	return nil
}

// String summarises the recorded calls, for test failure messages.
func (a *Agent) String() string {
	calls := a.Calls()
	counts := map[string]int{}
	for _, c := range calls {
		counts[c.Op]++
	}
	keys := make([]string, 0, len(counts))
	for k := range counts {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	fmt.Fprintf(&b, "fake agent %q:", a.cfg.Name)
	for _, k := range keys {
		fmt.Fprintf(&b, " %s×%d", k, counts[k])
	}
	return b.String()
}
