// Posting off vLLM's model thread (issue 34 item 3).
//
// The NIXL engine's Post copies a same-host DRAM transfer before it
// returns (NIXL's UCX backend, CMA): a 14 MiB READ spent all of its
// 1.97 ms in Post, measured between two processes (nixl.PostCopies), and
// the READ is posted from start_load_kv and a push WRITE from
// get_finished, both on vLLM's model thread. For an agent that says so,
// a READ or WRITE made under the worker's lock is queued instead, and one
// goroutine of the worker, the poster, posts the queue in order without
// the lock. MakeXfer stays on the caller's thread: the poster takes the
// queue only once the call that made it returns the lock, so every
// transfer of one call is made while the agent is free. The ucx engine's
// Post returns in microseconds (its copies run on a goroutine of its own)
// and is posted in place, as before.
//
// The trade: vLLM calls get_finished right after start_load_kv (a load
// starts after the forward's launch), so a READ posted by the poster is
// seen complete by the next step's get_finished, where one copied in place
// was seen by the same step's; that step no longer waits for the copy.
// post_off_model_thread false posts in place.
//
// While a transfer is being posted (queued, or taken by the poster and
// its Post not returned):
//
//   - it counts as in flight: it is in its request's xfers (recvState,
//     pushSend) from the moment it is made, so no completion, lease,
//     abort, eviction, preemption or Close gives its blocks back, and
//     nothing releases, checks or reposts its handle (inflight.posting);
//   - the agent is busy while the poster posts (postsRunning): the NIXL
//     engine serialises every call on one lock, so a poll, a MakeXfer or a
//     notification from vLLM's thread would wait behind the post. They are
//     put off as for a long control call (busy.go, agentBusyLocked);
//   - Post's error is kept on the transfer, and the first poll after it
//     returned handles it as a synchronous post error is handled
//     (pollTransfersLocked, pollPushSendLocked): reported once;
//   - a failed push releases what it can: a post still queued is dropped
//     (never posted), one being posted is released once it returned
//     (pushFailedLocked);
//   - the fence of a preempted push (fencePushLocked) posts its request's
//     queued WRITEs itself and waits for the one being posted, before the
//     forward that may reuse the blocks;
//   - Close waits for the poster (bounded) before it releases handles.
//
// A panic in a post fails that transfer (its error, errPanicked); one
// elsewhere in the poster fails every post it had not made; both are
// logged and counted.

package shim

import (
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/gonixl/gonixl/nixl"
)

// postState is one transfer's asynchronous post.
type postState struct {
	x    nixl.Xfer
	done chan struct{} // closed once Post returned, or the post was given up
	err  error         // Post's error; read only after done is closed
	// taken: the poster (or a fence) took it from the queue (worker's lock).
	taken bool
}

// closePostWait bounds how long Close waits for the posts in progress.
const closePostWait = 10 * time.Second

// posting reports whether f's post is queued or running: its handle must
// not be released, checked or posted again, and its blocks stay held.
func (f *inflight) posting() bool {
	if f.post == nil {
		return false
	}
	select {
	case <-f.post.done:
		return false
	default:
		return true
	}
}

// takePostResult returns the error of f's asynchronous post once it
// returned, once (nil for a synchronous post, and afterwards); returned
// is false while the post is queued or running.
func (f *inflight) takePostResult() (err error, returned bool) {
	if f.post == nil {
		return nil, true
	}
	select {
	case <-f.post.done:
		err = f.post.err
		f.post = nil
		return err, true
	default:
		return nil, false
	}
}

// postCopiesLocked reports whether the agent's Post copies on the
// caller's thread (nixl.PostCopies): its posts go to the poster, unless
// post_off_model_thread is false.
func (w *Worker) postCopiesLocked() bool {
	pc, ok := w.agent.(nixl.PostCopies)
	return ok && w.cfg.PostOffModelThread && pc.PostCopies()
}

// postLocked posts f's transfer: in place for an agent whose Post does not
// copy (the error is Post's), else by queuing it for the poster (nil: the
// error, if any, comes to f's next poll).
func (w *Worker) postLocked(f *inflight) error {
	if w.closed {
		return nixl.Errorf(nixl.ErrInvalidParam, "Post", "the worker is closing")
	}
	if !w.postCopiesLocked() {
		_, err := f.x.Post()
		return err
	}
	ps := &postState{x: f.x, done: make(chan struct{})}
	f.post = ps
	w.postQueue = append(w.postQueue, ps)
	if !w.posterOn {
		w.startPosterLocked()
	}
	return nil
}

