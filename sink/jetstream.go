// Package sink publishes outbox events to NATS JetStream and reports, per
// event, whether JetStream stored it.
//
// Each event becomes one message with Nats-Msg-Id = the outbox row id, so the
// stream's duplicate window absorbs replays; a Duplicate PubAck is success.
// Publishing is asynchronous and pipelined. With the order guard on (the
// default, and always in exactly-once mode), every message carries
// Nats-Expected-Last-Sequence: the stream's last sequence when the session
// opened plus the messages published before it in the session. If one
// message is lost (a reconnect drops the client's write buffer, a leader
// dies with it), JetStream refuses every later one, so the stream can hold
// neither a gap nor a reordering. The failure ends the session and the
// republish fills the hole in order.
//
// Exactly-once mode on an R1 stream also sends Nats-Expected-Last-Msg-Id =
// the previous event's id, so a foreign message slipped in after a refused
// publish cannot let a later event of ours match its expected sequence. Not
// on replicated streams: nats-server 2.14 and 2.15 check that header only
// when replicas apply the message and take the stream down on a mismatch
// (or on valid messages, after a replica's catch-up); the expected sequence
// is checked by the leader. There, checkSinceLastAck stops jetbox instead.
package sink

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jetbox-dev/jetbox/internal/fault"
	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
)

// Config configures publishing.
type Config struct {
	Stream        string // stream name, e.g. "OUTBOX"
	SubjectPrefix string // subjects are "<prefix>.>"
	// JSDomain is the JetStream domain of the stream ("" for the server's
	// own JetStream): its API is then $JS.<domain>.API.
	JSDomain string
	// SubjectFilter matches every subject the subject template produces
	// (decoder.Template.Filter, under SubjectPrefix); check reports it.
	SubjectFilter string
	// SubjectsHoldIDs: the subject template holds {aggregate_id}; trace
	// spans are then named after SubjectFilter, since one span name per
	// aggregate would flood a trace backend.
	SubjectsHoldIDs bool
	DuplicateWindow time.Duration // for a stream jetbox creates
	// StreamSpec: replicas, limits, storage and discard of a stream jetbox
	// creates, and which of them were given (compared with an existing one).
	StreamSpec     StreamSpec
	PublishTimeout time.Duration // how long to wait for one PubAck
	MaxPending     int           // async publishes in flight (the tracker's window)
	// MaxControlLine is the server's max_control_line (see SubjectLimit);
	// 0: DefaultMaxControlLine.
	MaxControlLine int
	// Delivery is the delivery mode (exactly-once, with or without atomic
	// transactions, or dedup, with or without the order guard); the zero
	// value is Dedup.
	Delivery Delivery
	// DeadLetterSubject: dead letters go to <DeadLetterSubject>.<reason>; the
	// stream must capture them too. "" when dead-lettering is off.
	DeadLetterSubject string
	// IndexScheme is decoder.Config.IndexScheme: when set, every message
	// carries it in Jetbox-Index-Scheme.
	IndexScheme string
	// Routing is decoder.Config.RoutingHeader: when set, every message
	// carries it in Jetbox-Routing.
	Routing string
	Metrics *metrics.Metrics
	// TracerProvider: one span per event (sink/trace.go); nil: no tracing.
	TracerProvider TracerProvider
}

// PermanentError is a publish failure that retrying cannot fix (the message is
// too large for the server or the stream, the stream is gone). Hint says
// what to do. It is jetbox's one shape of such an error (see internal/fault).
type PermanentError = fault.Permanent

// Publisher publishes to one stream over one NATS connection.
type Publisher struct {
	cfg   Config
	nc    *nats.Conn
	js    jetstream.JetStream
	log   zerolog.Logger
	stats struct{ published, duplicates, errors atomic.Uint64 }

	ackedSeq  atomic.Uint64 // highest stream sequence known to be jetbox's, in order: acked in order, or checked at a session open
	rmu       sync.Mutex
	replays   replays // what tells a replay from a repeated id (watermark.go)
	denyOnce  sync.Once
	denied    chan struct{} // closed on the first permissions violation for our subjects
	deniedErr error
	gone      chan struct{} // closed once the connection is CLOSED (see closedErr)

	// forgetThrough: messages up to this sequence belong to a WAL history
	// the server does not continue (see ForgetPositionsThrough).
	forgetThrough atomic.Uint64

	tipMu   sync.Mutex
	tipSeen tipSeen // how far Tip read the stream (history.go)

	forgetMu  sync.Mutex
	forgotten *forgotten // an accepted lost history (ForgetHistory)

	tracing *tracing // nil: off (sink/trace.go)
}

