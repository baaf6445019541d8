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
	"github.com/jetbox-dev/jetbox/internal/fault"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/metrics"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
)

// Header names jetbox sets on every message.
const (
	HeaderAggregateType = "Jetbox-Aggregate-Type"
	HeaderAggregateID   = "Jetbox-Aggregate-Id"
	HeaderEventType     = "Jetbox-Event-Type"
	HeaderCommitLSN     = "Jetbox-Commit-LSN"
	HeaderCommitTime    = "Jetbox-Commit-Time"
	HeaderTxIndex       = "Jetbox-Tx-Index"
	HeaderSource        = "Jetbox-Source" // <system id>/<timeline>/<database>/<slot>
)

// CommitTimeLayout is the format of Jetbox-Commit-Time: RFC 3339 in UTC with
// nanoseconds always printed, so the strings sort like the times.
const CommitTimeLayout = "2006-01-02T15:04:05.000000000Z07:00"

// Config configures publishing.
type Config struct {
	Stream        string // stream name, e.g. "OUTBOX"
	SubjectPrefix string // subjects are "<prefix>.>"
	// SubjectFilter matches every subject the subject template produces
	// (decoder.Template.Filter, under SubjectPrefix); check reports it.
	SubjectFilter   string
	DuplicateWindow time.Duration // for a stream jetbox creates
	PublishTimeout  time.Duration // how long to wait for one PubAck
	MaxPending      int           // async publishes in flight (the tracker's window)
	OrderGuard      bool          // set Nats-Expected-Last-Sequence (see package doc)
	// ExactlyOnce: jetbox is the stream's only writer; every publish expects
	// the stream's last sequence, and replayed events at or before the
	// stream's last message are skipped by position (see Open).
	ExactlyOnce bool
	// DeadLetterSubject: dead letters go to <DeadLetterSubject>.<reason>; the
	// stream must capture them too. "" when dead-lettering is off.
	DeadLetterSubject string
	// AtomicTransactions: each transaction is stored as JetStream atomic
	// batches (see AtomicSession); needs ExactlyOnce and a stream with
	// AllowAtomicPublish (nats-server 2.12 or later).
	AtomicTransactions bool
	Metrics            *metrics.Metrics
}

// PermanentError is a publish failure that retrying cannot fix (the message is
// too large for the server or the stream, the stream is gone). Hint says
// what to do. It is jetbox's one shape of such an error (see internal/fault).
type PermanentError = fault.Permanent

// Stats are cumulative publishing counters.
type Stats struct {
	Published  uint64 // stored by JetStream (new messages)
	Duplicates uint64 // acked as Duplicate: already stored, counted as success
	Errors     uint64 // failed or unknown outcome; the event is republished
}

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

	// forgetThrough: messages up to this sequence belong to a WAL history
	// the server does not continue (see ForgetPositionsThrough).
	forgetThrough atomic.Uint64
}

// New returns a publisher using nc, which the caller owns and closes.
func New(nc *nats.Conn, cfg Config, log zerolog.Logger) (*Publisher, error) {
	if cfg.PublishTimeout <= 0 {
		cfg.PublishTimeout = 30 * time.Second
	}
	if cfg.MaxPending < 1 {
		cfg.MaxPending = 1024
	}
	if cfg.Metrics == nil {
		cfg.Metrics = metrics.New()
	}
	js, err := jetstream.New(nc,
		jetstream.WithPublishAsyncTimeout(cfg.PublishTimeout),
		// Above the tracker's window so the client's own stall never triggers.
		jetstream.WithPublishAsyncMaxPending(cfg.MaxPending*2+16),
	)
	if err != nil {
		return nil, fmt.Errorf("jetstream context: %w", err)
	}
	return &Publisher{cfg: cfg, nc: nc, js: js, denied: make(chan struct{}),
		log: log.With().Str("component", "sink").Str("stream", cfg.Stream).Logger()}, nil
}

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

