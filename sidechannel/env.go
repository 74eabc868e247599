package sidechannel

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Environment variables read by FromEnv.
const (
	EnvHost   = "VLLM_NIXL_SIDE_CHANNEL_HOST"
	EnvPort   = "VLLM_NIXL_SIDE_CHANNEL_PORT"
	EnvSecret = "GONIXL_SIDE_CHANNEL_SECRET"
)

// Defaults shared by listener and client.
const (
	DefaultHost         = "localhost"
	DefaultPort         = 5600
	DefaultMaxFrameSize = 16 << 20
	DefaultRecvTimeout  = 5 * time.Second
	DefaultTimeout      = 30 * time.Second
)

// Env holds the side-channel settings that come from the environment.
type Env struct {
	Host     string // VLLM_NIXL_SIDE_CHANNEL_HOST, default "localhost"
	BasePort int    // VLLM_NIXL_SIDE_CHANNEL_PORT, default 5600
	Secret   []byte // GONIXL_SIDE_CHANNEL_SECRET, nil when unset or empty
}

// FromEnv is the one place this package reads environment variables; pass
// os.Getenv (tests pass a map lookup). The port is parsed as vLLM does
// (int() of the value, surrounding spaces allowed).
func FromEnv(getenv func(string) string) (Env, error) {
	e := Env{Host: DefaultHost, BasePort: DefaultPort}
	if v := getenv(EnvHost); v != "" {
		e.Host = v
	}
	if v := strings.TrimSpace(getenv(EnvPort)); v != "" {
		p, err := strconv.Atoi(v)
		if err != nil || p < 0 || p > 65535 {
			return e, fmt.Errorf("sidechannel: %s=%q is not a valid port", EnvPort, getenv(EnvPort))
		}
		e.BasePort = p
	}
	if v := getenv(EnvSecret); v != "" {
		e.Secret = []byte(v)
	}
	return e, nil
}

// ResolveSecret picks the shared secret: kv_connector_extra_config's
// side_channel_secret when it is non-empty, else the environment's
// GONIXL_SIDE_CHANNEL_SECRET, else none.
func ResolveSecret(extraConfigSecret string, env Env) []byte {
	if extraConfigSecret != "" {
		return []byte(extraConfigSecret)
	}
	return env.Secret
}
