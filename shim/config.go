package shim

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
)

// Role is the connector role vLLM gives each instance of the connector class.
type Role string

const (
	RoleScheduler Role = "scheduler"
	RoleWorker    Role = "worker"
)

// Config is the flattened vLLM configuration the Python connector passes
// in as JSON. Field names follow vLLM's KVTransferConfig and
// kv_connector_extra_config keys so that a NixlConnector configuration
// works unchanged.
type Config struct {
	Role                 Role   `json:"role"`
	KVRole               string `json:"kv_role"`
	EngineID             string `json:"engine_id"`
	KVBufferDevice       string `json:"kv_buffer_device"`
	KVLoadFailurePolicy  string `json:"kv_load_failure_policy"`
	EnablePermuteLocalKV bool   `json:"enable_permute_local_kv"`

	// Parallelism and placement, from vLLM's parallel config.
	TPSize     int    `json:"tp_size"`
	TPRank     int    `json:"tp_rank"`
	PPSize     int    `json:"pp_size"`
	PPRank     int    `json:"pp_rank"`
	DPIndex    int    `json:"dp_index"`
	BlockSize  int    `json:"block_size"`
	DeviceType string `json:"device_type"`

	// Side channel, from VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT.
	SideChannelHost string `json:"side_channel_host"`
	SideChannelPort int    `json:"side_channel_port"`

	// Extra holds kv_connector_extra_config verbatim.
	Extra map[string]any `json:"kv_connector_extra_config"`

	// Derived from Extra by ParseConfig.
	Backends               []string `json:"-"`
	NumThreads             int      `json:"-"`
	KVLeaseDuration        float64  `json:"-"` // seconds
	DecoderKVBlocksTTL     float64  `json:"-"`
	BidirectionalKVXfer    bool     `json:"-"`
	KVRecomputeThreshold   int      `json:"-"`
	EnforceHandshakeCompat bool     `json:"-"`
	EngineTTL              float64  `json:"-"`
	TransferEngine         string   `json:"-"` // gonixl: "auto", "nixl", "ucx"
	SideChannelSecret      string   `json:"-"` // gonixl: optional HMAC secret
	TransferTimeout        float64  `json:"-"` // gonixl: seconds a READ may stay in flight
	HandshakeTimeout       float64  `json:"-"` // gonixl: seconds a whole handshake may take
	ProgressDelayUs        int      `json:"-"` // gonixl: NIXL progress thread's wait for an event, µs
	PostOffModelThread     bool     `json:"-"` // gonixl: post from the worker's poster when Post copies (post.go)
	KVDigest               string   `json:"-"` // gonixl: KVDigestOff, KVDigestVerify or KVDigestFail (kvdigest.go)
	// KVDigestReadback (set by the Python connector, a bidirectional
	// decode's scheduler): its workers digest the blocks it holds for a
	// read-back, and the side channel serves the digests (kvdigest_serve.go).
	KVDigestReadback bool `json:"kv_digest_readback"`

	// Worker-side facts the Python connector reads from vLLM's config.
	// TransferMode is "pull" (NixlConnector: the decode READs) or "push"
	// (NixlPushConnector: the prefill WRITEs into blocks the decode
	// registered), set by the Python connector class.
	TransferMode string `json:"transfer_mode"`
	// PushRegistrationTimeout (push mode, a decode): seconds a request
	// waits for the prefill's WRITE after registering its blocks
	// (push_registration_timeout, default decoder_kv_blocks_ttl).
	PushRegistrationTimeout float64 `json:"-"`

	CompatFactors map[string]any `json:"compat_factors"`

	// vLLM's kv_cache_config.transfer_groups (both roles), and whether the
	// hybrid KV-cache manager is in use with a group that is not full
	// attention (vLLM's _is_hma_required): then sliding-window groups
	// exchange only their in-window blocks. Empty: one full-attention group.
	TransferGroups []TransferGroup `json:"transfer_groups"`
	HMARequired    bool            `json:"hma_required"`
}

