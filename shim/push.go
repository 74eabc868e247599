// Push mode (vLLM's NixlPushConnector): the decode allocates its blocks
// first and registers them with the prefill; the prefill WRITEs its KV into
// them and the WRITE's notification tells the decode the KV has landed.
//
// Wire format, as vLLM 0.32 speaks it (read from its push_scheduler.py and
// push_worker.py):
//   - registration, decode -> every prefill rank it handshook with, a NIXL
//     notification: "PUSH_REG:" + msgpack map of request_id (the decode's
//     request id), decode_engine_id, decode_host, decode_port,
//     decode_tp_size, local_block_ids (per KV-cache group), remote_engine_id,
//     remote_host, remote_port, remote_tp_size, remote_pp_size;
//   - completion, the WRITE's notification: "<decode request id>:<prefill
//     tp_size>"; the decode waits for pp_size * max(1, P tp / D tp) of them;
//   - a prefill request and a registration belong together when their
//     request ids are equal, or equal once vLLM's "-<8 hex>" suffix is cut
//     from both (the proxy sends one X-Request-Id to both).
//
// gonixl adds, between gonixl engines only (a stock engine would read any
// other notification as "<id>:<n>"): "GONIXL_PUSH_FAILED:<decode request
// id>" when a WRITE failed, so the decode fails the request at once instead
// of waiting for push_registration_timeout; and "GONIXL_PUSH_CANCEL:<id>"
// from a decode that gave up waiting, answered "GONIXL_PUSH_CANCELLED:<id>"
// once no WRITE into its blocks can happen any more: only then does the
// decode give its blocks back to vLLM. Where vLLM's decode only logs a
// timed-out registration and waits for ever, gonixl's fails the request
// (kv_load_failure_policy) within push_registration_timeout.
//
// This version pushes between engines of equal tp_size and block size;
// other pairings are refused with a clear error on both sides.

package shim

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"math"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
)

const (
	pushRegPrefix       = "PUSH_REG:"
	pushFailedPrefix    = "GONIXL_PUSH_FAILED:"
	pushCancelPrefix    = "GONIXL_PUSH_CANCEL:"
	pushCancelledPrefix = "GONIXL_PUSH_CANCELLED:"
	// maxPushRegs bounds the registrations a prefill keeps while their
	// requests have not finished (a decode's word, so bounded).
	maxPushRegs = 1 << 14
	// maxPushRegBytes bounds one registration notification.
	maxPushRegBytes = 8 << 20
)

// pushReg is a decode's registration of its blocks for one request.
type pushReg struct {
	RequestID      string
	DecodeEngineID string
	DecodeHost     string
	DecodePort     int
	DecodeTPSize   int
	LocalBlockIDs  BlockIDs
	RemoteEngineID string
	RemoteHost     string
	RemotePort     int
	RemoteTPSize   int
	RemotePPSize   int
	// PromptDigest (gonixl's key gonixl_prompt_digest, "" from a stock
	// decode): the digest of the decode's prompt.
	PromptDigest string
	received     float64 // prefill's clock
}

// encodePushReg writes the registration notification with vLLM's keys, in
// its order, integers in their smallest msgpack form (msgspec's encoding).
func encodePushReg(r *pushReg) ([]byte, error) {
	var buf bytes.Buffer
	buf.WriteString(pushRegPrefix)
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	str := func(k, v string) error {
		if err := enc.EncodeString(k); err != nil {
			return err
		}
		return enc.EncodeString(v)
	}
	num := func(k string, v int) error {
		if err := enc.EncodeString(k); err != nil {
			return err
		}
		return enc.EncodeInt(int64(v))
	}
	n := 11
	if r.PromptDigest != "" {
		n++
	}
	steps := []func() error{
		func() error { return enc.EncodeMapLen(n) },
		func() error { return str("request_id", r.RequestID) },
		func() error { return str("decode_engine_id", r.DecodeEngineID) },
		func() error { return str("decode_host", r.DecodeHost) },
		func() error { return num("decode_port", r.DecodePort) },
		func() error { return num("decode_tp_size", r.DecodeTPSize) },
		func() error {
			if err := enc.EncodeString("local_block_ids"); err != nil {
				return err
			}
			if err := enc.EncodeArrayLen(len(r.LocalBlockIDs)); err != nil {
				return err
			}
			for _, g := range r.LocalBlockIDs {
				if err := enc.EncodeArrayLen(len(g)); err != nil {
					return err
				}
				for _, b := range g {
					if err := enc.EncodeInt(b); err != nil {
						return err
					}
				}
			}
			return nil
		},
		func() error { return str("remote_engine_id", r.RemoteEngineID) },
		func() error { return str("remote_host", r.RemoteHost) },
		func() error { return num("remote_port", r.RemotePort) },
		func() error { return num("remote_tp_size", r.RemoteTPSize) },
		func() error { return num("remote_pp_size", r.RemotePPSize) },
		func() error {
			if r.PromptDigest == "" {
				return nil
			}
			return str("gonixl_prompt_digest", r.PromptDigest)
		},
	}
	for _, f := range steps {
		if err := f(); err != nil {
			return nil, err
		}
	}
	return buf.Bytes(), nil
}