// Stats returns the counters so far.
func (p *Publisher) Stats() Stats {
	return Stats{Published: p.stats.published.Load(), Duplicates: p.stats.duplicates.Load(), Errors: p.stats.errors.Load()}
}

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

	stream jetstream.Stream
	source string // this writer's WAL history
	// idGuard: also expect the previous message's id (exactly-once, R1).
	idGuard bool
	lastID  string
	// watermark: position of the stream's last message when the session
	// opened, if jetbox wrote it from this source. A Duplicate PubAck at or
	// before it is a replay; one after it is checked against the original.
	watermark    Position
	hasWatermark bool
	// The previous message (the stream's last one when the session opened,
	// then the last published): the same id at another position is a
	// repeated id, refused before publishing (JetStream's order guard
	// cannot see it: the expected last id would match).
	prevID  string
	prevPos Position

	tx txText // the current transaction's header values, formatted once

	// serial (dedup mode with the order guard, no watermark): publish
	// unguarded, one at a time, until one is stored as new (package doc).
	serial     bool
	serialWait chan serialResult // the outcome of the publish in flight
	serialErr  error             // a serial publish failed: send nothing more

	// exactly-once mode
	nextSeq uint64   // the stream's last sequence before the next publish
	last    Position // position of the stream's last message
	skipped uint64
	repair  bool // opened by OpenRepair
}

// Position orders events along the stream: commit order, then the row's
// index in its transaction. It strictly increases from message to message.
type Position struct {
	CommitLSN uint64
	TxIndex   int
}

// Less reports whether p comes before q.
func (p Position) Less(q Position) bool {
	return p.CommitLSN < q.CommitLSN || (p.CommitLSN == q.CommitLSN && p.TxIndex < q.TxIndex)
}

// serialResult is the outcome of a serial publish, for the next Publish.
type serialResult struct {
	err    error  // not stored (or a repeated id)
	stored bool   // stored as a new message, at seq
	seq    uint64 // its stream sequence
}

type pendingAck struct {
	serial    chan<- serialResult // a serial publish: tell Publish its outcome
	guarded   bool                // sent with Nats-Expected-Last-Sequence: expect
	expect    uint64
	fut       jetstream.PubAckFuture
	done      func(error)
	committed time.Time
	id        string
	pos       Position
	size      int
}

// Open starts a session; Close it to wait for its acks. In exactly-once mode
// it first reads the stream's last message: its position is where this
// session resumes, and its sequence the base of the expected sequences.
//
// source identifies this writer's WAL history (see decoder.Event.Source):
// exactly-once mode refuses to resume after a message from another one.
func (p *Publisher) Open(ctx context.Context, source string) (*Session, error) {
	return p.open(ctx, source, false)
}