// New returns a publisher using nc, which the caller owns and closes.
func New(nc *nats.Conn, cfg Config, log zerolog.Logger) (*Publisher, error) {
	if cfg.PublishTimeout <= 0 {
		cfg.PublishTimeout = DefaultPublishTimeout
	}
	if cfg.MaxPending < 1 {
		cfg.MaxPending = DefaultMaxPending
	}
	if cfg.MaxControlLine <= 0 {
		cfg.MaxControlLine = DefaultMaxControlLine
	}
	if cfg.Metrics == nil {
		cfg.Metrics = metrics.New()
	}
	js, err := NewJetStream(nc, cfg.JSDomain,
		jetstream.WithPublishAsyncTimeout(cfg.PublishTimeout),
		// Above the tracker's window so the client's own stall never triggers.
		jetstream.WithPublishAsyncMaxPending(cfg.MaxPending*2+16),
	)
	if err != nil {
		return nil, fmt.Errorf("jetstream context: %w", err)
	}
	p := &Publisher{cfg: cfg, nc: nc, js: js, denied: make(chan struct{}), gone: make(chan struct{}), tracing: newTracing(cfg.TracerProvider, cfg.Stream, spanTemplate(cfg)),
		log: log.With().Str("component", "sink").Str("stream", cfg.Stream).Logger()}
	// nats.go does not fail pending async publishes when the connection
	// closes (only on a reconnect): watch fails them at once instead of
	// after --publish-timeout each.
	closed := nc.StatusChanged(nats.CLOSED)
	go func() {
		<-closed
		nc.RemoveStatusListener(closed)
		close(p.gone)
	}()
	if nc.IsClosed() { // closed before the listener was registered
		nc.RemoveStatusListener(closed)
	}
	return p, nil
}

// NewJetStream is a JetStream context on nc for domain ("" for the
// server's own JetStream).
func NewJetStream(nc *nats.Conn, domain string, opts ...jetstream.JetStreamOpt) (jetstream.JetStream, error) {
	if domain == "" {
		return jetstream.New(nc, opts...)
	}
	return jetstream.NewWithDomain(nc, domain, opts...)
}

// Closed is closed once the connection is CLOSED for good: nothing can be
// published any more (ClosedError says why).
func (p *Publisher) Closed() <-chan struct{} { return p.gone }

// ClosedError is the permanent error of a CLOSED connection (see Closed);
// nil while the connection is not closed.
func (p *Publisher) ClosedError() error {
	if !p.nc.IsClosed() {
		return nil
	}
	return p.closedErr(nats.ErrConnectionClosed)
}

// Connected reports whether the NATS connection is up (not reconnecting,
// not closed).
func (p *Publisher) Connected() bool { return p.nc.IsConnected() }

var deniedSubject = regexp.MustCompile(`Publish to "([^"]+)"`)

// NoteAsyncError takes the connection's asynchronous errors (give it to
// nats.ErrorHandler). The server answers a publish it does not permit with
// an error on the connection, never with a PubAck: a permissions violation
// for jetbox's subjects fails every pending publish at once, as a permanent
// error, instead of after --publish-timeout. (A denied JetStream API request
// fails on its own, as that request's error.)
func (p *Publisher) NoteAsyncError(err error) {
	if !errors.Is(err, nats.ErrPermissionViolation) {
		return
	}
	m := deniedSubject.FindStringSubmatch(err.Error())
	if m == nil {
		return
	}
	subj := m[1]
	ours := Captures([]string{p.cfg.SubjectPrefix + ".>"}, subj) ||
		(p.cfg.DeadLetterSubject != "" && Captures([]string{p.cfg.DeadLetterSubject + ".>"}, subj))
	if !ours {
		return
	}
	p.denyOnce.Do(func() {
		p.deniedErr = &PermanentError{Err: fmt.Errorf("NATS denies this user publishing to %s: %w", subj, err),
			Hint: fmt.Sprintf("grant publish permission on %s.> (and on the dead-letter subject), plus $JS.API.> for the stream API, then restart jetbox; nothing past the last stored event was confirmed", p.cfg.SubjectPrefix)}
		close(p.denied)
	})
}

// JetStream returns the publisher's JetStream handle.
func (p *Publisher) JetStream() jetstream.JetStream { return p.js }

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

// closedErr returns err as a permanent error when the connection is CLOSED:
// nats.go never reconnects from it, whatever MaxReconnects, so retrying
// would go on for ever. (The server closes a connection on some protocol
// errors, such as -ERR 'Maximum Control Line Exceeded'; nats.go closes it
// on an error it does not know.) Other errors are returned as they are.
func (p *Publisher) closedErr(err error) error {
	if err == nil || fault.Is(err) || !p.nc.IsClosed() {
		return err
	}
	return &PermanentError{Err: fmt.Errorf("the NATS connection is closed for good (the client's last error: %v), so nothing more can be published: %w", p.nc.LastError(), err),
		Hint: "see the NATS error jetbox logged before it and the server's log (\"maximum control line exceeded\": a subject over the server's max_control_line, so set --nats-max-control-line to the server's value), fix the cause and restart jetbox; nothing past the last stored event was confirmed, so a restart loses nothing"}
}

