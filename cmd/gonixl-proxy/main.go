package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/gonixl/gonixl/proxy"
	"github.com/gonixl/gonixl/proxy/redisstate"
)

func main() {
	// The proxy's heap is small and its garbage short-lived: collect less
	// often than Go's default unless the operator chose (GOGC).
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(400)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr, nil))
}

func newLogger(level string, w io.Writer) (*zap.Logger, error) {
	if level == "" {
		level = os.Getenv("GONIXL_LOG_LEVEL")
	}
	if level == "" {
		level = "info"
	}
	lvl, err := zapcore.ParseLevel(strings.ToLower(level))
	if err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	core := zapcore.NewCore(zapcore.NewConsoleEncoder(enc), zapcore.Lock(zapcore.AddSync(w)), lvl)
	return zap.New(core).Named("gonixl-proxy"), nil
}

// run is the whole command; ready, when non-nil, receives the bound address.
// It returns the process exit status.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, ready func(addr string)) int {
	opts, err := buildOptions(args, os.Getenv("OPENAI_API_KEY"))
	if errors.Is(err, errHelp) {
		printUsage(stdout)
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "gonixl-proxy:", err)
		fmt.Fprintln(stderr, "run gonixl-proxy --help for the options")
		return 2
	}
	log, err := newLogger(opts.logLevel, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "gonixl-proxy:", err)
		return 2
	}
	defer func() { _ = log.Sync() }()
	opts.cfg.Logger = log

	if opts.stateURL != "" {
		rlog := log.Named("redis")
		redisstate.SetLogger(func(format string, args ...any) { rlog.Debug(fmt.Sprintf(format, args...)) })
		st, err := redisstate.New(redisstate.Options{URL: opts.stateURL, Prefix: opts.stateKeyPrefix,
			TTL: opts.cfg.CacheTTL, Timeout: opts.cfg.StateTimeout})
		if err != nil {
			fmt.Fprintln(stderr, "gonixl-proxy:", err)
			return 2
		}
		defer st.Close()
		// Not fatal: turns are full prefills until the store answers.
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		if err := st.Ping(pctx); err != nil {
			log.Warn("conversation state store does not answer (turns are full prefills until it does)",
				zap.Stringer("store", st), zap.Error(err))
		}
		cancel()
		opts.cfg.StateStore = st
	}

	p, err := proxy.New(opts.cfg)
	if err != nil {
		fmt.Fprintln(stderr, "gonixl-proxy:", err)
		return 2
	}
	defer p.Close()

	ln, err := net.Listen("tcp", net.JoinHostPort(opts.listenHost, strconv.Itoa(opts.listenPort)))
	if err != nil {
		log.Error("cannot listen", zap.Error(err))
		return 1
	}
	srv := &http.Server{
		Handler:           p,
		ReadHeaderTimeout: 30 * time.Second,
		IdleTimeout:       120 * time.Second,
		ErrorLog:          zap.NewStdLog(log.Named("http")),
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()

	addr := ln.Addr().String()
	state := "memory"
	if opts.cfg.StateStore != nil {
		state = opts.cfg.StateStore.String()
	}
	log.Info("listening on "+addr,
		zap.String("mode", opts.cfg.Mode.String()),
		zap.String("state_store", state),
		zap.Stringers("prefill", opts.cfg.Prefill),
		zap.Stringers("decode", opts.cfg.Decode))
	if ready != nil {
		ready(addr)
	}

	select {
	case err := <-served:
		log.Error("server stopped", zap.Error(err))
		return 1
	case <-ctx.Done():
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		log.Warn("shutdown incomplete", zap.Error(err))
		_ = srv.Close()
	}
	return 0
}
