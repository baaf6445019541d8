package sink

// OpenTelemetry traces of publishing: one producer span per event, from the
// publish to its PubAck (or failure). Its parent is the row's traceparent
// (and tracestate) when the headers column has one, and the message's
// traceparent becomes the span's (W3C trace context), so a consumer's trace
// continues through jetbox. With Config.TracerProvider nil (the default)
// every hook is a nil check: nothing is allocated.

import (
	"context"
	"errors"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// TracerProvider makes the publisher's tracer (Config.TracerProvider).
type TracerProvider = trace.TracerProvider

// otelSpan is an event's span; nil when tracing is off.
type otelSpan = trace.Span

// TracerName is the instrumentation scope of jetbox's spans.
const TracerName = "github.com/jetbox-dev/jetbox/sink"

// Span attributes jetbox adds to the messaging conventions'.
const (
	AttrCommitLSN = attribute.Key("jetbox.commit_lsn")         // the transaction's commit LSN, X/X
	AttrTxIndex   = attribute.Key("jetbox.tx_index")           // the row's index in its transaction
	AttrStream    = attribute.Key("jetbox.stream")             // the JetStream stream
	AttrSeq       = attribute.Key("jetbox.stream_sequence")    // where JetStream stored it (or already had it)
	AttrOutcome   = attribute.Key("jetbox.outcome")            // published, duplicate or error
	AttrWALSent   = attribute.Key("jetbox.wal_sent_unix_nano") // when the walsender sent the row (its XLogData's send time)
)

// Outcomes (AttrOutcome).
const (
	OutcomePublished = "published"
	OutcomeDuplicate = "duplicate"
	OutcomeError     = "error"
)

// Span errors of atomic events refused before their batch (the error
// itself is returned to the caller).
var (
	errSpanTooLarge = errors.New("not published: the message is over the server's or the stream's size limit")
	errSpanClosed   = errors.New("not published: the session is closed")
	// errSpanAbandoned: a stop stopped waiting for the ack; the event is
	// not confirmed, the next session republishes it.
	errSpanAbandoned = errors.New("outcome unknown: the session was abandoned before its ack")
)

// tracing is the publisher's tracer; nil when tracing is off.
type tracing struct {
	tracer   trace.Tracer
	template string // names every span when set (see Config.SubjectsHoldIDs)
	prop     propagation.TextMapPropagator
	fields   []string // the headers prop reads (a row's trace context is one of them)
	server   atomic.Pointer[serverAttrs]
	attrs    []attribute.KeyValue // the same on every span
}

// spanTemplate is the subject filter spans are named after, or "" to
// name them after their subject.
func spanTemplate(cfg Config) string {
	if cfg.SubjectsHoldIDs {
		return cfg.SubjectFilter
	}
	return ""
}

func newTracing(cfg Config) *tracing {
	tp := cfg.TracerProvider
	if tp == nil {
		return nil
	}
	var prop propagation.TextMapPropagator = propagation.TraceContext{}
	if cfg.Propagator != nil {
		prop = cfg.Propagator
	}
	return &tracing{
		template: spanTemplate(cfg),
		tracer:   tp.Tracer(TracerName, trace.WithSchemaURL(semconv.SchemaURL)),
		prop:     prop,
		fields:   prop.Fields(),
		attrs: []attribute.KeyValue{
			semconv.MessagingSystemKey.String("nats"),
			semconv.MessagingOperationTypeSend,
			semconv.MessagingOperationName("publish"),
			AttrStream.String(cfg.Stream),
		},
	}
}

// serverAttrs are server.address and server.port of the server a URL
// names, computed once per connected URL.
type serverAttrs struct {
	url   string
	attrs []attribute.KeyValue
}

// serverOf returns the server attributes of the connection's current
// server (none when it is not connected).
func (t *tracing) serverOf(nc *nats.Conn) []attribute.KeyValue {
	if nc == nil {
		return nil
	}
	u := nc.ConnectedUrl()
	if s := t.server.Load(); s != nil && s.url == u {
		return s.attrs
	}
	s := &serverAttrs{url: u}
	if pu, err := url.Parse(u); err == nil && pu.Hostname() != "" {
		s.attrs = append(s.attrs, semconv.ServerAddress(pu.Hostname()))
		if port, err := strconv.Atoi(pu.Port()); err == nil {
			s.attrs = append(s.attrs, semconv.ServerPort(port))
		}
	}
	t.server.Store(s)
	return s.attrs
}

// startSpan starts ev's span and sets the message's traceparent (and
// tracestate) to it, replacing the row's. nil when tracing is off.
func (p *Publisher) startSpan(ev *decoder.Event, h nats.Header) trace.Span {
	t := p.tracing
	if t == nil {
		return nil
	}
	ctx := context.Background()
	if hasTraceContext(ev.Headers, t.fields) {
		ctx = t.prop.Extract(ctx, rowCarrier(ev.Headers))
	}
	lsn := ""
	if v := h[format.HeaderCommitLSN]; len(v) == 1 {
		lsn = v[0] // formatted once per transaction (txText)
	}
	server := t.serverOf(p.nc)
	attrs := make([]attribute.KeyValue, 0, len(t.attrs)+len(server)+7)
	attrs = append(attrs, t.attrs...)
	attrs = append(attrs, server...)
	attrs = append(attrs,
		semconv.MessagingDestinationName(ev.Subject),
		semconv.MessagingMessageID(ev.ID),
		semconv.MessagingMessageBodySize(len(ev.Payload)),
		AttrCommitLSN.String(lsn),
		AttrTxIndex.Int(ev.TxIndex),
	)
	// The messaging conventions' span name: "{operation} {destination}".
	name := "publish " + ev.Subject
	if t.template != "" {
		name = "publish " + t.template
		attrs = append(attrs, semconv.MessagingDestinationTemplate(t.template))
	}
	if !ev.WALSent.IsZero() {
		attrs = append(attrs, AttrWALSent.Int64(ev.WALSent.UnixNano()))
	}
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attrs...)}
	if !ev.Decoded.IsZero() {
		opts = append(opts, trace.WithTimestamp(ev.Decoded)) // from decode: the window's wait shows
	}
	ctx, span := t.tracer.Start(ctx, name, opts...)
	c := msgCarrier{h: h, row: ev.Headers}
	t.prop.Inject(ctx, c)
	if span.SpanContext().TraceState().Len() == 0 {
		c.drop("tracestate") // a row's tracestate without its traceparent belongs to no trace
	}
	return span
}

