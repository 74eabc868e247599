package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// serveToy is toy_proxy_server.py's request path: prefill with one token,
// then relay the decode instance's response body unchanged.
func (p *Proxy) serveToy(ex *exchange) {
	if p.cfg.Push {
		p.servePush(ex)
		return
	}
	pi := p.nextPrefill()
	pbody, err := toyPrefillBody(ex.body)
	if err != nil {
		writeError(ex.w, http.StatusBadRequest, "invalid_request_error", "invalid_json", err.Error())
		return
	}
	presp, ue := p.prefill(ex, pi, pbody)
	if ue != nil {
		p.writeFailure(ex.w, ex.r, ue)
		return
	}
	// The decode instance gets the client's body unchanged, plus the prefill
	// instance's kv_transfer_params when it returned any. A client's own
	// kv_transfer_params never reach it unless configured.
	dbody := ex.raw
	fromPrefill := hasKVParams(presp)
	if fromPrefill || (ex.body.has("kv_transfer_params") && !p.cfg.ForwardClientKVParams) {
		d := ex.body.clone()
		if fromPrefill {
			d["kv_transfer_params"] = presp["kv_transfer_params"]
		} else {
			delete(d, "kv_transfer_params")
		}
		if dbody, err = d.marshal(); err != nil {
			writeError(ex.w, http.StatusInternalServerError, "internal_error", "internal_error", err.Error())
			return
		}
	}
	di := p.nextDecode()
	ex.logAt(zapcore.DebugLevel, "routing", zap.Stringer("prefill", pi), zap.Stringer("decode", di), zap.Duration("prefill_took", ex.prefillDur))
	p.relayDecode(ex, di, dbody)
}

// relayDecode streams a decode instance's response to the client, flushing
// after every read so that server-sent events pass as they arrive.
func (p *Proxy) relayDecode(ex *exchange, di Instance, body []byte) {
	start := time.Now()
	resp, ctx, cancel, timer, ue := p.openDecode(ex, di, body)
	if ue != nil {
		p.writeFailure(ex.w, ex.r, ue)
		return
	}
	p.relayOpened(ex, di, start, resp, ctx, cancel, timer)
}

// relayOpened is relayDecode once the decode's response headers arrived.
func (p *Proxy) relayOpened(ex *exchange, di Instance, start time.Time, resp *http.Response, ctx context.Context, cancel context.CancelCauseFunc, timer *upstreamTimer) {
	defer cancel(nil)
	defer timer.stop()
	defer resp.Body.Close()

	h := ex.w.Header()
	if ct := resp.Header.Get("Content-Type"); ct != "" {
		h.Set("Content-Type", ct)
	} else {
		h.Set("Content-Type", "application/json")
	}
	if cl := resp.Header.Get("Content-Length"); cl != "" {
		h.Set("Content-Length", cl)
	}
	ex.setServerTiming(h)
	ex.w.WriteHeader(resp.StatusCode)
	// A body of unknown length is a stream: send the headers now and every
	// piece as it arrives. A body of known length is written through the
	// server's buffer and flushed when the handler returns.
	streaming := resp.ContentLength < 0
	if streaming && !bodyBuffered(resp.Body) {
		// Send the headers now, unless the first piece is already here to
		// go out with them in one write.
		ex.w.Flush()
	}

	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	buf := *bp
	for {
		n, rerr := resp.Body.Read(buf)
		if n > 0 {
			timer.progress()
			if _, werr := ex.w.Write(buf[:n]); werr != nil {
				p.m.errors.WithLabelValues(roleClient, "canceled").Inc()
				ex.logAt(zapcore.DebugLevel, "client write failed", zap.Error(werr))
				return
			}
			if streaming {
				ex.w.Flush()
			}
		}
		if rerr == io.EOF {
			p.m.decodeTotal.Observe(time.Since(start).Seconds())
			return
		}
		if rerr != nil {
			p.abortStream(ex, di, reasonOf(ctx, rerr), rerr)
		}
	}
}

// abortStream ends a response whose headers are already sent: the client
// connection is aborted so that the client sees a truncated stream instead of
// a clean end.
func (p *Proxy) abortStream(ex *exchange, di Instance, reason string, err error) {
	if ex.r.Context().Err() != nil {
		p.m.errors.WithLabelValues(roleClient, "canceled").Inc()
		ex.logAt(zapcore.DebugLevel, "client disconnected during the decode stream")
		panic(http.ErrAbortHandler)
	}
	if errors.Is(err, errClientWrite) {
		p.m.errors.WithLabelValues(roleClient, "canceled").Inc()
		panic(http.ErrAbortHandler)
	}
	p.m.errors.WithLabelValues(roleDecode, reason).Inc()
	ex.logAt(zapcore.WarnLevel, "decode stream failed", zap.Stringer("decode", di), zap.String("reason", reason), zap.Error(err))
	panic(http.ErrAbortHandler)
}

var errClientWrite = errors.New("writing to the client failed")

// copyBufs recycles relay buffers across requests.
var copyBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}
