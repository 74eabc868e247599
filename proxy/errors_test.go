package proxy

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"
)

// deadInstance is a loopback port nobody listens on.
func deadInstance(t *testing.T) Instance {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	return Instance{Host: "127.0.0.1", Port: port}
}

func TestUpstreamFailures(t *testing.T) {
	hang := func(w http.ResponseWriter, r *http.Request, _ received) { <-r.Context().Done() }
	status := func(code int, body string) func(http.ResponseWriter, *http.Request, received) {
		return func(w http.ResponseWriter, _ *http.Request, _ received) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(code)
			fmt.Fprint(w, body)
		}
	}
	tests := []struct {
		description string
		mode        Mode
		prefill     func(http.ResponseWriter, *http.Request, received) // nil: dead instance
		decode      func(http.ResponseWriter, *http.Request, received) // nil: dead instance
		wantStatus  int
		wantInMsg   string
		wantBody    string // exact body, for relayed 4xx
		wantDecode  bool   // whether the decode instance is contacted
		wantErr     map[string]string
	}{
		{"dead prefill", ModeToy, nil, decodeHandler("d", false), 502, "prefill instance", "", false,
			map[string]string{"role": "prefill", "reason": "transport"}},
		{"dead decode", ModeToy, prefillHandler("p"), nil, 502, "decode instance", "", false,
			map[string]string{"role": "decode", "reason": "transport"}},
		{"prefill 500", ModeToy, status(500, `{"boom":1}`), decodeHandler("d", false), 502, "returned HTTP 500", "", false,
			map[string]string{"role": "prefill", "reason": "status"}},
		{"prefill 400 relayed", ModeToy, status(400, `{"error":{"message":"bad model"}}`), decodeHandler("d", false), 400, "",
			`{"error":{"message":"bad model"}}`, false, map[string]string{"role": "prefill", "reason": "status"}},
		{"prefill not json", ModeToy, status(200, `<html>`), decodeHandler("d", false), 502, "not a JSON object", "", false,
			map[string]string{"role": "prefill", "reason": "bad_response"}},
		{"prefill hangs", ModeToy, hang, decodeHandler("d", false), 504, "did not answer", "", false,
			map[string]string{"role": "prefill", "reason": "timeout"}},
		{"decode 503", ModeToy, prefillHandler("p"), status(503, `overloaded`), 502, "HTTP 503: overloaded", "", true,
			map[string]string{"role": "decode", "reason": "status"}},
		{"decode hangs", ModeToy, prefillHandler("p"), hang, 504, "did not answer", "", true,
			map[string]string{"role": "decode", "reason": "timeout"}},
		{"multiturn dead prefill", ModeMultiturn, nil, decodeHandler("d", true), 502, "prefill instance", "", false,
			map[string]string{"role": "prefill", "reason": "transport"}},
		{"multiturn decode 500", ModeMultiturn, prefillHandler("p"), status(500, `x`), 502, "HTTP 500", "", true,
			map[string]string{"role": "decode", "reason": "status"}},
		{"multiturn decode hangs", ModeMultiturn, prefillHandler("p"), hang, 504, "did not answer", "", true,
			map[string]string{"role": "decode", "reason": "timeout"}},
	}
	for _, tc := range tests {
		t.Run(tc.description, func(t *testing.T) {
			var pf, df *fakeOpenAI
			var pi, di Instance
			// The live fakes first: a port deadInstance just freed could
			// otherwise be handed to the next fake's listener, and the
			// "dead" upstream would answer (seen once in CI).
			if tc.prefill != nil {
				pf = newFake(t, "p0", tc.prefill)
				pi = pf.instance()
			}
			if tc.decode != nil {
				df = newFake(t, "d0", tc.decode)
				di = df.instance()
			}
			if tc.prefill == nil {
				pi = deadInstance(t)
			}
			if tc.decode == nil {
				di = deadInstance(t)
			}
			r := newRig(t, nil, nil, func(c *Config) {
				c.Mode = tc.mode
				c.Prefill, c.Decode = []Instance{pi}, []Instance{di}
				if strings.Contains(tc.description, "hangs") {
					// Only the silent upstreams get a short limit: a busy
					// test machine must not turn the other cases into 504s.
					c.UpstreamTimeout = 300 * time.Millisecond
				}
			})
			status, hdr, body := r.post("/v1/completions", map[string]any{"prompt": "x", "conversation_id": "c"}, nil)
			if status != tc.wantStatus {
				t.Fatalf("status %d (%s), want %d", status, body, tc.wantStatus)
			}
			if tc.wantBody != "" {
				if string(body) != tc.wantBody {
					t.Errorf("relayed body %q, want %q", body, tc.wantBody)
				}
			} else {
				e := errorOf(t, body)
				if msg, _ := e["message"].(string); !strings.Contains(msg, tc.wantInMsg) {
					t.Errorf("error message %q lacks %q", msg, tc.wantInMsg)
				}
				if ct := hdr.Get("Content-Type"); ct != "application/json" {
					t.Errorf("error Content-Type %q", ct)
				}
			}
			if df != nil && (len(df.requests()) > 0) != tc.wantDecode {
				t.Errorf("decode contacted: %v, want %v", len(df.requests()) > 0, tc.wantDecode)
			}
			if got := r.metric(MetricErrors, tc.wantErr); got != 1 {
				t.Errorf("%s%v = %v, want 1", MetricErrors, tc.wantErr, got)
			}
			code := fmt.Sprint(tc.wantStatus)
			if got := r.metric(MetricRequests, map[string]string{"code": code}); got != 1 {
				t.Errorf("%s{code=%s} = %v, want 1", MetricRequests, code, got)
			}
		})
	}
}

