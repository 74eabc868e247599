package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gonixl/gonixl/proxy"
)

func TestParseArgs(t *testing.T) {
	tests := []struct {
		description string
		args        []string
		check       func(t *testing.T, o *options)
		wantErr     string
	}{
		{"defaults as toy_proxy_server.py", nil, func(t *testing.T, o *options) {
			if o.listenHost != "127.0.0.1" || o.listenPort != 8000 || o.cfg.Mode != proxy.ModeToy {
				t.Errorf("listen %s:%d mode %v", o.listenHost, o.listenPort, o.cfg.Mode)
			}
			if want := []proxy.Instance{{Host: "localhost", Port: 8100}}; !reflect.DeepEqual(o.cfg.Prefill, want) {
				t.Errorf("prefill %v", o.cfg.Prefill)
			}
			if want := []proxy.Instance{{Host: "localhost", Port: 8200}}; !reflect.DeepEqual(o.cfg.Decode, want) {
				t.Errorf("decode %v", o.cfg.Decode)
			}
			if o.cfg.CacheTTL != 480*time.Second || o.cfg.ReuseMode != proxy.ReuseBidirectional {
				t.Errorf("ttl %v reuse %v", o.cfg.CacheTTL, o.cfg.ReuseMode)
			}
			if o.stateURL != "" || o.cfg.StateTimeout != 50*time.Millisecond || o.stateKeyPrefix != "gonixl:conv:" {
				t.Errorf("state store %q timeout %v prefix %q", o.stateURL, o.cfg.StateTimeout, o.stateKeyPrefix)
			}
		}, ""},
		{"nargs+ lists and aliases", []string{"--port", "9000", "--prefiller-hosts", "a", "b", "--prefiller-port", "1", "2",
			"--decoder-host=c", "--decoder-ports", "3"}, func(t *testing.T, o *options) {
			want := []proxy.Instance{{Host: "a", Port: 1}, {Host: "b", Port: 2}}
			if !reflect.DeepEqual(o.cfg.Prefill, want) || o.listenPort != 9000 {
				t.Errorf("prefill %v port %d", o.cfg.Prefill, o.listenPort)
			}
			if want := []proxy.Instance{{Host: "c", Port: 3}}; !reflect.DeepEqual(o.cfg.Decode, want) {
				t.Errorf("decode %v", o.cfg.Decode)
			}
		}, ""},
		{"repeated option replaces", []string{"--decoder-host", "x", "--decoder-host", "y"}, func(t *testing.T, o *options) {
			if o.cfg.Decode[0].Host != "y" {
				t.Errorf("decode %v", o.cfg.Decode)
			}
		}, ""},
		{"multiturn options", []string{"--multiturn", "--require-conversation-id", "--reuse-mode", "oneway", "--cache-ttl", "1.5",
			"--upstream-timeout", "2", "--connect-timeout=0.5"}, func(t *testing.T, o *options) {
			c := o.cfg
			if c.Mode != proxy.ModeMultiturn || !c.RequireConversationID || c.ReuseMode != proxy.ReuseOneway ||
				c.CacheTTL != 1500*time.Millisecond || c.UpstreamTimeout != 2*time.Second || c.ConnectTimeout != 500*time.Millisecond {
				t.Errorf("config %+v", c)
			}
		}, ""},
		{"shared state store", []string{"--multiturn", "--state-store", "redis://10.0.0.5:6379/3", "--state-store-timeout", "0.2",
			"--decoder-kv-blocks-ttl", "60", "--state-key-prefix", "fleet-a:"}, func(t *testing.T, o *options) {
			if o.stateURL != "redis://10.0.0.5:6379/3" || o.cfg.StateTimeout != 200*time.Millisecond ||
				o.cfg.CacheTTL != time.Minute || o.stateKeyPrefix != "fleet-a:" {
				t.Errorf("state store %q timeout %v ttl %v prefix %q", o.stateURL, o.cfg.StateTimeout, o.cfg.CacheTTL, o.stateKeyPrefix)
			}
		}, ""},
		{"abandon grace", []string{"--abandon-grace", "0.5"}, func(t *testing.T, o *options) {
			if o.cfg.AbandonGrace != 500*time.Millisecond {
				t.Errorf("abandon grace %v", o.cfg.AbandonGrace)
			}
		}, ""},
		{"no abandon grace", []string{"--abandon-grace", "0"}, func(t *testing.T, o *options) {
			if o.cfg.AbandonGrace != proxy.NoAbandonGrace {
				t.Errorf("abandon grace %v", o.cfg.AbandonGrace)
			}
		}, ""},
		{"bad abandon grace", []string{"--abandon-grace", "-1"}, nil, "not a positive number"},
		{"bad state store", []string{"--state-store", "mysql://x"}, nil, "not memory or a redis://"},
		{"bad state timeout", []string{"--state-store-timeout", "0"}, nil, "not a positive number"},
		{"host/port count mismatch", []string{"--prefiller-hosts", "a", "b"}, nil,
			"number of prefiller hosts (2) must match number of prefiller ports (1)"},
		{"decoder mismatch", []string{"--decoder-ports", "1", "2"}, nil, "number of decoder hosts (1) must match number of decoder ports (2)"},
		{"non-integer port", []string{"--prefiller-ports", "x"}, nil, `"x" is not an integer`},
		{"listen port range", []string{"--port", "70000"}, nil, "out of range"},
		{"missing value", []string{"--port"}, nil, "expects one value"},
		{"empty list", []string{"--decoder-hosts", "--port", "1"}, nil, "expects at least one value"},
		{"unknown", []string{"--bogus"}, nil, "unknown option --bogus"},
		{"positional", []string{"stray"}, nil, "unexpected argument"},
		{"flag with value", []string{"--multiturn=yes"}, nil, "takes no value"},
		{"bad reuse mode", []string{"--reuse-mode", "both"}, nil, "not oneway or bidirectional"},
		{"bad ttl", []string{"--cache-ttl", "-3"}, nil, "not a positive number"},
	}
	for _, tc := range tests {
		t.Run(tc.description, func(t *testing.T) {
			o, err := buildOptions(tc.args, "")
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("buildOptions: %v", err)
			}
			tc.check(t, o)
		})
	}
}