// open starts a session; repair: a jetbox repair session (see OpenRepair).
func (p *Publisher) open(ctx context.Context, source string, repair bool) (*Session, error) {
	s := &Session{p: p, pending: make(chan pendingAck, p.cfg.MaxPending+1), quit: make(chan struct{}), source: source, repair: repair}
	if err := s.resume(ctx); err != nil {
		return nil, err
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	s.loadWatermark(lctx, s.stream.CachedInfo().Config.Replicas)
	cancel()
	s.serial = !p.cfg.ExactlyOnce && p.cfg.OrderGuard && !s.hasWatermark && s.nextSeq > 0
	s.wg.Add(1)
	go s.watch()
	return s, nil
}

// ErrForeignMessage means the stream holds a message jetbox did not write,
// which exactly-once mode cannot order against.
var ErrForeignMessage = errors.New("the stream holds a message jetbox did not write")

// resume checks the stream still exists and captures jetbox's subjects (so
// a stream deleted or changed while jetbox runs stops it with a clear error
// rather than retrying forever), then reads the stream's last message: the
// watermark for duplicate checks and, in exactly-once mode, where to resume.
func (s *Session) resume(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	name := s.p.cfg.Stream
	st, err := s.p.js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return &PermanentError{Err: fmt.Errorf("stream %q does not exist (deleted while jetbox ran?)", name),
			Hint: "nothing past the last stored event was confirmed to Postgres: restart jetbox, which creates the stream again and resumes from the slot (or create it yourself first)"}
	}
	if err != nil {
		return fmt.Errorf("look up stream %q: %w", name, err)
	}
	s.stream = st
	info := st.CachedInfo()
	s.idGuard = s.p.cfg.ExactlyOnce && info.Config.Replicas <= 1
	for _, want := range []string{s.p.cfg.SubjectPrefix + ".>", s.p.cfg.DeadLetterSubject + ".>"} {
		if want != ".>" && !Captures(info.Config.Subjects, want) {
			return &PermanentError{Err: fmt.Errorf("stream %q has subjects %q, which no longer capture %q (changed while jetbox ran?)", name, info.Config.Subjects, want),
				Hint: fmt.Sprintf("add %q back to the stream's subjects (nats stream edit %s), then restart jetbox; nothing past the last stored event was confirmed", want, name)}
		}
	}
	s.nextSeq = info.State.LastSeq
	if s.nextSeq == 0 {
		return nil
	}
	m, err := st.GetMsg(ctx, s.nextSeq)
	if err != nil {
		if !s.p.cfg.ExactlyOnce {
			return nil // no watermark: every Duplicate PubAck is checked
		}
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return &PermanentError{Err: fmt.Errorf("exactly-once: the stream's last message (seq %d) is gone", s.nextSeq),
				Hint: "exactly-once mode resumes from the stream's last message: use a retention that keeps it (limits, no max-age shorter than an outage), or --delivery=dedup"}
		}
		return fmt.Errorf("exactly-once: read the stream's last message (seq %d): %w", s.nextSeq, err)
	}
	pos, ok := positionOf(m.Header)
	// The same system, database and slot: replication checked that the
	// server's timeline continues the stream's (see sameWriter), unless an
	// operator accepted a lost history.
	sameSource := sameWriter(m.Header.Get(HeaderSource), s.source) && s.nextSeq > s.p.forgetThrough.Load()
	s.prevID, s.prevPos = m.Header.Get(jetstream.MsgIDHeader), pos
	if !s.p.cfg.ExactlyOnce {
		// Without the order guard, rows after a refused one may be stored
		// before it is retried: no watermark, check every Duplicate.
		s.watermark, s.hasWatermark = pos, ok && sameSource && s.p.cfg.OrderGuard
		return nil
	}
	if !ok {
		return &PermanentError{Err: fmt.Errorf("exactly-once: %w (seq %d, subject %s)", ErrForeignMessage, s.nextSeq, m.Subject),
			Hint: "exactly-once mode needs jetbox to be the stream's only writer: stop the other publisher (or use --delivery=dedup), then restart jetbox"}
	}
	if s.repair {
		// jetbox repair starts the new slot's history: nothing of it is in
		// the stream yet, so nothing is skipped by position (after a rewind
		// or a lost tail the stream's positions may even sort after it).
		s.lastID = m.Header.Get(jetstream.MsgIDHeader)
		s.p.log.Info().Uint64("seq", s.nextSeq).Str("last_source", m.Header.Get(HeaderSource)).Msg("exactly-once repair: publishing the rows the stream misses, skipping nothing by position")
		return nil
	}
	if s.nextSeq <= s.p.forgetThrough.Load() {
		// An accepted lost history: its positions are not comparable.
		s.p.log.Warn().Uint64("seq", s.nextSeq).Msg("exactly-once: the stream's last message belongs to an abandoned WAL history: skipping nothing by position")
		return nil
	}
	if !sameSource {
		return &PermanentError{Err: fmt.Errorf("exactly-once: the stream's last message (seq %d) comes from %q, this jetbox reads %q", s.nextSeq, m.Header.Get(HeaderSource), s.source),
			Hint: "positions from another database, slot or cluster are not comparable: give each jetbox its own stream, or use --delivery=dedup"}
	}
	if err := s.checkSinceLastAck(ctx, st, s.nextSeq); err != nil {
		return err
	}
	// Every message up to the last is now known to be jetbox's, in order:
	// the next check starts after it. Otherwise stores whose acks a cut
	// lost, session after session, would add up to more than one session
	// has in flight and read as a foreign writer.
	s.p.raiseAcked(s.nextSeq)
	s.last, s.watermark, s.hasWatermark = pos, pos, true
	s.lastID = m.Header.Get(jetstream.MsgIDHeader)
	s.p.log.Info().Uint64("seq", s.nextSeq).Str("lsn", pglogrepl.LSN(pos.CommitLSN).String()).Int("tx_index", pos.TxIndex).
		Msg("exactly-once: resuming after the stream's last message")
	return nil
}