// decodePushReg parses a registration (without its prefix). It reads the
// keys vLLM's prefill reads; anything malformed is an error naming the key.
// local_block_ids may also be one flat list (a single group), as vLLM
// accepts.
func decodePushReg(b []byte) (*pushReg, error) {
	if len(b) > maxPushRegBytes {
		return nil, fmt.Errorf("registration of %d bytes (limit %d)", len(b), maxPushRegBytes)
	}
	if err := checkMsgpack(b, 8); err != nil {
		return nil, err
	}
	var m map[string]any
	dec := msgpack.NewDecoder(bytes.NewReader(b))
	dec.UseLooseInterfaceDecoding(true)
	if err := dec.Decode(&m); err != nil {
		return nil, fmt.Errorf("not a msgpack map: %w", err)
	}
	r := &pushReg{}
	var err error
	str := func(k string) string {
		if err != nil {
			return ""
		}
		v, ok := m[k].(string)
		if !ok || v == "" {
			err = fmt.Errorf("%s: want a non-empty string, got %T", k, m[k])
		}
		return v
	}
	num := func(k string, lo, hi int64) int {
		if err != nil {
			return 0
		}
		v, ok := asInt64(m[k])
		if !ok || v < lo || v > hi {
			err = fmt.Errorf("%s: want an integer in [%d, %d], got %v", k, lo, hi, m[k])
		}
		return int(v)
	}
	r.RequestID = str("request_id")
	r.DecodeEngineID = str("decode_engine_id")
	r.DecodeHost = str("decode_host")
	r.DecodePort = num("decode_port", 1, 65535)
	r.DecodeTPSize = num("decode_tp_size", 1, 1<<16)
	if err != nil {
		return nil, err
	}
	if d, ok := m["gonixl_prompt_digest"]; ok {
		if r.PromptDigest, ok = d.(string); !ok || len(r.PromptDigest) > 256 {
			return nil, fmt.Errorf("gonixl_prompt_digest: want a short string, got %T", d)
		}
	}
	groups, ok := m["local_block_ids"].([]any)
	if !ok {
		return nil, fmt.Errorf("local_block_ids: want a list, got %T", m["local_block_ids"])
	}
	if len(groups) > 0 {
		if _, flat := asInt64(groups[0]); flat {
			groups = []any{groups}
		}
	}
	for gi, g := range groups {
		ids, ok := g.([]any)
		if !ok {
			return nil, fmt.Errorf("local_block_ids[%d]: want a list, got %T", gi, g)
		}
		out := make([]int64, len(ids))
		for i, v := range ids {
			n, ok := asInt64(v)
			if !ok || n < 0 || n > math.MaxInt32 {
				return nil, fmt.Errorf("local_block_ids[%d][%d]: want a block id, got %v", gi, i, v)
			}
			out[i] = n
		}
		r.LocalBlockIDs = append(r.LocalBlockIDs, out)
	}
	return r, nil
}

// asInt64 reads an integer of a loosely decoded msgpack value (int64 or
// uint64: decodePushReg's decoder gives no other integer types).
func asInt64(v any) (int64, bool) {
	switch t := v.(type) {
	case int64:
		return t, true
	case uint64:
		if t > math.MaxInt64 {
			return 0, false
		}
		return int64(t), true
	}
	return 0, false
}

// vllmSuffix is the "-<8 hex>" vLLM appends to a client's request id.
var vllmSuffix = regexp.MustCompile(`(?i)-[0-9a-f]{8}$`)

// baseRequestID is vLLM's get_base_request_id: the id without that suffix.
func baseRequestID(id string) string { return vllmSuffix.ReplaceAllString(id, "") }

// ---------------------------------------------------------------------------
// Decode side
// ---------------------------------------------------------------------------