// endSpan ends span (nil: tracing is off) with the publish's outcome: err,
// or stored at seq (dup: JetStream already had it; seq 0: not known here).
func endSpan(span trace.Span, seq uint64, dup bool, err error) {
	if span == nil {
		return
	}
	if err != nil {
		span.SetAttributes(AttrOutcome.String(OutcomeError), semconv.ErrorType(err))
		span.SetStatus(codes.Error, err.Error())
		span.End()
		return
	}
	outcome := AttrOutcome.String(OutcomePublished)
	if dup {
		outcome = AttrOutcome.String(OutcomeDuplicate)
	}
	if seq > 0 { // 0: unknown here (atomic batches set it with setSpanSeq)
		span.SetAttributes(outcome, AttrSeq.Int64(int64(seq))) // one call: one copy of the span's attributes
	} else {
		span.SetAttributes(outcome)
	}
	span.End()
}

// traceDone returns done, ending span first (atomic sessions: the batch's
// outcome reaches each event through its done). Unchanged when span is nil.
func traceDone(span trace.Span, done func(error)) func(error) {
	if span == nil {
		return done
	}
	return func(err error) {
		endSpan(span, 0, false, err)
		done(err)
	}
}

// setSpanSeq records where an atomic batch stored the span's event.
func setSpanSeq(span trace.Span, seq uint64) {
	if span != nil {
		span.SetAttributes(AttrSeq.Int64(int64(seq)))
	}
}

// hasTraceContext reports whether the row carries one of the headers the
// propagator reads (fields: traceparent for W3C, b3 or X-B3-TraceId...).
func hasTraceContext(hs []decoder.Header, fields []string) bool {
	for _, h := range hs {
		for _, f := range fields {
			if strings.EqualFold(h.Key, f) {
				return true
			}
		}
	}
	return false
}

// rowCarrier reads the row's headers, whatever the key's case.
type rowCarrier []decoder.Header

func (c rowCarrier) Get(key string) string {
	for _, h := range c {
		if strings.EqualFold(h.Key, key) {
			return h.Value
		}
	}
	return ""
}

func (c rowCarrier) Set(string, string) {}

func (c rowCarrier) Keys() []string {
	keys := make([]string, len(c))
	for i, h := range c {
		keys[i] = h.Key
	}
	return keys
}

// msgCarrier sets the message's trace headers: the key as the W3C spec
// spells it (lowercase), replacing the row's in any case, so the message
// carries one traceparent.
type msgCarrier struct {
	h   nats.Header
	row []decoder.Header
}

func (c msgCarrier) Get(key string) string { return rowCarrier(c.row).Get(key) }

func (c msgCarrier) Set(key, value string) {
	for _, rh := range c.row {
		if rh.Key != key && strings.EqualFold(rh.Key, key) {
			delete(c.h, rh.Key)
		}
	}
	c.h[key] = []string{value}
}

// drop removes the row's key, in any case.
func (c msgCarrier) drop(key string) {
	for _, rh := range c.row {
		if strings.EqualFold(rh.Key, key) {
			delete(c.h, rh.Key)
		}
	}
}

func (c msgCarrier) Keys() []string {
	keys := make([]string, 0, len(c.h))
	for k := range c.h {
		keys = append(keys, k)
	}
	return keys
}
