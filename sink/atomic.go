package sink

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/synadia-io/orbit.go/jetstreamext"
)

// batchOverhead is what a batch adds to a message's headers at most:
// Nats-Batch-Id, -Sequence, -Commit, Nats-Expected-Last-Sequence and
// Jetbox-Tx-Last.
const batchOverhead = 192

// AtomicSession publishes the events of one replication session as JetStream
// atomic batches, so that a transaction is stored whole or not at all.
//
// Publish holds a transaction's events until EndTransaction; then the
// transaction is sealed and goes out, alone or together with the whole
// transactions sealed after it while the previous batch was in flight, as
// one atomic batch of at most the server's batch limit (and the window). A
// larger transaction is sealed in chunks of that size, each atomic; only
// the last message of a transaction carries Jetbox-Tx-Last: true. A
// transaction is cut before its end only when it is larger than a batch or
// when its events alone fill the window (see Flush).
//
// Batches go out one at a time, from the session's goroutine, each
// expecting the stream's last sequence (on its first message: JetStream
// refuses Nats-Expected-Last-Msg-Id in batches, and the previous batch's
// ack gives the exact sequence, so a foreign message in between is caught).
// done callbacks run in order after their batch's ack; a failed batch fails
// its events and every event after it. Exactly-once mode is required: a
// replay is skipped by position, never re-sent, so batch boundaries need not
// be the same after a restart.
type AtomicSession struct {
	p       *Publisher
	max     int // events per batch
	maxSize int // the largest message the server and the stream take
	ctx     context.Context
	cancel  context.CancelFunc // ends a batch in flight when Close gives up

	cur    cursor // exactly-once resume point: the stream's last message at open (session.go)
	source string // this writer's WAL history (Jetbox-Source)
	tx     txText // Publish's goroutine only

	mu      sync.Mutex
	wake    *sync.Cond              // on mu: a unit was sealed, or the session closes
	open    []batchMsg              // the events of the transaction being read, not yet sealed
	queue   [][]batchMsg            // sealed units (whole transactions or chunks), in order
	busy    int                     // sealed units not yet resolved (queued or in flight)
	blocked func() bool             // from Flush
	abort   context.CancelCauseFunc // ends the batch in flight (see watchConn)
	failed  bool                    // a batch failed: every later event fails
	closing bool                    // Close was called
	done    chan struct{}           // closed when the sender has returned

	nextSeq uint64 // sender only: the stream's last sequence
}

type batchMsg struct {
	msg       *nats.Msg
	done      func(error)
	id        string
	pos       format.Position
	committed time.Time
	span      otelSpan // tracing (sink/trace.go); nil when off
}

var (
	errAfterFailure = errors.New("not published: an earlier atomic batch of this session failed")
	errUnfinished   = errors.New("not published: the session closed before the transaction's end was read")
)