// ParseConfig decodes and validates a JSON configuration, applying vLLM's
// defaults for every key that is absent.
func ParseConfig(data []byte) (_ *Config, err error) {
	defer classify(&err, ErrInvalidInput)
	c := &Config{}
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.UseNumber()
	if err := dec.Decode(c); err != nil {
		return nil, fmt.Errorf("config: invalid JSON: %w", err)
	}
	if err := c.applyDefaults(); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *Config) applyDefaults() error {
	switch c.Role {
	case RoleScheduler, RoleWorker:
	default:
		return fmt.Errorf("config: role must be %q or %q, got %q", RoleScheduler, RoleWorker, c.Role)
	}
	switch c.KVRole {
	case "kv_producer", "kv_consumer", "kv_both":
	default:
		return fmt.Errorf("config: kv_role must be kv_producer, kv_consumer or kv_both, got %q", c.KVRole)
	}
	if c.EngineID == "" {
		return fmt.Errorf("config: engine_id is required")
	}
	// vLLM's KVTransferConfig takes any string here (its default is the
	// platform's device type); its NixlConnector worker checks it against
	// _NIXL_SUPPORTED_DEVICE. Empty (a caller other than vLLM) means "where
	// the KV cache is". Placement is checked by checkKVPlacement.
	switch c.KVBufferDevice {
	case "", "cpu", "cuda", "xpu", "hpu":
	default:
		return fmt.Errorf("config: kv_buffer_device must be cpu, cuda, xpu or hpu (the device the KV cache is on, or cpu for a CPU-only vLLM), got %q", c.KVBufferDevice)
	}
	switch c.KVLoadFailurePolicy {
	case "":
		c.KVLoadFailurePolicy = "fail"
	case "fail", "recompute":
	default:
		return fmt.Errorf("config: kv_load_failure_policy must be fail or recompute, got %q", c.KVLoadFailurePolicy)
	}
	if c.TPSize == 0 {
		c.TPSize = 1
	}
	if c.PPSize == 0 {
		c.PPSize = 1
	}
	// Upper bounds: those of the tp_size / pp_size this engine writes into
	// kv_transfer_params (ParseTransferParams refuses larger ones).
	if c.TPSize < 0 || c.TPSize > 1<<16 || c.PPSize < 0 || c.PPSize > 1<<20 || c.TPRank < 0 || c.TPRank >= c.TPSize ||
		c.PPRank < 0 || c.PPRank >= c.PPSize || c.DPIndex < 0 {
		return fmt.Errorf("config: bad parallel layout tp %d/%d pp %d/%d dp %d", c.TPRank, c.TPSize, c.PPRank, c.PPSize, c.DPIndex)
	}
	if c.BlockSize < 0 {
		return fmt.Errorf("config: block_size must be positive, got %d", c.BlockSize)
	}
	for i, g := range c.TransferGroups {
		switch g.Kind {
		case LayerKindFull, LayerKindMLA:
		case LayerKindSlidingWindow:
			if g.SlidingWindow <= 0 || g.BlockSize <= 0 {
				return fmt.Errorf("config: transfer group %d: sliding window %d / block size %d must be positive", i, g.SlidingWindow, g.BlockSize)
			}
		default:
			return fmt.Errorf("config: KV-cache group %d is of kind %q, which gonixl does not transfer (full, sliding-window and MLA attention only)", i, g.Kind)
		}
	}
	if c.SideChannelHost == "" {
		c.SideChannelHost = "localhost"
	}
	if c.SideChannelPort == 0 {
		c.SideChannelPort = 5600
	}
	if c.SideChannelPort < 0 || c.SideChannelPort > 65535 {
		return fmt.Errorf("config: side channel port %d out of range", c.SideChannelPort)
	}
	if c.DPIndex > 65535-c.SideChannelPort {
		// The listener binds port + dp_index, and that port goes into
		// kv_transfer_params.
		return fmt.Errorf("config: side channel port %d + dp_index %d is beyond 65535", c.SideChannelPort, c.DPIndex)
	}
	var err error
	x := extra(c.Extra)
	if c.Backends, err = x.strings("backends", []string{"UCX"}); err != nil {
		return err
	}
	if c.NumThreads, err = x.int("num_threads", 4); err != nil {
		return err
	}
	if c.KVLeaseDuration, err = x.float("kv_lease_duration", 30); err != nil {
		return err
	}
	if err := checkSeconds("kv_lease_duration", c.KVLeaseDuration); err != nil {
		return err
	}
	if c.DecoderKVBlocksTTL, err = x.float("decoder_kv_blocks_ttl", 480); err != nil {
		return err
	}
	if math.IsNaN(c.DecoderKVBlocksTTL) || math.IsInf(c.DecoderKVBlocksTTL, 0) {
		// It becomes remote_blocks_expiry_time, which JSON cannot carry.
		return fmt.Errorf("config: kv_connector_extra_config.decoder_kv_blocks_ttl must be a finite number of seconds, got %v", c.DecoderKVBlocksTTL)
	}
	if c.BidirectionalKVXfer, err = x.bool("bidirectional_kv_xfer", false); err != nil {
		return err
	}
	switch c.TransferMode {
	case "":
		c.TransferMode = "pull"
	case "pull":
	case "push":
		if c.BidirectionalKVXfer {
			// vLLM's NixlPushConnector refuses the same pairing.
			return errors.New("Bidirectional KV transfer is not supported for NIXL push connector.")
		}
	default:
		return fmt.Errorf("config: transfer_mode must be pull or push, got %q", c.TransferMode)
	}
	if c.PushRegistrationTimeout, err = x.float("push_registration_timeout", c.DecoderKVBlocksTTL); err != nil {
		return err
	}
	if err := checkSeconds("push_registration_timeout", c.PushRegistrationTimeout); err != nil {
		return err
	}
	if c.KVRecomputeThreshold, err = x.int("kv_recompute_threshold", 64); err != nil { // vLLM's default, in every mode
		return err
	}
	if c.EnforceHandshakeCompat, err = x.bool("enforce_handshake_compat", true); err != nil {
		return err
	}
	if c.EngineTTL, err = x.float("engine_ttl", 3600); err != nil {
		return err
	}
	if math.IsNaN(c.EngineTTL) {
		return fmt.Errorf("config: kv_connector_extra_config.engine_ttl must be a number of seconds (0 or less: never evict), got NaN")
	}
	if c.TransferEngine, err = x.string("transfer_engine", "auto"); err != nil {
		return err
	}
	switch c.TransferEngine {
	case "auto", "nixl", "ucx":
	default:
		return fmt.Errorf("config: transfer_engine must be auto, nixl or ucx, got %q", c.TransferEngine)
	}
	if c.SideChannelSecret, err = x.string("side_channel_secret", ""); err != nil {
		return err
	}
	if c.TransferTimeout, err = x.float("transfer_timeout", 60); err != nil {
		return err
	}
	if c.HandshakeTimeout, err = x.float("handshake_timeout", 30); err != nil {
		return err
	}
	if err := checkSeconds("transfer_timeout", c.TransferTimeout); err != nil {
		return err
	}
	if err := checkSeconds("handshake_timeout", c.HandshakeTimeout); err != nil {
		return err
	}
	// NIXL's Python API (and so vLLM) runs the UCX progress thread with a
	// zero delay: it polls without sleeping and takes a core per worker even
	// when idle. 1 ms lets it sleep in poll() until UCX signals an event, and
	// progress everything at least every millisecond.
	if c.ProgressDelayUs, err = x.int("progress_thread_delay_us", 1000); err != nil {
		return err
	}
	if c.ProgressDelayUs < 0 || int64(c.ProgressDelayUs) > math.MaxInt64/int64(time.Microsecond) {
		return fmt.Errorf("config: progress_thread_delay_us must be between 0 and %d, got %d", math.MaxInt64/int64(time.Microsecond), c.ProgressDelayUs)
	}
	// The NIXL engine's Post copies a DRAM transfer before it returns: by
	// default the worker posts from a goroutine of its own (post.go);
	// false posts on vLLM's model thread, as before.
	if c.PostOffModelThread, err = x.bool("post_off_model_thread", true); err != nil {
		return err
	}
	if c.KVDigest, err = x.string("kv_digest", KVDigestFail); err != nil {
		return err
	}
	switch c.KVDigest {
	case KVDigestOff, KVDigestVerify, KVDigestFail:
	default:
		return fmt.Errorf("config: kv_connector_extra_config.kv_digest must be off, verify or fail, got %q", c.KVDigest)
	}
	c.KVDigestReadback = c.KVDigestReadback && c.KVDigest != KVDigestOff && c.BidirectionalKVXfer
	return nil
}