// checkSinceLastAck makes sure every message stored after the last one this
// process saw acked in order (no failure before it in its session) is
// jetbox's, from this source: a foreign message that slipped in after a
// refused publish would otherwise let a later one of ours match its
// expected sequence, and resuming after that one would skip the refused
// event. At most a window of our messages can be there.
func (s *Session) checkSinceLastAck(ctx context.Context, st jetstream.Stream, lastSeq uint64) error {
	acked := s.p.ackedSeq.Load()
	if acked == 0 || lastSeq <= acked {
		return nil
	}
	if lastSeq-acked > uint64(s.p.cfg.MaxPending)+16 {
		return &PermanentError{Err: fmt.Errorf("exactly-once: %w: %d messages were stored after jetbox's last acked one (seq %d), more than it had in flight", ErrForeignMessage, lastSeq-acked, acked),
			Hint: "exactly-once mode needs jetbox to be the stream's only writer: stop the other publisher (or use --delivery=dedup), then restart jetbox"}
	}
	check := func(seq uint64, subject string, h nats.Header) error {
		if _, ok := positionOf(h); !ok || !sameWriter(h.Get(HeaderSource), s.source) {
			return &PermanentError{Err: fmt.Errorf("exactly-once: %w (seq %d, subject %s, after jetbox's seq %d)", ErrForeignMessage, seq, subject, acked),
				Hint: "exactly-once mode needs jetbox to be the stream's only writer: stop the other publisher (or use --delivery=dedup), then restart jetbox"}
		}
		return nil
	}
	if lastSeq-acked < 2 {
		return nil
	}
	// One headers-only ordered consumer reads them in a few round trips (a
	// read per message costs one each: ~1,000 at 10 ms is over the limit).
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{
		DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: acked + 1, HeadersOnly: true,
		InactiveThreshold: 10 * time.Second})
	if err != nil {
		// E.g. a WorkQueue stream refusing a second consumer: one by one.
		s.p.log.Warn().Err(err).Msg("exactly-once: cannot read the stream with a consumer; reading messages one by one")
		for seq := acked + 1; seq < lastSeq; seq++ {
			m, err := st.GetMsg(ctx, seq)
			if errors.Is(err, jetstream.ErrMsgNotFound) {
				continue
			}
			if err != nil {
				return fmt.Errorf("exactly-once: read message seq %d: %w", seq, err)
			}
			if err := check(seq, m.Subject, m.Header); err != nil {
				return err
			}
		}
		return nil
	}
	defer func() { // its interest would hold messages of an Interest stream
		if info := cons.CachedInfo(); info != nil {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			defer cancel()
			_ = st.DeleteConsumer(dctx, info.Name)
		}
	}()
	for seq := acked; seq < lastSeq-1; {
		batch, err := cons.FetchNoWait(int(lastSeq - seq))
		if err != nil {
			return fmt.Errorf("exactly-once: read the messages after seq %d: %w", seq, err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			md, err := m.Metadata()
			if err != nil {
				return fmt.Errorf("exactly-once: read the messages after seq %d: %w", seq, err)
			}
			if seq = md.Sequence.Stream; seq >= lastSeq {
				break
			}
			if err := check(seq, m.Subject(), m.Headers()); err != nil {
				return err
			}
		}
		if err := batch.Error(); err != nil {
			return fmt.Errorf("exactly-once: read the messages after seq %d: %w", seq, err)
		}
		if n == 0 {
			break // the rest was removed meanwhile
		}
	}
	return nil
}

// raiseAcked moves ackedSeq up to seq (never down).
func (p *Publisher) raiseAcked(seq uint64) {
	for {
		cur := p.ackedSeq.Load()
		if seq <= cur || p.ackedSeq.CompareAndSwap(cur, seq) {
			return
		}
	}
}

func positionOf(h nats.Header) (Position, bool) {
	lsn, err := pglogrepl.ParseLSN(h.Get(HeaderCommitLSN))
	if err != nil || h.Get(HeaderCommitLSN) == "" {
		return Position{}, false
	}
	idx, err := strconv.Atoi(h.Get(HeaderTxIndex))
	if err != nil {
		return Position{}, false
	}
	return Position{CommitLSN: uint64(lsn), TxIndex: idx}, true
}