// OpenAtomic starts an atomic session (see AtomicSession); Close it to wait
// for its batches. Like Open in exactly-once mode it first reads the
// stream's last message, where the session resumes. It checks the server
// and the stream support atomic batches and asks the server for its batch
// limit (a request for a batch never started: nothing is stored).
func (p *Publisher) OpenAtomic(ctx context.Context, source string) (*AtomicSession, error) {
	c, err := p.resume(ctx, source, false)
	if err != nil {
		return nil, p.closedErr(err)
	}
	cfg := c.stream.CachedInfo().Config
	if err := p.atomicSupport(cfg.AllowAtomicPublish); err != nil {
		return nil, err
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	limit, err := p.AtomicBatchLimit(pctx)
	if err != nil {
		select {
		case <-p.denied: // the probe went unanswered because NATS denied it
			return nil, p.deniedErr
		default:
		}
		return nil, p.closedErr(err)
	}
	maxSize := int(p.nc.MaxPayload())
	if m := int(cfg.MaxMsgSize); m > 0 && m < maxSize {
		maxSize = m
	}
	s := &AtomicSession{p: p, max: limit, maxSize: maxSize, done: make(chan struct{}),
		nextSeq: c.seq, cur: c, source: source}
	s.ctx, s.cancel = context.WithCancel(context.WithoutCancel(ctx))
	s.wake = sync.NewCond(&s.mu)
	go s.watchConn(p.nc.StatusChanged(nats.RECONNECTING, nats.CLOSED))
	go s.send()
	return s, nil
}

// watchConn ends the batch in flight when the connection drops (its reply
// would never come: fail now, as jetstream does for async publishes) or
// NATS denies a publish (the server answers with no reply at all).
func (s *AtomicSession) watchConn(status chan nats.Status) {
	defer s.p.nc.RemoveStatusListener(status)
	denied := s.p.denied
	for {
		var cause error
		select {
		case <-s.ctx.Done():
			return
		case <-status:
			cause = nats.ErrDisconnected
		case <-denied:
			cause, denied = s.p.deniedErr, nil
		}
		s.mu.Lock()
		if s.abort != nil {
			s.abort(cause)
		}
		s.mu.Unlock()
	}
}

// Publish adds ev to the transaction being read. done is called exactly
// once: with nil after ev's batch was stored (or at once for a replay of
// what the stream held at open), or with an error. An error returned here
// means ev was not taken and done will not be called; an event refused
// for its size also fails the session (its transaction is never sealed
// without it: Close fails the transaction's other events). Called from one
// goroutine.
func (s *AtomicSession) Publish(ev *decoder.Event, done func(error)) error {
	pos := eventPos(ev)
	if s.p.skipReplay(s.cur, pos, ev.ID, done) {
		return nil
	}
	h := s.p.header(ev, &s.tx, 4)
	span := s.p.startSpan(ev, h) // tracing (sink/trace.go): ended by done
	done = traceDone(span, done) // tracing
	msg := &nats.Msg{Subject: ev.Subject, Data: ev.Payload, Header: h}
	if size := len(msg.Data) + headerSize(h) + batchOverhead; size > s.maxSize {
		endSpan(span, 0, false, errSpanTooLarge) // tracing
		// The transaction now lacks an event: it must never be sealed.
		s.mu.Lock()
		s.failed = true
		s.mu.Unlock()
		return tooLarge(ev.ID, pos, fmt.Sprintf("message of about %d bytes (payload %d) is over the limit of %d bytes (the server's max_payload or the stream's max_msg_size)", size, len(ev.Payload), s.maxSize))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.failed:
		endSpan(span, 0, false, errAfterFailure) // tracing
		return errAfterFailure
	case s.closing:
		endSpan(span, 0, false, errSpanClosed) // tracing
		return errors.New("not published: the session is closed")
	}
	if len(s.open) > 0 && s.open[0].pos.CommitLSN != pos.CommitLSN {
		s.seal(true) // a new transaction: the previous one ended (republished events carry no EndTransaction)
	}
	if len(s.open) == s.max {
		s.seal(false) // a chunk of a transaction larger than a batch
	}
	s.open = append(s.open, batchMsg{msg: msg, done: done, id: ev.ID, pos: pos, committed: ev.CommitTime, span: span})
	return nil
}

// EndTransaction seals the transaction being read: its last message gets
// Jetbox-Tx-Last: true, and it goes out with the next batch.
func (s *AtomicSession) EndTransaction() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.failed && !s.closing {
		s.seal(true)
	}
}

// Flush records blocked, and sends the events of the transaction being
// read (cutting it) if nothing else the session sent can free the window.
func (s *AtomicSession) Flush(blocked func() bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.blocked = blocked
	s.flushIfStuck()
}

// flushIfStuck seals the open events when the loop waits for room that only
// they can free: nothing sealed is unresolved and the window is still full.
// mu is held; blocked takes the tracker's lock (always after ours).
func (s *AtomicSession) flushIfStuck() {
	if s.busy == 0 && len(s.open) > 0 && !s.failed && !s.closing && s.blocked != nil && s.blocked() {
		s.seal(false)
	}
}

