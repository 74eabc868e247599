package proxy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// serveMultiturn is disagg_proxy_multiturn.py's request path.
func (p *Proxy) serveMultiturn(ex *exchange) {
	conv := conversationID(ex.body) // popped: never forwarded
	wantStream := ex.body.isTrue("stream")
	if conv == "" {
		if p.cfg.RequireConversationID {
			p.m.errors.WithLabelValues(roleClient, "bad_request").Inc()
			writeError(ex.w, http.StatusBadRequest, "invalid_request_error", "missing_conversation_id",
				"this proxy requires a top-level conversation_id field "+
					"(vLLM's multi-turn benchmark sends it with --send-conversation-id)")
			return
		}
		p.warnNoConvOnce.Do(func() {
			p.cfg.Logger.Warn("request without conversation_id: KV reuse across turns is disabled for such " +
				"requests; add a top-level conversation_id (the multi-turn benchmark's --send-conversation-id)")
		})
	}

	if p.cfg.Push {
		// Oneway reuse (validated): nothing is cached between turns; each
		// turn is a push request pair.
		p.m.cacheMisses.Inc()
		p.servePush(ex)
		return
	}
	params := []byte(emptyPrefillParams)
	result := Miss
	var turn uint64 // this turn's number in the state store; 0: none
	if conv != "" && p.cfg.ReuseMode == ReuseBidirectional {
		t := p.takeState(ex, conv)
		result, turn = t.Result, t.Turn
		if result == Hit {
			b, err := forPrefillPull(t.Params)
			if err != nil { // cannot happen: the cache only holds objects
				ex.logAt(zapcore.WarnLevel, "dropping unusable cached params", zap.Error(err))
				result = Miss
			} else {
				params = b
			}
		}
	}
	switch result {
	case Hit:
		p.m.cacheHits.Inc()
	case Stale:
		p.m.cacheStale.Inc()
		p.m.cacheMisses.Inc()
	default:
		p.m.cacheMisses.Inc()
	}
	ex.logAt(zapcore.DebugLevel, "conversation cache", zap.String("conversation_id", conv), zap.Stringer("result", result), zap.Uint64("turn", turn))

	pi := p.nextPrefill()
	pbody, err := multiturnPrefillBody(ex.body, params)
	if err != nil {
		writeError(ex.w, http.StatusInternalServerError, "internal_error", "internal_error", err.Error())
		return
	}
	presp, ue := p.prefill(ex, pi, pbody)
	if ue != nil {
		p.writeFailure(ex.w, ex.r, ue)
		return
	}

	// The decode request: the client's body (without conversation_id), the
	// prefill's params with remote_host set to the prefill instance's host,
	// streamed when the client streams. vLLM (0.32, installed) puts a
	// request's kv_transfer_params only in a non-streaming response — its
	// stream chunks have no such field — so a non-streaming client's turn
	// goes to the decode non-streaming, and the decode's params for the next
	// turn come from that body. A streaming client's chunks are still
	// searched (a vLLM that sends them in the last chunk is served too).
	d := ex.body.clone()
	if !p.cfg.ForwardClientKVParams {
		delete(d, "kv_transfer_params") // a client's own never reach the decode
	}
	if kv, ok := kvParams(presp); ok {
		b, err := withRemoteHost(kv, pi.Host)
		if err != nil {
			writeError(ex.w, http.StatusInternalServerError, "internal_error", "internal_error", err.Error())
			return
		}
		d.setRaw("kv_transfer_params", b)
	}
	if wantStream {
		d.setRaw("stream", jsonTrue)
	}
	dbody, err := d.marshal()
	if err != nil {
		writeError(ex.w, http.StatusInternalServerError, "internal_error", "internal_error", err.Error())
		return
	}
	di := p.nextDecode()
	ex.logAt(zapcore.DebugLevel, "routing", zap.Stringer("prefill", pi), zap.Stringer("decode", di), zap.Duration("prefill_took", ex.prefillDur))

	start := time.Now()
	resp, ctx, cancel, timer, ue := p.openDecode(ex, di, dbody)
	if ue != nil {
		p.writeFailure(ex.w, ex.r, ue)
		return
	}
	defer cancel(nil)
	defer timer.stop()
	defer resp.Body.Close()

	capture := func(chunk object) {
		kv, ok := kvParams(chunk)
		if !ok || conv == "" || p.cfg.ReuseMode != ReuseBidirectional {
			return
		}
		b, err := withRemoteHost(kv, di.Host)
		if err != nil {
			return
		}
		p.putState(ex, conv, turn, b)
	}

	br := readers.Get().(*bufio.Reader)
	br.Reset(resp.Body)
	defer func() { br.Reset(nil); readers.Put(br) }()
	if wantStream {
		h := ex.w.Header()
		h.Set("Content-Type", "text/event-stream; charset=utf-8")
		h.Set("Cache-Control", "no-cache")
		ex.setServerTiming(h)
		ex.w.WriteHeader(http.StatusOK)
		if !bodyBuffered(resp.Body) {
			ex.w.Flush() // else the headers go with the first events
		}
		for {
			line, rerr := br.ReadBytes('\n')
			if len(line) > 0 {
				timer.progress()
				if data, ok := sseData(line); ok && bytes.Contains(data, []byte(`"kv_transfer_params"`)) {
					if chunk, err := parseObject(data); err == nil {
						capture(chunk)
					}
				}
				if _, werr := ex.w.Write(line); werr != nil {
					p.abortStream(ex, di, "canceled", errClientWrite)
				}
				if br.Buffered() == 0 {
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

	// The client wants one JSON response, and so does the decode request.
	// Its body is relayed without kv_transfer_params (the decode's handle to
	// its blocks is the proxy's business, not the client's). A decode that
	// streams anyway is read to the end and an OpenAI-style response is built
	// from its chunks, as the reference does (usage is null).
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		data, err := readBody(io.LimitReader(resp.Body, p.cfg.MaxBodyBytes+1), resp.ContentLength, p.cfg.MaxBodyBytes)
		if err == nil && int64(len(data)) > p.cfg.MaxBodyBytes {
			err = fmt.Errorf("response exceeds %d bytes", p.cfg.MaxBodyBytes)
		}
		if err != nil {
			p.writeFailure(ex.w, ex.r, &upstreamError{role: roleDecode, target: di.String(), reason: reasonOf(ctx, err), err: err})
			return
		}
		timer.progress()
		p.m.decodeTotal.Observe(time.Since(start).Seconds())
		o, perr := parseObject(data)
		if perr != nil {
			p.writeFailure(ex.w, ex.r, &upstreamError{role: roleDecode, target: di.String(), reason: "bad_response",
				err: fmt.Errorf("response is not a JSON object: %w", perr)})
			return
		}
		capture(o)
		if _, ok := o["kv_transfer_params"]; ok {
			delete(o, "kv_transfer_params")
			if data, err = o.marshal(); err != nil {
				writeError(ex.w, http.StatusInternalServerError, "internal_error", "internal_error", err.Error())
				return
			}
		}
		h := ex.w.Header()
		h.Set("Content-Type", "application/json")
		ex.setServerTiming(h)
		ex.w.WriteHeader(resp.StatusCode)
		_, _ = ex.w.Write(data)
		return
	}
	var (
		text       strings.Builder
		finish     json.RawMessage
		id, model  json.RawMessage
		created    json.RawMessage
		firstChunk = true
	)
	for {
		line, rerr := br.ReadBytes('\n')
		if len(line) > 0 {
			timer.progress()
		}
		data, ok := sseData(line)
		if ok && string(bytes.TrimSpace(data)) == "[DONE]" {
			break
		}
		if ok {
			if chunk, err := parseObject(data); err == nil {
				if firstChunk {
					id, model, created, firstChunk = chunk["id"], chunk["model"], chunk["created"], false
				}
				accumulate(chunk, &text, &finish)
				capture(chunk)
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			p.writeFailure(ex.w, ex.r, &upstreamError{role: roleDecode, target: di.String(),
				reason: reasonOf(ctx, rerr), err: rerr})
			return
		}
	}
	p.m.decodeTotal.Observe(time.Since(start).Seconds())
	ex.setServerTiming(ex.w.Header())
	writeJSON(ex.w, http.StatusOK, p.assemble(ex, text.String(), finish, id, model, created))
}

// readers recycles line readers across requests.
var readers = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 32<<10) }}

// sseData returns the payload of a "data: " line (the reference matches that
// exact prefix).
func sseData(line []byte) ([]byte, bool) {
	line = bytes.TrimRight(line, "\r\n")
	if !bytes.HasPrefix(line, []byte("data: ")) {
		return nil, false
	}
	return line[len("data: "):], true
}

// accumulate appends a stream chunk's text (completions) or delta content
// (chat) over all its choices, and remembers the last finish_reason.
func accumulate(chunk object, text *strings.Builder, finish *json.RawMessage) {
	var choices []struct {
		Text  *string `json:"text"`
		Delta *struct {
			Content *string `json:"content"`
		} `json:"delta"`
		FinishReason json.RawMessage `json:"finish_reason"`
	}
	if err := json.Unmarshal(chunk["choices"], &choices); err != nil {
		return
	}
	for _, c := range choices {
		if c.Text != nil {
			text.WriteString(*c.Text)
		}
		if c.Delta != nil && c.Delta.Content != nil {
			text.WriteString(*c.Delta.Content)
		}
		if fr := bytes.TrimSpace(c.FinishReason); len(fr) > 0 && !bytes.Equal(fr, []byte("null")) && !bytes.Equal(fr, []byte(`""`)) {
			*finish = append(json.RawMessage(nil), fr...)
		}
	}
}

type chatChoice struct {
	Index        int             `json:"index"`
	Message      chatMessage     `json:"message"`
	FinishReason json.RawMessage `json:"finish_reason"`
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type textChoice struct {
	Index        int             `json:"index"`
	Text         string          `json:"text"`
	Logprobs     any             `json:"logprobs"`
	FinishReason json.RawMessage `json:"finish_reason"`
}

type assembled struct {
	ID      json.RawMessage `json:"id"`
	Object  string          `json:"object"`
	Created json.RawMessage `json:"created"`
	Model   json.RawMessage `json:"model"`
	Choices any             `json:"choices"`
	Usage   any             `json:"usage"`
}

func (p *Proxy) assemble(ex *exchange, text string, finish, id, model, created json.RawMessage) assembled {
	isNull := func(r json.RawMessage) bool {
		t := bytes.TrimSpace(r)
		return len(t) == 0 || bytes.Equal(t, []byte("null"))
	}
	if isNull(finish) {
		finish = json.RawMessage("null")
	}
	if isNull(id) || bytes.Equal(bytes.TrimSpace(id), []byte(`""`)) {
		id, _ = json.Marshal(ex.reqID)
	}
	if isNull(created) || bytes.Equal(bytes.TrimSpace(created), []byte("0")) {
		created, _ = json.Marshal(p.cfg.Clock().Unix())
	}
	if isNull(model) || bytes.Equal(bytes.TrimSpace(model), []byte(`""`)) {
		model = ex.body["model"]
		if isNull(model) {
			model = json.RawMessage(`""`)
		}
	}
	out := assembled{ID: id, Created: created, Model: model}
	if ex.body.has("messages") {
		out.Object = "chat.completion"
		out.Choices = []chatChoice{{Message: chatMessage{Role: "assistant", Content: text}, FinishReason: finish}}
	} else {
		out.Object = "text_completion"
		out.Choices = []textChoice{{Text: text, FinishReason: finish}}
	}
	return out
}
