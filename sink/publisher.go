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
	"errors"
	"fmt"
	"regexp"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jetbox-dev/jetbox/internal/fault"
	"go.opentelemetry.io/otel/propagation"

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
	// Propagator reads a row's trace context and writes the span's into
	// the message (OTEL_PROPAGATORS); nil: W3C trace context.
	Propagator propagation.TextMapPropagator
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
	p := &Publisher{cfg: cfg, nc: nc, js: js, denied: make(chan struct{}), gone: make(chan struct{}), tracing: newTracing(cfg),
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