// waitClosed waits for ch, failing the test if it never closes.
func waitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(waitLimit):
		t.Fatalf("%s never happened", what)
	}
}

// A client that leaves during the prefill: the prefill request outlives it by
// the abandon grace, then is cancelled; the decode never hears of a prefill
// that did not answer.
func TestClientDisconnectCancelsPrefill(t *testing.T) {
	for _, grace := range []time.Duration{NoAbandonGrace, 300 * time.Millisecond} {
		for _, mode := range []Mode{ModeToy, ModeMultiturn} {
			t.Run(fmt.Sprintf("%v/grace=%v", mode, grace), func(t *testing.T) {
				arrived, canceled := make(chan struct{}), make(chan struct{})
				pf := newFake(t, "p0", func(w http.ResponseWriter, r *http.Request, _ received) {
					close(arrived)
					select {
					case <-r.Context().Done():
						close(canceled)
					case <-time.After(waitLimit):
					}
				})
				df := newFake(t, "d0", decodeHandler("d0", false))
				r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) { c.Mode = mode; c.AbandonGrace = grace })
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan error, 1)
				go func() {
					req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.srv.URL+"/v1/completions",
						strings.NewReader(`{"prompt":"x"}`))
					resp, err := r.srv.Client().Do(req)
					if err == nil {
						resp.Body.Close()
					}
					done <- err
				}()
				waitClosed(t, arrived, "prefill request")
				left := time.Now()
				cancel()
				waitClosed(t, canceled, "prefill cancellation after the client left")
				if took := time.Since(left); grace > 0 && took < grace {
					t.Errorf("prefill cancelled %v after the client left, before the %v grace", took, grace)
				}
				if err := <-done; err == nil {
					t.Error("client request succeeded after cancel")
				}
				if n := len(df.requests()); n != 0 {
					t.Errorf("decode contacted %d times after the client left", n)
				}
			})
		}
	}
}

// A prefill that answers after its client left, within the grace: the decode
// still gets the request with the prefill's params (its connector then frees
// the prefill's blocks instead of their lease), and is cancelled once the
// grace has passed. Without a grace it never hears of the request.
func TestClientGoneAfterPrefillStillReachesDecode(t *testing.T) {
	const grace = 400 * time.Millisecond
	for _, g := range []time.Duration{NoAbandonGrace, grace} {
		for _, mode := range []Mode{ModeToy, ModeMultiturn} {
			t.Run(fmt.Sprintf("%v/grace=%v", mode, g), func(t *testing.T) {
				arrived, gone := make(chan struct{}), make(chan struct{})
				pf := newFake(t, "p0", func(w http.ResponseWriter, r *http.Request, rec received) {
					close(arrived)
					<-gone
					time.Sleep(50 * time.Millisecond) // the proxy sees the client gone first
					prefillHandler("p0")(w, r, rec)
				})
				decoded := make(chan time.Time, 1)
				dcanceled := make(chan time.Time, 1)
				df := newFake(t, "d0", func(w http.ResponseWriter, r *http.Request, _ received) {
					decoded <- time.Now()
					select {
					case <-r.Context().Done():
						dcanceled <- time.Now()
					case <-time.After(waitLimit):
					}
				})
				r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) { c.Mode = mode; c.AbandonGrace = g })
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan struct{})
				go func() {
					defer close(done)
					req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.srv.URL+"/v1/completions",
						strings.NewReader(`{"prompt":"x","conversation_id":"c"}`))
					if resp, err := r.srv.Client().Do(req); err == nil {
						resp.Body.Close()
					}
				}()
				waitClosed(t, arrived, "prefill request")
				cancel()
				waitClosed(t, done, "client gave up")
				close(gone)
				if g < 0 {
					select {
					case <-decoded:
						t.Fatal("decode contacted without a grace")
					case <-time.After(300 * time.Millisecond):
					}
					return
				}
				var sent time.Time
				select {
				case sent = <-decoded:
				case <-time.After(waitLimit):
					t.Fatal("decode never got the request of a client that left during its prefill")
				}
				reqs := df.requests()
				if kv, _ := reqs[0].Body["kv_transfer_params"].(map[string]any); kv == nil || kv["remote_engine_id"] == nil {
					t.Errorf("decode request without the prefill's params: %s", reqs[0].Raw)
				}
				select {
				case end := <-dcanceled:
					if end.Sub(sent) < grace-50*time.Millisecond {
						t.Errorf("decode cancelled %v after it was sent, before the %v grace", end.Sub(sent), grace)
					}
				case <-time.After(waitLimit):
					t.Fatal("decode request never cancelled after the grace")
				}
			})
		}
	}
}