// Publish sends ev asynchronously. done is called exactly once, with nil when
// JetStream stored the message (or already had it), unless the session is
// abandoned by a Close whose ctx expired. An error returned here means the
// message was not sent and done will not be called.
func (s *Session) Publish(ev *decoder.Event, done func(error)) error {
	if s.p.cfg.ExactlyOnce && s.nextSeq > 0 && !s.last.Less(Position{CommitLSN: uint64(ev.CommitLSN), TxIndex: ev.TxIndex}) {
		// A replay of an event the stream already holds (at or before its last message).
		s.skipped++
		s.p.stats.duplicates.Add(1)
		s.p.cfg.Metrics.Duplicates.Inc()
		done(nil)
		return nil
	}
	pos := Position{CommitLSN: uint64(ev.CommitLSN), TxIndex: ev.TxIndex}
	if ev.ID == s.prevID && pos != s.prevPos {
		return &decoder.InvalidEventError{ID: ev.ID, LSN: ev.CommitLSN, TxIndex: ev.TxIndex, Code: decoder.ReasonDuplicateID, Column: "id",
			Reason: fmt.Sprintf("the id repeats the previous row's (transaction %s, row %d) inside the duplicate window: JetStream would drop this row silently", pglogrepl.LSN(s.prevPos.CommitLSN), s.prevPos.TxIndex),
			Hint:   duplicateHint}
	}
	h := s.p.header(ev, &s.tx, 2)
	var opts []jetstream.PublishOpt
	// A replay of what the stream held when the session opened goes without
	// an expected sequence: it is a Duplicate and stores nothing.
	guarded := (s.p.cfg.ExactlyOnce || s.p.cfg.OrderGuard) && !(s.hasWatermark && !s.watermark.Less(pos))
	var serial chan serialResult
	if guarded && s.serial {
		if err := s.waitSerial(); err != nil {
			return err
		}
		if s.serial {
			guarded, serial = false, make(chan serialResult, 1)
			opts = append(opts, jetstream.WithRetryAttempts(0))
		}
	}
	if guarded {
		// Pipelined: the k-th message in flight expects base+k-1. A
		// Duplicate PubAck after the watermark stores nothing, so the
		// messages after it are refused and republished by a new session.
		h[jetstream.ExpectedLastSeqHeader] = []string{strconv.FormatUint(s.nextSeq, 10)}
		opts = append(opts, jetstream.WithRetryAttempts(0))
		if s.idGuard && s.lastID != "" {
			h[jetstream.ExpectedLastMsgIDHeader] = []string{s.lastID}
		}
	}
	msg := &nats.Msg{Subject: ev.Subject, Data: ev.Payload, Header: h}
	fut, err := s.p.js.PublishMsgAsync(msg, opts...)
	if err != nil {
		s.p.stats.errors.Add(1)
		s.p.cfg.Metrics.PublishErrors.Inc()
		if errors.Is(err, nats.ErrMaxPayload) {
			return tooLarge(ev.ID, ev.CommitLSN, ev.TxIndex, fmt.Sprintf("message of %d bytes (payload %d) is over the server's max_payload of %d bytes", len(msg.Data)+headerSize(msg.Header), len(ev.Payload), s.p.nc.MaxPayload()))
		}
		return fmt.Errorf("publish to %s: %w", ev.Subject, err)
	}
	s.prevID, s.prevPos, s.lastID = ev.ID, pos, ev.ID
	if guarded {
		s.nextSeq++
	}
	if serial != nil {
		s.serialWait = serial
	}
	s.pending <- pendingAck{serial: serial, guarded: guarded, expect: s.nextSeq - 1, fut: fut, done: done, committed: ev.CommitTime, id: ev.ID, pos: pos, size: len(ev.Payload)}
	return nil
}

// waitSerial waits for the outcome of the serial publish in flight: once one
// is stored as a new message the session turns pipelined and guarded, with
// that message's sequence as the stream's last. After a failure nothing more
// is sent (the next could be stored after a gap).
func (s *Session) waitSerial() error {
	if s.serialErr == nil && s.serialWait != nil {
		select {
		case r := <-s.serialWait:
			s.serialErr = r.err
			if r.err == nil && r.stored {
				s.serial, s.nextSeq = false, r.seq
			}
		case <-s.quit:
			s.serialErr = errors.New("the session was closed")
		}
		s.serialWait = nil
	}
	if s.serialErr != nil {
		return fmt.Errorf("not sent: an earlier publish of this session failed (%v); it is republished in order", s.serialErr)
	}
	return nil
}

