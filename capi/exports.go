package main

/*
#cgo CFLAGS: -I${SRCDIR}/../include
#include "gonixl.h"
*/
import "C"

import (
	"encoding/json"
	"os"
	"unsafe"

	_ "github.com/gonixl/gonixl/nixl/libnixl" // registers the "nixl" engine
	_ "github.com/gonixl/gonixl/nixl/ucx"     // registers the "ucx" engine
	"github.com/gonixl/gonixl/shim"
)

func main() {}

//export gonixl_abi_version
func gonixl_abi_version() C.uint32_t {
	return C.GONIXL_ABI_VERSION
}

//export gonixl_version
func gonixl_version(buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		return writeOut(buf, lenp, []byte(shim.Version))
	})
}

//export gonixl_probe
func gonixl_probe(buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		return writeOut(buf, lenp, shim.ProbeJSON())
	})
}

func parseConfig(p *C.char, n C.size_t) (*shim.Config, error) {
	data, err := readIn(p, n, "config_json")
	if err != nil {
		return nil, err
	}
	cfg, err := shim.ParseConfig(data)
	if err != nil {
		return nil, err
	}
	return cfg, nil
}

func scheduler(h C.gonixl_scheduler_t) (*shim.Scheduler, error) {
	obj, err := handles.get(uint64(h), kindScheduler)
	if err != nil {
		return nil, err
	}
	return obj.(*shim.Scheduler), nil
}

func worker(h C.gonixl_worker_t) (*shim.Worker, error) {
	obj, err := handles.get(uint64(h), kindWorker)
	if err != nil {
		return nil, err
	}
	return obj.(*shim.Worker), nil
}

// onScheduler runs fn on the scheduler behind h, inside the panic guard.
func onScheduler(h C.gonixl_scheduler_t, cerr *C.gonixl_error_t, fn func(*shim.Scheduler) error) C.gonixl_status_t {
	return guard(cerr, func() error {
		s, err := scheduler(h)
		if err != nil {
			return err
		}
		return fn(s)
	})
}

// onWorker runs fn on the worker behind h, inside the panic guard.
func onWorker(h C.gonixl_worker_t, cerr *C.gonixl_error_t, fn func(*shim.Worker) error) C.gonixl_status_t {
	return guard(cerr, func() error {
		w, err := worker(h)
		if err != nil {
			return err
		}
		return fn(w)
	})
}

// request reads the (req_id, params_json) pair most scheduler calls take.
func request(reqID *C.char, reqIDLen C.size_t, pj *C.char, pl C.size_t) (string, *shim.TransferParams, error) {
	id, err := readString(reqID, reqIDLen, "req_id")
	if err != nil {
		return "", nil, err
	}
	p, err := params(pj, pl)
	return id, p, err
}

// requestBlocks is request plus the request's block ids per group.
func requestBlocks(reqID *C.char, reqIDLen C.size_t, pj *C.char, pl C.size_t, ids *C.int64_t, nids C.int64_t,
	lens *C.int64_t, ngroups C.int64_t) (string, *shim.TransferParams, shim.BlockIDs, error) {
	id, p, err := request(reqID, reqIDLen, pj, pl)
	if err != nil {
		return "", nil, nil, err
	}
	blocks, err := blockIDs(ids, nids, lens, ngroups)
	return id, p, blocks, err
}

func params(p *C.char, n C.size_t) (*shim.TransferParams, error) {
	b, err := readIn(p, n, "params_json")
	if err != nil {
		return nil, err
	}
	tp, err := shim.ParseTransferParams(b)
	if err != nil {
		return nil, err
	}
	return tp, nil
}

// blockIDs rebuilds per-group block ids from a flat array and group lengths.
func blockIDs(flat *C.int64_t, n C.int64_t, lens *C.int64_t, groups C.int64_t) (shim.BlockIDs, error) {
	ids, err := readInt64s(flat, n, "block_ids")
	if err != nil {
		return nil, err
	}
	gl, err := readInt64s(lens, groups, "group_lens")
	if err != nil {
		return nil, err
	}
	out := make(shim.BlockIDs, len(gl))
	off := int64(0)
	for g, l := range gl {
		if l < 0 || off+l > int64(len(ids)) {
			return nil, errorf(statusInvalidArg, "group_lens %v do not add up to %d block ids", gl, len(ids))
		}
		out[g] = ids[off : off+l]
		off += l
	}
	if off != int64(len(ids)) {
		return nil, errorf(statusInvalidArg, "group_lens %v do not add up to %d block ids", gl, len(ids))
	}
	for _, b := range ids {
		if b < 0 {
			return nil, errorf(statusInvalidArg, "negative block id %d", b)
		}
	}
	return out, nil
}