// registerPushLocked sends st's registration to every rank of the prefill
// re it handshook with, and starts waiting for the WRITE.
func (w *Worker) registerPushLocked(st *recvState, re *remoteEngine) {
	if err := w.pushPairingError(re); err != nil {
		w.stats.RecordFailedTransfer()
		w.failLocked(st, "transfer_setup_failed", fmt.Sprintf("push from engine %s", re.id), err)
		return
	}
	msg, err := encodePushReg(w.pushRegOf(st))
	if err != nil {
		w.failLocked(st, "transfer_setup_failed", "encode the push registration", err)
		return
	}
	sent := 0
	for _, a := range re.agents() {
		if err := w.agent.SendNotif(a, msg); err != nil {
			w.stats.RecordFailedNotification()
			w.logFailure("push_reg_notif_failed", st, "remote agent "+a, err)
			continue
		}
		sent++
	}
	if sent == 0 {
		w.stats.RecordFailedTransfer()
		w.failLocked(st, "push_reg_notif_failed", fmt.Sprintf("no rank of engine %s took the registration", re.id), nil)
		return
	}
	now := w.clock()
	st.remote = re
	st.push = &pushWait{deadline: now + w.cfg.PushRegistrationTimeout, want: max(st.meta.PPSize, 1) * max(1, re.plan.remoteTP/max(w.cfg.TPSize, 1))}
	w.touchRemoteLocked(re)
}

// pushRegOf is the registration of decode request st.
func (w *Worker) pushRegOf(st *recvState) *pushReg {
	rm := &st.meta.Remote
	return &pushReg{
		RequestID: st.id, DecodeEngineID: w.cfg.EngineID, DecodeHost: w.cfg.SideChannelHost,
		DecodePort: w.cfg.SideChannelPort + w.cfg.DPIndex, DecodeTPSize: w.cfg.TPSize, LocalBlockIDs: st.meta.LocalBlockIDs,
		RemoteEngineID: rm.EngineID, RemoteHost: rm.Host, RemotePort: rm.Port, RemoteTPSize: st.meta.TPSize, RemotePPSize: max(st.meta.PPSize, 1),
		PromptDigest: st.meta.PromptDigest,
	}
}

// pushWait is a decode request's wait for the prefill's WRITE.
type pushWait struct {
	deadline float64 // this worker's clock
	want     int     // completion notifications that make the KV complete
	got      int
	done     bool // complete, or failed with nothing more to wait for
	// cancelled: the wait timed out and the prefill (a gonixl engine) was
	// asked to drop the registration; the blocks stay held until it
	// answers, its WRITE's notification arrives, or it is gone.
	cancelled bool
	holdUntil float64 // a cancelled wait gives up holding at this time
}

// pushPairingError says why this engine cannot push with re. Handled:
// equal block sizes, and equal tp_size or different ones where every rank
// holds distinct KV heads (a prefill rank then writes its whole blocks into
// its heads' slice of a decode rank's blocks, or each slice of its blocks
// into one decode rank: the tp plan's slices and slots, as a READ uses
// them). Replicated KV heads (fewer heads than a side's tp_size) and MLA
// across tp sizes are refused.
func (w *Worker) pushPairingError(re *remoteEngine) error {
	if re.blockRatio != 1 {
		return errors.New("push between different block sizes is not supported by gonixl yet (pull mode supports a smaller prefill block size)")
	}
	pl := re.plan
	if pl.remoteTP == w.cfg.TPSize {
		return nil
	}
	if pl.mla {
		return fmt.Errorf("push of an MLA cache between tp_size %d and %d is not supported by gonixl yet", w.cfg.TPSize, pl.remoteTP)
	}
	if heads := int(w.geometryOf(w.layout).NumKVHeads); heads < max(pl.localTP, pl.remoteTP) {
		return fmt.Errorf("push between tp_size %d and %d with %d KV heads (replicated on some ranks) is not supported by gonixl yet", w.cfg.TPSize, pl.remoteTP, heads)
	}
	return nil
}

// pushNotifLocked takes a decode-side push notification (a WRITE's
// completion or a gonixl prefill's word); false if it is not one.
func (w *Worker) pushNotifLocked(from, msg string) bool {
	var id string
	switch {
	case strings.HasPrefix(msg, pushFailedPrefix):
		id = strings.TrimPrefix(msg, pushFailedPrefix)
	case strings.HasPrefix(msg, pushCancelledPrefix):
		id = strings.TrimPrefix(msg, pushCancelledPrefix)
	default:
		i := strings.LastIndexByte(msg, ':')
		if i <= 0 {
			return false
		}
		if _, err := strconv.Atoi(msg[i+1:]); err != nil {
			return false
		}
		id = msg[:i]
	}
	st, ok := w.recv[id]
	if !ok || st.push == nil {
		return false
	}
	pw := st.push
	switch {
	case strings.HasPrefix(msg, pushFailedPrefix):
		if !st.failed {
			w.stats.RecordFailedTransfer()
			w.failLocked(st, "transfer_failed", fmt.Sprintf("the prefill's WRITE failed (engine %s, agent %s)", st.meta.Remote.EngineID, from), nil)
		}
		pw.done = true
	case strings.HasPrefix(msg, pushCancelledPrefix):
		pw.done = true // nothing will be written any more
	default:
		pw.got++
		if pw.got >= pw.want {
			pw.done = true
		}
	}
	if st.remote != nil {
		w.touchRemoteLocked(st.remote)
	}
	return true
}

