package sink

// The pipeline: a Session publishes a replication session's events
// asynchronously, with the order guard when the delivery mode has it, and
// its ack goroutine (acks.go) resolves them in order. Where a session
// resumes is session.go's; the serial dedup replay serial.go's.

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
)

// Session is one pipelined publishing run, matching one replication session.
// Publish is called from one goroutine; done callbacks run on the session's
// ack goroutine, in publish order.
type Session struct {
	p       *Publisher
	pending chan pendingAck
	quit    chan struct{}
	wg      sync.WaitGroup
	closing sync.Once // closes pending
	quitter sync.Once // closes quit
	// ctx ends when the session quits: the ack goroutine's stream reads
	// (checkDuplicate) use it, so a stop is not held up by a slow read.
	ctx    context.Context
	cancel context.CancelFunc

	cur    cursor // where the session resumed (session.go)
	source string // this writer's WAL history
	// idGuard: also expect the previous message's id (exactly-once, R1).
	idGuard bool
	lastID  string
	// The previous message (the stream's last one when the session opened,
	// then the last published): the same id at another position is a
	// repeated id, refused before publishing (JetStream's order guard
	// cannot see it: the expected last id would match).
	prevID  string
	prevPos format.Position

	tx txText // the current transaction's header values, formatted once
	// hdr and vals: the headers of a publish without retries, reused by
	// the next one (see Publish).
	hdr  nats.Header
	vals []string

	// serial (dedup mode with the order guard, no watermark): publish
	// unguarded, one at a time, until one is stored as new (package doc);
	// nil once pipelined.
	serial *serialReplay

	nextSeq uint64 // the stream's last sequence before the next publish
}

type pendingAck struct {
	serial    chan<- serialResult // a serial publish: tell Publish its outcome
	guarded   bool                // sent with Nats-Expected-Last-Sequence: expect
	expect    uint64
	fut       jetstream.PubAckFuture
	done      func(error)
	committed time.Time
	id        string
	subject   string
	pos       format.Position
	size      int
	span      otelSpan // tracing (sink/trace.go); nil when off
}

// Open starts a session; Close it to wait for its acks. In exactly-once mode
// it first reads the stream's last message: its position is where this
// session resumes, and its sequence the base of the expected sequences.
//
// source identifies this writer's WAL history (see decoder.Event.Origin):
// exactly-once mode refuses to resume after a message from another one.
func (p *Publisher) Open(ctx context.Context, source string) (*Session, error) {
	return p.open(ctx, source, false)
}

