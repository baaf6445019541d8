package sink

import (
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// ackWatcher is the state of a session's ack goroutine (Session.watch): the
// events it resolved whose done waits for the watermark, and whether the
// pipeline is still in order. Its transitions:
//
//   - a publish fails, or its ack comes from another stream (fail): broken
//     and frozen;
//   - a guarded publish is acked as a Duplicate other than this very row at
//     the sequence it expected (duplicate): broken;
//   - storing the watermark fails (flush): frozen, and the events it was to
//     cover get the error.
//
// Neither is ever undone: a new session starts afresh.
type ackWatcher struct {
	s *Session
	// broken: a guarded publish of this session failed or was not found
	// where the pipeline expected it, so the expected sequences after it
	// are off by one and a later publish can only be stored after a
	// message jetbox did not send: acks after it do not move ackedSeq (see
	// checkSinceLastAck). A replay sent unguarded shifts nothing.
	broken bool
	// frozen: a failure in this session; the watermark stays before it.
	frozen bool
	// ready: resolved events whose done waits for the watermark to cover
	// them (it is stored first, see flush).
	ready []readyAck
}

// readyAck is a resolved event waiting for flush.
type readyAck struct {
	pa  pendingAck
	seq uint64
	dup bool
}

// flushEvery is how many resolved events wait for one watermark store at
// most.
const flushEvery = 1024

// watch is the session's ack goroutine: it resolves the publishes in
// order and calls their done callbacks.
func (s *Session) watch() {
	defer s.wg.Done()
	defer s.cancel()
	w := &ackWatcher{s: s}
	defer w.flush()
	for {
		pa, more := w.next()
		if !more {
			return
		}
		ack, quit, err := w.await(pa)
		if quit {
			w.abandon(pa)
			return
		}
		w.resolve(pa, ack, err)
	}
}

// next returns the next publish in flight; while there is none, the
// resolved ones go (flush). more is false once the session closed.
func (w *ackWatcher) next() (pa pendingAck, more bool) {
	select {
	case pa, more = <-w.s.pending:
	default:
		w.flush() // nothing more in flight now
		pa, more = <-w.s.pending
	}
	return pa, more
}

// await waits for pa's PubAck or failure: its own, a permissions violation
// (NoteAsyncError) or the connection closed for good. quit: the session was
// abandoned meanwhile (Close gave up).
func (w *ackWatcher) await(pa pendingAck) (ack *jetstream.PubAck, quit bool, err error) {
	select {
	case ack = <-pa.fut.Ok():
		return ack, false, nil
	case err = <-pa.fut.Err():
		return nil, false, err
	default:
	}
	w.flush() // nothing more to resolve now: let the resolved ones go
	p := w.s.p
	select {
	case ack = <-pa.fut.Ok():
	case err = <-pa.fut.Err():
	case <-p.denied:
		err = p.deniedErr
	case <-p.gone:
		err = p.ClosedError()
	case <-w.s.quit:
		quit = true
	}
	return ack, quit, err
}

// abandon ends the session's remaining events without their done calls:
// the resolved ones, pa and those still pending (Close closed pending
// before quit). Their spans end as abandoned.
func (w *ackWatcher) abandon(pa pendingAck) {
	for _, r := range w.ready {
		endSpan(r.pa.span, 0, false, errSpanAbandoned) // tracing
	}
	w.ready = nil
	endSpan(pa.span, 0, false, errSpanAbandoned) // tracing
	for pa := range w.s.pending {
		endSpan(pa.span, 0, false, errSpanAbandoned) // tracing
	}
}

// resolve takes pa's PubAck (or err, its failure): a failure fails it at
// once; a stored or duplicate event waits in ready for the next flush,
// unless a serial Publish waits for it.
func (w *ackWatcher) resolve(pa pendingAck, ack *jetstream.PubAck, err error) {
	p := w.s.p
	if err == nil {
		err = p.checkStream(ack.Stream, pa.subject)
	}
	if err != nil {
		w.broken = true
		if err != p.deniedErr {
			err = p.classify(pa, err)
		}
		w.fail(pa, err)
		return
	}
	if ack.Duplicate {
		if err := w.duplicate(pa, ack.Sequence); err != nil {
			w.fail(pa, err)
			return
		}
		p.record(outDuplicate, 1)
	} else {
		w.stored(pa, ack.Sequence)
	}
	w.ready = append(w.ready, readyAck{pa: pa, seq: ack.Sequence, dup: ack.Duplicate})
	if pa.serial != nil || len(w.ready) >= flushEvery {
		w.flush() // a Publish waits for it
	}
}

// stored takes pa's ack as a new message at seq.
func (w *ackWatcher) stored(pa pendingAck, seq uint64) {
	p := w.s.p
	w.inOrder(seq)
	if p.cfg.Delivery.Guarded() {
		p.claim(seq, pa.pos)
	}
	p.record(outStored, 1)
	p.cfg.Metrics.Latency.Observe(time.Since(pa.committed).Seconds())
}

// duplicate takes pa's Duplicate PubAck naming seq: a replay, or a repeated
// id (the error). A guarded publish keeps the pipeline in order only when
// the original is this very row at the sequence it expected (an earlier
// attempt stored late).
func (w *ackWatcher) duplicate(pa pendingAck, seq uint64) error {
	same, err := w.s.checkDuplicate(pa, seq)
	if pa.guarded {
		if same && seq == pa.expect+1 {
			w.inOrder(seq)
		} else {
			w.broken = true
		}
	}
	return err
}

// inOrder notes that the message at seq is jetbox's, in order, unless the
// pipeline is broken.
func (w *ackWatcher) inOrder(seq uint64) {
	if !w.broken {
		w.s.p.raiseAcked(seq)
	}
}

// fail fails pa with err, after letting the events resolved before it go;
// the watermark stays before it.
func (w *ackWatcher) fail(pa pendingAck, err error) {
	w.flush()
	w.frozen = true
	w.s.p.record(outFailed, 1)
	endSpan(pa.span, 0, false, err) // tracing
	pa.done(err)
	pa.report(serialResult{err: err})
}

// flush moves the watermark over the resolved events (unless frozen) and
// then calls their done: with nil, or with the error of storing the
// watermark, which freezes it.
func (w *ackWatcher) flush() {
	if len(w.ready) == 0 {
		return
	}
	var err error
	if !w.frozen {
		seq := uint64(0)
		for _, r := range w.ready {
			seq = max(seq, r.seq)
		}
		if err = w.s.advance(w.ready[len(w.ready)-1].pa.pos, seq); err != nil {
			w.frozen = true
			w.s.p.log.Warn().Err(err).Msg("events stored, but not confirmed until republished")
		}
	}
	for _, r := range w.ready {
		endSpan(r.pa.span, r.seq, r.dup, err) // tracing: the outcome done reports
		r.pa.done(err)
		if err != nil {
			r.pa.report(serialResult{err: err})
		} else {
			r.pa.report(serialResult{stored: !r.dup, seq: r.seq})
		}
	}
	w.ready = w.ready[:0]
}

// report tells a waiting Publish the outcome of a serial publish.
func (pa pendingAck) report(r serialResult) {
	if pa.serial != nil {
		pa.serial <- r
	}
}