// MessageSize is MessageSize with this publisher's index scheme and
// routing: the decoder's size check (decoder.Config.Size).
func (p *Publisher) MessageSize(ev *decoder.Event) int {
	return MessageSize(ev, p.cfg.IndexScheme, p.cfg.Routing)
}

// SubjectLimit returns the longest subject a publish may carry: the
// server's max_control_line (Config.MaxControlLine; servers do not send
// theirs in INFO) less the reply subject and sizes that share the line. A
// longer subject makes the server close the connection for good; the
// decoder refuses it (decoder.Config.MaxSubjectLength).
func (p *Publisher) SubjectLimit() int { return p.cfg.MaxControlLine - controlLineReserve }

// noRetry is the publish option of a guarded or serial publish, built once
// (not per event): nats.go only reads it.
var noRetry = []jetstream.PublishOpt{jetstream.WithRetryAttempts(0)}

// txText is a transaction's header values, formatted once for all its rows.
type txText struct {
	lsn            pglogrepl.LSN
	time           time.Time
	lsnText, ctime string
}

// header returns ev's message headers: the row's own, jetbox's and the
// message id, with room for extra more. tx caches the strings of ev's
// transaction.
//
// No Nats-Expected-Stream: the server would scan for it in every message
// and store it with each. What it protected (an ack from another stream
// that took over the subjects) is checked on every PubAck's stream instead
// (see checkStream); resume checks at every session open that the stream
// still captures the subjects.
func (p *Publisher) header(ev *decoder.Event, tx *txText, extra int) nats.Header {
	n := 10 + len(ev.Headers)
	h := make(nats.Header, n+extra)
	p.fillHeader(h, make([]string, 0, n), ev, tx)
	return h
}

// fillHeader sets ev's headers (see header) in h, their values in vals'
// storage (one backing array, not a slice per value), and returns vals.
func (p *Publisher) fillHeader(h nats.Header, vals []string, ev *decoder.Event, tx *txText) []string {
	// Header keys are set canonical and directly (not through publish
	// options): the hot path then skips re-canonicalising every key.
	for _, uh := range ev.Headers {
		vals = setHeader(h, vals, uh.Key, uh.Value) // keep the producer's spelling (traceparent)
	}
	// One transaction's events share both (a repair's rows share a commit
	// LSN, each with its own time).
	if ev.CommitLSN != tx.lsn || tx.lsnText == "" || !ev.CommitTime.Equal(tx.time) {
		tx.lsn, tx.time, tx.lsnText, tx.ctime = ev.CommitLSN, ev.CommitTime, ev.CommitLSN.String(), ev.CommitTime.UTC().Format(format.CommitTimeLayout)
	}
	vals = setHeader(h, vals, format.HeaderAggregateType, ev.AggregateType)
	vals = setHeader(h, vals, format.HeaderAggregateID, ev.AggregateID)
	vals = setHeader(h, vals, format.HeaderEventType, ev.EventType)
	vals = setHeader(h, vals, format.HeaderCommitLSN, tx.lsnText)
	vals = setHeader(h, vals, format.HeaderCommitTime, tx.ctime)
	vals = setHeader(h, vals, format.HeaderTxIndex, strconv.Itoa(ev.TxIndex))
	if ev.Origin != "" {
		vals = setHeader(h, vals, format.HeaderSource, ev.Origin)
	}
	if p.cfg.IndexScheme != "" {
		vals = setHeader(h, vals, format.HeaderIndexScheme, p.cfg.IndexScheme)
	}
	if p.cfg.Routing != "" {
		vals = setHeader(h, vals, format.HeaderRouting, p.cfg.Routing)
	}
	return setHeader(h, vals, jetstream.MsgIDHeader, ev.ID)
}

// setHeader sets h[k] to the one value v, stored in vals: the slice is
// capped at it, so an append to one header never writes into the next.
func setHeader(h nats.Header, vals []string, k, v string) []string {
	vals = append(vals, v)
	h[k] = vals[len(vals)-1 : len(vals) : len(vals)]
	return vals
}

// checkStream reports an ack from another stream than jetbox's: one that
// took over the subjects stored the message (and jetbox's stream did not).
func (p *Publisher) checkStream(stream, subject string) error {
	if stream == p.cfg.Stream {
		return nil
	}
	return fmt.Errorf("the PubAck comes from stream %q, not %q: another stream captures %s (changed while jetbox ran?); the event is not confirmed", stream, p.cfg.Stream, subject)
}

func headerSize(h nats.Header) int {
	n := 12
	for k, vs := range h {
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
	}
	return n
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