// open starts a session; repair: a jetbox repair session (see OpenRepair).
func (p *Publisher) open(ctx context.Context, source string, repair bool) (*Session, error) {
	c, err := p.resume(ctx, source, repair)
	if err != nil {
		return nil, p.closedErr(err)
	}
	replicas := c.stream.CachedInfo().Config.Replicas
	s := &Session{p: p, pending: make(chan pendingAck, p.cfg.MaxPending+1), quit: make(chan struct{}), source: source,
		cur: c, nextSeq: c.seq, prevID: c.id, prevPos: c.pos, idGuard: p.cfg.Delivery.ExactlyOnce() && replicas <= 1}
	if c.chain {
		s.lastID = c.id
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	s.loadWatermark(lctx, replicas)
	cancel()
	if p.cfg.Delivery == DedupGuarded && !c.watermark && s.nextSeq > 0 {
		s.serial = &serialReplay{}
	}
	s.wg.Add(1)
	go s.watch()
	return s, nil
}

// Publish sends ev asynchronously. done is called exactly once, with nil when
// JetStream stored the message (or already had it), unless the session is
// abandoned by a Close whose ctx expired. An error returned here means the
// message was not sent and done will not be called.
func (s *Session) Publish(ev *decoder.Event, done func(error)) error {
	pos := eventPos(ev)
	if s.p.skipReplay(s.cur, pos, ev.ID, done) {
		return nil
	}
	if ev.ID == s.prevID && pos != s.prevPos {
		return duplicateID(ev.ID, pos, fmt.Sprintf("the id repeats the previous row's (transaction %s, row %d) inside the duplicate window: JetStream would drop this row silently", pglogrepl.LSN(s.prevPos.CommitLSN), s.prevPos.TxIndex))
	}
	var opts []jetstream.PublishOpt
	// A replay of what the stream held when the session opened goes without
	// an expected sequence: it is a Duplicate and stores nothing.
	guarded := s.p.cfg.Delivery.Guarded() && !s.cur.covers(pos)
	var serial chan serialResult
	if guarded && s.serial != nil {
		stored, seq, err := s.serial.await(s.quit)
		if err != nil {
			return err
		}
		if stored {
			s.serial, s.nextSeq = nil, seq // pipelined and guarded from here
		} else {
			guarded, serial = false, make(chan serialResult, 1)
			opts = noRetry
		}
	}
	if guarded {
		opts = noRetry
	}
	var h nats.Header
	if opts == nil {
		// nats.go may send it again (a retry after no responders).
		h = s.p.header(ev, &s.tx, 0)
	} else {
		// Without retries nats.go reads the headers only inside
		// PublishMsgAsync: the session's map and values serve again.
		if s.hdr == nil {
			s.hdr = make(nats.Header, 13+len(ev.Headers))
		}
		clear(s.hdr)
		h = s.hdr
		s.vals = s.p.fillHeader(h, s.vals[:0], ev, &s.tx)
	}
	if guarded {
		// Pipelined: the k-th message in flight expects base+k-1. A
		// Duplicate PubAck after the watermark stores nothing, so the
		// messages after it are refused and republished by a new session.
		s.vals = setHeader(h, s.vals, jetstream.ExpectedLastSeqHeader, strconv.FormatUint(s.nextSeq, 10))
		if s.idGuard && s.lastID != "" {
			s.vals = setHeader(h, s.vals, jetstream.ExpectedLastMsgIDHeader, s.lastID)
		}
	}
	span := s.p.startSpan(ev, h) // tracing (sink/trace.go)
	msg := &nats.Msg{Subject: ev.Subject, Data: ev.Payload, Header: h}
	fut, err := s.p.js.PublishMsgAsync(msg, opts...)
	if err != nil {
		endSpan(span, 0, false, err) // tracing
		s.p.record(outFailed, 1)
		if errors.Is(err, nats.ErrMaxPayload) {
			return tooLarge(ev.ID, pos, fmt.Sprintf("message of %d bytes (payload %d) is over the server's max_payload of %d bytes", len(msg.Data)+headerSize(msg.Header), len(ev.Payload), s.p.nc.MaxPayload()))
		}
		return s.p.closedErr(fmt.Errorf("publish to %s: %w", ev.Subject, err))
	}
	s.prevID, s.prevPos, s.lastID = ev.ID, pos, ev.ID
	if guarded {
		s.nextSeq++
	}
	if serial != nil {
		s.serial.sent(serial)
	}
	s.pending <- pendingAck{serial: serial, guarded: guarded, expect: s.nextSeq - 1, fut: fut, done: done, committed: ev.CommitTime, id: ev.ID, subject: ev.Subject, pos: pos, size: len(ev.Payload), span: span}
	return nil
}

// noRetry is the publish option of a guarded or serial publish, built once
// (not per event): nats.go only reads it.
var noRetry = []jetstream.PublishOpt{jetstream.WithRetryAttempts(0)}

// checkStream reports an ack from another stream than jetbox's: one that
// took over the subjects stored the message (and jetbox's stream did not).
func (p *Publisher) checkStream(stream, subject string) error {
	if stream == p.cfg.Stream {
		return nil
	}
	return fmt.Errorf("the PubAck comes from stream %q, not %q: another stream captures %s (changed while jetbox ran?); the event is not confirmed", stream, p.cfg.Stream, subject)
}

func (p *Publisher) classify(pa pendingAck, err error) error {
	if cerr := p.closedErr(err); cerr != err {
		return cerr
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum {
		return tooLarge(pa.id, pa.pos,
			fmt.Sprintf("stream %s refused the message (payload %d bytes): %v", p.cfg.Stream, pa.size, err))
	}
	return err
}

// checkDuplicate tells a replay (the stream already holds this very row)
// from a repeated id (another row used it inside the duplicate window, and
// JetStream would drop this one silently): a Duplicate PubAck after the
// session's watermark is compared with the original message at seq. same
// reports that the original was read and is this row.
func (s *Session) checkDuplicate(pa pendingAck, seq uint64) (same bool, err error) {
	if s.cur.covers(pa.pos) {
		return false, nil
	}
	ctx, cancel := context.WithTimeout(s.ctx, s.p.cfg.PublishTimeout)
	defer cancel()
	orig, err := s.cur.stream.GetMsg(ctx, seq)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		if s.provenReplay(pa.pos, seq) {
			return false, nil
		}
		return false, duplicateID(pa.id, pa.pos, fmt.Sprintf("the id is already used by stream message seq %d inside the duplicate window, which is no longer in the stream (removed by retention or a purge) and is not this row by jetbox's watermark: JetStream would drop this row silently", seq))
	}
	if err != nil {
		return false, fmt.Errorf("read message seq %d to check a Duplicate PubAck for id %s: %w", seq, pa.id, err)
	}
	op, ok := format.ParsePosition(orig.Header)
	if ok && op == pa.pos {
		return true, nil // the same row, stored before
	}
	what := fmt.Sprintf("stream message seq %d (not written by jetbox)", seq)
	if ok {
		what = fmt.Sprintf("stream message seq %d (transaction %s, row %d)", seq, pglogrepl.LSN(op.CommitLSN), op.TxIndex)
	}
	return false, duplicateID(pa.id, pa.pos, "the id is already used by "+what+" inside the duplicate window: JetStream would drop this row silently")
}

// EndTransaction does nothing: this session sends every event at once.
func (s *Session) EndTransaction() {}

// Flush does nothing: this session holds no event back.
func (s *Session) Flush(func() bool) {}

// Close waits until every published event's done was called, or ctx ends;
// in that case the remaining acks are abandoned and their done never runs.
//
// Close is idempotent and safe to call from several goroutines; Publish must
// not be called once Close was.
func (s *Session) Close(ctx context.Context) error {
	s.closing.Do(func() { close(s.pending) })
	finished := make(chan struct{})
	go func() { s.wg.Wait(); close(finished) }()
	select {
	case <-finished:
		return nil
	case <-ctx.Done():
		s.quitter.Do(func() { close(s.quit); s.cancel() })
		<-finished
		return fmt.Errorf("wait for in-flight acks: %w", ctx.Err())
	}
}