// newHandle parses a configuration, builds the object and registers it;
// the handle is 0 on error.
func newHandle(cfgJSON *C.char, cfgLen C.size_t, kind handleKind, build func(*shim.Config) (any, error)) (uint64, error) {
	cfg, err := parseConfig(cfgJSON, cfgLen)
	if err != nil {
		return 0, err
	}
	obj, err := build(cfg)
	if err != nil {
		return 0, err
	}
	return handles.add(kind, obj), nil
}

//export gonixl_scheduler_new
func gonixl_scheduler_new(cfgJSON *C.char, cfgLen C.size_t, out *C.gonixl_scheduler_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		if out == nil {
			return errorf(statusNullPointer, "out handle pointer is NULL")
		}
		*out = 0
		h, err := newHandle(cfgJSON, cfgLen, kindScheduler, func(c *shim.Config) (any, error) { return shim.NewScheduler(c, nil) })
		*out = C.gonixl_scheduler_t(h)
		return err
	})
}

//export gonixl_scheduler_get_num_new_matched_tokens
func gonixl_scheduler_get_num_new_matched_tokens(h C.gonixl_scheduler_t, pj *C.char, pl C.size_t, numPrompt, numComputed C.int64_t, outCount *C.int64_t, outAsync *C.int32_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		if outCount == nil || outAsync == nil {
			return errorf(statusNullPointer, "out_count or out_async is NULL")
		}
		*outCount, *outAsync = 0, 0
		s, err := scheduler(h)
		if err != nil {
			return err
		}
		if numPrompt < 0 || numComputed < 0 {
			return errorf(statusInvalidArg, "negative token counts (%d, %d)", numPrompt, numComputed)
		}
		p, err := params(pj, pl)
		if err != nil {
			return err
		}
		n, async := s.GetNumNewMatchedTokens(p, int64(numPrompt), int64(numComputed))
		*outCount = C.int64_t(n)
		if async {
			*outAsync = 1
		}
		return nil
	})
}

//export gonixl_scheduler_update_state_after_alloc
func gonixl_scheduler_update_state_after_alloc(h C.gonixl_scheduler_t, reqID *C.char, reqIDLen C.size_t, pj *C.char, pl C.size_t,
	ids *C.int64_t, nids C.int64_t, lens *C.int64_t, ngroups C.int64_t, computed *C.int64_t, ncomputed C.int64_t,
	numExternal C.int64_t, outMutated *C.int32_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		if outMutated == nil {
			return errorf(statusNullPointer, "out_mutated is NULL")
		}
		*outMutated = 0
		s, err := scheduler(h)
		if err != nil {
			return err
		}
		id, p, blocks, err := requestBlocks(reqID, reqIDLen, pj, pl, ids, nids, lens, ngroups)
		if err != nil {
			return err
		}
		comp, err := readInt64s(computed, ncomputed, "num_computed")
		if err != nil {
			return err
		}
		mutated, err := s.UpdateStateAfterAlloc(id, p, blocks, comp, int64(numExternal))
		if err != nil {
			return err
		}
		if mutated {
			*outMutated = 1
		}
		return nil
	})
}

//export gonixl_scheduler_build_meta
func gonixl_scheduler_build_meta(h C.gonixl_scheduler_t, buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onScheduler(h, cerr, func(s *shim.Scheduler) error {
		return consume(pendingKey{uint64(h), "build_meta", ""}, buf, lenp, s.BuildMetaOrIdle)
	})
}

//export gonixl_scheduler_apply
func gonixl_scheduler_apply(h C.gonixl_scheduler_t, ops *C.char, opsLen C.size_t, results *C.uint8_t, numOps C.int64_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onScheduler(h, cerr, func(s *shim.Scheduler) error {
		return applyOps(s, ops, opsLen, results, numOps)
	})
}

//export gonixl_scheduler_apply_build_meta
func gonixl_scheduler_apply_build_meta(h C.gonixl_scheduler_t, ops *C.char, opsLen C.size_t, results *C.uint8_t, numOps C.int64_t,
	buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onScheduler(h, cerr, func(s *shim.Scheduler) error {
		// The ops go inside produce: a retry after BUFFER_TOO_SMALL is
		// handed the parked metadata and applies nothing again.
		return consume(pendingKey{uint64(h), "build_meta", ""}, buf, lenp, func() ([]byte, error) {
			if err := applyOps(s, ops, opsLen, results, numOps); err != nil {
				return nil, err
			}
			return s.BuildMetaOrIdle()
		})
	})
}