// pollPushWaitsLocked finishes decode requests whose WRITE completed and
// fails those that waited past push_registration_timeout.
func (w *Worker) pollPushWaitsLocked() {
	now := w.clock()
	ids := make([]string, 0)
	for id, st := range w.recv {
		if st.push != nil {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	for _, id := range ids {
		st := w.recv[id]
		pw := st.push
		if !pw.done && !pw.cancelled && now >= pw.deadline {
			w.stats.RecordFailedTransfer()
			w.failLocked(st, "push_registration_timeout", fmt.Sprintf("no WRITE from engine %s within push_registration_timeout=%gs", st.meta.Remote.EngineID, w.cfg.PushRegistrationTimeout), nil)
			w.cancelPushLocked(st, now)
		}
		if pw.cancelled && !pw.done && now >= pw.holdUntil {
			w.log.Warn("push: giving a timed-out request's blocks back to vLLM without word from the prefill", zap.String("request_id", id),
				zap.String("remote_engine_id", st.meta.Remote.EngineID), zap.Float64("held_seconds", now-pw.deadline))
			pw.done = true
		}
		if !pw.done {
			continue
		}
		delete(w.recv, id)
		w.done.Recving = append(w.done.Recving, id)
		if st.failed {
			w.reportFailedLocked(st)
		}
	}
}

// pushAbortedLocked ends the waits of requests vLLM finished (aborted)
// before their WRITE came, as a timeout would, at once.
func (w *Worker) pushAbortedLocked(ids []string) {
	now := w.clock()
	for _, id := range ids {
		st, ok := w.recv[id]
		if !ok || st.push == nil || st.push.done || st.push.cancelled {
			continue
		}
		st.failed = true // its KV never came; vLLM no longer waits for it
		w.cancelPushLocked(st, now)
	}
}

// cancelPushLocked stops waiting for st's WRITE: the failure is reported
// now, the blocks stay held (finished_recving withheld) until it is known
// that no WRITE will land in them. A gonixl prefill says so when asked. A
// stock one cannot be asked and keeps a registration for ever (a later
// request with the same client id would match it): the blocks stay held
// until that engine is gone, a bounded leak rather than a WRITE into
// blocks vLLM gave to another request.
func (w *Worker) cancelPushLocked(st *recvState, now float64) {
	pw := st.push
	w.reportFailedLocked(st)
	pw.cancelled = true
	pw.holdUntil = math.Inf(1)
	re := st.remote
	if re == nil || !re.gonixl {
		w.log.Warn("push: a failed request's blocks stay held until its stock prefill engine is gone (it cannot be told to drop the registration)",
			zap.String("request_id", st.id), zap.String("remote_engine_id", st.meta.Remote.EngineID), zap.Int("blocks", st.meta.LocalBlockIDs.Count()))
		return
	}
	pw.holdUntil = now + 2*w.cfg.KVLeaseDuration // its answer normally comes at once
	// The registration again, under another prefix: the prefill may not
	// know this engine yet, and answers at its address.
	msg, err := encodePushReg(w.pushRegOf(st))
	if err != nil {
		return
	}
	msg = append([]byte(pushCancelPrefix), msg[len(pushRegPrefix):]...)
	for _, a := range re.agents() {
		if err := w.agent.SendNotif(a, msg); err != nil {
			w.stats.RecordFailedNotification()
		}
	}
}

// pushWaitGoneLocked ends the waits on a prefill engine that died or was
// dropped: no WRITE from it can come any more.
func (w *Worker) pushWaitGoneLocked(engineID string) {
	for _, st := range w.recv {
		if st.push == nil || st.push.done || st.meta.Remote.EngineID != engineID {
			continue
		}
		if !st.failed {
			w.stats.RecordFailedTransfer()
			w.failLocked(st, "transfer_failed", fmt.Sprintf("prefill engine %s is gone before its WRITE", engineID), nil)
		}
		st.push.done = true
	}
}

// ---------------------------------------------------------------------------
// Prefill side
// ---------------------------------------------------------------------------

// pushSend is a prefill request in push mode: its finished blocks, the
// registration they go to, and the WRITEs in flight.
type pushSend struct {
	id     string // this engine's request id
	blocks BlockIDs
	digest string // its prompt's digest ("" when not known)
	reg    *pushReg
	engine string // the decode engine's id, once matched
	xfers  []*inflight
	waitHS bool
	// early: announced by PushEarly, its request_finished (and so its
	// lease) not seen yet. computing: the forward that writes its blocks
	// may still be running (no WRITE before the next GetFinished).
	early, computing bool
	since            float64 // when it was announced (early pushes)
}

// pushFinishedLocked records the step's finished requests' blocks and
// starts the WRITEs whose registrations already arrived.
func (w *Worker) pushFinishedLocked(m *StepMeta) {
	for _, id := range slices.Sorted(maps.Keys(m.PushFinished)) {
		if _, ok := w.toProcess[id]; !ok {
			continue
		}
		if _, done := w.pushEarlyDone[id]; done {
			// Its early WRITE already ended (or failed): its blocks are
			// free to go.
			delete(w.pushEarlyDone, id)
			w.held.Drop(id)
			delete(w.toProcess, id)
			w.done.Sending = append(w.done.Sending, id)
			continue
		}
		if ps, dup := w.pushSends[id]; dup {
			ps.early = false // now held under its lease, as any other
			continue
		}
		pf := m.PushFinished[id]
		ps := &pushSend{id: id, blocks: pf.Blocks, digest: pf.PromptDigest}
		w.pushSends[id] = ps
		w.pushOrder = append(w.pushOrder, id)
		if reg := w.takeRegLocked(id); reg != nil {
			w.startPushLocked(ps, reg)
		}
	}
}

// pushEarlyLocked takes the step's requests whose prompt its forward
// completes (Scheduler.PushPromptDone): each is matched with its
// registration at once (handshaking if needed), and WRITTEN from the next
// GetFinished on, which vLLM calls after the step's forward, or right away
// when the registration comes later.
func (w *Worker) pushEarlyLocked(m *StepMeta) {
	if len(m.PushEarly) == 0 {
		return
	}
	now := w.clock()
	for _, id := range slices.Sorted(maps.Keys(m.PushEarly)) {
		if _, dup := w.pushSends[id]; dup {
			continue
		}
		pf := m.PushEarly[id]
		ps := &pushSend{id: id, blocks: pf.Blocks, digest: pf.PromptDigest, early: true, computing: true, since: now}
		w.pushSends[id] = ps
		w.pushOrder = append(w.pushOrder, id)
		w.pushComputing = append(w.pushComputing, id)
		if reg := w.takeRegLocked(id); reg != nil {
			w.startPushLocked(ps, reg)
		}
	}
}

// pushComputedLocked marks the early pushes of the last start_load_kv
// computed (GetFinished runs after the step's forward) and WRITEs those
// already matched.
func (w *Worker) pushComputedLocked() {
	ids := w.pushComputing
	if len(ids) == 0 {
		return
	}
	w.pushComputing = nil
	for _, id := range ids {
		ps := w.pushSends[id]
		if ps == nil || !ps.computing {
			continue
		}
		ps.computing = false
		if ps.reg != nil && !ps.waitHS && len(ps.xfers) == 0 {
			w.startPushLocked(ps, ps.reg)
		}
	}
}

// takeRegLocked removes and returns the registration for prefill request
// id: the one with the same id, else the oldest with the same base id.
func (w *Worker) takeRegLocked(id string) *pushReg {
	if r, ok := w.pushRegs[id]; ok {
		w.dropRegLocked(id)
		return r
	}
	base := baseRequestID(id)
	for _, rid := range w.pushRegOrder {
		if baseRequestID(rid) == base {
			r := w.pushRegs[rid]
			w.dropRegLocked(rid)
			return r
		}
	}
	return nil
}

func (w *Worker) dropRegLocked(id string) {
	delete(w.pushRegs, id)
	if i := slices.Index(w.pushRegOrder, id); i >= 0 {
		w.pushRegOrder = append(w.pushRegOrder[:i], w.pushRegOrder[i+1:]...)
	}
}

// takeSendLocked is takeRegLocked's mirror: the finished, unmatched
// request for registration id.
func (w *Worker) takeSendLocked(id string) *pushSend {
	if ps, ok := w.pushSends[id]; ok && ps.reg == nil {
		return ps
	}
	base := baseRequestID(id)
	for _, pid := range w.pushOrder {
		if ps := w.pushSends[pid]; ps != nil && ps.reg == nil && baseRequestID(pid) == base {
			return ps
		}
	}
	return nil
}

// pushRegLocked takes a registration notification.
func (w *Worker) pushRegLocked(from string, payload []byte) {
	reg, err := decodePushReg(payload)
	if err != nil {
		w.log.Warn("push: malformed PUSH_REG notification dropped", zap.String("from", from), zap.Error(err))
		return
	}
	reg.received = w.clock()
	if ps := w.takeSendLocked(reg.RequestID); ps != nil {
		w.startPushLocked(ps, reg)
		return
	}
	if _, dup := w.pushRegs[reg.RequestID]; dup {
		return // another decode rank's copy (several ranks register with this one)
	}
	if len(w.pushRegs) >= maxPushRegs {
		w.log.Warn("push: too many registrations waiting for their requests; dropping the oldest", zap.Int("limit", maxPushRegs))
		w.dropRegLocked(w.pushRegOrder[0])
	}
	w.pushRegs[reg.RequestID] = reg
	w.pushRegOrder = append(w.pushRegOrder, reg.RequestID)
}

// startPushLocked pairs ps with its registration and WRITEs, handshaking
// with the decode first where needed.
func (w *Worker) startPushLocked(ps *pushSend, reg *pushReg) {
	ps.reg, ps.engine = reg, reg.DecodeEngineID
	re, ok := w.remotes[reg.DecodeEngineID]
	if ok && (re.host != reg.DecodeHost || re.port != reg.DecodePort) {
		ok = false
	}
	if !ok {
		ps.waitHS = true
		w.startPushHandshakeLocked(reg, ps.id)
		return
	}
	if ps.computing {
		return // pushComputedLocked WRITEs it
	}
	w.writeLocked(ps, re)
}

// writeLocked posts the WRITE of ps's blocks into the decode's.
func (w *Worker) writeLocked(ps *pushSend, re *remoteEngine) {
	ps.waitHS = false
	w.touchRemoteLocked(re)
	fail := func(kind string, err error) {
		w.stats.RecordFailedTransfer()
		w.log.Error("NIXL transfer failure: "+kind, zap.String("request_id", ps.id), zap.String("decode_request_id", ps.reg.RequestID),
			zap.String("decode_engine_id", ps.engine), zap.Error(err))
		w.pushFailedLocked(ps, re)
	}
	if err := w.pushPairingError(re); err != nil {
		fail("transfer_setup_failed", err)
		return
	}
	if ps.digest != "" && ps.reg.PromptDigest != "" && ps.digest != ps.reg.PromptDigest {
		// Matched by request id, but the decode's prompt is not this
		// request's (a reused id, a proxy mix-up): writing would give it
		// another prompt's KV.
		fail("transfer_setup_failed", fmt.Errorf("the decode's prompt differs from this request's (gonixl_prompt_digest %s, here %s): not writing", ps.reg.PromptDigest, ps.digest))
		return
	}
	local, remote, err := pairPush(ps.blocks, ps.reg.LocalBlockIDs)
	if err != nil {
		fail("transfer_setup_failed", err)
		return
	}
	for g := range local {
		if err := w.checkBlockRange(local[g], remote[g], re); err != nil {
			fail("transfer_setup_failed", err)
			return
		}
	}
	if local.Empty() {
		// Every block was a prefix hit on the decode: nothing to write,
		// but the decode waits for the notification.
		for _, a := range re.agents() {
			if err := w.agent.SendNotif(a, []byte(ps.reg.RequestID+":"+strconv.Itoa(w.cfg.TPSize))); err != nil {
				w.stats.RecordFailedNotification()
			}
		}
		w.pushSentLocked(ps)
		return
	}
	notif := []byte(ps.reg.RequestID + ":" + strconv.Itoa(w.cfg.TPSize))
	mk := w.xferMakerOp(nixl.Write, local, remote, re.numBlocks)
	for _, rr := range re.ranks {
		if rr.list == nil {
			continue
		}
		// Fewer ranks here than on the decode: this rank's blocks hold
		// several decode ranks' heads, one slot each (localListFor).
		x, err := mk(w.localListFor(re, rr), rr.list, notif)
		if err != nil {
			fail("transfer_setup_failed", err)
			return
		}
		if _, err := x.Post(); err != nil {
			_ = x.Release()
			fail("transfer_failed", err)
			w.dropRemoteOnDisconnect(re, err)
			return
		}
		now := w.clock()
		ps.xfers = append(ps.xfers, &inflight{x: x, posted: now, deadline: now + w.cfg.TransferTimeout})
	}
}

// pairPush pairs a prefill request's blocks with the decode's registered
// ones, group by group: the decode registers only the blocks it did not
// find in its prefix cache, so the prefill's list is cut at its front to
// the decode's length.
func pairPush(prefill, decode BlockIDs) (BlockIDs, BlockIDs, error) {
	if len(prefill) != len(decode) {
		return nil, nil, fmt.Errorf("the decode registered %d KV-cache groups, this request has %d", len(decode), len(prefill))
	}
	l, r := make(BlockIDs, len(prefill)), make(BlockIDs, len(prefill))
	for g := range prefill {
		p, d := prefill[g], decode[g]
		if len(d) > len(p) {
			return nil, nil, fmt.Errorf("group %d: the decode registered %d blocks for a request of %d blocks here: the registration is not this request's", g, len(d), len(p))
		}
		l[g], r[g] = p[len(p)-len(d):], d
	}
	return l, r, nil
}

// pushFailedLocked gives up a push: the prefill's blocks are freed once
// nothing reads them, and a gonixl decode is told at once.
func (w *Worker) pushFailedLocked(ps *pushSend, re *remoteEngine) {
	if re != nil && re.gonixl {
		for _, a := range re.agents() {
			if err := w.agent.SendNotif(a, []byte(pushFailedPrefix+ps.reg.RequestID)); err != nil {
				w.stats.RecordFailedNotification()
			}
		}
	}
	for _, f := range ps.xfers {
		if err := f.x.Release(); err != nil {
			// Still reading our blocks: they are freed at the lease.
			return
		}
	}
	ps.xfers = nil
	w.pushSentLocked(ps)
}

// pushSentLocked frees a finished push's blocks.
func (w *Worker) pushSentLocked(ps *pushSend) {
	delete(w.pushSends, ps.id)
	if i := slices.Index(w.pushOrder, ps.id); i >= 0 {
		w.pushOrder = append(w.pushOrder[:i], w.pushOrder[i+1:]...)
	}
	if ps.early {
		// vLLM has not finished the request yet: its finished_sending
		// waits for the request_finished (pushFinishedLocked).
		w.pushEarlyDone[ps.id] = w.clock()
		return
	}
	if _, held := w.held.Deadline(ps.id); held || w.isToProcess(ps.id) {
		w.held.Drop(ps.id)
		delete(w.toProcess, ps.id)
		w.done.Sending = append(w.done.Sending, ps.id)
	}
}

func (w *Worker) isToProcess(id string) bool {
	_, ok := w.toProcess[id]
	return ok
}

// pollPushSendsLocked polls the WRITEs in flight.
func (w *Worker) pollPushSendsLocked() {
	now := w.clock()
	for _, id := range append([]string(nil), w.pushOrder...) {
		ps := w.pushSends[id]
		if ps == nil || len(ps.xfers) == 0 {
			continue
		}
		kept := ps.xfers[:0]
		failed := false
		for _, f := range ps.xfers {
			status, err := f.x.Check()
			switch {
			case err == nil && status == nixl.Success:
				if t, ts := f.x.Telemetry(); ts == nixl.Success {
					w.stats.RecordTransfer(t.XferDur.Seconds(), t.PostDur.Seconds(), t.Bytes, t.DescCount)
				}
				if rerr := f.x.Release(); rerr != nil {
					w.log.Warn("push: releasing a completed WRITE failed", zap.String("request_id", id), zap.Error(rerr))
				}
			case err == nil && status == nixl.InProgress && now < f.deadline:
				kept = append(kept, f)
			default:
				if err == nil {
					err = fmt.Errorf("WRITE still in flight after transfer_timeout=%gs", w.cfg.TransferTimeout)
				}
				w.stats.RecordFailedTransfer()
				w.log.Error("NIXL transfer failure: transfer_failed", zap.String("request_id", id), zap.String("decode_request_id", ps.reg.RequestID),
					zap.String("decode_engine_id", ps.engine), zap.Error(err))
				kept = append(kept, f)
				failed = true
			}
		}
		ps.xfers = kept
		if failed {
			re := w.remotes[ps.engine]
			w.pushFailedLocked(ps, re)
			if re != nil {
				w.dropRemoteOnDisconnect(re, errors.New("push WRITE failed"))
			}
			continue
		}
		if len(ps.xfers) == 0 {
			w.pushSentLocked(ps)
		}
	}
}

// pushCancelLocked answers a gonixl decode that gave up waiting (payload:
// its registration): the registration is dropped, and once no WRITE into
// its blocks is in flight it is told so, at its address (handshaking with
// it first if this engine never did).
func (w *Worker) pushCancelLocked(from string, payload []byte) {
	reg, err := decodePushReg(payload)
	if err != nil {
		w.log.Warn("push: malformed cancel notification dropped", zap.String("from", from), zap.Error(err))
		return
	}
	id := reg.RequestID
	if _, ok := w.pushRegs[id]; ok {
		w.dropRegLocked(id)
	}
	for _, ps := range w.pushSends {
		if ps.reg != nil && ps.reg.RequestID == id && (len(ps.xfers) > 0 || ps.waitHS) {
			return // its WRITE's notification (or failure) answers
		}
	}
	if re, ok := w.remotes[reg.DecodeEngineID]; ok {
		w.sendCancelledLocked(re, id)
		return
	}
	key := hsKey(reg.DecodeEngineID, reg.DecodeHost, reg.DecodePort)
	w.startHandshakeLocked(reg.DecodeEngineID, reg.DecodeHost, reg.DecodePort, reg.DecodeTPSize, "")
	if hs, ok := w.handshakes[key]; ok {
		hs.cancelReplies = append(hs.cancelReplies, id)
	}
}

func (w *Worker) sendCancelledLocked(re *remoteEngine, id string) {
	for _, a := range re.agents() {
		if err := w.agent.SendNotif(a, []byte(pushCancelledPrefix+id)); err != nil {
			w.stats.RecordFailedNotification()
		}
	}
}

// sweepPushLocked drops registrations that waited longer than
// push_registration_timeout for their request (the decode gave up), and
// pushes whose blocks' lease ended (sweepLeasesLocked frees them).
func (w *Worker) sweepPushLocked() {
	now := w.clock()
	for len(w.pushRegOrder) > 0 {
		r := w.pushRegs[w.pushRegOrder[0]]
		if r != nil && now-r.received < w.cfg.PushRegistrationTimeout {
			break
		}
		w.dropRegLocked(w.pushRegOrder[0])
	}
	// An early push whose request_finished never came (vLLM calls it for
	// every request, within a step or two) is given up after two leases.
	stale := 2 * w.cfg.KVLeaseDuration
	for id, t := range w.pushEarlyDone {
		if now-t > stale {
			delete(w.pushEarlyDone, id)
		}
	}
	for _, id := range append([]string(nil), w.pushOrder...) {
		ps := w.pushSends[id]
		if ps == nil || len(ps.xfers) > 0 || ps.waitHS {
			continue
		}
		if ps.early && now-ps.since <= stale {
			continue // not held before its request_finished
		}
		if _, held := w.held.Deadline(id); !held {
			// The lease ended (its blocks are freed) before a decode
			// registered: nothing will be written.
			delete(w.pushSends, id)
			w.pushOrder = slices.DeleteFunc(w.pushOrder, func(x string) bool { return x == id })
		}
	}
}

// startPushHandshakeLocked handshakes with a registration's decode engine;
// the push of prefill request id waits for it (finishHandshake).
func (w *Worker) startPushHandshakeLocked(reg *pushReg, id string) {
	key := hsKey(reg.DecodeEngineID, reg.DecodeHost, reg.DecodePort)
	w.startHandshakeLocked(reg.DecodeEngineID, reg.DecodeHost, reg.DecodePort, reg.DecodeTPSize, "")
	hs, ok := w.handshakes[key]
	if !ok {
		// Refused before any network work (hsguard): give the push up.
		w.stats.RecordFailedHandshake()
		w.log.Error("NIXL transfer failure: push_handshake_failed", zap.String("request_id", id),
			zap.String("decode_engine_id", reg.DecodeEngineID), zap.String("decode", fmt.Sprintf("%s:%d", reg.DecodeHost, reg.DecodePort)))
		if ps := w.pushSends[id]; ps != nil {
			w.pushFailedLocked(ps, nil)
		}
		return
	}
	hs.pushWaiting = append(hs.pushWaiting, id)
}

// pushHandshakeDoneLocked continues the pushes and cancel answers that
// waited for a handshake with a decode engine (re nil: it failed).
func (w *Worker) pushHandshakeDoneLocked(hs *handshakeState, re *remoteEngine, err error) {
	if err == nil {
		for _, id := range hs.cancelReplies {
			w.sendCancelledLocked(re, id)
		}
	}
	ids := hs.pushWaiting
	for _, id := range ids {
		ps := w.pushSends[id]
		if ps == nil || !ps.waitHS {
			continue
		}
		if err != nil {
			w.log.Error("NIXL transfer failure: push_handshake_failed", zap.String("request_id", id),
				zap.String("decode_engine_id", ps.engine), zap.Error(err))
			w.pushFailedLocked(ps, nil)
			continue
		}
		if ps.computing {
			ps.waitHS = false // pushComputedLocked WRITEs it
			continue
		}
		w.writeLocked(ps, re)
	}
}
