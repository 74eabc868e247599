// Notifications between a decode's workers and a prefill's workers, carried
// by the transfer engine (NIXL notifications, or gonixl's UCX engine's),
// byte for byte as vLLM's NixlConnector writes and reads them (the
// installed vLLM 0.32: nixl/pull_worker.py and base_worker.py):
//
//	"<remote_request_id>:<consumers>"  a decode worker is done with the
//	                                   request's blocks (read, or will not
//	                                   read them); the prefill frees them
//	                                   once <consumers> such notifications
//	                                   arrived (vLLM's plan.local_consumers:
//	                                   how many decode ranks read this
//	                                   prefill rank). The request id may
//	                                   itself contain ':' (split at the last).
//	"HB:<id>,<id>,..."                 heartbeat: the decode still wants
//	                                   these requests' blocks; the prefill
//	                                   extends each lease it holds.
//
// A notification that is neither (no ':<count>', a count that is not a
// positive integer) is logged as malformed and ignored.

package shim

import (
	"strconv"
	"strings"
)

const heartbeatPrefix = "HB:"

// doneNotif formats a "<req>:<consumers>" notification.
func doneNotif(remoteReqID string, consumers int) []byte {
	return []byte(remoteReqID + ":" + strconv.Itoa(consumers))
}

// heartbeatNotif formats an "HB:" notification for the given request ids.
func heartbeatNotif(reqIDs []string) []byte {
	return []byte(heartbeatPrefix + strings.Join(reqIDs, ","))
}

// notif is a parsed notification: a heartbeat (heartbeat set, ids listed)
// or a done notification (reqID, consumers > 0).
type notif struct {
	heartbeat bool
	ids       []string
	reqID     string
	consumers int
}

// parseNotif parses one notification; ok is false for a malformed one.
func parseNotif(msg string) (n notif, ok bool) {
	if ids, hb := strings.CutPrefix(msg, heartbeatPrefix); hb {
		return notif{heartbeat: true, ids: strings.Split(ids, ",")}, true
	}
	i := strings.LastIndexByte(msg, ':')
	if i < 0 {
		return notif{}, false
	}
	c, err := strconv.Atoi(msg[i+1:])
	if err != nil || c <= 0 {
		return notif{}, false
	}
	return notif{reqID: msg[:i], consumers: c}, true
}