// applyOps runs a scheduler batch (shim/sched_ops.go), one result byte per op.
func applyOps(s *shim.Scheduler, ops *C.char, opsLen C.size_t, results *C.uint8_t, numOps C.int64_t) error {
	if numOps < 0 || numOps > maxArray {
		return errorf(statusInvalidArg, "num_ops %d out of range", numOps)
	}
	if numOps > 0 && results == nil {
		return errorf(statusNullPointer, "results is NULL but num_ops is %d", numOps)
	}
	b, err := readIn(ops, opsLen, "ops")
	if err != nil {
		return err
	}
	res := make([]byte, numOps)
	if err := s.ApplyOps(b, res); err != nil {
		return err
	}
	if numOps > 0 {
		copy(unsafe.Slice((*byte)(unsafe.Pointer(results)), int(numOps)), res)
	}
	return nil
}

//export gonixl_scheduler_idle_for
func gonixl_scheduler_idle_for(h C.gonixl_scheduler_t, out *C.double, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onScheduler(h, cerr, func(s *shim.Scheduler) error {
		if out == nil {
			return errorf(statusNullPointer, "out pointer is NULL")
		}
		*out = C.double(s.IdleFor())
		return nil
	})
}

//export gonixl_scheduler_request_finished
func gonixl_scheduler_request_finished(h C.gonixl_scheduler_t, reqID *C.char, reqIDLen C.size_t, pj *C.char, pl C.size_t,
	finishedNormally C.int32_t, numComputed C.int64_t, ids *C.int64_t, nids C.int64_t, lens *C.int64_t, ngroups C.int64_t,
	outDelay *C.int32_t, outParams *C.char, outLen *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		if outDelay == nil {
			return errorf(statusNullPointer, "out_delay is NULL")
		}
		s, err := scheduler(h)
		if err != nil {
			return err
		}
		id, p, blocks, err := requestBlocks(reqID, reqIDLen, pj, pl, ids, nids, lens, ngroups)
		if err != nil {
			return err
		}
		// The delay flag travels in front of the params so that a retry
		// after BUFFER_TOO_SMALL returns both unchanged.
		err = consume(pendingKey{uint64(h), "request_finished", id}, outParams, outLen, func() ([]byte, error) {
			delay, out, err := s.RequestFinished(id, p, finishedNormally != 0, int64(numComputed), blocks)
			if err != nil {
				return nil, err
			}
			flag := byte('0')
			if delay {
				flag = '1'
			}
			return append([]byte{flag}, out...), nil
		})
		if err != nil {
			return err
		}
		// Strip the flag in place: the caller sees only the params.
		n := int(*outLen)
		b := unsafe.Slice((*byte)(unsafe.Pointer(outParams)), n)
		*outDelay = C.int32_t(b[0] - '0')
		copy(b, b[1:])
		*outLen = C.size_t(n - 1)
		return nil
	})
}

//export gonixl_scheduler_push_prompt_done
func gonixl_scheduler_push_prompt_done(h C.gonixl_scheduler_t, reqID *C.char, reqIDLen C.size_t, pj *C.char, pl C.size_t,
	ids *C.int64_t, nids C.int64_t, lens *C.int64_t, ngroups C.int64_t, numTokens C.int64_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onScheduler(h, cerr, func(s *shim.Scheduler) error {
		id, p, blocks, err := requestBlocks(reqID, reqIDLen, pj, pl, ids, nids, lens, ngroups)
		if err != nil {
			return err
		}
		return s.PushPromptDone(id, p, blocks, int64(numTokens))
	})
}

//export gonixl_scheduler_push_preempted
func gonixl_scheduler_push_preempted(h C.gonixl_scheduler_t, j *C.char, n C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onScheduler(h, cerr, func(s *shim.Scheduler) error {
		ids, err := readIDs(j, n, "req_ids_json")
		if err != nil {
			return err
		}
		s.PushPreempted(ids)
		return nil
	})
}

//export gonixl_scheduler_pending_block_frees
func gonixl_scheduler_pending_block_frees(h C.gonixl_scheduler_t, out *C.int32_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onScheduler(h, cerr, func(s *shim.Scheduler) error {
		if out == nil {
			return errorf(statusInvalidArg, "out is NULL")
		}
		pending, fenced := s.PendingBlockFreesFenced()
		*out = 0
		if pending {
			*out |= 1
		}
		if fenced {
			*out |= 2
		}
		return nil
	})
}