// checkSeconds validates a duration setting: positive, and finite and small
// enough for a time.Duration (NaN would pass every comparison: a NaN
// transfer_timeout never expires, a NaN lease expiry cannot be written to
// kv_transfer_params).
func checkSeconds(key string, v float64) error {
	if !(v > 0) || v*float64(time.Second) >= float64(math.MaxInt64) {
		return fmt.Errorf("config: kv_connector_extra_config.%s must be a positive number of seconds (at most %.0f), got %v", key, float64(math.MaxInt64)/float64(time.Second), v)
	}
	return nil
}

// extra reads kv_connector_extra_config values with vLLM's leniency: numbers
// may arrive as strings ("30"), booleans as "true"/"False".
type extra map[string]any

func (x extra) string(key, def string) (string, error) {
	v, ok := x[key]
	if !ok || v == nil {
		return def, nil
	}
	switch t := v.(type) {
	case string:
		return t, nil
	case json.Number:
		return t.String(), nil
	}
	return "", fmt.Errorf("config: kv_connector_extra_config.%s must be a string, got %T", key, v)
}

func (x extra) float(key string, def float64) (float64, error) {
	v, ok := x[key]
	if !ok || v == nil {
		return def, nil
	}
	var s string
	switch t := v.(type) {
	case json.Number:
		s = t.String()
	case string:
		s = t
	default:
		return 0, fmt.Errorf("config: kv_connector_extra_config.%s must be a number, got %T", key, v)
	}
	f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil {
		return 0, fmt.Errorf("config: kv_connector_extra_config.%s must be a number, got %q", key, s)
	}
	return f, nil
}