// seal hands the open events to the sender as one unit; last marks the end
// of their transaction. mu is held.
func (s *AtomicSession) seal(last bool) {
	if len(s.open) == 0 {
		return
	}
	if last {
		s.open[len(s.open)-1].msg.Header[format.HeaderTxLast] = []string{"true"}
	}
	s.queue = append(s.queue, s.open)
	s.open = nil
	s.busy++
	s.wake.Signal()
}

// send is the session's goroutine: it publishes the sealed units, one batch
// at a time, merging whole units up to the batch limit.
func (s *AtomicSession) send() {
	defer close(s.done)
	for {
		s.mu.Lock()
		for len(s.queue) == 0 && !s.closing {
			s.wake.Wait()
		}
		if len(s.queue) == 0 || s.ctx.Err() != nil {
			rest := s.takeAll()
			s.mu.Unlock()
			fail(rest, errAbandoned)
			return
		}
		units, n := 1, len(s.queue[0])
		for units < len(s.queue) && n+len(s.queue[units]) <= s.max {
			n += len(s.queue[units])
			units++
		}
		batch := make([]batchMsg, 0, n)
		for _, u := range s.queue[:units] {
			batch = append(batch, u...)
		}
		s.queue = s.queue[units:]
		s.mu.Unlock()

		if err := s.publish(batch); err != nil {
			s.failBatch(batch, err)
		}
		s.mu.Lock()
		s.busy -= units
		s.flushIfStuck()
		s.mu.Unlock()
	}
}

var errAbandoned = errors.New("not published: the atomic session was abandoned")

// takeAll removes every event not yet sent (queued units and open events),
// in order. mu is held.
func (s *AtomicSession) takeAll() []batchMsg {
	var rest []batchMsg
	for _, u := range s.queue {
		rest = append(rest, u...)
	}
	rest = append(rest, s.open...)
	s.busy -= len(s.queue)
	s.queue, s.open = nil, nil
	return rest
}

func fail(msgs []batchMsg, err error) {
	for _, m := range msgs {
		m.done(err)
	}
}

// publish sends batch as one atomic batch and, once stored, calls every
// done. It expects the stream's last sequence on the first message.
func (s *AtomicSession) publish(batch []batchMsg) error {
	if i, j := repeatedID(batch); j >= 0 {
		return &batchError{culprit: j, err: duplicateID(batch[j].id, batch[j].pos,
			fmt.Sprintf("the id repeats row %d of transaction %s, in the same atomic batch: JetStream would refuse the whole batch", batch[i].pos.TxIndex, pglogrepl.LSN(batch[i].pos.CommitLSN)))}
	}
	msgs := make([]*nats.Msg, len(batch))
	for i := range batch {
		msgs[i] = batch[i].msg
	}
	msgs[0].Header[jetstream.ExpectedLastSeqHeader] = []string{strconv.FormatUint(s.nextSeq, 10)}
	// All or nothing: the batch's first message speaks for all of it.
	msgs[0].Header[jetstream.ExpectedStreamHeader] = []string{s.p.cfg.Stream}
	select {
	case <-s.p.denied:
		return s.p.deniedErr
	default:
	}
	actx, abort := context.WithCancelCause(s.ctx)
	ctx, cancel := context.WithTimeout(actx, s.p.cfg.PublishTimeout)
	defer cancel()
	s.mu.Lock()
	s.abort = abort
	s.mu.Unlock()
	ack, err := jetstreamext.PublishMsgBatch(ctx, s.p.js, msgs, jetstreamext.BatchFlowControl{AckFirst: false, AckTimeout: s.p.cfg.PublishTimeout})
	s.mu.Lock()
	s.abort = nil
	s.mu.Unlock()
	abort(nil)
	if err != nil {
		if cause := context.Cause(actx); cause != nil && !errors.Is(cause, context.Canceled) {
			return s.p.closedErr(cause) // the connection dropped, or NATS denied the publish
		}
		return s.p.closedErr(err)
	}
	if err := s.p.checkStream(ack.Stream, batch[0].msg.Subject); err != nil {
		return err
	}
	if want := s.nextSeq + uint64(len(batch)); ack.Sequence != want {
		s.p.log.Warn().Uint64("seq", ack.Sequence).Uint64("expected", want).Msg("atomic batch stored at an unexpected sequence")
	}
	s.nextSeq = ack.Sequence
	s.p.raiseAcked(ack.Sequence)
	s.p.record(outStored, len(batch))
	for i, b := range batch {
		s.p.cfg.Metrics.Latency.Observe(time.Since(b.committed).Seconds())
		setSpanSeq(b.span, ack.Sequence-uint64(len(batch)-1-i)) // tracing (sink/trace.go)
		b.done(nil)
	}
	return nil
}