//export gonixl_scheduler_kv_digests
func gonixl_scheduler_kv_digests(h C.gonixl_scheduler_t, j *C.char, n C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onScheduler(h, cerr, func(s *shim.Scheduler) error {
		b, err := readIn(j, n, "digests_json")
		if err != nil {
			return err
		}
		return s.SetKVDigests(b)
	})
}

//export gonixl_scheduler_set_handshake_payload
func gonixl_scheduler_set_handshake_payload(h C.gonixl_scheduler_t, pp, tp C.int32_t, payload *C.char, n C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onScheduler(h, cerr, func(s *shim.Scheduler) error {
		if pp < 0 || tp < 0 {
			return errorf(statusInvalidArg, "negative rank pp=%d tp=%d", pp, tp)
		}
		b, err := readIn(payload, n, "payload")
		if err != nil {
			return err
		}
		if err := s.SetHandshakePayload(int(pp), int(tp), b); err != nil {
			return err
		}
		return nil
	})
}

//export gonixl_scheduler_close
func gonixl_scheduler_close(h C.gonixl_scheduler_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		obj, err := handles.remove(uint64(h), kindScheduler)
		if err != nil {
			return err
		}
		dropPending(uint64(h))
		return obj.(*shim.Scheduler).Close()
	})
}

//export gonixl_worker_new
func gonixl_worker_new(cfgJSON *C.char, cfgLen C.size_t, out *C.gonixl_worker_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		if out == nil {
			return errorf(statusNullPointer, "out handle pointer is NULL")
		}
		*out = 0
		h, err := newHandle(cfgJSON, cfgLen, kindWorker, func(c *shim.Config) (any, error) { return shim.NewWorker(c, nil) })
		*out = C.gonixl_worker_t(h)
		return err
	})
}

//export gonixl_worker_register_kv_caches
func gonixl_worker_register_kv_caches(h C.gonixl_worker_t, j *C.char, n C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onWorker(h, cerr, func(w *shim.Worker) error {
		b, err := readIn(j, n, "init_json")
		if err != nil {
			return err
		}
		var init shim.WorkerInit
		if err := json.Unmarshal(b, &init); err != nil {
			return errorf(statusInvalidArg, "init_json: %v", err)
		}
		if err := w.RegisterKVCaches(&init); err != nil {
			return err
		}
		return nil
	})
}

//export gonixl_worker_handshake_payload
func gonixl_worker_handshake_payload(h C.gonixl_worker_t, buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onWorker(h, cerr, func(w *shim.Worker) error {
		b, err := w.HandshakePayload()
		if err != nil {
			return err
		}
		return writeOut(buf, lenp, b)
	})
}

//export gonixl_worker_start_load_kv
func gonixl_worker_start_load_kv(h C.gonixl_worker_t, meta *C.char, n C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onWorker(h, cerr, func(w *shim.Worker) error {
		if n == 0 {
			return nil // an idle step (gonixl_scheduler_build_meta's empty answer)
		}
		b, err := readIn(meta, n, "meta")
		if err != nil {
			return err
		}
		if err := w.StartLoadKV(b); err != nil {
			return err
		}
		return nil
	})
}

//export gonixl_worker_get_finished
func gonixl_worker_get_finished(h C.gonixl_worker_t, buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onWorker(h, cerr, func(w *shim.Worker) error {
		return consume(pendingKey{uint64(h), "get_finished", ""}, buf, lenp, w.GetFinished)
	})
}

//export gonixl_worker_handle_preemptions
func gonixl_worker_handle_preemptions(h C.gonixl_worker_t, meta *C.char, n C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onWorker(h, cerr, func(w *shim.Worker) error {
		b, err := readIn(meta, n, "meta")
		if err != nil {
			return err
		}
		return w.HandlePreemptions(b)
	})
}

//export gonixl_worker_load_errors
func gonixl_worker_load_errors(h C.gonixl_worker_t, buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onWorker(h, cerr, func(w *shim.Worker) error {
		return consume(pendingKey{uint64(h), "load_errors", ""}, buf, lenp, func() ([]byte, error) {
			return json.Marshal(w.LoadErrors())
		})
	})
}