func (w *Worker) startPosterLocked() {
	w.posterOn = true
	w.posterDone = make(chan struct{})
	w.goSafe("transfer poster", w.posterPanicked, w.runPoster)
}

func (w *Worker) stopPosterLocked() {
	w.posterOn = false
	close(w.posterDone)
}

// runPoster posts the queue, batch by batch, until it is empty or the
// worker closes.
func (w *Worker) runPoster() {
	posted := false
	for {
		batch := w.nextPostBatch(posted)
		if batch == nil {
			return
		}
		for _, ps := range batch {
			w.postOne(ps)
		}
		posted = true
	}
}

// nextPostBatch takes the queue (nil: the poster ends). After a batch it
// bumps the change counter: the next poll has results to find.
func (w *Worker) nextPostBatch(posted bool) []*postState {
	defer w.lockTimed("transfer poster")()
	if posted {
		w.postBatch = nil
		w.publishLocked(true)
	}
	if w.closed || len(w.postQueue) == 0 {
		w.stopPosterLocked()
		return nil
	}
	batch := w.postQueue
	w.postQueue = nil
	for _, ps := range batch {
		ps.taken = true
	}
	w.postBatch = batch
	w.postsRunning.Add(int32(len(batch)))
	return batch
}

// postOne posts one transfer taken from the queue, without the worker's
// lock (a fence calls it with the lock: it waits anyway).
func (w *Worker) postOne(ps *postState) {
	defer func() {
		if p := recover(); p != nil {
			w.log.Error("recovered a panic posting a transfer", zap.Any("panic", p), zap.Stack("stack"))
			w.panics.Add(1)
			ps.err = fmt.Errorf("%w (posting a transfer): panic: %v", errPanicked, p)
		}
		close(ps.done)
		w.postsRunning.Add(-1)
	}()
	_, ps.err = ps.x.Post()
}

// posterPanicked fails every post the poster had not made (a panic outside
// a post: nextPostBatch): each is reported failed at its next poll and
// released, never posted.
func (w *Worker) posterPanicked(err error) {
	defer w.lockTimed("transfer poster panicked")()
	fail := func(ps *postState) {
		select {
		case <-ps.done:
			return
		default:
		}
		ps.err = err
		close(ps.done)
	}
	for _, ps := range w.postBatch {
		select {
		case <-ps.done:
		default:
			fail(ps)
			w.postsRunning.Add(-1)
		}
	}
	for _, ps := range w.postQueue {
		ps.taken = true
		fail(ps)
	}
	w.postBatch, w.postQueue = nil, nil
	if w.posterOn {
		w.stopPosterLocked()
	}
	w.publishLocked(true)
}

// dropQueuedLocked takes f's post out of the queue if nobody took it yet:
// it is never posted, and f is an unposted handle again.
func (w *Worker) dropQueuedLocked(f *inflight) bool {
	if f.post == nil || f.post.taken {
		return false
	}
	i := slices.Index(w.postQueue, f.post)
	if i < 0 {
		return false
	}
	w.postQueue = slices.Delete(w.postQueue, i, i+1)
	f.post = nil
	return true
}

// postNowLocked posts, on this thread and under the lock, those of xs whose
// post is still queued: a fence waits for them anyway, and the poster
// cannot take them while the fence holds the lock.
func (w *Worker) postNowLocked(xs []*inflight) {
	for _, f := range xs {
		if f.post == nil || f.post.taken {
			continue
		}
		ps := f.post
		if i := slices.Index(w.postQueue, ps); i >= 0 {
			w.postQueue = slices.Delete(w.postQueue, i, i+1)
		}
		ps.taken = true
		w.postsRunning.Add(1)
		w.postOne(ps)
	}
}

// waitPosterForClose waits, without the lock (the caller set closed and
// holds it; it is held again on return), until the poster ended, bounded
// by closePostWait: handles are released only once no post runs.
func (w *Worker) waitPosterForClose() {
	if !w.posterOn {
		return
	}
	done := w.posterDone
	w.mu.Unlock()
	defer w.mu.Lock()
	select {
	case <-done:
	case <-time.After(closePostWait):
		w.log.Warn("closing with a transfer still being posted after the wait; releasing its handle anyway",
			zap.Duration("waited", closePostWait))
	}
}