func (x extra) int(key string, def int) (int, error) {
	f, err := x.float(key, float64(def))
	if err != nil {
		return 0, err
	}
	if f != float64(int(f)) {
		return 0, fmt.Errorf("config: kv_connector_extra_config.%s must be an integer, got %v", key, f)
	}
	return int(f), nil
}

func (x extra) bool(key string, def bool) (bool, error) {
	v, ok := x[key]
	if !ok || v == nil {
		return def, nil
	}
	switch t := v.(type) {
	case bool:
		return t, nil
	case string:
		switch strings.ToLower(strings.TrimSpace(t)) {
		case "true", "1", "yes", "on":
			return true, nil
		case "false", "0", "no", "off", "":
			return false, nil
		}
	case json.Number:
		// Not its text: 0.0 is 0 (and false in Python, which reads the
		// same key: pybridge/gonixl/vllm.py _extra_bool).
		f, err := t.Float64()
		if err != nil {
			return false, fmt.Errorf("config: kv_connector_extra_config.%s must be a boolean, got %v", key, v)
		}
		return f != 0, nil
	}
	return false, fmt.Errorf("config: kv_connector_extra_config.%s must be a boolean, got %v", key, v)
}

func (x extra) strings(key string, def []string) ([]string, error) {
	v, ok := x[key]
	if !ok || v == nil {
		return def, nil
	}
	switch t := v.(type) {
	case string:
		return []string{t}, nil
	case []any:
		out := make([]string, 0, len(t))
		for _, e := range t {
			s, ok := e.(string)
			if !ok {
				return nil, fmt.Errorf("config: kv_connector_extra_config.%s must be a list of strings, got element %T", key, e)
			}
			out = append(out, s)
		}
		if len(out) == 0 {
			return nil, fmt.Errorf("config: kv_connector_extra_config.%s must not be empty", key)
		}
		return out, nil
	}
	return nil, fmt.Errorf("config: kv_connector_extra_config.%s must be a list of strings, got %T", key, v)
}

