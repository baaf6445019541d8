package sink

import (
	"errors"
	"fmt"
)

// serialReplay is how a dedup session with the order guard but no
// watermark replays (see Session.serial): it cannot tell which of its
// first events the stream already holds, so it publishes them unguarded,
// one at a time, each waiting for the outcome of the one before, until
// one is stored as a new message. From there the session is pipelined and
// guarded, with that message's sequence as the stream's last. After a
// failure nothing more is sent (the next could be stored after a gap).
//
// Publish's goroutine owns it; the ack goroutine sends each outcome on
// the channel of the publish in flight (pendingAck.serial).
type serialReplay struct {
	wait chan serialResult // the outcome of the publish in flight; nil: none
	err  error             // a serial publish failed: send nothing more
}

// serialResult is the outcome of a serial publish, for the next Publish.
type serialResult struct {
	err    error  // not stored (or a repeated id)
	stored bool   // stored as a new message, at seq
	seq    uint64 // its stream sequence
}

// await waits for the outcome of the serial publish in flight, if any (or
// for quit, the session's end). stored: it was stored as a new message, at
// seq; the replay is over. An error means an earlier serial publish
// failed: the next event is not to be sent.
func (r *serialReplay) await(quit <-chan struct{}) (stored bool, seq uint64, err error) {
	if r.err == nil && r.wait != nil {
		select {
		case res := <-r.wait:
			r.err = res.err
			stored, seq = res.err == nil && res.stored, res.seq
		case <-quit:
			r.err = errors.New("the session was closed")
		}
		r.wait = nil
	}
	if r.err != nil {
		return false, 0, fmt.Errorf("not sent: an earlier publish of this session failed (%v); it is republished in order", r.err)
	}
	return stored, seq, nil
}

// sent notes the serial publish now in flight, whose outcome comes on wait.
func (r *serialReplay) sent(wait chan serialResult) { r.wait = wait }