// repeatedID returns the indexes of the first id that appears twice in
// batch (i the first, j the repeat), or -1, -1.
func repeatedID(batch []batchMsg) (int, int) {
	seen := make(map[string]int, len(batch))
	for j, b := range batch {
		if i, ok := seen[b.id]; ok {
			return i, j
		}
		seen[b.id] = j
	}
	return -1, -1
}

// batchError is a batch refused because of one of its events.
type batchError struct {
	culprit int
	err     error
}

func (e *batchError) Error() string { return e.err.Error() }
func (e *batchError) Unwrap() error { return e.err }

// failBatch resolves a batch that was not stored, and everything after it.
// The event that made JetStream refuse the batch (a repeated id) gets its
// own error first, so that it is the failure's cause (it may be dead
// lettered); the others get one that does not name a bad row.
func (s *AtomicSession) failBatch(batch []batchMsg, err error) {
	s.mu.Lock()
	s.failed = true
	rest := s.takeAll()
	s.mu.Unlock()
	s.p.record(outFailed, len(batch))

	culprit, err := s.explain(batch, err)
	first, lastm := batch[0].pos, batch[len(batch)-1].pos
	others := fmt.Errorf("atomic batch of %d events (transaction %s row %d to transaction %s row %d) not stored: %w",
		len(batch), pglogrepl.LSN(first.CommitLSN), first.TxIndex, pglogrepl.LSN(lastm.CommitLSN), lastm.TxIndex, err)
	if culprit >= 0 {
		batch[culprit].done(err)
		others = fmt.Errorf("atomic batch of %d events not stored: row id=%s (transaction %s, row %d) made JetStream refuse it",
			len(batch), batch[culprit].id, pglogrepl.LSN(batch[culprit].pos.CommitLSN), batch[culprit].pos.TxIndex)
	}
	for i, b := range batch {
		if i != culprit {
			b.done(others)
		}
	}
	fail(rest, errAfterFailure)
}

// explain turns a batch failure into the error to report, and finds the
// event that caused it (-1 when none did).
func (s *AtomicSession) explain(batch []batchMsg, err error) (int, error) {
	var be *batchError
	if errors.As(err, &be) {
		return be.culprit, be.err
	}
	var apiErr *jetstream.APIError
	if errors.Is(err, nats.ErrMaxPayload) {
		if i, ierr := s.oversized(batch); i >= 0 {
			return i, ierr
		}
	}
	if !errors.As(err, &apiErr) {
		return -1, err
	}
	switch apiErr.ErrorCode {
	case jetstreamext.JSErrCodeBatchPublishNotEnabled:
		return -1, s.p.atomicSupport(false)
	case jetstream.JSErrCodeStreamMessageExceedsMaximum, jetstreamext.JSErrCodeBatchPublishIncomplete:
		// JetStream drops a message over the stream's max_msg_size from
		// its batch (refused alone, or the batch is then incomplete): the
		// limits may have been lowered since the session opened.
		if i, ierr := s.oversized(batch); i >= 0 {
			return i, ierr
		}
	case jetstreamext.JSErrCodeBatchPublishDuplicateMsgID:
		ctx, cancel := context.WithTimeout(s.ctx, s.p.cfg.PublishTimeout)
		defer cancel()
		// A replay: the batch was applied after all (a leader change, a
		// stale instance during a takeover) after this session read the
		// stream's last message. A new session resumes after it.
		if held, rerr := s.streamHolds(ctx, batch[0].pos); rerr != nil {
			return -1, fmt.Errorf("%w (and reading the stream's last message failed: %v)", err, rerr)
		} else if held {
			return -1, fmt.Errorf("the stream already holds this batch's events (stored by an earlier attempt or another instance after this session opened): resuming after the stream's last message: %w", err)
		}
		// Not a replay: this is another row's id, still in the
		// duplicate window: ask which.
		for i, b := range batch {
			code, perr := s.p.probe(ctx, b.msg.Subject, b.id, 1, true)
			if perr != nil {
				return -1, fmt.Errorf("%w (and finding the repeated id failed: %v)", err, perr)
			}
			if code == jetstreamext.JSErrCodeBatchPublishDuplicateMsgID {
				return i, duplicateID(b.id, b.pos, "the id is already used by a message inside the stream's duplicate window: JetStream refuses the whole atomic batch")
			}
		}
		return -1, &PermanentError{Err: fmt.Errorf("JetStream refused an atomic batch for a repeated id, and no row of it repeats one now: %w", err),
			Hint: "check that jetbox is the stream's only writer and restart it"}
	}
	return -1, err
}