// checkKVPlacement checks kv_buffer_device and enable_permute_local_kv
// against where register_kv_caches found the KV cache. vLLM's NixlConnector
// (base_worker.py) with kv_buffer_device "cpu" on a GPU platform stages
// every transfer through a host copy of the KV cache (use_host_buffer,
// initialize_host_xfer_buffer); gonixl's Python side does the same
// (gonixl.engine.HostStaging) and registers the host mirrors, so the
// library sees host memory. Device tensors registered with "cpu" mean a
// caller that skipped the staging: refused rather than silently
// transferring device memory. On vLLM's CPU platform "cpu" is the only
// value vLLM accepts and means no staging (use_host_buffer is false there).
//
// enable_permute_local_kv only matters to vLLM when the remote engine's
// kv_cache_layout differs from this one (a LBHNC remote read into a LBNHC
// cache is permuted after the READ) or with host staging. gonixl refuses
// both (the handshake requires the same kv_cache_layout and attention
// backend), so for every pair of engines gonixl connects the flag changes
// nothing in vLLM either. It is accepted (vLLM's XPU platform sets it
// unconditionally) and its lack of effect is logged.
func (w *Worker) checkKVPlacement(layout *KVLayout, init *WorkerInit) error {
	if err := checkKVBufferDevice(w.cfg.KVBufferDevice, layout, init.Layers); err != nil {
		return err
	}
	if w.cfg.EnablePermuteLocalKV {
		w.log.Info("enable_permute_local_kv has no effect in gonixl: KV moves only between engines with the same kv_cache_layout, "+
			"where vLLM does not permute either; a remote engine with another layout is refused at handshake",
			zap.String("kv_cache_layout", init.KVCacheLayout))
	}
	return nil
}

// checkKVBufferDevice is checkKVPlacement's kv_buffer_device rule: "cpu"
// for a KV cache in host memory, the KV cache's device type otherwise.
func checkKVBufferDevice(setting string, layout *KVLayout, layers []LayerTensor) error {
	if setting == "" {
		return nil
	}
	if layout.Mem == nixl.DRAM {
		if setting != "cpu" {
			return fmt.Errorf("kv_buffer_device is %q, but the KV cache is in host memory (vLLM's CPU platform), where only \"cpu\" is supported: set kv_buffer_device to \"cpu\"", setting)
		}
		return nil
	}
	dev := ""
	for _, l := range layers {
		if l.Device != "" && l.Device != "cpu" {
			dev = l.Device
			break
		}
	}
	if setting == "cpu" {
		return fmt.Errorf("kv_buffer_device is \"cpu\" with the KV cache on %s: that asks for host-buffer staging, so the tensors to register are the pinned host mirrors "+
			"(gonixl.engine.HostStaging; GoNixlConnector registers them itself), not the device caches; or set kv_buffer_device to %q so that the device memory moves directly", dev, dev)
	}
	if setting != dev {
		return fmt.Errorf("kv_buffer_device is %q, but the KV cache is on %s: set kv_buffer_device to %q", setting, dev, dev)
	}
	return nil
}
