package shim

import "github.com/gonixl/gonixl/shim/kvwire"

// The wire types shim works with are kvwire's (one home for the formats);
// these names let the connector logic say BlockIDs rather than
// kvwire.BlockIDs at every use.
type (
	BlockIDs       = kvwire.BlockIDs
	TransferParams = kvwire.TransferParams
	StepMeta       = kvwire.StepMeta
	RecvReq        = kvwire.RecvReq
	RemoteMeta     = kvwire.RemoteMeta
	PushFinished   = kvwire.PushFinished
	HeartbeatInfo  = kvwire.HeartbeatInfo
	Finished       = kvwire.Finished
	BlockReshape   = kvwire.BlockReshape
)

// ParseTransferParams is kvwire.ParseTransferParams with its errors in
// class ErrInvalidInput (capi maps it to GONIXL_ERR_INVALID_ARG).
func ParseTransferParams(data []byte) (_ *TransferParams, err error) {
	defer classify(&err, ErrInvalidInput)
	return kvwire.ParseTransferParams(data)
}

// DecodeStepMeta is kvwire.DecodeStepMeta.
func DecodeStepMeta(b []byte) (*StepMeta, error) { return kvwire.DecodeStepMeta(b) }

// pushReg is a registration as a prefill keeps it: the decode's message
// and when it arrived (this worker's clock).
type pushReg struct {
	kvwire.PushReg
	received float64
	// from: the decode agent that sent it. Its blocks are that process's:
	// a process that took the decode's engine id and address after it
	// (a restart) has other agents and is never written.
	from string
}

// decodePushReg parses a registration (without its prefix).
func decodePushReg(b []byte) (*pushReg, error) {
	r, err := kvwire.DecodePushReg(b)
	if err != nil {
		return nil, err
	}
	return &pushReg{PushReg: *r}, nil
}