func TestHelpAndBadArgs(t *testing.T) {
	var out, errb bytes.Buffer
	if rc := run(context.Background(), []string{"--help"}, &out, &errb, nil); rc != 0 || !strings.Contains(out.String(), "--prefiller-hosts, --prefiller-host") {
		t.Errorf("--help: rc %d, output %q", rc, out.String())
	}
	out.Reset()
	if rc := run(context.Background(), []string{"--decoder-ports", "1", "2"}, &out, &errb, nil); rc != 2 || !strings.Contains(errb.String(), "must match") {
		t.Errorf("mismatch: rc %d, stderr %q", rc, errb.String())
	}
}

// syncBuffer is a bytes.Buffer safe for the logger and the test to share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
func (s *syncBuffer) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

// TestRunServes starts the command on a free port in front of fake instances
// and checks the startup line, /healthcheck, a request, and clean shutdown.
func TestRunServes(t *testing.T) {
	fake := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var m map[string]any
		_ = json.Unmarshal(b, &m)
		if m["max_tokens"] == 1.0 {
			_, _ = io.WriteString(w, `{"kv_transfer_params":{"remote_block_ids":[1]}}`)
			return
		}
		_, _ = io.WriteString(w, `{"choices":[{"text":"ok"}]}`)
	}))
	defer fake.Close()
	u, _ := url.Parse(fake.URL)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stderr syncBuffer
	ready := make(chan string, 1)
	exited := make(chan int, 1)
	go func() {
		exited <- run(ctx, []string{"--port", "0", "--prefiller-host", u.Hostname(), "--prefiller-port", u.Port(),
			"--decoder-host", u.Hostname(), "--decoder-port", u.Port()}, io.Discard, &stderr, func(a string) { ready <- a })
	}()
	var addr string
	select {
	case addr = <-ready:
	case rc := <-exited:
		t.Fatalf("run exited early with %d: %s", rc, stderr.String())
	case <-time.After(10 * time.Second):
		t.Fatal("proxy never became ready")
	}
	if !strings.Contains(stderr.String(), "listening on "+addr) {
		t.Errorf("startup log %q lacks %q", stderr.String(), "listening on "+addr)
	}
	resp, err := http.Get("http://" + addr + "/healthcheck")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("/healthcheck: %v %v", resp, err)
	}
	resp.Body.Close()
	resp, err = http.Post("http://"+addr+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"x","max_tokens":5}`))
	if err != nil {
		t.Fatalf("POST: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(b) != `{"choices":[{"text":"ok"}]}` {
		t.Errorf("completion %d %q", resp.StatusCode, b)
	}
	cancel()
	select {
	case rc := <-exited:
		if rc != 0 {
			t.Errorf("exit status %d after shutdown", rc)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("proxy did not shut down")
	}
}
