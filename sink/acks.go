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
	// lastStore: when flush last stored the watermark (dedup mode), and
	// storeTimer: fires when the next store is due (see settle).
	lastStore  time.Time
	storeTimer *time.Timer
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

// Coalesced watermark stores (dedup mode). The watermark is a KV Put: a
// message the NATS server stores (and whose older revision it removes),
// sent on jetbox's connection between the outbox messages. Stored after
// every in-order advance, in 1-row transactions that was one Put per event,
// each delaying the next event's store on the server and, while it waited,
// the ack goroutine. Now, when nothing more is to resolve, the resolved
// events wait until watermarkEvery has passed since the last store (or
// until flushLimit of them wait, a serial Publish waits, a failure comes,
// or the session closes), and one Put covers them all.
//
// Why this keeps the promises. What flush stores and when it calls done is
// unchanged: it stores the watermark of the in-order prefix of events
// JetStream acked (stored in order, or proved replays), and calls their
// done only after that store succeeded. So, at every moment,
//
//   - the stored watermark is never ahead of the stream: it only names
//     events acked in order, i.e. durably held in the stream in order;
//   - the stored watermark covers every event whose done was called, so
//     everything jetbox can confirm to PostgreSQL (the tracker's in-order
//     prefix of done events) is at or before it, and everything after it
//     is replayed after a crash. A replayed event's Duplicate PubAck whose
//     original is gone is proved by its claim (the original's sequence is
//     after the stored watermark's), exactly as for an event acked but not
//     yet flushed before this change.
//
// A crash between an ack and the store loses nothing (the events were not
// confirmed: they are sent again, and the duplicate window or the claims
// absorb them) and duplicates nothing the dedup contract did not already
// allow. The only change is when done runs: up to watermarkEvery after the
// ack, which delays the confirmed LSN by that much (it is sent every
// --status-interval, 1 s by default) and holds that many events in the
// tracker's window (flushLimit keeps half of it free).
const watermarkEvery = 50 * time.Millisecond

// flushLimit is how many resolved events wait for a coalesced store at
// most: half the tracker's window (the sink's MaxPending follows it), so
// done calls never hold up the publishing.
func (w *ackWatcher) flushLimit() int {
	window := w.s.p.cfg.MaxPending
	if window < 1 {
		window = DefaultMaxPending // what New sets
	}
	return min(flushEvery, max(1, window/2))
}

// coalesces reports whether flush stores the watermark, so that its stores
// are coalesced (dedup mode with the order guard, not frozen).
func (w *ackWatcher) coalesces() bool {
	return w.s.p.cfg.Delivery.PersistsWatermark() && !w.frozen
}

// settle lets the resolved events go when nothing more is to resolve now:
// at once, unless their watermark store is not due yet (see
// watermarkEvery); it then returns the channel that fires when it is (nil:
// nothing waits).
func (w *ackWatcher) settle() <-chan time.Time {
	if len(w.ready) == 0 {
		return nil
	}
	wait := time.Duration(0)
	if w.coalesces() {
		wait = time.Until(w.lastStore.Add(watermarkEvery))
	}
	if wait <= 0 {
		w.flush()
		return nil
	}
	if w.storeTimer == nil {
		w.storeTimer = time.NewTimer(wait)
	} else {
		w.storeTimer.Reset(wait) // Go 1.23+: no stale tick after Reset
	}
	return w.storeTimer.C
}

// watch is the session's ack goroutine: it resolves the publishes in
// order and calls their done callbacks.
func (s *Session) watch() {
	defer s.wg.Done()
	defer s.cancel()
	w := &ackWatcher{s: s}
	defer w.flush()
	defer func() {
		if w.storeTimer != nil {
			w.storeTimer.Stop()
		}
	}()
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
// resolved ones go (settle). more is false once the session closed.
func (w *ackWatcher) next() (pa pendingAck, more bool) {
	select {
	case pa, more = <-w.s.pending:
		return pa, more
	default:
	}
	for {
		due := w.settle() // nothing more in flight now
		select {
		case pa, more = <-w.s.pending:
			return pa, more
		case <-due:
			w.flush()
		}
	}
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
	p := w.s.p
	for {
		due := w.settle() // nothing more to resolve now: let the resolved ones go
		select {
		case ack = <-pa.fut.Ok():
		case err = <-pa.fut.Err():
		case <-p.denied:
			err = p.deniedErr
		case <-p.gone:
			err = p.ClosedError()
		case <-w.s.quit:
			quit = true
		case <-due:
			w.flush()
			continue
		}
		return ack, quit, err
	}
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
	if pa.serial != nil || len(w.ready) >= w.flushLimit() {
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
		w.lastStore = time.Now()
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