// txText is a transaction's header values, formatted once for all its rows.
type txText struct {
	lsn            pglogrepl.LSN
	lsnText, ctime string
}

// header returns ev's message headers: the row's own, jetbox's, the message
// id and the expected stream, with room for extra more. tx caches the
// strings of ev's transaction.
func (p *Publisher) header(ev *decoder.Event, tx *txText, extra int) nats.Header {
	// Header keys are set canonical and directly (not through publish
	// options): the hot path then skips re-canonicalising every key.
	h := make(nats.Header, 10+extra+len(ev.Headers))
	for _, uh := range ev.Headers {
		h[uh.Key] = []string{uh.Value} // keep the producer's spelling (traceparent)
	}
	if ev.CommitLSN != tx.lsn || tx.lsnText == "" {
		tx.lsn, tx.lsnText, tx.ctime = ev.CommitLSN, ev.CommitLSN.String(), ev.CommitTime.UTC().Format(CommitTimeLayout)
	}
	h[HeaderAggregateType] = []string{ev.AggregateType}
	h[HeaderAggregateID] = []string{ev.AggregateID}
	h[HeaderEventType] = []string{ev.EventType}
	h[HeaderCommitLSN] = []string{tx.lsnText}
	h[HeaderCommitTime] = []string{tx.ctime}
	h[HeaderTxIndex] = []string{strconv.Itoa(ev.TxIndex)}
	if ev.Source != "" {
		h[HeaderSource] = []string{ev.Source}
	}
	h[jetstream.MsgIDHeader] = []string{ev.ID}
	// An ack from another stream that took over the subjects is an error.
	h[jetstream.ExpectedStreamHeader] = []string{p.cfg.Stream}
	return h
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

// tooLarge is the invalid-row error of a message the server or stream refuses for its size.
func tooLarge(id string, lsn pglogrepl.LSN, txIndex int, what string) *decoder.InvalidEventError {
	return &decoder.InvalidEventError{ID: id, LSN: lsn, TxIndex: txIndex, Code: decoder.ReasonTooLarge, Column: "payload", Reason: what,
		Hint: "raise max_payload on the NATS server (and the stream's max_msg_size), or keep outbox payloads smaller (e.g. a CHECK on octet_length(payload)); or run with --on-invalid=dead-letter"}
}

func (s *Session) watch() {
	defer s.wg.Done()
	defer s.cancel()
	m := s.p.cfg.Metrics
	// broken: a guarded publish of this session failed or was not found
	// where the pipeline expected it, so the expected sequences after it
	// are off by one and a later publish can only be stored after a
	// message jetbox did not send: acks after it do not move ackedSeq (see
	// checkSinceLastAck). A replay sent unguarded shifts nothing.
	broken := false
	// ready: resolved events whose done waits for the watermark to cover
	// them (it is stored first, see flush); frozen: a failure in this
	// session, the watermark stays before it.
	var ready []readyAck
	frozen := false
	flush := func() {
		if len(ready) == 0 {
			return
		}
		var err error
		if !frozen {
			seq := uint64(0)
			for _, r := range ready {
				seq = max(seq, r.seq)
			}
			if err = s.advance(ready[len(ready)-1].pa.pos, seq); err != nil {
				frozen = true
				s.p.log.Warn().Err(err).Msg("events stored, but not confirmed until republished")
			}
		}
		for _, r := range ready {
			r.pa.done(err)
			if err != nil {
				r.pa.report(serialResult{err: err})
			} else {
				r.pa.report(serialResult{stored: !r.dup, seq: r.seq})
			}
		}
		ready = ready[:0]
	}
	fail := func(pa pendingAck, err error) {
		flush()
		frozen = true
		s.p.stats.errors.Add(1)
		m.PublishErrors.Inc()
		pa.done(err)
		pa.report(serialResult{err: err})
	}
	defer flush()
	for {
		var pa pendingAck
		var more bool
		select {
		case pa, more = <-s.pending:
		default:
			flush() // nothing more in flight now
			pa, more = <-s.pending
		}
		if !more {
			return
		}
		var ack *jetstream.PubAck
		var perr error
		select {
		case ack = <-pa.fut.Ok():
		case perr = <-pa.fut.Err():
		default:
			flush() // nothing more to resolve now: let the resolved ones go
			select {
			case ack = <-pa.fut.Ok():
			case perr = <-pa.fut.Err():
			case <-s.p.denied:
				perr = s.p.deniedErr
			case <-s.quit:
				ready = nil // abandoned
				return
			}
		}
		if perr != nil {
			broken = true
			if perr != s.p.deniedErr {
				perr = s.p.classify(pa, perr)
			}
			fail(pa, perr)
			continue
		}
		if ack.Duplicate {
			same, err := s.checkDuplicate(pa, ack.Sequence)
			if pa.guarded {
				// The very row, stored at the sequence this publish
				// expected (an earlier attempt stored late): the
				// pipeline is still in order.
				if same && ack.Sequence == pa.expect+1 {
					if !broken {
						s.p.raiseAcked(ack.Sequence)
					}
				} else {
					broken = true
				}
			}
			if err != nil {
				fail(pa, err)
				continue
			}
			s.p.stats.duplicates.Add(1)
			m.Duplicates.Inc()
		} else {
			if !broken {
				s.p.raiseAcked(ack.Sequence)
			}
			if s.p.guarded() {
				s.p.claim(ack.Sequence, pa.pos)
			}
			s.p.stats.published.Add(1)
			m.Published.Inc()
			m.Latency.Observe(time.Since(pa.committed).Seconds())
		}
		ready = append(ready, readyAck{pa: pa, seq: ack.Sequence, dup: ack.Duplicate})
		if pa.serial != nil || len(ready) >= 1024 {
			flush() // a Publish waits for it
		}
	}
}

type readyAck struct {
	pa  pendingAck
	seq uint64
	dup bool
}

// report tells a waiting Publish the outcome of a serial publish.
func (pa pendingAck) report(r serialResult) {
	if pa.serial != nil {
		pa.serial <- r
	}
}

func (p *Publisher) classify(pa pendingAck, err error) error {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamMessageExceedsMaximum {
		return tooLarge(pa.id, pglogrepl.LSN(pa.pos.CommitLSN), pa.pos.TxIndex,
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
	if s.hasWatermark && !s.watermark.Less(pa.pos) {
		return false, nil
	}
	ctx, cancel := context.WithTimeout(s.ctx, s.p.cfg.PublishTimeout)
	defer cancel()
	orig, err := s.stream.GetMsg(ctx, seq)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		if s.provenReplay(pa.pos, seq) {
			return false, nil
		}
		return false, &decoder.InvalidEventError{ID: pa.id, LSN: pglogrepl.LSN(pa.pos.CommitLSN), TxIndex: pa.pos.TxIndex, Code: decoder.ReasonDuplicateID, Column: "id",
			Reason: fmt.Sprintf("the id is already used by stream message seq %d inside the duplicate window, which is no longer in the stream (removed by retention or a purge) and is not this row by jetbox's watermark: JetStream would drop this row silently", seq),
			Hint:   duplicateHint}
	}
	if err != nil {
		return false, fmt.Errorf("read message seq %d to check a Duplicate PubAck for id %s: %w", seq, pa.id, err)
	}
	op, ok := positionOf(orig.Header)
	if ok && op == pa.pos {
		return true, nil // the same row, stored before
	}
	what := fmt.Sprintf("stream message seq %d (not written by jetbox)", seq)
	if ok {
		what = fmt.Sprintf("stream message seq %d (transaction %s, row %d)", seq, pglogrepl.LSN(op.CommitLSN), op.TxIndex)
	}
	return false, &decoder.InvalidEventError{ID: pa.id, LSN: pglogrepl.LSN(pa.pos.CommitLSN), TxIndex: pa.pos.TxIndex, Code: decoder.ReasonDuplicateID, Column: "id",
		Reason: "the id is already used by " + what + " inside the duplicate window: JetStream would drop this row silently",
		Hint:   duplicateHint}
}

const duplicateHint = "give every outbox row a unique id (the default gen_random_uuid()); run with --on-invalid=dead-letter to send this row to the dead-letter subject"

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