//export gonixl_worker_push_arrivals
func gonixl_worker_push_arrivals(h C.gonixl_worker_t, buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onWorker(h, cerr, func(w *shim.Worker) error {
		return consume(pendingKey{uint64(h), "push_arrivals", ""}, buf, lenp, func() ([]byte, error) {
			return json.Marshal(w.PushArrivals())
		})
	})
}

//export gonixl_worker_kv_digest
func gonixl_worker_kv_digest(h C.gonixl_worker_t, reqs *C.char, n C.size_t, buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onWorker(h, cerr, func(w *shim.Worker) error {
		return consume(pendingKey{uint64(h), "kv_digest", ""}, buf, lenp, func() ([]byte, error) {
			b, err := readIn(reqs, n, "reqs")
			if err != nil {
				return nil, err
			}
			return w.KVDigests(b)
		})
	})
}

//export gonixl_worker_kv_digest_held
func gonixl_worker_kv_digest_held(h C.gonixl_worker_t, reqs *C.char, n C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onWorker(h, cerr, func(w *shim.Worker) error {
		b, err := readIn(reqs, n, "reqs")
		if err != nil {
			return err
		}
		return w.KVDigestsHeld(b)
	})
}

//export gonixl_worker_kv_digests_ready
func gonixl_worker_kv_digests_ready(h C.gonixl_worker_t, buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onWorker(h, cerr, func(w *shim.Worker) error {
		return consume(pendingKey{uint64(h), "kv_digests_ready", ""}, buf, lenp, w.TakeHeldDigests)
	})
}

//export gonixl_worker_stats
func gonixl_worker_stats(h C.gonixl_worker_t, buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onWorker(h, cerr, func(w *shim.Worker) error {
		return consume(pendingKey{uint64(h), "stats", ""}, buf, lenp, func() ([]byte, error) {
			return w.Stats(), nil
		})
	})
}

//export gonixl_worker_metrics
func gonixl_worker_metrics(h C.gonixl_worker_t, buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onWorker(h, cerr, func(w *shim.Worker) error {
		b, err := w.MetricsText()
		if err != nil {
			return err
		}
		return writeOut(buf, lenp, b)
	})
}

//export gonixl_worker_live
func gonixl_worker_live(h C.gonixl_worker_t, buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onWorker(h, cerr, func(w *shim.Worker) error {
		b, err := json.Marshal(w.Live())
		if err != nil {
			return err
		}
		return writeOut(buf, lenp, b)
	})
}

//export gonixl_scheduler_live
func gonixl_scheduler_live(h C.gonixl_scheduler_t, buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return onScheduler(h, cerr, func(s *shim.Scheduler) error {
		b, err := json.Marshal(s.Live())
		if err != nil {
			return err
		}
		return writeOut(buf, lenp, b)
	})
}

//export gonixl_worker_close
func gonixl_worker_close(h C.gonixl_worker_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		obj, err := handles.remove(uint64(h), kindWorker)
		if err != nil {
			return err
		}
		dropPending(uint64(h))
		return obj.(*shim.Worker).Close()
	})
}

// testHooks is read once at load: the panic hook works only in processes
// that have GONIXL_TEST_HOOKS=1 in their environment when the library loads.
var testHooks = envSynced && os.Getenv("GONIXL_TEST_HOOKS") == "1"

//export gonixl_live_objects
func gonixl_live_objects(buf *C.char, lenp *C.size_t, cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		b, err := json.Marshal(map[string]int{
			"schedulers":      handles.count(kindScheduler),
			"workers":         handles.count(kindWorker),
			"pending_results": pendingCount(),
		})
		if err != nil {
			return err
		}
		return writeOut(buf, lenp, b)
	})
}

//export gonixl_debug_panic
func gonixl_debug_panic(cerr *C.gonixl_error_t) C.gonixl_status_t {
	return guard(cerr, func() error {
		if !testHooks {
			return errorf(statusNotSupported, "gonixl_debug_panic needs GONIXL_TEST_HOOKS=1 in the environment")
		}
		panic("gonixl_debug_panic called")
	})
}

// readIDs reads a JSON array of request ids (empty input: none).
func readIDs(j *C.char, n C.size_t, what string) ([]string, error) {
	b, err := readIn(j, n, what)
	if err != nil {
		return nil, err
	}
	var ids []string
	if len(b) > 0 {
		if err := json.Unmarshal(b, &ids); err != nil {
			return nil, errorf(statusInvalidArg, "%s: %v", what, err)
		}
	}
	return ids, nil
}