// streamHolds reports whether the stream's last message is, now, from
// this source at or after pos.
func (s *AtomicSession) streamHolds(ctx context.Context, pos format.Position) (bool, error) {
	st, err := s.p.js.Stream(ctx, s.p.cfg.Stream)
	if err != nil {
		return false, fmt.Errorf("look up stream %q: %w", s.p.cfg.Stream, err)
	}
	if st.CachedInfo().State.LastSeq == 0 {
		return false, nil
	}
	// The message-get API, unlike the stream info, is isolated from a batch being applied.
	m, err := st.GetLastMsgForSubject(ctx, ">")
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	last, ok := format.ParsePosition(m.Header)
	// A message of an abandoned history (ForgetHistory) has no comparable position.
	return ok && m.Sequence > s.p.forgetThrough.Load() && format.SameWriter(m.Header.Get(format.HeaderSource), s.source) && !last.Less(pos), nil
}

// oversized returns the first message of a refused batch over the limits
// the server and the stream have now (they may have been lowered since the
// session opened), with its too-large error; -1 when none is.
func (s *AtomicSession) oversized(batch []batchMsg) (int, error) {
	limit, what := int(s.p.nc.MaxPayload()), "the server's max_payload"
	ctx, cancel := context.WithTimeout(s.ctx, s.p.cfg.PublishTimeout)
	defer cancel()
	if st, err := s.p.js.Stream(ctx, s.p.cfg.Stream); err == nil {
		if m := int(st.CachedInfo().Config.MaxMsgSize); m > 0 && m < limit {
			limit, what = m, "the stream's max_msg_size"
		}
	}
	for i, b := range batch {
		// What the server measures: the payload and the encoded headers,
		// including the batch's own.
		if size := len(b.msg.Data) + headerSize(b.msg.Header); size > limit {
			return i, tooLarge(b.id, b.pos,
				fmt.Sprintf("message of %d bytes (payload %d) is over %s of %d bytes (lowered while jetbox ran?): JetStream refused its atomic batch", size, len(b.msg.Data), what, limit))
		}
	}
	return -1, nil
}

// Close waits until every sealed batch was resolved (bounded by ctx: then
// the batch in flight is abandoned). The events of a transaction whose end
// was not read are not published: their done gets an error at once.
//
// Close is idempotent and safe to call from several goroutines; Publish must
// not be called once Close was.
func (s *AtomicSession) Close(ctx context.Context) error {
	s.mu.Lock()
	var unfinished []batchMsg
	if !s.closing {
		s.closing = true
		unfinished, s.open = s.open, nil
		s.wake.Broadcast()
	}
	s.mu.Unlock()
	fail(unfinished, errUnfinished)
	select {
	case <-s.done:
		s.cancel()
		return nil
	case <-ctx.Done():
		s.cancel()
		<-s.done
		return fmt.Errorf("wait for in-flight atomic batches: %w", ctx.Err())
	}
}