func TestClientDisconnectCancelsDecodeStream(t *testing.T) {
	for _, mode := range []Mode{ModeToy, ModeMultiturn} {
		t.Run(mode.String(), func(t *testing.T) {
			canceled := make(chan struct{})
			pf := newFake(t, "p0", prefillHandler("p0"))
			df := newFake(t, "d0", func(w http.ResponseWriter, r *http.Request, _ received) {
				w.Header().Set("Content-Type", "text/event-stream")
				fmt.Fprint(w, "data: {\"choices\":[{\"text\":\"a\"}]}\n\n")
				w.(http.Flusher).Flush()
				select {
				case <-r.Context().Done():
					close(canceled)
				case <-time.After(waitLimit):
				}
			})
			r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) { c.Mode = mode })
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.srv.URL+"/v1/completions",
				strings.NewReader(`{"prompt":"x","stream":true,"conversation_id":"c"}`))
			resp, err := r.srv.Client().Do(req)
			if err != nil {
				t.Fatalf("POST: %v", err)
			}
			buf := make([]byte, 8)
			if _, err := io.ReadFull(resp.Body, buf); err != nil {
				t.Fatalf("no stream data: %v", err)
			}
			cancel()
			resp.Body.Close()
			waitClosed(t, canceled, "decode cancellation after the client left")
		})
	}
}

func TestDecodeDiesMidStream(t *testing.T) {
	for _, mode := range []Mode{ModeToy, ModeMultiturn} {
		t.Run(mode.String(), func(t *testing.T) {
			pf := newFake(t, "p0", prefillHandler("p0"))
			df := newFake(t, "d0", func(w http.ResponseWriter, r *http.Request, _ received) {
				w.Header().Set("Content-Type", "text/event-stream")
				fmt.Fprint(w, "data: {\"choices\":[{\"text\":\"a\"}]}\n\n")
				w.(http.Flusher).Flush()
				panic(http.ErrAbortHandler) // drop the connection mid-stream
			})
			r := newRig(t, []*fakeOpenAI{pf}, []*fakeOpenAI{df}, func(c *Config) { c.Mode = mode })
			resp, err := r.srv.Client().Post(r.srv.URL+"/v1/completions", "application/json",
				strings.NewReader(`{"prompt":"x","stream":true}`))
			if err != nil {
				t.Fatalf("POST: %v", err)
			}
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			if err == nil {
				t.Errorf("truncated upstream stream ended cleanly for the client (%q); want a read error", b)
			}
			if got := r.metric(MetricErrors, map[string]string{"role": "decode"}); got != 1 {
				t.Errorf("decode errors = %v, want 1", got)
			}
		})
	}
}

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "i/o timeout" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

// A connection that cannot be set up in time is a connect timeout, named as
// such (it used to read "did not answer within <upstream timeout>").
func TestConnectTimeoutNamed(t *testing.T) {
	ctx := context.Background()
	dial := &url.Error{Op: "Post", URL: "http://x", Err: &net.OpError{Op: "dial", Net: "tcp", Err: timeoutErr{}}}
	if got := reasonOf(ctx, dial); got != "connect_timeout" {
		t.Fatalf("dial timeout classified %q", got)
	}
	read := &url.Error{Op: "Post", URL: "http://x", Err: &net.OpError{Op: "read", Net: "tcp", Err: timeoutErr{}}}
	if got := reasonOf(ctx, read); got != "timeout" {
		t.Fatalf("read timeout classified %q", got)
	}
	r := newRig(t, []*fakeOpenAI{newFake(t, "p0", prefillHandler("p"))}, []*fakeOpenAI{newFake(t, "d0", decodeHandler("d", false))}, nil)
	rec := httptest.NewRecorder()
	req := httptest.NewRequest("POST", "/v1/completions", nil)
	r.p.writeFailure(rec, req, &upstreamError{role: "prefill", target: "10.0.0.1:1", reason: "connect_timeout", err: dial})
	if rec.Code != 504 || !strings.Contains(rec.Body.String(), "could not connect to prefill instance 10.0.0.1:1 within") {
		t.Fatalf("%d %s", rec.Code, rec.Body.String())
	}
}
