package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Push mode: both sides run vLLM's push connector. The decode allocates
// its blocks and registers them with the prefill, which WRITEs its KV into
// them; the decode needs the prefill's identity (engine id, side-channel
// address, tp and pp size) and one request id shared with the prefill's
// request (vLLM pairs them by the X-Request-Id both receive). A prefill's
// identity comes from its first answer (kv_transfer_params), which is
// relayed as in pull mode; after that the two requests go out at once,
// saving the prefill's round trip before the decode starts. A prefill that
// answers with transfer_mode other than "push" is always served in
// sequence, and a decode failure forgets the prefill's identity (it may
// have restarted as another engine).

// pushIdentity is what a decode needs to register with a prefill.
type pushIdentity struct {
	EngineID string `json:"remote_engine_id"`
	Host     string `json:"remote_host"`
	Port     int    `json:"remote_port"`
	TPSize   int    `json:"tp_size"`
	PPSize   int    `json:"pp_size"`
	Mode     string `json:"transfer_mode"`
}

var errPrefillFailed = errors.New("the prefill request failed")

func (p *Proxy) pushIdentityOf(pi Instance) (pushIdentity, bool) {
	p.pushMu.Lock()
	defer p.pushMu.Unlock()
	id, ok := p.pushIDs[pi]
	return id, ok && id.Mode == "push"
}

func (p *Proxy) setPushIdentity(pi Instance, params object) {
	raw, err := params.marshal()
	if err != nil {
		return
	}
	var id pushIdentity
	if json.Unmarshal(raw, &id) != nil || id.EngineID == "" || id.Host == "" || id.Port <= 0 {
		return
	}
	if id.TPSize <= 0 {
		id.TPSize = 1
	}
	if id.PPSize <= 0 {
		id.PPSize = 1
	}
	p.pushMu.Lock()
	defer p.pushMu.Unlock()
	if p.pushIDs == nil {
		p.pushIDs = map[Instance]pushIdentity{}
	}
	if old, ok := p.pushIDs[pi]; !ok || old != id {
		p.cfg.Logger.Info("prefill identity learned", zap.Stringer("prefill", pi), zap.String("engine_id", id.EngineID),
			zap.String("transfer_mode", id.Mode))
	}
	p.pushIDs[pi] = id
}

func (p *Proxy) forgetPushIdentity(pi Instance) {
	p.pushMu.Lock()
	defer p.pushMu.Unlock()
	delete(p.pushIDs, pi)
}

// servePush serves one client request in push mode.
func (p *Proxy) servePush(ex *exchange) {
	pi, di := p.nextPrefill(), p.nextDecode()
	pbody, err := toyPrefillBody(ex.body)
	if err != nil {
		writeError(ex.w, http.StatusBadRequest, "invalid_request_error", "invalid_json", err.Error())
		return
	}
	id, known := p.pushIdentityOf(pi)
	if !known {
		// First contact (or a prefill that does not push): in sequence,
		// and learn who the prefill is from its answer.
		presp, ue := p.prefill(ex, pi, pbody)
		if ue != nil {
			p.writeFailure(ex.w, ex.r, ue)
			return
		}
		d := ex.body.clone()
		if kv, ok := kvParams(presp); ok {
			if p.cfg.Mode == ModeMultiturn {
				// As the multi-turn proxy does in pull mode: the prefill's
				// side channel at the host the proxy reaches it at.
				if b, err := withRemoteHost(kv, pi.Host); err == nil {
					presp["kv_transfer_params"] = b
					kv, _ = kvParams(presp)
				}
			}
			p.setPushIdentity(pi, kv)
			d["kv_transfer_params"] = presp["kv_transfer_params"]
		} else {
			delete(d, "kv_transfer_params")
		}
		dbody, err := d.marshal()
		if err != nil {
			writeError(ex.w, http.StatusInternalServerError, "internal_error", "internal_error", err.Error())
			return
		}
		ex.logAt(zapcore.DebugLevel, "routing", zap.Stringer("prefill", pi), zap.Stringer("decode", di), zap.Duration("prefill_took", ex.prefillDur), zap.Bool("concurrent", false))
		p.relayDecode(ex, di, dbody)
		return
	}
	d := ex.body.clone()
	params, _ := json.Marshal(map[string]any{
		"do_remote_prefill": true, "do_remote_decode": false,
		"remote_engine_id": id.EngineID, "remote_host": id.Host, "remote_port": id.Port,
		"tp_size": id.TPSize, "pp_size": id.PPSize,
		"remote_request_id": ex.reqID, "transfer_mode": "push",
	})
	d["kv_transfer_params"] = params
	dbody, err := d.marshal()
	if err != nil {
		writeError(ex.w, http.StatusInternalServerError, "internal_error", "internal_error", err.Error())
		return
	}
	// The decode's request is cancelled if the prefill's fails: no WRITE
	// would come, and its blocks would wait for push_registration_timeout.
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	dex := *ex
	dex.abort = ctx
	pex := *ex
	pdone := make(chan *upstreamError, 1)
	go func() {
		_, ue := p.prefill(&pex, pi, pbody)
		if ue != nil {
			cancel(errPrefillFailed)
		}
		pdone <- ue
	}()
	ex.logAt(zapcore.DebugLevel, "routing", zap.Stringer("prefill", pi), zap.Stringer("decode", di), zap.Bool("concurrent", true))
	start := time.Now()
	resp, dctx, dcancel, timer, ue := p.openDecode(&dex, di, dbody)
	if ue != nil {
		switch {
		case errors.Is(context.Cause(ctx), errPrefillFailed):
			ue = <-pdone // the prefill's failure is the one to report
		case ex.r.Context().Err() != nil:
			// The client went away: nothing is known about the decode or
			// the prefill. Forgetting the identity would send the next
			// requests in sequence, and a push prefill admits a request no
			// decode has registered for only within its unclaimed budget.
		default:
			p.forgetPushIdentity(pi)
		}
		p.writeFailure(ex.w, ex.r, ue)
		return
	}
	p.relayOpened(&dex, di, start, resp, dctx, dcancel, timer)
	if pue := <-pdone; pue != nil {
		ex.logAt(zapcore.WarnLevel, "the prefill request failed while its decode answered", zap.Stringer("prefill", pi), zap.Error(pue.err))
	} else {
		ex.prefillDur = pex.prefillDur
	}
}
