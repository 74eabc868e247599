package shim

import (
	"os"
	"strings"
	"sync"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

var (
	logOnce sync.Once
	logger  *zap.Logger
)

// Logger returns the library's logger: zap, console encoding, to stderr, at
// GONIXL_LOG_LEVEL (debug, info, warn, error; default info).
func Logger() *zap.Logger {
	logOnce.Do(func() {
		level := zapcore.InfoLevel
		if v := strings.TrimSpace(os.Getenv("GONIXL_LOG_LEVEL")); v != "" {
			if err := level.UnmarshalText([]byte(strings.ToLower(v))); err != nil {
				level = zapcore.InfoLevel
			}
		}
		enc := zap.NewProductionEncoderConfig()
		enc.EncodeTime = zapcore.ISO8601TimeEncoder
		enc.EncodeLevel = zapcore.CapitalLevelEncoder
		core := zapcore.NewCore(zapcore.NewConsoleEncoder(enc), zapcore.Lock(os.Stderr), level)
		logger = zap.New(core).Named("gonixl")
	})
	return logger
}
