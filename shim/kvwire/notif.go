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

package kvwire

import (
	"strconv"
	"strings"
)

// HeartbeatPrefix starts a heartbeat notification.
const HeartbeatPrefix = "HB:"

// DoneNotif formats a "<req>:<consumers>" notification.
func DoneNotif(remoteReqID string, consumers int) []byte {
	return []byte(remoteReqID + ":" + strconv.Itoa(consumers))
}

// HeartbeatNotif formats an "HB:" notification for the given request ids.
func HeartbeatNotif(reqIDs []string) []byte {
	return []byte(HeartbeatPrefix + strings.Join(reqIDs, ","))
}

// Notif is a parsed notification: a heartbeat (Heartbeat set, IDs listed)
// or a done notification (ReqID, Consumers > 0).
type Notif struct {
	Heartbeat bool
	IDs       []string
	ReqID     string
	Consumers int
}

// ParseNotif parses one notification; ok is false for a malformed one.
func ParseNotif(msg string) (n Notif, ok bool) {
	if ids, hb := strings.CutPrefix(msg, HeartbeatPrefix); hb {
		return Notif{Heartbeat: true, IDs: strings.Split(ids, ",")}, true
	}
	i := strings.LastIndexByte(msg, ':')
	if i < 0 {
		return Notif{}, false
	}
	c, err := strconv.Atoi(msg[i+1:])
	if err != nil || c <= 0 {
		return Notif{}, false
	}
	return Notif{ReqID: msg[:i], Consumers: c}, true
}
